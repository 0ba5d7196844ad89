// bf16/f16 conversions: round to nearest even, once, from the source value.
// Oracles: the CPU's own F16C instruction (vcvtps2ph) for f32 -> f16, and
// the integer round-half-even formula for f32 -> bf16; exhaustive decoding.
#include <gtest/gtest.h>
#include <immintrin.h>

#include <cmath>
#include <random>
#include <vector>

#include "common/float16.h"
#include "cpu/operands.h"
#include "simd/testing/float_bits.h"

namespace flce {
namespace {

using flce::simd::testing::bits;
using flce::simd::testing::from_bits;

// Nearest bf16 by search: the truncation and the next pattern away from
// zero bracket f; take the closer in exact double arithmetic, the even one
// on a tie (finite f whose rounding stays finite).
uint16_t bf16_by_search(float f) {
  const uint16_t lo = uint16_t(bits(f) >> 16), hi = uint16_t(lo + 1);
  const double d_lo = std::fabs(double(bf16_to_f32(lo)) - f);
  const double d_hi = std::fabs(double(bf16_to_f32(hi)) - f);
  if (d_lo != d_hi) return d_lo < d_hi ? lo : hi;
  return (lo & 1) ? hi : lo;
}

__attribute__((target("f16c"))) uint16_t f16_by_hardware(float f) {
  return uint16_t(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}

TEST(Float16, F16DecodeEncodeRoundTripsEveryPattern) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = f16_to_f32(uint16_t(b));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(f))));
      continue;
    }
    ASSERT_EQ(f32_to_f16(f), b) << "pattern " << b;
    ASSERT_EQ(f64_to_f16(double(f)), b) << "pattern " << b;
  }
}

TEST(Float16, Bf16DecodeEncodeRoundTripsEveryPattern) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = bf16_to_f32(uint16_t(b));
    if (std::isnan(f)) continue;
    ASSERT_EQ(f32_to_bf16(f), b) << "pattern " << b;
    ASSERT_EQ(f64_to_bf16(double(f)), b) << "pattern " << b;
  }
}

TEST(Float16, F32ToF16MatchesF16cInstruction) {
  if (!__builtin_cpu_supports("f16c")) GTEST_SKIP() << "this CPU has no F16C";
  std::mt19937 rng(7);
  for (int i = 0; i < 2000000; ++i) {
    float f = from_bits(rng());
    if (std::isnan(f)) continue;
    if (i % 2) f = std::ldexp(float(rng() % 65536) / 65536.0f + 1.0f, int(rng() % 44) - 28);
    ASSERT_EQ(f32_to_f16(f), f16_by_hardware(f)) << "value " << f;
  }
}

TEST(Float16, F32AndF64ToBf16MatchTheNearestBySearch) {
  std::mt19937 rng(11);
  for (int i = 0; i < 2000000; ++i) {
    const float f = from_bits(rng());
    if (!std::isfinite(f) || std::fabs(f) > 3.38e38f) continue;  // rounding past the max: Inf
    ASSERT_EQ(f32_to_bf16(f), bf16_by_search(f)) << "value " << f;
    ASSERT_EQ(f64_to_bf16(double(f)), bf16_by_search(f)) << "value " << f;
  }
}

TEST(Float16, TiesGoToEven) {
  // 1 + 2^-8 lies halfway between bf16 1 and 1 + 2^-7: ties to 1 (even).
  EXPECT_EQ(f64_to_bf16(1.0 + std::ldexp(1.0, -8)), 0x3F80);
  // 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: ties to even 1 + 2^-6.
  EXPECT_EQ(f64_to_bf16(1.0 + 3 * std::ldexp(1.0, -8)), 0x3F82);
  // f16: 2049 lies halfway between 2048 and 2050: ties to 2048.
  EXPECT_EQ(f64_to_f16(2049.0), f32_to_f16(2048.0f));
}

TEST(Float16, F64RoundsOnceNotThroughF32) {
  // Just above the bf16 midpoint 1 + 2^-8 by less than half an f32 ulp:
  // through f32 it would land on the midpoint and tie down to 1.0; rounded
  // once it goes up to 1 + 2^-7.
  const double v = 1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -30);
  EXPECT_EQ(f64_to_bf16(v), 0x3F81);
  EXPECT_EQ(f32_to_bf16(float(v)), 0x3F80);
}

