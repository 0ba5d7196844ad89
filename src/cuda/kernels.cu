// The `cuda` backend's kernels (kernels.h has the contract of each).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <utility>

#include "common/row_terms.h"
#include "cuda/kernels.h"
#include "cuda/softmax_state.cuh"

namespace flce::cuda {
namespace {

constexpr int kThreads = 256;       // per block, for the elementwise kernels
constexpr int kWideThreads = 1024;  // the single-block reductions

// ---- element access --------------------------------------------------------

__device__ double load_at(const DView& t, int64_t off) {
  switch (Dtype(t.dtype)) {
    case Dtype::f32: return static_cast<const float*>(t.data)[off];
    case Dtype::f64: return static_cast<const double*>(t.data)[off];
    case Dtype::bf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(t.data)[off]);
    case Dtype::f16: return __half2float(static_cast<const __half*>(t.data)[off]);
    case Dtype::i32: return static_cast<const int32_t*>(t.data)[off];
    case Dtype::i64: return double(static_cast<const int64_t*>(t.data)[off]);
  }
  return NAN;
}

__device__ void store_at(const DView& t, int64_t off, double v) {
  switch (Dtype(t.dtype)) {
    case Dtype::f32: static_cast<float*>(t.data)[off] = float(v); break;
    case Dtype::f64: static_cast<double*>(t.data)[off] = v; break;
    case Dtype::bf16: static_cast<__nv_bfloat16*>(t.data)[off] = __double2bfloat16(v); break;
    case Dtype::f16: static_cast<__half*>(t.data)[off] = __double2half(v); break;
    case Dtype::i32: static_cast<int32_t*>(t.data)[off] = int32_t(v); break;
    case Dtype::i64: static_cast<int64_t*>(t.data)[off] = int64_t(v); break;
  }
}

__device__ double load1(const DView& t, int64_t i) { return load_at(t, i * t.s0); }
__device__ void store1(const DView& t, int64_t i, double v) { store_at(t, i * t.s0, v); }
__device__ double opt1(const DView& t, int64_t i, double absent) {
  return t.present() ? load1(t, i) : absent;
}

// Fixed-shape tree over the block's threads: the result in thread 0.
template <typename T, typename Combine>
__device__ T block_reduce(T value, T* shared, Combine combine) {
  const int tid = threadIdx.x;
  shared[tid] = value;
  __syncthreads();
  for (int width = blockDim.x / 2; width > 0; width /= 2) {
    if (tid < width) shared[tid] = combine(shared[tid], shared[tid + width]);
    __syncthreads();
  }
  return shared[0];
}

// ---- kernels ------------------------------------------------------------------

__global__ void prepare_kernel(LossArgs g) {
  __shared__ double sums[kWideThreads];
  __shared__ int64_t firsts[kWideThreads];
  const auto add = [](double a, double b) { return a + b; };
  const auto lowest = [](int64_t a, int64_t b) { return a < b ? a : b; };
  const int tid = threadIdx.x;

  double class_sum = 0;
  int64_t bad_class = INT64_MAX;
  for (int64_t j = tid; j < g.v; j += blockDim.x) {
    const double c = opt1(g.class_weights, j, 1.0);
    if (!(isfinite(c) && c >= 0) && bad_class == INT64_MAX) bad_class = j;
    class_sum += c;
  }
  double denom = 0;
  int64_t bad_label = INT64_MAX, bad_token = INT64_MAX;
  for (int64_t i = tid; i < g.n; i += blockDim.x) {
    const int64_t y = load_int(g.labels, i);
    const double t = opt1(g.token_weights, i, 1.0);
    if (!(isfinite(t) && t >= 0) && bad_token == INT64_MAX) bad_token = i;
    if (y == g.ignore_index) continue;
    if (y < 0 || y >= g.v) {
      if (bad_label == INT64_MAX) bad_label = i;
      continue;
    }
    denom += t * opt1(g.class_weights, y, 1.0);
  }
  class_sum = block_reduce(class_sum, sums, add);
  __syncthreads();
  denom = block_reduce(denom, sums, add);
  __syncthreads();
  bad_class = block_reduce(bad_class, firsts, lowest);
  __syncthreads();
  bad_label = block_reduce(bad_label, firsts, lowest);
  __syncthreads();
  bad_token = block_reduce(bad_token, firsts, lowest);
  if (tid == 0) *g.scalars = Scalars{class_sum, denom, bad_label, bad_token, bad_class};
}


// Threads per row in tile_states: one warp (each thread folds 128 columns
// of a 4096-wide tile before the merges, and no merge crosses warps); eight
// rows share a block. Two warps a row measured the same on an H100.
constexpr int kStateThreads = 32;
constexpr int kWarps = kStateThreads / 32;
constexpr int kStateRows = 8;
constexpr int kQuadsInFlight = 4;  // loads in flight per thread (tile_states_kernel)

// Four adjacent columns c .. c+3 of a row (n <= 4 of them inside the tile):
// one 16-byte load when the row is 16-byte aligned and all four are in.
struct Quad {
  float v[4];
  Quad() = default;
  __device__ Quad(const float* row, int c, int n, bool aligned) {
    if (aligned && n == 4) {
      const float4 q = *reinterpret_cast<const float4*>(row + c);
      v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) v[k] = k < n ? row[c + k] : 0.0f;
    }
  }
};

