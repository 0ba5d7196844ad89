// Backends are tried in order; each accepts a problem or declines with a
// reason, and a forced backend that declines is an error, never a silent
// fallback. A new backend adds one line to backend_list().
#include "registry.h"

#include <cstdlib>

#include "cpu/cpu_backend.h"
#include "cuda/cuda_backend.h"
#include "reference/reference.h"

namespace flce {

const std::vector<const Backend*>& backend_list() {
  static const std::vector<const Backend*> list = {
      &cpu_backend(),
      &reference_backend(),
      &cuda_backend(),
  };
  return list;
}

namespace {

std::string names() {
  std::string s;
  for (const Backend* b : backend_list()) s += (s.empty() ? "" : ", ") + std::string(b->name());
  return s;
}

}  // namespace

std::string choose_backend(const Problem& problem, Pass pass, const RunConfig& config,
                           const Backend** chosen, std::string* declined) {
  std::string forced = config.backend, source = "backend";
  if (forced.empty()) {
    const char* env = std::getenv("FLCE_BACKEND");
    if (env != nullptr && *env != '\0') forced = env, source = "FLCE_BACKEND";
  }
  if (!forced.empty()) {
    for (const Backend* b : backend_list()) {
      if (forced != b->name()) continue;
      const Support s = b->supports(problem, pass, config);
      if (!s.accepted()) return source + " = " + forced + ": declines this problem: " + s.reason;
      *chosen = b;
      return "";
    }
    return source + " = '" + forced + "' is not a backend (available: " + names() + ")";
  }
  std::string reasons;
  for (const Backend* b : backend_list()) {
    const Support s = b->supports(problem, pass, config);
    if (s.accepted()) {
      *chosen = b;
      *declined = reasons.empty() ? "" : reasons.substr(2);
      return "";
    }
    reasons += std::string("; ") + b->name() + ": " + s.reason;
  }
  return "backend: no backend accepts this problem" + reasons;
}

}  // namespace flce
