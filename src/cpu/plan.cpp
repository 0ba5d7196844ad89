#include "cpu/plan.h"

#include "common/loss_terms.h"
#include "common/score_codes.h"
#include "cpu/operands.h"

#include <omp.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>

namespace flce::cpu {

std::string pick_gemm(const RunConfig& config, Dtype storage, const GemmEngine** engine) {
  if (!config.gemm.empty()) {
    *engine = find_gemm_engine(config.gemm);
    if (*engine == nullptr) {
      std::string names;
      for (const GemmEngine* e : gemm_engines()) names += (names.empty() ? "" : ", ") + std::string(e->name());
      return "gemm = '" + config.gemm + "' is not a GEMM engine compiled into this build (available: " +
             names + ")" + (config.gemm == "cublas" ? "; cublas is the cuda backend's" : "");
    }
    return "";
  }
  // bf16 storage prefers an engine with native bf16; any other converts to f32.
  *engine = storage == Dtype::bf16 ? default_gemm_engine(Dtype::bf16) : nullptr;
  if (*engine == nullptr) *engine = default_gemm_engine(Dtype::f32);
  return "";
}

namespace {

// FLCE_CPU_SCORE_MIB in [1, 4096], or 0 when unset or invalid.
int64_t score_mib_from_env() {
  const char* env = std::getenv("FLCE_CPU_SCORE_MIB");
  if (env == nullptr) return 0;
  char* end = nullptr;
  const long mib = std::strtol(env, &end, 10);
  return *env != '\0' && *end == '\0' && mib >= 1 && mib <= 4096 ? mib : 0;
}

int64_t score_budget_bytes() {
  const int64_t mib = score_mib_from_env();
  return mib > 0 ? mib << 20 : kScoreBudgetBytes;
}

// FLCE_CPU_GRAD_ORDER: "rows", "vocab", "vocab:RxT" (super-blocks of R
// rows, chunks of T tiles), or unset: the plan's own choice.
struct ForcedOrder {
  bool set = false, valid = true, vocab = false;
  int64_t rows = 0, chunk_tiles = 0;  // 0: the plan's cut
};

ForcedOrder forced_order() {
  ForcedOrder f;
  const char* env = std::getenv("FLCE_CPU_GRAD_ORDER");
  if (env == nullptr) return f;
  f.set = true;
  const std::string v = env;
  if (v == "rows" || v == "vocab") {
    f.vocab = v == "vocab";
    return f;
  }
  long long rows = 0, tiles = 0;
  char tail = 0;
  f.vocab = true;
  f.valid = std::sscanf(v.c_str(), "vocab:%lldx%lld%c", &rows, &tiles, &tail) == 2 && rows >= 1 &&
            tiles >= 1 && rows <= (int64_t(1) << 30) && tiles <= (int64_t(1) << 30);
  f.rows = rows, f.chunk_tiles = tiles;
  return f;
}

// The cut of the vocabulary-outer order: super-blocks of `rows` rows, in
// whole forward pieces of kMaxRowBlock unless one holds all N, and chunks of
// `chunk_tiles` tiles, with the fewest bytes of grad_W and grad_x traffic
// whose scores and per-row [R, H] buffers fit the budget.
struct VocabOuterCut {
  int64_t rows = 0, chunk_tiles = 0;
  double traffic = 0;  // bytes
};

// f32 grad_W [V, H] is written by the first block and read and written by
// each later one; f32 grad_x [R, H] likewise per vocab chunk.
double accumulator_traffic(double elements, int64_t passes) { return 4 * elements * double(2 * passes - 1); }

// `score_bytes`: the workspace a score of the chunk takes (4 for its f32,
// plus 2 where each tile has a bf16 copy of its G).
VocabOuterCut cut_vocab_outer(const Dims& d, int64_t tiles, int64_t row_bytes, int64_t score_bytes,
                              int64_t budget) {
  VocabOuterCut best;
  for (int64_t r = kMaxRowBlock;; r += kMaxRowBlock) {
    const int64_t rows = std::min(r, d.n);
    const int64_t room = budget / rows - row_bytes;  // per row, for scores
    const int64_t chunk = std::min(room / (score_bytes * kVocabTile), tiles);
    if (chunk < 1) break;  // more rows fit even fewer scores
    const int64_t blocks = (d.n + rows - 1) / rows, chunks = (tiles + chunk - 1) / chunk;
    const double traffic = accumulator_traffic(double(d.v) * double(d.h), blocks) +
                           accumulator_traffic(double(d.n) * double(d.h), chunks);
    if (best.rows == 0 || traffic < best.traffic) best = {rows, chunk, traffic};
    if (rows == d.n) break;
  }
  return best;
}

// FLCE_CPU_STASH: "0" (vocab outer computes the logits twice), "1", or
// unset: scores stashed wherever Plan::stash_scores applies.
const char* stash_env() { return std::getenv("FLCE_CPU_STASH"); }

bool dense(const Tensor& t) { return t.stride[1] == 1 && t.stride[0] == t.shape[1]; }

// Whether a vocab-outer pass with super-blocks of `rows` rows can keep its
// scores in grad_W's memory (Plan::stash_scores).
bool stashable(const Problem& p, const Plan& plan, int64_t rows, bool no_stats) {
  const char* env = stash_env();
  if (no_stats || !p.grad_w.present() || !dense(p.grad_w) || (env && std::string(env) == "0")) return false;
  const bool fits = 4 * rows <= plan.d.h * int64_t(dtype_size(p.grad_w.dtype));
  const bool in_place_ok = p.w_layout == WeightLayout::vh && rows >= plan.d.n;
  return fits && (!plan.grad_w_in_place || in_place_ok);
}

// Whether the gradient pass copies each tile's bf16 G (Workspace::g16_tiles)
// for grad_W's product or grad_x's (Plan::grad_x_by_tile).
bool g16_copies(const Plan& plan, const Problem& p) {
  const bool grads = plan.pass != Pass::forward && !plan.d.logits_entry;
  return grads && plan.grad_gemm == Dtype::bf16 && (p.grad_w.present() || plan.grad_x_by_tile);
}

// Whether a training step or backward takes the vocabulary-outer order
// (Plan), and its cut. Rows outer stays where one block holds every row
// (nothing to save), for the logits entry (no GEMMs) and with the gradient
// filter, which skips [row block x tile] blocks and so wants short blocks.
void choose_grad_order(const Problem& p, Plan* plan) {
  const Dims& d = plan->d;
  const bool grads = plan->pass != Pass::forward && (p.grad_x.present() || p.grad_w.present());
  ForcedOrder forced = forced_order();
  if (!forced.valid) forced = ForcedOrder{};  // run() refuses it (check_tuning_env); size as unset
  if (!grads || d.logits_entry || plan->filter || (forced.set && !forced.vocab)) return;
  const bool no_stats = plan->pass == Pass::backward && !p.grad_entropy.present();
  const int64_t x_bytes = int64_t(dtype_size(plan->logits_gemm)) +
                          (plan->grad_gemm != plan->logits_gemm ? int64_t(dtype_size(plan->grad_gemm)) : 0);
  // Per row: x, grad_x and row scalars; per score, its f32 and each tile's
  // bf16 copy of G (Workspace::g16_tiles, [R, kVocabTile] a tile of the
  // chunk). Nothing here depends on the thread count: R is the K of grad_W's
  // products and the chunk decides which tiles share a grad_x product, so
  // the bits would.
  const int64_t row_bytes = d.h * (x_bytes + 4) + int64_t(sizeof(RowInfo));
  const int64_t score_bytes = 4 + (g16_copies(*plan, p) ? 2 : 0);
  const VocabOuterCut cut =
      forced.rows > 0 ? VocabOuterCut{std::min(forced.rows, d.n), std::min(forced.chunk_tiles, plan->tiles), 0}
                      : cut_vocab_outer(d, plan->tiles, row_bytes, score_bytes, score_budget_bytes());
  if (cut.rows == 0) return;  // not even one piece and one tile fit the budget
  // Stashed, vocab outer costs three GEMMs, as rows outer does, with no
  // grad_W accumulator traffic when one super-block holds every row.
  const bool stash = stashable(p, *plan, cut.rows, no_stats);
  const bool pays = plan->row_block < kVocabOuterBelowRows || no_stats ||  // Plan::stats_from_inputs
                    (stash && cut.rows >= d.n);
  if (!forced.vocab && !(pays && plan->row_block < d.n)) return;
  plan->vocab_outer = true;
  plan->stash_scores = stash;
  plan->stash_rows = stash ? cut.rows : 0;
  plan->stats_from_inputs = no_stats;
  plan->row_block = cut.rows;
  plan->chunk_tiles = cut.chunk_tiles;
  if (stash && forced.chunk_tiles == 0)  // a copy's target only: kStashChunkBytes will do
    plan->chunk_tiles = std::clamp<int64_t>(kStashChunkBytes / (cut.rows * 4 * kVocabTile), 1, cut.chunk_tiles);
}

// A row of `cols` elements, `per_line` of them to a 64-byte line, padded to
// an odd number of whole lines (Plan::scores_ld).
int64_t padded_row(int64_t cols, int64_t per_line) {
  const int64_t lines = (cols + per_line - 1) / per_line;
  return per_line * (lines % 2 == 1 ? lines : lines + 1);
}

// FLCE_CPU_PACK_SCORES: "0" (f32 scores), "1", or unset: packed wherever
// Plan::packed_scores applies.
const char* pack_scores_env() { return std::getenv("FLCE_CPU_PACK_SCORES"); }

// Whether a pass may keep its scores packed (Plan::packed_scores), before
// the order is chosen: a gradient pass of the head whose G goes to the
// GEMMs in bf16 anyway, with nothing that reads the f32 scores or G
// elsewhere (grad_logits), and a kernel set that packs.
bool packable(const Problem& p, const Plan& plan) {
  const char* env = pack_scores_env();
  return plan.pass != Pass::forward && !plan.d.logits_entry && plan.grad_gemm == Dtype::bf16 &&
         !p.grad_logits.present() && plan.kernels->pack_scores != nullptr &&
         codes_hold_softcap(p.options.softcap) &&
         !(env != nullptr && std::string(env) == "0");
}

// FLCE_CPU_GRAD_X_SPLIT: "vocab", "hidden", "tile" (Plan::grad_x_by_tile,
// where it applies), or unset: the plan's choice.
const char* forced_grad_x_split() { return std::getenv("FLCE_CPU_GRAD_X_SPLIT"); }

// Plan::grad_x_vocab_split: rows outer with grad_x and H up to
// kVocabSplitMaxHidden (the parts then take at most 4 R H floats: 1 MiB, 2
// MiB with packed scores' R of up to 512).
bool grad_x_vocab_split(const Problem& p, const Plan& plan) {
  const bool grad_x = plan.pass != Pass::forward && p.grad_x.present() && !plan.d.logits_entry;
  if (!grad_x || plan.vocab_outer) return false;
  if (const char* forced = forced_grad_x_split()) return std::string(forced) == "vocab";
  return plan.d.h <= kVocabSplitMaxHidden;
}

// Plan::grad_x_by_tile: rows outer with grad_x and bf16 G, where the
// engine's bf16 runs on a matrix unit or FLCE_CPU_GRAD_X_SPLIT=tile.
bool grad_x_by_tile(const Problem& p, const Plan& plan) {
  const bool grad_x = plan.pass != Pass::forward && p.grad_x.present() && !plan.d.logits_entry;
  if (!grad_x || plan.vocab_outer || plan.grad_gemm != Dtype::bf16) return false;
  if (const char* forced = forced_grad_x_split()) return std::string(forced) == "tile";
  return plan.gemm->bf16_on_matrix_unit();
}

}  // namespace

std::string check_tuning_env() {
  const char* env = std::getenv("FLCE_CPU_SCORE_MIB");
  if (env != nullptr && score_mib_from_env() == 0)
    return "FLCE_CPU_SCORE_MIB = '" + std::string(env) + "': must be a whole number of MiB in [1, 4096]";
  const char* pack = pack_scores_env();
  if (pack != nullptr && std::string(pack) != "0" && std::string(pack) != "1")
    return "FLCE_CPU_PACK_SCORES = '" + std::string(pack) +
           "': must be 0 (f32 scores) or 1 (16-bit where it applies; unset: the same)";
  const char* stash = stash_env();
  if (stash != nullptr && std::string(stash) != "0" && std::string(stash) != "1")
    return "FLCE_CPU_STASH = '" + std::string(stash) +
           "': must be 0 (vocab outer computes the logits twice) or 1 (scores kept in grad_W's "
           "memory where that applies; unset: the same)";
  const char* split = forced_grad_x_split();
  if (split != nullptr && std::string(split) != "vocab" && std::string(split) != "hidden" &&
      std::string(split) != "tile")
    return "FLCE_CPU_GRAD_X_SPLIT = '" + std::string(split) +
           "': must be vocab, hidden or tile (unset: chosen by the problem)";
  if (!forced_order().valid)
    return "FLCE_CPU_GRAD_ORDER = '" + std::string(std::getenv("FLCE_CPU_GRAD_ORDER")) +
           "': must be rows, vocab or vocab:RxT (R rows per super-block, T tiles per chunk; unset: "
           "chosen by the problem)";
  return "";
}

Plan make_plan(const Problem& p, Pass pass, const RunConfig& config) {
  Plan plan;
  plan.d = dims_of(p);
  plan.pass = pass;
  // At most as many threads as a loop has iterations (classes, rows, the
  // grad_x tasks): each gets scratch, and --threads 4096 on a problem of 12
  // classes asked for 2 GB of it. The bits do not depend on the count.
  const int asked = config.threads > 0 ? config.threads : omp_get_max_threads();
  plan.threads = int(std::min<int64_t>(asked, std::max({plan.d.v, plan.d.n, 2 * kGradXTasks})));
  plan.storage = plan.d.logits_entry ? p.logits.dtype : p.x.dtype;
  // An unknown engine name is reported by config_error(); plan with the default.
  if (!pick_gemm(config, plan.storage, &plan.gemm).empty()) plan.gemm = default_gemm_engine(Dtype::f32);
  plan.kernels = &simd::best_kernels();
  const bool bf16 = plan.storage == Dtype::bf16 && plan.gemm->supports(Dtype::bf16);
  plan.logits_gemm = bf16 ? Dtype::bf16 : Dtype::f32;
  const bool storage_grads = p.options.grad_logits_dtype == GradLogitsDtype::storage;
  plan.grad_gemm = bf16 && storage_grads ? Dtype::bf16 : Dtype::f32;
  // In place as a GEMM's output: its leading dimension must fit the GEMMs' int.
  plan.grad_w_in_place = p.grad_w.present() && p.grad_w.dtype == Dtype::f32 &&
                         p.grad_w.stride[1] == 1 && p.grad_w.stride[0] <= INT_MAX;

  const bool grads = pass != Pass::forward && (p.grad_x.present() || p.grad_w.present());
  // flce's short-k kernels beat the engines' grad_W products on AVX-512
  // (steps.cpp, grad_w_gemm), but not a matrix unit: on a 2-core Xeon with
  // AMX (bench/gemm_engines.cpp, [512, H] tiles, H = 768 and 4096, k = 192
  // and 496) oneDNN's bf16 ran 850-1150 GFLOP/s, gemm_tn_bf16 207-217.
  const bool has_gemm_tn = plan.grad_gemm == Dtype::f32
                               ? plan.kernels->gemm_tn != nullptr
                               : plan.kernels->gemm_tn_bf16 != nullptr && !plan.gemm->bf16_on_matrix_unit();
  plan.grad_w_gemm_tn = pass != Pass::forward && p.grad_w.present() && !plan.d.logits_entry && has_gemm_tn;
  plan.filter_eps = filter_eps_for(p.options, plan.storage);
  plan.filter = grads && !plan.d.logits_entry && plan.filter_eps > 0 &&
                !(p.options.softcap > 0 && p.options.label_smoothing > 0);
  plan.filter_uniform = plan.filter && p.options.label_smoothing > 0;
  // G converted to bf16 for the GEMMs is rounded there, once (nearest even):
  // rounding the f32 G first changes no bit, so it is left out where nothing
  // else reads the f32 G (the filter, grad_logits, grad_bias).
  const bool only_bf16_reads_g = plan.grad_gemm == Dtype::bf16 && !plan.d.logits_entry &&
                                 !plan.filter && !p.grad_logits.present() && !p.grad_bias.present();
  plan.round_grad_logits = storage_grads && plan.storage != Dtype::f32 && !only_bf16_reads_g;
  plan.flush_subnormal_g = grads && !plan.d.logits_entry && plan.grad_gemm == Dtype::f32;

  const bool moments = p.entropy.present() || p.grad_entropy.present() ||
                       p.options.label_smoothing > 0;
  plan.softmax_extras = (moments ? simd::kSoftmaxMoments : 0u) |
                        (p.argmax.present() ? simd::kSoftmaxArgmax : 0u);

  const int64_t V = plan.d.v;
  const bool pack = packable(p, plan);
  const int64_t fit = score_budget_bytes() / (V * (pack ? 2 : 4));
  plan.tile_scores = pass == Pass::forward;
  int64_t rows = plan.tile_scores ? kMaxRowBlock
                                  : std::clamp<int64_t>(fit, 1, pack ? kMaxPackedRowBlock : kMaxRowBlock);
  if (rows >= 16) rows -= rows % 16;  // whole GEMM register blocks
  plan.row_block = plan.tile_scores ? rows : std::min(rows, plan.d.n);
  plan.tiles = (V + kVocabTile - 1) / kVocabTile;
  const int64_t H = std::max<int64_t>(plan.d.h, 1);  // the logits entry has no H
  const int64_t chunks = std::clamp<int64_t>(H / kMinHiddenChunk, 1, kGradXTasks);
  plan.h_chunk = std::min(H, ((H + chunks - 1) / chunks + 15) / 16 * 16);
  plan.h_chunks = (H + plan.h_chunk - 1) / plan.h_chunk;
  plan.row_groups = std::max<int64_t>(1, kGradXTasks / plan.h_chunks);
  choose_grad_order(p, &plan);
  plan.packed_scores = pack && !plan.vocab_outer;
  // In floats; a packed row's 2 scores_ld codes fill the same odd number of lines.
  plan.scores_ld = plan.packed_scores ? padded_row(V, 32) / 2
                                      : padded_row(plan.vocab_outer ? plan.chunk_tiles * kVocabTile : V, 16);
  plan.grad_x_by_tile = grad_x_by_tile(p, plan);
  plan.grad_x_vocab_split = !plan.grad_x_by_tile && grad_x_vocab_split(p, plan);
  plan.grad_x_in_place = plan.vocab_outer && p.grad_x.present() && p.grad_x.dtype == Dtype::f32 &&
                         dense(p.grad_x) && !plan.filter_uniform;
  plan.compact_bf16_g = plan.grad_gemm == Dtype::bf16 && pass != Pass::forward && p.grad_x.present() &&
                        !plan.d.logits_entry && !plan.grad_x_vocab_split && !plan.packed_scores &&
                        !plan.grad_x_by_tile;
  plan.grad_w_packed_x = grads && p.grad_w.present() && !plan.d.logits_entry &&
                         plan.grad_gemm == Dtype::bf16 && !plan.grad_w_gemm_tn &&
                         !(plan.grad_w_in_place && p.w_layout == WeightLayout::hv) &&
                         plan.gemm->packed_b_bytes(grad_w_tile_args(plan, p, plan.row_block, kVocabTile)) > 0;
  return plan;
}

GemmArgs grad_w_tile_args(const Plan& plan, const Problem& p, int64_t rows, int64_t n) {
  GemmArgs g{};
  g.ab_dtype = plan.grad_gemm;
  g.m = n, g.n = plan.d.h, g.k = rows;
  g.lda = kVocabTile, g.trans_a = true;
  g.ldb = plan.d.h, g.trans_b = false;
  g.ldc = plan.grad_w_in_place ? p.grad_w.stride[0] : plan.d.h;
  g.b_packed = plan.grad_w_packed_x && rows == plan.row_block && n == kVocabTile;
  return g;
}

namespace {

// Whether W's pieces go through Workspace::w_scratch: where its dtype is not
// a GEMM's or its rows are strided (w_piece); otherwise the GEMMs read W in
// place and the scratch ([threads, kVocabTile, H] floats, 16 MiB at S2 on
// 2 threads) is not needed.
bool w_converted(const Plan& plan, const Problem& p) {
  if (plan.d.logits_entry) return false;
  const bool grads = plan.pass != Pass::forward;
  return !w_in_place(p.w, plan.logits_gemm) || (grads && !w_in_place(p.w, plan.grad_gemm));
}

// Sizes in bytes of each workspace piece, in carve order.
constexpr int kPieces = 23;
struct Sizes {
  size_t bytes[kPieces] = {};
};

Sizes sizes_of(const Plan& plan, const Problem& p) {
  const int64_t R = plan.row_block, V = plan.d.v, H = plan.d.h, N = plan.d.n;
  const bool grads = plan.pass != Pass::forward;
  const size_t logits_elt = dtype_size(plan.logits_gemm), grad_elt = dtype_size(plan.grad_gemm);
  // Vocab outer runs the forward's pieces first (Plan): their tiles, states
  // and x rows, whole pieces of kMaxRowBlock.
  const bool pieces = plan.tile_scores || plan.vocab_outer;
  const size_t tile_bytes = size_t(plan.threads) * size_t(kMaxRowBlock * kVocabTile) * 4;
  const int64_t x_rows = plan.vocab_outer ? (R + kMaxRowBlock - 1) / kMaxRowBlock * kMaxRowBlock : R;
  const int64_t state_rows = plan.vocab_outer ? kMaxRowBlock : R;
  Sizes s;
  s.bytes[0] = plan.tile_scores ? tile_bytes
               : plan.vocab_outer ? std::max(tile_bytes, size_t(R * plan.scores_ld) * 4)
                                  : size_t(R * plan.scores_ld) * 4;
  s.bytes[1] = size_t(x_rows * H) * logits_elt;
  s.bytes[2] = grads && plan.grad_gemm != plan.logits_gemm ? size_t(R * H) * grad_elt : 0;
  s.bytes[3] = w_converted(plan, p) ? size_t(plan.threads) * size_t(kVocabTile * H) * 4 : 0;
  s.bytes[4] = grads && p.grad_x.present() && !plan.grad_x_in_place && !plan.grad_x_by_tile
                   ? size_t(R * H) * 4
                   : 0;
  s.bytes[5] = size_t(state_rows * plan.tiles) * sizeof(simd::SoftmaxState);
  s.bytes[6] = size_t(R) * sizeof(RowInfo);
  s.bytes[7] = size_t(N) * sizeof(double);
  s.bytes[8] = grads && p.grad_w.present() && !plan.grad_w_in_place ? size_t(V * H) * 4 : 0;
  s.bytes[9] = grads && p.grad_bias.present() ? size_t(V) * sizeof(double) : 0;
  s.bytes[10] = p.class_weights.present() ? size_t(V) * 4 : 0;
  s.bytes[11] = p.bias.present() ? size_t(V) * 4 : 0;
  s.bytes[12] = plan.filter ? size_t(plan.tiles) : 0;
  s.bytes[13] = plan.filter_uniform && p.grad_x.present() ? size_t(H) * sizeof(double) : 0;
  s.bytes[14] = plan.filter_uniform ? size_t(H + 1) * sizeof(double) : 0;
  s.bytes[15] = pieces ? size_t(kMaxRowBlock) * 4 : plan.packed_scores ? size_t(R) * 4 : 0;
  s.bytes[16] = grads && p.grad_w.present() ? size_t(plan.tiles) : 0;
  s.bytes[17] = plan.grad_w_gemm_tn ? size_t(plan.threads) * size_t(simd::kGemmTnScratchFloats) * 4 : 0;
  s.bytes[18] = plan.grad_x_vocab_split || plan.grad_x_by_tile ? size_t(kGradXTasks * R * H) * 4 : 0;
  s.bytes[19] = plan.packed_scores ? size_t(plan.threads) * size_t(R * kVocabTile) * 4 : 0;
  s.bytes[20] = plan.packed_scores ? size_t(R * plan.tiles) * 4 : 0;
  // (With packed scores, the f32 tiles of piece 19 serve: free by then.)
  // One copy per tile of a vocab-outer chunk (the cut counted them), else
  // one per thread (rows outer: R <= kMaxRowBlock).
  s.bytes[21] = g16_copies(plan, p) && !plan.packed_scores
                    ? size_t(plan.vocab_outer ? plan.chunk_tiles : plan.threads) *
                          size_t(R * kVocabTile) * 2
                    : 0;
  s.bytes[22] = plan.grad_w_packed_x ? plan.gemm->packed_b_bytes(grad_w_tile_args(plan, p, R, kVocabTile)) : 0;
  return s;
}

size_t aligned(size_t n) { return (n + 63) / 64 * 64; }

}  // namespace

size_t workspace_bytes(const Plan& plan, const Problem& p) {
  size_t total = 64;  // room to align the base
  for (size_t b : sizes_of(plan, p).bytes) total += aligned(b);
  return total;
}

Workspace carve_workspace(const Plan& plan, const Problem& p, void* base) {
  const Sizes s = sizes_of(plan, p);
  auto at = reinterpret_cast<uintptr_t>(base);
  at = (at + 63) / 64 * 64;
  void* piece[kPieces];
  for (int k = 0; k < kPieces; ++k) {
    piece[k] = s.bytes[k] ? reinterpret_cast<void*>(at) : nullptr;
    at += aligned(s.bytes[k]);
  }
  Workspace w;
  w.scores = static_cast<float*>(piece[0]);
  w.x_block = piece[1];
  w.x_block_grad = piece[2] ? piece[2] : piece[1];
  w.w_scratch = piece[3];
  w.grad_x_block = static_cast<float*>(plan.grad_x_by_tile ? piece[18] : piece[4]);
  w.states = static_cast<simd::SoftmaxState*>(piece[5]);
  w.rows = static_cast<RowInfo*>(piece[6]);
  w.row_loss = static_cast<double*>(piece[7]);
  w.grad_w_acc = static_cast<float*>(piece[8]);
  w.grad_b_acc = static_cast<double*>(piece[9]);
  w.class_w = static_cast<float*>(piece[10]);
  w.bias = static_cast<float*>(piece[11]);
  w.kept = static_cast<uint8_t*>(piece[12]);
  w.uniform_w = static_cast<double*>(piece[13]);
  w.uniform_x = static_cast<double*>(piece[14]);
  w.label_score = static_cast<float*>(piece[15]);
  w.w_written = static_cast<uint8_t*>(piece[16]);
  w.gemm_tn_scratch = static_cast<float*>(piece[17]);
  w.grad_x_parts = static_cast<float*>(piece[18]);
  w.packed_tiles = static_cast<float*>(piece[19]);
  w.score_refs = static_cast<float*>(piece[20]);
  w.g16_tiles = static_cast<uint16_t*>(piece[21]);
  if (plan.packed_scores && g16_copies(plan, p)) w.g16_tiles = static_cast<uint16_t*>(piece[19]);
  w.x_packed = piece[22];
  return w;
}

char* stash_at(const Plan& plan, const Problem& p, int64_t r, int64_t j, int64_t j0, int64_t j1) {
  const int64_t R = plan.stash_rows, V = plan.d.v;
  const int64_t end = plan.d.h * V * int64_t(dtype_size(p.grad_w.dtype)) / 4;  // whole floats
  const int64_t chunk = end - (V - j0) * R;
  return static_cast<char*>(p.grad_w.data) + 4 * (chunk + r * (j1 - j0) + (j - j0));
}

}  // namespace flce::cpu
