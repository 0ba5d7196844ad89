// tests/support/kernels_for_testing.cpp: FLCE_TEST_KERNELS=avx512_emulated
// makes flce_tests run the cpu backend with the AVX-512 kernel set compiled
// over the model of its intrinsics (simd/testing/avx512_emulated_set.h), so
// that the plan paths only that set enables run on a CPU without AVX-512.
// The ctest cpu_backend_isa_avx512_emulated sets it (tests/CMakeLists.txt).
// Set before main (gtest_main's), so before any plan is made; any other
// value stops the binary rather than run the default set under its name.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "simd/dispatch.h"
#if defined(FLCE_TESTS_HAVE_AVX512_EMULATED)
#include "simd/testing/avx512_emulated_set.h"
#endif

namespace {

const flce::simd::KernelSet* named_set(const std::string& name) {
#if defined(FLCE_TESTS_HAVE_AVX512_EMULATED)
  if (name == "avx512_emulated") return &flce::simd::testing::avx512_emulated_kernels();
#endif
  (void)name;
  return nullptr;
}

const bool kernels_set = [] {
  const char* name = std::getenv("FLCE_TEST_KERNELS");
  if (name == nullptr || *name == 0) return false;
  const flce::simd::KernelSet* set = named_set(name);
  if (set == nullptr) {
    std::fprintf(stderr,
                 "flce_tests: FLCE_TEST_KERNELS=%s names no kernel set of this build "
                 "(avx512_emulated, on x86-64)\n",
                 name);
    std::exit(2);
  }
  flce::simd::set_best_kernels_for_testing(set);
  std::fprintf(stderr, "flce_tests: the cpu backend runs the kernel set \"%s\" (FLCE_TEST_KERNELS)\n",
               set->isa);
  return true;
}();

}  // namespace
