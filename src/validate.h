// Validation of a Problem, done once in front of every backend (src/api.cpp).
// Backends receive only problems that passed: they check what is theirs to
// decline (dtypes, devices they do not handle), never the problem's sense.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "flce/flce.h"

namespace flce {

// The sizes of a validated problem.
struct Dims {
  int64_t n = 0;  // rows (tokens)
  int64_t h = 0;  // hidden size; 0 for the logits-level entry
  int64_t v = 0;  // classes
  bool logits_entry = false;
};

// Returns "" when `problem` is a valid request for `pass`, else one message
// that starts with the argument's name and gives the offending value.
std::string validate(const Problem& problem, Pass pass, Dims* dims);

// validate()'s first checks, which need no outputs: the inputs' shapes and
// dtypes (setting *dims), and the options. For a caller that sizes its
// outputs from the inputs (`flce run`), so that a bad input is named before
// its outputs are allocated; validate() still checks the whole problem.
std::string validate_inputs(const Problem& problem, Dims* dims);

// "" unless the first `bytes` of a caller's `workspace` overlap a tensor the
// call reads or writes (the backend overwrites them); checked once the
// backend, hence the bytes it uses, is known.
std::string check_workspace_aliasing(const Problem& problem, Pass pass, const void* workspace,
                                     size_t bytes);

// The most threads a call may ask for.
constexpr int kMaxThreads = 4096;

// Checks the RunConfig's own values (threads); "" or the error.
std::string validate_config(const RunConfig& config);

// One tensor of a problem: its name, a pointer to it, and whether a call
// writes it (outputs and gradients) rather than reads it.
template <class T>
struct NamedTensor {
  const char* name;
  T* tensor;
  bool written;
};

// Every tensor of a problem (const or not), in the order flce.h declares
// them.
template <class P>
auto tensors_of(P& p) {
  using T = std::remove_pointer_t<decltype(&p.x)>;
  return std::array<NamedTensor<T>, 20>{{
      {"x", &p.x, false}, {"w", &p.w, false}, {"bias", &p.bias, false},
      {"logits", &p.logits, false}, {"labels", &p.labels, false},
      {"token_weights", &p.token_weights, false}, {"class_weights", &p.class_weights, false},
      {"loss", &p.loss, true}, {"lse", &p.lse, true}, {"logprob", &p.logprob, true},
      {"argmax", &p.argmax, true}, {"entropy", &p.entropy, true}, {"zloss", &p.zloss, true},
      {"grad_loss", &p.grad_loss, false}, {"grad_lse", &p.grad_lse, false},
      {"grad_entropy", &p.grad_entropy, false}, {"grad_x", &p.grad_x, true},
      {"grad_w", &p.grad_w, true}, {"grad_bias", &p.grad_bias, true},
      {"grad_logits", &p.grad_logits, true}}};
}

// The problem with every size-1 dimension's stride (which addresses nothing,
// so validate() takes any value) set to a contiguous tensor's: a [1, H]
// view of torch's `t()` has strides [1, 1], and backends pass stride[0] on
// as a GEMM's leading dimension, which must be >= H. Done once in front of
// every backend (src/api.cpp).
Problem with_canonical_strides(const Problem& problem);

// Dims of a problem already validated.
Dims dims_of(const Problem& problem);

// W seen as [V, H] whatever its layout (a view, no copy); likewise grad_w.
Tensor w_as_vh(const Tensor& w, WeightLayout layout);

}  // namespace flce
