// tests/test_simd.cpp: every kernel set this machine runs against the scalar
// reference (the checks live in simd/testing/kernel_checks.h, shared with the
// AArch64 driver .ci/neon_tests.sh builds), plus the ISA dispatch.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/float16.h"
#include "simd/dispatch.h"
#include "simd/kernels.h"
#include "simd/testing/kernel_checks.h"
#include "support/tolerance.h"

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

// The elements of gemm_tn's A and B: f32, or bf16 bits (gemm_tn_bf16).
struct F32Elements {
  using T = float;
  static T make(float v) { return v; }
  static double value(T v) { return v; }
};
struct Bf16Elements {
  using T = uint16_t;
  static T make(float v) { return f32_to_bf16(v); }
  static double value(T v) { return bf16_to_f32(v); }
};

// gemm_tn or gemm_tn_bf16, C (+)= A^T B, over the sizes around both
// kernels' micro-tiles (6 x 64, 8 x 48), their packing pieces of rows (516,
// 512) and of k (128, 256) and their panels (512, 480 columns), k = 0 too
// (C = 0 or kept), with A and B inside larger arrays and C written with and
// without accumulate. Each element must be within gamma_{k+1} (|C| +
// sum_p |a_p b_p|) of the exact sum (the bound of any k + 1 term f32 sum,
// NUMERICS.md; bf16 products are exact in f32); without accumulate a
// NaN-filled C must be ignored; the padding of C must stay untouched; and
// splitting m and n over four calls must give the same bits (the kernel's
// promise, which keeps the cpu backend's grad_W independent of its tiling).
template <class E, class Kernel>
int sweep_gemm_tn(Kernel kernel) {
  using T = typename E::T;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  const double u = std::ldexp(1.0, -24);
  // The packing scratch, 64-byte aligned as the kernel requires.
  std::vector<float> scratch_store(size_t(kGemmTnScratchFloats) + 16);
  float* const scratch = reinterpret_cast<float*>(
      (reinterpret_cast<uintptr_t>(scratch_store.data()) + 63) / 64 * 64);
  int failures = 0;
  for (int64_t m : {1, 5, 6, 7, 8, 9, 17, 64, 600}) {  // 600: two pieces of rows
    for (int64_t n : {1, 15, 16, 17, 47, 48, 49, 63, 64, 65, 130, 480, 481, 512, 513, 600}) {
      for (int64_t k : {0, 1, 2, 3, 7, 48, 520}) {  // 520: pieces of 128 and 256
        if (m * n * k > 20000000) continue;  // the exact sums' cost
        for (bool accumulate : {false, true}) {
          const int64_t lda = m + 3, ldb = n + 5, ldc = n + 2;
          std::vector<T> a(size_t(k * lda)), b(size_t(k * ldb));
          std::vector<float> c0(size_t(m * ldc));
          for (T& v : a) v = E::make(normal(rng));
          for (T& v : b) v = E::make(normal(rng));
          for (float& v : c0) v = accumulate ? normal(rng) : std::numeric_limits<float>::quiet_NaN();
          auto call = [&](int64_t i0, int64_t i1, int64_t j0, int64_t j1, float* c) {
            if (i1 > i0 && j1 > j0)
              kernel(i1 - i0, j1 - j0, k, a.data() + i0, lda, b.data() + j0, ldb,
                     c + i0 * ldc + j0, ldc, accumulate, scratch);
          };
          const std::string where = "m=" + std::to_string(m) + " n=" + std::to_string(n) +
                                    " k=" + std::to_string(k) + " acc=" + std::to_string(accumulate);
          std::vector<float> c = c0;
          call(0, m, 0, n, c.data());
          for (int64_t i = 0; i < m; ++i) {
            for (int64_t j = 0; j < n; ++j) {
              double exact = accumulate ? c0[i * ldc + j] : 0.0, mag = std::fabs(exact);
              for (int64_t p = 0; p < k; ++p) {
                const double t = E::value(a[p * lda + i]) * E::value(b[p * ldb + j]);
                exact += t, mag += std::fabs(t);
              }
              const double bound = flce_test::gamma(double(k + 1), u) * mag;
              if (!(std::fabs(c[i * ldc + j] - exact) <= bound) && ++failures <= 5)
                ADD_FAILURE() << where << ": C[" << i << "," << j << "] = " << c[i * ldc + j]
                              << ", exact " << exact << " (bound " << bound << ")";
            }
            for (int64_t j = n; j < ldc; ++j)
              if (std::memcmp(&c[i * ldc + j], &c0[i * ldc + j], 4) != 0 && ++failures <= 5)
                ADD_FAILURE() << where << ": padding C[" << i << "," << j << "] written";
          }
          std::vector<float> split = c0;
          const int64_t mh = m / 2, nh = n / 3;
          call(0, mh, 0, nh, split.data()), call(0, mh, nh, n, split.data());
          call(mh, m, 0, nh, split.data()), call(mh, m, nh, n, split.data());
          for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < n; ++j)
              if (std::memcmp(&split[i * ldc + j], &c[i * ldc + j], 4) != 0 && ++failures <= 5)
                ADD_FAILURE() << where << ": C[" << i << "," << j << "] differs when the call is split";
        }
      }
    }
  }
  return failures;
}

