// Reference exp: libm's expf (correctly rounded or within 1 ulp).
#include <cmath>

#include "simd/isa_kernels.h"

namespace flce::simd {

void f32_exp__scalar(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = std::exp(x[i]);
}

}  // namespace flce::simd