// Codes of the n <= 4 scores s from column c: one 8-byte store when aligned
// and full.
__device__ void store_codes(uint16_t* codes, int c, int n, float ref, const float s[4],
                            bool aligned) {
  alignas(8) uint16_t h[4];  // read as one uint2 below
#pragma unroll
  for (int k = 0; k < 4; ++k) h[k] = stash_code(ref, s[k]);
  if (aligned && n == 4) {
    *reinterpret_cast<uint2*>(codes + c) = *reinterpret_cast<const uint2*>(h);
    return;
  }
  for (int k = 0; k < n; ++k) codes[c + k] = h[k];
}

// The first NaN score among this thread's quads of a row (the walk of
// tile_states_kernel), or -1. Run only when the thread's sum_exp came out
// NaN, which a NaN score always causes and nothing else can: exp of a score
// relative to the max is finite or +inf, and sum_exp >= 1 once a finite max
// is seen, so a rescale by +inf cannot make 0 * inf. The hot loop then
// needs no NaN test per column.
template <bool kSoftcap>
__device__ int first_nan_column(const float* u, const TileParams& q, int tid, int cols) {
  for (int c = 4 * tid; c < cols; c += 4 * kStateThreads)
    for (int k = 0; k < 4 && c + k < cols; ++k) {
      const float z = q.a * (q.bias ? u[c + k] + q.bias[c + k] : u[c + k]);
      if (isnan(kSoftcap ? q.k * tanhf(z * q.poly.inv_k) : z)) return c + k;
    }
  return -1;
}

