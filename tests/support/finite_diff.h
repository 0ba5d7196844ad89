// Central finite differences of the brute-force objective, to check the
// brute force's analytic gradients (and, through them, every backend's).
#pragma once

#include <functional>

#include <gtest/gtest.h>

#include "support/brute_force.h"

namespace flce_test {

struct FiniteDifference {
  double derivative = 0;  // (f(p + h) - f(p - h)) / (2h)
  double third = 0;       // T3, the estimate of f''' (see finite_diff.cpp)
  double tolerance = 0;   // bound on |derivative - f'(p)|
  double step = 0;        // h
};

// The central difference of `f` in `*param` (changed during the call and
// restored), when each evaluation of f is within `f_error` of its exact value.
FiniteDifference central_difference(const std::function<double()>& f, double* param,
                                    double f_error);

// Every gradient brute_force() returns for `problem` (grad_x, grad_w and
// grad_bias, or grad_logits) against central differences of the objective:
// |analytic - fd| <= fd tolerance + the policy's float64 bound on the
// analytic value.
::testing::AssertionResult gradients_match_finite_differences(const DenseProblem& problem);

}  // namespace flce_test
