// The `cuda` backend: the cpu backend's algorithm on an NVIDIA GPU. cuBLAS
// GEMMs give the raw logits of one [rows x vocab] score tile at a time;
// fused kernels turn each tile into softmax states (pass 1) or dlogits
// (pass 2) right after its GEMM; on an H100 with 16-bit storage one kernel
// does both the GEMM and that work, and no score tile exists (sm90/). The
// dlogits gather into large gradient blocks for the grad_x and grad_W
// GEMMs. Never an [N, V] buffer; every sum in a fixed order, so the bytes
// are the same on every run (src/cuda/kernels.h).
#include "cuda/cuda_backend.h"

#include <cuda_runtime.h>

#include <climits>
#include <cstdio>
#include <memory>
#include <string>
#include <tuple>

#include "common/float32_options.h"
#include "common/number_text.h"
#include "cuda/cublas_library.h"
#include "cuda/device_guard.h"
#include "cuda/gemm.h"
#include "cuda/kernels.h"
#include "cuda/passes.h"
#include "cuda/plan.h"
#include "cuda/sm90/score_gemms.h"
#include "validate.h"

namespace flce {
namespace {

using cuda::DView;
using cuda::dview;

std::string cuda_error(const char* what, cudaError_t e) {
  return std::string(what) + ": " + cudaGetErrorString(e);
}

// "" when device `index` can run the backend, else why not.
std::string device_problem(int index) {
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error for later calls
    return "no usable CUDA driver or device (" + cuda_error("cudaGetDeviceCount", e) + ")";
  }
  if (count == 0) return "no CUDA device is visible";
  if (index < 0 || index >= count)
    return "device index " + std::to_string(index) + " is not one of the " +
           std::to_string(count) + " CUDA devices";
  cudaDeviceProp prop{};
  if (cudaError_t e = cudaGetDeviceProperties(&prop, index); e != cudaSuccess) {
    cudaGetLastError();
    return cuda_error("cudaGetDeviceProperties", e);
  }
  if (prop.major < 8)
    return std::string("device ") + std::to_string(index) + " (" + prop.name + ") is sm_" +
           std::to_string(prop.major * 10 + prop.minor) +
           "; the cuda backend is built for sm_80 and newer";
  return "";
}

struct Named {
  const char* name;
  const Tensor* t;
};

// "" when `data` is device memory of cuda:`device`, else where it is
// ("host memory", "memory of cuda:1", "unknown to CUDA (why)").
std::string memory_problem(const void* data, int device) {
  cudaPointerAttributes attr{};
  if (const cudaError_t e = cudaPointerGetAttributes(&attr, data); e != cudaSuccess) {
    cudaGetLastError();
    return "unknown to CUDA (" + cuda_error("cudaPointerGetAttributes", e) + ")";
  }
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)
    return "host memory";
  if (attr.device != device) return "memory of cuda:" + std::to_string(attr.device);
  return "";
}

// Every tensor must be device memory of the device the views name.
std::string pointer_problem(const Problem& p) {
  for (auto [name, t, written] : tensors_of(p)) {
    if (!t->present() || t->data == nullptr) continue;
    if (auto why = memory_problem(t->data, t->device_index); !why.empty())
      return std::string(name) + ": the view says cuda:" + std::to_string(t->device_index) +
             " but its pointer is " + why;
  }
  return "";
}

// A call reads its label checks back to the host (a synchronization), which
// a stream capturing a CUDA graph cannot hold: the copy would fail and
// invalidate the caller's capture. Declined before anything is queued; run
// with the tensors' device current.
std::string capture_problem(cudaStream_t stream) {
  const char* why = "; the cuda backend synchronizes once a call (its label checks), which a "
                    "capture cannot hold, so run it outside the capture";
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t e = cudaStreamIsCapturing(stream, &status);
  if (e == cudaErrorStreamCaptureImplicit) {  // the legacy stream, a blocking one capturing
    cudaGetLastError();
    return std::string("config.stream is the legacy default stream while a blocking stream "
                       "captures a CUDA graph") + why;
  }
  if (e != cudaSuccess) {
    cudaGetLastError();
    return "";  // not this check's to judge: the stream checks below name a bad handle
  }
  if (status == cudaStreamCaptureStatusNone) return "";
  return std::string("config.stream is capturing a CUDA graph") + why;
}

