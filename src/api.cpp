// The public calls: validate once, choose a backend, give it a workspace, run.
#include <sys/mman.h>

#include <cstdlib>
#include <exception>
#include <memory>

#include "common/float_env.h"
#include "flce/backend.h"
#include "flce/flce.h"
#include "registry.h"
#include "validate.h"

namespace flce {
namespace {

// Host scratch for one call, in 2 MiB-aligned memory that Linux may back
// with huge pages (MADV_HUGEPAGE): a 48 MiB workspace then costs 24 page
// faults instead of 12,288, which in a VM took about 45 ms per call.
class HostScratch {
 public:
  HostScratch() = default;
  HostScratch(const HostScratch&) = delete;
  HostScratch& operator=(const HostScratch&) = delete;
  ~HostScratch() { std::free(data_); }

  void* allocate(size_t bytes) {
    constexpr size_t kHuge = size_t(2) << 20;
    const size_t rounded = (bytes + kHuge - 1) / kHuge * kHuge;
    data_ = std::aligned_alloc(kHuge, rounded);
#ifdef MADV_HUGEPAGE
    if (data_ != nullptr) madvise(data_, rounded, MADV_HUGEPAGE);  // advice only
#endif
    return data_;
  }

 private:
  void* data_ = nullptr;
};

// The backend for a valid problem and the workspace bytes it needs; "" or
// the error, a backend's exception (a failed allocation while planning)
// included. Nothing is written yet.
std::string plan_call(const Problem& problem, Pass pass, const RunConfig& config,
                      const Backend** backend, std::string* declined, size_t* need) {
  std::string error;
  try {
    error = choose_backend(problem, pass, config, backend, declined);
    if (error.empty()) error = (*backend)->config_error(problem, pass, config);
    if (error.empty()) *need = (*backend)->workspace_bytes(problem, pass, config);
  } catch (const std::exception& e) {
    error = std::string("planning the call: ") + e.what();
  }
  if (!error.empty()) declined->clear();  // no backend runs for them to be passed over for
  return error;
}

Status run_pass(const Problem& given, Pass pass, const RunConfig& config) {
  Status status;
  Dims dims;
  status.error = validate_config(config);
  if (!status.ok()) return status;
  status.error = validate(given, pass, &dims);
  if (!status.ok()) return status;
  const Problem problem = with_canonical_strides(given);
  const Backend* backend = nullptr;
  size_t need = 0;
  status.error = plan_call(problem, pass, config, &backend, &status.declined, &need);
  if (!status.ok()) return status;
  status.backend = backend->name();
  void* workspace = config.workspace;
  HostScratch owned;
  if (workspace == nullptr && need > 0 && backend->workspace_device() == Device::cpu) {
    workspace = owned.allocate(need);
    if (workspace == nullptr) {
      status.error = "workspace: cannot allocate " + std::to_string(need) + " bytes";
      return status;
    }
  } else if (workspace != nullptr && config.workspace_bytes < need) {
    status.error = "workspace_bytes = " + std::to_string(config.workspace_bytes) +
                   ": the " + status.backend + " backend needs " + std::to_string(need);
    return status;
  }
  if (workspace == config.workspace) {
    status.error = check_workspace_aliasing(problem, pass, workspace, need);
    if (!status.ok()) return status;
  }
  try {
    const DefaultFloatEnv env;  // the caller's may flush subnormals or round otherwise
    status.error = backend->run(problem, pass, config, workspace, &status.stats);
  } catch (const std::exception& e) {  // a failed allocation, a GEMM library's error
    status.error = status.backend + " backend: " + e.what() + " (the outputs may be partly written)";
  }
  return status;
}

}  // namespace

const char* pass_name(Pass pass) {
  switch (pass) {
    case Pass::forward: return "forward";
    case Pass::backward: return "backward";
    case Pass::loss_and_grad: return "loss_and_grad";
  }
  return "unknown pass";
}

Status forward(const Problem& problem, const RunConfig& config) {
  return run_pass(problem, Pass::forward, config);
}

Status backward(const Problem& problem, const RunConfig& config) {
  return run_pass(problem, Pass::backward, config);
}

Status loss_and_grad(const Problem& problem, const RunConfig& config) {
  return run_pass(problem, Pass::loss_and_grad, config);
}

Status workspace_size(const Problem& given, Pass pass, const RunConfig& config, size_t* bytes) {
  Status status;
  Dims dims;
  status.error = validate_config(config);
  if (status.ok()) status.error = validate(given, pass, &dims);
  if (!status.ok()) return status;
  const Problem problem = with_canonical_strides(given);
  if (bytes == nullptr) {
    status.error = "bytes: null pointer";
    return status;
  }
  const Backend* backend = nullptr;
  status.error = plan_call(problem, pass, config, &backend, &status.declined, bytes);
  if (status.ok()) status.backend = backend->name();
  return status;
}

std::vector<BackendInfo> list_backends() {
  std::vector<BackendInfo> out;
  for (const Backend* b : backend_list()) out.push_back({b->name(), b->describe()});
  return out;
}

const char* version() { return FLCE_VERSION; }

}  // namespace flce
