// A generated problem for timing (x ~ N(0,1), W ~ N(0, 4/H), uniform labels),
// its flce::Problem for each pass, and the logits GEMM of the same shape
// timed the way the cpu backend runs GEMMs. Shared by `flce bench` and the
// Google Benchmark binary in bench/.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu/gemm/gemm.h"
#include "flce/flce.h"

namespace flce::cli {

class BenchProblem {
 public:
  BenchProblem(int64_t n, int64_t h, int64_t v, Dtype dtype, Options options);

  // The problem of `pass`: loss and lse for forward, gradients (in the
  // storage dtype, as a training step keeps them) for backward and step.
  // Backward reads the lse a forward run wrote: call forward first.
  Problem problem(Pass pass);

  int64_t n, h, v;
  Dtype dtype;
  const void* x() const;
  const void* w() const;

 private:
  Options options_;
  std::vector<float> x32_, w32_;
  std::vector<uint16_t> x16_, w16_;
  std::vector<int64_t> labels_;
  std::vector<float> lse_;
  float loss_ = 0;
  std::vector<char> grad_x_, grad_w_;
};

// Seconds for U[N, V] = X W^T with `engine` (which must support `dtype`),
// in vocab blocks of 2048 over `threads` OpenMP threads, one single-threaded
// engine call per block: the fastest way the cpu backend could run it.
double logits_gemm_seconds(const cpu::GemmEngine& engine, const BenchProblem& p, int threads);

// The engine the cpu backend picks for this dtype, or the named one.
const cpu::GemmEngine* bench_engine(Dtype dtype, const std::string& name);

}  // namespace flce::cli
