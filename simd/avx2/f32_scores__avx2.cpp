// scores, AVX2: s = a (s + b), softcapped k tanh(z / k) with z / k as z * (1/k).
#include "simd/avx2/vmath_avx2.h"
#include "simd/isa_kernels.h"

namespace flce::simd {
namespace {

template <bool kBias, bool kCap>
void scores(float* s, const float* bias, int64_t n, float scale, float softcap) {
  using namespace avx2;
  const __m256 a = splat(scale);
  const __m256 k = splat(softcap);
  const __m256 inv_k = splat(kCap ? 1.0f / softcap : 0.0f);
  auto one = [&](__m256 v, __m256 b) {
    const __m256 z = _mm256_mul_ps(kBias ? _mm256_add_ps(v, b) : v, a);
    return kCap ? _mm256_mul_ps(tanh_ps(_mm256_mul_ps(z, inv_k)), k) : z;
  };
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 r0 = one(_mm256_loadu_ps(s + i), kBias ? _mm256_loadu_ps(bias + i) : a);
    const __m256 r1 = one(_mm256_loadu_ps(s + i + 8), kBias ? _mm256_loadu_ps(bias + i + 8) : a);
    _mm256_storeu_ps(s + i, r0);
    _mm256_storeu_ps(s + i + 8, r1);
  }
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(s + i, one(_mm256_loadu_ps(s + i), kBias ? _mm256_loadu_ps(bias + i) : a));
  if (i < n) {
    const __m256i m = tail_mask(n - i);
    const __m256 r = one(_mm256_maskload_ps(s + i, m), kBias ? _mm256_maskload_ps(bias + i, m) : a);
    _mm256_maskstore_ps(s + i, m, r);
  }
}

}  // namespace

void f32_scores__avx2(float* s, const float* bias, int64_t n, float scale, float softcap) {
  if (softcap > 0) {
    if (bias) scores<true, true>(s, bias, n, scale, softcap);
    else scores<false, true>(s, bias, n, scale, softcap);
  } else {
    if (bias) scores<true, false>(s, bias, n, scale, softcap);
    else scores<false, false>(s, bias, n, scale, softcap);
  }
}

}  // namespace flce::simd