// kStateRows rows of the tile per block, kStateThreads threads per row.
// Thread t takes the column quads 4t, 4t + 128, ..., kQuadsInFlight loads at
// a time: a tile's 4096 rows fill only about half an H100's thread slots,
// so each thread needs several loads in flight (torch.profiler, one run, us
// a 4096 x 4096 tile with 1, 2, 4 in flight: 37.2, 32.3, 30.9 at the Llama-3
// head, 45.0, 39.8, 38.9 at the Gemma head). One vector load, one group max
// and (rarely) one rescale per quad; exps, sums, argmax and label
// checks per quad rather than per column where they can be, the NaN search
// after the loop (first_nan_column). The states merge by a warp butterfly,
// then a row's first thread folds its warps in order. What a call does not
// need is compiled out: sum_exp_d (kSbar: entropy or grad_entropy), sum_cs
// (kSumCs: label smoothing), the softcap, and the scale and bias (kRaw: a = 1,
// no bias). Columns stay 32-bit and tile-relative until the merge. Those
// cuts, with one load in flight, took the softcapped kernel 56 -> 50 us a
// tile (Nsight Compute at the Gemma head on an H100, 22% fewer instructions).
template <bool kSbar, bool kSumCs, bool kSoftcap, bool kRaw = false>
__global__ void tile_states_kernel(LossArgs g, ScoreTile tile, int64_t t, int64_t tiles,
                                   int64_t state_r0, TileState* states) {
  __shared__ State warps[kStateRows][kWarps];
  const int row_in_block = threadIdx.x / kStateThreads, tid = threadIdx.x % kStateThreads;
  const int64_t r = int64_t(blockIdx.x) * kStateRows + row_in_block, i = tile.r0 + r;
  const bool live = r < tile.rows;  // no early return: the block meets at a barrier
  const float* u = tile.u + r * tile.ld;
  const TileParams q(g, tile.j0);
  const int cols = live ? int(tile.cols) : 0;
  const int y_col = live ? label_column(load_int(g.labels, i), tile.j0, cols) : -1;
  const bool aligned = reinterpret_cast<uintptr_t>(u) % 16 == 0;
  const bool bias_aligned = reinterpret_cast<uintptr_t>(q.bias) % 16 == 0;
  float max = -kInf, sum_exp = 0, sum_exp_d = 0, sum_cs = 0;
  int arg_c = -1;
  // The scores of the quad of n <= 4 columns from c, whose raw logits are
  // uq (-inf past n).
  auto scores = [&](const Quad& uq, int c, int n, float s[4]) {
    const Quad bq = !kRaw && q.bias ? Quad(q.bias, c, n, bias_aligned) : uq;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float z = kRaw ? uq.v[k] : q.a * (q.bias ? uq.v[k] + bq.v[k] : uq.v[k]);
      s[k] = k < n ? (kSoftcap ? q.k * tanhf(z * q.poly.inv_k) : z) : -kInf;
    }
  };
  // Folds that quad.
  auto fold = [&](const Quad& uq, int c, int n) {
    float s[4];
    scores(uq, c, n, s);
    float group_max = -kInf;
#pragma unroll
    for (int k = 0; k < 4; ++k) group_max = fmaxf(group_max, s[k]);  // fmaxf ignores NaN
    if (group_max > max) {  // one rescale per quad, when the max rises
      const float delta = shift_of(max) - shift_of(group_max);
      const float f = max == -kInf ? 0.0f : exp_of(delta);
      if (kSbar) sum_exp_d = moved_sum_exp_d(sum_exp_d, sum_exp, f, delta);
      sum_exp *= f;
      max = group_max;
      arg_c = -1;
    }
    const float shift = shift_of(max);
    const ExpOffset offset = exp_offset(shift);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      // Padding is -inf: exp gives 0. A NaN poisons the sums, as on the cpu;
      // the lse of such a row is NaN by first_nan whatever the sums hold.
      const float e = exp_at(s[k], offset);
      sum_exp += e;
      if (kSbar) sum_exp_d += e == 0 ? 0.0f : e * (s[k] - shift);
      if (kSumCs && k < n) {
        const float cw = q.class_weight(c + k);
        sum_cs += cw * s[k];  // 0 * inf is NaN, as the semantics' c_j logp_j
      }
    }
    if (group_max == max && arg_c < 0) {  // columns rise within a thread: the first wins
#pragma unroll
      for (int k = 3; k >= 0; --k)
        if (s[k] == max) arg_c = c + k;
    }
    if (unsigned(y_col - c) < unsigned(n)) {  // (unrolled: s[] stays in registers)
#pragma unroll
      for (int k = 0; k < 4; ++k)
        if (c + k == y_col) g.rows[i].s_y = s[k];
    }
  };
  // kQuadsInFlight quads a step, all loaded before the first is folded: as
  // many loads in flight per thread, in the same column order as one quad a
  // step (a quad with n <= 0 columns loads nothing and is skipped).
  constexpr int kStride = 4 * kStateThreads;
  for (int c = 4 * tid; c < cols; c += kQuadsInFlight * kStride) {
    int n[kQuadsInFlight];
    Quad uq[kQuadsInFlight];
#pragma unroll
    for (int j = 0; j < kQuadsInFlight; ++j) {
      const int cj = c + j * kStride;
      n[j] = cols - cj < 4 ? cols - cj : 4;
      uq[j] = Quad(u, cj, n[j], aligned);
    }
#pragma unroll
    for (int j = 0; j < kQuadsInFlight; ++j)
      if (n[j] > 0) fold(uq[j], c + j * kStride, n[j]);
  }
  State st;
  st.max = max, st.sum_exp = sum_exp, st.sum_exp_d = sum_exp_d, st.sum_cs = sum_cs;
  st.argmax = arg_c < 0 ? -1 : tile.j0 + arg_c;
  const int nan_c = isnan(sum_exp) ? first_nan_column<kSoftcap>(u, q, tid, cols) : -1;
  st.first_nan = nan_c < 0 ? -1 : tile.j0 + nan_c;
  st = warp_merge(st);  // every lane holds the row's state (one warp a row)
  if (tile.stash.present() && live) {
    // The row's codes, from the tile again (read moments ago: mostly L2).
    static_assert(kWarps == 1, "the stash needs the row's max in every lane");
    const float ref = shift_of(st.max);
    uint16_t* codes = tile.stash.codes + r * tile.stash.codes_ld;
    const bool codes_aligned = reinterpret_cast<uintptr_t>(codes) % 8 == 0;
    for (int c = 4 * tid; c < cols; c += kStride) {
      const int n = cols - c < 4 ? cols - c : 4;
      float sc[4];
      scores(Quad(u, c, n, aligned), c, n, sc);
      store_codes(codes, c, n, ref, sc, codes_aligned);
    }
    if (tid == 0) tile.stash.refs[r * tile.stash.refs_ld] = ref;
  }
  const int warp = tid / 32;
  if (tid % 32 == 0) warps[row_in_block][warp] = st;
  __syncthreads();
  if (tid != 0 || !live) return;
  st = warps[row_in_block][0];
  for (int w = 1; w < kWarps; ++w) st.merge(warps[row_in_block][w]);
  states[(i - state_r0) * tiles + t] =
      TileState{st.max, st.sum_exp, st.sum_exp_d, st.sum_cs, st.argmax, st.first_nan};
}

