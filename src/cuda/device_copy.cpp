#include "cuda/device_copy.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include "validate.h"

#ifdef FLCE_HAVE_CUDA
#include <cuda_runtime.h>

#include "cuda/device_guard.h"
#include "cuda/gemm.h"
#endif

namespace flce::cuda {

#ifdef FLCE_HAVE_CUDA

namespace {

// Bytes from the first to one past the last element (non-negative strides).
size_t span_bytes(const Tensor& t) {
  int64_t last = 0;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] == 0) return 0;
    last += (t.shape[d] - 1) * t.stride[d];
  }
  return size_t(last + 1) * dtype_size(t.dtype);
}

// The spans as copies, those that overlap merged into one (sorted by start).
std::vector<DeviceProblem::Copy> merged_spans(std::vector<DeviceProblem::Copy> spans) {
  const auto start = [](const DeviceProblem::Copy& c) {
    return reinterpret_cast<uintptr_t>(c.host);
  };
  std::sort(spans.begin(), spans.end(),
            [&](const auto& a, const auto& b) { return start(a) < start(b); });
  std::vector<DeviceProblem::Copy> merged;
  for (const DeviceProblem::Copy& c : spans) {
    DeviceProblem::Copy* last = merged.empty() ? nullptr : &merged.back();
    if (last && (start(c) == start(*last) || start(c) < start(*last) + last->bytes))
      last->bytes = std::max(last->bytes, size_t(start(c) + c.bytes - start(*last)));
    else
      merged.push_back(c);
  }
  return merged;
}

// Makes cuda:`device` current for `guard`'s scope: "" or why it cannot.
std::string enter_device(DeviceGuard& guard, int device) {
  if (auto e = guard.enter(device); !e.empty())
    return "cannot use cuda:" + std::to_string(device) + " (" + e + ")";
  return "";
}

}  // namespace

bool built_with_cuda() { return true; }

std::string synchronize() {
  const cudaError_t e = cudaDeviceSynchronize();
  return e == cudaSuccess ? "" : std::string("cuda: ") + cudaGetErrorString(e);
}

std::string time_logits_gemm(const Problem& p, double* seconds) {
  DeviceGuard guard;  // the buffer and the GEMMs on the problem's device
  if (auto e = enter_device(guard, p.x.device_index); !e.empty()) return e;
  const int64_t n = p.x.shape[0], h = p.x.shape[1];
  const bool vh = p.w_layout == WeightLayout::vh;
  const int64_t v = vh ? p.w.shape[0] : p.w.shape[1];
  const size_t row_bytes = size_t(v) * dtype_size(p.x.dtype);
  void* out = nullptr;
  int64_t rows = n;  // halved until the output buffer fits
  cudaError_t e = cudaMalloc(&out, size_t(rows) * row_bytes);
  while (e == cudaErrorMemoryAllocation && rows > 1) {
    cudaGetLastError();
    rows = (rows + 1) / 2;
    e = cudaMalloc(&out, size_t(rows) * row_bytes);
  }
  if (e != cudaSuccess) {
    cudaGetLastError();
    return "the GEMM's output (" + std::to_string(rows) + " rows of " + std::to_string(row_bytes) +
           " bytes): " + cudaGetErrorString(e);
  }
  auto run_all = [&]() -> std::string {
    for (int64_t i0 = 0; i0 < n; i0 += rows) {
      Gemm g;
      g.m = std::min(rows, n - i0), g.n = v, g.k = h;
      g.a = static_cast<const char*>(p.x.data) + size_t(i0 * p.x.stride[0]) * dtype_size(p.x.dtype);
      g.lda = p.x.stride[0];
      g.b = p.w.data, g.ldb = p.w.stride[0], g.trans_b = vh;
      g.c = out, g.ldc = v;
      g.ab = p.x.dtype, g.c_dtype = p.x.dtype;
      if (auto error = run_gemm(g, nullptr); !error.empty()) return error;
    }
    return synchronize();
  };
  std::string error = run_all();
  const auto start = std::chrono::steady_clock::now();
  if (error.empty()) error = run_all();
  *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  cudaFree(out);
  return error;
}