// The caller's stream and scratch must belong to the tensors' device: work
// queued on another device's stream fails as an "invalid resource handle",
// and a kernel reading another device's memory faults.
std::string config_problem(const RunConfig& config, int device) {
  const auto stream = static_cast<cudaStream_t>(config.stream);
  // Null and the two special handles mean the current device's stream,
  // which run() makes the tensors' device.
  const bool current = stream == nullptr || stream == cudaStreamLegacy ||
                       stream == cudaStreamPerThread;
#if CUDART_VERSION >= 12080  // cudaStreamGetDevice is new in CUDA 12.8
  int on = device;
  if (!current) {
    const cudaError_t e = cudaStreamGetDevice(stream, &on);
    if (e != cudaSuccess) {
      cudaGetLastError();
      // A driver older than the runtime cannot tell: the stream is taken
      // unchecked, as with an older toolkit.
      if (e == cudaErrorCallRequiresNewerDriver || e == cudaErrorNotSupported) return "";
      return "config.stream: " + cuda_error("cudaStreamGetDevice", e);
    }
  }
  if (on != device)
    return "config.stream is a stream of cuda:" + std::to_string(on) + "; the tensors are on cuda:" +
           std::to_string(device) + " (give a stream of their device)";
#else
  (void)current;
#endif
  if (config.workspace != nullptr)
    if (auto why = memory_problem(config.workspace, device); !why.empty())
      return "config.workspace is " + why + "; the tensors are on cuda:" +
             std::to_string(device) + " (give scratch of their device)";
  return "";
}

std::string layout_problem(const Problem& p) {
  const Tensor& first = p.logits.present() ? p.logits : p.x;
  const Dtype storage = first.dtype;
  if (storage != Dtype::f32 && storage != Dtype::bf16 && storage != Dtype::f16)
    return std::string("the cuda backend stores x and W (or the logits) in f32, bf16 or f16; ") +
           (p.logits.present() ? "logits" : "x") + " is " + dtype_name(storage);
  if (p.logits.present()) return "";
  for (const Named& a : {Named{"w", &p.w}, Named{"bias", &p.bias}})
    if (a.t->present() && a.t->dtype != storage)
      return std::string("the cuda backend needs x, w and bias in one dtype; x is ") +
             dtype_name(storage) + ", " + a.name + " is " + dtype_name(a.t->dtype);
  // The GEMMs' operands: rows of unit stride that do not overlap (cuBLAS
  // needs a leading dimension of at least a row; inputs may overlap).
  for (const Named& a : {Named{"x", &p.x}, Named{"w", &p.w}}) {
    if (a.t->shape[1] > 1 && a.t->stride[1] != 1) {
      // W^T of a row-major W (torch's lm_head.weight.t()) is that W in the
      // other layout, no copy needed.
      const bool transposed_w = a.t == &p.w && a.t->stride[0] == 1;
      const char* other = p.w_layout == WeightLayout::vh ? "hv" : "vh";
      return std::string(a.name) + ": the cuda backend's GEMMs need unit column stride; stride " +
             std::to_string(a.t->stride[1]) +
             (transposed_w ? std::string(" (a transposed view: give the tensor it views, with "
                                         "w_layout ") + other + ", and grad_w likewise)"
                           : std::string(" (make it contiguous)"));
    }
    if (a.t->stride[0] < a.t->shape[1])
      return std::string(a.name) + ": its rows overlap (stride[0] = " +
             std::to_string(a.t->stride[0]) + " < " + std::to_string(a.t->shape[1]) +
             " columns); the cuda backend's GEMMs need stride[0] >= the row (make it contiguous)";
  }
  // Every GEMM operand's and result's dimensions and leading dimension.
  for (const Named& a : {Named{"x", &p.x}, Named{"w", &p.w}, Named{"grad_x", &p.grad_x},
                         Named{"grad_w", &p.grad_w}}) {
    if (!a.t->present()) continue;
    if (a.t->stride[0] > INT_MAX || a.t->shape[0] > INT_MAX || a.t->shape[1] > INT_MAX)
      return std::string(a.name) + ": a dimension or stride above 2^31 - 1 (cuBLAS' int limit)";
  }
  return "";
}

cuda::LossArgs loss_args(const Problem& p, const cuda::Plan& plan, const cuda::Workspace& ws) {
  const Options& o = p.options;
  cuda::LossArgs g;
  g.n = plan.d.n, g.v = plan.d.v;
  g.a = o.logit_scale, g.k = o.softcap, g.e = o.label_smoothing, g.l = o.z_loss;
  g.a_f32 = float(o.logit_scale), g.k_f32 = float(o.softcap);
  g.softcap = cuda::softcap_poly(o.softcap);
  g.ignore_index = o.ignore_index;
  g.reduction = int(o.reduction);
  g.backward = plan.pass == Pass::backward;
  g.need_sbar = p.entropy.present() || p.grad_entropy.present();
  g.labels = dview(p.labels), g.token_weights = dview(p.token_weights);
  g.class_weights = dview(p.class_weights), g.bias = dview(p.bias);
  g.grad_loss = dview(p.grad_loss), g.grad_lse = dview(p.grad_lse);
  g.grad_entropy = dview(p.grad_entropy);
  if (plan.pass == Pass::backward) g.lse_in = dview(p.lse);
  else g.lse = dview(p.lse);
  g.loss = dview(p.loss), g.logprob = dview(p.logprob), g.argmax = dview(p.argmax);
  g.entropy = dview(p.entropy), g.zloss = dview(p.zloss);
  g.class_w = ws.class_w, g.bias_f32 = ws.bias;
  g.scalars = ws.scalars, g.rows = ws.rows, g.row_loss = ws.row_loss;
  return g;
}