// The row's max so far and where it is (arg -1: not yet). Of two, the
// larger max wins and, on a tie, the lower class: the first tile in class
// order that reaches the row's max, as a scan in tile order finds it.
struct MaxAt {
  float max = -kInf;
  int64_t arg = -1;
  __device__ void merge(float m, int64_t a) {
    if (a < 0) return;
    if (arg < 0 || m > max || (m == max && a < arg)) max = m, arg = a;
  }
};

// A warp's total of v in a fixed butterfly: every lane gets the same bits
// on every run (a + b and b + a round alike).
__device__ double warp_sum(double v) {
  for (int width = 16; width > 0; width /= 2) v += __shfl_xor_sync(0xffffffffu, v, width);
  return v;
}

// A row's tile states -> lse, the forward outputs, RowInfo, in double (as
// src/cpu/steps.cpp merges them). One warp per row: lane l folds tiles l,
// l + 32, ... in order, then the lanes combine in a fixed butterfly (a
// thread per row walking 100-odd uncoalesced 32-byte states was
// latency-bound: 178 us at the Gemma-2 head).
constexpr int kMergeRowsPerBlock = 4;

__global__ void merge_rows_kernel(LossArgs g, const TileState* states, int64_t tiles, int64_t r0,
                                  int64_t rows, bool have_states) {
  const int64_t r = blockIdx.x * int64_t(kMergeRowsPerBlock) + threadIdx.x / 32;
  if (r >= rows) return;  // the whole warp
  const int lane = threadIdx.x % 32;
  const int64_t i = r0 + r;
  const Scalars sc = *g.scalars;
  double max = -INFINITY, sum_exp = 0, sum_cs = 0;
  int64_t argmax = 0, first_nan = -1;
  const TileState* st = states + r * tiles;
  if (have_states) {
    MaxAt at;
    float m = -kInf;
    for (int64_t t = lane; t < tiles; t += 32) {
      first_nan = min_index(first_nan, st[t].first_nan);
      at.merge(st[t].max, st[t].argmax);
      m = fmaxf(m, st[t].max);
      sum_cs += st[t].sum_cs;
    }
    for (int width = 16; width > 0; width /= 2) {
      first_nan = min_index(first_nan, __shfl_xor_sync(0xffffffffu, first_nan, width));
      at.merge(__shfl_xor_sync(0xffffffffu, at.max, width),
               __shfl_xor_sync(0xffffffffu, at.arg, width));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, width));
    }
    sum_cs = warp_sum(sum_cs);
    if (at.arg >= 0) argmax = at.arg;
    max = m;
    for (int64_t t = lane; t < tiles; t += 32)
      if (st[t].max != -kInf) sum_exp += double(st[t].sum_exp) * exp(double(st[t].max) - max);
    sum_exp = warp_sum(sum_exp);
  }
  const double formed = merged_lse(first_nan >= 0, max, sum_exp);  // the lse of these states
  const double lse = g.backward ? load1(g.lse_in, i) : formed;
  // p, logp and the entropy from differences to the max, as the oracle's
  // (row_terms.h, lse_parts); a saved lse with other bits than these
  // states' is taken as given. Without states the max is -inf.
  const LseParts parts = lse_parts(lse, max, sum_exp, lse == formed);
  // sbar_d = sum_j p_j (s_j - max); the entropy lse_d - sbar_d
  // (row_terms.h, tile_mean_score_d).
  double sbar_d = 0;
  if (have_states) {
    if (max == INFINITY || max == -INFINITY) {  // every p_j is inf - inf: NaN, as the oracle's
      sbar_d = NAN;
    } else if (g.need_sbar) {
      for (int64_t t = lane; t < tiles; t += 32)
        sbar_d += tile_mean_score_d(st[t].max, st[t].sum_exp, st[t].sum_exp_d, max, parts.lse_d);
      sbar_d = warp_sum(sbar_d);
    }
  }
  if (lane != 0) return;
  const int64_t y = load_int(g.labels, i);
  const bool ignored = y == g.ignore_index;
  const double t_i = opt1(g.token_weights, i, 1.0);
  const double c_y = ignored ? 0.0 : opt1(g.class_weights, y, 1.0);
  RowInfo& info = g.rows[i];
  const double s_y = ignored || !have_states ? 0.0 : info.s_y;

  // Cotangents and the dlogits coefficients.
  double g_loss = 0;
  if (!ignored) {
    const double scale = g.grad_loss.present() ? load1(g.grad_loss, g.reduction == 0 ? i : 0) : 1.0;
    if (g.reduction == int(Reduction::mean)) g_loss = sc.denom == 0 ? 0.0 : scale / sc.denom;
    else g_loss = scale;
    g_loss *= t_i;
  }
  const double g_lse = opt1(g.grad_lse, i, 0.0), g_ent = opt1(g.grad_entropy, i, 0.0);
  const LossConstants k{g.e, double(g.v), sc.class_sum, g.l};
  info.lse = lse;
  info.shift = parts.shift;  // the max, where sbar_d is finite
  info.sbar_d = sbar_d;
  // The kernels' p is e^(s - lse32) (DlogitsRow), times p_scale: e^(s - lse).
  info.coef_p = grad_coef_p(k, g_loss, c_y, lse, g_lse) * parts.p_scale;
  info.coef_c = grad_coef_c(k, g_loss);
  info.coef_h = g_ent * parts.p_scale;
  info.label_coef = g_loss * (1 - g.e) * c_y;
  info.y = ignored ? -1 : y;
  if (g.backward) return;

  const double logp_y = ignored ? 0.0 : (s_y - parts.shift) - parts.lse_d;
  const double loss = row_loss(k, ignored, t_i, c_y, logp_y, sum_cs, lse);
  g.row_loss[i] = loss;
  store1(g.lse, i, lse);
  if (g.logprob.present()) store1(g.logprob, i, logp_y);
  if (g.argmax.present()) store1(g.argmax, i, double(first_nan >= 0 ? first_nan : argmax));
  if (g.entropy.present()) store1(g.entropy, i, parts.lse_d - sbar_d);
  if (g.zloss.present()) store1(g.zloss, i, z_loss_term(k, lse));
  if (g.reduction == int(Reduction::none)) store1(g.loss, i, loss);
}

