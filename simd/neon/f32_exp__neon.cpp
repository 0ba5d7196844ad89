// exp, NEON: 4 vectors per iteration; the tail goes through one padded vector.
#include "simd/isa_kernels.h"
#include "simd/neon/vmath_neon.h"

namespace flce::simd {

void f32_exp__neon(const float* x, float* y, int64_t n) {
  using namespace neon;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const float32x4_t a = exp_ps(vld1q_f32(x + i));
    const float32x4_t b = exp_ps(vld1q_f32(x + i + 4));
    const float32x4_t c = exp_ps(vld1q_f32(x + i + 8));
    const float32x4_t d = exp_ps(vld1q_f32(x + i + 12));
    vst1q_f32(y + i, a);
    vst1q_f32(y + i + 4, b);
    vst1q_f32(y + i + 8, c);
    vst1q_f32(y + i + 12, d);
  }
  for (; i + 4 <= n; i += 4) vst1q_f32(y + i, exp_ps(vld1q_f32(x + i)));
  if (i < n) store_partial(y + i, n - i, exp_ps(load_partial(x + i, n - i, 0.0f)));
}

}  // namespace flce::simd
