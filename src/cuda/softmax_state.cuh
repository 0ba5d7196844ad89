// src/cuda/softmax_state.cuh: what the `cuda` backend's score kernels share
// (kernels.cu's tile_states and dlogits, sm90/score_gemms.cu's fused
// epilogues): the score formula, the per-row softmax state pass 1 folds, and
// G's formula for pass 2. Device code only (internal).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "cuda/kernels.h"
#include "cuda/softcap_small.h"

namespace flce::cuda {

constexpr float kInf = INFINITY;

// ---- the semantics shared by the kernels ------------------------------------

// Element i of an integer vector (i32 or i64), e.g. a row's label.
inline __device__ int64_t load_int(const DView& t, int64_t i) {
  if (Dtype(t.dtype) == Dtype::i32) return static_cast<const int32_t*>(t.data)[i * t.s0];
  return static_cast<const int64_t*>(t.data)[i * t.s0];
}

inline __device__ float shift_of(float m) { return isfinite(m) ? m : 0.0f; }

// A running sum_exp_d, sum_j e^(s_j - shift) (s_j - shift), moved to a new
// shift (delta = old shift - new shift, f = e^delta): f (sum_exp_d + delta
// sum_exp), as the cpu kernels' (simd/common.h, moved_sum_exp_d). Where f
// underflowed (each term's weight is then below 2^-149) 0, NaN kept, without
// the delta term: delta may be infinite (shifts near -FLT_MAX and FLT_MAX),
// and 0 * inf is NaN; unchanged where the shift is.
inline __device__ float moved_sum_exp_d(float sum_exp_d, float sum_exp, float f, float delta) {
  if (f == 0) return sum_exp_d * f;
  return delta == 0 ? sum_exp_d : fmaf(f, sum_exp_d, delta * (f * sum_exp));
}

// e^x for the rescales and merges: CUDA's exp2f (2 ulp, as expf; one
// MUFU.EX2 and a subnormal fix-up) of x log2(e), against expf's range
// reduction of about a dozen instructions. Rounding the product moves the
// exponent by u |x|, which the tolerance policy counts (tests/support/
// tolerance.h, section 2: the exponents' u (m - s_j) term).
constexpr float kLog2e = 1.44269504088896341f;
inline __device__ float exp_of(float x) { return exp2f(x * kLog2e); }

// The hot loops' e^(s - m) for a shift m fixed over many s: m's offset
// m log2(e) once (exp_offset), then per s an FMA, a subtraction and one
// ex2.approx.ftz (exp_at), against a subtraction, a product and exp2f's
// subnormal fix-up. The offset is two floats, hi = fl(m log2(e)) and lo its
// rounding error (one FMA, exact), so that s = m has the exponent 0 exactly:
// with hi alone it was -lo, up to half an ulp of hi, which beyond |m| ~ 3e9
// (hi >= 2^32) exceeds 126, and the row's sum of exponentials came out 0
// or inf (lse -inf or +inf; NaN gradients). The FMA's rounding moves the
// exponent by u |s - m| (tolerance.h, sections 2 and 3: the u_a (|s| +
// |lse|) term). Results below 2^-126 flush to 0: in a sum of at least 1
// (pass 1, whose max's term is 1) far under its rounding; in G the p
// underflow term, which the policy takes at the smallest normal. A finite
// m whose offset would overflow is clamped to the largest float (|m| >
// 2.3e38, where the policy's bounds are far above any G); an infinite or
// NaN m keeps its offset, as s - m would.
struct ExpOffset {
  float hi, lo;
};
inline __device__ ExpOffset exp_offset(float m) {
  const float o = m * kLog2e;
  if (!isfinite(m)) return {o, 0.0f};
  const float hi = fminf(fmaxf(o, -3.4028235e38f), 3.4028235e38f);
  const float lo = fmaf(m, kLog2e, -hi);
  return {hi, isfinite(lo) ? lo : 0.0f};
}
inline __device__ float ex2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
inline __device__ float exp_at(float s, ExpOffset offset) {
  return ex2_ftz(fmaf(s, kLog2e, -offset.hi) - offset.lo);
}

inline __device__ int64_t min_index(int64_t a, int64_t b) {
  if (a < 0) return b;
  if (b < 0) return a;
  return a < b ? a : b;
}

// The label's column inside a tile of `cols` starting at class j0, or -1.
inline __device__ int label_column(int64_t y, int64_t j0, int cols) {
  return y >= j0 && y < j0 + cols ? int(y - j0) : -1;
}

// A stashed score's code: the f16 bits of ref - s rounded to nearest even,
// as the cpu backend's pack_scores codes it (simd/isa_kernels.h): a finite
// difference above f16's range becomes +inf, which reads back as s = -inf
// with p = 0, as that s's p is (e^-65504 underflows); one below it (ref 0
// beside an infinite max) is raised to -65504; an infinity or NaN stays one.
// Back: s = ref - f32(code) (kernels.h, Stash).
inline __device__ uint16_t stash_code(float ref, float s) {
  float d = ref - s;
  if (fabsf(d) < kInf) d = fmaxf(d, -65504.0f);
  return __half_as_ushort(__float2half_rn(d));
}
// Two codes as one 32-bit pair (s0's in the low half), for a ref that is the
// finite max of its scores, so that ref - s >= 0 or NaN: cvt.rn gives what
// stash_code does there (+inf beyond f16's range, a NaN kept), in one
// instruction for both.
inline __device__ uint32_t stash_code_pair_below_max(float ref, float s0, float s1) {
  uint32_t pair;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(pair) : "f"(ref - s1), "f"(ref - s0));
  return pair;
}
inline __device__ float unstash(float ref, uint16_t code) {
  return ref - __half2float(__ushort_as_half(code));
}

