// The tolerance policy of tolerance.h, section by section.
#include "support/tolerance.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

namespace flce_test {

double unit_roundoff(flce::Dtype dtype) {
  switch (dtype) {
    case flce::Dtype::f64: return 0x1p-53;
    case flce::Dtype::f32: return 0x1p-24;
    case flce::Dtype::f16: return 0x1p-11;
    case flce::Dtype::bf16: return 0x1p-8;
    default: return 0.0;  // integers are exact
  }
}

double gamma(double n, double u) {
  const double nu = n * u;
  return nu >= 1.0 ? std::numeric_limits<double>::infinity() : nu / (1.0 - nu);
}

namespace {

// A floating format by its unit roundoff: smallest subnormal and normal.
struct Format {
  double u, tiny, normal;
};
constexpr Format kFormats[] = {
    {0x1p-53, 0x1p-1074, 0x1p-1022},  // f64
    {0x1p-24, 0x1p-149, 0x1p-126},    // f32
    {0x1p-11, 0x1p-24, 0x1p-14},      // f16
    {0x1p-8, 0x1p-133, 0x1p-126},     // bf16
};

const Format& format_of(double u) {
  for (const Format& f : kFormats)
    if (u <= f.u) return f;
  return kFormats[3];  // coarser than bf16: bf16's range
}

}  // namespace

double tiny(double u) { return format_of(u).tiny; }

double smallest_normal(double u) { return format_of(u).normal; }

double cast_underflow(double u) {
  if (u <= 0) return 0.0;
  return u == 0x1p-8 ? smallest_normal(u) : tiny(u) / 2;
}

Precision Precision::float64(flce::Dtype out) {
  Precision p;
  p.u_out = unit_roundoff(out);
  return p;
}

namespace {

constexpr double kappa = kFunctionUlps;

// p * q with 0 * anything = 0 (a class with p = 0 contributes nothing).
double pw(double p, double q) { return p == 0.0 ? 0.0 : p * q; }
// a * b with a 0 on either side giving 0: a coefficient of 0 (an ignored
// row, no cotangent) times a dp that no finite bound holds.
double mul0(double a, double b) { return a == 0.0 || b == 0.0 ? 0.0 : a * b; }

// What each row needs from sections 1-4, kept for sections 5-6.
struct RowTerms {
  std::vector<double> dlogp;  // [n, v]
  std::vector<double> relp;   // [n, v]
  std::vector<double> dlse;   // [n]
  std::vector<double> eval;   // E_i, [n]
};

// Section 1: ds_ij, and max_j ds_ij, which row_bounds narrows to Delta_i.
void logit_bounds(const DenseProblem& d, const BruteForce& x, const Precision& pr,
                  Bounds* b) {
  const double a = d.options.logit_scale, k = d.options.softcap;
  const double ua = pr.u_accum, us = pr.u_store;
  const double g_dot = gamma(d.logits_entry ? 2.0 : double(d.h + 3), ua);
  b->logits.assign(d.n * d.v, 0.0);
  b->row_logit.assign(d.n, 0.0);
  for (int64_t i = 0; i < d.n; ++i) {
    for (int64_t j = 0; j < d.v; ++j) {
      const int64_t ij = i * d.v + j;
      double m;
      if (d.logits_entry) {
        m = std::fabs(d.logits[ij]);
      } else {
        m = d.bias.empty() ? 0.0 : std::fabs(d.bias[j]);
        for (int64_t kk = 0; kk < d.h; ++kk) m += std::fabs(d.x[i * d.h + kk] * d.weight(j, kk));
      }
      const double z = x.z[ij], s = x.s[ij];
      double ds;
      if (std::isinf(z) && !std::isnan(m)) {
        // +-inf logits are exact; s = +-k carries k's conversion and storage.
        ds = k > 0 ? (ua + us) * k : 0.0;
      } else {
        const double dz = a * g_dot * m;
        if (k > 0) {
          const double t = std::tanh(std::max(0.0, std::fabs(z) - dz) / k);
          ds = (1.0 - t * t) * dz + ((kappa + 4.0) * ua + us) * std::fabs(s);
        } else {
          ds = dz + us * std::fabs(s);
        }
      }
      b->logits[ij] = ds;
      b->row_logit[i] = std::isnan(ds) ? ds : std::max(b->row_logit[i], ds);
    }
  }
}

// p (e^x - 1) for x >= 0 without cancellation: p expm1(x) where x <= 1, and
// e^{logp + x} - p beyond, so that a p that underflows in float64 still
// counts where x is large enough.
double p_expm1(double logp, double p, double x) {
  return x <= 1.0 ? pw(p, std::expm1(x)) : std::exp(logp + x) - p;
}

// Delta_i: how far lse_i = log sum_j e^{s_ij} moves when every s_ij moves by
// up to ds_ij, log sum_j p_ij e^{ds_ij} = log1p(sum_j p_ij (e^{ds_ij} - 1))
// (sum_j p_ij = 1): a sum of positive terms, so that the small Delta of a
// normal row has no cancellation. At most max_j ds_ij (max_ds), and unlike
// it not set by a class whose p is 0: a vocabulary padding masked by a logit
// of -1e30 has a ds of 1e23, which made every bound of its row useless.
double lse_logit_error(const double* logp, const double* p, const double* ds, int64_t v,
                       double max_ds) {
  double sum = 0.0;
  for (int64_t j = 0; j < v; ++j) sum += p_expm1(logp[j], p[j], ds[j]);
  const double r = std::log1p(sum);
  return std::isnan(r) ? max_ds : std::min(max_ds, r);
}

// dp_ij: how far the gradient pass's p can be from p_ij, given p's error
// as a logarithm rel_p: p e^{rel_p} - p (first order, p rel_p, was too
// tight once logit errors reach O(1), as bf16 logits of |s| ~ 300 have),
// and at most p_max, the largest p that pass can compute.
double p_error(double logp, double p, double rel_p, double p_max) {
  if (logp == -INFINITY) return 0.0;  // s = -inf, or lse = +inf: p is 0 exactly, as computed
  const double e = p_expm1(logp, p, rel_p);
  return std::isnan(e) ? e : std::fmin(e, p_max);  // a NaN p_max (lse = inf) caps nothing
}

// p_max_ij: the gradient pass computes p as e^{s - lse}. Its lse is at
// least the exact lse of its forward's scores less E_i (whatever the
// shift), so at least their max less E_i; a stored lse loses u_l |lse_i|,
// adding the max back u_a |lse_i|, forming the exponent 2 u_a (|s| +
// |lse|). Its scores are the forward's, or read back from packed scores
// (q_ij), or, under the fused kernels' softcap, recomputed from tanh within
// 2 (kappa + 4) u_a |s|. So p <= e^{that sum} (1 + kappa u_a).
double p_max(double q, double s, double lse, double eval, double k, const Precision& pr) {
  const double ua = pr.u_accum;
  const double recomputed = k > 0 ? 2.0 * (kappa + 4.0) * ua * std::fabs(s) : 0.0;
  return std::exp(q + (ua + pr.u_saved_lse) * std::fabs(lse) + eval +
                  2.0 * ua * (std::fabs(s) + std::fabs(lse)) + recomputed) *
         (1.0 + kappa * ua);
}

// Sections 2-4: lse, logprob, p, entropy.
RowTerms row_bounds(const DenseProblem& d, const BruteForce& x, const Precision& pr,
                    double floor, Bounds* b) {
  const double ua = pr.u_accum, uo = pr.u_out;
  const double log_v = std::log(double(d.v));
  const double gv = gamma(double(d.v), ua), gv1 = gamma(double(d.v + 1), ua);
  RowTerms t;
  t.dlogp.assign(d.n * d.v, 0.0);
  t.relp.assign(d.n * d.v, 0.0);
  t.dlse.assign(d.n, 0.0);
  t.eval.assign(d.n, 0.0);
  for (auto* v : {&b->lse, &b->logprob, &b->entropy}) v->assign(d.n, 0.0);
  for (int64_t i = 0; i < d.n; ++i) {
    const double lse = x.lse[i], mu = x.mean_s[i];
    const double eval = gv + double(d.v + 1) * (kappa + 1.0) * ua + 3.0 * ua * log_v +
                        ua * (std::fabs(lse) + log_v) + 2.0 * ua * d.options.softcap +
                        kappa * ua * log_v + ua * std::fabs(lse) +
                        pr.u_saved_lse * std::fabs(lse);
    b->row_logit[i] = lse_logit_error(&x.logp[i * d.v], &x.p[i * d.v], &b->logits[i * d.v],
                                      d.v, b->row_logit[i]);
    const double dlse = b->row_logit[i] + eval;
    t.eval[i] = eval;
    t.dlse[i] = dlse;
    b->lse[i] = dlse + uo * std::fabs(lse) + floor;

    double from_logits = 0.0, w = 0.0, evaluation = 0.0;
    for (int64_t j = 0; j < d.v; ++j) {
      const int64_t ij = i * d.v + j;
      const double s = x.s[ij], p = x.p[ij], logp = x.logp[ij];
      const double rho = 2.0 * ua * (std::fabs(s) + std::fabs(lse) + log_v);
      t.dlogp[ij] = b->logits[ij] + dlse + rho;
      // p's error as a logarithm (p_error: how far p itself can move).
      t.relp[ij] = t.dlogp[ij] + kappa * ua + ua * (std::fabs(s) + std::fabs(lse));
      from_logits += pw(p, std::fabs(s - mu) * b->logits[ij]);
      const double mag = pw(p, std::fabs(s) + std::fabs(logp));
      w += mag;
      evaluation += pw(mag, rho + kappa * ua + gv1);
    }
    const double ent = x.entropy[i];
    b->entropy[i] = from_logits + eval * (1.0 + w) + evaluation +
                    ua * (std::fabs(lse) + std::fabs(mu)) + uo * std::fabs(ent) + floor;
    if (d.ignored(i)) {
      b->logprob[i] = 0.0;
    } else {
      const double lp = x.logprob[i];
      b->logprob[i] = t.dlogp[i * d.v + d.labels[i]] + uo * std::fabs(lp) + floor;
    }
  }
  return t;
}

// Section 5: ce, zloss, loss rows and the reduction.
void loss_bounds(const DenseProblem& d, const BruteForce& x, const Precision& pr,
                 const RowTerms& t, double floor, Bounds* b) {
  const double ua = pr.u_accum, uo = pr.u_out;
  const double e = d.options.label_smoothing, l = d.options.z_loss;
  const double gv5 = gamma(double(d.v + 5), ua);
  b->zloss.assign(d.n, 0.0);
  b->loss_rows.assign(d.n, 0.0);
  std::vector<double> dloss(d.n, 0.0);
  for (int64_t i = 0; i < d.n; ++i) {
    const double lse = x.lse[i];
    const double dzl = 2.0 * l * std::fabs(lse) * t.dlse[i] + 3.0 * ua * l * lse * lse;
    b->zloss[i] = dzl + uo * std::fabs(x.zloss[i]) + floor;
    if (d.ignored(i)) continue;
    const int64_t y = d.labels[i];
    const double cy = d.class_weight(y);
    double dce = (1.0 - e) * cy * t.dlogp[i * d.v + y];
    double magnitude = (1.0 - e) * cy * std::fabs(x.logp[i * d.v + y]);
    if (e > 0) {
      double prop = 0.0, mag = 0.0;
      for (int64_t j = 0; j < d.v; ++j) {
        prop += d.class_weight(j) * t.dlogp[i * d.v + j];
        mag += d.class_weight(j) * (std::fabs(x.s[i * d.v + j]) + std::fabs(lse));
      }
      dce += e / double(d.v) * prop;
      magnitude += e / double(d.v) * mag;
    }
    dce += gv5 * magnitude;
    const double ti = d.token_weight(i);
    dloss[i] = ti * (dce + dzl) + 2.0 * ua * ti * (std::fabs(x.ce[i]) + std::fabs(x.zloss[i]));
    b->loss_rows[i] = dloss[i] + uo * std::fabs(x.loss_rows[i]) + floor;
  }
  const auto reduction = d.options.reduction;
  if (reduction == flce::Reduction::none) {
    b->loss = b->loss_rows;
    return;
  }
  double sum_d = 0.0, sum_abs = 0.0;
  for (int64_t i = 0; i < d.n; ++i) {
    sum_d += dloss[i];
    sum_abs += std::fabs(x.loss_rows[i]);
  }
  const double gn = gamma(double(d.n), ua), total = x.loss[0];
  if (reduction == flce::Reduction::sum) {
    b->loss = {sum_d + gn * sum_abs + uo * std::fabs(total) + floor};
  } else if (x.denominator > 0) {
    b->loss = {(sum_d + gn * sum_abs) / x.denominator +
               gamma(double(d.n + 1), ua) * std::fabs(total) + uo * std::fabs(total) + floor};
  } else {
    b->loss = {0.0};
  }
}

// Section 6's q_ij: the error of the score that the gradient pass reads back
// from a 16-bit store (Precision::u_packed), 0 where it reads the score
// itself. Non-finite scores and rows whose max is infinite read back
// exactly enough: p_ij is 0 or NaN either way.
std::vector<double> packed_score_errors(const DenseProblem& d, const BruteForce& x, double uq,
                                        double ua) {
  std::vector<double> q(d.n * d.v, 0.0);
  if (uq == 0) return q;
  for (int64_t i = 0; i < d.n; ++i) {
    double m = -INFINITY;
    for (int64_t j = 0; j < d.v; ++j)
      if (!std::isnan(x.s[i * d.v + j])) m = std::max(m, x.s[i * d.v + j]);
    for (int64_t j = 0; j < d.v; ++j) {
      const double s = x.s[i * d.v + j];
      if (std::isfinite(s) && std::isfinite(m))
        q[i * d.v + j] = (uq + 2 * ua) * (m - s) + ua * std::fabs(s) + tiny(uq);
    }
  }
  return q;
}

// Section 6: dG_ij, the error of dlogits before any output rounding.
void dlogits_bounds(const DenseProblem& d, const BruteForce& x, const Precision& pr,
                    const RowTerms& t, Bounds* b) {
  const double ua = pr.u_accum, p_underflow = smallest_normal(ua);
  const double a = d.options.logit_scale, k = d.options.softcap;
  const double e = d.options.label_smoothing, l = d.options.z_loss;
  const double g9 = gamma(9.0, ua), gv1 = gamma(double(d.v + 1), ua);
  const double gv5 = gamma(double(d.v + 5), ua);
  const double rho_r = d.options.reduction == flce::Reduction::mean ? gamma(double(d.n + 1), ua)
                                                                    : 0.0;
  double class_sum = 0.0;
  for (int64_t j = 0; j < d.v; ++j) class_sum += d.class_weight(j);
  b->dlogits.assign(d.n * d.v, 0.0);
  const std::vector<double> dq = packed_score_errors(d, x, pr.u_packed, ua);
  for (int64_t i = 0; i < d.n; ++i) {
    const double q = x.loss_coef[i] * d.token_weight(i);
    const double g_lse = d.grad_lse.empty() ? 0.0 : d.grad_lse[i];
    const double g_ent = d.grad_entropy.empty() ? 0.0 : d.grad_entropy[i];
    const int64_t y = d.ignored(i) ? -1 : d.labels[i];
    const double cy = y >= 0 ? d.class_weight(y) : 0.0;
    const double lse = x.lse[i], mu = x.mean_s[i];
    // z-loss's 2 l lse only where l > 0: 0 * inf is NaN in a row of +inf logits.
    const double zl = l == 0 ? 0.0 : 2 * l * lse, dzl = l == 0 ? 0.0 : 2.0 * l * t.dlse[i];
    const double A = (1 - e) * cy + e / double(d.v) * class_sum + zl;
    const double dA = dzl + gv5 * ((1 - e) * cy + e / double(d.v) * class_sum + std::fabs(zl));
    double dmu = 0.0;
    for (int64_t j = 0; j < d.v; ++j) {
      const int64_t ij = i * d.v + j;
      const double p = x.p[ij];
      const double dp =
          p_error(x.logp[ij], p, t.relp[ij], p_max(0.0, x.s[ij], lse, t.eval[i], k, pr));
      dmu += pw(p, b->logits[ij]) + pw(dp + p * gv1, std::fabs(x.s[ij]));
    }
    for (int64_t j = 0; j < d.v; ++j) {
      const int64_t ij = i * d.v + j;
      const double p = x.p[ij], s = x.s[ij];
      // The score and p as the gradient pass has them: ds + q, and relP + q.
      const double ds = b->logits[ij] + dq[ij];
      const double dp = p_error(x.logp[ij], p, t.relp[ij] + dq[ij],
                                p_max(dq[ij], s, lse, t.eval[i], k, pr));
      const double T1 = std::fabs(q * A) * p;
      const double T2 = j == y ? std::fabs(q) * (1 - e) * cy : 0.0;
      const double T3 = std::fabs(q) * e / double(d.v) * d.class_weight(j);
      const double T4 = std::fabs(g_lse) * p;
      const double T5 = std::fabs(g_ent) * pw(p, std::fabs(s - mu));
      double dgs = g9 * (T1 + T2 + T3 + T4 + T5) + mul0(std::fabs(q * A), dp) + T1 * rho_r +
                   pw(std::fabs(q) * p, dA) + (T2 + T3) * rho_r + mul0(std::fabs(g_lse), dp) +
                   mul0(std::fabs(g_ent) * std::fabs(s - mu), dp) +
                   mul0(std::fabs(g_ent), pw(p + dp, ds + dmu));  // p~ (s~ - mu~): p~ <= p + dp
      dgs += p_underflow * (std::fabs(q * A) + std::fabs(g_lse) +
                       (g_ent != 0 && std::isfinite(s - mu) ? std::fabs(g_ent * (s - mu)) : 0.0));
      const double gs = x.grad_s[ij];
      double dgz = dgs;
      if (k > 0) {
        const double L = 1.0 - (s / k) * (s / k);
        const double dL = 2.0 * std::fabs(s) * ds / (k * k) + 6.0 * ua;
        dgz = L * dgs + std::fabs(gs) * dL;
      }
      b->dlogits[ij] = a * dgz + (k > 0 ? 3.0 : 2.0) * ua * std::fabs(x.dlogits[ij]);
    }
  }
}

// What gradient filtering may leave out of the GEMMs, per entry: |G'_ij|
// where |G'_ij| <= eps (kappa_i + dkappa_i) + dG'_ij, with G' = G - u c^T
// (u_i = -a g_i e/V, g_i = r_i t_i) when label smoothing's term is split off,
// kappa_i = a (|coef_p_i| + |g_ent_i|), coef_p_i = g_i ((1-e) c_y + (e/V) C +
// 2 l lse_i) + g_lse_i, and dG' the error of G as cast (the cpu backend
// compares G after rounding it to the storage dtype, Plan::round_grad_logits,
// where dlogits are cast). The threshold is computed too: from the
// computed lse (a g 2 l dlse_i) in at most 8 roundings (8 u_a kappa_i),
// dkappa_i. With a softcap and label smoothing together the filter is off.
std::vector<double> filter_allowance(const DenseProblem& d, const BruteForce& x, double eps,
                                     double ua, const std::vector<double>& dg,
                                     const std::vector<double>& dlse) {
  std::vector<double> dropped(d.n * d.v, 0.0);
  const flce::Options& o = d.options;
  const double e = o.label_smoothing, a = o.logit_scale, V = double(d.v);
  if (o.softcap > 0 && e > 0) return dropped;
  auto c = [&](int64_t j) { return d.class_weights.empty() ? 1.0 : d.class_weights[j]; };
  double C = 0;
  for (int64_t j = 0; j < d.v; ++j) C += c(j);
  for (int64_t i = 0; i < d.n; ++i) {
    const bool ignored = d.labels[i] == o.ignore_index;
    const double t = d.token_weights.empty() ? 1.0 : d.token_weights[i];
    const double g = ignored ? 0.0 : x.loss_coef[i] * t;
    const double c_y = ignored ? 0.0 : c(d.labels[i]);
    const double g_lse = d.grad_lse.empty() ? 0.0 : d.grad_lse[i];
    const double g_ent = d.grad_entropy.empty() ? 0.0 : d.grad_entropy[i];
    const double coef_p = g * ((1 - e) * c_y + (e / V) * C + 2 * o.z_loss * x.lse[i]) + g_lse;
    const double kappa = a * (std::fabs(coef_p) + std::fabs(g_ent));
    const double dkappa = a * std::fabs(g) * 2 * o.z_loss * dlse[i] + 8 * ua * kappa;
    const double u = -a * g * e / V;
    for (int64_t j = 0; j < d.v; ++j) {
      const double gp = std::fabs(x.dlogits[i * d.v + j] - u * c(j));
      if (gp <= eps * (kappa + dkappa) + dg[i * d.v + j]) dropped[i * d.v + j] = gp;
    }
  }
  return dropped;
}

// Section 7: the parameter gradients (or grad_logits).
void gradient_bounds(const DenseProblem& d, const BruteForce& x, const Precision& pr,
                     const RowTerms& t, double floor, Bounds* b) {
  const double ua = pr.u_accum, uo = pr.u_out;
  // G as cast (u_g) for the GEMMs or for a 16-bit grad_logits: dG'.
  std::vector<double> dg(d.n * d.v);
  const double floor_g = cast_underflow(pr.u_grad);
  for (int64_t ij = 0; ij < d.n * d.v; ++ij)
    dg[ij] = b->dlogits[ij] + pr.u_grad * std::fabs(x.dlogits[ij]) + floor_g;
  if (d.logits_entry) {
    b->grad_logits.assign(d.n * d.v, 0.0);
    for (int64_t ij = 0; ij < d.n * d.v; ++ij)
      b->grad_logits[ij] = dg[ij] + uo * std::fabs(x.dlogits[ij]) + floor;
    return;
  }
  // The GEMMs may read G' below the accumulation format's normal range as 0
  // (the cpu backend flushes it there, Plan::flush_subnormal_g).
  for (double& e : dg) e += smallest_normal(ua);
  const double gv1 = gamma(double(d.v + 1), ua), gn1 = gamma(double(d.n + 1), ua);
  // dG' plus the GEMMs' own gamma terms.
  std::vector<double> for_x(d.n * d.v), for_w(d.n * d.v);
  for (int64_t ij = 0; ij < d.n * d.v; ++ij) {
    for_x[ij] = dg[ij] + gv1 * std::fabs(x.dlogits[ij]);
    for_w[ij] = dg[ij] + gn1 * std::fabs(x.dlogits[ij]);
  }
  if (!d.bias.empty()) {  // before the filter's allowance: grad_bias sums every entry of G'
    b->grad_bias.assign(d.v, 0.0);
    for (int64_t j = 0; j < d.v; ++j) {
      double sum = 0.0;
      for (int64_t i = 0; i < d.n; ++i) sum += for_w[i * d.v + j];
      b->grad_bias[j] = sum + uo * std::fabs(x.grad_bias[j]) + floor;
    }
  }
  if (pr.filter_eps > 0) {
    const std::vector<double> dropped = filter_allowance(d, x, pr.filter_eps, ua, dg, t.dlse);
    for (int64_t ij = 0; ij < d.n * d.v; ++ij) for_x[ij] += dropped[ij], for_w[ij] += dropped[ij];
  }
  b->grad_x.assign(d.n * d.h, 0.0);
  for (int64_t i = 0; i < d.n; ++i)
    for (int64_t kk = 0; kk < d.h; ++kk) {
      double sum = 0.0;
      for (int64_t j = 0; j < d.v; ++j) sum += for_x[i * d.v + j] * std::fabs(d.weight(j, kk));
      b->grad_x[i * d.h + kk] = sum + uo * std::fabs(x.grad_x[i * d.h + kk]) + floor;
    }
  b->grad_w.assign(d.v * d.h, 0.0);
  for (int64_t j = 0; j < d.v; ++j)
    for (int64_t kk = 0; kk < d.h; ++kk) {
      double sum = 0.0;
      for (int64_t i = 0; i < d.n; ++i) sum += for_w[i * d.v + j] * std::fabs(d.x[i * d.h + kk]);
      const int64_t at = d.w_index(j, kk);
      b->grad_w[at] = sum + uo * std::fabs(x.grad_w[at]) + floor;
    }
}

// The objective sum_i r-weighted loss + g_lse . lse + g_ent . H, from the
// output bounds, plus gamma_{2N+1} for its own sum.
double objective_bound(const DenseProblem& d, const BruteForce& x, const Bounds& b,
                       double ua) {
  double err = 0.0, mag = 0.0;
  const bool rows = d.options.reduction == flce::Reduction::none;
  for (size_t i = 0; i < x.loss.size(); ++i) {
    const double g = d.grad_loss.empty() ? 1.0 : d.grad_loss[rows ? i : 0];
    err += std::fabs(g) * b.loss[i];
    mag += std::fabs(g * x.loss[i]);
  }
  for (int64_t i = 0; i < d.n; ++i) {
    if (!d.grad_lse.empty()) {
      err += std::fabs(d.grad_lse[i]) * b.lse[i];
      mag += std::fabs(d.grad_lse[i] * x.lse[i]);
    }
    if (!d.grad_entropy.empty()) {
      err += std::fabs(d.grad_entropy[i]) * b.entropy[i];
      mag += std::fabs(d.grad_entropy[i] * x.entropy[i]);
    }
  }
  return err + gamma(double(2 * d.n + 1), ua) * mag;
}

}  // namespace

Bounds error_bounds(const DenseProblem& d, const BruteForce& x, const Precision& pr) {
  Bounds b;
  const double floor = double(d.n + d.v + d.h + 8) * tiny(pr.u_accum) + tiny(pr.u_out);
  logit_bounds(d, x, pr, &b);
  const RowTerms t = row_bounds(d, x, pr, floor, &b);
  loss_bounds(d, x, pr, t, floor, &b);
  dlogits_bounds(d, x, pr, t, &b);
  gradient_bounds(d, x, pr, t, floor, &b);
  b.objective = objective_bound(d, x, b, pr.u_accum);
  return b;
}

namespace {

std::string index_str(size_t at, int64_t cols) {
  std::ostringstream out;
  if (cols <= 0) {
    out << "[" << at << "]";
  } else {
    out << "[" << int64_t(at) / cols << ", " << int64_t(at) % cols << "]";
  }
  return out.str();
}

// NaN matches NaN, +inf matches +inf, -inf matches -inf.
bool same_nonfinite(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return a == b;
}

}  // namespace

::testing::AssertionResult within_bounds_normwise(const std::string& name,
                                                  const std::vector<double>& actual,
                                                  const std::vector<double>& expected,
                                                  const std::vector<double>& bounds, double c) {
  if (actual.size() != expected.size() || bounds.size() != expected.size())
    return ::testing::AssertionFailure()
           << name << ": sizes differ: actual " << actual.size() << ", expected "
           << expected.size() << ", bounds " << bounds.size();
  double err2 = 0, bound2 = 0, value2 = 0;
  for (size_t at = 0; at < expected.size(); ++at) {
    const double a = actual[at], e = expected[at];
    if (!std::isfinite(a) || !std::isfinite(e)) {
      if (!same_nonfinite(a, e))
        return ::testing::AssertionFailure() << name << ": non-finite mismatch at " << at
                                             << ": actual " << a << ", expected " << e;
      continue;
    }
    err2 += (a - e) * (a - e);
    bound2 += (c * bounds[at]) * (c * bounds[at]);
    value2 += e * e;
  }
  std::ostringstream out;
  out.precision(6);
  out << name << " norm-wise: ||err|| " << std::sqrt(err2) << " vs ||C * bound|| "
      << std::sqrt(bound2) << " (ratio " << std::sqrt(err2 / bound2) << "; ||expected|| "
      << std::sqrt(value2) << ")";
  // NaN or +inf (which would accept anything): a test-construction error.
  if (!std::isfinite(bound2) || !(err2 <= bound2)) return ::testing::AssertionFailure() << out.str();
  return ::testing::AssertionSuccess() << out.str();
}

::testing::AssertionResult within_bounds(const std::string& name,
                                         const std::vector<double>& actual,
                                         const std::vector<double>& expected,
                                         const std::vector<double>& bounds, int64_t cols,
                                         double c) {
  if (actual.size() != expected.size() || bounds.size() != expected.size())
    return ::testing::AssertionFailure()
           << name << ": sizes differ: actual " << actual.size() << ", expected "
           << expected.size() << ", bounds " << bounds.size();
  size_t violations = 0, mismatches = 0, bad_bounds = 0;
  size_t worst = 0, first_mismatch = 0, first_bad_bound = 0;
  double worst_ratio = -1.0;
  for (size_t at = 0; at < expected.size(); ++at) {
    const double a = actual[at], e = expected[at], bound = c * bounds[at];
    if (!std::isfinite(a) || !std::isfinite(e)) {
      if (!same_nonfinite(a, e) && mismatches++ == 0) first_mismatch = at;
      continue;
    }
    if (!std::isfinite(bound)) {  // NaN, or +inf, which would accept anything
      if (bad_bounds++ == 0) first_bad_bound = at;
      continue;
    }
    const double err = std::fabs(a - e);
    if (err > bound) ++violations;
    const double ratio = bound > 0 ? err / bound : (err > 0 ? INFINITY : 0.0);
    if (ratio > worst_ratio) {
      worst_ratio = ratio;
      worst = at;
    }
  }
  std::ostringstream out;
  out.precision(17);
  out << name << " (" << expected.size() << " elements, C = " << c << ")";
  if (!expected.empty()) {
    out << ": worst " << index_str(worst, cols) << " actual " << actual[worst] << ", expected "
        << expected[worst] << ", |err| " << std::fabs(actual[worst] - expected[worst])
        << " vs bound " << c * bounds[worst] << " (ratio " << worst_ratio << ")";
  }
  if (violations == 0 && mismatches == 0 && bad_bounds == 0)
    return ::testing::AssertionSuccess() << out.str();
  auto fail = ::testing::AssertionFailure();
  fail << name << ": " << violations << " of " << expected.size()
       << " elements exceed C * bound; " << out.str();
  if (mismatches > 0)
    fail << "; " << mismatches << " NaN/Inf position mismatches, first at "
         << index_str(first_mismatch, cols) << ": actual " << actual[first_mismatch]
         << ", expected " << expected[first_mismatch];
  if (bad_bounds > 0)
    fail << "; " << bad_bounds << " finite values have a NaN bound (test error), first at "
         << index_str(first_bad_bound, cols);
  return fail;
}

::testing::AssertionResult argmax_within_bounds(const std::vector<int64_t>& actual,
                                                const DenseProblem& d, const BruteForce& x,
                                                const Bounds& b) {
  if (int64_t(actual.size()) != d.n)
    return ::testing::AssertionFailure() << "argmax: " << actual.size() << " rows, expected "
                                         << d.n;
  for (int64_t i = 0; i < d.n; ++i) {
    const int64_t want = x.argmax[i], got = actual[i];
    if (got == want) continue;
    if (got < 0 || got >= d.v)
      return ::testing::AssertionFailure()
             << "argmax[" << i << "] = " << got << " is outside [0, " << d.v << ")";
    const double s_max = x.s[i * d.v + want], s_got = x.s[i * d.v + got];
    if (std::isnan(s_max))
      return ::testing::AssertionFailure()
             << "argmax[" << i << "] = " << got << ", expected " << want
             << " (the first NaN logit of the row)";
    const double allowed = b.logits[i * d.v + want] + b.logits[i * d.v + got];
    if (!(s_max - s_got <= allowed))
      return ::testing::AssertionFailure()
             << "argmax[" << i << "] = " << got << " (s = " << s_got << "), expected " << want
             << " (s = " << s_max << "); the gap " << s_max - s_got << " exceeds the logit bounds "
             << allowed;
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult identical(const std::string& name, const std::vector<double>& a,
                                     const std::vector<double>& b) {
  if (a.size() != b.size())
    return ::testing::AssertionFailure() << name << ": sizes differ: " << a.size() << " vs "
                                         << b.size();
  for (size_t at = 0; at < a.size(); ++at) {
    if (std::isnan(a[at]) && std::isnan(b[at])) continue;
    if (std::memcmp(&a[at], &b[at], sizeof(double)) != 0) {
      std::ostringstream out;
      out.precision(17);
      out << name << ": element " << at << " differs: " << a[at] << " vs " << b[at];
      return ::testing::AssertionFailure() << out.str();
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace flce_test
