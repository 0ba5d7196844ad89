// src/cuda/cublas_library.h: cuBLAS, loaded when the cuda backend first
// needs it. Linking it would load libcublasLt (540 MB) into every process
// that uses flce, on the cpu backend too: about 210 MiB of resident memory at
// start. Only the functions gemm.cpp calls are resolved.
#pragma once

#include <cublas_v2.h>

#include <string>

namespace flce::cuda {

struct CublasLibrary {
  decltype(&cublasCreate_v2) create;
  decltype(&cublasDestroy_v2) destroy;
  decltype(&cublasSetStream_v2) set_stream;
  decltype(&cublasSetMathMode) set_math_mode;
  // The C function (the header overloads it for C++ with the computeType as
  // cudaDataType, which no library symbol carries).
  cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                            const void*, const void*, cudaDataType, int, const void*,
                            cudaDataType, int, const void*, void*, cudaDataType, int,
                            cublasComputeType_t, cublasGemmAlgo_t);
  decltype(&cublasGetStatusString) status_string;
};

// The library, loaded at the first call (thread-safe), or nullptr when it
// cannot be; then cublas_problem() says why.
const CublasLibrary* cublas_library();

// "" when cublas_library() has the library, else why not, for a decline:
// "cuBLAS (libcublas.so.13) cannot be loaded: ...".
std::string cublas_problem();

}  // namespace flce::cuda