__global__ void reduce_loss_kernel(LossArgs g) {
  __shared__ double sums[kWideThreads];
  double total = 0;
  for (int64_t i = threadIdx.x; i < g.n; i += blockDim.x) total += g.row_loss[i];
  total = block_reduce(total, sums, [](double a, double b) { return a + b; });
  if (threadIdx.x != 0) return;
  if (g.reduction == int(Reduction::mean)) {
    const double d = g.scalars->denom;
    total = d == 0 ? 0.0 : total / d;
  }
  store_at(g.loss, 0, total);
}

// One value of G rounded to a 16-bit dtype (f32 goes through store_quad<float>).
template <typename T>
__device__ void store_g(void* out, int64_t o, float v);
template <>
__device__ void store_g<__nv_bfloat16>(void* out, int64_t o, float v) {
  static_cast<__nv_bfloat16*>(out)[o] = __float2bfloat16_rn(v);
}
template <>
__device__ void store_g<__half>(void* out, int64_t o, float v) {
  static_cast<__half*>(out)[o] = __float2half_rn(v);
}

// Four values of G stored at g[c .. c+n): one 8- or 16-byte store when
// aligned and full.
template <typename T>
__device__ void store_quad(T* g, int c, int n, const float v[4], bool aligned);
template <>
__device__ void store_quad<float>(float* g, int c, int n, const float v[4], bool aligned) {
  if (aligned && n == 4) {
    *reinterpret_cast<float4*>(g + c) = make_float4(v[0], v[1], v[2], v[3]);
    return;
  }
  for (int k = 0; k < n; ++k) g[c + k] = v[k];
}
template <typename T16>
__device__ void store_quad16(T16* g, int c, int n, const float v[4], bool aligned) {
  alignas(8) T16 h[4];  // read as one uint2 below
#pragma unroll
  for (int k = 0; k < 4; ++k) store_g<T16>(h, k, v[k]);
  if (aligned && n == 4) {
    *reinterpret_cast<uint2*>(g + c) = *reinterpret_cast<const uint2*>(h);
    return;
  }
  for (int k = 0; k < n; ++k) g[c + k] = h[k];
}
template <>
__device__ void store_quad<__nv_bfloat16>(__nv_bfloat16* g, int c, int n, const float v[4],
                                          bool aligned) {
  store_quad16(g, c, n, v, aligned);
}
template <>
__device__ void store_quad<__half>(__half* g, int c, int n, const float v[4], bool aligned) {
  store_quad16(g, c, n, v, aligned);
}

