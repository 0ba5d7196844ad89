// src/cuda/device_guard.h: makes a GPU current for a scope and gives the
// caller's current GPU back at its end, so that a call on cuda:1 leaves a
// caller on cuda:0 where it was. Internal; needs the CUDA runtime.
#pragma once

#include <cuda_runtime.h>

#include <string>

namespace flce::cuda {

// Whether cuda:`device`'s primary context exists (the runtime creates it on
// a device's first use, and cudaSetDevice does since CUDA 12); true where
// the driver cannot tell, so that callers act as if it did.
bool has_primary_context(int device);

class DeviceGuard {
 public:
  DeviceGuard() = default;
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  ~DeviceGuard() {
    if (restore_ && cudaSetDevice(previous_) != cudaSuccess) cudaGetLastError();
  }

  // "" once cuda:`device` is current, else why it cannot be. A caller's
  // current GPU that has no context yet (a thread that never chose one
  // reads 0) is not given back: that would create a context there, ~500 MB
  // of a GPU the caller never used, in every process of a job that runs one
  // per GPU without cudaSetDevice (PyTorch's device guards skip it too).
  std::string enter(int device) {
    if (const cudaError_t e = cudaGetDevice(&previous_); e != cudaSuccess) {
      cudaGetLastError();
      return std::string("reading the current CUDA device: ") + cudaGetErrorString(e);
    }
    if (previous_ == device) return "";
    const bool previous_used = has_primary_context(previous_);
    if (const cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
      cudaGetLastError();
      return "making cuda:" + std::to_string(device) + " current: " + cudaGetErrorString(e);
    }
    restore_ = previous_used;
    return "";
  }

 private:
  int previous_ = 0;
  bool restore_ = false;
};

}  // namespace flce::cuda
