// src/cuda/gemm.h: the `cuda` backend's GEMMs, row-major, through cuBLAS.
#pragma once

#include <cstdint>
#include <string>

#include "flce/tensor.h"

typedef struct CUstream_st* cudaStream_t;

namespace flce::cuda {

// C[m, n] = op(A)[m, k] op(B)[k, n] + beta C, every matrix row-major with its
// leading dimension (elements between rows). op(A) = A, stored [m, k], or
// A^T with A stored [k, m] (trans_a); likewise B. A and B share `ab`
// (f32, bf16 or f16); C is f32 or `ab`. Accumulation is always f32 (no TF32).
struct Gemm {
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  bool trans_a = false;
  const void* b = nullptr;
  int64_t ldb = 0;
  bool trans_b = false;
  void* c = nullptr;
  int64_t ldc = 0;
  Dtype ab = Dtype::f32, c_dtype = Dtype::f32;
  float beta = 0;
};

// Runs `g` on `stream` with this thread's cuBLAS handle for the current
// device; "" or the error.
std::string run_gemm(const Gemm& g, cudaStream_t stream);

// Makes sure this thread has its cuBLAS handle for the current device, so
// that a call can fail for want of one (a full GPU) before it writes any
// output; "" or the error.
std::string ready_gemm_handle();

}  // namespace flce::cuda