// Threads per row in dlogits: each takes 8 quads of a 4096-wide tile.
constexpr int kDlogitsThreads = 128;

// G of a stashed row (16-bit, never the logits entry): eight columns a
// thread at a time, one 16-byte load of codes and one 16-byte store of G
// where aligned. With four (8-byte accesses) the Llama-3 head's decode moved
// about 1.8 TB/s on an H100. Columns [c, c + 8) share one ref: ref_cols is
// a multiple of 8, or the row's width.
template <class Row, typename T>
__device__ void decode_stashed_row(const Row& row, const uint16_t* codes, const float* refs,
                                   int ref_cols, T* g_row, int cols) {
  static_assert(sizeof(T) == 2, "stashed tiles have 16-bit G");
  const bool aligned = reinterpret_cast<uintptr_t>(codes) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(g_row) % 16 == 0;
  for (int c = 8 * threadIdx.x; c < cols; c += 8 * kDlogitsThreads) {
    const int n = cols - c < 8 ? cols - c : 8;
    const float ref = refs[c / ref_cols];
    alignas(16) uint16_t h[8] = {};
    if (aligned && n == 8) {
      *reinterpret_cast<uint4*>(h) = *reinterpret_cast<const uint4*>(codes + c);
    } else {
      for (int k = 0; k < n; ++k) h[k] = codes[c + k];
    }
    alignas(16) T gv[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) store_g<T>(gv, k, k < n ? row(unstash(ref, h[k]), c + k) : 0.0f);
    if (aligned && n == 8) {
      *reinterpret_cast<uint4*>(g_row + c) = *reinterpret_cast<const uint4*>(gv);
    } else {
      for (int k = 0; k < n; ++k) g_row[c + k] = gv[k];
    }
  }
}

// One block per row of the tile; each thread takes quads of adjacent
// columns (one 16-byte load of u, one 8- or 16-byte store of G). out may be
// null (the logits entry writes only grad_logits). The rounding dtype and
// the formula (DlogitsForm) are compile-time: with them chosen per element, the
// kernel was bound by instruction issue (Nsight Compute, Llama-3 head on an
// H100: SM 79% and DRAM 42% of peak, 65 us a tile; now 52% and 68%, 39 us).
// kStashed: the tile's scores come from its stash (decode_stashed_row),
// not from raw logits.
template <typename T, int kRound, DlogitsForm kForm, bool kStashed = false>
__global__ void dlogits_kernel(LossArgs g, ScoreTile tile, void* out, int64_t out_ld,
                               DView grad_logits) {
  const int64_t r = blockIdx.x, i = tile.r0 + r;
  const int cols = int(tile.cols);
  const DlogitsRow<kRound, kForm> row(g, g.rows[i], tile.j0, cols);
  const float* u = kStashed ? nullptr : tile.u + r * tile.ld;
  const uint16_t* codes = kStashed ? tile.stash.codes + r * tile.stash.codes_ld : nullptr;
  const float* refs = kStashed ? tile.stash.refs + r * tile.stash.refs_ld : nullptr;
  const bool ref_per_group = kStashed && tile.stash.ref_cols < cols;  // the fused kernel's
  T* g_row = out ? static_cast<T*>(out) + r * out_ld : nullptr;
  if constexpr (kStashed) {
    decode_stashed_row(row, codes, refs, ref_per_group ? int(tile.stash.ref_cols) : cols,
                       static_cast<T*>(g_row), cols);
    return;
  }
  const bool aligned = reinterpret_cast<uintptr_t>(u) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(g_row) % (4 * sizeof(T)) == 0;
  for (int c = 4 * threadIdx.x; c < cols; c += 4 * kDlogitsThreads) {
    const int n = cols - c < 4 ? cols - c : 4;
    const Quad uq(u, c, n, aligned);
    float v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = k < n ? row(row.score(uq.v[k], c + k), c + k) : 0.0f;
    if (g_row) store_quad<T>(g_row, c, n, v, aligned);
    if (grad_logits.present()) {
      for (int k = 0; k < n; ++k)
        store_at(grad_logits, i * grad_logits.s0 + (tile.j0 + c + k) * grad_logits.s1, v[k]);
    }
  }
}

