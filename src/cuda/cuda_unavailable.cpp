// The `cuda` backend of a build without CUDA (FLCE_CUDA=OFF, or no toolkit
// found when CMake ran): listed, so that `flce backends` says why it is off.
#include "cuda/cuda_backend.h"

namespace flce {
namespace {

// Why CMake left the backend out; cuda.cmake names an nvcc too old for it.
#ifndef FLCE_CUDA_MISSING
#define FLCE_CUDA_MISSING "FLCE_CUDA=OFF, or CMake found no CUDA toolkit"
#endif

constexpr const char* kWhy =
    "flce was built without CUDA (" FLCE_CUDA_MISSING "); rebuild with a CUDA 12 or newer "
    "toolkit installed and FLCE_CUDA=AUTO or ON";

class CudaUnavailable final : public Backend {
 public:
  const char* name() const override { return "cuda"; }
  std::string describe() const override { return std::string("unavailable: ") + kWhy; }
  Support supports(const Problem&, Pass, const RunConfig&) const override {
    return Support::decline(kWhy);
  }
  size_t workspace_bytes(const Problem&, Pass, const RunConfig&) const override { return 0; }
  Device workspace_device() const override { return Device::cuda; }
  std::string run(const Problem&, Pass, const RunConfig&, void*, RunStats*) const override { return kWhy; }
};

}  // namespace

const Backend& cuda_backend() {
  static const CudaUnavailable backend;
  return backend;
}

}  // namespace flce
