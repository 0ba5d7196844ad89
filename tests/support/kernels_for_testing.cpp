// tests/support/kernels_for_testing.cpp: FLCE_TEST_KERNELS=avx512_emulated
// makes flce_tests plan the cpu backend's runs as on a CPU with AVX-512 and
// AVX512-BF16, whatever this one has: with the AVX-512 kernel set compiled
// over the model of its intrinsics (simd/testing/avx512_emulated_set.h) and,
// where no GEMM engine here has bf16, bf16 GEMMs widened to f32
// (bf16_widening_engine.h). So the plan paths only such a CPU takes (grad_W
// by gemm_tn and gemm_tn_bf16, bf16 G, packed scores) run on CI's AVX2
// machine. The rest still sees this CPU: oneDNN's own kernels, and the
// target_clones copies in src/cpu/operands.cpp.
// The ctest cpu_backend_isa_avx512_emulated sets it (tests/CMakeLists.txt).
// Set before main (gtest_main's), so before any plan is made; any other
// value stops the binary rather than run the default set under its name.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "cpu/gemm/gemm.h"
#include "simd/dispatch.h"
#include "support/bf16_widening_engine.h"
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
  using flce::cpu::default_gemm_engine;
  if (default_gemm_engine(flce::Dtype::bf16) == nullptr) {
    // Never freed: plans may use it until the process ends.
    flce::cpu::set_bf16_gemm_engine_for_testing(
        new flce_test::Bf16WideningEngine(default_gemm_engine(flce::Dtype::f32)));
  }
  std::fprintf(stderr, "flce_tests (FLCE_TEST_KERNELS): the cpu backend runs the kernel set \"%s\", bf16 GEMMs on %s\n",
               set->isa, default_gemm_engine(flce::Dtype::bf16)->describe().c_str());
  return true;
}();

}  // namespace
