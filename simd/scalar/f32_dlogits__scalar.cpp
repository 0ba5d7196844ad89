// Reference dlogits (isa_kernels.h has the semantics).
#include <cmath>

#include "simd/isa_kernels.h"

namespace flce::simd {

void f32_dlogits__scalar(const float* s, const float* class_w, int64_t n,
                         const DlogitsParams* params, float* g) {
  const DlogitsParams q = *params;
  for (int64_t i = 0; i < n; ++i) {
    const float si = s[i];
    const float p = std::exp(si - q.lse);
    float d = q.coef_p * p;
    if (q.coef_c != 0) d += q.coef_c * (class_w ? class_w[i] : 1.0f);
    if (q.coef_h != 0) d -= q.coef_h * (p == 0 ? 0.0f : p * ((si - q.shift) - q.sbar_d));
    if (q.softcap > 0) {
      const float t = si / q.softcap;
      g[i] = q.scale * (1 - t * t) * d;
    } else {
      g[i] = q.scale * d;
    }
  }
}

}  // namespace flce::simd
