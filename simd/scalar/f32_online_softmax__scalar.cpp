// Reference online softmax: the two-pass algorithm of the vector sets with
// plain loops and sequential f32 sums (isa_kernels.h has the semantics).
#include <cmath>

#include "simd/common.h"
#include "simd/isa_kernels.h"

namespace flce::simd {

void f32_online_softmax__scalar(const float* s, const float* class_w, int64_t n, int64_t j0,
                                unsigned extras, SoftmaxState* state) {
  float tile_max = -detail::kInf;  // NaN compares false: ignored
  for (int64_t i = 0; i < n; ++i)
    if (s[i] > tile_max) tile_max = s[i];

  const float shift = detail::shift_of(tile_max > state->max ? tile_max : state->max);
  const bool moments = extras & kSoftmaxMoments;
  float sum_exp = 0, sum_exp_d = 0, sum_cs = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float d = s[i] - shift;
    const float e = std::exp(d);
    sum_exp += e;
    if (!moments) continue;
    sum_exp_d += e == 0 ? 0.0f : e * d;
    if (class_w) sum_cs += class_w[i] * s[i];
    else sum_cs += s[i];
  }

  int64_t argmax = -1;
  if ((extras & kSoftmaxArgmax) && detail::tile_argmax_needed(state, tile_max, j0))
    for (int64_t i = 0; i < n; ++i)
      if (s[i] == tile_max) { argmax = j0 + i; break; }
  int64_t first_nan = -1;
  if (std::isnan(sum_exp))
    for (int64_t i = 0; i < n; ++i)
      if (std::isnan(s[i])) { first_nan = j0 + i; break; }

  detail::fold_tile(state, tile_max, sum_exp, sum_exp_d, sum_cs, argmax, first_nan);
}

}  // namespace flce::simd
