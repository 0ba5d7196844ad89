// The fused sm90 epilogues' short softcap polynomials (src/cuda/softcap_small.h)
// against k tanh(z / k) in float64. They are host code too, so this runs on
// any machine: every 193rd float of [0, 0.6 k] (both are odd), and each end of
// the range float by float, for softcaps across the range they take.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

#include "cuda/softcap_small.h"
#include "simd/testing/float_bits.h"
#include "support/tolerance.h"

namespace {

using flce::cuda::kSoftcapSmallMaxK;
using flce::cuda::kSoftcapSmallMinK;
using flce::cuda::softcap_poly;
using flce::cuda::softcap_small;
using flce::cuda::SoftcapPoly;
using flce::cuda::tanh_small;

using flce::simd::testing::bits;
using flce::simd::testing::from_bits;

// The score a polynomial gives for z: s itself, or k t with the product
// exact, as pass 2's exponent FMA forms t (k log2(e)).
double s_of(float z, const SoftcapPoly& p) { return softcap_small(z, p); }
double kt_of(float z, const SoftcapPoly& p, double k) { return k * double(tanh_small(z, p)); }

// The largest error of a score over z = from_bits(b) for b in [first, last]
// by `step`, relative to max(|s|, floor), in units of f32's u = 2^-24 (-1: a
// wrong zero). floor is 0 for s, and k 2^-126 for k t, whose t is subnormal
// below it (softcap_small.h).
template <typename Score>
double worst_error_in_u(double k, double floor, uint32_t first, uint32_t last, uint32_t step,
                        Score score) {
  double worst = 0;
  for (uint64_t b = first; b <= last; b += step) {
    const float z = from_bits(uint32_t(b));
    const double exact = k * std::tanh(double(z) / k);
    const double s = score(z);
    if (exact == 0) {
      if (s != 0) return -1;
      continue;
    }
    const double error = std::fabs(s - exact) / std::fmax(std::fabs(exact), floor);
    if (!(error >= 0)) return -1;  // NaN
    worst = std::fmax(worst, error * 0x1p24);
  }
  return worst;
}

// Both polynomials of softcap k: sampled over the range and float by float
// at each end, within the policy's budget, and near what was measured.
void check_softcap(double k) {
  SCOPED_TRACE(testing::Message() << "k = " << k);
  const SoftcapPoly p = softcap_poly(k);
  ASSERT_GT(p.limit, 0);
  // The policy's budget for computing s from z: (kappa + 4) u (section 1 of
  // tests/support/tolerance.h: z/k, tanh, the product by k, k's conversion).
  const double budget = flce_test::kFunctionUlps + 4;
  const auto s = [&](float z) { return s_of(z, p); };
  const auto kt = [&](float z) { return kt_of(z, p, k); };
  const uint32_t top = bits(p.limit);
  for (int which = 0; which < 2; ++which) {
    SCOPED_TRACE(which == 0 ? "s" : "k t");
    const auto worst = [&](uint32_t first, uint32_t last, uint32_t step) {
      return which == 0 ? worst_error_in_u(k, 0, first, last, step, s)
                        : worst_error_in_u(k, k * 0x1p-126, first, last, step, kt);
    };
    const double sampled = worst(0, top, 193);
    const double low_end = worst(0, 100000, 1);
    const double high_end = worst(top - 100000, top, 1);
    EXPECT_GE(sampled, 0) << "a NaN, or a nonzero result where k tanh(z / k) is 0";
    EXPECT_GE(std::fmin(low_end, high_end), 0);
    EXPECT_LE(sampled, budget);
    EXPECT_LE(low_end, budget);
    EXPECT_LE(high_end, budget);
    // Sweeps of every 7th float of the range (the k here, 50, and the ends
    // of the k taken) measured at most 2.60 u for s and 4.04 u for k t; a
    // coefficient gone wrong shows far above.
    EXPECT_LE(std::fmax(sampled, high_end), which == 0 ? 3.0 : 4.5);
  }
}

TEST(SoftcapSmall, WithinThePolicysBudgetOverItsRange) {
  for (double k : {30.0, 1.0, 7.3, 1000.0, 1e-4}) check_softcap(k);
}

TEST(SoftcapSmall, WithinThePolicysBudgetAtTheEndsOfTheSoftcapsItTakes) {
  check_softcap(kSoftcapSmallMinK);
  check_softcap(kSoftcapSmallMaxK);
}

TEST(SoftcapSmall, IsOddAndExactAtZero) {
  const SoftcapPoly p = softcap_poly(30.0);
  for (float z : {0.0f, 1e-30f, 0.25f, 3.0f, 17.99f}) {
    EXPECT_EQ(softcap_small(-z, p), -softcap_small(z, p)) << z;
    EXPECT_EQ(tanh_small(-z, p), -tanh_small(z, p)) << z;
  }
  EXPECT_EQ(softcap_small(0.0f, p), 0.0f);
  EXPECT_EQ(tanh_small(0.0f, p), 0.0f);
  EXPECT_TRUE(std::isnan(softcap_small(NAN, p)));
  EXPECT_TRUE(std::isnan(tanh_small(NAN, p)));
}

TEST(SoftcapSmall, TakesNoRangeOutsideTheSoftcapsItServes) {
  EXPECT_EQ(softcap_poly(0.0).limit, 0.0f);
  EXPECT_EQ(softcap_poly(0.0).inv_k, 0.0f);
  EXPECT_EQ(softcap_poly(1e-30).limit, 0.0f);
  EXPECT_EQ(softcap_poly(kSoftcapSmallMinK / 2).limit, 0.0f);
  EXPECT_EQ(softcap_poly(kSoftcapSmallMaxK * 2).limit, 0.0f);
  EXPECT_EQ(softcap_poly(1e30).inv_k, float(1 / 1e30));  // tanhf still needs it
  EXPECT_EQ(softcap_poly(30.0).limit, 18.0f);
  EXPECT_EQ(softcap_poly(30.0).inv_k, float(1 / 30.0));
  // k log2(e) for pass 2's exponent from t, outside the range too (tanhf's t).
  for (double k : {30.0, 1e4})
    EXPECT_NEAR(softcap_poly(k).k_log2e, k / std::log(2.0), k * 0x1p-23) << k;
}

}  // namespace
