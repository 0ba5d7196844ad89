// Test problems: a small builder for random DenseProblems whose values are
// exactly representable in their storage dtypes, and the code that hands one
// to the library (flce::Problem of host tensors) and reads the outputs back.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "flce/flce.h"
#include "support/brute_force.h"

namespace flce_test {

// The dtypes the library sees.
struct Storage {
  flce::Dtype inputs = flce::Dtype::f64;   // x, w, bias, logits
  flce::Dtype reals = flce::Dtype::f64;    // token/class weights, cotangents
  flce::Dtype labels = flce::Dtype::i64;
  flce::Dtype outputs = flce::Dtype::f64;    // loss, lse, logprob, entropy, zloss
  flce::Dtype gradients = flce::Dtype::f64;  // grad_x, grad_w, grad_bias, grad_logits
  flce::Dtype argmax = flce::Dtype::i64;
};

// v rounded to `dtype` and decoded back (the value the library reads).
double round_to(double v, flce::Dtype dtype);

// A random problem, built step by step:
//   Case::head(4, 8, 16).with_bias().softcap(5).reduction(Reduction::sum)
// Values are drawn when a step asks for them; problem() rounds every array
// to its storage dtype, labels the ignored rows and shapes grad_loss.
class Case {
 public:
  // x ~ U(-1, 1), W ~ U(-1, 1), labels ~ U{0..V-1}.
  static Case head(int64_t n, int64_t h, int64_t v, uint64_t seed = 1);
  // A head shaped like a trained LM's (flce bench --data peaky): x_i0 = 1 and
  // W_j0 = -2 ln(j + 1) give a Zipf(2) prior over classes in frequency
  // order; the other coordinates add a logit noise of standard deviation 1
  // (x ~ U(-1, 1) sqrt 3, W ~ U(-1, 1) sqrt(3 / (h - 1))); labels ~ Zipf(2).
  static Case peaky_head(int64_t n, int64_t h, int64_t v, uint64_t seed = 1);
  // logits ~ U(-4, 4).
  static Case logits(int64_t n, int64_t v, uint64_t seed = 1);

  Case& layout(flce::WeightLayout layout);
  Case& with_bias();
  Case& with_token_weights();   // U(0.25, 2)
  Case& with_class_weights();   // U(0.25, 2)
  Case& with_grad_loss();       // U(-2, 2), 0-D or [N] by the reduction
  Case& with_grad_lse();        // U(-1, 1)
  Case& with_grad_entropy();    // U(-1, 1)
  Case& ignore_rows(std::vector<int64_t> rows);
  Case& reduction(flce::Reduction reduction);
  Case& logit_scale(double a);
  Case& softcap(double k);
  Case& label_smoothing(double e);
  Case& z_loss(double l);
  Case& filter_eps(double eps);                // flce::kFilterEpsAuto for auto
  Case& grad_logits(flce::GradLogitsDtype dtype);
  Case& ignore_index(int64_t index);
  // Scales x (and bias) or the logits so that max |x.W + b| is `m`.
  Case& logit_magnitude(double m);
  Case& stored_as(flce::Dtype inputs);
  Case& outputs_as(flce::Dtype outputs);      // forward outputs and gradients
  Case& gradients_as(flce::Dtype gradients);  // gradients only
  Case& reals_as(flce::Dtype reals);
  Case& labels_as(flce::Dtype labels);

  DenseProblem problem() const;
  const Storage& storage() const { return storage_; }

 private:
  std::vector<double> draw(int64_t count, double lo, double hi);
  DenseProblem dense_;
  Storage storage_;
  std::mt19937_64 rng_;
  std::vector<int64_t> ignored_;
  bool grad_loss_ = false;
  double grad_loss_scalar_ = 0;
  std::vector<double> grad_loss_rows_;
  double magnitude_ = 0;
};

// What the library wrote, decoded to doubles (absent outputs stay empty).
struct Outputs {
  flce::Status status;
  std::vector<double> loss, lse, logprob, entropy, zloss;
  std::vector<int64_t> argmax;
  std::vector<double> grad_x, grad_w, grad_bias, grad_logits;
};

// How run_library lays out the arrays it hands to the library.
enum class Views {
  contiguous,
  // Every size-1 dimension's stride 0 (torch's expand; a [1, H] `t()` view
  // has [1, 1]): strides that address nothing, which a GEMM cannot take as
  // its leading dimension.
  size_one_stride_0,
  // x and W as views whose rows overlap (strides [1, 1] over r + c - 1
  // values): the problem's x and W must be Hankel (make_hankel_inputs).
  overlapping_rows,
  // Every 2-D array (x, W, logits, grad_x, grad_W, grad_logits) the rows of
  // a wider one (row stride cols + kRowPadding), as a slice of a padded
  // buffer is: the padding, NaN bytes (0xFF), must be neither read into a
  // result nor written (run_library fails the test if a byte changes).
  padded_rows,
};
constexpr int64_t kRowPadding = 5;

// Rewrites x and W (a head problem) as Hankel matrices, a[i][c] = b[i + c],
// from values they hold, so that Views::overlapping_rows can store them.
void make_hankel_inputs(DenseProblem* d);

// Which of a head's gradients a call asks for (all by default; a frozen
// head asks grad_x alone, a frozen trunk grad_w and grad_bias).
struct GradientSet {
  bool x = true, w = true, bias = true;
};

struct Request {
  flce::Pass pass = flce::Pass::loss_and_grad;
  Views views = Views::contiguous;
  flce::RunConfig config;
  std::vector<double> saved_lse;  // backward(): the lse forward() wrote
  bool in_place = false;          // grad_logits over the logits
  bool per_row_outputs = true;    // logprob, argmax, entropy, zloss
  bool argmax = true;             // with per_row_outputs: argmax too
  bool gradients = true;          // grad_x, grad_w, grad_bias / grad_logits
  GradientSet head_gradients;     // with gradients, of a head: which ones
  int device = 0;                 // backend "cuda": the GPU that holds the copies
  bool call_on_new_thread = false;  // the library call (not the copies) on a thread of its own
};

// Stores `problem` as `storage` says, calls flce::forward/backward/
// loss_and_grad, and reads every output back. Outputs start as NaN (-7 for
// argmax) so that one left unwritten shows.
Outputs run_library(const DenseProblem& problem, const Storage& storage, const Request& request);

}  // namespace flce_test
