// src/cuda/softcap_small.h: the softcap s = k tanh(z / k) for |z| <= 0.6 k as
// one short polynomial, for the fused sm90 epilogues (internal).
//
// Why: at the Gemma-2 head the epilogue runs while the tensor cores wait, and
// CUDA's tanhf is about 16 instructions (an exp2/reciprocal branch for
// |x| >= 0.6 and a polynomial below it, both computed, one selected) plus the
// products by 1/k and k around it. When every |z| of a warp's subtile is at
// most 0.6 k (one vote: sm90/epilogues.cuh), this takes 7 instructions.
// Logits within +-0.6 k are the common case: |z| <= 18 at k = 30.
//
// Host and device code (plain f32 products and explicit fmaf, nothing for a
// compiler to contract), so tests/test_softcap_small.cpp checks the very
// arithmetic the GPU runs, without a GPU.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define FLCE_HOST_DEVICE __host__ __device__
#else
#define FLCE_HOST_DEVICE
#endif

namespace flce::cuda {

// The polynomial's range, as a fraction of k, and the smallest k it takes
// (below, products of subnormal z lose relative precision; tanhf then).
constexpr float kSoftcapSmallX = 0.6f;
constexpr float kSoftcapSmallMinK = 1e-20f;

// The largest |z| the polynomial takes for softcap k (0: none), in f32.
FLCE_HOST_DEVICE inline float softcap_small_limit(float k) {
  return k >= kSoftcapSmallMinK ? kSoftcapSmallX * k : 0.0f;
}

// k tanh(z / k) = z (1 + x^2 P(x^2)) with x = z / k, for |z| <= 0.6 k.
// P: a weighted minimax fit of (tanh(x)/x - 1) / x^2 on x in (0, 0.6]
// (Lawson's iteration in float64, weights = the relative error of s a
// coefficient error makes; coefficients rounded to f32): 1.45 u of fit
// error, so with the roundings at most about 3 u of relative error in s
// (tests/test_softcap_small.cpp measures it; the tolerance policy allows
// (kappa + 4) u = 9 u for computing s from z).
FLCE_HOST_DEVICE inline float softcap_small(float z, float inv_k) {
  const float x = z * inv_k;
  const float x2 = x * x;
  float p = fmaf(x2, 0x1.ff97fp-7f, -0x1.abb80cp-5f);  // 0.015612595, -0.052211784
  p = fmaf(x2, p, 0x1.10a712p-3f);                     // 0.13313116
  p = fmaf(x2, p, -0x1.555368p-2f);                    // -0.33332598
  const float zx2 = z * x2;
  return fmaf(zx2, p, z);
}

}  // namespace flce::cuda
