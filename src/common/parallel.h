// The host backends' one way to run a loop over OpenMP threads (cpu and
// reference).
#pragma once

#include <cstdint>
#include <exception>

#include "common/float_env.h"

namespace flce {

// Runs body(i) for every i in [begin, end) on `threads` OpenMP threads,
// scheduled statically (each index's thread depends on the range and the
// thread count only, which per-thread scratch relies on). An exception may
// not leave an OpenMP region (the runtime would terminate the process:
// a GEMM engine's error or a failed allocation inside a Python job), so
// each one is caught where it is thrown, every other index still runs,
// and the one of the lowest index is rethrown after the region.
// Every thread computes in the default floating-point environment
// (common/float_env.h): a pool thread keeps the one it started with, which
// need not be the calling thread's.
template <class Body>
void parallel_for(int threads, int64_t begin, int64_t end, const Body& body) {
  std::exception_ptr first;
  int64_t first_index = end;
#pragma omp parallel num_threads(threads)
  {
    const DefaultFloatEnv env;
#pragma omp for schedule(static)
    for (int64_t i = begin; i < end; ++i) {
      try {
        body(i);
      } catch (...) {
#pragma omp critical(flce_parallel_for_error)
        if (i < first_index) first_index = i, first = std::current_exception();
      }
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace flce
