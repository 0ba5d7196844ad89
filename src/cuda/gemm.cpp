#include "cuda/gemm.h"

#include "cuda/cublas_library.h"

#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <vector>

namespace flce::cuda {
namespace {

cudaDataType_t cuda_type(Dtype d) {
  switch (d) {
    case Dtype::bf16: return CUDA_R_16BF;
    case Dtype::f16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

// cuBLAS handles (each with its device workspace) of threads that have
// exited, per device, for the next threads to take: a program that calls
// from a new thread per request then holds as many handles as it has
// threads at once, not one per thread it ever ran. Never destroyed: at
// process exit the CUDA runtime may already be gone.
struct IdleHandles {
  std::mutex mutex;
  std::map<int, std::vector<cublasHandle_t>> by_device;
};
IdleHandles& idle_handles() {
  static IdleHandles* idle = new IdleHandles;
  return *idle;
}

// One handle per host thread and device: cuBLAS handles are not to be
// shared between threads that call concurrently. A thread's handles go
// back to the idle ones when it exits.
struct ThreadHandles {
  std::map<int, cublasHandle_t> by_device;
  ~ThreadHandles() {
    IdleHandles& idle = idle_handles();
    std::lock_guard<std::mutex> lock(idle.mutex);
    for (const auto& [device, h] : by_device) idle.by_device[device].push_back(h);
  }
};

cublasHandle_t take_idle_handle(int device) {
  IdleHandles& idle = idle_handles();
  std::lock_guard<std::mutex> lock(idle.mutex);
  std::vector<cublasHandle_t>& handles = idle.by_device[device];
  if (handles.empty()) return nullptr;
  const cublasHandle_t h = handles.back();
  handles.pop_back();
  return h;
}

// cuBLAS (loaded at the first call) and this thread's handle for the current
// device; "" or why not.
std::string handle_for_current_device(const CublasLibrary** lib_out, cublasHandle_t* out) {
  const CublasLibrary* loaded = cublas_library();
  if (loaded == nullptr) return "cuda backend: " + cublas_problem();
  const CublasLibrary& lib = *loaded;
  *lib_out = loaded;
  thread_local ThreadHandles mine;
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess)
    return std::string("cuda backend: cudaGetDevice: ") + cudaGetErrorString(e);
  auto it = mine.by_device.find(device);
  if (it == mine.by_device.end()) {
    cublasHandle_t h = take_idle_handle(device);
    if (h == nullptr) {
      if (cublasStatus_t s = lib.create(&h); s != CUBLAS_STATUS_SUCCESS)
        return std::string("cuda backend: cublasCreate: ") + lib.status_string(s);
      // Plain f32 math: no TF32 for f32 operands (cuBLAS' default, made explicit).
      const cublasStatus_t mode = lib.set_math_mode(h, CUBLAS_DEFAULT_MATH);
      if (mode != CUBLAS_STATUS_SUCCESS) {
        lib.destroy(h);
        return std::string("cuda backend: cublasSetMathMode: ") + lib.status_string(mode);
      }
    }
    it = mine.by_device.emplace(device, h).first;
  }
  *out = it->second;
  return "";
}

}  // namespace

std::string run_gemm(const Gemm& g, cudaStream_t stream) {
  if (g.m == 0 || g.n == 0) return "";
  const CublasLibrary* lib = nullptr;
  cublasHandle_t h = nullptr;
  if (auto e = handle_for_current_device(&lib, &h); !e.empty()) return e;
  if (cublasStatus_t s = lib->set_stream(h, stream); s != CUBLAS_STATUS_SUCCESS)
    return std::string("cuda backend: cublasSetStream: ") + lib->status_string(s);
  // cuBLAS is column-major: a row-major [r, c] matrix with leading dimension
  // ld is the column-major [c, r] one, so C^T = op(B)^T op(A)^T is the call.
  const float alpha = 1.0f, beta = g.beta;
  const cublasStatus_t s = lib->gemm_ex(
      h, g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, int(g.n),
      int(g.m), int(g.k), &alpha, g.b, cuda_type(g.ab), int(g.ldb), g.a, cuda_type(g.ab),
      int(g.lda), &beta, g.c, cuda_type(g.c_dtype), int(g.ldc), CUBLAS_COMPUTE_32F,
      CUBLAS_GEMM_DEFAULT);
  if (s != CUBLAS_STATUS_SUCCESS)
    return std::string("cuda backend: cublasGemmEx (") + std::to_string(g.m) + "x" +
           std::to_string(g.n) + "x" + std::to_string(g.k) + "): " + lib->status_string(s);
  return "";
}

std::string ready_gemm_handle() {
  const CublasLibrary* lib = nullptr;
  cublasHandle_t h = nullptr;
  return handle_for_current_device(&lib, &h);
}

}  // namespace flce::cuda
