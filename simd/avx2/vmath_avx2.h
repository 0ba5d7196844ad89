// simd/avx2/vmath_avx2.h: exp and tanh on __m256 (AVX2 + FMA).
// Only for TUs compiled with the AVX2 flags; internal linkage throughout.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "simd/vmath_constants.h"

namespace flce::simd::avx2 {
namespace {

inline __m256 splat(float v) { return _mm256_set1_ps(v); }

// Lanes [0, n) set, 0 <= n <= 8, as a maskload/maskstore mask.
inline __m256i tail_mask(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline __m256 exp_poly(__m256 r) {
  using namespace vmath;
  __m256 p = splat(kExpC6);
  p = _mm256_fmadd_ps(p, r, splat(kExpC5));
  p = _mm256_fmadd_ps(p, r, splat(kExpC4));
  p = _mm256_fmadd_ps(p, r, splat(kExpC3));
  p = _mm256_fmadd_ps(p, r, splat(kExpC2));
  p = _mm256_fmadd_ps(p, r, splat(kExpC1));
  return _mm256_fmadd_ps(p, r, splat(1.0f));
}

// 2^n for integer n in [-126, 127] from its bits.
inline __m256 pow2i(__m256i n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
}

// exp(x) over the whole range: clamped, n in [-150, 128].
//  n >= -125: (p + p) 2^(n-1), one normal factor (n - 1 in [-126, 127]),
//    rounded once (to +inf where due); p + p is exact.
//  n <= -126: the result is subnormal (or just normal); its bits are the
//    integer round(p 2^(n+149)): p 2^(n+149) is an exact product of normal
//    numbers and cvtps2dq rounds it once, to nearest even, on the subnormal
//    grid (an integer of 2^23 or more is the right normal number).
// No operation sees a subnormal. NaN lanes take the first branch.
inline __m256 exp_full(__m256 x) {
  using namespace vmath;
  const __m256 ordered = _mm256_cmp_ps(x, x, _CMP_ORD_Q);
  x = _mm256_max_ps(splat(kExpLo), x);  // maxps returns the 2nd operand on NaN
  x = _mm256_min_ps(splat(kExpHi), x);
  const __m256 t = _mm256_fmadd_ps(x, splat(kLog2e), splat(kRound));
  const __m256 n = _mm256_sub_ps(t, splat(kRound));
  __m256 r = _mm256_fnmadd_ps(n, splat(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, splat(kLn2Lo), r);
  const __m256 p = exp_poly(r);
  const __m256i ni = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_castps_si256(splat(kRound)));
  const __m256i nn = _mm256_max_epi32(ni, _mm256_set1_epi32(-125));
  const __m256 y = _mm256_mul_ps(_mm256_add_ps(p, p), pow2i(_mm256_sub_epi32(nn, _mm256_set1_epi32(1))));
  const __m256i ns = _mm256_min_epi32(ni, _mm256_set1_epi32(-126));
  const __m256 scaled = _mm256_mul_ps(p, pow2i(_mm256_add_epi32(ns, _mm256_set1_epi32(149))));
  const __m256 ys = _mm256_castsi256_ps(_mm256_cvtps_epi32(scaled));
  const __m256 sub = _mm256_and_ps(ordered, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(-125), ni)));
  return _mm256_blendv_ps(y, ys, sub);
}

// exp(x), within 1.2 ulp everywhere (subnormal results included), +inf
// above ~88.72, exp(-inf) = +0, NaN -> NaN. Where every |x| <= kExpFast (or
// NaN), n is in [-126, 126], p 2^n is normal and 2^n is one normal factor
// whose bits come straight from the rounding constant; otherwise exp_full.
// Both round p 2^n once, so a lane's result does not depend on the path.
inline __m256 exp_ps(__m256 x) {
  using namespace vmath;
  const __m256 big = _mm256_cmp_ps(_mm256_andnot_ps(splat(-0.0f), x), splat(kExpFast), _CMP_GT_OQ);
  if (__builtin_expect(!_mm256_testz_ps(big, big), 0)) return exp_full(x);
  const __m256 t = _mm256_fmadd_ps(x, splat(kLog2e), splat(kRoundBiased));
  const __m256 n = _mm256_sub_ps(t, splat(kRoundBiased));
  __m256 r = _mm256_fnmadd_ps(n, splat(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, splat(kLn2Lo), r);
  const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(t), 23));
  return _mm256_mul_ps(exp_poly(r), scale);
}

// tanh(x): odd polynomial below kTanhSmall, em1 / (em1 + 2) above, where the
// quotient uses rcp plus two correction steps (no division).
inline __m256 tanh_ps(__m256 x) {
  using namespace vmath;
  const __m256 sign_bit = splat(-0.0f);
  const __m256 sign = _mm256_and_ps(x, sign_bit);
  const __m256 ax = _mm256_andnot_ps(sign_bit, x);
  // Small |x|.
  const __m256 y = _mm256_mul_ps(ax, ax);
  __m256 q = splat(kTanhT4);
  q = _mm256_fmadd_ps(q, y, splat(kTanhT3));
  q = _mm256_fmadd_ps(q, y, splat(kTanhT2));
  q = _mm256_fmadd_ps(q, y, splat(kTanhT1));
  q = _mm256_fmadd_ps(q, y, splat(kTanhT0));
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(ax, y), q, ax);
  // Large |x| (NaN lanes land here and stay NaN); 2|x| <= 20: one 2^n factor.
  const __m256 axc = _mm256_min_ps(splat(kTanhSat), ax);  // minps returns ax on NaN
  const __m256 x2 = _mm256_add_ps(axc, axc);
  const __m256 t = _mm256_fmadd_ps(x2, splat(kLog2e), splat(kRound));
  const __m256 n = _mm256_sub_ps(t, splat(kRound));
  __m256 r = _mm256_fnmadd_ps(n, splat(kLn2Hi), x2);
  r = _mm256_fnmadd_ps(n, splat(kLn2Lo), r);
  const __m256i ni = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_castps_si256(splat(kRound)));
  const __m256 em1 = _mm256_fmadd_ps(pow2i(ni), exp_poly(r), splat(-1.0f));
  const __m256 den = _mm256_add_ps(em1, splat(2.0f));
  __m256 rcp = _mm256_rcp_ps(den);  // 12 bits
  rcp = _mm256_fmadd_ps(_mm256_fnmadd_ps(den, rcp, splat(1.0f)), rcp, rcp);  // ~23 bits
  const __m256 t0 = _mm256_mul_ps(em1, rcp);
  const __m256 large = _mm256_fmadd_ps(_mm256_fnmadd_ps(den, t0, em1), rcp, t0);
  const __m256 res = _mm256_blendv_ps(large, small, _mm256_cmp_ps(ax, splat(kTanhSmall), _CMP_LT_OQ));
  return _mm256_or_ps(res, sign);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace
}  // namespace flce::simd::avx2
