// flce/flce.h: fused linear cross-entropy, the public API.
//
// One flat Problem struct names every input, output and cotangent; the
// README's "Semantics" section defines every number it produces. A call
// validates the problem once, then hands it to the first backend in the
// ordered list (cpu, reference, ...) that accepts it, or to the one the
// caller names. The [N, V] logits are never materialized.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "flce/tensor.h"

namespace flce {

enum class Reduction : int { none, sum, mean };

// How the head weight is stored: [V, H] is PyTorch's lm_head.weight.
enum class WeightLayout : int { vh, hv };

// The dtype dlogits are cast to before the two gradient GEMMs: f32 (exact
// to f32), or the storage dtype of x and W (faster with bf16 GEMMs, less
// precise; what GPU kernels do). The reference backend always uses float64.
enum class GradLogitsDtype : int { f32, storage };

// Options::filter_eps value meaning "the storage dtype's machine epsilon / 32"
// (2^-12 for bf16, 2^-15 for f16, 2^-28 for f32), as Cut Cross-Entropy sets it.
constexpr double kFilterEpsAuto = -1.0;

// The scalar options of the loss (README, "Semantics").
struct Options {
  double logit_scale = 1.0;      // a > 0:  z = a * (x . W_j + b_j)
  double softcap = 0.0;          // k >= 0: s = k * tanh(z / k); 0 = off
  int64_t ignore_index = -100;   // rows with this label contribute no loss
  double label_smoothing = 0.0;  // e in [0, 1]
  double z_loss = 0.0;           // l >= 0: adds l * lse^2 per row
  Reduction reduction = Reduction::mean;
  GradLogitsDtype grad_logits_dtype = GradLogitsDtype::f32;
  // Gradient filtering, opt-in (README, "Gradient filtering"): a backend may
  // leave a [row block x vocab tile] block of dlogits out of the grad_x and
  // grad_W GEMMs when every entry has |G_ij| <= filter_eps * kappa_i. 0 = off
  // (exact); kFilterEpsAuto = the storage dtype's epsilon / 32.
  double filter_eps = 0.0;
};

// Everything a backend reads. Shapes use N rows (tokens), H hidden units and
// V classes. Absent tensors (ndim == -1) are optional arguments not given or
// outputs not wanted. Which fields each call reads or writes is listed at the
// calls below.
struct Problem {
  // Inputs: the head (x, w, optional bias) or, for the logits-level entry,
  // the logits (then x, w and bias are absent).
  Tensor x;                                // [N, H]   f32 | bf16 | f16 | f64
  Tensor w;                                // [V, H] (vh) or [H, V] (hv)
  WeightLayout w_layout = WeightLayout::vh;
  Tensor bias;                             // [V]
  Tensor logits;                           // [N, V]   (logits-level entry)
  Tensor labels;                           // [N]      i32 | i64
  Tensor token_weights;                    // [N]      f32 | f64, >= 0
  Tensor class_weights;                    // [V]      f32 | f64, >= 0
  Options options;

  // Forward outputs, f32 or f64 (int64 or int32 for argmax).
  Tensor loss;     // [N] for reduction none, 0-D for sum and mean
  Tensor lse;      // [N] log-sum-exp; an input to backward
  Tensor logprob;  // [N] log p of the label; 0 for ignored rows
  Tensor argmax;   // [N] argmax_j s_ij, lowest index on ties
  Tensor entropy;  // [N] H_i = lse_i - sum_j p_ij s_ij
  Tensor zloss;    // [N] l * lse_i^2

  // Cotangents. Absent grad_loss means ones; absent grad_lse and
  // grad_entropy mean zeros.
  Tensor grad_loss;     // 0-D for sum and mean, [N] for none
  Tensor grad_lse;      // [N]
  Tensor grad_entropy;  // [N]

  // Gradient outputs: f32, f64 or the input's dtype.
  Tensor grad_x;       // [N, H]
  Tensor grad_w;       // w's shape, so w's layout
  Tensor grad_bias;    // [V]
  Tensor grad_logits;  // [N, V]; may be exactly `logits` (written in place)
};

// How to run a problem, as opposed to what it is.
struct RunConfig {
  // Force a backend by name. Empty: the FLCE_BACKEND environment variable if
  // set, else the first backend in the list that accepts the problem.
  std::string backend;
  int threads = 0;  // CPU threads; 0 = the backend's default
  // Force the cpu backend's GEMM engine ("openblas", "onednn", "eigen");
  // empty: the measured default for the dtype.
  std::string gemm;
  // Opaque stream handle (a cudaStream_t for a CUDA backend; ignored on CPU).
  void* stream = nullptr;
  // Optional caller-owned scratch of at least workspace_size() bytes, in the
  // memory of the tensors' device (host memory for cpu and reference, device
  // memory for cuda), overlapping no tensor of the call (refused: the backend
  // overwrites it). When null the backend allocates what it needs for the
  // duration of the call.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// What a backend reports about the work of one call (zeros where a backend
// does not do that work).
struct RunStats {
  // Gradient filtering (Options::filter_eps): the [row block x vocab tile]
  // blocks of dlogits the call formed, and how many of them it left out of
  // the grad_x and grad_W GEMMs.
  int64_t grad_blocks = 0;
  int64_t grad_blocks_skipped = 0;
};

// The outcome of a call: ok() or an error message that names the argument
// and the offending value; `backend` says which backend ran (or was chosen).
struct Status {
  std::string error;
  std::string backend;
  RunStats stats;
  // With no backend named (RunConfig::backend, FLCE_BACKEND): those tried
  // before `backend` that declined, each with why ("cpu: ...; ..."), so a
  // caller can say why the call ran where it did; empty otherwise and on
  // an error.
  std::string declined;
  bool ok() const { return error.empty(); }
};

// Which work a call asks for.
enum class Pass : int { forward, backward, loss_and_grad };
const char* pass_name(Pass pass);

// forward: reads the inputs and options; writes loss and lse (required) and
// logprob, argmax, entropy, zloss where present.
Status forward(const Problem& problem, const RunConfig& config = {});

// backward: reads the inputs, options, lse (as saved by forward) and the
// cotangents; writes grad_x, grad_w, grad_bias (or grad_logits) where
// present. loss and the other forward outputs must be absent.
Status backward(const Problem& problem, const RunConfig& config = {});

// loss_and_grad: a training step in one call, forward then backward without
// a second pass over the inputs; writes loss and lse (required), at least
// one gradient, and every other present output.
Status loss_and_grad(const Problem& problem, const RunConfig& config = {});

// The scratch bytes the chosen backend needs for `pass` (beyond the outputs).
Status workspace_size(const Problem& problem, Pass pass, const RunConfig& config,
                      size_t* bytes);

// The backends in the order they are tried.
struct BackendInfo {
  std::string name;
  std::string description;  // what it is and, for cpu, what it picked here
};
std::vector<BackendInfo> list_backends();

const char* version();

}  // namespace flce
