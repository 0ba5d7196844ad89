// The ordered list of backends and the choice among them.
#pragma once

#include <string>
#include <vector>

#include "flce/backend.h"

namespace flce {

// In the order they are tried: the fastest first, the reference last.
const std::vector<const Backend*>& backend_list();

// The backend to run: the one named by config.backend, else by FLCE_BACKEND,
// else the first that accepts. Returns "" and sets *chosen (and *declined to
// the reasons of those passed over before it, "name: why; ..."), or an error
// that gives each backend's reason for declining.
std::string choose_backend(const Problem& problem, Pass pass, const RunConfig& config,
                           const Backend** chosen, std::string* declined);

}  // namespace flce
