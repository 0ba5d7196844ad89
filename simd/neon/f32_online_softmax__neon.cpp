// online_softmax, NEON: pass 1 the tile max (4 accumulators), pass 2 the
// sums relative to the new shift (2 accumulator sets; sum_exp_d and sum_cs
// only with kSoftmaxMoments); the tail goes through one padded vector; the
// argmax and first-NaN searches stop at the first hit, the argmax one runs
// only with kSoftmaxArgmax and the NaN one only when sum_exp came out NaN.
#include "simd/common.h"
#include "simd/isa_kernels.h"
#include "simd/neon/vmath_neon.h"

namespace flce::simd {
namespace {

using namespace neon;

// NaN lanes of x replaced by -inf (FMAXNM would do for quiet NaNs only).
inline float32x4_t nan_to_ninf(float32x4_t x) {
  return vbslq_f32(vceqq_f32(x, x), x, splat(-detail::kInf));
}

float tile_max(const float* s, int64_t n) {
  const float32x4_t ninf = splat(-detail::kInf);
  float32x4_t m0 = ninf, m1 = ninf, m2 = ninf, m3 = ninf;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    m0 = vmaxq_f32(m0, nan_to_ninf(vld1q_f32(s + i)));
    m1 = vmaxq_f32(m1, nan_to_ninf(vld1q_f32(s + i + 4)));
    m2 = vmaxq_f32(m2, nan_to_ninf(vld1q_f32(s + i + 8)));
    m3 = vmaxq_f32(m3, nan_to_ninf(vld1q_f32(s + i + 12)));
  }
  for (; i + 4 <= n; i += 4) m0 = vmaxq_f32(m0, nan_to_ninf(vld1q_f32(s + i)));
  if (i < n) m1 = vmaxq_f32(m1, nan_to_ninf(load_partial(s + i, n - i, -detail::kInf)));
  return vmaxvq_f32(vmaxq_f32(vmaxq_f32(m0, m1), vmaxq_f32(m2, m3)));
}

// Lowest lane set in a compare result (which has one set), plus base.
inline int64_t first_lane(uint32x4_t k, int64_t base) {
  uint32_t lanes[4];
  vst1q_u32(lanes, k);
  for (int l = 0; l < 4; ++l)
    if (lanes[l]) return base + l;
  return -1;
}

// Lowest i with s[i] == v (ordered compare: never a NaN), or -1.
int64_t find_equal(const float* s, int64_t n, float v) {
  const float32x4_t vv = splat(v);
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const uint32x4_t k = vceqq_f32(vld1q_f32(s + i), vv);
    if (vmaxvq_u32(k)) return first_lane(k, i);
  }
  for (; i < n; ++i)
    if (s[i] == v) return i;
  return -1;
}

int64_t find_nan(const float* s, int64_t n) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const float32x4_t x = vld1q_f32(s + i);
    const uint32x4_t k = vmvnq_u32(vceqq_f32(x, x));
    if (vmaxvq_u32(k)) return first_lane(k, i);
  }
  for (; i < n; ++i)
    if (__builtin_isnan(s[i])) return i;
  return -1;
}

struct Acc {
  float32x4_t se, sed, scs;
};

// One vector of terms; padded tail lanes arrive as s = -inf, c = 0, and
// `m` (all ones in the body) keeps them out of sum_cs.
template <bool kClassW, bool kMoments>
inline void accumulate(Acc& acc, float32x4_t x, float32x4_t c, float32x4_t shift, uint32x4_t m) {
  const float32x4_t d = vsubq_f32(x, shift);
  const float32x4_t e = exp_ps(d);
  acc.se = vaddq_f32(acc.se, e);
  if (!kMoments) return;
  // e * max(d, -FLT_MAX) (FMAX keeps NaN): e == 0 exactly where d = -inf.
  acc.sed = vfmaq_f32(acc.sed, e, vmaxq_f32(d, splat(-0x1.fffffep127f)));
  // A weight of 0 on an infinite s gives NaN, as c_j logp_j does in the
  // semantics; padded lanes (0 * -inf) are masked off.
  const float32x4_t term = kClassW ? vmulq_f32(c, x) : x;
  acc.scs = vaddq_f32(acc.scs, vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(term), m)));
}

template <bool kClassW, bool kMoments>
void sums(const float* s, const float* class_w, int64_t n, float shift_f, float* out) {
  const float32x4_t shift = splat(shift_f);
  const float32x4_t zero = splat(0.0f);
  const uint32x4_t all = vdupq_n_u32(~0u);
  Acc a0{zero, zero, zero}, a1{zero, zero, zero};
  int64_t i = 0;
  const auto add = [shift](Acc& a, float32x4_t x, float32x4_t c, uint32x4_t m) {
    accumulate<kClassW, kMoments>(a, x, c, shift, m);
  };
  for (; i + 8 <= n; i += 8) {
    add(a0, vld1q_f32(s + i), kClassW ? vld1q_f32(class_w + i) : zero, all);
    add(a1, vld1q_f32(s + i + 4), kClassW ? vld1q_f32(class_w + i + 4) : zero, all);
  }
  if (i + 4 <= n) {
    add(a0, vld1q_f32(s + i), kClassW ? vld1q_f32(class_w + i) : zero, all);
    i += 4;
  }
  if (i < n) {
    const int64_t r = n - i;
    const uint32x4_t m = vcltq_u32(vcombine_u32(vcreate_u32(0x0000000100000000ull),
                                                vcreate_u32(0x0000000300000002ull)),
                                   vdupq_n_u32(uint32_t(r)));
    add(a1, load_partial(s + i, r, -detail::kInf),
        kClassW ? load_partial(class_w + i, r, 0.0f) : zero, m);
  }
  out[0] = vaddvq_f32(vaddq_f32(a0.se, a1.se));
  out[1] = vaddvq_f32(vaddq_f32(a0.sed, a1.sed));
  out[2] = vaddvq_f32(vaddq_f32(a0.scs, a1.scs));
}

}  // namespace

void f32_online_softmax__neon(const float* s, const float* class_w, int64_t n, int64_t j0,
                              unsigned extras, SoftmaxState* state) {
  const float tmax = tile_max(s, n);
  const float shift = detail::shift_of(tmax > state->max ? tmax : state->max);
  float t[3];
  if (!(extras & kSoftmaxMoments)) sums<false, false>(s, nullptr, n, shift, t);
  else if (class_w) sums<true, true>(s, class_w, n, shift, t);
  else sums<false, true>(s, class_w, n, shift, t);
  int64_t argmax = -1;
  if ((extras & kSoftmaxArgmax) && detail::tile_argmax_needed(state, tmax, j0)) {
    const int64_t i = find_equal(s, n, tmax);
    if (i >= 0) argmax = j0 + i;
  }
  int64_t first_nan = -1;
  if (detail::is_nan(t[0])) {
    const int64_t i = find_nan(s, n);
    if (i >= 0) first_nan = j0 + i;
  }
  detail::fold_tile(state, tmax, t[0], t[1], t[2], argmax, first_nan);
}

}  // namespace flce::simd
