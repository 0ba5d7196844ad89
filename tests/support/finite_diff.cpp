// Central differences with a derived tolerance.
//
// With f evaluated to within eps (a rounding-error bound of the float64
// objective, from the tolerance policy), the central difference
//   D = (f(p + h) - f(p - h)) / (2h)
// differs from f'(p) by
//   truncation  h^2 / 6 |f'''(xi)|, xi in [p - h, p + h]   (Taylor, with the
//               mean-value theorem on the two third-order remainders)
//   rounding    2 eps / (2h) = eps / h                      (the two values)
//               + 3 u |D|                                   (the subtraction,
//               the step (p + h) - (p - h) and the division).
// f''' is estimated from a wider stencil,
//   T3 = [f(p + 2h) - 2 f(p + h) + 2 f(p - h) - f(p - 2h)] / (2 h^3),
// which is 3! times the third divided difference on {p-2h, p-h, p+h, p+2h},
// so T3 = f'''(eta) exactly for some eta in [p - 2h, p + 2h]; its own rounding
// is at most 6 eps / (2 h^3) = 3 eps / h^3. We take |f'''(xi)| <= 2 (|T3| +
// 3 eps / h^3): the factor 2 allows f''' to differ by 100% between two
// points 4h apart, far more than a smooth f does at h ~ 2^-17 (where it
// does change that much, near a zero of f''', the truncation term is
// O(h^3 f'''') and negligible next to the rounding term). So
//   tolerance = h^2 |T3| / 3 + 2 eps / h + 3 u |D|.
// The step minimizes that tolerance, h^2 F / 3 + 2 eps / h, over h:
// h = (3 eps / F)^(1/3), taking F = |f'''| ~ 1 (inputs and logits of order
// one), rounded to a power of two (so p +- h is usually exact), scaled by
// max(1, |p|) and kept within [2^-24, 2^-8]. With the float64 eps of the
// small test problems (~1e-14) that is h ~ 2^-15, where T3's rounding
// (3 eps / h^3 ~ 0.1) is small enough for T3 to mean something.
#include "support/finite_diff.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>

#include "support/tolerance.h"

namespace flce_test {

FiniteDifference central_difference(const std::function<double()>& f, double* param,
                                    double f_error) {
  const double p = *param;
  const double ideal = std::cbrt(3.0 * std::max(f_error, 0x1p-1000));
  const int exponent = std::clamp(int(std::lround(std::log2(ideal))), -24, -8);
  const double h = std::ldexp(1.0, std::ilogb(std::max(1.0, std::fabs(p))) + exponent);
  auto at = [&](double value) {
    *param = value;
    return f();
  };
  const double f_p1 = at(p + h), f_m1 = at(p - h), f_p2 = at(p + 2 * h), f_m2 = at(p - 2 * h);
  *param = p;
  FiniteDifference r;
  r.step = h;
  r.derivative = (f_p1 - f_m1) / ((p + h) - (p - h));
  r.third = (f_p2 - 2 * f_p1 + 2 * f_m1 - f_m2) / (2 * h * h * h);
  r.tolerance = h * h * std::fabs(r.third) / 3 + 2 * f_error / h +
                3 * 0x1p-53 * std::fabs(r.derivative);
  return r;
}

namespace {

// Checks d objective / d values[k] for every k against `analytic`.
::testing::AssertionResult check_all(const char* name, DenseProblem* d, std::vector<double>* values,
                                     const std::vector<double>& analytic,
                                     const std::vector<double>& analytic_bound, double f_error) {
  auto f = [d] { return brute_force_objective(*d); };
  for (size_t k = 0; k < values->size(); ++k) {
    const FiniteDifference fd = central_difference(f, &(*values)[k], f_error);
    const double err = std::fabs(fd.derivative - analytic[k]);
    const double allowed = fd.tolerance + analytic_bound[k];
    if (!(err <= allowed)) {
      std::ostringstream out;
      out.precision(17);
      out << name << "[" << k << "]: analytic " << analytic[k] << ", finite difference "
          << fd.derivative << " (h " << fd.step << ", T3 " << fd.third << "), |diff| " << err
          << " > tolerance " << fd.tolerance << " + analytic bound " << analytic_bound[k];
      return ::testing::AssertionFailure() << out.str();
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace

::testing::AssertionResult gradients_match_finite_differences(const DenseProblem& problem) {
  const BruteForce exact = brute_force(problem);
  const Bounds bounds = error_bounds(problem, exact, Precision::float64());
  const double f_error = bounds.objective;
  DenseProblem d = problem;
  if (d.logits_entry)
    return check_all("grad_logits", &d, &d.logits, exact.grad_logits, bounds.grad_logits, f_error);
  if (auto r = check_all("grad_x", &d, &d.x, exact.grad_x, bounds.grad_x, f_error); !r) return r;
  if (auto r = check_all("grad_w", &d, &d.w, exact.grad_w, bounds.grad_w, f_error); !r) return r;
  if (!d.bias.empty())
    return check_all("grad_bias", &d, &d.bias, exact.grad_bias, bounds.grad_bias, f_error);
  return ::testing::AssertionSuccess();
}

}  // namespace flce_test
