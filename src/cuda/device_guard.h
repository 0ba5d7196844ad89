// src/cuda/device_guard.h: makes a GPU current for a scope and gives the
// caller's current GPU back at its end, so that a call on cuda:1 leaves a
// caller on cuda:0 where it was. Internal; needs the CUDA runtime.
#pragma once

#include <cuda_runtime.h>

#include <string>

namespace flce::cuda {

class DeviceGuard {
 public:
  DeviceGuard() = default;
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  ~DeviceGuard() {
    if (restore_ && cudaSetDevice(previous_) != cudaSuccess) cudaGetLastError();
  }

  // "" once cuda:`device` is current, else why it cannot be.
  std::string enter(int device) {
    if (const cudaError_t e = cudaGetDevice(&previous_); e != cudaSuccess) {
      cudaGetLastError();
      return std::string("reading the current CUDA device: ") + cudaGetErrorString(e);
    }
    if (previous_ == device) return "";
    if (const cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
      cudaGetLastError();
      return "making cuda:" + std::to_string(device) + " current: " + cudaGetErrorString(e);
    }
    restore_ = true;
    return "";
  }

 private:
  int previous_ = 0;
  bool restore_ = false;
};

}  // namespace flce::cuda
