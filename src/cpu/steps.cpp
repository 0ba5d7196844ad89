#include "cpu/steps.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/loss_terms.h"
#include "common/parallel.h"
#include "common/row_terms.h"
#include "common/tensor_access.h"
#include "cpu/operands.h"

namespace flce::cpu {
namespace {

bool is_ignored(const Problem& p, int64_t y) { return y == p.options.ignore_index; }
int64_t tile_width(const Plan& plan, int64_t t) {
  return std::min(kVocabTile, plan.d.v - t * kVocabTile);
}
void* thread_scratch(const Context& c) {
  return static_cast<char*>(c.ws.w_scratch) +
         size_t(omp_get_thread_num()) * size_t(kVocabTile * c.plan.d.h) * 4;
}

// U[rows, n] = X_block W_t^T (columns j0 .. j0+n) into out, rows ld apart.
void logits_gemm(const Context& c, int64_t rows, int64_t j0, int64_t n, float* out, int64_t ld) {
  const Plan& plan = c.plan;
  const int64_t H = plan.d.h;
  const WPiece w = w_piece(c.p.w, c.p.w_layout, j0, n, 0, H, plan.logits_gemm, thread_scratch(c));
  GemmArgs g{};
  g.m = rows, g.n = n, g.k = H;
  g.ab_dtype = plan.logits_gemm;
  g.a = c.ws.x_block, g.lda = H, g.trans_a = false;
  g.b = w.data, g.ldb = w.ld, g.trans_b = w.vocab_major;
  g.c = out, g.ldc = ld, g.beta = 0;
  plan.gemm->run(g);
}

// s = u exactly without a bias, scale or softcap: no scores pass needed.
bool scores_are_logits(const Context& c) {
  const Options& o = c.p.options;
  return !c.ws.bias && o.logit_scale == 1 && !(o.softcap > 0);
}

// s = softcap(a (u + b)) in place over rows of a tile of columns j0 .. j0+n.
void scores_in_place(const Context& c, float* tile, int64_t ld, int64_t rows, int64_t j0, int64_t n) {
  if (scores_are_logits(c)) return;
  const Options& o = c.p.options;
  const float* bias = c.ws.bias ? c.ws.bias + j0 : nullptr;
  for (int64_t r = 0; r < rows; ++r)
    c.plan.kernels->scores(tile + r * ld, bias, n, float(o.logit_scale), float(o.softcap));
}

// Plan::stash_scores: the columns [j0, j1) of the vocab-outer chunk that
// holds tile t.
struct ChunkCols {
  int64_t j0, j1;
};
ChunkCols chunk_of(const Plan& plan, int64_t t) {
  const int64_t j0 = t / plan.chunk_tiles * plan.chunk_tiles * kVocabTile;
  return {j0, std::min(j0 + plan.chunk_tiles * kVocabTile, plan.d.v)};
}

// Rows 0 .. rows of tile t (n columns from j0), `ld` floats apart at `tile`,
// to the stash rows from `row0` on, or back from them.
void stash_tile(const Context& c, float* tile, int64_t ld, int64_t row0, int64_t rows, int64_t t,
                bool back) {
  const int64_t j0 = t * kVocabTile, n = tile_width(c.plan, t);
  const ChunkCols ch = chunk_of(c.plan, t);
  for (int64_t r = 0; r < rows; ++r) {
    char* at = stash_at(c.plan, c.p, row0 + r, j0, ch.j0, ch.j1);
    if (back)
      std::memcpy(tile + r * ld, at, size_t(n) * 4);
    else
      std::memcpy(at, tile + r * ld, size_t(n) * 4);
  }
}

}  // namespace

void scores_and_states(const Context& c, int64_t i0, int64_t rows) {
  const Plan& plan = c.plan;
  if (!plan.d.logits_entry) {
    load_rows(c.p.x, i0, rows, plan.logits_gemm, c.ws.x_block);
    if (plan.tile_scores && rows < plan.row_block)  // the padding rows (Plan::tile_scores)
      std::memset(static_cast<char*>(c.ws.x_block) + rows * plan.d.h * dtype_size(plan.logits_gemm), 0,
                  size_t(plan.row_block - rows) * plan.d.h * dtype_size(plan.logits_gemm));
  }
  parallel_for(plan.threads, 0, plan.tiles, [&](int64_t t) {
    const int64_t j0 = t * kVocabTile, n = tile_width(plan, t);
    // This tile's scores: in the [R, V] block, or the thread's own tile
    // (a forward's, or one whose rows are then packed into the block).
    const int64_t thread_tile = int64_t(omp_get_thread_num()) * plan.row_block * kVocabTile;
    float* const tile = plan.tile_scores     ? c.ws.scores + thread_tile
                        : plan.packed_scores ? c.ws.packed_tiles + thread_tile
                                             : c.ws.scores + j0;
    const int64_t ld = plan.tile_scores || plan.packed_scores ? kVocabTile : plan.scores_ld;
    if (plan.d.logits_entry) {
      for (int64_t r = 0; r < rows; ++r) {
        Tensor row = c.p.logits;  // row i0 + r, columns j0 .. j0+n, as a 1 x n region
        row.data = static_cast<char*>(row.data) +
                   ((i0 + r) * row.stride[0] + j0 * row.stride[1]) * int64_t(dtype_size(row.dtype));
        row.shape[0] = 1, row.shape[1] = n;
        load_rows(row, 0, 1, Dtype::f32, tile + r * ld);
      }
    } else {
      logits_gemm(c, plan.tile_scores ? plan.row_block : rows, j0, n, tile, ld);
    }
    scores_in_place(c, tile, ld, rows, j0, n);
    if (plan.stash_scores) stash_tile(c, tile, ld, c.piece_row0, rows, t, /*back=*/false);
    const float* class_w = c.ws.class_w ? c.ws.class_w + j0 : nullptr;
    for (int64_t r = 0; r < rows; ++r) {
      float* s = tile + r * ld;
      simd::SoftmaxState* st = c.ws.states + r * plan.tiles + t;
      simd::softmax_state_init(st);
      plan.kernels->online_softmax(s, class_w, n, j0, plan.softmax_extras, st);
      if (plan.label_scores_aside()) {  // the f32 tile is gone after this
        const int64_t y = load_int(c.p.labels, i0 + r);
        if (y >= j0 && y < j0 + n) c.ws.label_score[r] = s[y - j0];
      }
      if (plan.packed_scores) {  // ref: the tile's max in the row (>= every s here), if finite
        const float ref = std::isfinite(st->max) ? st->max : 0.0f;
        c.ws.score_refs[r * plan.tiles + t] = ref;
        plan.kernels->pack_scores(s, n, ref, ScoreBlock{c.ws.scores, plan.scores_ld, 0}.codes(r, j0));
      }
    }
  });
}

namespace {

// Merged statistics of one row, in double.
struct Merged {
  double max = -INFINITY, sum_exp = 0, sum_cs = 0;
  int64_t argmax = 0, first_nan = -1;
};

Merged merge_states(const simd::SoftmaxState* st, int64_t tiles) {
  Merged m;
  bool found = false;  // ties between tiles keep the earlier tile: the lowest index
  for (int64_t t = 0; t < tiles; ++t) {
    if (st[t].first_nan >= 0 && m.first_nan < 0) m.first_nan = st[t].first_nan;
    if (st[t].argmax >= 0 && (!found || st[t].max > m.max)) m.argmax = st[t].argmax, found = true;
    m.max = std::max(m.max, double(st[t].max));
    m.sum_cs += st[t].sum_cs;
  }
  for (int64_t t = 0; t < tiles; ++t)
    if (st[t].max != -INFINITY) m.sum_exp += double(st[t].sum_exp) * std::exp(double(st[t].max) - m.max);
  return m;
}

// sum_j p_ij (s_ij - m) over the row's tiles, m its finite max and
// lse_d = lse - m (tile_mean_score_d).
double weighted_mean_score_d(const simd::SoftmaxState* st, int64_t tiles, double m, double lse_d) {
  double sbar_d = 0;
  for (int64_t t = 0; t < tiles; ++t)
    sbar_d += tile_mean_score_d(st[t].max, st[t].sum_exp, st[t].sum_exp_d, m, lse_d);
  return sbar_d;
}

// The row's filter threshold kappa_i * eps, kappa_i = a (|coef_p| + |g_ent|):
// |G_ij| / kappa_i is p_ij - [j = y_i] for a plain cross-entropy, the
// quantity Cut Cross-Entropy filters on. With label smoothing (and no
// softcap, see Plan) the uniform term u_i c_j leaves G for a rank-one update.
void set_filter_terms(const Plan& plan, const Options& o, RowInfo* info) {
  const double a = o.logit_scale;
  info->filter_tau = plan.filter_eps * a * (std::fabs(info->coef_p) + std::fabs(info->g_ent));
  if (plan.filter_uniform) info->uniform = a * info->coef_c;
}

LossConstants loss_constants(const Context& c) {
  const Options& o = c.p.options;
  return {o.label_smoothing, double(c.plan.d.v), c.class_sum, o.z_loss};
}

// Row i's RowInfo with only its label set (README, Semantics: ignore_index).
RowInfo labelled_row(const Context& c, int64_t i) {
  RowInfo info;
  info.y = load_int(c.p.labels, i);
  info.ignored = is_ignored(c.p, info.y);
  return info;
}

// The row's label, weights and gradient coefficients (README, Semantics),
// given its lse.
void set_grad_terms(const Context& c, int64_t i, RowInfo* info) {
  const Problem& p = c.p;
  const double t_i = p.token_weights.present() ? load(p.token_weights, i) : 1.0;
  const double c_y = info->ignored ? 0.0 : (c.ws.class_w ? c.ws.class_w[info->y] : 1.0);
  info->g_loss = info->ignored ? 0.0 : loss_cotangent(c.p, c.denom, i) * t_i;
  info->g_lse = p.grad_lse.present() ? load(p.grad_lse, i) : 0.0;
  info->g_ent = p.grad_entropy.present() ? load(p.grad_entropy, i) : 0.0;
  const LossConstants k = loss_constants(c);
  info->coef_p = grad_coef_p(k, info->g_loss, c_y, info->lse, info->g_lse);
  info->coef_c = grad_coef_c(k, info->g_loss);
  if (c.plan.filter) set_filter_terms(c.plan, p.options, info);
}

}  // namespace

void merge_rows(const Context& c, int64_t i0, int64_t rows) {
  const Problem& p = c.p;
  const Plan& plan = c.plan;
  const LossConstants k = loss_constants(c);
  parallel_for(plan.threads, 0, rows, [&](int64_t r) {
    const int64_t i = i0 + r;
    const simd::SoftmaxState* st = c.ws.states + r * plan.tiles;
    const Merged m = merge_states(st, plan.tiles);
    RowInfo& info = c.ws.rows[r];
    info = labelled_row(c, i);
    const double formed = merged_lse(m.first_nan >= 0, m.max, m.sum_exp);
    info.lse = plan.pass == Pass::backward ? load(p.lse, i) : formed;
    // p, logp and the entropy from differences to the max, as the oracle's
    // (row_terms.h, lse_parts); a saved lse with other bits than this
    // pass's is taken as given.
    const LseParts parts = lse_parts(info.lse, m.max, m.sum_exp, info.lse == formed);
    info.shift = parts.shift, info.lse_d = parts.lse_d, info.p_scale = parts.p_scale;
    const bool finite_max = std::isfinite(m.max);  // merge_states' maxima are never NaN
    // sbar_d (an exp per tile) only where the entropy's sums were
    // computed: its output and cotangent are its only readers. An infinite
    // max makes every p_j = e^(s_j - lse) NaN (inf - inf), so sbar_d is NaN,
    // as the oracle's sum gives. The entropy is lse_d - sbar_d.
    double entropy = NAN;
    if (plan.softmax_extras & simd::kSoftmaxMoments) {
      info.sbar_d = NAN;
      if (finite_max) {
        info.sbar_d = weighted_mean_score_d(st, plan.tiles, m.max, info.lse_d);
        entropy = info.lse_d - info.sbar_d;
      }
    }
    if (!info.ignored)
      info.s_y = plan.label_scores_aside() ? c.ws.label_score[r] : c.ws.scores[r * plan.scores_ld + info.y];
    if (plan.pass != Pass::forward) set_grad_terms(c, i, &info);
    if (plan.pass == Pass::backward) return;
    const double t_i = p.token_weights.present() ? load(p.token_weights, i) : 1.0;
    const double c_y = info.ignored ? 0.0 : (c.ws.class_w ? c.ws.class_w[info.y] : 1.0);
    const double logp_y = info.ignored ? 0.0 : (info.s_y - info.shift) - info.lse_d;
    c.ws.row_loss[i] = row_loss(k, info.ignored, t_i, c_y, logp_y, m.sum_cs, info.lse);
    store(p.lse, i, info.lse);
    if (p.logprob.present()) store(p.logprob, i, logp_y);
    if (p.argmax.present()) store(p.argmax, i, double(m.first_nan >= 0 ? m.first_nan : m.argmax));
    if (p.entropy.present()) store(p.entropy, i, entropy);
    if (p.zloss.present()) store(p.zloss, i, z_loss_term(k, info.lse));
    if (p.options.reduction == Reduction::none) store(p.loss, i, c.ws.row_loss[i]);
  });
}

void rows_from_inputs(const Context& c, int64_t i0, int64_t rows) {
  const Plan& plan = c.plan;
  load_rows(c.p.x, i0, rows, plan.logits_gemm, c.ws.x_block);
  for (int64_t r = 0; r < rows; ++r) {
    RowInfo& info = c.ws.rows[r];
    info = labelled_row(c, i0 + r);
    info.lse = load(c.p.lse, i0 + r);
    info.shift = info.lse;  // lse_parts without the row's max: lse, 0, 1
    set_grad_terms(c, i0 + r, &info);
  }
}

namespace {

// G at row r's label column, in double from its score s_y: the dlogits
// kernel's p_y term and the label term -(1-e) c_y g_loss together, through
// one ds/dz. Apart, the kernel's f32 slope 1 - t^2 and a double one differ
// by ~2^-24 t^2, which near the softcap's saturation is the slope itself,
// while p_y -> 1 cancels the rest (a 96% error at z = 5k).
double label_column_grad(const Context& c, const RowInfo& info, double s_y, double coef_c) {
  const Options& o = c.p.options;
  const double w_y = c.ws.class_w ? c.ws.class_w[info.y] : 1.0;
  const double p = std::exp((s_y - info.shift) - info.lse_d);
  double d = info.coef_p * p + coef_c * w_y - info.g_loss * (1 - o.label_smoothing) * w_y;
  if (info.g_ent != 0) d -= info.g_ent * (p == 0 ? 0.0 : p * ((s_y - info.shift) - info.sbar_d));
  const double dsdz = o.softcap > 0 ? 1 - (s_y / o.softcap) * (s_y / o.softcap) : 1.0;
  return o.logit_scale * dsdz * d;
}

// G for row r over the tile's columns j0 .. j0+n, in place over its scores s.
void row_tile_grad(const Context& c, float* s, int64_t r, int64_t j0, int64_t n) {
  const Plan& plan = c.plan;
  const Options& o = c.p.options;
  const RowInfo& info = c.ws.rows[r];
  simd::DlogitsParams q;
  q.lse = float(info.lse);
  q.coef_p = float(info.coef_p * info.p_scale);  // the kernel's p is e^(s - lse32)
  q.coef_c = plan.filter_uniform ? 0.0f : float(info.coef_c);  // G' = G - u c^T
  q.coef_h = float(info.g_ent * info.p_scale);
  q.shift = float(info.shift);  // the max, where sbar_d is finite
  q.sbar_d = float(info.sbar_d);
  q.scale = float(o.logit_scale);
  q.softcap = float(o.softcap);
  const bool label_here = !info.ignored && info.y >= j0 && info.y < j0 + n;
  // Before G overwrites it; packed scores were read back inexactly, but the
  // label's own was kept aside exactly.
  const double s_y = !label_here ? 0.0 : plan.packed_scores ? info.s_y : s[info.y - j0];
  plan.kernels->dlogits(s, c.ws.class_w ? c.ws.class_w + j0 : nullptr, n, &q, s);
  if (label_here && info.g_loss != 0)
    s[info.y - j0] = float(label_column_grad(c, info, s_y, plan.filter_uniform ? 0 : info.coef_c));
  if (plan.round_grad_logits) round_to_storage(s, n, plan.storage);
  if (plan.flush_subnormal_g) flush_subnormals(s, n);
}

// Whether any |g_j| exceeds tau (NaN counts as exceeding: it must reach the
// outputs).
bool any_above(const float* g, int64_t n, float tau) {
  bool above = false;
  for (int64_t j = 0; j < n; ++j) above |= !(std::fabs(g[j]) <= tau);
  return above;
}

// The filter's block counts for this row block.
void count_filtered(const Context& c) {
  c.stats->grad_blocks += c.plan.tiles;
  for (int64_t t = 0; t < c.plan.tiles; ++t) c.stats->grad_blocks_skipped += !c.ws.kept[t];
}

// The row block's share of label smoothing's rank-one term (Plan::
// filter_uniform): sum_i u_i x_i (rows in order, in double) and sum_i u_i.
void add_uniform_rows(const Context& c, int64_t i0, int64_t rows) {
  const int64_t H = c.plan.d.h;
  std::vector<double> x(size_t(H), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    const double u = c.ws.rows[r].uniform;
    c.ws.uniform_x[H] += u;
    if (u == 0 || !c.p.grad_w.present()) continue;
    load_row(c.p.x, i0 + r, x.data());
    for (int64_t h = 0; h < H; ++h) c.ws.uniform_x[h] += u * x[h];
  }
}

// grad_W rows j0 .. j0+n (+)= G_t^T X_block, G_t [rows, n] at G, rows ldg
// elements apart, in the gradient GEMMs' dtype.
void grad_w_gemm(const Context& c, const void* G, int64_t ldg, int64_t rows, int64_t j0, int64_t n) {
  const Plan& plan = c.plan;
  const int64_t H = plan.d.h;
  GemmArgs g{};
  g.ab_dtype = plan.grad_gemm;
  const bool bf16 = plan.grad_gemm == Dtype::bf16;
  const bool hv_direct = plan.grad_w_in_place && c.p.w_layout == WeightLayout::hv;
  if (hv_direct) {  // grad_W^T [H, n] += X_block^T [H, rows] G_t [rows, n]
    g.m = H, g.n = n, g.k = rows;
    g.a = c.ws.x_block_grad, g.lda = H, g.trans_a = true;
    g.b = G, g.ldb = ldg, g.trans_b = false;
    g.c = static_cast<float*>(c.p.grad_w.data) + j0, g.ldc = c.p.grad_w.stride[0];
  } else {  // grad_W [n, H] += G_t^T [n, rows] X_block [rows, H]
    // The shape the plan packed x for (bf16 G is the tile's compact copy,
    // lda kVocabTile; f32 G lies in the block, ldg apart).
    g = grad_w_tile_args(plan, c.p, rows, n);
    g.a = G, g.lda = ldg;
    g.b = g.b_packed ? c.ws.x_packed : c.ws.x_block_grad;
    g.c = plan.grad_w_in_place ? static_cast<float*>(c.p.grad_w.data) + j0 * c.p.grad_w.stride[0]
                               : c.ws.grad_w_acc + j0 * H;
  }
  // The tile's first GEMM writes its rows, no zeroing pass over grad_W first
  // (a fresh gradient buffer is then touched once, by its tile's owner).
  uint8_t& written = c.ws.w_written[j0 / kVocabTile];
  g.beta = written ? 1.0f : 0.0f;
  written = 1;
  // Either layout (both products are A^T B): the ISA's short-k kernel where
  // it has one (simd::KernelSet::gemm_tn, gemm_tn_bf16). oneDNN -> gemm_tn
  // in GFLOP/s on the 2-core Zen 5, 2 threads, [512, H] tiles of the [V, H]
  // layout, H = 768, 2304, 4096 (bench/gemm_engines.cpp): f32 k = 48:
  // 190-196 -> 344-368; k = 96: 256-266 -> 348-376; k = 240: 316-344 ->
  // 369-383. bf16: about twice as fast alone at k = 48 and 96; inside the
  // steps faster at k = 96, level at 240-256 (bf16_gemm_tn__avx512bf16.cpp).
  if (plan.grad_w_gemm_tn) {
    float* scratch = c.ws.gemm_tn_scratch + int64_t(omp_get_thread_num()) * simd::kGemmTnScratchFloats;
    if (bf16)
      plan.kernels->gemm_tn_bf16(g.m, g.n, g.k, static_cast<const uint16_t*>(g.a), g.lda,
                                 static_cast<const uint16_t*>(g.b), g.ldb, g.c, g.ldc, g.beta != 0.0f,
                                 scratch);
    else
      plan.kernels->gemm_tn(g.m, g.n, g.k, static_cast<const float*>(g.a), g.lda,
                            static_cast<const float*>(g.b), g.ldb, g.c, g.ldc, g.beta != 0.0f, scratch);
    return;
  }
  plan.gemm->run(g);
}

// The [R, kVocabTile] buffer for a copy of tile t's bf16 G
// (Workspace::g16_tiles): the tile's own in a vocab-outer chunk, else the
// thread's; null where G is not bf16 or there is no grad_W.
uint16_t* g16_tile(const Context& c, int64_t t) {
  if (!c.ws.g16_tiles) return nullptr;
  const int64_t slot = c.plan.vocab_outer ? t % c.plan.chunk_tiles : int64_t(omp_get_thread_num());
  return c.ws.g16_tiles + slot * c.plan.row_block * kVocabTile;
}

// A tile's rows of codes (Plan::packed_scores) lie a block row (2 V bytes)
// apart, out of the hardware prefetcher's reach, so each row's first read
// waited on memory; they are fetched kCodesAhead rows ahead instead. S1 bf16
// step, side by side (flce bench, 2 threads, two alternations of 0, 1, 2, 4
// and 8 rows ahead): 0.86-0.87 s with none, 0.79-0.80 s at 4.
constexpr int64_t kCodesAhead = 4;
void prefetch_codes(const uint16_t* codes, int64_t n) {
  for (int64_t j = 0; j < n; j += 32) __builtin_prefetch(codes + j, /*rw=*/1);
}

// Tile t of the block's scores becomes G in place (grad_logits written,
// the filter's verdict in ws.kept); its share of grad_bias and grad_W added.
// Packed scores (Plan::packed_scores) are read back a row at a time into
// f32, and the row's G goes back over its codes in bf16. bf16 G goes to
// grad_W's GEMM from a compact copy of the tile: with G's rows a block row
// apart (V or a chunk), AMX's bf16 grad_W product ran at about 620 GFLOP/s
// in the S1 step and 1150 on rows kVocabTile apart (bench/gemm_engines.cpp);
// grad_W's GEMM time in the S1 step went from 0.51 to 0.33 s a thread.
void tile_grads(const Context& c, const ScoreBlock& blk, int64_t i0, int64_t rows, int64_t t) {
  const Plan& plan = c.plan;
  const Problem& p = c.p;
  const int64_t j0 = t * kVocabTile, n = tile_width(plan, t);
  alignas(64) float unpacked[kVocabTile];
  uint16_t* const g16 = g16_tile(c, t);
  // Whether grad_x's GEMMs read bf16 G from the block afterwards (not from
  // the compact copy, Plan::grad_x_by_tile).
  const bool g_in_block = p.grad_x.present() && !plan.grad_x_by_tile;
  bool keep = !plan.filter;  // the filter keeps the tile if any row needs it
  for (int64_t r = 0; r < rows; ++r) {
    float* g = plan.packed_scores ? unpacked : blk.at(r, j0);
    if (plan.packed_scores && r + kCodesAhead < rows) prefetch_codes(blk.codes(r + kCodesAhead, j0), n);
    if (plan.packed_scores)
      plan.kernels->unpack_scores(blk.codes(r, j0), n, c.ws.score_refs[r * plan.tiles + t], g);
    row_tile_grad(c, g, r, j0, n);
    if (plan.filter) keep = keep || any_above(g, n, float(c.ws.rows[r].filter_tau));
    if (p.grad_logits.present())
      for (int64_t j = 0; j < n; ++j) store(p.grad_logits, i0 + r, j0 + j, g[j]);
    if (c.ws.grad_b_acc)  // rows in order, as every other sum
      for (int64_t j = 0; j < n; ++j) c.ws.grad_b_acc[j0 + j] += g[j];
    if (plan.packed_scores) {  // to the copy, and over the codes where grad_x reads it there
      uint16_t* g_row = g16 ? g16 + r * kVocabTile : blk.codes(r, j0);
      f32_to_bf16_bits(g, n, g_row);
      if (g16 && g_in_block) std::memcpy(blk.codes(r, j0), g_row, size_t(n) * 2);
    }
  }
  if (plan.filter) c.ws.kept[t] = keep;
  const bool gemms = !plan.d.logits_entry && keep;
  if (gemms && plan.grad_gemm == Dtype::bf16 && !plan.packed_scores)  // G to bf16 (Workspace::scores)
    for (int64_t r = 0; r < rows; ++r) {
      if (!g_in_block && g16) {  // only the copy is read
        f32_to_bf16_bits(blk.at(r, j0), n, g16 + r * kVocabTile);
        continue;
      }
      f32_to_bf16_in_place(blk.at(r, j0), n);
      if (g16) std::memcpy(g16 + r * kVocabTile, blk.bf16_tile(r, j0), size_t(n) * 2);
    }
  if (!p.grad_w.present() || !gemms) return;
  if (g16)
    grad_w_gemm(c, g16, kVocabTile, rows, j0, n);
  else
    grad_w_gemm(c, blk.at(0, j0), blk.ld, rows, j0, n);
}

// Moves each row's bf16 G tiles t0+1 .. t1 left, next to tile t0's
// (Workspace::scores). In tile order every destination ends before the next
// tile's source starts.
void compact_bf16_rows(const Context& c, const ScoreBlock& blk, int64_t rows, int64_t t0, int64_t t1) {
  const Plan& plan = c.plan;
  parallel_for(plan.threads, 0, rows, [&](int64_t r) {
    auto* row = reinterpret_cast<uint16_t*>(blk.at(r, blk.j_begin));
    for (int64_t t = t0 + 1; t < t1; ++t) {
      const int64_t j = t * kVocabTile - blk.j_begin;
      std::memmove(row + j, row + 2 * j, size_t(tile_width(plan, t)) * 2);
    }
  });
}

// The x rows in the gradient GEMMs' dtype, where it differs from the
// logits'; and packed for grad_W's products (Plan::grad_w_packed_x).
void load_grad_rows(const Context& c, int64_t i0, int64_t rows) {
  const Plan& plan = c.plan;
  if (!plan.d.logits_entry && plan.grad_gemm != plan.logits_gemm)
    load_rows(c.p.x, i0, rows, plan.grad_gemm, c.ws.x_block_grad);
  GemmArgs g = grad_w_tile_args(plan, c.p, rows, kVocabTile);
  if (!g.b_packed) return;
  g.b_packed = false;  // what pack_b reads: the plain rows
  g.b = c.ws.x_block_grad;
  plan.gemm->pack_b(g, c.ws.x_packed);
}

// part [rows, H] (+)= G_t W_t for tile t (Plan::grad_x_by_tile), G_t the
// thread's compact bf16 copy of the tile.
void grad_x_tile_gemm(const Context& c, int64_t rows, int64_t t, bool first, float* part) {
  const Plan& plan = c.plan;
  const int64_t H = plan.d.h, j0 = t * kVocabTile, n = tile_width(plan, t);
  const WPiece w = w_piece(c.p.w, c.p.w_layout, j0, n, 0, H, plan.grad_gemm, thread_scratch(c));
  GemmArgs g{};
  g.m = rows, g.n = H, g.k = n;
  g.ab_dtype = plan.grad_gemm;
  g.a = g16_tile(c, t), g.lda = kVocabTile, g.trans_a = false;
  g.b = w.data, g.ldb = w.ld, g.trans_b = !w.vocab_major;
  g.c = part, g.ldc = H, g.beta = first ? 0.0f : 1.0f;
  plan.gemm->run(g);
}

// Plan::grad_x_by_tile: one task per grad_x part, which owns tiles task,
// task + kGradXTasks, ..., in order, each tile's grad_x product after
// tile_grads. Dealt round, not in ranges, so that the tiles a gradient
// filter keeps, which crowd at the frequent classes' end of a trained
// head's vocabulary, spread over the tasks (the peaky head's filtered S1
// step measured the same either way, 0.42-0.44 s). A part whose every tile
// was dropped is zeroed.
void tile_grads_by_part(const Context& c, const ScoreBlock& blk, int64_t i0, int64_t rows) {
  const Plan& plan = c.plan;
  const int64_t H = plan.d.h;
  parallel_for(plan.threads, 0, kGradXTasks, [&](int64_t task) {
    float* part = c.ws.grad_x_parts + task * rows * H;
    bool first = true;
    for (int64_t t = task; t < plan.tiles; t += kGradXTasks) {
      tile_grads(c, blk, i0, rows, t);
      if (plan.filter && !c.ws.kept[t]) continue;
      grad_x_tile_gemm(c, rows, t, first, part);
      first = false;
    }
    if (first) std::fill_n(part, rows * H, 0.0f);
  });
}

}  // namespace

void grad_logits_and_weights(const Context& c, int64_t i0, int64_t rows) {
  const Plan& plan = c.plan;
  const ScoreBlock blk{c.ws.scores, plan.scores_ld, 0};
  load_grad_rows(c, i0, rows);
  if (plan.grad_x_by_tile) {
    tile_grads_by_part(c, blk, i0, rows);
  } else {
    parallel_for(plan.threads, 0, plan.tiles, [&](int64_t t) { tile_grads(c, blk, i0, rows, t); });
  }
  if (plan.filter) count_filtered(c);
  if (plan.filter_uniform) add_uniform_rows(c, i0, rows);
  if (plan.compact_bf16_g) compact_bf16_rows(c, blk, rows, 0, plan.tiles);
}

namespace {

// out[r0 .. r0+m, h0 .. h0+width] (+)= G[r0 .., tiles t0 .. t1] W[.., h0 ..]
// over the kept vocab tiles (all of them unless the gradient filter dropped
// some), out an [R, H] buffer; `accumulate` adds to what it holds. With W
// read in place and G contiguous along rows, one GEMM per run of
// consecutive kept tiles; else one per tile, in order (W pieces are
// converted tile by tile; bf16 G not compacted lies tile by tile).
void grad_hidden_task(const Context& c, const ScoreBlock& blk, int64_t r0, int64_t m, int64_t h0,
                      int64_t width, int64_t t_begin, int64_t t_end, bool accumulate, float* out) {
  const Plan& plan = c.plan;
  const int64_t H = plan.d.h, V = plan.d.v;
  const bool bf16 = plan.grad_gemm == Dtype::bf16;
  const bool tile_by_tile =  // Plan::compact_bf16_g
      !w_in_place(c.p.w, plan.grad_gemm) || (bf16 && !plan.g16_by_rows());
  auto kept = [&](int64_t t) { return !plan.filter || c.ws.kept[t]; };
  bool first = !accumulate;
  for (int64_t t0 = t_begin; t0 < t_end;) {
    if (!kept(t0)) {
      ++t0;
      continue;
    }
    int64_t t1 = t0 + 1;
    if (!tile_by_tile)
      while (t1 < t_end && kept(t1)) ++t1;
    const int64_t j0 = t0 * kVocabTile, n = std::min(t1 * kVocabTile, V) - j0;
    const WPiece w = w_piece(c.p.w, c.p.w_layout, j0, n, h0, width, plan.grad_gemm, thread_scratch(c));
    GemmArgs g{};
    g.m = m, g.n = width, g.k = n;
    g.ab_dtype = plan.grad_gemm;
    if (bf16) {
      g.a = plan.g16_by_rows() ? blk.bf16_rows(r0, j0) : blk.bf16_tile(r0, j0);
      g.lda = 2 * blk.ld;
    } else {
      g.a = blk.at(r0, j0), g.lda = blk.ld;
    }
    g.trans_a = false;
    g.b = w.data, g.ldb = w.ld, g.trans_b = !w.vocab_major;
    g.c = out + r0 * H + h0, g.ldc = H;
    g.beta = first ? 0.0f : 1.0f;
    plan.gemm->run(g);
    first = false;
    t0 = t1;
  }
  if (first)  // every tile filtered out
    for (int64_t r = r0; r < r0 + m; ++r) std::fill_n(out + r * H + h0, width, 0.0f);
}

// ws.grad_x_block (+)= grad_x parts task0 .. kGradXTasks, row by row in
// task order. Plan::grad_x_by_tile: grad_x_block is part 0, and parts 1 ..
// are added to it, the same sums.
void add_grad_x_parts(const Context& c, int64_t rows, int64_t task0, bool accumulate) {
  const int64_t H = c.plan.d.h;
  parallel_for(c.plan.threads, 0, rows, [&](int64_t r) {
    float* g = c.ws.grad_x_block + r * H;
    if (!accumulate) std::fill_n(g, H, 0.0f);
    for (int64_t task = task0; task < kGradXTasks; ++task) {
      const float* q = c.ws.grad_x_parts + (task * rows + r) * H;
      for (int64_t h = 0; h < H; ++h) g[h] += q[h];
    }
  });
}

// grad_x_block (+)= G W over tiles t0 .. t1 as kGradXTasks products over
// runs of tiles (Plan::grad_x_vocab_split), each into its own part, then the
// parts added row by row in task order: the same sums whatever the threads.
void grad_hidden_by_vocab(const Context& c, const ScoreBlock& blk, int64_t rows, int64_t t0,
                          int64_t t1, bool accumulate) {
  const Plan& plan = c.plan;
  const int64_t H = plan.d.h, per_task = (t1 - t0 + kGradXTasks - 1) / kGradXTasks;
  const auto part = [&](int64_t task) { return c.ws.grad_x_parts + task * rows * H; };
  parallel_for(plan.threads, 0, kGradXTasks, [&](int64_t task) {
    const int64_t a = std::min(t1, t0 + task * per_task), b = std::min(t1, a + per_task);
    grad_hidden_task(c, blk, 0, rows, 0, H, a, b, false, part(task));
  });
  add_grad_x_parts(c, rows, 0, accumulate);
}

// grad_x_block (+)= G W over tiles t0 .. t1, one owner per (row group,
// hidden chunk) task of the Plan, or split over the vocabulary.
void grad_hidden_tasks(const Context& c, const ScoreBlock& blk, int64_t rows, int64_t t0, int64_t t1,
                       bool accumulate) {
  const Plan& plan = c.plan;
  if (plan.grad_x_vocab_split) return grad_hidden_by_vocab(c, blk, rows, t0, t1, accumulate);
  const int64_t H = plan.d.h;
  const int64_t group = (rows + plan.row_groups - 1) / plan.row_groups;
  const int64_t row_groups = (rows + group - 1) / group;
  parallel_for(plan.threads, 0, row_groups * plan.h_chunks, [&](int64_t task) {
    const int64_t r0 = (task / plan.h_chunks) * group, m = std::min(group, rows - r0);
    const int64_t h0 = (task % plan.h_chunks) * plan.h_chunk, width = std::min(plan.h_chunk, H - h0);
    grad_hidden_task(c, blk, r0, m, h0, width, t0, t1, accumulate, c.ws.grad_x_block);
  });
}

}  // namespace

void grad_hidden(const Context& c, int64_t i0, int64_t rows) {
  if (c.plan.grad_x_by_tile)
    add_grad_x_parts(c, rows, 1, /*accumulate=*/true);
  else
    grad_hidden_tasks(c, ScoreBlock{c.ws.scores, c.plan.scores_ld, 0}, rows, 0, c.plan.tiles, false);
  store_grad_x(c, i0, rows);
}

void store_grad_x(const Context& c, int64_t i0, int64_t rows) {
  const Plan& plan = c.plan;
  const int64_t H = plan.d.h;
  for (int64_t r = 0; r < rows; ++r) {
    const double u = plan.filter_uniform ? c.ws.rows[r].uniform : 0.0;  // + u_i sum_j c_j W_j
    if (u == 0) {
      store_row(c.p.grad_x, i0 + r, c.ws.grad_x_block + r * H, H);
      continue;
    }
    for (int64_t h = 0; h < H; ++h)
      store(c.p.grad_x, i0 + r, h, c.ws.grad_x_block[r * H + h] + u * c.ws.uniform_w[h]);
  }
}

void grad_vocab_chunk(const Context& c, int64_t i0, int64_t rows, int64_t t0, int64_t t1) {
  const Plan& plan = c.plan;
  const ScoreBlock blk{c.ws.scores, plan.scores_ld, t0 * kVocabTile};
  if (t0 == 0) load_grad_rows(c, i0, rows);
  // The whole chunk first: a grad_W written in place may reach over the
  // stash of this chunk's later tiles (never of a later chunk's).
  if (plan.stash_scores) {
    parallel_for(plan.threads, t0, t1, [&](int64_t t) {
      stash_tile(c, blk.at(0, t * kVocabTile), blk.ld, 0, rows, t, /*back=*/true);
    });
  }
  parallel_for(plan.threads, t0, t1, [&](int64_t t) {
    const int64_t j0 = t * kVocabTile, n = tile_width(plan, t);
    if (!plan.stash_scores) {
      logits_gemm(c, rows, j0, n, blk.at(0, j0), blk.ld);
      scores_in_place(c, blk.at(0, j0), blk.ld, rows, j0, n);
    }
    tile_grads(c, blk, i0, rows, t);
  });
  if (!c.p.grad_x.present()) return;
  if (plan.compact_bf16_g) compact_bf16_rows(c, blk, rows, t0, t1);
  grad_hidden_tasks(c, blk, rows, t0, t1, /*accumulate=*/t0 > 0);
}

}  // namespace flce::cpu
