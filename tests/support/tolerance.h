// The tolerance policy: how far a backend's outputs may be from the exact
// values, derived once from a first-order rounding-error analysis and used by
// every comparison in the tests.
//
// ---------------------------------------------------------------------------
// Precisions and notation
// ---------------------------------------------------------------------------
// A computation is described by four unit roundoffs (u = 2^-53 for f64,
// 2^-24 for f32, 2^-11 for f16, 2^-8 for bf16):
//   u_a  accumulation: the dot products, sums, exp/log/tanh;
//   u_s  storage of the logits (u_s = u_a when they stay in the accumulator);
//   u_o  storage of the outputs (2^-24 for f32 outputs, 2^-53 for f64);
//   u_g  the cast of dlogits before the gradient GEMMs (0 when there is none);
//   u_q  the scores a gradient pass reads back from a 16-bit store (the cpu
//        backend's packed scores: f16 differences from a running max,
//        2^-11), 0 when it reads the scores themselves.
// A fifth, u_l, is the precision of an lse that backward() reads after
// forward() stored it (0 when the lse is computed in the same call).
//
// gamma_n = n u_a / (1 - n u_a) bounds the relative error of any n-term sum or
// dot product, in any order (Higham, "Accuracy and Stability of Numerical
// Algorithms", ch. 3). It is +inf once n u_a >= 1: no bound exists there.
// kappa = 5: exp, log and tanh have relative error <= kappa u (an error of E
// ulp is at most 2E u). That covers every function the backends call: flce's
// vector exp and tanh (<= 1.2 and 1.6 ulp, simd/testing/kernel_checks.h),
// libm's expf (1 ulp) and tanhf (2.5 ulp: the scalar kernels), glibc's
// double functions (1 ulp), and CUDA's expf, exp2f and tanhf (2 ulp from the
// correctly rounded result by the CUDA C++ Programming Guide's table of
// single-precision functions, so 2.5 ulp from the exact one; no fast math;
// exp2f is the ex2.approx.f32 instruction, whose .ftz form the score passes
// use: the same result except that it flushes subnormal ones to 0).
// tiny(u) is the smallest subnormal of the format with unit roundoff u. Every bound is first order in u (terms in u^2 dropped).
// The option scalars a, k, e, l may be converted to the accumulation
// precision first; each conversion is one more rounding wherever the scalar
// enters, and the rounding counts below include it.
// Below, |.| is elementwise, sums over j run over the V classes, over i over
// the N rows, over k over the H hidden units; all values on the right-hand
// sides are the exact ones (the float64 brute force).
//
// ---------------------------------------------------------------------------
// 1. Logits
// ---------------------------------------------------------------------------
// M_ij = sum_k |x_ik||W_jk| + |b_j|   (head),   |logits_ij|   (logits entry).
//   dz_ij = a gamma_n M_ij,  n = H + 3 (H products and sums, the bias, the
//           scale a and its conversion) for the head, n = 2 (the scale and
//           its conversion) for the logits entry.
// No softcap: ds_ij = dz_ij + u_s |s_ij|                  (logit storage).
// Softcap k:  ds_ij = L_ij dz_ij + ((kappa + 4) u_a + u_s) |s_ij|, where
//   L_ij = 1 - tanh^2(max(0, |z_ij| - dz_ij) / k) is the largest slope of
//   k tanh(z/k) within dz_ij of z_ij (mean-value theorem: rigorous), and
//   (kappa + 4) u_a |s| covers rounding z/k (an argument error u|z|/k, which
//   the slope turns into u |z| (1 - t^2) <= u |s|, because w sech^2 w <=
//   tanh w), tanh itself, the product by k, and k's conversion (k (1 + d)
//   moves s by |d| (|s| + |z| (1 - t^2)) <= 2 u |s|). Storing the logits costs
//   u_s |s| whether it happens before the softcap (u_s|z|(1 - t^2) <= u_s|s|)
//   or after it. The fused sm90 kernels compute the softcap of a warp's
//   subtile whose |z| are all <= 0.6 k as one polynomial instead, of s in
//   pass 1 and of t = tanh(z/k) in pass 2 (src/cuda/softcap_small.h): at
//   most 2.60 u of relative error in s and 4.04 u in k t over every 7th
//   float of that range (measured for eight k; tests/test_softcap_small.cpp
//   checks (kappa + 4) u), inside the same budget.
// An exact logit of +-inf (an infinite logits entry) is exact: ds_ij = 0,
// or (u_a + u_s) k under a softcap k (s = +-k, with k's conversion and the
// storage).
// Delta_i = log sum_j p_ij e^{ds_ij} (formed from logp_ij + ds_ij), at most
// max_j ds_ij, and unlike it blind to a class whose p is 0 (a vocabulary
// padding masked by a logit of -1e30, whose ds is 1e23).
//
// ---------------------------------------------------------------------------
// 2. Log-sum-exp
// ---------------------------------------------------------------------------
// Logit errors |d_ij| <= ds_ij move lse by log sum_j p_ij e^{d_ij}, within
// +-Delta_i (the lower side by Jensen's inequality), rigorously, not just
// to first order.
// Evaluating it from the computed logits, with the max shift or online
// (Blanchard, Higham and Higham, IMA J. Numer. Anal. 2021), adds
//   E_i = gamma_V                    the sum of V positive terms, any order
//       + (V + 1)(kappa + 1) u_a     each term goes through its own exp and
//                                    at most V online rescalings or merges,
//                                    each an exp and a product
//       + 3 u_a ln V                 rounding the exponents s_j - m and the
//                                    rescale differences m_old - m_new adds
//                                    <= 2 u (m - s_j) per term (the running
//                                    maxima rise monotonically to m), and
//                                    u (m - s_j) more if exp is exp2 of a
//                                    product by log2(e); weighted by p_j that
//                                    is 3 u sum_j p_j (m - s_j) <= 3 u H_i
//                                    <= 3 u ln V
//       + u_a (|lse_i| + ln V)       the exponent formed as one FMA
//                                    s log2(e) - o, o = m' log2(e) rounded
//                                    once for the running max m' (s_j <=
//                                    m' <= m): u |m'| <= u (|m| + m - s_j)
//                                    per term, the m - s_j part inside the
//                                    3 u ln V above (the FMA has no separate
//                                    difference), and |m| <= |lse_i| + ln V
//       + 2 u_a k                    with a softcap k, a shift of k itself
//                                    instead of the max (the fused sm90
//                                    pass 1, src/cuda/sm90/epilogues.cuh):
//                                    o = k log2(e) rounded adds u k, and
//                                    the FMA's u (k - s_j) = u (k - m) +
//                                    u (m - s_j) adds u (k + |m|), |m| as
//                                    above (its sum, in [e^-2k, V], has
//                                    its log taken in float64 there, so the
//                                    next term stays as it is)
//       + kappa u_a ln V             the log of a sum in [1, V]
//       + u_a |lse_i|                adding the max back
//       + u_l |lse_i|                backward() reading a stored lse.
// dlse_i = Delta_i + E_i.                       bound(lse_i) = dlse_i + out(lse_i)
// with out(v) = u_o |v| + floor, the output rounding (floor: see 9).
//
// ---------------------------------------------------------------------------
// 3. Log-probabilities and probabilities
// ---------------------------------------------------------------------------
// logp_ij = s_ij - lse_i, formed as s - lse or (s - m) - ln S; the operands
// are bounded by |s_ij| + |lse_i| + ln V, so the two roundings add
//   rho_ij = 2 u_a (|s_ij| + |lse_i| + ln V), and
//   dlogp_ij = ds_ij + dlse_i + rho_ij.
// bound(logprob_i) = dlogp_{i,y_i} + out(logp_{i,y_i}); ignored rows are 0
// exactly (bound 0).
// p_ij = exp(logp_ij) has relative error e^{relP_ij} - 1, with
//   relP_ij = dlogp_ij + kappa u_a + u_a (|s_ij| + |lse_i|)
// (the last term: with the exponent formed as one FMA s log2(e) - o,
// o = lse log2(e) rounded, the FMA's rounding is one of the two rho counts;
// the other's share of rho and this term, 2 u (|s| + |lse|) together,
// cover o's rounding, u |lse|, and log2(e)'s, u |s - lse|; or, where the
// fused pass 2 forms it as t (k log2(e)) - o from t = tanh(z/k), with k
// log2(e) rounded once, u |lse| + u |s|), so the gradient pass's p is
// within
//   dp_ij = min(p_ij (e^{relP_ij} - 1), pmax_ij) + tiny(u_a)
// of p_ij (~ p (2 Delta + gamma_V) of the notes; tiny: exp underflowing to
// 0). e^{relP} - 1, not relP itself: logit errors of O(1), as bf16 logits of
// |s| ~ 300 have, need it; formed as e^{logp + relP} - p where relP > 1, so
// that a p that underflows in float64 still counts; 0 where logp = -inf.
// pmax_ij = e^{q_ij + (u_a + u_l)|lse_i| + E_i + 2 u_a (|s_ij| + |lse_i|)
// + r_ij} (1 + kappa u_a) is the largest p that pass computes: from an lse
// at least the exact lse of the forward's scores less E_i, whatever the
// shift, so at least their max less E_i, and less u_l |lse_i| when stored;
// the exponent formed in 2 u_a (|s| + |lse|); from the forward's scores,
// packed ones (q_ij, section 6), or under the fused kernels' softcap ones
// recomputed from tanh (r_ij = 2 (kappa + 4) u_a |s_ij|; else 0). It bounds the largest classes' dp where
// their logit bounds alone would allow any p, while (u_a + u_l)|lse_i|
// stays well below 700 (beside a logit of 2^41 in f32 it does not, and
// nothing bounds the max class's p); a backward that recomputes its
// logits with other roundings than its forward's is not covered by it.
//
// ---------------------------------------------------------------------------
// 4. Entropy, H_i = lse_i - mu_i, mu_i = sum_j p_ij s_ij
// ---------------------------------------------------------------------------
// The logit errors move H by |sum_j p_ij (s_ij - mu_i) ds_ij| <=
// sum_j p_ij |s_ij - mu_i| ds_ij. Evaluating it from the computed logits,
// as lse - sum p s or as -sum p logp, adds, with
// w_i = sum_j p_ij (|s_ij| + |logp_ij|):
//   E_i (1 + w_i)                           the lse error, directly and
//                                           through every p_ij;
//   sum_j p_ij (|s_ij| + |logp_ij|) (rho_ij + kappa u_a + gamma_{V+1})
//                                           each p's exponent and exp, the
//                                           products and the V-term sum;
//   u_a (|lse_i| + |mu_i|)                  the final subtraction.
// bound(entropy_i) = the three + the logit term + out(H_i).
//
// ---------------------------------------------------------------------------
// 5. Per-row loss, z-loss, reductions
// ---------------------------------------------------------------------------
// ce_i = -(1-e) c_y logp_iy - (e/V) sum_j c_j logp_ij:
//   dce_i = (1-e) c_y dlogp_iy + (e/V) sum_j c_j dlogp_ij
//         + gamma_{V+5} ((1-e) c_y |logp_iy| + (e/V) sum_j c_j (|s_ij| + |lse_i|))
//   (e's conversion, the coefficients 1-e and e/V, two products, the V-term
//   sum and the final combination; the smoothing sum may be formed as
//   sum c s - C lse, hence |s| + |lse| rather than |logp|).
// zl_i = l lse_i^2:  dzl_i = 2 l |lse_i| dlse_i + 3 u_a l lse_i^2
//   (the square, the product by l, l's conversion).
// loss_i = t_i (ce_i + zl_i) (ce, zl >= 0, no cancellation):
//   dloss_i = t_i (dce_i + dzl_i) + 2 u_a t_i (|ce_i| + |zl_i|).
// bound(loss_i) = dloss_i + out(loss_i), 0 for ignored rows (exact zeros).
// bound(zloss_i) = dzl_i + out(zl_i), every row.
// sum:  sum_i dloss_i + gamma_N sum_i |loss_i| + out(L).
// mean: (sum_i dloss_i + gamma_N sum_i |loss_i|) / D + gamma_{N+1} |L| + out(L)
//   (D = sum t_i c_{y_i} of N nonnegative products has relative error
//   gamma_N; the division one u). D = 0 gives 0 exactly.
//
// ---------------------------------------------------------------------------
// 6. dlogits G = d objective / d (x.W + b)  (or / d logits)
// ---------------------------------------------------------------------------
// r_i = d objective / d loss_i: grad_loss (exact) for none and sum,
// grad_loss / D for mean (relative error rho_r = gamma_{N+1}); q_i = r_i t_i.
// d objective / d s_ij = T1 - T2 - T3 + T4 - T5 with
//   T1 = q_i A_i p_ij,  A_i = (1-e) c_y + (e/V) C + 2 l lse_i,  C = sum_j c_j
//   T2 = q_i (1-e) c_y [j = y_i],  T3 = q_i (e/V) c_j,
//   T4 = g_lse_i p_ij,  T5 = g_ent_i p_ij (s_ij - mu_i).
// Forming each term takes at most 5 roundings (T3: q = r t, e's conversion,
// e/V, the products by c_j and q), and the five are combined with 4 more, so
// evaluation adds gamma_9 sum |T|. The
// propagated errors of the computed factors add
//   |q_i A_i| dp_ij + |T1| rho_r + |q_i| p_ij dA_i,
//       dA_i = 2 l dlse_i + gamma_{V+5} ((1-e) c_y + (e/V) C + 2 l |lse_i|);
//   (|T2| + |T3|) rho_r;  (|g_lse_i| + |g_ent_i| |s_ij - mu_i|) dp_ij;
//   |g_ent_i| (p_ij + dp_ij) (ds_ij + dmu_i),
//       dmu_i = sum_j (p_ij ds_ij + |s_ij| (dp_ij + p_ij gamma_{V+1}));
//   nmin(u_a) (|q_i A_i| + |g_lse_i| + |g_ent_i| |s_ij - mu_i|)  (p underflow;
//   nmin: the smallest normal, for an exp that flushes subnormal results to
//   0, as the cuda backend's ex2.approx.ftz does).
// Softcap: G^z = L G^s with L = 1 - (s/k)^2, whose error is
//   dL_ij = 2 |s_ij| ds_ij / k^2 + 6 u_a: t = s/k takes at most three
//   roundings (k's conversion, 1/k and the product in the vector kernels;
//   k's conversion and the quotient in the scalar ones), doubled by the
//   square, 6 u t^2; 1 - t^2 at most one more and the square's own, u t^2 +
//   u L where they are separate, with two roundings in t (t^2 + L = 1).
// Packed scores (u_q > 0): the pass reads s_ij back as ref - f16(ref - s_ij)
// with ref a computed running max, ref <= M_i = max_j s_ij (first order),
// so it starts from s_ij + q_ij with
//   q_ij = (u_q + 2 u_a)(M_i - s_ij) + u_a |s_ij| + tiny(u_q)
//   (the f32 difference, its f16 rounding, or the f16 subnormal spacing, and
//   the f32 subtraction back), and every ds_ij and relP_ij of this section
//   (not those of mu_i, whose sums came from the scores themselves) gains
//   q_ij. Where s_ij or M_i is not finite q_ij = 0: p_ij is 0 or NaN either way.
// Scale: G = a L G^s;  dG_ij = a (L dG^s_ij + |G^s_ij| dL_ij) + r u_a |G_ij|,
// r = 2 (a's conversion, the product by a), 3 with a softcap (the product
// by L). bound(grad_logits_ij) = dG'_ij + out(G_ij), dG' of section 7 when
// a 16-bit grad_logits is written (grad_logits_dtype = storage).
//
// ---------------------------------------------------------------------------
// 7. Parameter gradients
// ---------------------------------------------------------------------------
// The GEMMs read G' = G, cast with u_g: dG'_ij = dG_ij + u_g |G_ij| +
// cast_underflow(u_g): tiny(u_g) / 2 for rounding to nearest in a format with
// gradual underflow, the smallest normal for bf16, whose dot-product
// instructions (AVX512-BF16's VDPBF16PS, AMX) read subnormals as 0. The
// absolute term is the one that counts where G falls below the format's
// normal range, as f16 dlogits of a mean over many rows do. The GEMMs may
// also read any G' below the accumulation format's normal range as 0 (+
// smallest_normal(u_a): subnormal operands slow f32 GEMMs some 20x, and the
// cpu backend flushes them). A dot
// product of computed factors adds gamma_n of the sum of |products|; one
// more rounding allows the scale a to be applied after the GEMM.
//   bound(grad_x_ik) = sum_j (dG'_ij + gamma_{V+1} |G_ij|) |W_jk| + out
//   bound(grad_W_jk) = sum_i (dG'_ij + gamma_{N+1} |G_ij|) |x_ik| + out
//   bound(grad_b_j)  = sum_i (dG'_ij + gamma_{N+1} |G_ij|) + out
// With gradient filtering, grad_x and grad_W also allow every entry the
// filter may leave out (Precision::filter_eps); grad_b sums every entry.
//
// ---------------------------------------------------------------------------
// 8. Argmax
// ---------------------------------------------------------------------------
// The computed s_ij lies within ds_ij of the exact one, so class j can be the
// computed argmax only if s_i,max - s_ij <= ds_ij + ds_i,max. A backend must
// return such a class, hence exactly the oracle's one wherever the top two
// logits are further apart than that (at most 2 max_j ds_ij). A row with a NaN
// logit must return the first NaN's index.
//
// ---------------------------------------------------------------------------
// 9. Floor, and the constant C
// ---------------------------------------------------------------------------
// The gamma bounds assume no underflow. An operation whose result is
// subnormal loses at most tiny(u) absolutely; an output element is formed by
// fewer than N + V + H + 8 operations, so every bound gets
//   floor = (N + V + H + 8) tiny(u_a) + tiny(u_o).
// This is what lets exact zeros and underflowed probabilities compare.
// C = 1: the check is |actual - exact| <= 1 * bound. The bounds above are
// rigorous worst cases to first order, so no safety factor is needed, and a
// factor below 1 (probabilistic error growth) would need an argument we do
// not make here. The exact values come from the float64 brute force, whose
// own error (a u = 2^-53 instance of the same bounds) is negligible next to
// any bound computed here and is not added.
//
// NaN and Inf: positions must match exactly (NaN for NaN, +inf for +inf,
// -inf for -inf); a finite expected value with a non-finite bound is a
// test-construction error and is reported as such.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "flce/flce.h"
#include "support/brute_force.h"