// One thread per column, rows in order.
__global__ void column_sums_kernel(const void* gptr, Dtype dtype, int64_t ld, int64_t rows,
                                   int64_t cols, double* acc) {
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c >= cols) return;
  const DView g{const_cast<void*>(gptr), int(dtype), ld, 1};
  double sum = 0;
  for (int64_t r = 0; r < rows; ++r) sum += load_at(g, r * ld + c);
  acc[c] += sum;
}

__global__ void convert_kernel(DView src, int64_t sr0, int64_t sc0, DView dst, int64_t dr0,
                               int64_t dc0, int64_t rows, int64_t cols) {
  const int64_t total = rows * cols;
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < total;
       k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = k / cols, c = k % cols;
    const double v = load_at(src, (sr0 + r) * src.s0 + (sc0 + c) * src.s1);
    store_at(dst, (dr0 + r) * dst.s0 + (dc0 + c) * dst.s1, v);
  }
}

__global__ void store_vector_kernel(const double* src, int64_t n, DView dst) {
  const int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (j < n) store1(dst, j, src[j]);
}

int64_t blocks_for(int64_t work, int threads, int64_t cap = 65535) {
  const int64_t b = (work + threads - 1) / threads;
  return b < 1 ? 1 : (b > cap ? cap : b);
}

}  // namespace

DView dview(const Tensor& t) {
  DView v;
  if (!t.present()) return v;
  v.data = t.data;
  v.dtype = int(t.dtype);
  v.s0 = t.ndim >= 1 ? t.stride[0] : 0;
  v.s1 = t.ndim >= 2 ? t.stride[1] : 1;
  return v;
}

void prepare(const LossArgs& args, float* class_w, float* bias, cudaStream_t stream) {
  prepare_kernel<<<1, kWideThreads, 0, stream>>>(args);
  DView f32row{nullptr, int(Dtype::f32), 0, 1};
  const size_t tail = size_t(padded_classes(args.v) - args.v) * sizeof(float);
  for (auto [src, dst] : {std::pair{args.class_weights, class_w}, std::pair{args.bias, bias}}) {
    if (!dst) continue;
    src.s1 = src.s0, src.s0 = 0;
    f32row.data = dst;
    convert(src, 0, 0, f32row, 0, 0, 1, args.v, stream);
    if (tail) cudaMemsetAsync(dst + args.v, 0, tail, stream);
  }
}

namespace {

// The kernel for flags F (bit 2 sbar, bit 1 label smoothing, bit 0
// softcap), raw (no scale or bias) or not.
template <int F>
void launch_tile_states(const LossArgs& args, const ScoreTile& tile, int64_t t, int64_t tiles,
                        int64_t state_r0, TileState* states, cudaStream_t stream) {
  const unsigned blocks = unsigned((tile.rows + kStateRows - 1) / kStateRows);
  auto kernel = args.a == 1 && args.bias_f32 == nullptr
                    ? tile_states_kernel<bool(F & 4), bool(F & 2), bool(F & 1), true>
                    : tile_states_kernel<bool(F & 4), bool(F & 2), bool(F & 1)>;
  kernel<<<blocks, kStateThreads * kStateRows, 0, stream>>>(args, tile, t, tiles, state_r0, states);
}

}  // namespace

