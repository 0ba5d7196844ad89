// src/cuda/driver_entry.h: a CUDA driver function by name, through the
// runtime (flce links cudart, not libcuda). Internal; needs the CUDA runtime.
#pragma once

#include <cuda_runtime.h>

namespace flce::cuda {

// The driver's `name` at ABI `version` (e.g. 12000 for
// cuTensorMapEncodeTiled's v12000), or nullptr where the driver has none.
// cudaGetDriverEntryPointByVersion is new in CUDA 12.5; the toolkits from 12.0
// that cuda.cmake accepts get the unversioned call, which answers with the
// toolkit's own version of the function.
inline void* driver_entry_point(const char* name, int version) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
  const cudaError_t e =
      cudaGetDriverEntryPointByVersion(name, &p, unsigned(version), cudaEnableDefault, &found);
#else
  (void)version;
  const cudaError_t e = cudaGetDriverEntryPoint(name, &p, cudaEnableDefault, &found);
#endif
  if (e != cudaSuccess || found != cudaDriverEntryPointSuccess) {
    cudaGetLastError();  // not left for the next call's error check
    return nullptr;
  }
  return p;
}

}  // namespace flce::cuda
