// flce/backend.h: the interface every backend implements.
//
// The API validates a Problem once (shapes, dtypes, option ranges, label
// range, overlaps), then walks the ordered backend list. Each backend either
// accepts the problem or declines it with a sentence a person can act on
// ("the cpu backend stores x in f32, bf16 or f16; x is f64"). A backend's own
// types never appear here or in flce.h: a new backend is one class in src/
// plus one line in src/registry.cpp.
#pragma once

#include <cstddef>
#include <string>

#include "flce/flce.h"

namespace flce {

// Accept, or decline with a reason.
struct Support {
  std::string reason;  // empty when accepted
  bool accepted() const { return reason.empty(); }
  static Support accept() { return {}; }
  static Support decline(std::string why) { return {std::move(why)}; }
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  // One line for `flce backends`: what it is and what it picked here.
  virtual std::string describe() const = 0;
  // Called only with validated problems.
  virtual Support supports(const Problem& problem, Pass pass,
                           const RunConfig& config) const = 0;
  // "" or why `config` cannot run here although the problem is accepted (a
  // GEMM engine name the backend does not have, a malformed tuning variable):
  // an error rather than a decline, which would hand the problem to another
  // backend unasked; the API asks before workspace_bytes(), so that
  // workspace_size() reports it as the call would.
  virtual std::string config_error(const Problem& problem, Pass pass,
                                   const RunConfig& config) const {
    (void)problem, (void)pass, (void)config;
    return "";
  }
  virtual size_t workspace_bytes(const Problem& problem, Pass pass,
                                 const RunConfig& config) const = 0;
  // Where the workspace lives. For host memory the API allocates it when the
  // caller gives none; for device memory the backend does (stream-ordered),
  // and run() gets a null workspace in that case.
  virtual Device workspace_device() const { return Device::cpu; }
  // `workspace` holds at least workspace_bytes() bytes (or is null, see
  // workspace_device()). `stats` starts zeroed; a backend fills what it
  // measures. Returns an error message, or "" on success.
  virtual std::string run(const Problem& problem, Pass pass, const RunConfig& config,
                          void* workspace, RunStats* stats) const = 0;
};

}  // namespace flce
