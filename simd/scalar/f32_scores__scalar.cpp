// Reference scores: s = a (s + b), then k tanh(z / k) when k > 0.
#include <cmath>

#include "simd/isa_kernels.h"

namespace flce::simd {

void f32_scores__scalar(float* s, const float* bias, int64_t n, float scale, float softcap) {
  for (int64_t i = 0; i < n; ++i) {
    const float z = scale * (bias ? s[i] + bias[i] : s[i]);
    s[i] = softcap > 0 ? softcap * std::tanh(z / softcap) : z;
  }
}

}  // namespace flce::simd
