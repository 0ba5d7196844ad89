// src/cuda/device_copy.h: a host Problem copied to a CUDA device and its
// outputs copied back, for callers whose data lives on the host (`flce run
// --backend cuda`, `flce bench --backend cuda`, the tests). Internal.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "flce/flce.h"

namespace flce::cuda {

// Whether this build has the real cuda backend (FLCE_CUDA found a toolkit).
bool built_with_cuda();

class DeviceProblem {
 public:
  DeviceProblem() = default;
  DeviceProblem(const DeviceProblem&) = delete;
  DeviceProblem& operator=(const DeviceProblem&) = delete;
  ~DeviceProblem();

  // Copies every present tensor of `host` (outputs too, so that one left
  // unwritten keeps its host value) to cuda:`device`; tensors that share
  // memory on the host (in-place grad_logits) share it there. "" or the error.
  std::string upload(const Problem& host, int device);
  // The problem whose views point at the device copies.
  const Problem& problem() const { return device_; }
  // Copies the outputs and gradients back into `host`'s arrays; waits for
  // the device first. "" or the error.
  std::string download(const Problem& host) const;
  // Device bytes the copies hold.
  size_t bytes() const;

 private:
  struct Copy {
    const void* host;
    void* device;
    size_t bytes;
  };
  Problem device_;
  std::vector<Copy> copies_;
  int device_index_ = 0;
};

}  // namespace flce::cuda