namespace flce_test {

// C in |actual - exact| <= C * bound (section 9 above).
constexpr double kBoundFactor = 1.0;
// kappa: relative error of exp, log and tanh, in units of u (2.5 ulp: see
// "Precisions and notation" above for which functions that covers).
constexpr double kFunctionUlps = 5.0;

// Unit roundoff of a floating dtype: 2^-53, 2^-24, 2^-11 (f16), 2^-8 (bf16).
double unit_roundoff(flce::Dtype dtype);
// gamma_n = n u / (1 - n u), +inf when n u >= 1.
double gamma(double n, double u);
// Smallest positive subnormal of the format whose unit roundoff is u.
double tiny(double u);
// Smallest positive normal of that format (nmin in section 6).
double smallest_normal(double u);
// Absolute error of a cast to the format of unit roundoff u below its normal
// range (section 7): tiny(u) / 2, rounding to nearest; for bf16 the smallest
// normal, as the bf16 dot-product instructions (AVX512-BF16, AMX) read a
// subnormal bf16 as 0. 0 for u = 0 (no cast).
double cast_underflow(double u);

struct Precision {
  double u_accum = 0x1p-53;  // u_a
  double u_store = 0x1p-53;  // u_s
  double u_out = 0x1p-53;    // u_o
  double u_grad = 0.0;       // u_g
  double u_packed = 0.0;     // u_q
  double u_saved_lse = 0.0;  // u_l
  // Gradient filtering's eps, resolved (0: off). The bounds of grad_x and
  // grad_W then also allow every entry the filter may drop (README,
  // "Gradient filtering"): |G'_ij| wherever |G'_ij| <= eps (kappa_i +
  // dkappa_i) + dG'_ij (tolerance.cpp, filter_allowance).
  double filter_eps = 0.0;

