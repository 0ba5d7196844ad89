// exp, AVX-512: 4 vectors per iteration, one masked vector for the tail.
#include "simd/avx512/vmath_avx512.h"
#include "simd/isa_kernels.h"

namespace flce::simd {

void f32_exp__avx512(const float* x, float* y, int64_t n) {
  using namespace avx512;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m512 a = exp_ps(_mm512_loadu_ps(x + i));
    const __m512 b = exp_ps(_mm512_loadu_ps(x + i + 16));
    const __m512 c = exp_ps(_mm512_loadu_ps(x + i + 32));
    const __m512 d = exp_ps(_mm512_loadu_ps(x + i + 48));
    _mm512_storeu_ps(y + i, a);
    _mm512_storeu_ps(y + i + 16, b);
    _mm512_storeu_ps(y + i + 32, c);
    _mm512_storeu_ps(y + i + 48, d);
  }
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, exp_ps(_mm512_loadu_ps(x + i)));
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    _mm512_mask_storeu_ps(y + i, m, exp_ps(_mm512_maskz_loadu_ps(m, x + i)));
  }
}

}  // namespace flce::simd
