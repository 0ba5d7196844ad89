// src/cuda/passes.h: the two passes of the `cuda` backend over a problem
// (internal). All work is queued on the call's stream, in a fixed order.
#pragma once

#include <string>

#include "cuda/kernels.h"
#include "cuda/plan.h"

namespace flce::cuda {

struct Context {
  const Problem& p;
  const Plan& plan;
  const Workspace& ws;
  LossArgs args;
  cudaStream_t stream;
};

// Pass 1: every score tile once; tile states, then per-row outputs and
// RowInfo (lse, the dlogits coefficients). Without states (backward with no
// grad_entropy) only the RowInfo, from the saved lse.
std::string statistics_pass(const Context& c);

// Pass 2: score tiles again, dlogits into gradient blocks, the two gradient
// GEMMs per block, grad_bias; then the gradients in their output dtypes.
std::string gradient_pass(const Context& c);

}  // namespace flce::cuda
