#include "cuda/plan.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/score_codes.h"
#include "cuda/sm90/score_gemms.h"

namespace flce::cuda {
namespace {

// The cuBLAS path's tiles. Measured on an H100 (bench/cuda_bench.py --variants
// FLCE_CUDA_TILE=...): 4096 x 4096 beat 2048 x 2048 and 4096 x 2048 at all
// three benchmark shapes (fewer, longer GEMMs).
constexpr int64_t kTileRows = 4096, kTileCols = 4096;
// The fused kernel's tiles (sm90/score_gemms.h) are narrower: more and
// shorter pass-1 blocks (128 rows of one tile each), and at H = 1024 a
// gradient block, whole tiles wide, that fills its 192 MiB (6144 classes,
// against 4096). Against 4096 x 4096 in five H100 runs: the H = 1024 step
// 3.9-4.4% faster in three of them, the Llama-3 forward faster in all five,
// Gemma-2 within the noise (bench/results/cuda-h100-history.md, "Two
// changes of that day").
constexpr int64_t kFusedTileCols = 2048;
constexpr size_t kBlockBytes = size_t(192) << 20;  // the G block
constexpr size_t kStateBytes = size_t(64) << 20;   // pass 1's tile states
// The most workspace a plan widens its gradient block to (below): the 512
// MiB beyond the gradients that #7 allows a step, less 32 MiB for the
// rest of a call (its outputs, a caller's allocator rounding).
constexpr size_t kWideWorkspaceBytes = size_t(480) << 20;

// Whether `text` is "RxC" with R, C >= 1, read into *rows and *cols.
bool parse_size(const char* text, int64_t* rows, int64_t* cols) {
  long long r = 0, c = 0;
  int end = 0;
  if (std::sscanf(text, "%lldx%lld%n", &r, &c, &end) != 2 || text[end] != '\0') return false;
  if (r < 1 || c < 1) return false;
  *rows = r, *cols = c;
  return true;
}

// FLCE_CUDA_TILE=RxC overrides the score tile and FLCE_CUDA_BLOCK=RxC the
// gradient block (rounded to whole tiles): tuning sweeps (bench/) and tests
// that need many tiles and blocks on small problems. Unset or malformed
// (check_plan_env reports that) leaves *rows and *cols.
void size_from_env(const char* name, int64_t* rows, int64_t* cols) {
  if (const char* env = std::getenv(name)) parse_size(env, rows, cols);
}

int64_t round_down(int64_t v, int64_t m) { return std::max(m, v / m * m); }
int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

bool unit_columns(const Tensor& t) { return t.shape[1] == 1 || t.stride[1] == 1; }

const char* stash_env() { return std::getenv("FLCE_CUDA_STASH"); }

// Where pass 1 stashes which classes (plan.h): stash_cols, stash_in_g and
// stash_base, when G is rounded to bf16, grad_W is [V, H] with rows packed
// end to end, and no grad_W write precedes a read of the codes under it.
struct StashLayout {
  int64_t cols = 0;
  bool in_g = false;
  int64_t base = 0;
};

// The classes from first_col whose codes fit in grad_W's `capacity` bytes
// from byte `base`: whole blocks, then whole tiles of the next.
int64_t classes_that_fit(const Plan& plan, int64_t first_col, int64_t base, int64_t capacity) {
  const int64_t V = plan.d.v, C = plan.block_cols, class_bytes = 2 * plan.d.n;
  int64_t cols = first_col;
  for (int64_t at = base; cols < V; at += class_bytes * C) {
    const int64_t width = std::min(C, V - cols);
    if (at + class_bytes * width <= capacity) {
      cols += width;
      continue;
    }
    const int64_t part = std::max<int64_t>(0, capacity - at) / class_bytes;
    return cols + part / plan.tile_cols * plan.tile_cols;
  }
  return cols;
}

StashLayout stash_layout(const Problem& p, const Plan& plan) {
  const char* env = stash_env();
  if (env != nullptr && std::string(env) == "0") return {};
  const Tensor& gw = p.grad_w;
  const int64_t N = plan.d.n, V = plan.d.v, H = plan.d.h, C = plan.block_cols;
  if (!plan.states_pass || !plan.grads || plan.d.logits_entry || plan.round_to != Dtype::bf16 ||
      !gw.present() || p.w_layout != WeightLayout::vh || gw.stride[0] != H ||
      !unit_columns(gw) || !codes_hold_softcap(p.options.softcap))
    return {};
  const int64_t gw_size = int64_t(dtype_size(gw.dtype));
  // f32 in place with several row blocks: each row block writes grad_W's
  // block rows, before the next row block reads the codes there.
  if (plan.grad_w_in_place && plan.block_rows < N) return {};
  if (H * gw_size > 2 * N) return {};
  const int64_t capacity = V * H * gw_size;
  StashLayout in_w{classes_that_fit(plan, 0, 0, capacity), false, 0};
  // Block 0 in the gradient block, which holds all N rows of a whole block:
  // grad_W's codes then start after block 0's grad_W rows.
  if (plan.block_rows < N || C > V) return in_w;
  StashLayout in_g{0, true, C * H * gw_size};
  in_g.cols = classes_that_fit(plan, C, in_g.base, capacity);
  return in_g.cols > in_w.cols ? in_g : in_w;
}

void set_stash(Plan* plan, const StashLayout& stash) {
  plan->stash_cols = stash.cols, plan->stash_in_g = stash.in_g, plan->stash_base = stash.base;
  plan->stash_tiles = (plan->stash_cols + plan->tile_cols - 1) / plan->tile_cols;
  plan->stash_refs = plan->stash_tiles * plan->stash_refs_per_tile;
}

// The fused G kernel's waves over the classes pass 2 recomputes: per
// gradient block, ceil(kernel blocks / SMs) (sm90/score_gemms.h).
int64_t recompute_waves(const Plan& plan, int sms) {
  const int64_t rows = (plan.block_rows + sm90::kKernelRows - 1) / sm90::kKernelRows;
  int64_t waves = 0;
  for (int64_t j0 = 0; j0 < plan.d.v; j0 += plan.block_cols) {
    const int64_t cols = std::min(plan.block_cols, plan.d.v - j0) - plan.stash_width(j0);
    const int64_t blocks = rows * ((cols + sm90::kDlogitsChunk - 1) / sm90::kDlogitsChunk);
    waves += (blocks + sms - 1) / sms;
  }
  return waves;
}

// Where block 0's codes are the gradient block, a wider block stashes more
// classes (block 0 is all stashed; the wider grad_W rows before the other
// blocks' codes cost less than that at H |grad_W dtype| < 2 N). Of the
// blocks of whole tiles that keep the workspace within kWideWorkspaceBytes,
// the fused plan takes the one whose recomputed classes take the fewest
// waves of the G kernel, then the one that stashes the most: the most
// classes alone took a Gemma-2 block of 22528 classes, whose launches of
// 704 kernel blocks fill 5.3 of 6 waves, and whose pass 2 was no faster
// than with 12288 (H200, two rounds).
void widen_stashing_block(Plan* plan, const Problem& p, int sms) {
  if (!plan->stash_in_g || !plan->fused) return;
  const int64_t widest = round_up(plan->d.v, plan->tile_cols);
  Plan best = *plan;
  int64_t best_waves = recompute_waves(best, sms);
  for (int64_t cols = plan->block_cols + plan->tile_cols; cols <= widest; cols += plan->tile_cols) {
    Plan wider = *plan;
    wider.block_cols = cols;
    set_stash(&wider, stash_layout(p, wider));
    if (workspace_bytes(wider, p) > kWideWorkspaceBytes) break;
    if (!wider.stash_in_g) continue;
    const int64_t waves = recompute_waves(wider, sms);
    if (waves < best_waves || (waves == best_waves && wider.stash_cols > best.stash_cols))
      best = wider, best_waves = waves;
  }
  *plan = best;
}

}  // namespace

std::string check_plan_env() {
  const char* env = stash_env();
  if (env != nullptr && std::string(env) != "0" && std::string(env) != "1")
    return "FLCE_CUDA_STASH = '" + std::string(env) +
           "': must be 0 (recompute every score tile) or 1 (stash where it applies; unset: the "
           "same)";
  for (const char* name : {"FLCE_CUDA_TILE", "FLCE_CUDA_BLOCK"}) {
    int64_t rows = 0, cols = 0;
    const char* size = std::getenv(name);
    if (size != nullptr && !parse_size(size, &rows, &cols))
      return std::string(name) + " = '" + size +
             "': must be ROWSxCOLS with both at least 1, e.g. 4096x2048 (unset: the default)";
  }
  return "";
}

Plan make_plan(const Problem& p, Pass pass) {
  PlanTarget target;
  target.fused = sm90::fused_declines(p).empty();
  if (target.fused) target.sms = sm90::sm_count(p);
  return make_plan(p, pass, target);
}

Plan make_plan(const Problem& p, Pass pass, const PlanTarget& target) {
  Plan plan;
  plan.d = dims_of(p);
  plan.pass = pass;
  const int64_t N = plan.d.n, V = plan.d.v, H = plan.d.h;
  plan.storage = p.logits.present() ? p.logits.dtype : p.x.dtype;
  const bool storage_g = p.options.grad_logits_dtype == GradLogitsDtype::storage;
  plan.grad_gemm = storage_g ? plan.storage : Dtype::f32;
  plan.round_to = storage_g ? plan.storage : Dtype::f32;
  plan.grads = pass != Pass::forward;
  plan.states_pass = pass != Pass::backward || p.grad_entropy.present();

  plan.fused = target.fused;
  int64_t tr = kTileRows, tc = plan.fused ? kFusedTileCols : kTileCols;
  size_from_env("FLCE_CUDA_TILE", &tr, &tc);
  plan.tile_rows = std::min(tr, N);
  plan.tile_cols = std::min(tc, V);
  plan.tiles = (V + plan.tile_cols - 1) / plan.tile_cols;
  const int64_t per_row = plan.tiles * int64_t(sizeof(TileState));
  plan.state_rows = std::min(N, round_down(int64_t(kStateBytes) / per_row, plan.tile_rows));

  if (plan.grads && !plan.d.logits_entry) {
    const int64_t g_size = int64_t(dtype_size(plan.grad_gemm));
    plan.block_rows = std::min(N, round_down(int64_t(kBlockBytes) / (plan.tile_cols * g_size),
                                             plan.tile_rows));
    const int64_t cols = int64_t(kBlockBytes) / (plan.block_rows * g_size);
    plan.block_cols = std::min(round_up(V, plan.tile_cols), round_down(cols, plan.tile_cols));
    int64_t br = 0, bc = 0;
    size_from_env("FLCE_CUDA_BLOCK", &br, &bc);
    if (br > 0) {
      plan.block_rows = std::min(N, round_down(br, plan.tile_rows));
      plan.block_cols = std::min(round_up(V, plan.tile_cols), round_down(bc, plan.tile_cols));
    }
    plan.grad_x_in_place = p.grad_x.present() && p.grad_x.dtype == Dtype::f32 && unit_columns(p.grad_x);
    plan.grad_w_in_place = p.grad_w.present() && p.grad_w.dtype == Dtype::f32 && unit_columns(p.grad_w);
    const bool gemm_dtype = p.grad_w.present() &&
                            (p.grad_w.dtype == Dtype::f32 || p.grad_w.dtype == plan.grad_gemm);
    plan.grad_w_direct = !plan.grad_w_in_place && gemm_dtype && unit_columns(p.grad_w) &&
                         plan.block_rows >= N;
    plan.stash_ref_cols = plan.fused ? sm90::kStashRefCols : plan.tile_cols;
    plan.stash_refs_per_tile = (plan.tile_cols + plan.stash_ref_cols - 1) / plan.stash_ref_cols;
    set_stash(&plan, stash_layout(p, plan));
    if (br == 0) widen_stashing_block(&plan, p, target.sms);
    (void)H;
  }
  return plan;
}

namespace {

// Byte sizes of the Workspace members, in declaration order.
struct Sizes {
  size_t bytes[14] = {};
};

Sizes sizes_of(const Plan& plan, const Problem& p) {
  const int64_t N = plan.d.n, V = plan.d.v, H = plan.d.h;
  const bool head = !plan.d.logits_entry;
  const bool gemms = plan.grads && head;
  const size_t g_size = dtype_size(plan.grad_gemm);
  Sizes s;
  s.bytes[0] = sizeof(Scalars);
  s.bytes[1] = size_t(N) * sizeof(RowInfo);
  s.bytes[2] = size_t(N) * 8;
  const size_t per_class = size_t(padded_classes(V)) * 4;  // read to a subtile's end (prepare)
  s.bytes[3] = p.class_weights.present() ? per_class : 0;
  s.bytes[4] = p.bias.present() ? per_class : 0;
  s.bytes[5] = plan.states_pass ? size_t(plan.state_rows * plan.tiles) * sizeof(TileState) : 0;
  s.bytes[6] = plan.fused ? 0 : size_t(plan.tile_rows * plan.tile_cols) * 4;  // the f32 score tile
  s.bytes[7] = gemms ? size_t(plan.block_rows * plan.block_cols) * g_size : 0;
  s.bytes[8] = gemms && p.grad_x.present() && !plan.grad_x_in_place ? size_t(N * H) * 4 : 0;
  s.bytes[9] = gemms && p.grad_w.present() && !plan.grad_w_in_place && !plan.grad_w_direct
                   ? size_t(plan.block_cols * H) * 4
                   : 0;
  s.bytes[10] = plan.grads && p.grad_bias.present() ? size_t(V) * 8 : 0;
  // Copies of x and W in grad_gemm's dtype: grad_W's GEMM reads x and
  // grad_x's reads W, so each is made only for the gradient that reads it.
  const bool convert = gemms && plan.grad_gemm != plan.storage;
  s.bytes[11] = convert && p.grad_w.present() ? size_t(plan.block_rows * H) * g_size : 0;
  s.bytes[12] = convert && p.grad_x.present() ? size_t(plan.block_cols * H) * g_size : 0;
  s.bytes[13] = size_t(N * plan.stash_refs) * 4;
  return s;
}

constexpr size_t kAlign = 256;
size_t aligned(size_t b) { return (b + kAlign - 1) / kAlign * kAlign; }

}  // namespace

size_t workspace_bytes(const Plan& plan, const Problem& p) {
  size_t total = kAlign;  // room to align a caller's base
  for (size_t b : sizes_of(plan, p).bytes) total += aligned(b);
  return total;
}

Workspace carve_workspace(const Plan& plan, const Problem& p, void* base) {
  const Sizes s = sizes_of(plan, p);
  char* at = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(base) + kAlign - 1) / kAlign * kAlign);
  void* ptr[14];
  for (int k = 0; k < 14; ++k) {
    ptr[k] = s.bytes[k] ? at : nullptr;
    at += aligned(s.bytes[k]);
  }
  Workspace ws;
  ws.scalars = static_cast<Scalars*>(ptr[0]);
  ws.rows = static_cast<RowInfo*>(ptr[1]);
  ws.row_loss = static_cast<double*>(ptr[2]);
  ws.class_w = static_cast<float*>(ptr[3]);
  ws.bias = static_cast<float*>(ptr[4]);
  ws.states = static_cast<TileState*>(ptr[5]);
  ws.scores = static_cast<float*>(ptr[6]);
  ws.g = ptr[7];
  ws.grad_x_acc = static_cast<float*>(ptr[8]);
  ws.grad_w_acc = static_cast<float*>(ptr[9]);
  ws.grad_b_acc = static_cast<double*>(ptr[10]);
  ws.x_grad = ptr[11];
  ws.w_grad = ptr[12];
  ws.stash_refs = static_cast<float*>(ptr[13]);
  return ws;
}

uint16_t* stash_codes(const Plan& plan, const Problem& p, const Workspace& ws, int64_t b) {
  if (plan.stash_in_g && b == 0) return static_cast<uint16_t*>(ws.g);
  const int64_t first = plan.stash_in_g ? 1 : 0;
  return reinterpret_cast<uint16_t*>(static_cast<char*>(p.grad_w.data) + plan.stash_base) +
         (b - first) * plan.d.n * plan.block_cols;
}

}  // namespace flce::cuda
