// simd/isa_kernels.h: the per-ISA kernel functions behind the KernelSets
// (internal; dispatch.cpp and the tests' ISA checks use them).
//
// Semantics (common to every ISA; the scalar set is the reference):
//  exp             y = exp(x): +inf above ~88.72, gradual underflow below
//                  -87.34 down to +0 below ~-103.97, exp(-inf) = +0, NaN ->
//                  NaN. Vector sets: within 1.2 ulp everywhere (AVX2 and
//                  AVX-512 measured over every float: README); the scalar
//                  set is libm's expf.
//  scores          s = a*(s+b) if k == 0; k*tanh(a*(s+b)/k) if k > 0 (vector
//                  sets multiply by 1/k instead of dividing; their tanh is
//                  within 1.6 ulp, measured likewise). NaN stays NaN,
//                  +-inf saturate to +-k.
//  online_softmax  two passes over the tile (it is in cache): the max over
//                  non-NaN s (a max of zero is stored as +0 whichever zeros
//                  the tile has), then the sums relative to shift = max(state max,
//                  tile max) if finite, else 0 (see common.h). Terms, with
//                  d = s - shift:
//                    sum_exp   += e = exp(d)
//                    sum_exp_d += e == 0 ? 0 : e * d      (no 0 * -inf NaN)
//                    sum_cs    += c * s                   (0 * inf is NaN, as the
//                                                          semantics' c_j logp_j)
//                  A NaN s makes sum_exp, sum_exp_d and sum_cs NaN and
//                  first_nan its lowest index; the max ignores it.
//                  argmax: the lowest index of the max among non-NaN s (so an
//                  all -inf tile has max -inf and argmax at its first -inf); it
//                  stays -1 while only NaNs were seen. The old state's sums
//                  move to the new shift (common.h, fold_tile): sum_exp times
//                  f = exp(old shift - new shift) (0 for an old max of -inf),
//                  sum_exp_d to f (sum_exp_d + (old shift - new shift) sum_exp).
//                  Without kSoftmaxMoments the tile's sum_exp_d and sum_cs are
//                  0, without kSoftmaxArgmax its argmax is -1 (kernels.h); the
//                  max, sum_exp and first_nan are the same bits either way.
//  dlogits         p = exp(s - lse);
//                  d = coef_p p + coef_c c
//                      - coef_h (p == 0 ? 0 : p ((s - shift) - sbar_d));
//                  g = a (1 - (s/k)^2) d if k > 0, else a d. The entropy term
//                  is left out where coef_h == 0 (none even where its
//                  product would be inf or NaN); the p term is formed whatever coef_p
//                  is, so 0 * inf = NaN where p overflows (s > lse + 88.7: a
//                  saved lse too low), as the oracle's g_lse p_ij.
//  gemm_tn         C = (accumulate ? C : 0) + A^T B, each element summed in
//                  order of k by fused multiply-adds from C (or 0), so its bits
//                  do not depend on m, n or where the caller splits them.
//                  AVX-512 only (f32_gemm_tn__avx512.cpp says why).
//  gemm_tn_bf16    C = (accumulate ? C : 0) + A^T B for bf16 A and B: k taken in
//                  pairs (rows 2p, 2p + 1; an odd k's last row with 0), each pair
//                  added to C (or 0) in order of k by one vdpbf16ps step, so its
//                  bits do not depend on m, n or where the caller splits them.
//                  vdpbf16ps reads subnormal operands as 0 and also flushes a
//                  subnormal C it adds to, and a subnormal sum, to 0, whatever
//                  MXCSR says (C = 1e-40 plus 1e-20 * 1e-20 gives 0).
//                  AVX-512 with AVX512-BF16 only (bf16_gemm_tn__avx512bf16.cpp).
//  pack_scores     d = f16(max(ref - s, -65504)): the f32 difference rounded
//                  to f16, nearest even; a finite difference below -65504 is
//                  raised to it (ref 0 where the max is infinite), one of
//                  65520 or more overflows to +inf (s reads back as -inf,
//                  whose p is 0, as that s's is: a clamp to 65504 read back
//                  as ref once |ref| >= 2^40), an infinite one stays infinite,
//                  NaN stays NaN. unpack_scores: s = ref - f32(d). AVX-512, and AVX2
//                  where the CPU has F16C (f32_pack_scores__<isa>.cpp;
//                  vcvtps2ph).
#pragma once

#include <cstdint>

#include "simd/kernels.h"

namespace flce::simd {

#define FLCE_SIMD_DECLARE_SET(isa)                                                            \
  void f32_exp__##isa(const float* x, float* y, int64_t n);                                   \
  void f32_scores__##isa(float* s, const float* bias, int64_t n, float scale, float softcap); \
  void f32_online_softmax__##isa(const float* s, const float* class_w, int64_t n, int64_t j0, \
                                 unsigned extras, SoftmaxState* state);                       \
  void f32_dlogits__##isa(const float* s, const float* class_w, int64_t n,                    \
                          const DlogitsParams* params, float* g);

// Declared for every ISA; only those of the compiled-in sets are defined.
FLCE_SIMD_DECLARE_SET(scalar)
FLCE_SIMD_DECLARE_SET(avx2)
FLCE_SIMD_DECLARE_SET(avx512)
FLCE_SIMD_DECLARE_SET(neon)

#undef FLCE_SIMD_DECLARE_SET

void f32_gemm_tn__avx512(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                         const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate,
                         float* scratch);
void bf16_gemm_tn__avx512bf16(int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda,
                              const uint16_t* b, int64_t ldb, float* c, int64_t ldc,
                              bool accumulate, float* scratch);
void f32_pack_scores__avx2(const float* s, int64_t n, float ref, uint16_t* d);
void f32_unpack_scores__avx2(const uint16_t* d, int64_t n, float ref, float* s);
void f32_pack_scores__avx512(const float* s, int64_t n, float ref, uint16_t* d);
void f32_unpack_scores__avx512(const uint16_t* d, int64_t n, float ref, float* s);

}  // namespace flce::simd
