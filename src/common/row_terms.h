// A row's loss and the coefficients of its dlogits G (README, Semantics),
// formed from its lse once the row's tiles are merged: by the cpu backend's
// merge step (src/cpu/steps.cpp) and by the cuda backend's merge kernel
// (src/cuda/kernels.cu), both from these functions. The reference backend
// keeps its own lines, written as the math, so that it stays an independent
// check of these.
//
// Host and device code: plain double arithmetic, and exp.
#pragma once

#include <cfloat>
#include <cmath>

#include "common/host_device.h"

namespace flce {

// The problem's constants in a row's terms.
struct LossConstants {
  double e;          // label smoothing
  double v;          // V, the number of classes
  double class_sum;  // C = sum_j c_j (V without class weights)
  double z_loss;     // l
};

// G_ij = coef_p p_ij + coef_c c_j - [j = y_i] g_loss (1 - e) c_y (+ the
// entropy term), where g_loss = d objective / d loss_i (0 for an ignored
// row) and g_lse the lse output's cotangent:
//   coef_p = g_loss ((1 - e) c_y + (e / V) C + 2 l lse) + g_lse.
// No loss term where g_loss = 0, as the oracle: 0 (2 l lse) would be NaN for
// lse = +inf and poison the row's every class.
FLCE_HOST_DEVICE inline double grad_coef_p(const LossConstants& k, double g_loss, double c_y,
                                           double lse, double g_lse) {
  const double loss_p =
      g_loss == 0 ? 0.0 : g_loss * ((1 - k.e) * c_y + (k.e / k.v) * k.class_sum + 2 * k.z_loss * lse);
  return loss_p + g_lse;
}

//   coef_c = -g_loss e / V.
FLCE_HOST_DEVICE inline double grad_coef_c(const LossConstants& k, double g_loss) {
  return -g_loss * k.e / k.v;
}

// The z-loss term l lse^2 (also the zloss output).
FLCE_HOST_DEVICE inline double z_loss_term(const LossConstants& k, double lse) {
  return k.z_loss * lse * lse;
}

// loss_i = t_i (-(1 - e) c_y logp_y - (e / V) sum_j c_j logp_ij + l lse^2),
// 0 for an ignored row. sum_cs = sum_j c_j s_ij, so that
// sum_j c_j logp_ij = sum_cs - C lse; the smoothing term is left out at
// e = 0, where 0 times a NaN or infinite sum would poison the loss.
FLCE_HOST_DEVICE inline double row_loss(const LossConstants& k, bool ignored, double t_i, double c_y,
                                        double logp_y, double sum_cs, double lse) {
  if (ignored) return 0.0;
  const double sum_clogp = sum_cs - k.class_sum * lse;
  const double ce = -(1 - k.e) * c_y * logp_y - (k.e > 0 ? (k.e / k.v) * sum_clogp : 0.0);
  return t_i * (ce + z_loss_term(k, lse));
}

// A tile's share of sum_j p_ij (s_ij - m), m the row's finite max, from its
// softmax state (sums relative to its own max m_t, simd/kernels.h) and the
// row's lse_d = lse - m: e^((m_t - m) - lse_d) (sum_exp_d_t + (m_t - m)
// sum_exp_t). Summed over the tiles it is sbar_d, and the entropy
// lse - sum_j p_ij s_ij is lse_d - sbar_d, formed from differences to the
// max as the oracle's (no cancellation of two numbers of the logits' size;
// each term e^d d of sum_exp_d is at most 1/e in size, so a vocabulary mask
// at -FLT_MAX no longer overflows it). A tile whose weight underflows holds
// only p_ij below 2^-1074, which add nothing, and is skipped.
FLCE_HOST_DEVICE inline double tile_mean_score_d(float max_t, float sum_exp_t, float sum_exp_d_t,
                                                 double m, double lse_d) {
  const double weight = max_t == -INFINITY ? 0.0 : exp((double(max_t) - m) - lse_d);
  if (weight == 0) return 0.0;
  return weight * (double(sum_exp_d_t) + (double(max_t) - m) * double(sum_exp_t));
}

// The factor e^(lse32 - lse) that the dlogits kernels' p is multiplied by
// (through coef_p and coef_h): they take e^(s_ij - lse32) with lse32 the
// row's lse in float32, whose rounding at a large max is all of
// lse_d = log sum_j e^(s_ij - m) (a row masked whole with -1e30 has
// lse32 = m, and e^(s_ij - lse32) = 1 for every class where p_ij = 1/V);
// times this factor it is p_ij = e^(s_ij - m - lse_d). m is the row's
// finite max and lse_d = lse - m, exact as the merge formed it (lse itself
// rounds in double beyond about 1e16). m <= lse32 <= m + 2 lse_d, so the
// factor lies in [e^-lse_d, e^lse_d]: at most V and at least 1/V. 1 where
// lse is not finite (the row's G is NaN or follows e^(s - lse32) as the
// formulas give), and for a backward's saved lse, which is taken as given.
FLCE_HOST_DEVICE inline double p_scale(double lse, double m, double lse_d) {
  if (!(fabs(lse) <= DBL_MAX)) return 1.0;  // inf or NaN (fabs and <=: host and device)
  return exp((double(float(lse)) - m) - lse_d);
}

}  // namespace flce
