// simd/testing/gemm_pack_checks.h: the checks of the x86 sets' extra kernels,
// gemm_tn / gemm_tn_bf16 and pack_scores / unpack_scores (isa_kernels.h),
// shared by tests/test_simd.cpp and the emulated AVX-512 run
// (simd/testing/avx512_emulated_test_main.cpp). Header-only and plain C++
// (no gtest), as kernel_checks.h; needs src/ on the include path for the
// f16 / bf16 conversions the expected values come from.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/float16.h"
#include "simd/kernels.h"
#include "simd/testing/kernel_checks.h"

namespace flce::simd::testing {

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
// gemm_tn's packing scratch, 64-byte aligned as the kernels require.
inline float* gemm_tn_scratch() {
  alignas(64) static float scratch[kGemmTnScratchFloats];
  return scratch;
}

template <class E, class Kernel>
void check_gemm_tn(Kernel kernel, Report& r) {
  using T = typename E::T;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  float* const scratch = gemm_tn_scratch();
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
          for (float& v : c0) v = accumulate ? normal(rng) : kNaN;
          auto call = [&](int64_t i0, int64_t i1, int64_t j0, int64_t j1, float* c) {
            if (i1 > i0 && j1 > j0)
              kernel(i1 - i0, j1 - j0, k, a.data() + i0, lda, b.data() + j0, ldb,
                     c + i0 * ldc + j0, ldc, accumulate, scratch);
          };
          const std::string where = format("m=%lld n=%lld k=%lld acc=%d", (long long)m, (long long)n,
                                           (long long)k, int(accumulate));
          std::vector<float> c = c0;
          call(0, m, 0, n, c.data());
          for (int64_t i = 0; i < m; ++i) {
            for (int64_t j = 0; j < n; ++j) {
              double exact = accumulate ? c0[i * ldc + j] : 0.0, mag = std::fabs(exact);
              for (int64_t p = 0; p < k; ++p) {
                const double t = E::value(a[p * lda + i]) * E::value(b[p * ldb + j]);
                exact += t, mag += std::fabs(t);
              }
              const double bound = gamma(k + 1) * mag;
              r.expect(std::fabs(c[i * ldc + j] - exact) <= bound, [&] {
                return where + format(": C[%lld,%lld] = %.9g, exact %.9g (bound %.3g)", (long long)i,
                                      (long long)j, c[i * ldc + j], exact, bound);
              });
            }
            for (int64_t j = n; j < ldc; ++j)
              r.expect(same_bits(c[i * ldc + j], c0[i * ldc + j]), [&] {
                return where + format(": padding C[%lld,%lld] written", (long long)i, (long long)j);
              });
          }
          std::vector<float> split = c0;
          const int64_t mh = m / 2, nh = n / 3;
          call(0, mh, 0, nh, split.data()), call(0, mh, nh, n, split.data());
          call(mh, m, 0, nh, split.data()), call(mh, m, nh, n, split.data());
          for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < n; ++j)
              r.expect(same_bits(split[i * ldc + j], c[i * ldc + j]), [&] {
                return where + format(": C[%lld,%lld] differs when the call is split", (long long)i,
                                      (long long)j);
              });
        }
      }
    }
  }
}

// gemm_tn_bf16's flushes (isa_kernels.h: vdpbf16ps reads subnormal
// operands as 0 and flushes a subnormal C and a subnormal sum, whatever
// MXCSR says), each with k = 1 (its pair completed by 0) on a 1 x 1 C:
//  * C = 1e-40 plus 2^-70 * 2^-70: the sum 1e-40 + 2^-140 is subnormal -> 0;
//  * C = 1 plus (subnormal a = 2^-130) * 2^127: a read as 0 -> C stays 1
//    (unflushed, 1 + 2^-3 is exact in f32);
//  * C = 0 plus 2^-63 * 2^-63 = 2^-126, the smallest normal: kept.
template <class Kernel>
void check_gemm_tn_bf16_flushes(Kernel kernel, Report& r) {
  struct Case {
    float a, b, c, want;
    const char* what;
  };
  const Case cases[] = {{0x1p-70f, 0x1p-70f, 1e-40f, 0.0f, "a subnormal C and sum"},
                        {0x1p-130f, 0x1p127f, 1.0f, 1.0f, "a subnormal operand"},
                        {0x1p-63f, 0x1p-63f, 0.0f, 0x1p-126f, "the smallest normal sum"}};
  for (const Case& t : cases) {
    const uint16_t a = f32_to_bf16(t.a), b = f32_to_bf16(t.b);
    float c = t.c;
    kernel(1, 1, 1, &a, 1, &b, 1, &c, 1, true, gemm_tn_scratch());
    r.expect(same_bits(c, t.want), format("gemm_tn_bf16, %s: C = %g, want %g", t.what, c, t.want));
  }
}

// pack_scores / unpack_scores (isa_kernels.h): every code is the f16 of the
// f32 difference ref - s, raised to -65504 where finite, rounded as
// flce::f32_to_f16 rounds (nearest even), and unpacking gives ref minus it
// in f32. Lengths 1 .. 70 and 513 at every offset within a 64-byte line, over
// scores around ref (normal and subnormal f16 differences, ties, overflow)
// and the non-finite ones; ref 0 with +inf (a row whose max is infinite);
// ref 2^41, where ref - 65504 is ref again in f32.
inline void check_pack_scores(const KernelSet& ks, Report& r) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> below(-80.0f, 0.0f);
  const float special[] = {0.0f, -0x1p-20f, -0x1p-14f, -0x1.002p-3f, -65504.0f, -65519.0f, -65520.0f,
                           -1e30f, -kInf, kInf, kNaN,
                           -0x1p41f};  // s = 0 at ref 2^41: far below, not at ref
  const size_t kSpecial = sizeof(special) / sizeof(float);
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
        ks.pack_scores(s.data() + offset, n, ref, d.data() + offset);
        ks.unpack_scores(d.data() + offset, n, ref, back.data() + offset);
        for (int64_t i = 0; i < n; ++i) {
          const float x = ref - s[size_t(offset + i)];
          const float clamped = std::isfinite(x) ? std::max(x, -65504.0f) : x;
          const uint16_t want = f32_to_f16(clamped);
          const uint16_t got = d[size_t(offset + i)];
          const float want_back = ref - f16_to_f32(want);
          const float got_back = back[size_t(offset + i)];
          const bool same_back = std::isnan(want_back) ? std::isnan(got_back) : got_back == want_back;
          const bool both_nan = std::isnan(x) && (got & 0x7C00) == 0x7C00 && (got & 0x3FF) != 0;
          r.expect((got == want || both_nan) && same_back, [&] {
            return format("ref %g s %g (n %lld, i %lld): code %u want %u, back %g want %g", ref,
                          s[size_t(offset + i)], (long long)n, (long long)i, unsigned(got),
                          unsigned(want), got_back, want_back);
          });
        }
        r.expect(d[size_t(n + offset)] == 0xABCD && back[size_t(n + offset)] == 7.0f,
                 format("wrote past the end at n %lld, offset %lld", (long long)n, (long long)offset));
      }
}

}  // namespace flce::simd::testing
