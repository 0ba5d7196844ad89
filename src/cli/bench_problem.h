// A generated problem for timing, its flce::Problem for each pass, and the
// logits GEMM of the same shape timed the way the cpu backend runs GEMMs.
// Shared by `flce bench` and the Google Benchmark binary in bench/.
//
// Two kinds of data:
// - gaussian: x ~ N(0, 1), W ~ N(0, 4/H), uniform labels. Every class gets
//   some probability: what a head looks like before training.
// - peaky: a head shaped like a trained LM's. Token ids are in frequency
//   order (as BPE vocabularies roughly are) and the logits are a Zipf prior
//   plus context: x_i0 = 1 and W_j0 = -2 ln(j + 1) give p_j ~ (j + 1)^-2, the
//   other H - 1 coordinates are N(0, 1) in x and N(0, 1/(H - 1)) in W (a
//   per-row, per-class logit noise of standard deviation 1), and labels
//   are drawn from the Zipf(2) prior. Most of the probability sits in the
//   first few hundred classes, so the gradient filter skips most blocks.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu/gemm/gemm.h"
#include "flce/flce.h"

namespace flce::cli {

enum class BenchData { gaussian, peaky };

class BenchProblem {
 public:
  // grad_dtype: the dtype of grad_x and grad_W, the storage dtype (a pure
  // bf16 step) or f32 (mixed precision: f32 master weights and their grads).
  BenchProblem(int64_t n, int64_t h, int64_t v, Dtype dtype, Options options,
               BenchData data, Dtype grad_dtype);

  // The problem of `pass`: loss and lse for forward, gradients for backward
  // and step (allocated by the first such call: a forward-only benchmark
  // holds none). Backward reads the lse a forward run wrote: call forward
  // first.
  Problem problem(Pass pass);

  int64_t n, h, v;
  Dtype dtype, grad_dtype;
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

// How logits_gemm_seconds cuts U[N, V]: row_blocks x col_blocks blocks of
// rows x cols (at most 4096 x 2048; the last row and column of blocks a
// little smaller), col_blocks planned as a multiple of the thread count
// (unless blocks would be narrower than 64 classes; rounding the width up
// can leave it a few short at many threads: V = 6145 at 96 threads makes
// 95), so that the static
// schedule gives each thread about the same share. Blocks of exactly 4096 x 2048 gave one of two
// threads 13 of S1's 25 (4096 x 768 x 50257): 6% more than half, so the
// reference was slow and the ratios to it low.
struct LogitsGemmBlocks {
  int64_t rows = 0, cols = 0, row_blocks = 0, col_blocks = 0;
};
LogitsGemmBlocks logits_gemm_blocks(int64_t n, int64_t v, int threads);

// Seconds for U[N, V] = X W^T with `engine` (which must support `dtype`),
// in the blocks above over `threads` OpenMP threads, one single-threaded
// engine call per block into a buffer of at most 32 MiB per thread: the
// fastest way the cpu backend could run it, in bounded memory.
double logits_gemm_seconds(const cpu::GemmEngine& engine, const BenchProblem& p, int threads);

// The median of timings (at least one): the mean of the middle two of an
// even count.
double median(std::vector<double> seconds);

// forward, backward or loss_and_grad, by `pass`.
Status call_pass(const Problem& p, Pass pass, const RunConfig& config);

// Peak resident memory over a stretch of code, from Linux's VmHWM after
// resetting it (/proc/self/clear_refs). Memory first touched before reset()
// (inputs, outputs, gradients, all touched by a warm-up call) is not
// counted; what a call allocates and touches is, scratch of the GEMM
// libraries included. Falls back to getrusage's lifetime peak, which can
// only under-report, where clear_refs is not writable.
class PeakMemory {
 public:
  void reset();
  long extra_bytes() const;  // peak since reset() minus the resident size at reset()

 private:
  long base_ = 0;
  bool hwm_ = false;
};

// The process's peak resident memory since it started (getrusage).
long process_peak_rss_bytes();

// The process's resident memory now (/proc/self/status's VmRSS); -1 where
// that file has none.
long process_rss_bytes();

// The engine the cpu backend picks for this dtype, or the named one.
const cpu::GemmEngine* bench_engine(Dtype dtype, const std::string& name);

}  // namespace flce::cli
