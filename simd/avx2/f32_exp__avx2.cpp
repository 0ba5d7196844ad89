// exp, AVX2: 4 vectors per iteration, one masked vector for the tail.
#include "simd/avx2/vmath_avx2.h"
#include "simd/isa_kernels.h"

namespace flce::simd {

void f32_exp__avx2(const float* x, float* y, int64_t n) {
  using namespace avx2;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256 a = exp_ps(_mm256_loadu_ps(x + i));
    const __m256 b = exp_ps(_mm256_loadu_ps(x + i + 8));
    const __m256 c = exp_ps(_mm256_loadu_ps(x + i + 16));
    const __m256 d = exp_ps(_mm256_loadu_ps(x + i + 24));
    _mm256_storeu_ps(y + i, a);
    _mm256_storeu_ps(y + i + 8, b);
    _mm256_storeu_ps(y + i + 16, c);
    _mm256_storeu_ps(y + i + 24, d);
  }
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, exp_ps(_mm256_loadu_ps(x + i)));
  if (i < n) {
    const __m256i m = tail_mask(n - i);
    _mm256_maskstore_ps(y + i, m, exp_ps(_mm256_maskload_ps(x + i, m)));
  }
}

}  // namespace flce::simd