// Element i of the 1-D device tensor t, as text ("" and the error in *error
// when the copy fails).
std::string element_text(const Tensor& t, int64_t i, cudaStream_t stream, std::string* error) {
  unsigned char raw[8] = {};
  const size_t size = dtype_size(t.dtype);
  const char* at = static_cast<const char*>(t.data) + i * t.stride[0] * int64_t(size);
  cudaError_t e = cudaMemcpyAsync(raw, at, size, cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) {
    *error = cuda_error("cuda backend: reading a bad value back", e);
    return "";
  }
  switch (t.dtype) {
    case Dtype::i32: return std::to_string(*reinterpret_cast<int32_t*>(raw));
    case Dtype::i64: return std::to_string(*reinterpret_cast<int64_t*>(raw));
    case Dtype::f32: return number_text(*reinterpret_cast<float*>(raw), Dtype::f32);
    case Dtype::f64: return number_text(*reinterpret_cast<double*>(raw));
    default: return "";
  }
}

// The label range and weight signs, checked on the device (validate() only
// reads host memory); the message matches validate()'s.
std::string check_values(const Problem& p, const cuda::Scalars& s, cudaStream_t stream) {
  std::string error;
  if (s.bad_label != INT64_MAX) {
    const std::string v = element_text(p.labels, s.bad_label, stream, &error);
    if (!error.empty()) return error;
    return "labels[" + std::to_string(s.bad_label) + "] = " + v + " is outside [0, V) with V = " +
           std::to_string(dims_of(p).v) + " and is not ignore_index (" +
           std::to_string(p.options.ignore_index) + ")";
  }
  for (auto [name, t, at] : {std::tuple{"token_weights", &p.token_weights, s.bad_token_weight},
                             std::tuple{"class_weights", &p.class_weights, s.bad_class_weight}}) {
    if (at == INT64_MAX) continue;
    const std::string v = element_text(*t, at, stream, &error);
    if (!error.empty()) return error;
    return std::string(name) + "[" + std::to_string(at) + "] = " + v +
           ": weights must be finite and >= 0";
  }
  return "";
}

std::string run_passes(const Problem& p, Pass pass, cudaStream_t stream, void* workspace) {
  const cuda::Plan plan = cuda::make_plan(p, pass);
  const cuda::Workspace ws = cuda::carve_workspace(plan, p, workspace);
  const cuda::LossArgs args = loss_args(p, plan, ws);
  cuda::prepare(args, ws.class_w, ws.bias, stream);
  if (auto e = cuda::last_launch_error("prepare"); !e.empty()) return e;
  cuda::Scalars scalars{};
  cudaError_t copied =
      cudaMemcpyAsync(&scalars, ws.scalars, sizeof scalars, cudaMemcpyDeviceToHost, stream);
  if (copied == cudaSuccess) copied = cudaStreamSynchronize(stream);
  if (copied != cudaSuccess) return cuda_error("cuda backend: checking labels and weights", copied);
  if (auto e = check_values(p, scalars, stream); !e.empty()) return e;
  // From here on the passes write the outputs (and pass 1 the stash, into grad_w).
  const cuda::Context c{p, plan, ws, args, stream};
  std::string error = cuda::statistics_pass(c);
  if (error.empty() && plan.grads) error = cuda::gradient_pass(c);
  if (!error.empty()) error += " (the outputs may be partly written)";
  return error;
}

class CudaBackend final : public Backend {
 public:
  const char* name() const override { return "cuda"; }