DeviceProblem::~DeviceProblem() {
  DeviceGuard guard;
  guard.enter(device_index_);
  for (const Copy& c : copies_) cudaFree(c.allocation);
}

std::string DeviceProblem::upload(const Problem& host, int device) {
  device_index_ = device;
  DeviceGuard guard;
  if (auto e = enter_device(guard, device); !e.empty()) return e;
  device_ = host;
  // One copy per run of overlapping host byte spans: tensors that share
  // memory on the host share it on the device (logits and grad_logits in
  // place; two inputs on one buffer; outputs interleaved as the columns of
  // one array, which a copy each would write back over one another).
  std::vector<Copy> wanted;
  for (auto named : tensors_of(host)) {
    const Tensor& h = *named.tensor;
    if (h.present()) wanted.push_back({h.data, nullptr, span_bytes(h)});
  }
  wanted = merged_spans(std::move(wanted));
  for (Copy c : wanted) {
    const size_t shift = reinterpret_cast<uintptr_t>(c.host) % 256;  // cudaMalloc's is 0
    if (cudaError_t e = cudaMalloc(&c.allocation, shift + (c.bytes ? c.bytes : 1));
        e != cudaSuccess) {
      cudaGetLastError();
      return "cannot allocate " + std::to_string(c.bytes) + " bytes on cuda:" +
             std::to_string(device) + ": " + cudaGetErrorString(e);
    }
    c.device = static_cast<char*>(c.allocation) + shift;
    copies_.push_back(c);
    if (c.bytes && c.host != nullptr) {
      if (cudaError_t e = cudaMemcpy(c.device, c.host, c.bytes, cudaMemcpyHostToDevice);
          e != cudaSuccess) {
        cudaGetLastError();
        return std::string("copying to the device: ") + cudaGetErrorString(e);
      }
    }
  }
  for (auto named : tensors_of(device_)) {
    Tensor& d = *named.tensor;
    if (!d.present()) continue;
    const Copy& c = *std::find_if(copies_.begin(), copies_.end(),
                                  [&](const Copy& c) { return c.holds(d.data); });
    d.data = static_cast<char*>(c.device) + (static_cast<const char*>(d.data) -
                                             static_cast<const char*>(c.host));
    d.device = Device::cuda;
    d.device_index = device;
  }
  return "";
}

std::string DeviceProblem::download(const Problem& host) const {
  DeviceGuard guard;
  if (auto e = enter_device(guard, device_index_); !e.empty()) return e;
  if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess)
    return std::string("cuda: ") + cudaGetErrorString(e);
  std::vector<const Copy*> back;  // each copy that holds a written tensor, once
  for (auto named : tensors_of(host)) {
    if (!named.written || !named.tensor->present()) continue;
    for (const Copy& c : copies_)
      if (c.holds(named.tensor->data) && std::find(back.begin(), back.end(), &c) == back.end())
        back.push_back(&c);
  }
  for (const Copy* c : back) {
    if (c->bytes == 0) continue;
    if (cudaError_t e = cudaMemcpy(const_cast<void*>(c->host), c->device, c->bytes,
                                   cudaMemcpyDeviceToHost);
        e != cudaSuccess) {
      cudaGetLastError();
      return std::string("copying from the device: ") + cudaGetErrorString(e);
    }
  }
  return "";
}

#else

bool built_with_cuda() { return false; }
std::string synchronize() { return "flce was built without CUDA"; }
std::string time_logits_gemm(const Problem&, double*) { return "flce was built without CUDA"; }
DeviceProblem::~DeviceProblem() = default;
std::string DeviceProblem::upload(const Problem&, int) {
  return "flce was built without CUDA (FLCE_CUDA=OFF, or CMake found no CUDA toolkit)";
}
std::string DeviceProblem::download(const Problem&) const {
  return "flce was built without CUDA";
}

#endif

size_t DeviceProblem::bytes() const {
  size_t total = 0;
  for (const Copy& c : copies_) total += c.bytes;
  return total;
}

}  // namespace flce::cuda
