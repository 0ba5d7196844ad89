#include "support/agreement.h"

#include <gtest/gtest.h>

namespace flce_test {

void expect_agreement(const DenseProblem& d, const Storage& st, flce::Pass pass,
                      const flce::RunConfig& config, Precision precision, bool in_place,
                      WeightGradients judge, RowOutputs rows, Views views) {
  const BruteForce exact = brute_force(d);
  Request rq;
  rq.config = config;
  rq.views = views;
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
  if (judge == WeightGradients::normwise) {
    EXPECT_TRUE(within_bounds_normwise("grad_x", out.grad_x, exact.grad_x, gb.grad_x));
    EXPECT_TRUE(within_bounds_normwise("grad_w", out.grad_w, exact.grad_w, gb.grad_w));
  } else {
    EXPECT_TRUE(within_bounds("grad_x", out.grad_x, exact.grad_x, gb.grad_x, d.h));
    const int64_t w_cols = d.w_layout == flce::WeightLayout::vh ? d.h : d.v;
    EXPECT_TRUE(within_bounds("grad_w", out.grad_w, exact.grad_w, gb.grad_w, w_cols));
  }
  EXPECT_TRUE(within_bounds("grad_bias", out.grad_bias, exact.grad_bias, gb.grad_bias));
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

}  // namespace flce_test
