// simd/neon/vmath_neon.h: exp and tanh on float32x4_t (AArch64 NEON).
#pragma once

#include <arm_neon.h>

#include <cstdint>

#include "simd/vmath_constants.h"

namespace flce::simd::neon {
namespace {

inline float32x4_t splat(float v) { return vdupq_n_f32(v); }

inline float32x4_t exp_poly(float32x4_t r) {
  using namespace vmath;
  float32x4_t p = splat(kExpC6);
  p = vfmaq_f32(splat(kExpC5), p, r);
  p = vfmaq_f32(splat(kExpC4), p, r);
  p = vfmaq_f32(splat(kExpC3), p, r);
  p = vfmaq_f32(splat(kExpC2), p, r);
  p = vfmaq_f32(splat(kExpC1), p, r);
  return vfmaq_f32(splat(1.0f), p, r);
}

// 2^n for integer n in [-126, 127] from its bits.
inline float32x4_t pow2i(int32x4_t n) {
  return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n, vdupq_n_s32(127)), 23));
}

// exp(x) over the whole range: clamped, n in [-150, 128] applied as
// 2^(n - n/2) 2^(n/2), two normal factors, so p 2^n is rounded once (to a
// subnormal, 0 or +inf as due). AArch64 cores handle subnormal results at
// full speed, so no detour as in the x86 sets.
inline float32x4_t exp_full(float32x4_t x) {
  using namespace vmath;
  x = vmaxq_f32(x, splat(kExpLo));  // FMAX/FMIN propagate NaN
  x = vminq_f32(x, splat(kExpHi));
  const float32x4_t t = vfmaq_f32(splat(kRound), x, splat(kLog2e));
  const float32x4_t n = vsubq_f32(t, splat(kRound));
  float32x4_t r = vfmsq_f32(x, n, splat(kLn2Hi));
  r = vfmsq_f32(r, n, splat(kLn2Lo));
  const int32x4_t ni = vsubq_s32(vreinterpretq_s32_f32(t), vreinterpretq_s32_f32(splat(kRound)));
  const int32x4_t n1 = vshrq_n_s32(ni, 1);
  const int32x4_t n2 = vsubq_s32(ni, n1);
  return vmulq_f32(vmulq_f32(exp_poly(r), pow2i(n1)), pow2i(n2));
}

// exp(x), within 1.2 ulp everywhere (subnormal results included), +inf
// above ~88.72, exp(-inf) = +0, NaN -> NaN. Where every |x| <= kExpFast (or
// NaN), one normal 2^n factor from the bits of the rounding constant;
// otherwise exp_full. Both round p 2^n once, so a lane's result does not
// depend on the path.
inline float32x4_t exp_ps(float32x4_t x) {
  using namespace vmath;
  if (__builtin_expect(vmaxvq_u32(vcagtq_f32(x, splat(kExpFast))) != 0, 0)) return exp_full(x);
  const float32x4_t t = vfmaq_f32(splat(kRoundBiased), x, splat(kLog2e));
  const float32x4_t n = vsubq_f32(t, splat(kRoundBiased));
  float32x4_t r = vfmsq_f32(x, n, splat(kLn2Hi));
  r = vfmsq_f32(r, n, splat(kLn2Lo));
  const float32x4_t scale = vreinterpretq_f32_s32(vshlq_n_s32(vreinterpretq_s32_f32(t), 23));
  return vmulq_f32(exp_poly(r), scale);
}

// tanh(x): odd polynomial below kTanhSmall, em1 / (em1 + 2) above, where the
// quotient uses FRECPE plus two FRECPS steps and a final correction (no FDIV).
inline float32x4_t tanh_ps(float32x4_t x) {
  using namespace vmath;
  const uint32x4_t sign = vandq_u32(vreinterpretq_u32_f32(x), vdupq_n_u32(0x80000000u));
  const float32x4_t ax = vabsq_f32(x);
  const float32x4_t y = vmulq_f32(ax, ax);
  float32x4_t q = splat(kTanhT4);
  q = vfmaq_f32(splat(kTanhT3), q, y);
  q = vfmaq_f32(splat(kTanhT2), q, y);
  q = vfmaq_f32(splat(kTanhT1), q, y);
  q = vfmaq_f32(splat(kTanhT0), q, y);
  const float32x4_t small = vfmaq_f32(ax, vmulq_f32(ax, y), q);
  const float32x4_t axc = vminq_f32(ax, splat(kTanhSat));  // NaN stays NaN
  const float32x4_t x2 = vaddq_f32(axc, axc);
  const float32x4_t t = vfmaq_f32(splat(kRound), x2, splat(kLog2e));
  const float32x4_t n = vsubq_f32(t, splat(kRound));
  float32x4_t r = vfmsq_f32(x2, n, splat(kLn2Hi));
  r = vfmsq_f32(r, n, splat(kLn2Lo));
  const int32x4_t ni = vsubq_s32(vreinterpretq_s32_f32(t), vreinterpretq_s32_f32(splat(kRound)));
  const float32x4_t em1 = vfmaq_f32(splat(-1.0f), pow2i(ni), exp_poly(r));
  const float32x4_t den = vaddq_f32(em1, splat(2.0f));
  float32x4_t rcp = vrecpeq_f32(den);  // ~8 bits
  rcp = vmulq_f32(rcp, vrecpsq_f32(den, rcp));  // ~16
  rcp = vmulq_f32(rcp, vrecpsq_f32(den, rcp));  // ~23
  const float32x4_t t0 = vmulq_f32(em1, rcp);
  const float32x4_t large = vfmaq_f32(t0, vfmsq_f32(em1, den, t0), rcp);
  const uint32x4_t is_small = vcltq_f32(ax, splat(kTanhSmall));
  const float32x4_t res = vbslq_f32(is_small, small, large);
  return vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(res), sign));
}

// Copies lanes [0, n) of p (n < 4) into a vector, `fill` elsewhere.
inline float32x4_t load_partial(const float* p, int64_t n, float fill) {
  float buf[4] = {fill, fill, fill, fill};
  for (int64_t i = 0; i < n; ++i) buf[i] = p[i];
  return vld1q_f32(buf);
}

inline void store_partial(float* p, int64_t n, float32x4_t v) {
  float buf[4];
  vst1q_f32(buf, v);
  for (int64_t i = 0; i < n; ++i) p[i] = buf[i];
}

}  // namespace
}  // namespace flce::simd::neon
