// scores, AVX-512: s = a (s + b), softcapped k tanh(z / k) with z / k as z * (1/k).
#include "simd/avx512/vmath_avx512.h"
#include "simd/isa_kernels.h"

namespace flce::simd {
namespace {

template <bool kBias, bool kCap>
void scores(float* s, const float* bias, int64_t n, float scale, float softcap) {
  using namespace avx512;
  const __m512 a = splat(scale);
  const __m512 k = splat(softcap);
  const __m512 inv_k = splat(kCap ? 1.0f / softcap : 0.0f);
  auto one = [&](__m512 v, __m512 b) {
    const __m512 z = _mm512_mul_ps(kBias ? _mm512_add_ps(v, b) : v, a);
    return kCap ? _mm512_mul_ps(tanh_ps(_mm512_mul_ps(z, inv_k)), k) : z;
  };
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 r0 = one(_mm512_loadu_ps(s + i), kBias ? _mm512_loadu_ps(bias + i) : a);
    const __m512 r1 = one(_mm512_loadu_ps(s + i + 16), kBias ? _mm512_loadu_ps(bias + i + 16) : a);
    _mm512_storeu_ps(s + i, r0);
    _mm512_storeu_ps(s + i + 16, r1);
  }
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(s + i, one(_mm512_loadu_ps(s + i), kBias ? _mm512_loadu_ps(bias + i) : a));
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 r = one(_mm512_maskz_loadu_ps(m, s + i), kBias ? _mm512_maskz_loadu_ps(m, bias + i) : a);
    _mm512_mask_storeu_ps(s + i, m, r);
  }
}

}  // namespace

void f32_scores__avx512(float* s, const float* bias, int64_t n, float scale, float softcap) {
  if (softcap > 0) {
    if (bias) scores<true, true>(s, bias, n, scale, softcap);
    else scores<false, true>(s, bias, n, scale, softcap);
  } else {
    if (bias) scores<true, false>(s, bias, n, scale, softcap);
    else scores<false, false>(s, bias, n, scale, softcap);
  }
}

}  // namespace flce::simd
