// tests/test_simd.cpp: every kernel set this machine runs against the scalar
// reference (the checks live in simd/testing/kernel_checks.h and
// gemm_pack_checks.h, shared with the AArch64 driver .ci/neon_tests.sh builds
// and the emulated AVX-512 run), plus the ISA dispatch.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "simd/dispatch.h"
#include "simd/kernels.h"
#include "simd/testing/gemm_pack_checks.h"
#include "simd/testing/kernel_checks.h"

namespace flce::simd {
namespace {

using testing::Report;

const KernelSet* set_named(const std::string& isa) {
  if (isa == "scalar") return &scalar_kernels();
  if (isa == "avx2") return avx2_kernels();
  if (isa == "avx512") return avx512_kernels();
  if (isa == "neon") return neon_kernels();
  return nullptr;
}

// Why a set is missing: another architecture's ISA, or this CPU lacks it.
std::string missing_reason(const std::string& isa) {
#if defined(__aarch64__)
  const bool this_arch = isa == "scalar" || isa == "neon";
  const char* arch = "AArch64";
#else
  const bool this_arch = isa != "neon";
  const char* arch = "x86-64";
#endif
  return this_arch ? isa + " kernels skipped: not supported by this CPU"
                   : isa + " kernels skipped: not compiled into this " + arch + " build";
}

// The set under test, or a skip that names the ISA.
#define SIMD_REQUIRE_SET(var)                     \
  const KernelSet* var = set_named(GetParam());  \
  if (!var) GTEST_SKIP() << missing_reason(GetParam())

class SimdKernels : public ::testing::TestWithParam<std::string> {};

// The accuracy sweeps' stride over the f32 bit patterns: the suite's sample,
// or FLCE_SIMD_SWEEP_STRIDE (1: every float, a few minutes per set and
// function; the README's maxima come from that run).
uint32_t sweep_stride() {
  const char* env = std::getenv("FLCE_SIMD_SWEEP_STRIDE");
  if (env == nullptr || *env == '\0') return testing::kSweepStride;
  char* end = nullptr;
  const unsigned long v = std::strtoul(env, &end, 10);
  if (*end != '\0' || v < 1 || v > 0xffffffffUL) {
    ADD_FAILURE() << "FLCE_SIMD_SWEEP_STRIDE = '" << env << "': must be an integer in [1, 2^32 - 1]";
    return testing::kSweepStride;
  }
  return uint32_t(v);
}

TEST_P(SimdKernels, ExpMatchesScalar) {
  SIMD_REQUIRE_SET(ks);
  Report r;
  testing::check_exp(*ks, scalar_kernels(), r);
  EXPECT_EQ(r.failed, 0) << r.summary();
}

TEST_P(SimdKernels, ExpAccuracy) {
  SIMD_REQUIRE_SET(ks);
  const bool ref = GetParam() == "scalar";
  Report r;
  double worst = 0;
  testing::check_exp_accuracy(*ks, ref ? testing::kRefExpUlp : testing::kVecExpUlp, r, &worst,
                              sweep_stride());
  EXPECT_EQ(r.failed, 0) << r.summary();
  RecordProperty("max_ulp", std::to_string(worst));
  std::printf("%s exp: max %.3f ulp over %lld values\n", GetParam().c_str(), worst,
              (long long)r.checked);
}

TEST_P(SimdKernels, TanhAccuracy) {
  SIMD_REQUIRE_SET(ks);
  const bool ref = GetParam() == "scalar";
  Report r;
  double worst = 0;
  testing::check_tanh_accuracy(*ks, ref ? testing::kRefTanhUlp : testing::kVecTanhUlp, r, &worst,
                               sweep_stride());
  EXPECT_EQ(r.failed, 0) << r.summary();
  RecordProperty("max_ulp", std::to_string(worst));
  std::printf("%s tanh: max %.3f ulp over %lld values\n", GetParam().c_str(), worst,
              (long long)r.checked);
}

TEST_P(SimdKernels, ScoresMatchScalar) {
  SIMD_REQUIRE_SET(ks);
  Report r;
  testing::check_scores(*ks, scalar_kernels(), r);
  EXPECT_EQ(r.failed, 0) << r.summary();
}

TEST_P(SimdKernels, OnlineSoftmaxMatchesScalar) {
  SIMD_REQUIRE_SET(ks);
  Report r;
  testing::check_online_softmax(*ks, scalar_kernels(), r);
  EXPECT_EQ(r.failed, 0) << r.summary();
}

TEST_P(SimdKernels, OnlineSoftmaxLeavesOutWhatIsNotAskedFor) {
  SIMD_REQUIRE_SET(ks);
  Report r;
  testing::check_online_softmax_extras(*ks, r);
  EXPECT_EQ(r.failed, 0) << r.summary();
}

TEST_P(SimdKernels, OnlineSoftmaxSemantics) {
  SIMD_REQUIRE_SET(ks);
  Report r;
  testing::check_softmax_semantics(*ks, r);
  EXPECT_EQ(r.failed, 0) << r.summary();
}

TEST_P(SimdKernels, OnlineSoftmaxSameBitsAtEveryOffset) {
  SIMD_REQUIRE_SET(ks);
  Report r;
  testing::check_online_softmax_offsets(*ks, r);
  EXPECT_EQ(r.failed, 0) << r.summary();
}

// A read past an array's end or before its start faults here (guard pages).
TEST_P(SimdKernels, NoAccessOutsideTheArrays) {
  SIMD_REQUIRE_SET(ks);
  Report r;
  testing::check_reads_stay_inside(*ks, r);
  EXPECT_EQ(r.failed, 0) << r.summary();
}

TEST_P(SimdKernels, DlogitsMatchesScalar) {
  SIMD_REQUIRE_SET(ks);
  Report r;
  testing::check_dlogits(*ks, scalar_kernels(), r);
  EXPECT_EQ(r.failed, 0) << r.summary();
}

// The sweeps of simd/testing/gemm_pack_checks.h (sizes and promises there).
TEST_P(SimdKernels, GemmTnSweep) {
  SIMD_REQUIRE_SET(ks);
  if (!ks->gemm_tn) GTEST_SKIP() << GetParam() << " has no gemm_tn: the GEMM engine runs grad_W";
  Report r;
  testing::check_gemm_tn<testing::F32Elements>(ks->gemm_tn, r);
  EXPECT_EQ(r.failed, 0) << r.summary();
}

TEST_P(SimdKernels, GemmTnBf16Sweep) {
  SIMD_REQUIRE_SET(ks);
  if (!ks->gemm_tn_bf16)
    GTEST_SKIP() << GetParam() << " has no gemm_tn_bf16 on this CPU: the GEMM engine runs bf16 grad_W";
  Report r;
  testing::check_gemm_tn<testing::Bf16Elements>(ks->gemm_tn_bf16, r);
  testing::check_gemm_tn_bf16_flushes(ks->gemm_tn_bf16, r);
  EXPECT_EQ(r.failed, 0) << r.summary();
}

TEST_P(SimdKernels, PackScoresSweep) {
  SIMD_REQUIRE_SET(ks);
  if (!ks->pack_scores) GTEST_SKIP() << GetParam() << " has no pack_scores: the cpu backend keeps f32 scores";
  Report r;
  testing::check_pack_scores(*ks, r);
  EXPECT_EQ(r.failed, 0) << r.summary();
}

INSTANTIATE_TEST_SUITE_P(Simd, SimdKernels,
                         ::testing::Values("scalar", "avx2", "avx512", "neon"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

TEST(SimdDispatch, CapsAndSets) {
  Report r;
  ::testing::internal::CaptureStderr();  // the warnings of the ignored caps
  testing::check_dispatch(r);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(r.failed, 0) << r.summary();
  EXPECT_NE(err.find("ignoring FLCE_MAX_ISA=bogus"), std::string::npos) << err;
}

TEST(SimdDispatch, CapNamesTheChosenSet) {
#if defined(__aarch64__)
  GTEST_SKIP() << "x86 caps; AArch64 is covered by check_dispatch";
#else
  EXPECT_STREQ(kernels_for_cap("scalar").isa, "scalar");
  if (avx2_kernels()) {
    EXPECT_STREQ(kernels_for_cap("avx2").isa, "avx2");
  }
  if (avx512_kernels()) {
    EXPECT_STREQ(kernels_for_cap("avx512").isa, "avx512");
    EXPECT_STREQ(kernels_for_cap(nullptr).isa, "avx512");
  }
  // Unknown: one warning line on stderr, then ignored.
  ::testing::internal::CaptureStderr();
  const KernelSet& k = kernels_for_cap("sse9");
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(&k, &kernels_for_cap(nullptr));
  EXPECT_NE(err.find("FLCE_MAX_ISA=sse9"), std::string::npos) << err;
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
#endif
}

}  // namespace
}  // namespace flce::simd
