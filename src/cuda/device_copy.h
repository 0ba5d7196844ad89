// src/cuda/device_copy.h: for callers whose data lives on the host (`flce
// run --backend cuda`, `flce bench --backend cuda`, the tests): a host
// Problem copied to a CUDA device and its outputs copied back, a device
// synchronize, and the cuBLAS GEMM a benchmark compares against. Internal;
// without CUDA every call returns an error that says so.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "flce/flce.h"

namespace flce::cuda {

// Whether this build has the real cuda backend (FLCE_CUDA found a toolkit).
bool built_with_cuda();

// Waits for all work on the current device; "" or the error.
std::string synchronize();

// The seconds of one timed run (after an untimed one) of the logits GEMM
// U = X W^T of `device_problem` (x, w on the device), output in x's dtype
// (f32 for f32): the GEMM a step cannot avoid. One cuBLAS call into an
// [N, V] buffer, or, where the device cannot hold that, one call per block
// of rows into a buffer of N/2, N/4, ... rows, the first that it can hold.
// Where writing the output dominates (a small H), this GEMM is slower than
// a pass that never writes [N, V], so its ratio is no bound. "" or the error.
std::string time_logits_gemm(const Problem& device_problem, double* seconds);

class DeviceProblem {
 public:
  DeviceProblem() = default;
  DeviceProblem(const DeviceProblem&) = delete;
  DeviceProblem& operator=(const DeviceProblem&) = delete;
  ~DeviceProblem();

  // Copies every present tensor of `host` (outputs too, so that one left
  // unwritten keeps its host value) to cuda:`device`; tensors that share
  // memory on the host (in-place grad_logits) share it there. "" or the
  // error. The caller's current device stays current (here, in download()
  // and in the destructor).
  std::string upload(const Problem& host, int device);
  // The problem whose views point at the device copies.
  const Problem& problem() const { return device_; }
  // Copies the outputs and gradients back into `host`'s arrays; waits for
  // the copies' device first. "" or the error.
  std::string download(const Problem& host) const;
  // Device bytes the copies hold.
  size_t bytes() const;

  // The device copy of one run of host bytes, at `device`, which agrees with
  // `host` modulo 256 (inside `allocation`): each tensor in the run is as
  // aligned on the device as on the host.
  struct Copy {
    const void* host;
    void* device;
    size_t bytes;
    void* allocation = nullptr;
    bool holds(const void* p) const {
      const auto at = reinterpret_cast<uintptr_t>(p), from = reinterpret_cast<uintptr_t>(host);
      return at == from || (at > from && at - from < bytes);
    }
  };

 private:
  Problem device_;
  std::vector<Copy> copies_;
  int device_index_ = 0;
};

}  // namespace flce::cuda
