// The public calls: validate once, choose a backend, give it a workspace, run.
#include <memory>

#include "flce/backend.h"
#include "flce/flce.h"
#include "registry.h"
#include "validate.h"

namespace flce {
namespace {

Status run_pass(const Problem& problem, Pass pass, const RunConfig& config) {
  Status status;
  Dims dims;
  status.error = validate_config(config);
  if (!status.ok()) return status;
  status.error = validate(problem, pass, &dims);
  if (!status.ok()) return status;
  const Backend* backend = nullptr;
  status.error = choose_backend(problem, pass, config, &backend);
  if (!status.ok()) return status;
  status.backend = backend->name();
  const size_t need = backend->workspace_bytes(problem, pass, config);
  void* workspace = config.workspace;
  std::unique_ptr<unsigned char[]> owned;
  if (workspace == nullptr && need > 0 && backend->workspace_device() == Device::cpu) {
    owned.reset(new (std::nothrow) unsigned char[need]);
    if (!owned) {
      status.error = "workspace: cannot allocate " + std::to_string(need) + " bytes";
      return status;
    }
    workspace = owned.get();
  } else if (workspace != nullptr && config.workspace_bytes < need) {
    status.error = "workspace_bytes = " + std::to_string(config.workspace_bytes) +
                   ": the " + status.backend + " backend needs " + std::to_string(need);
    return status;
  }
  status.error = backend->run(problem, pass, config, workspace, &status.stats);
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

Status workspace_size(const Problem& problem, Pass pass, const RunConfig& config, size_t* bytes) {
  Status status;
  Dims dims;
  status.error = validate_config(config);
  if (status.ok()) status.error = validate(problem, pass, &dims);
  if (!status.ok()) return status;
  if (bytes == nullptr) {
    status.error = "bytes: null pointer";
    return status;
  }
  const Backend* backend = nullptr;
  status.error = choose_backend(problem, pass, config, &backend);
  if (!status.ok()) return status;
  status.backend = backend->name();
  *bytes = backend->workspace_bytes(problem, pass, config);
  return status;
}

std::vector<BackendInfo> list_backends() {
  std::vector<BackendInfo> out;
  for (const Backend* b : backend_list()) out.push_back({b->name(), b->describe()});
  return out;
}

const char* version() { return FLCE_VERSION; }

}  // namespace flce
