// tests/support/skip_uncapped.cpp: FLCE_TEST_SKIP_UNCAPPED=1 (the ctests
// cpu_backend_isa_<isa>, tests/CMakeLists.txt) stops flce_tests with exit
// status 77, which those ctests report as skipped, where their FLCE_MAX_ISA
// cap leaves this CPU's best kernel set: the run would repeat the suite's
// own tests bit for bit (cpu_backend_isa_avx2 on an AVX2 machine, 143 s in
// CI and 358 s under the sanitizers).
#include <cstdio>
#include <cstdlib>
#include <string>

#include "simd/dispatch.h"

namespace {

const bool skipped = [] {
  const char* skip = std::getenv("FLCE_TEST_SKIP_UNCAPPED");
  if (skip == nullptr || std::string(skip) != "1") return false;
  const char* cap = std::getenv("FLCE_MAX_ISA");
  const flce::simd::KernelSet& capped = flce::simd::kernels_for_cap(cap);
  if (&capped != &flce::simd::kernels_for_cap(nullptr)) return false;
  std::printf("flce_tests: FLCE_MAX_ISA=%s leaves this CPU's best set (%s): the suite's own "
              "tests run it; skipped\n",
              cap ? cap : "", capped.isa);
  std::fflush(stdout);
  std::exit(77);
}();

}  // namespace
