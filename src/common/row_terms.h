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

// A row's lse from its merged states: max + log sum_exp (sum_exp =
// sum_j e^(s_ij - max)); NaN with a NaN score; an infinite max is not
// subtracted (as torch.logsumexp), so +inf scores give +inf, and a row of
// -inf scores gives -inf.
FLCE_HOST_DEVICE inline double merged_lse(bool has_nan, double max, double sum_exp) {
  if (has_nan) return NAN;
  if (max == INFINITY || max == -INFINITY) return max;
  return max + log(sum_exp);
}

// How a row's p, logp and entropy take its lse: as shift + lse_d, and the
// dlogits kernels' p, e^(s_ij - lse32) with lse32 the lse in float32, times
// p_scale (through coef_p and coef_h). lse32's rounding at a large max m is
// all of log sum_j e^(s_ij - m) (a row masked whole with -1e30 has
// lse32 = m, and e^(s_ij - lse32) = 1 for every class where p_ij = 1/V).
// So where the lse is the one this call formed from the row's finite max m
// and sum_exp = sum_j e^(s_ij - m) (`own`: a forward pass, or a backward
// whose saved lse has those bits, as the oracle takes it), the parts are m,
// lse_d = log sum_exp (which lse itself, rounded in double, loses beyond
// about 1e16) and p_scale = e^(lse32 - m - lse_d). m <= lse32 <= m + 2 lse_d,
// so p_scale lies in [e^-lse_d, e^lse_d], at least 1/V and at most V. A
// saved lse of other bits, or one that is not finite, is taken as given:
// m, lse - m and 1. Where the max is not finite (a backward without the
// row's states passes a NaN one): lse, 0 and 1. Either way the formulas
// give what e^(s - lse) gives.
struct LseParts {
  double shift, lse_d, p_scale;
};
FLCE_HOST_DEVICE inline LseParts lse_parts(double lse, double m, double sum_exp, bool own) {
  // fabs and <= rather than isfinite: the same spelling on the host and the device.
  if (!(fabs(m) <= DBL_MAX)) return {lse, 0.0, 1.0};
  if (!own || !(fabs(lse) <= DBL_MAX)) return {m, lse - m, 1.0};
  const double lse_d = log(sum_exp);
  return {m, lse_d, exp((double(float(lse)) - m) - lse_d)};
}

}  // namespace flce