  // The reference backend: float64 throughout, outputs stored as `out`.
  static Precision float64(flce::Dtype out = flce::Dtype::f64);
};

// Per-output absolute error bounds, shaped like the outputs.
struct Bounds {
  std::vector<double> logits;     // ds_ij, [n, v]
  std::vector<double> row_logit;  // Delta_i, [n]
  std::vector<double> lse, logprob, entropy, zloss, loss_rows;  // [n]
  std::vector<double> loss;       // [n] (none) or [1]
  std::vector<double> dlogits;    // dG_ij (before the output rounding), [n, v]
  std::vector<double> grad_x, grad_w, grad_bias, grad_logits;
  double objective = 0;  // of brute.objective, for finite differences
};

Bounds error_bounds(const DenseProblem& problem, const BruteForce& exact,
                    const Precision& precision);

// |actual - expected| <= c * bound elementwise, with NaN/Inf positions
// matching exactly. On failure: how many elements fail, the worst one (by
// error / bound) with its index ([row, col] when cols > 0), and the first
// NaN/Inf mismatch.
::testing::AssertionResult within_bounds(const std::string& name,
                                         const std::vector<double>& actual,
                                         const std::vector<double>& expected,
                                         const std::vector<double>& bounds, int64_t cols = 0,
                                         double c = kBoundFactor);

// The same bound taken norm-wise: ||actual - expected||_2 <= c ||bounds||_2
// (implied by the elementwise check, and weaker: error may move between
// elements). For approximations that drop whole terms, such as gradient
// filtering, which leaves a filtered class's grad_W row at 0. Non-finite
// values must match position for position, as elementwise.
::testing::AssertionResult within_bounds_normwise(const std::string& name,
                                                  const std::vector<double>& actual,
                                                  const std::vector<double>& expected,
                                                  const std::vector<double>& bounds,
                                                  double c = kBoundFactor);

// Section 8: every row's argmax is a class that could be the maximum given
// the logit bounds (the exact one where the gap is large), and the first NaN
// for rows with a NaN logit.
::testing::AssertionResult argmax_within_bounds(const std::vector<int64_t>& actual,
                                                const DenseProblem& problem,
                                                const BruteForce& exact, const Bounds& bounds);

// The same bits (NaN payloads aside: NaN equals NaN).
::testing::AssertionResult identical(const std::string& name, const std::vector<double>& a,
                                     const std::vector<double>& b);

}  // namespace flce_test
