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
// outputs the call asks for, `grads` which of a head's gradients; `views`
// lays the arrays out (random_problem.h).
void expect_agreement(const DenseProblem& d, const Storage& st, flce::Pass pass,
                      const flce::RunConfig& config, Precision precision, bool in_place = false,
                      WeightGradients judge = WeightGradients::elementwise,
                      RowOutputs rows = RowOutputs::all,
                      Views views = Views::contiguous, GradientSet grads = {});

// The policy for a float32 backend (cpu, cuda): f32 accumulation and logits,
// outputs rounded to their storage, dlogits cast to the storage dtype when
// grad_logits_dtype = storage.
Precision float32_precision(const DenseProblem& d, const Storage& st);

// Every output of a and b bit for bit (NaN equals NaN).
void expect_identical_outputs(const Outputs& a, const Outputs& b);

// Logits moved by a common offset that keeps every difference to the row's
// max exact: sets *d's logits on a grid of 1/8 within 8 of 0, or for a head
// (with a bias, H <= 64) x in {0, +-1/8}, W in {-4, ..., 4} and b = 0, so
// that every product and sum is exact; *moved is the same problem with 2^20
// added to every logit (to the bias for a head). Differences of two such
// logits are exact in float32 (Sterbenz), so a backend that forms the
// entropy from differences to the max, as the oracle does, sums the same
// terms for both. (From unshifted scores, lse - sum_j p_j s_j, the entropy
// moves by about u_f32 2^20 = 0.06.)
void offset_pair(DenseProblem* d, DenseProblem* moved, uint64_t seed);

// How a backend's exponentials see the offset: the same f32 arguments
// e^(s - max) (the cpu kernels subtract first: exact here), or arguments
// rounded at the offset's size (the cuda kernels' s log2(e) less the max's
// in one FMA), which moves each e_j by up to 2 u |s_j - max| relative.
enum class ExpArguments { exact_differences, rounded_at_the_offset };

// The entropies `config`'s backend gives d and moved, forward and in a
// step, agree to what the offset leaves: in double, lse's own rounding (u
// |lse| in its sum and in its difference to the max, in either call) moves
// lse - max by as much and every tile's weight e^(max_t - lse) by as much
// relative, so the entropy by 4 u |lse| (1 + |sbar_d|), sbar_d = sum_j p_j
// (s_j - max); then the entropy's own rounding. With rounded_at_the_offset also,
// in each call, e_j's relative error delta_j <= kappa u + 2 u |d_j| (float32
// u; d_j = s_j - max) moving the entropy by sum_j p_j delta_j (1 + |d_j -
// sbar_d|), and the float32 sums, no longer of the same terms: gamma_V (1 +
// 2 sum_j p_j |d_j|). The unmoved entropies are also judged against the
// oracle by the float32 policy (a mistake both calls share would pass the
// comparison of the two).
void expect_entropy_ignores_offset(const DenseProblem& d, const DenseProblem& moved,
                                   const Storage& st, const flce::RunConfig& config,
                                   ExpArguments exps = ExpArguments::exact_differences);

// Rows whose logits all hold one value far from 0 (-1e30 and the lowest
// float, masks; -1e17 and 1e17), and one of 1e8 and 1e8 - 8 by turns (its
// float32 lse is 1e8 + 8, not its max), through `config`'s backend in a
// forward pass, a step and a backward from the forward's float32 lse
// (reduction none, g_lse = 1/2, g_ent = 1/4; with an entropy cotangent
// every backend runs the first pass again). The semantics give p_ij = 1/V
// in a row of one value, as for any common value (README, Semantics),
// though lse rounds to the logit itself, whose ulp dwarfs log V: lse is the
// logit, the loss and entropy log V, and G_ij = (1 + g_lse)/V - [j = y_i];
// with p as e^(s_ij - lse32), p_ij was 1 and a G row summed to about V.
// The policy's bounds say nothing at such logits (its u |lse| terms exceed
// 1, or overflow to NaN), so the rows are held to exact values computed
// from d_ij = s_ij - max (exact here), with what a backend forming p, logp
// and the entropy from d_ij and lse_d = log sum_j e^(d_ij) leaves: its
// float32 sums and exponentials (`sums` = kFunctionUlps u + gamma_V) and
// the outputs' float32 rounding; G within the kernels' exponential and its
// argument's rounding, and two float32 roundings (the code says which).
// The logits entry (float32) checks G itself; the head entry (`inputs`;
// x_i = (z_i, -8 on the 1e8 row, 0, ...), W_j = (1, j odd, 0, ...), H =
// 16, so the logits are exact) checks grad_x_ik = sum_j G_ij W_jk: G's
// errors, its rounding to `inputs` where the backend multiplies in that
// dtype (u_in |G_ij|), and the GEMM's float32 sum (gamma_V sum_j |G_ij|).
enum class MaskedRowsEntry { logits, head };
void expect_rows_masked_whole_are_uniform(const flce::RunConfig& config, int64_t v,
                                          MaskedRowsEntry entry = MaskedRowsEntry::logits,
                                          flce::Dtype inputs = flce::Dtype::f32);

}  // namespace flce_test