void tile_states(const LossArgs& args, const ScoreTile& tile, int64_t t, int64_t tiles,
                 int64_t state_r0, TileState* states, cudaStream_t stream) {
  const int flags = (args.need_sbar ? 4 : 0) | (args.e > 0 ? 2 : 0) | (args.k > 0 ? 1 : 0);
  switch (flags) {
#define FLCE_STATES(F) \
  case F: launch_tile_states<F>(args, tile, t, tiles, state_r0, states, stream); break;
    FLCE_STATES(0) FLCE_STATES(1) FLCE_STATES(2) FLCE_STATES(3)
    FLCE_STATES(4) FLCE_STATES(5) FLCE_STATES(6) FLCE_STATES(7)
#undef FLCE_STATES
  }
}

void merge_rows(const LossArgs& args, const TileState* states, int64_t tiles, int64_t r0,
                int64_t rows, bool have_states, cudaStream_t stream) {
  merge_rows_kernel<<<unsigned(blocks_for(rows, kMergeRowsPerBlock, INT_MAX)),
                      32 * kMergeRowsPerBlock, 0, stream>>>(
      args, states, tiles, r0, rows, have_states);
}

void reduce_loss(const LossArgs& args, cudaStream_t stream) {
  reduce_loss_kernel<<<1, kWideThreads, 0, stream>>>(args);
}

namespace {

template <typename T, int kRound, bool kStashed = false>
void launch_dlogits(const LossArgs& args, const ScoreTile& tile, void* g, int64_t g_ld,
                    DView grad_logits, cudaStream_t stream) {
  const unsigned blocks = unsigned(tile.rows);
  switch (dlogits_form(args)) {
#define FLCE_DLOGITS(F) \
  case F: \
    dlogits_kernel<T, kRound, F, kStashed><<<blocks, kDlogitsThreads, 0, stream>>>( \
        args, tile, g, g_ld, grad_logits); \
    break;
    FLCE_DLOGITS(kGeneral) FLCE_DLOGITS(kPlain) FLCE_DLOGITS(kPlainSoftcap)
#undef FLCE_DLOGITS
  }
}

constexpr int kF32 = int(Dtype::f32), kBf16 = int(Dtype::bf16), kF16 = int(Dtype::f16);

}  // namespace

// G is stored as f32 (any rounding; also the logits entry's null g), or
// as the dtype it was rounded to (plan: grad_gemm == round_to then).
// A stashed tile only ever has G in bf16 (plan.h).
void dlogits(const LossArgs& args, const ScoreTile& tile, void* g, Dtype g_dtype, int64_t g_ld,
             DView grad_logits, Dtype round_to, cudaStream_t stream) {
  if (tile.stash.present())
    launch_dlogits<__nv_bfloat16, kBf16, true>(args, tile, g, g_ld, grad_logits, stream);
  else if (g != nullptr && g_dtype == Dtype::bf16)
    launch_dlogits<__nv_bfloat16, kBf16>(args, tile, g, g_ld, grad_logits, stream);
  else if (g != nullptr && g_dtype == Dtype::f16)
    launch_dlogits<__half, kF16>(args, tile, g, g_ld, grad_logits, stream);
  else if (round_to == Dtype::bf16)
    launch_dlogits<float, kBf16>(args, tile, g, g_ld, grad_logits, stream);
  else if (round_to == Dtype::f16)
    launch_dlogits<float, kF16>(args, tile, g, g_ld, grad_logits, stream);
  else
    launch_dlogits<float, kF32>(args, tile, g, g_ld, grad_logits, stream);
}

void column_sums(const void* g, Dtype g_dtype, int64_t g_ld, int64_t rows, int64_t cols,
                 double* acc, cudaStream_t stream) {
  column_sums_kernel<<<unsigned(blocks_for(cols, kThreads, INT_MAX)), kThreads, 0, stream>>>(
      g, g_dtype, g_ld, rows, cols, acc);
}

void convert(DView src, int64_t sr0, int64_t sc0, DView dst, int64_t dr0, int64_t dc0,
             int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  convert_kernel<<<unsigned(blocks_for(rows * cols, kThreads, 4096)), kThreads, 0, stream>>>(
      src, sr0, sc0, dst, dr0, dc0, rows, cols);
}

void store_f64_vector(const double* src, int64_t n, DView dst, cudaStream_t stream) {
  store_vector_kernel<<<unsigned(blocks_for(n, kThreads, INT_MAX)), kThreads, 0, stream>>>(src, n,
                                                                                       dst);
}

std::string last_launch_error(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return "";
  return std::string("cuda backend: ") + what + ": " + cudaGetErrorString(e);
}

}  // namespace flce::cuda
