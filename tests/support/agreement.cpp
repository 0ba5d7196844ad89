#include "support/agreement.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <random>
#include <string>

#include <gtest/gtest.h>

namespace flce_test {

void expect_agreement(const DenseProblem& d, const Storage& st, flce::Pass pass,
                      const flce::RunConfig& config, Precision precision, bool in_place,
                      WeightGradients judge, RowOutputs rows, Views views, GradientSet grads) {
  const BruteForce exact = brute_force(d);
  Request rq;
  rq.config = config;
  rq.views = views;
  rq.head_gradients = grads;
  rq.in_place = in_place;
  rq.per_row_outputs = rows != RowOutputs::none;
  rq.argmax = rows == RowOutputs::all;
  if (pass == flce::Pass::backward) {
    rq.pass = flce::Pass::forward;
    const Outputs fwd = run_library(d, st, rq);
    ASSERT_TRUE(fwd.status.ok()) << fwd.status.error;
    rq.saved_lse = fwd.lse;
    precision.u_saved_lse = unit_roundoff(st.outputs);
  }
  rq.pass = pass;
  const Bounds b = error_bounds(d, exact, precision);
  // Gradients have their own output dtype (the logits' one when in place).
  Precision grad_precision = precision;
  grad_precision.u_out = unit_roundoff(in_place ? st.inputs : st.gradients);
  const Bounds gb = error_bounds(d, exact, grad_precision);
  const Outputs out = run_library(d, st, rq);
  ASSERT_TRUE(out.status.ok()) << out.status.error;
  if (!config.backend.empty()) {
    EXPECT_EQ(out.status.backend, config.backend);
  }
  if (pass != flce::Pass::backward) {
    EXPECT_TRUE(within_bounds("loss", out.loss, exact.loss, b.loss));
    EXPECT_TRUE(within_bounds("lse", out.lse, exact.lse, b.lse));
    if (rows != RowOutputs::none) {
      EXPECT_TRUE(within_bounds("logprob", out.logprob, exact.logprob, b.logprob));
      EXPECT_TRUE(within_bounds("entropy", out.entropy, exact.entropy, b.entropy));
      EXPECT_TRUE(within_bounds("zloss", out.zloss, exact.zloss, b.zloss));
    }
    if (rows == RowOutputs::all) {
      EXPECT_TRUE(argmax_within_bounds(out.argmax, d, exact, b));
    }
  }
  if (pass == flce::Pass::forward) return;
  if (d.logits_entry) {
    EXPECT_TRUE(
        within_bounds("grad_logits", out.grad_logits, exact.grad_logits, gb.grad_logits, d.v));
    return;
  }
  // Those not asked for came back empty (run_library).
  const int64_t w_cols = d.w_layout == flce::WeightLayout::vh ? d.h : d.v;
  // (Braces: EXPECT_TRUE is an if-else of its own.)
  if (judge == WeightGradients::normwise) {
    if (grads.x) { EXPECT_TRUE(within_bounds_normwise("grad_x", out.grad_x, exact.grad_x, gb.grad_x)); }
    if (grads.w) { EXPECT_TRUE(within_bounds_normwise("grad_w", out.grad_w, exact.grad_w, gb.grad_w)); }
  } else {
    if (grads.x) { EXPECT_TRUE(within_bounds("grad_x", out.grad_x, exact.grad_x, gb.grad_x, d.h)); }
    if (grads.w) { EXPECT_TRUE(within_bounds("grad_w", out.grad_w, exact.grad_w, gb.grad_w, w_cols)); }
  }
  if (grads.bias) {
    EXPECT_TRUE(within_bounds("grad_bias", out.grad_bias, exact.grad_bias, gb.grad_bias));
  }
}

void expect_identical_outputs(const Outputs& a, const Outputs& b) {
  EXPECT_TRUE(identical("loss", a.loss, b.loss));
  EXPECT_TRUE(identical("lse", a.lse, b.lse));
  EXPECT_TRUE(identical("logprob", a.logprob, b.logprob));
  EXPECT_TRUE(identical("entropy", a.entropy, b.entropy));
  EXPECT_TRUE(identical("zloss", a.zloss, b.zloss));
  EXPECT_EQ(a.argmax, b.argmax);
  EXPECT_TRUE(identical("grad_x", a.grad_x, b.grad_x));
  EXPECT_TRUE(identical("grad_w", a.grad_w, b.grad_w));
  EXPECT_TRUE(identical("grad_bias", a.grad_bias, b.grad_bias));
  EXPECT_TRUE(identical("grad_logits", a.grad_logits, b.grad_logits));
}

Precision float32_precision(const DenseProblem& d, const Storage& st) {
  Precision p;
  p.u_accum = 0x1p-24;
  p.u_store = 0x1p-24;
  p.u_out = unit_roundoff(st.outputs);
  const bool cast = d.options.grad_logits_dtype == flce::GradLogitsDtype::storage;
  p.u_grad = cast && st.inputs != flce::Dtype::f32 ? unit_roundoff(st.inputs) : 0.0;
  return p;
}

void offset_pair(DenseProblem* d, DenseProblem* moved, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto integer = [&](int lo, int hi) { return double(std::uniform_int_distribution<int>(lo, hi)(rng)); };
  if (d->logits_entry) {
    for (double& s : d->logits) s = integer(-64, 64) / 8;
  } else {
    ASSERT_FALSE(d->bias.empty()) << "offset_pair: a head needs a bias to carry the offset";
    ASSERT_LE(d->h, 64) << "offset_pair: |x . W| <= 32 needs H <= 64";
    for (double& v : d->x) v = integer(-1, 1) / 8;
    for (double& v : d->w) v = integer(-4, 4);
    for (double& b : d->bias) b = 0;
  }
  *moved = *d;
  for (double& s : d->logits_entry ? moved->logits : moved->bias) s += 0x1p20;
}

namespace {

// Row i's sum_j p_j (s_j - max), from the exact scores.
double mean_score_d(const BruteForce& x, int64_t v, int64_t i) {
  const double* s = &x.s[size_t(i * v)];
  const double* p = &x.p[size_t(i * v)];
  const double m = *std::max_element(s, s + v);
  double sbar_d = 0;
  for (int64_t j = 0; j < v; ++j) sbar_d += p[j] * (s[j] - m);
  return sbar_d;
}

// Row i's bound on the entropy's move from exponentials rounded at the
// offset (expect_entropy_ignores_offset), from the exact scores.
double rounded_exp_bound(const BruteForce& x, int64_t v, int64_t i) {
  const double u = 0x1p-24;
  const double* s = &x.s[size_t(i * v)];
  const double* p = &x.p[size_t(i * v)];
  const double m = *std::max_element(s, s + v);
  const double sbar_d = mean_score_d(x, v, i), mean_abs_d = -sbar_d;
  double from_exps = 0;
  for (int64_t j = 0; j < v; ++j) {
    const double d = s[j] - m;
    from_exps += p[j] * (kFunctionUlps * u + 2 * u * std::fabs(d)) * (1 + std::fabs(d - sbar_d));
  }
  return 2 * (from_exps + gamma(double(v), u) * (1 + 2 * mean_abs_d));
}

}  // namespace

void expect_entropy_ignores_offset(const DenseProblem& d, const DenseProblem& moved,
                                   const Storage& st, const flce::RunConfig& config,
                                   ExpArguments exps) {
  const BruteForce exact = brute_force(d);
  const Bounds policy = error_bounds(d, exact, float32_precision(d, st));
  for (flce::Pass pass : {flce::Pass::forward, flce::Pass::loss_and_grad}) {
    SCOPED_TRACE(flce::pass_name(pass));
    Request rq;
    rq.pass = pass;
    rq.config = config;
    const Outputs a = run_library(d, st, rq), b = run_library(moved, st, rq);
    ASSERT_TRUE(a.status.ok()) << a.status.error;
    ASSERT_TRUE(b.status.ok()) << b.status.error;
    ASSERT_EQ(a.entropy.size(), size_t(d.n));
    EXPECT_TRUE(within_bounds("entropy", a.entropy, exact.entropy, policy.entropy));
    const double u = 0x1p-53, u_out = st.outputs == flce::Dtype::f32 ? 0x1p-24 : u;
    for (int64_t i = 0; i < d.n; ++i) {
      const double h = a.entropy[size_t(i)];
      const double sbar_d = mean_score_d(exact, d.v, i);
      double tol = 4 * u * std::fabs(b.lse[size_t(i)]) * (1 + std::fabs(sbar_d)) + 2 * u_out * std::fabs(h);
      if (exps == ExpArguments::rounded_at_the_offset) tol += rounded_exp_bound(exact, d.v, i);
      EXPECT_NEAR(b.entropy[size_t(i)], h, tol) << "row " << i << " (entropy " << h << ")";
    }
  }
}

namespace {

// The problem of expect_rows_masked_whole_are_uniform: row i's logits all
// z_i, but the last row's, z and z - 8 (its float32 ulp) by turns. As a
// head: x_i = (z_i, -8 on the last row, 0, ...), W_j = (1, j odd, 0, ...).
DenseProblem rows_of_huge_logits(int64_t v, MaskedRowsEntry entry, flce::Dtype inputs) {
  const float lowest = inputs == flce::Dtype::bf16 ? -0x1.fep127f : -FLT_MAX;
  const std::vector<float> rows = {-1e30f, lowest, -1e17f, 1e17f, 1e8f};
  DenseProblem d;
  d.v = v;
  d.logits_entry = entry == MaskedRowsEntry::logits;
  d.h = d.logits_entry ? 0 : 16;
  d.n = int64_t(rows.size());
  if (!d.logits_entry) {
    d.w.assign(size_t(v * d.h), 0.0);
    d.x.assign(size_t(d.n * d.h), 0.0);
    for (int64_t j = 0; j < v; ++j) d.w[size_t(j * d.h)] = 1, d.w[size_t(j * d.h + 1)] = j % 2;
  }
  for (int64_t i = 0; i < d.n; ++i) {
    const double z = round_to(rows[size_t(i)], inputs), step = i + 1 == d.n ? -8.0 : 0.0;
    if (d.logits_entry)
      for (int64_t j = 0; j < v; ++j) d.logits.push_back(z + step * (j % 2));
    else
      d.x[size_t(i * d.h)] = z, d.x[size_t(i * d.h + 1)] = step;
    d.labels.push_back((i * 7919 + 3) % v);
    d.grad_lse.push_back(0.5);
    d.grad_entropy.push_back(0.25);  // a backward then runs the first pass too
  }
  d.options.reduction = flce::Reduction::none;
  return d;
}

}  // namespace

void expect_rows_masked_whole_are_uniform(const flce::RunConfig& config, int64_t v,
                                          MaskedRowsEntry entry, flce::Dtype inputs) {
  const DenseProblem d = rows_of_huge_logits(v, entry, inputs);
  Storage st;
  st.inputs = inputs;
  st.reals = st.outputs = st.gradients = flce::Dtype::f32;
  const double u = 0x1p-24, sums = kFunctionUlps * u + gamma(double(v), u);
  const BruteForce exact = brute_force(d);  // p and logp from s - max, as here
  std::vector<double> saved_lse;
  for (flce::Pass pass : {flce::Pass::forward, flce::Pass::loss_and_grad, flce::Pass::backward}) {
    SCOPED_TRACE(flce::pass_name(pass));
    Request rq;
    rq.pass = pass;
    rq.config = config;
    rq.saved_lse = saved_lse;
    rq.head_gradients = {true, false, false};  // grad_x
    const Outputs out = run_library(d, st, rq);
    ASSERT_TRUE(out.status.ok()) << out.status.error;
    if (pass == flce::Pass::forward) saved_lse = out.lse;
    for (int64_t i = 0; i < d.n; ++i) {
      const double* s = &exact.s[size_t(i * v)];
      const double max = *std::max_element(s, s + v);
      SCOPED_TRACE("row " + std::to_string(i) + ", max " + std::to_string(max));
      const int64_t y = d.labels[size_t(i)];
      const double lse32 = round_to(exact.lse[size_t(i)], flce::Dtype::f32);
      if (pass != flce::Pass::backward) {
        const double entropy = exact.entropy[size_t(i)], logp_y = exact.logprob[size_t(i)];
        EXPECT_EQ(out.lse[size_t(i)], lse32);
        EXPECT_NEAR(out.loss[size_t(i)], -logp_y, sums + 2 * u * std::fabs(logp_y));
        EXPECT_NEAR(out.logprob[size_t(i)], logp_y, sums + 2 * u * std::fabs(logp_y));
        EXPECT_NEAR(out.entropy[size_t(i)], entropy, sums * 17 + 2 * u * entropy);  // |d_j| <= 8
      }
      if (pass == flce::Pass::forward) continue;
      // G_ij = (1 + g_lse) p_ij - [j = y] - g_ent p_ij (d_ij - sbar_d). The
      // kernels' e^(s - lse32) is within kFunctionUlps u, and 2 u |s - lse32|
      // from its argument (cuda's exponent FMA with log2(e) rounded): eps_p.
      // The entropy term's d_ij - sbar_d is formed in float32 from d_ij
      // (exact here) and sbar_d, whose sums are off by up to 17 `sums`, as
      // the entropy's. A backward's saved lse (float32) is the row's own
      // where it equals the lse in double (the rows of one logit, whose
      // log sum_j e^(d_ij) that sum loses); else p is e^(s - saved).
      const double saved = pass == flce::Pass::backward ? saved_lse[size_t(i)] : exact.lse[size_t(i)];
      const double g = 1 + d.grad_lse[size_t(i)], g_ent = d.grad_entropy[size_t(i)];
      std::vector<double> p(exact.p.begin() + i * v, exact.p.begin() + (i + 1) * v);
      double sbar_d = 0;
      for (int64_t j = 0; j < v; ++j) {
        if (!(saved == exact.lse[size_t(i)])) p[size_t(j)] = std::exp((s[j] - max) - (saved - max));
        sbar_d += p[size_t(j)] * (s[j] - max);
      }
      std::vector<double> want(static_cast<size_t>(v)), tol(static_cast<size_t>(v));
      for (int64_t j = 0; j < v; ++j) {
        const double pj = p[size_t(j)], dev = (s[j] - max) - sbar_d;
        const double gap = std::fabs(s[j] - lse32);
        const double eps_p = (kFunctionUlps + 2 * gap + 4) * u;
        want[size_t(j)] = g * pj - (j == y) - g_ent * pj * dev;
        tol[size_t(j)] = 2 * u * std::fabs(want[size_t(j)]) + g * pj * eps_p +
                         g_ent * pj *
                             (std::fabs(dev) * (eps_p + 2 * u) + u * std::fabs(sbar_d) + 17 * sums);
      }
      if (d.logits_entry) {
        int64_t wrong = 0;
        for (int64_t j = 0; j < v; ++j) {
          const double got = out.grad_logits[size_t(i * v + j)];
          if (!(std::fabs(got - want[size_t(j)]) <= tol[size_t(j)]) && wrong++ < 3)
            ADD_FAILURE() << "G[" << i << ", " << j << "] = " << got << ", not " << want[size_t(j)];
        }
        EXPECT_EQ(wrong, 0) << "classes of row " << i << " outside";
        continue;
      }
      // grad_x_ik = sum_j G_ij W_jk: G's errors, its rounding to `inputs`
      // where the GEMM takes that dtype, and the GEMM's float32 sum (bf16
      // products add exactly into float32).
      for (int64_t k = 0; k < d.h; ++k) {
        double sum = 0, sum_abs = 0, sum_tol = 0;
        for (int64_t j = 0; j < v; ++j) {
          const double w = d.weight(j, k);
          sum += want[size_t(j)] * w, sum_abs += std::fabs(want[size_t(j)] * w), sum_tol += tol[size_t(j)] * w;
        }
        const double bound = sum_tol + (unit_roundoff(inputs) + gamma(double(v), u)) * sum_abs;
        EXPECT_NEAR(out.grad_x[size_t(i * d.h + k)], sum, bound) << "grad_x column " << k;
      }
    }
  }
}

}  // namespace flce_test
