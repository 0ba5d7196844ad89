// Host-side scalars of the README's semantics that every backend needs, in
// one place: the mean's denominator, the loss cotangent per row, and the
// reduction of per-row losses.
#pragma once

#include <cstdint>

#include "common/tensor_access.h"
#include "flce/flce.h"

namespace flce {

// D = sum over rows i with y_i != ignore_index of t_i * c_{y_i}.
inline double mean_denominator(const Problem& p, int64_t n) {
  double d = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t y = load_int(p.labels, i);
    if (y == p.options.ignore_index) continue;
    const double t_i = p.token_weights.present() ? load(p.token_weights, i) : 1.0;
    d += t_i * (p.class_weights.present() ? load(p.class_weights, y) : 1.0);
  }
  return d;
}

// d objective / d loss_i: grad_loss (ones when absent), divided by D for the
// mean; 0 when D = 0 (the mean is 0 there, and so is its gradient).
inline double loss_cotangent(const Problem& p, double denom, int64_t i) {
  switch (p.options.reduction) {
    case Reduction::none: return p.grad_loss.present() ? load(p.grad_loss, i) : 1.0;
    case Reduction::sum: return p.grad_loss.present() ? load(p.grad_loss) : 1.0;
    case Reduction::mean:
      if (denom == 0) return 0.0;
      return (p.grad_loss.present() ? load(p.grad_loss) : 1.0) / denom;
  }
  return 0.0;
}

// The gradient filter's eps for a storage dtype: filter_eps, or for
// kFilterEpsAuto the dtype's machine epsilon (2u) / 32.
inline double filter_eps_for(const Options& o, Dtype storage) {
  if (o.filter_eps != kFilterEpsAuto) return o.filter_eps;
  switch (storage) {
    case Dtype::bf16: return 0x1p-7 / 32;
    case Dtype::f16: return 0x1p-10 / 32;
    case Dtype::f64: return 0x1p-52 / 32;
    default: return 0x1p-23 / 32;
  }
}

// sum_i loss_i in row order, divided by D for the mean (0 when D = 0).
inline double reduce_loss(const Problem& p, const double* row_loss, int64_t n, double denom) {
  double total = 0;
  for (int64_t i = 0; i < n; ++i) total += row_loss[i];
  if (p.options.reduction == Reduction::mean) total = denom == 0 ? 0.0 : total / denom;
  return total;
}

}  // namespace flce
