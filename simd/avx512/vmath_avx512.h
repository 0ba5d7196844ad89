// simd/avx512/vmath_avx512.h: exp and tanh on __m512 (AVX-512F + FMA).
// Only for TUs compiled with the AVX-512 flags; internal linkage throughout.
#pragma once

// GCC 12's AVX-512 intrinsics start from _mm512_undefined_ps() (`__m512 __Y = __Y`),
// which -Wall reports as (maybe) uninitialized once inlined (GCC PR105593,
// fixed in 13). The diagnostic is located in the intrinsics headers, so
// silencing it around the include is enough; this header is included first.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstdint>

#include "simd/vmath_constants.h"

namespace flce::simd::avx512 {
namespace {

inline __m512 splat(float v) { return _mm512_set1_ps(v); }

// Mask of the first n lanes, 0 <= n <= 16.
inline __mmask16 tail_mask(int64_t n) { return __mmask16((1u << n) - 1u); }

// exp(r) on the reduced argument.
inline __m512 exp_poly(__m512 r) {
  using namespace vmath;
  __m512 p = splat(kExpC6);
  p = _mm512_fmadd_ps(p, r, splat(kExpC5));
  p = _mm512_fmadd_ps(p, r, splat(kExpC4));
  p = _mm512_fmadd_ps(p, r, splat(kExpC3));
  p = _mm512_fmadd_ps(p, r, splat(kExpC2));
  p = _mm512_fmadd_ps(p, r, splat(kExpC1));
  return _mm512_fmadd_ps(p, r, splat(1.0f));
}

// The table form's pieces (vmath_constants.h). exp16_round: x 16/ln2 +
// kRound, whose low mantissa bits hold n = round(16 x / ln2) for |x| < 2^17
// (the float is kRound + n exactly, its bits kRound's + n). exp16_expm1:
// exp(r) - 1 for r = x - n ln2/16, given that rounded value.
inline __m512 exp16_round(__m512 x) {
  return _mm512_fmadd_ps(x, splat(vmath::kExp16Log2e), splat(vmath::kRound));
}
inline __m512 exp16_expm1(__m512 x, __m512 rounded) {
  using namespace vmath;
  const __m512 n = _mm512_sub_ps(rounded, splat(kRound));
  __m512 r = _mm512_fnmadd_ps(n, splat(kLn2Over16Hi), x);
  r = _mm512_fnmadd_ps(n, splat(kLn2Over16Lo), r);
  const __m512 p = _mm512_mul_ps(_mm512_fmadd_ps(splat(kExpLutC3), r, splat(kExpLutC2)), r);
  return _mm512_fmadd_ps(p, r, r);
}
// The table as a vector: entry j = bits(2^(j/16)), less j << 19 with
// minus_j (exp_table's entries). _mm512_permutexvar_*
// picks entry j by the low 4 bits of each index lane.
inline __m512i exp2_sixteenths(bool minus_j) {
  const unsigned* t = vmath::kExp2Sixteenths;
  auto e = [&](int j) { return int32_t(t[j] - (minus_j ? unsigned(j) << 19 : 0u)); };
  return _mm512_setr_epi32(e(0), e(1), e(2), e(3), e(4), e(5), e(6), e(7), e(8), e(9), e(10),
                           e(11), e(12), e(13), e(14), e(15));
}

// exp(x) by the table for |x| <= kExpFast (n in [-2009, 2009], so q in
// [-126, 125] and every result normal), NaN -> NaN. 2^q 2^(j/16) is built in
// the integers: the table holds bits(2^(j/16)) - (j << 19), and adding
// (kRound + n) << 19 = n << 19 (kRound's bits shift out) leaves
// bits(2^(j/16)) + (q << 23). One rounding: the final fma.
inline __m512 exp_table(__m512 x) {
  const __m512 rounded = exp16_round(x);
  const __m512i nb = _mm512_castps_si512(rounded);
  const __m512i entry = _mm512_permutexvar_epi32(nb, exp2_sixteenths(true));
  const __m512 s = _mm512_castsi512_ps(_mm512_add_epi32(entry, _mm512_slli_epi32(nb, 19)));
  return _mm512_fmadd_ps(s, exp16_expm1(x, rounded), s);
}

// exp(x) over the whole range, clamped to [kExpLo, kExpHi] (NaN stays NaN).
// From -kExpFast up: exp_table's formula with 2^q applied by vscalefps, which
// is exact for normal results (so the bits equal exp_table's where both
// apply) and rounds overflow to +inf. Below -kExpFast (results near and
// below FLT_MIN): 2^n p with n = round(x log2 e) and p = exp(r) by the degree-6
// polynomial; the result's bits are the integer round(p 2^(n+149)), an exact
// product of normal numbers that cvtps2dq rounds once, to nearest even, on
// the subnormal grid (an integer of 2^23 or more is the right normal number),
// so no operation sees a subnormal.
inline __m512 exp_full(__m512 x) {
  using namespace vmath;
  x = _mm512_max_ps(splat(kExpLo), x);  // maxps returns the 2nd operand on NaN
  x = _mm512_min_ps(splat(kExpHi), x);
  // The low lanes' y, replaced below, from -kExpFast instead, so that it is
  // normal too (x itself made it subnormal or 0).
  const __m512 xf = _mm512_max_ps(splat(-kExpFast), x);
  const __m512 rounded = exp16_round(xf);
  const __m512 t = _mm512_castsi512_ps(
      _mm512_permutexvar_epi32(_mm512_castps_si512(rounded), exp2_sixteenths(false)));
  const __m512 q = _mm512_roundscale_ps(
      _mm512_mul_ps(_mm512_sub_ps(rounded, splat(kRound)), splat(1.0f / 16)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 y = _mm512_scalef_ps(_mm512_fmadd_ps(t, exp16_expm1(xf, rounded), t), q);
  const __mmask16 low = _mm512_cmp_ps_mask(x, splat(-kExpFast), _CMP_LT_OQ);  // not NaN
  if (low == 0) return y;
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, splat(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, splat(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, splat(kLn2Lo), r);
  // Those lanes have n in [-150, -126], so p 2^(n+149) is in [0.35, 2^23.5].
  const __m512 scaled = _mm512_scalef_ps(exp_poly(r), _mm512_add_ps(n, splat(149.0f)));
  return _mm512_mask_mov_ps(y, low, _mm512_castsi512_ps(_mm512_cvtps_epi32(scaled)));
}

// exp(x), within 1.01 ulp everywhere (subnormal results included; measured
// over every f32 with |x| < 106: 0.99 from -87 up, 1.004 below), +inf
// above ~88.72, exp(-inf) = +0, NaN -> NaN. Where every |x| <= kExpFast (or
// NaN): exp_table; otherwise exp_full, which gives the same bits for those
// lanes, so a lane's result does not depend on its neighbours.
inline __m512 exp_ps(__m512 x) {
  using namespace vmath;
  if (__builtin_expect(_mm512_cmp_ps_mask(_mm512_abs_ps(x), splat(kExpFast), _CMP_GT_OQ) != 0, 0))
    return exp_full(x);
  return exp_table(x);
}

// exp_ps for x <= 0 (or NaN): the same bits, one compare fewer.
inline __m512 exp_nonpositive_ps(__m512 x) {
  if (__builtin_expect(_mm512_cmp_ps_mask(x, splat(-vmath::kExpFast), _CMP_LT_OQ) != 0, 0))
    return exp_full(x);
  return exp_table(x);
}

// tanh(x): odd polynomial below kTanhSmall, em1 / (em1 + 2) above, where the
// quotient uses rcp14 plus one correction step (no division).
inline __m512 tanh_ps(__m512 x) {
  using namespace vmath;
  const __m512 sign = _mm512_castsi512_ps(
      _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(int32_t(0x80000000u))));
  const __m512 ax = _mm512_abs_ps(x);
  // Small |x|.
  const __m512 y = _mm512_mul_ps(ax, ax);
  __m512 q = splat(kTanhT4);
  q = _mm512_fmadd_ps(q, y, splat(kTanhT3));
  q = _mm512_fmadd_ps(q, y, splat(kTanhT2));
  q = _mm512_fmadd_ps(q, y, splat(kTanhT1));
  q = _mm512_fmadd_ps(q, y, splat(kTanhT0));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(ax, y), q, ax);
  // Large |x| (NaN lanes land here and stay NaN).
  const __m512 axc = _mm512_min_ps(splat(kTanhSat), ax);  // minps returns ax on NaN
  const __m512 x2 = _mm512_add_ps(axc, axc);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x2, splat(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, splat(kLn2Hi), x2);
  r = _mm512_fnmadd_ps(n, splat(kLn2Lo), r);
  const __m512 em1 = _mm512_fmadd_ps(_mm512_scalef_ps(splat(1.0f), n), exp_poly(r), splat(-1.0f));
  const __m512 den = _mm512_add_ps(em1, splat(2.0f));
  const __m512 rcp = _mm512_rcp14_ps(den);
  const __m512 t0 = _mm512_mul_ps(em1, rcp);
  const __m512 large = _mm512_fmadd_ps(_mm512_fnmadd_ps(den, t0, em1), rcp, t0);
  const __m512 res = _mm512_mask_blend_ps(
      _mm512_cmp_ps_mask(ax, splat(kTanhSmall), _CMP_LT_OQ), large, small);
  return _mm512_or_ps(res, sign);
}

}  // namespace
}  // namespace flce::simd::avx512