// What the per-element hot loops read, in f32 and relative to the tile's
// first column: no double arithmetic or 64-bit indexing per element.
struct TileParams {
  float a, k;             // logit scale, softcap
  SoftcapPoly poly;       // 1 / k, k log2(e), softcap_small and tanh_small for |z| <= poly.limit
  const float* bias;      // at the tile's column 0, or null
  const float* class_w;   // likewise

  __device__ TileParams(const LossArgs& g, int64_t j0)
      : a(g.a_f32), k(g.k_f32), poly(g.softcap),
        bias(g.bias_f32 ? g.bias_f32 + j0 : nullptr),
        class_w(g.class_w ? g.class_w + j0 : nullptr) {}

  // z = a (u + b): the logit before the softcap.
  __device__ float z(float u, int c) const { return a * (bias ? u + bias[c] : u); }
  // s = k tanh(z / k) when k > 0, else z.
  __device__ float score(float u, int c) const {
    const float zc = z(u, c);
    return k > 0 ? k * tanhf(zc * poly.inv_k) : zc;
  }
  __device__ float class_weight(int c) const { return class_w ? class_w[c] : 1.0f; }
  // ds/dz = 1 - (s/k)^2 when k > 0.
  __device__ float dsdz(float s) const {
    return k > 0 ? 1 - (s * poly.inv_k) * (s * poly.inv_k) : 1.0f;
  }
};

// A thread's (or a subtree's) running state, as TileState.
struct State {
  float max = -kInf, sum_exp = 0, sum_exp_d = 0, sum_cs = 0;
  int64_t argmax = -1, first_nan = -1;

  // Folds `o` in; ties in the max keep the lower index.
  __device__ void merge(const State& o) {
    const float m = o.max > max ? o.max : max;
    const float delta = shift_of(max) - shift_of(m), delta_o = shift_of(o.max) - shift_of(m);
    const float f = max == -kInf ? 0.0f : exp_of(delta);
    const float fo = o.max == -kInf ? 0.0f : exp_of(delta_o);
    sum_exp_d = moved_sum_exp_d(sum_exp_d, sum_exp, f, delta) +
                moved_sum_exp_d(o.sum_exp_d, o.sum_exp, fo, delta_o);
    sum_exp = sum_exp * f + o.sum_exp * fo;
    sum_cs += o.sum_cs;
    if (o.max > max) argmax = o.argmax;
    else if (o.max == max) argmax = min_index(argmax, o.argmax);
    max = m;
    first_nan = min_index(first_nan, o.first_nan);
  }
};

// Fixed-shape butterfly over groups of `lanes` adjacent lanes of a warp (32:
// the whole warp; 4: the quads of a wgmma accumulator row): every lane ends
// with the merge of its group (lane order inside each pair is fixed, so the
// bits are too).
inline __device__ State warp_merge(State st, int lanes = 32) {
  for (int width = lanes / 2; width > 0; width /= 2) {
    State o;
    o.max = __shfl_xor_sync(0xffffffffu, st.max, width);
    o.sum_exp = __shfl_xor_sync(0xffffffffu, st.sum_exp, width);
    o.sum_exp_d = __shfl_xor_sync(0xffffffffu, st.sum_exp_d, width);
    o.sum_cs = __shfl_xor_sync(0xffffffffu, st.sum_cs, width);
    o.argmax = __shfl_xor_sync(0xffffffffu, st.argmax, width);
    o.first_nan = __shfl_xor_sync(0xffffffffu, st.first_nan, width);
    // The lower lane's state first, so both lanes compute the same bits
    // (field by field: a struct-valued select would go to local memory).
    const bool lower = (threadIdx.x & width) == 0;
    State a, b;
    a.max = lower ? st.max : o.max, b.max = lower ? o.max : st.max;
    a.sum_exp = lower ? st.sum_exp : o.sum_exp, b.sum_exp = lower ? o.sum_exp : st.sum_exp;
    a.sum_exp_d = lower ? st.sum_exp_d : o.sum_exp_d, b.sum_exp_d = lower ? o.sum_exp_d : st.sum_exp_d;
    a.sum_cs = lower ? st.sum_cs : o.sum_cs, b.sum_cs = lower ? o.sum_cs : st.sum_cs;
    a.argmax = lower ? st.argmax : o.argmax, b.argmax = lower ? o.argmax : st.argmax;
    a.first_nan = lower ? st.first_nan : o.first_nan;
    b.first_nan = lower ? o.first_nan : st.first_nan;
    a.merge(b);
    st = a;
  }
  return st;
}