  // What it is and each visible device, or why it can run on none of them.
  std::string describe() const override {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0)  // no driver or no device
      return "declines every problem here: " + device_problem(0);
    std::string devices, reasons;
    bool hopper = false;
    for (int i = 0; i < count; ++i) {
      const std::string why = device_problem(i);
      if (!why.empty()) {
        reasons += (reasons.empty() ? "" : "; ") + why;
        continue;
      }
      cudaDeviceProp prop{};
      cudaGetDeviceProperties(&prop, i);  // device_problem read it without error
      hopper |= prop.major == 9 && prop.minor == 0;
      devices += std::string(devices.empty() ? "" : ", ") + "cuda:" + std::to_string(i) + " " +
                 prop.name + " (sm_" + std::to_string(prop.major * 10 + prop.minor) + ")";
    }
    if (devices.empty()) return "declines every problem here: " + reasons;
    if (auto why = cuda::cublas_problem(); !why.empty())
      return "declines every problem here: " + why;
    return std::string("cuBLAS GEMMs on vocab tiles + fused softmax and dlogits kernels") +
           (hopper ? " (bf16/f16 on sm_90: one wgmma kernel for each score GEMM and its epilogue)"
                   : "") +
           "; runs on " + devices + (reasons.empty() ? "" : "; declines " + reasons);
  }

  Support supports(const Problem& p, Pass, const RunConfig& config) const override {
    const Tensor& first = p.logits.present() ? p.logits : p.x;
    if (first.device != Device::cuda)
      return Support::decline("the cuda backend reads CUDA device memory; the tensors are on the "
                              "host (use cpu or reference, or move them to the GPU)");
    if (!config.gemm.empty() && config.gemm != "cublas")
      return Support::decline("gemm = '" + config.gemm +
                              "': the cuda backend's GEMMs are cuBLAS ('cublas' or empty)");
    if (auto why = device_problem(first.device_index); !why.empty()) return Support::decline(why);
    {
      // On the tensors' device: the null and per-thread handles are the
      // current device's streams, and a query from another device would
      // create a context there (~500 MB of a GPU the caller never used).
      cuda::DeviceGuard on;
      if (auto e = on.enter(first.device_index); !e.empty())
        return Support::decline("cuda backend: " + e);
      if (auto why = capture_problem(static_cast<cudaStream_t>(config.stream)); !why.empty())
        return Support::decline(why);
    }
    if (auto why = cuda::cublas_problem(); !why.empty()) return Support::decline(why);
    if (auto why = float32_options_problem(p.options, "cuda"); !why.empty())
      return Support::decline(why);
    if (auto why = layout_problem(p); !why.empty()) return Support::decline(why);
    if (auto why = pointer_problem(p); !why.empty()) return Support::decline(why);
    if (auto why = config_problem(config, first.device_index); !why.empty())
      return Support::decline(why);
    return Support::accept();
  }

  size_t workspace_bytes(const Problem& p, Pass pass, const RunConfig&) const override {
    return cuda::workspace_bytes(cuda::make_plan(p, pass), p);
  }

  Device workspace_device() const override { return Device::cuda; }

  std::string run(const Problem& p, Pass pass, const RunConfig& config, void* workspace,
                  RunStats*) const override {
    if (auto e = cuda::check_plan_env(); !e.empty()) return e;
    if (auto e = cuda::sm90::check_fused_env(); !e.empty()) return e;
    // A caller's pending error would surface at the first launch check below
    // and read as flce's own (and be cleared): name it and leave it pending.
    if (const cudaError_t e = cudaPeekAtLastError(); e != cudaSuccess)
      return std::string("cuda backend: a CUDA error from before this call is pending (") +
             cudaGetErrorName(e) + ": " + cudaGetErrorString(e) +
             "); nothing was run, and the error is left for its owner (cudaGetLastError "
             "clears it unless it is sticky)";
    const Tensor& first = p.logits.present() ? p.logits : p.x;
    cuda::DeviceGuard guard;
    if (auto e = guard.enter(first.device_index); !e.empty()) return "cuda backend: " + e;
    if (auto e = cuda::ready_gemm_handle(); !e.empty()) return e;
    cudaStream_t stream = static_cast<cudaStream_t>(config.stream);
    // The call's own scratch, freed on the stream however the call ends.
    const auto free_on_stream = [stream](void* ptr) { cudaFreeAsync(ptr, stream); };
    std::unique_ptr<void, decltype(free_on_stream)> owned(nullptr, free_on_stream);
    if (workspace == nullptr) {
      const size_t bytes = cuda::workspace_bytes(cuda::make_plan(p, pass), p);
      if (cudaError_t e = cudaMallocAsync(&workspace, bytes, stream); e != cudaSuccess) {
        cudaGetLastError();
        return "workspace: cannot allocate " + std::to_string(bytes) +
               " bytes of device memory (" + cudaGetErrorString(e) +
               "; config.workspace takes scratch of the caller's)";
      }
      owned.reset(workspace);
    }
    std::string error = run_passes(p, pass, stream, workspace);
    if (owned) {
      if (cudaError_t e = cudaFreeAsync(owned.release(), stream); e != cudaSuccess && error.empty())
        error = cuda_error("cuda backend: freeing the workspace", e);
    }
    if (error.empty()) {
      error = cuda::last_launch_error("after the passes");
      if (!error.empty()) error += " (the outputs may be partly written)";
    }
    return error;
  }
};

}  // namespace

const Backend& cuda_backend() {
  static const CudaBackend backend;
  return backend;
}

}  // namespace flce