TEST_P(SimdKernels, GemmTnSweep) {
  SIMD_REQUIRE_SET(ks);
  if (!ks->gemm_tn) GTEST_SKIP() << GetParam() << " has no gemm_tn: the GEMM engine runs grad_W";
  EXPECT_EQ(sweep_gemm_tn<F32Elements>(ks->gemm_tn), 0);
}

TEST_P(SimdKernels, GemmTnBf16Sweep) {
  SIMD_REQUIRE_SET(ks);
  if (!ks->gemm_tn_bf16)
    GTEST_SKIP() << GetParam() << " has no gemm_tn_bf16 on this CPU: the GEMM engine runs bf16 grad_W";
  EXPECT_EQ(sweep_gemm_tn<Bf16Elements>(ks->gemm_tn_bf16), 0);
}

// pack_scores / unpack_scores (isa_kernels.h): every code is the f16 of the
// f32 difference ref - s, raised to -65504 where finite, rounded as
// flce::f32_to_f16 rounds (nearest even), and unpacking gives ref minus it
// in f32. Lengths 1 .. 70 and 513 at every offset within a 64-byte line, over
// scores around ref (normal and subnormal f16 differences, ties, overflow)
// and the non-finite ones; ref 0 with +inf (a row whose max is infinite);
// ref 2^41, where ref - 65504 is ref again in f32.
TEST_P(SimdKernels, PackScoresSweep) {
  SIMD_REQUIRE_SET(ks);
  if (!ks->pack_scores) GTEST_SKIP() << GetParam() << " has no pack_scores: the cpu backend keeps f32 scores";
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> below(-80.0f, 0.0f);
  const float kInf = std::numeric_limits<float>::infinity();
  const float special[] = {0.0f, -0x1p-20f, -0x1p-14f, -0x1.002p-3f, -65504.0f, -65519.0f, -65520.0f,
                           -1e30f, -kInf, kInf, std::numeric_limits<float>::quiet_NaN(),
                           -0x1p41f};  // s = 0 at ref 2^41: far below, not at ref
  const size_t kSpecial = sizeof(special) / sizeof(float);
  int failures = 0;
  std::vector<int64_t> lengths;
  for (int64_t n = 1; n <= 70; ++n) lengths.push_back(n);
  lengths.push_back(513);
  for (float ref : {3.5f, 0.0f, -1000.25f, 0x1p41f})
    for (int64_t n : lengths)
      for (int64_t offset = 0; offset < 16; offset += (n > 70 ? 5 : 1)) {
        std::vector<float> s(size_t(n + offset)), back(size_t(n + offset) + 1, 7.0f);
        std::vector<uint16_t> d(size_t(n + offset) + 1, 0xABCD);
        for (int64_t i = 0; i < n; ++i) {
          const size_t k = size_t(i) % (kSpecial + 5);
          s[size_t(offset + i)] = k < kSpecial ? ref + special[k] : ref + below(rng);
          if (ref == 0.0f && k == 9) s[size_t(offset + i)] = 12.0f;  // a finite score beside +inf
        }
        ks->pack_scores(s.data() + offset, n, ref, d.data() + offset);
        ks->unpack_scores(d.data() + offset, n, ref, back.data() + offset);
        for (int64_t i = 0; i < n; ++i) {
          const float x = ref - s[size_t(offset + i)];
          const float clamped = std::isfinite(x) ? std::max(x, -65504.0f) : x;
          const uint16_t want = flce::f32_to_f16(clamped);
          const uint16_t got = d[size_t(offset + i)];
          const float want_back = ref - flce::f16_to_f32(want);
          const float got_back = back[size_t(offset + i)];
          const bool same_back = std::isnan(want_back) ? std::isnan(got_back) : got_back == want_back;
          const bool both_nan = std::isnan(x) && (got & 0x7C00) == 0x7C00 && (got & 0x3FF) != 0;
          if ((got != want && !both_nan) || !same_back) {
            if (++failures <= 5)
              ADD_FAILURE() << "ref " << ref << " s " << s[size_t(offset + i)] << " (n " << n << ", i " << i
                            << "): code " << got << " want " << want << ", back " << got_back << " want "
                            << want_back;
          }
        }
        if (d[size_t(n + offset)] != 0xABCD || back[size_t(n + offset)] != 7.0f) {
          if (++failures <= 5) ADD_FAILURE() << "wrote past the end at n " << n << ", offset " << offset;
        }
      }
  EXPECT_EQ(failures, 0);
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