// v rounded to the dtype kRound (a Dtype as int), kept in f32.
template <int kRound>
inline __device__ float round_as(float v) {
  if (Dtype(kRound) == Dtype::bf16) return __bfloat162float(__float2bfloat16_rn(v));
  if (Dtype(kRound) == Dtype::f16) return __half2float(__float2half_rn(v));
  return v;
}

// Which formula dlogits compiles: the general one, or for rows with no
// scale, bias, class weights, smoothing or entropy term, G = coef_p p minus
// the label term, times ds/dz with a softcap. The general formula gives the
// same bits there: every factor it skips is exactly 1 or 0.
enum DlogitsForm { kGeneral, kPlain, kPlainSoftcap };

inline DlogitsForm dlogits_form(const LossArgs& g) {
  const bool plain = g.a == 1 && g.e == 0 && !g.need_sbar &&  // need_sbar: grad_entropy too
                     g.class_w == nullptr && g.bias_f32 == nullptr;
  if (!plain) return kGeneral;
  return g.k > 0 ? kPlainSoftcap : kPlain;
}

// G of one element, per RowInfo (kernels.h), rounded to kRound.
template <int kRound, DlogitsForm kForm>
struct DlogitsRow {
  TileParams q;
  float lse;
  ExpOffset lse_offset;  // exp_offset(lse)
  float shift, sbar_d;  // the entropy's s - sbar as (s - shift) - sbar_d: exact near the max
  float coef_p, coef_c, coef_h, label;
  int y_col;  // the label's column in the tile, or -1

  __device__ DlogitsRow(const LossArgs& g, const RowInfo& info, int64_t j0, int cols)
      : q(g, j0), lse(float(info.lse)), lse_offset(exp_offset(lse)), shift(float(info.shift)),
        sbar_d(float(info.sbar_d)),
        coef_p(float(info.coef_p)), coef_c(float(info.coef_c)), coef_h(float(info.coef_h)),
        label(float(info.label_coef)),
        y_col(info.y < 0 ? -1 : label_column(info.y, j0, cols)) {}

  // The score of raw logit u at column c.
  __device__ float score(float u, int c) const {
    if (kForm == kPlain) return u;
    if (kForm == kPlainSoftcap) return q.k * tanhf(u * q.poly.inv_k);
    return q.score(u, c);
  }

  // kPlainSoftcap's G from t = tanh(z / k) (the fused epilogue): the same
  // exponent FMA as exp_at with t and k log2(e) for s and log2(e) (the
  // policy counts k log2(e)'s rounding as it did log2(e)'s), and
  // ds/dz = 1 - t^2 in one FMA.
  __device__ float unrounded_from_t(float t, bool at_label) const {
    const float d = coef_p * ex2_ftz(fmaf(t, q.poly.k_log2e, -lse_offset.hi) - lse_offset.lo);
    return fmaf(-t, t, 1.0f) * (at_label ? d - label : d);
  }

  // G at column c from its score s.
  __device__ float operator()(float s, int c) const {
    return round_as<kRound>(unrounded(s, c, c == y_col));
  }

  // G before its rounding, at a column that is the label's or not (the
  // fused epilogue passes a constant and rounds in its store).
  __device__ float unrounded(float s, int c, bool at_label) const {
    if (kForm == kPlain) {
      const float d = coef_p * exp_at(s, lse_offset);
      return at_label ? d - label : d;
    }
    if (kForm == kPlainSoftcap) {
      const float d = coef_p * exp_at(s, lse_offset);
      return q.dsdz(s) * (at_label ? d - label : d);
    }
    const float p = exp_at(s, lse_offset);
    float d = coef_p * p;
    if (coef_c != 0) d += coef_c * q.class_weight(c);
    if (coef_h != 0) d -= coef_h * (p == 0 ? 0.0f : p * ((s - shift) - sbar_d));
    if (at_label) d -= label;
    return q.a * q.dsdz(s) * d;
  }
};

}  // namespace flce::cuda
