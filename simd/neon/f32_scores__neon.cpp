// scores, NEON: s = a (s + b), softcapped k tanh(z / k) with z / k as z * (1/k).
#include "simd/isa_kernels.h"
#include "simd/neon/vmath_neon.h"

namespace flce::simd {
namespace {

template <bool kBias, bool kCap>
void scores(float* s, const float* bias, int64_t n, float scale, float softcap) {
  using namespace neon;
  const float32x4_t a = splat(scale);
  const float32x4_t k = splat(softcap);
  const float32x4_t inv_k = splat(kCap ? 1.0f / softcap : 0.0f);
  auto one = [&](float32x4_t v, float32x4_t b) {
    const float32x4_t z = vmulq_f32(kBias ? vaddq_f32(v, b) : v, a);
    return kCap ? vmulq_f32(tanh_ps(vmulq_f32(z, inv_k)), k) : z;
  };
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const float32x4_t r0 = one(vld1q_f32(s + i), kBias ? vld1q_f32(bias + i) : a);
    const float32x4_t r1 = one(vld1q_f32(s + i + 4), kBias ? vld1q_f32(bias + i + 4) : a);
    vst1q_f32(s + i, r0);
    vst1q_f32(s + i + 4, r1);
  }
  for (; i + 4 <= n; i += 4) vst1q_f32(s + i, one(vld1q_f32(s + i), kBias ? vld1q_f32(bias + i) : a));
  if (i < n) {
    const float32x4_t r =
        one(load_partial(s + i, n - i, 0.0f), kBias ? load_partial(bias + i, n - i, 0.0f) : a);
    store_partial(s + i, n - i, r);
  }
}

}  // namespace

void f32_scores__neon(float* s, const float* bias, int64_t n, float scale, float softcap) {
  if (softcap > 0) {
    if (bias) scores<true, true>(s, bias, n, scale, softcap);
    else scores<false, true>(s, bias, n, scale, softcap);
  } else {
    if (bias) scores<true, false>(s, bias, n, scale, softcap);
    else scores<false, false>(s, bias, n, scale, softcap);
  }
}

}  // namespace flce::simd