TEST(Float16, OverflowSubnormalsAndSpecials) {
  EXPECT_EQ(f64_to_f16(65504.0), 0x7BFF);        // largest finite f16
  EXPECT_EQ(f64_to_f16(65520.0), 0x7C00);        // rounds up to +Inf
  EXPECT_EQ(f64_to_f16(-1e10), 0xFC00);
  EXPECT_EQ(f64_to_f16(std::ldexp(1.0, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(f64_to_f16(std::ldexp(1.0, -25)), 0x0000);  // half of it: ties to 0
  EXPECT_EQ(f64_to_f16(std::ldexp(1.5, -25)), 0x0001);
  EXPECT_EQ(f64_to_bf16(-0.0), 0x8000);
  EXPECT_EQ(f64_to_bf16(INFINITY), 0x7F80);
  EXPECT_EQ(f64_to_bf16(3.5e38), 0x7F80);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f64_to_bf16(NAN))));
  EXPECT_TRUE(std::isnan(f16_to_f32(f64_to_f16(-NAN))));
  EXPECT_EQ(f16_to_f32(0x3C00), 1.0f);
  EXPECT_EQ(f16_to_f32(0x8001), -std::ldexp(1.0f, -24));
}

// The cpu backend's bf16 conversions (vector clones, branch-free) against
// f32_to_bf16: every f32 pattern, in 4096-element calls.
TEST(Float16, CpuBf16ConversionsMatchEveryPattern) {
  std::vector<float> in(4096), rounded(4096);
  std::vector<uint16_t> bf16_bits(4096);
  for (uint64_t start = 0; start < (uint64_t(1) << 32); start += in.size()) {
    for (size_t i = 0; i < in.size(); ++i) in[i] = from_bits(uint32_t(start + i));
    cpu::f32_to_bf16_bits(in.data(), int64_t(in.size()), bf16_bits.data());
    rounded = in;
    cpu::round_to_storage(rounded.data(), int64_t(rounded.size()), Dtype::bf16);
    for (size_t i = 0; i < in.size(); ++i) {
      const uint16_t want = f32_to_bf16(in[i]);
      if (std::isnan(in[i])) {  // a quiet NaN of the same sign; payloads may differ
        ASSERT_TRUE((bf16_bits[i] & 0x7FC0) == 0x7FC0 && (bf16_bits[i] >> 15) == (want >> 15))
            << start + i;
        ASSERT_EQ(bits(rounded[i]), uint32_t(bf16_bits[i]) << 16) << "pattern " << start + i;
        continue;
      }
      ASSERT_EQ(bf16_bits[i], want) << "pattern " << start + i;
      ASSERT_EQ(bits(rounded[i]), uint32_t(want) << 16) << "pattern " << start + i;
    }
  }
}

// Every length and start offset around the vector widths: in place
// (f32_to_bf16_in_place), nothing written past the end; out of place
// (f32_to_bf16_bits) and rounded (round_to_storage) in arrays that end
// exactly where the n values do, so that the sanitizers catch any access
// past them (the every-pattern test above checks the values, not this).
TEST(Float16, CpuBf16ConversionsAnyLengthAndOffset) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 100.0f);
  for (int64_t offset = 0; offset < 17; ++offset)
    for (int64_t n = 1; n <= 600; n += (n < 70 ? 1 : 37)) {
      std::vector<float> values(size_t(offset + n + 16), 1.5f);
      for (int64_t i = 0; i < n; ++i) values[size_t(offset + i)] = normal(rng);
      const std::vector<float> before = values;
      cpu::f32_to_bf16_in_place(values.data() + offset, n);
      const auto* packed = reinterpret_cast<const uint16_t*>(values.data() + offset);
      for (int64_t i = 0; i < n; ++i)
        ASSERT_EQ(packed[i], f32_to_bf16(before[size_t(offset + i)])) << "n " << n << " i " << i;
      for (size_t i = size_t(offset + n); i < values.size(); ++i) ASSERT_EQ(values[i], 1.5f);

      std::vector<float> exact(before.begin(), before.begin() + offset + n);
      std::vector<uint16_t> bf16_bits(size_t(offset + n));
      cpu::f32_to_bf16_bits(exact.data() + offset, n, bf16_bits.data() + offset);
      cpu::round_to_storage(exact.data() + offset, n, Dtype::bf16);
      for (int64_t i = offset; i < offset + n; ++i) {
        ASSERT_EQ(bf16_bits[size_t(i)], packed[i - offset]) << "n " << n << " i " << i;
        ASSERT_EQ(bits(exact[size_t(i)]), uint32_t(packed[i - offset]) << 16) << "n " << n << " i " << i;
      }
    }
}

}  // namespace
}  // namespace flce
