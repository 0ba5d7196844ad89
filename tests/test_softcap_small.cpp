// The fused sm90 epilogues' short softcap polynomial (src/cuda/softcap_small.h)
// against k tanh(z / k) in float64. It is host code too, so this runs on any
// machine: every 97th float of [0, 0.6 k] (the function is odd), and each
// end of the range float by float.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

#include "cuda/softcap_small.h"
#include "simd/testing/float_bits.h"
#include "support/tolerance.h"

namespace {

using flce::cuda::softcap_small;
using flce::cuda::softcap_small_limit;

using flce::simd::testing::bits;
using flce::simd::testing::from_bits;

// The largest relative error of softcap_small over z = from_bits(b) for b in
// [first, last] by `step`, in units of f32's u = 2^-24 (-1: a wrong zero).
double worst_error_in_u(double k, uint32_t first, uint32_t last, uint32_t step) {
  const float inv_k = float(1 / k);  // as cuda_backend.cpp converts it
  double worst = 0;
  for (uint64_t b = first; b <= last; b += step) {
    const float z = from_bits(uint32_t(b));
    const double exact = k * std::tanh(double(z) / k);
    const float s = softcap_small(z, inv_k);
    if (exact == 0) {
      if (s != 0) return -1;
      continue;
    }
    worst = std::fmax(worst, std::fabs(s - exact) / std::fabs(exact) * 0x1p24);
  }
  return worst;
}

TEST(SoftcapSmall, WithinThePolicysBudgetForTheSoftcapOverItsRange) {
  // The policy's budget for computing s from z: (kappa + 4) u (section 1 of
  // tests/support/tolerance.h: z/k, tanh, the product by k, k's conversion).
  const double budget = flce_test::kFunctionUlps + 4;
  for (double k : {30.0, 1.0, 7.3, 1000.0, 3e-5}) {
    const uint32_t top = bits(softcap_small_limit(float(k)));
    const double sampled = worst_error_in_u(k, 0, top, 97);
    const double low_end = worst_error_in_u(k, 0, 100000, 1);
    const double high_end = worst_error_in_u(k, top - 100000, top, 1);
    SCOPED_TRACE(testing::Message() << "k = " << k);
    EXPECT_GE(sampled, 0) << "a nonzero result where k tanh(z / k) is 0";
    EXPECT_LE(sampled, budget);
    EXPECT_LE(low_end, budget);
    EXPECT_LE(high_end, budget);
    // An exhaustive run over every float of the range (all k above) measured
    // at most 2.91 u; a fit or coefficient gone wrong shows far above that.
    EXPECT_LE(std::fmax(sampled, high_end), 3.0);
  }
}

TEST(SoftcapSmall, IsOddAndExactAtZero) {
  const float inv_k = float(1 / 30.0);
  for (float z : {0.0f, 1e-30f, 0.25f, 3.0f, 17.99f})
    EXPECT_EQ(softcap_small(-z, inv_k), -softcap_small(z, inv_k)) << z;
  EXPECT_EQ(softcap_small(0.0f, inv_k), 0.0f);
  EXPECT_TRUE(std::isnan(softcap_small(NAN, inv_k)));
}

TEST(SoftcapSmall, TakesNoRangeForATinyOrZeroSoftcap) {
  EXPECT_EQ(softcap_small_limit(0.0f), 0.0f);
  EXPECT_EQ(softcap_small_limit(1e-30f), 0.0f);
  EXPECT_EQ(softcap_small_limit(30.0f), 18.0f);
}

}  // namespace
