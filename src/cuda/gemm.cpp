#include "cuda/gemm.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <map>

namespace flce::cuda {
namespace {

cudaDataType_t cuda_type(Dtype d) {
  switch (d) {
    case Dtype::bf16: return CUDA_R_16BF;
    case Dtype::f16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

// One handle per host thread and device: cuBLAS handles are not to be
// shared between threads that call concurrently.
std::string handle_for_current_device(cublasHandle_t* out) {
  thread_local std::map<int, cublasHandle_t> handles;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return "cuda backend: cudaGetDevice failed";
  auto it = handles.find(device);
  if (it == handles.end()) {
    cublasHandle_t h = nullptr;
    const cublasStatus_t s = cublasCreate(&h);
    if (s != CUBLAS_STATUS_SUCCESS)
      return std::string("cuda backend: cublasCreate: ") + cublasGetStatusString(s);
    // Plain f32 math: no TF32 for f32 operands (cuBLAS' default, made explicit).
    cublasSetMathMode(h, CUBLAS_DEFAULT_MATH);
    it = handles.emplace(device, h).first;
  }
  *out = it->second;
  return "";
}

}  // namespace

std::string run_gemm(const Gemm& g, cudaStream_t stream) {
  if (g.m == 0 || g.n == 0) return "";
  cublasHandle_t h = nullptr;
  if (auto e = handle_for_current_device(&h); !e.empty()) return e;
  cublasSetStream(h, stream);
  // cuBLAS is column-major: a row-major [r, c] matrix with leading dimension
  // ld is the column-major [c, r] one, so C^T = op(B)^T op(A)^T is the call.
  const float alpha = 1.0f, beta = g.beta;
  const cublasStatus_t s = cublasGemmEx(
      h, g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, int(g.n),
      int(g.m), int(g.k), &alpha, g.b, cuda_type(g.ab), int(g.ldb), g.a, cuda_type(g.ab),
      int(g.lda), &beta, g.c, cuda_type(g.c_dtype), int(g.ldc), CUBLAS_COMPUTE_32F,
      CUBLAS_GEMM_DEFAULT);
  if (s != CUBLAS_STATUS_SUCCESS)
    return std::string("cuda backend: cublasGemmEx (") + std::to_string(g.m) + "x" +
           std::to_string(g.n) + "x" + std::to_string(g.k) + "): " + cublasGetStatusString(s);
  return "";
}

}  // namespace flce::cuda
