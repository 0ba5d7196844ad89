// One backend's outputs against the brute force, judged by the tolerance
// policy: the check every backend test (reference, cpu, ...) is built from.
#pragma once

#include <string>

#include "flce/flce.h"
#include "support/brute_force.h"
#include "support/random_problem.h"
#include "support/tolerance.h"

namespace flce_test {

// How grad_x and grad_W are judged: elementwise (every backend, exact
// semantics), or norm-wise (within_bounds_normwise) for gradient filtering,
// which drops terms by design. Everything else is always elementwise.
enum class WeightGradients { elementwise, normwise };

// The per-row outputs a call asks for besides loss and lse. A backend may
// take another path for fewer: with no argmax the cuda backend's fused pass
// 1 shifts by the softcap; with neither entropy nor argmax (a training
// step, as flce.torch calls it) it keeps no sum of p s at all, and its G
// takes the plain forms.
enum class RowOutputs {
  all,             // logprob, argmax, entropy, zloss
  all_but_argmax,  // logprob, entropy, zloss
  none,            // loss and lse alone
};

// Runs `pass` with `config` (for backward: after a forward() whose stored
// lse it reads, adding that storage's roundoff to the policy) and checks
// every output written against the brute force under `precision`. Expects
// the backend `config.backend` to have run. `rows` says which per-row
// outputs the call asks for; `views` lays the arrays out (random_problem.h).
void expect_agreement(const DenseProblem& d, const Storage& st, flce::Pass pass,
                      const flce::RunConfig& config, Precision precision, bool in_place = false,
                      WeightGradients judge = WeightGradients::elementwise,
                      RowOutputs rows = RowOutputs::all,
                      Views views = Views::contiguous);

// The policy for a float32 backend (cpu, cuda): f32 accumulation and logits,
// outputs rounded to their storage, dlogits cast to the storage dtype when
// grad_logits_dtype = storage.
Precision float32_precision(const DenseProblem& d, const Storage& st);

// Every output of a and b bit for bit (NaN equals NaN).
void expect_identical_outputs(const Outputs& a, const Outputs& b);

}  // namespace flce_test
