// The README's semantics, one formula per loop, with materialized [N, V]
// arrays. Written for reading, not for speed.
//
// Every function computes in T: double for the oracle, float for the plain
// float32 implementation that the tolerance policy is checked against. The
// results are kept in the double arrays of BruteForce, which hold T's values
// exactly.
#include "support/brute_force.h"

#include <cmath>
#include <limits>

namespace flce_test {

double DenseProblem::weight(int64_t j, int64_t k) const { return w[w_index(j, k)]; }

int64_t DenseProblem::w_index(int64_t j, int64_t k) const {
  return w_layout == flce::WeightLayout::vh ? j * h + k : k * v + j;
}

double DenseProblem::token_weight(int64_t i) const {
  return token_weights.empty() ? 1.0 : token_weights[i];
}

double DenseProblem::class_weight(int64_t j) const {
  return class_weights.empty() ? 1.0 : class_weights[j];
}

namespace {

// p * q with 0 * anything = 0: a class with p = 0 (s = -inf, or underflow)
// contributes nothing to an expectation over p.
template <typename T>
T expect_term(T p, T q) {
  return p == T(0) ? T(0) : p * q;
}

// z_ij = a * (x_i . W_j + b_j) or a * logits_ij;  s_ij = k tanh(z_ij / k).
template <typename T>
void logits(const DenseProblem& d, BruteForce* r) {
  const T a = T(d.options.logit_scale), k = T(d.options.softcap);
  for (int64_t i = 0; i < d.n; ++i) {
    for (int64_t j = 0; j < d.v; ++j) {
      T dot;
      if (d.logits_entry) {
        dot = T(d.logits[i * d.v + j]);
      } else {
        dot = 0;
        for (int64_t kk = 0; kk < d.h; ++kk) dot += T(d.x[i * d.h + kk]) * T(d.weight(j, kk));
        if (!d.bias.empty()) dot += T(d.bias[j]);
      }
      const T z = a * dot;
      r->z[i * d.v + j] = z;
      r->s[i * d.v + j] = k > 0 ? T(k * std::tanh(z / k)) : z;
    }
  }
}

// argmax (first NaN, else lowest index of the maximum), lse, p, logp,
// entropy and zloss of row i.
template <typename T>
void row_statistics(const DenseProblem& d, int64_t i, BruteForce* r) {
  const double* s = &r->s[i * d.v];
  int64_t first_nan = -1, best = 0;
  for (int64_t j = 0; j < d.v; ++j) {
    if (std::isnan(s[j])) {
      if (first_nan < 0) first_nan = j;
    } else if (s[j] > s[best] || std::isnan(s[best])) {
      best = j;
    }
  }
  r->argmax[i] = first_nan >= 0 ? first_nan : best;

  // lse = m + log sum_j exp(s_j - m), m = max_j s_j. logp_j = (s_j - m) -
  // log sum where m is finite: s_j - lse would lose log sum to lse's own
  // rounding at a large m (a row of -1e30 logits has lse = m, so p_j = 1).
  const T m = T(s[best]);
  const bool shifted = first_nan < 0 && std::isfinite(m);
  T lse, lse_m = 0;  // lse_m = log sum, where shifted
  if (first_nan >= 0) {
    lse = std::numeric_limits<T>::quiet_NaN();
  } else if (std::isinf(m)) {
    lse = m;  // +inf: some exp(s) is infinite; -inf: every class is masked
  } else {
    T sum = 0;
    for (int64_t j = 0; j < d.v; ++j) sum += T(std::exp(T(s[j]) - m));
    lse_m = T(std::log(sum));
    lse = m + lse_m;
  }
  r->lse[i] = lse;

  // H_i = -sum_j p_ij logp_ij, by its definition: lse_i - mu_i would
  // cancel two numbers as large as the logits.
  T mean_s = 0, entropy = 0;  // mu_i = sum_j p_ij s_ij
  for (int64_t j = 0; j < d.v; ++j) {
    const T logp = shifted ? (T(s[j]) - m) - lse_m : T(s[j]) - lse, p = T(std::exp(logp));
    r->logp[i * d.v + j] = logp;
    r->p[i * d.v + j] = p;
    mean_s += expect_term(p, T(s[j]));
    entropy -= expect_term(p, logp);
  }
  r->mean_s[i] = mean_s;
  r->entropy[i] = entropy;
  r->zloss[i] = T(d.options.z_loss) * lse * lse;
}

// ce_i = -(1-e) c_y logp_iy - (e/V) sum_j c_j logp_ij;
// loss_i = t_i (ce_i + l lse_i^2), 0 for ignored rows.
template <typename T>
void row_loss(const DenseProblem& d, int64_t i, BruteForce* r) {
  if (d.ignored(i)) {
    r->logprob[i] = r->ce[i] = r->loss_rows[i] = 0.0;
    return;
  }
  const T e = T(d.options.label_smoothing);
  const int64_t y = d.labels[i];
  const T logp_y = T(r->logp[i * d.v + y]);
  r->logprob[i] = logp_y;
  T ce = -(T(1) - e) * T(d.class_weight(y)) * logp_y;
  if (e > 0) {
    T smooth = 0;
    for (int64_t j = 0; j < d.v; ++j) smooth += T(d.class_weight(j)) * T(r->logp[i * d.v + j]);
    ce -= e / T(d.v) * smooth;
  }
  r->ce[i] = ce;
  r->loss_rows[i] = T(d.token_weight(i)) * (ce + T(r->zloss[i]));
}

// Reduction, the denominator D, and r_i = d objective / d loss_i.
template <typename T>
void reduce(const DenseProblem& d, BruteForce* r) {
  const auto reduction = d.options.reduction;
  T total = 0, denominator = 0;
  for (int64_t i = 0; i < d.n; ++i) {
    total += T(r->loss_rows[i]);
    if (!d.ignored(i)) denominator += T(d.token_weight(i)) * T(d.class_weight(d.labels[i]));
  }
  r->denominator = denominator;
  if (reduction == flce::Reduction::none) {
    r->loss = r->loss_rows;
  } else if (reduction == flce::Reduction::sum) {
    r->loss = {double(total)};
  } else {
    r->loss = {denominator > 0 ? double(total / denominator) : 0.0};
  }
  for (int64_t i = 0; i < d.n; ++i) {
    T g;
    if (reduction == flce::Reduction::none) {
      g = d.grad_loss.empty() ? T(1) : T(d.grad_loss[i]);
    } else {
      g = d.grad_loss.empty() ? T(1) : T(d.grad_loss[0]);
      if (reduction == flce::Reduction::mean) g = denominator > 0 ? g / denominator : T(0);
    }
    r->loss_coef[i] = d.ignored(i) ? T(0) : g;
  }
}

// objective = grad_loss . loss + grad_lse . lse + grad_entropy . entropy.
double objective(const DenseProblem& d, const BruteForce& r) {
  double obj = 0.0;
  if (d.options.reduction == flce::Reduction::none) {
    for (int64_t i = 0; i < d.n; ++i)
      obj += (d.grad_loss.empty() ? 1.0 : d.grad_loss[i]) * r.loss[i];
  } else {
    obj += (d.grad_loss.empty() ? 1.0 : d.grad_loss[0]) * r.loss[0];
  }
  for (int64_t i = 0; i < d.n; ++i) {
    if (!d.grad_lse.empty()) obj += d.grad_lse[i] * r.lse[i];
    if (!d.grad_entropy.empty()) obj += d.grad_entropy[i] * r.entropy[i];
  }
  return obj;
}

// d objective / d s_ij, then through the softcap and the scale:
//   d loss_i / d s_ij = t_i (p_ij A_i - (1-e) c_y [j = y] - (e/V) c_j),
//     A_i = (1-e) c_y + (e/V) sum_k c_k + 2 l lse_i
//   d lse_i / d s_ij = p_ij
//   d H_i / d s_ij = -p_ij (s_ij - mu_i)
//   d s / d z = 1 - (s/k)^2;  d z / d(x.W + b) = a.
template <typename T>
void dlogits(const DenseProblem& d, BruteForce* r) {
  const T a = T(d.options.logit_scale), k = T(d.options.softcap);
  const T e = T(d.options.label_smoothing), l = T(d.options.z_loss), v = T(d.v);
  T class_sum = 0;
  for (int64_t j = 0; j < d.v; ++j) class_sum += T(d.class_weight(j));
  for (int64_t i = 0; i < d.n; ++i) {
    const T q = T(r->loss_coef[i]) * T(d.token_weight(i));
    const T g_lse = d.grad_lse.empty() ? T(0) : T(d.grad_lse[i]);
    const T g_ent = d.grad_entropy.empty() ? T(0) : T(d.grad_entropy[i]);
    const int64_t y = d.ignored(i) ? -1 : d.labels[i];
    const T c_y = y >= 0 ? T(d.class_weight(y)) : T(0);
    const T A = (1 - e) * c_y + e / v * class_sum + 2 * l * T(r->lse[i]);
    for (int64_t j = 0; j < d.v; ++j) {
      const int64_t ij = i * d.v + j;
      const T p = T(r->p[ij]), s = T(r->s[ij]);
      T gs = 0;
      if (q != 0) {
        gs += q * (p * A - e / v * T(d.class_weight(j)));
        if (j == y) gs -= q * (1 - e) * c_y;
      }
      gs += g_lse * p;
      // s_ij - mu_i = logp_ij + H_i
      gs -= g_ent * expect_term(p, T(r->logp[ij]) + T(r->entropy[i]));
      r->grad_s[ij] = gs;
      const T ds_dz = k > 0 ? T(1) - (s / k) * (s / k) : T(1);
      r->dlogits[ij] = a * ds_dz * gs;
    }
  }
}

// grad_x = G W, grad_W = G^T x, grad_b = column sums of G (G = dlogits).
template <typename T>
void parameter_gradients(const DenseProblem& d, BruteForce* r) {
  if (d.logits_entry) {
    r->grad_logits = r->dlogits;
    return;
  }
  r->grad_x.assign(d.n * d.h, 0.0);
  r->grad_w.assign(d.v * d.h, 0.0);
  for (int64_t i = 0; i < d.n; ++i) {
    for (int64_t kk = 0; kk < d.h; ++kk) {
      T sum = 0;
      for (int64_t j = 0; j < d.v; ++j) sum += T(r->dlogits[i * d.v + j]) * T(d.weight(j, kk));
      r->grad_x[i * d.h + kk] = sum;
    }
  }
  for (int64_t j = 0; j < d.v; ++j) {
    for (int64_t kk = 0; kk < d.h; ++kk) {
      T sum = 0;
      for (int64_t i = 0; i < d.n; ++i) sum += T(r->dlogits[i * d.v + j]) * T(d.x[i * d.h + kk]);
      r->grad_w[d.w_index(j, kk)] = sum;
    }
  }
  if (!d.bias.empty()) {
    r->grad_bias.assign(d.v, 0.0);
    for (int64_t j = 0; j < d.v; ++j) {
      T sum = 0;
      for (int64_t i = 0; i < d.n; ++i) sum += T(r->dlogits[i * d.v + j]);
      r->grad_bias[j] = sum;
    }
  }
}

template <typename T>
BruteForce compute(const DenseProblem& d) {
  BruteForce r;
  const size_t nv = size_t(d.n * d.v), n = size_t(d.n);
  for (auto* a : {&r.z, &r.s, &r.p, &r.logp, &r.grad_s, &r.dlogits}) a->assign(nv, 0.0);
  for (auto* a : {&r.lse, &r.logprob, &r.entropy, &r.zloss, &r.mean_s, &r.loss_rows, &r.ce,
                  &r.loss_coef})
    a->assign(n, 0.0);
  r.argmax.assign(n, 0);
  logits<T>(d, &r);
  for (int64_t i = 0; i < d.n; ++i) {
    row_statistics<T>(d, i, &r);
    row_loss<T>(d, i, &r);
  }
  reduce<T>(d, &r);
  r.objective = objective(d, r);
  dlogits<T>(d, &r);
  parameter_gradients<T>(d, &r);
  return r;
}

}  // namespace

BruteForce brute_force(const DenseProblem& problem) { return compute<double>(problem); }

BruteForce brute_force_float32(const DenseProblem& problem) { return compute<float>(problem); }

double brute_force_objective(const DenseProblem& problem) {
  return brute_force(problem).objective;
}

}  // namespace flce_test
