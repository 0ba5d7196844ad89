// The brute-force oracle of the tests: the README's semantics written out in
// float64 with the [N, V] logits materialized. It is the only code in the
// project allowed O(N * V) memory, and it shares no code with the library, so
// that a mistake in src/ cannot hide behind the same mistake here.
#pragma once

#include <cstdint>
#include <vector>

#include "flce/flce.h"

namespace flce_test {

// A problem in host memory, every value an exact double: what the library
// reads after its storage dtype is decoded. Empty optional vectors mean the
// argument is absent (ones for weights and grad_loss, zeros for grad_lse and
// grad_entropy).
struct DenseProblem {
  int64_t n = 0, h = 0, v = 0;
  bool logits_entry = false;
  std::vector<double> x;       // [n, h]          (head entry)
  std::vector<double> w;       // [v, h] or [h, v] (head entry)
  flce::WeightLayout w_layout = flce::WeightLayout::vh;
  std::vector<double> bias;    // [v] or empty    (head entry)
  std::vector<double> logits;  // [n, v]          (logits entry)
  std::vector<int64_t> labels;        // [n]
  std::vector<double> token_weights;  // [n] or empty
  std::vector<double> class_weights;  // [v] or empty
  flce::Options options;
  std::vector<double> grad_loss;     // [1] (sum, mean), [n] (none) or empty
  std::vector<double> grad_lse;      // [n] or empty
  std::vector<double> grad_entropy;  // [n] or empty

  double weight(int64_t j, int64_t k) const;  // W_jk (class j, hidden k), any layout
  int64_t w_index(int64_t j, int64_t k) const;  // position of W_jk in `w`
  double token_weight(int64_t i) const;
  double class_weight(int64_t j) const;
  bool ignored(int64_t i) const { return labels[i] == options.ignore_index; }
};

// Every forward output and every gradient of one problem.
struct BruteForce {
  // [n, v], row-major.
  std::vector<double> z;         // a * (x_i . W_j + b_j), or a * logits_ij
  std::vector<double> s;         // softcapped logits (= z when softcap is off)
  std::vector<double> p;         // softmax of s
  std::vector<double> logp;      // s - lse
  std::vector<double> grad_s;    // d objective / d s_ij
  std::vector<double> dlogits;   // d objective / d (x_i . W_j + b_j) or / d logits_ij

  // [n].
  std::vector<double> lse, logprob, entropy, zloss;
  std::vector<int64_t> argmax;
  std::vector<double> mean_s;     // mu_i = sum_j p_ij s_ij
  std::vector<double> loss_rows;  // loss_i, 0 for ignored rows
  std::vector<double> ce;         // ce_i, 0 for ignored rows
  std::vector<double> loss_coef;  // r_i = d objective / d loss_i (0 for ignored rows)

  std::vector<double> loss;  // [n] for reduction none, [1] for sum and mean
  double denominator = 0;    // D = sum over kept rows of t_i * c_{y_i}
  double objective = 0;      // the scalar that backward differentiates

  std::vector<double> grad_x;       // [n, h]
  std::vector<double> grad_w;       // w's shape and layout
  std::vector<double> grad_bias;    // [v] when the problem has a bias
  std::vector<double> grad_logits;  // [n, v] for the logits entry
};

// Computes every output of `problem`. Non-finite inputs propagate the IEEE
// way, except that a class with p = 0 and s = -inf contributes 0 (the limit)
// to sums of p * s.
BruteForce brute_force(const DenseProblem& problem);

// The same loops computed in float32 (inputs must be float32 values): a
// plain same-precision implementation, used to check that the tolerance
// policy's float32 bounds hold for it.
BruteForce brute_force_float32(const DenseProblem& problem);

// Only the objective (sum of grad_loss * loss + grad_lse . lse +
// grad_entropy . entropy), for finite differences.
double brute_force_objective(const DenseProblem& problem);

}  // namespace flce_test
