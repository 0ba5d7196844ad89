// Validation of a Problem, done once in front of every backend (src/api.cpp).
// Backends receive only problems that passed: they check what is theirs to
// decline (dtypes, devices they do not handle), never the problem's sense.
#pragma once

#include <cstdint>
#include <string>

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

// The most threads a call may ask for.
constexpr int kMaxThreads = 4096;

// Checks the RunConfig's own values (threads); "" or the error.
std::string validate_config(const RunConfig& config);

// Dims of a problem already validated.
Dims dims_of(const Problem& problem);

// W seen as [V, H] whatever its layout (a view, no copy); likewise grad_w.
Tensor w_as_vh(const Tensor& w, WeightLayout layout);

}  // namespace flce
