// simd/testing/avx512_emulated_test_main.cpp: the AVX-512 kernel set checked
// on any x86-64 CPU. The simd/avx512/ sources, compiled a second time over a
// lane-by-lane model of their intrinsics (avx512_emulated_set.h), run
// through the checks tests/test_simd.cpp runs on
// hardware (kernel_checks.h, gemm_pack_checks.h), against the scalar set.
// Where the CPU has AVX-512, tests/test_simd.cpp runs the real instructions
// too; where it has not (this CI machine), this is what runs the code.
// tests/CMakeLists.txt builds it as flce_avx512_emulated_tests (a ctest of
// the same name). Prints one line per check; exit status 1 on any failure.
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>

#include "simd/kernels.h"
#include "simd/testing/avx512_emulated_set.h"
#include "simd/testing/avx512_emulation/immintrin.h"
#include "simd/testing/gemm_pack_checks.h"
#include "simd/testing/kernel_checks.h"

namespace t = flce::simd::testing;
using namespace flce::simd;

int main() {
  // Every kernel of the set, bf16 GEMM included (the model has vdpbf16ps).
  const KernelSet& avx512 = t::avx512_emulated_kernels();
  const KernelSet& scalar = scalar_kernels();
  int failed = 0, passed = 0;
  auto run = [&](const std::string& name, const std::function<void(t::Report&)>& body) {
    t::Report r;
    const auto start = std::chrono::steady_clock::now();
    body(r);
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    const bool ok = r.failed == 0 && r.checked > 0;
    std::printf("[%s] %s (%.1f s): %s\n", ok ? "PASS" : "FAIL", name.c_str(), took.count(),
                r.summary().c_str());
    std::fflush(stdout);
    (ok ? passed : failed)++;
  };
  double ulp = 0;
  run("exp vs scalar", [&](t::Report& r) { t::check_exp(avx512, scalar, r); });
  run("exp accuracy", [&](t::Report& r) {
    t::check_exp_accuracy(avx512, t::kVecExpUlp, r, &ulp);
    std::printf("       exp max error %.3f ulp (sampled sweep)\n", ulp);
  });
  run("tanh accuracy", [&](t::Report& r) {
    t::check_tanh_accuracy(avx512, t::kVecTanhUlp, r, &ulp);
    std::printf("       tanh max error %.3f ulp (sampled sweep; rcp14 at its bound)\n", ulp);
  });
  run("scores vs scalar", [&](t::Report& r) { t::check_scores(avx512, scalar, r); });
  run("online_softmax vs scalar", [&](t::Report& r) { t::check_online_softmax(avx512, scalar, r); });
  run("online_softmax semantics", [&](t::Report& r) { t::check_softmax_semantics(avx512, r); });
  run("online_softmax extras", [&](t::Report& r) { t::check_online_softmax_extras(avx512, r); });
  run("online_softmax offsets", [&](t::Report& r) { t::check_online_softmax_offsets(avx512, r); });
  run("dlogits vs scalar", [&](t::Report& r) { t::check_dlogits(avx512, scalar, r); });
  run("no access outside the arrays", [&](t::Report& r) { t::check_reads_stay_inside(avx512, r); });
  run("pack_scores sweep", [&](t::Report& r) { t::check_pack_scores(avx512, r); });
  run("gemm_tn sweep", [&](t::Report& r) { t::check_gemm_tn<t::F32Elements>(avx512.gemm_tn, r); });
  run("gemm_tn_bf16 sweep",
      [&](t::Report& r) { t::check_gemm_tn<t::Bf16Elements>(avx512.gemm_tn_bf16, r); });
  run("gemm_tn_bf16 flushes",
      [&](t::Report& r) { t::check_gemm_tn_bf16_flushes(avx512.gemm_tn_bf16, r); });
  // The GEMMs' packed panels are the aligned accesses (loads and stores).
  const bool aligned_reached = avx512_emulation::aligned_accesses > 0;
  std::printf("[%s] aligned accesses checked: %ld\n", aligned_reached ? "PASS" : "FAIL",
              avx512_emulation::aligned_accesses);
  (aligned_reached ? passed : failed)++;
  std::printf("avx512 emulated tests: %d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
