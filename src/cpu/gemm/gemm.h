// cpu/gemm: one f32-output GEMM behind an interface, with an engine per
// library (OpenBLAS, oneDNN, Eigen) chosen at build time by gemm.cmake.
//
// The cpu backend computes the LM-head logits tile by tile and feeds the
// backward's two products through here. It parallelizes over tiles itself, so
// an engine call is always single-threaded: it runs on the calling thread,
// starts no threads, and may be called from several threads at once (each
// with its own C). See gemm.cpp for the measurements behind the default.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "flce/tensor.h"

namespace flce::cpu {

// C[m, n] = beta * C + op(A)[m, k] * op(B)[k, n], all row-major.
//
// A and B share one dtype: Dtype::f32 (float) or Dtype::bf16 (the 16 bits as
// uint16_t); C is always f32. op(A) = A when !trans_a, so A is stored as
// [m, k] with lda >= k; op(A) = A^T when trans_a, so A is stored as [k, m]
// with lda >= m. Likewise B: [k, n] with ldb >= n, or [n, k] with ldb >= k
// when trans_b. C is [m, n] with ldc >= n. Leading dimensions are in
// elements, so a sub-matrix of a larger array is passed by pointer plus the
// larger array's row length.
//
// beta == 0 means C is write-only: whatever it held (NaN included) is
// ignored, as in BLAS. k == 0 gives C = beta * C; m == 0 or n == 0 touches
// nothing. Only the m x n elements of C are written, never the padding
// between n and ldc.
struct GemmArgs {
  int64_t m = 0, n = 0, k = 0;
  Dtype ab_dtype = Dtype::f32;
  const void* a = nullptr;
  int64_t lda = 0;
  bool trans_a = false;
  const void* b = nullptr;
  int64_t ldb = 0;
  bool trans_b = false;
  float* c = nullptr;
  int64_t ldc = 0;
  float beta = 0.0f;
  // b holds B as GemmEngine::pack_b wrote it for calls of this shape (ldb
  // and trans_b then describe the B that was packed), not a plain matrix.
  bool b_packed = false;
};

class GemmEngine {
 public:
  virtual ~GemmEngine() = default;
  // "openblas", "onednn", "eigen".
  virtual const char* name() const = 0;
  // One line for logs and `flce backends`: library, version, what it picked
  // on this CPU (e.g. "openblas 0.3.21 (Haswell kernels)").
  virtual std::string describe() const { return name(); }
  // Whether run() accepts A and B of this dtype natively. Only f32 and bf16
  // are ever asked; for an engine without bf16 the caller converts to f32.
  virtual bool supports(Dtype ab_dtype) const = 0;
  // Whether its bf16 products run on a matrix unit (Intel AMX): then they
  // are several times faster than any AVX-512 kernel of flce's own, short
  // k included, and the cpu backend gives them every bf16 product
  // (Plan::grad_w_gemm_tn).
  virtual bool bf16_on_matrix_unit() const { return false; }
  // B packed once for many products that share it (grad_W's x block, the B
  // of every vocab tile's product): a library that first reorders B into a
  // layout of its own (oneDNN's blocked pairs for AMX) does it once, not in
  // every call. packed_b_bytes is the size of B packed for calls of the
  // shape of `g` (every field but the pointers and beta), or 0 where the
  // engine does not pack for that shape; pack_b writes g.b there.
  virtual size_t packed_b_bytes(const GemmArgs& /*g*/) const { return 0; }
  virtual void pack_b(const GemmArgs& g, void* packed) const;
  // Runs on the calling thread only (no threads of its own, also when called
  // outside any OpenMP parallel region), and is safe to call concurrently
  // from several threads with different C. The same call gives bitwise the
  // same result wherever it runs. Throws std::invalid_argument for arguments
  // that break the contract above (a dtype it does not support, a leading
  // dimension too small): those are bugs in the caller, never data errors.
  virtual void run(const GemmArgs& args) const = 0;
  // Held on the calling thread around a call's GEMMs (the cpu backend's
  // run; calls may overlap): an engine whose library keeps a process-wide
  // thread count that other code may change (OpenBLAS's, which numpy
  // shares) sets it to what run() needs while any call holds it, then
  // restores the caller's. Null where the engine keeps no such state.
  virtual std::shared_ptr<void> hold_for_calls() const { return nullptr; }
};

// The engines compiled in, in order of preference (the f32 default first).
// Eigen is always there.
const std::vector<const GemmEngine*>& gemm_engines();
// nullptr if no engine of that name is compiled in.
const GemmEngine* find_gemm_engine(const std::string& name);
// The measured-best engine, among those compiled in, that supports A and B of
// this dtype natively; nullptr when none does (bf16 without oneDNN, or on a
// CPU where oneDNN has no bf16 kernels): the caller then converts to f32 and
// uses default_gemm_engine(Dtype::f32), which is never nullptr.
const GemmEngine* default_gemm_engine(Dtype ab_dtype);

// Tests only: default_gemm_engine(Dtype::bf16) returns `engine` from now on
// (nullptr: the compiled-in choice again). A plan keeps the engine it was
// made with, so set it before the runs that should use it, never while
// another thread makes a plan. tests/support/kernels_for_testing.cpp sets
// a bf16 engine that widens to f32 where no engine here has bf16.
void set_bf16_gemm_engine_for_testing(const GemmEngine* engine);

namespace gemm_detail {
// Shared by the engines: throws std::invalid_argument, naming `engine`,
// unless the sizes, leading dimensions and pointers in `args` are consistent.
// (Each engine checks the dtype against its own supports().)
void check_args(const GemmArgs& args, const char* engine);
// Handles m == 0, n == 0 or k == 0 (C = beta * C, by the BLAS rule for
// beta == 0). Returns true when it did, so the engine has nothing left to do.
bool run_degenerate(const GemmArgs& args);
}  // namespace gemm_detail

}  // namespace flce::cpu
