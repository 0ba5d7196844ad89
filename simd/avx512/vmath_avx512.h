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

// exp(x) over the whole range: clamped, n in [-150, 128]. Where p 2^n is
// normal or overflows, vscalefps rounds it once. Where it is subnormal
// (n <= -126) the result's bits are the integer round(p 2^(n+149)): p 2^(n+149)
// is an exact product of normal numbers and cvtps2dq rounds it once, to
// nearest even, on the subnormal grid (an integer of 2^23 or more is the
// right normal number), so no operation sees a subnormal.
inline __m512 exp_full(__m512 x) {
  using namespace vmath;
  x = _mm512_max_ps(splat(kExpLo), x);  // maxps returns the 2nd operand on NaN
  x = _mm512_min_ps(splat(kExpHi), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, splat(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, splat(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, splat(kLn2Lo), r);
  const __m512 p = exp_poly(r);
  const __mmask16 sub = _mm512_cmp_ps_mask(n, splat(-125.5f), _CMP_LT_OQ);  // not NaN
  const __m512 y = _mm512_maskz_scalef_ps(__mmask16(~sub), p, n);
  const __m512 scaled = _mm512_maskz_scalef_ps(sub, p, _mm512_add_ps(n, splat(149.0f)));
  return _mm512_mask_mov_ps(y, sub, _mm512_castsi512_ps(_mm512_maskz_cvtps_epi32(sub, scaled)));
}

// exp(x), within 1.2 ulp everywhere (subnormal results included), +inf
// above ~88.72, exp(-inf) = +0, NaN -> NaN. Where every |x| <= kExpFast (or
// NaN) n is in [-126, 126] and p 2^n is normal: no clamps; otherwise
// exp_full. Both round p 2^n once, so a lane's result does not depend on the
// path taken.
inline __m512 exp_ps(__m512 x) {
  using namespace vmath;
  if (__builtin_expect(_mm512_cmp_ps_mask(_mm512_abs_ps(x), splat(kExpFast), _CMP_GT_OQ) != 0, 0))
    return exp_full(x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, splat(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, splat(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, splat(kLn2Lo), r);
  return _mm512_scalef_ps(exp_poly(r), n);
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
