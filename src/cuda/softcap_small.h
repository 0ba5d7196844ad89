// src/cuda/softcap_small.h: the softcap s = k tanh(z / k), and t = tanh(z / k)
// itself, for |z| <= 0.6 k as short polynomials in z, for the fused sm90
// epilogues (internal).
//
// Why: at the Gemma-2 head the epilogue runs while the tensor cores wait, and
// CUDA's tanhf is about 16 instructions (an exp2/reciprocal branch for
// |x| >= 0.6 and a polynomial below it, both computed, one selected) plus the
// products by 1/k and k around it. When every |z| of a warp's subtile is at
// most 0.6 k (one vote: sm90/epilogues.cuh), s or t takes 6 instructions:
// the coefficients are scaled by powers of 1/k once per call (softcap_poly,
// on the host), so no product by 1/k is left per score. Pass 2 takes t:
// ds/dz = 1 - t^2 and the exponent s log2(e) = t (k log2(e)) need no s.
// Logits within +-0.6 k are the common case: |z| <= 18 at k = 30.
//
// Host and device code (plain f32 products and explicit fmaf, nothing for a
// compiler to contract), so tests/test_softcap_small.cpp checks the very
// arithmetic the GPU runs, without a GPU.
#pragma once

#include <cmath>

#include "common/host_device.h"

namespace flce::cuda {

// The polynomials' range, as a fraction of k, and the k they take: t's last
// coefficient, P_3 / k^9 (below), would overflow f32 below kSoftcapSmallMinK
// and be subnormal above kSoftcapSmallMaxK. Outside, tanhf serves every z.
constexpr float kSoftcapSmallX = 0.6f;
constexpr double kSoftcapSmallMinK = 0x1p-14;  // 6.1e-5
constexpr double kSoftcapSmallMaxK = 0x1p13;   // 8192

// tanh(x) = x (1 + x^2 P(x^2)) for |x| <= 0.6. P: a weighted minimax fit of
// (tanh(x)/x - 1) / x^2 on x in (0, 0.6] (Lawson's iteration in float64,
// weights = the relative error of s a coefficient error makes; coefficients
// rounded to f32): 1.45 u of fit error.
constexpr double kSoftcapP[4] = {
    -0x1.555368p-2,  // -0.33332598
    0x1.10a712p-3,   // 0.13313116
    -0x1.abb80cp-5,  // -0.052211784
    0x1.ff97fp-7,    // 0.015612595
};

// One softcap's polynomials in z, every coefficient rounded once to f32
// from its float64 value: with x = z / k,
//   s = k tanh(x) = z + z^3 (s[0] + z^2 (s[1] + z^2 (s[2] + z^2 s[3]))),
//       s[i] = P_i / k^(2 i + 2);
//   t = tanh(x)   = z (inv_k + z^2 (t[0] + z^2 (t[1] + z^2 (t[2] + z^2 t[3])))),
//       t[i] = P_i / k^(2 i + 3).
struct SoftcapPoly {
  float limit = 0;  // the largest |z| they take (0.6 k), 0 for none
  float inv_k = 0;  // f32(1 / k), as everywhere else
  float k_log2e = 0;  // f32(k log2(e)): pass 2's exponent t (k log2(e)) from t
  float s[4] = {0, 0, 0, 0};
  float t[4] = {0, 0, 0, 0};
};

// The polynomials of softcap k (no range outside [kSoftcapSmallMinK,
// kSoftcapSmallMaxK]); host code, in float64.
inline SoftcapPoly softcap_poly(double k) {
  SoftcapPoly p;
  if (!(k > 0)) return p;
  p.inv_k = float(1 / k);
  p.k_log2e = float(k * 1.44269504088896340736);
  if (k < kSoftcapSmallMinK || k > kSoftcapSmallMaxK) return p;
  p.limit = kSoftcapSmallX * float(k);
  double scale = 1 / (k * k);  // 1 / k^(2 i + 2)
  for (int i = 0; i < 4; ++i, scale /= k * k) {
    p.s[i] = float(kSoftcapP[i] * scale);
    p.t[i] = float(kSoftcapP[i] * scale / k);
  }
  return p;
}

// s = k tanh(z / k) for |z| <= p.limit: at most about 3 u of relative error
// (tests/test_softcap_small.cpp measures it; the tolerance policy allows
// (kappa + 4) u = 9 u for computing s from z).
FLCE_HOST_DEVICE inline float softcap_small(float z, const SoftcapPoly& p) {
  const float z2 = z * z;
  float c = fmaf(z2, p.s[3], p.s[2]);
  c = fmaf(z2, c, p.s[1]);
  c = fmaf(z2, c, p.s[0]);
  const float z3 = z * z2;
  return fmaf(z3, c, z);
}

// t = tanh(z / k) for |z| <= p.limit, within the same budget for k t, except
// where t is subnormal (|z| < 2^-126 k): there its error is absolute, at most
// about k 2^-149 in k t, which moves pass 2's exponent t (k log2(e)) far
// less than the policy's kappa u.
FLCE_HOST_DEVICE inline float tanh_small(float z, const SoftcapPoly& p) {
  const float z2 = z * z;
  float c = fmaf(z2, p.t[3], p.t[2]);
  c = fmaf(z2, c, p.t[1]);
  c = fmaf(z2, c, p.t[0]);
  return z * fmaf(z2, c, p.inv_k);
}

}  // namespace flce::cuda
