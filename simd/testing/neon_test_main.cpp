// simd/testing/neon_test_main.cpp: the AArch64 test program (no GoogleTest
// there): the checks of tests/test_simd.cpp (simd/testing/kernel_checks.h)
// for the neon set against the scalar reference, plus the scalar set's own
// accuracy and the dispatch. .ci/neon_tests.sh builds and runs it under
// qemu-aarch64. Prints one line per check and a summary; exit status 1 on
// any failure.
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "simd/dispatch.h"
#include "simd/kernels.h"
#include "simd/testing/kernel_checks.h"

namespace t = flce::simd::testing;
using flce::simd::KernelSet;

int main() {
  const KernelSet* neon = flce::simd::neon_kernels();
  const KernelSet& scalar = flce::simd::scalar_kernels();
  int failed = 0, passed = 0;
  auto run = [&](const std::string& name, const std::function<void(t::Report&)>& body) {
    t::Report r;
    body(r);
    const bool ok = r.failed == 0 && r.checked > 0;
    std::printf("[%s] %s: %s\n", ok ? "PASS" : "FAIL", name.c_str(), r.summary().c_str());
    std::fflush(stdout);
    (ok ? passed : failed)++;
  };
  if (!neon) {
    std::printf("[FAIL] the neon kernel set is not compiled in\n");
    ++failed;
  } else {
    double ulp = 0;
    run("neon exp vs scalar", [&](t::Report& r) { t::check_exp(*neon, scalar, r); });
    run("neon exp accuracy", [&](t::Report& r) {
      t::check_exp_accuracy(*neon, t::kVecExpUlp, r, &ulp);
      std::printf("       neon exp max error %.3f ulp (sweep)\n", ulp);
    });
    run("neon tanh accuracy", [&](t::Report& r) {
      t::check_tanh_accuracy(*neon, t::kVecTanhUlp, r, &ulp);
      std::printf("       neon tanh max error %.3f ulp (sweep)\n", ulp);
    });
    run("neon scores vs scalar", [&](t::Report& r) { t::check_scores(*neon, scalar, r); });
    run("neon online_softmax vs scalar",
        [&](t::Report& r) { t::check_online_softmax(*neon, scalar, r); });
    run("neon online_softmax semantics", [&](t::Report& r) { t::check_softmax_semantics(*neon, r); });
    run("neon online_softmax extras",
        [&](t::Report& r) { t::check_online_softmax_extras(*neon, r); });
    run("neon dlogits vs scalar", [&](t::Report& r) { t::check_dlogits(*neon, scalar, r); });
    run("neon online_softmax offsets",
        [&](t::Report& r) { t::check_online_softmax_offsets(*neon, r); });
    run("neon no access outside the arrays",
        [&](t::Report& r) { t::check_reads_stay_inside(*neon, r); });
  }
  run("scalar exp accuracy", [&](t::Report& r) { t::check_exp_accuracy(scalar, t::kRefExpUlp, r); });
  run("scalar tanh accuracy",
      [&](t::Report& r) { t::check_tanh_accuracy(scalar, t::kRefTanhUlp, r); });
  run("scalar online_softmax semantics",
      [&](t::Report& r) { t::check_softmax_semantics(scalar, r); });
  run("dispatch", [&](t::Report& r) { t::check_dispatch(r); });
  std::printf("neon tests: %d passed, %d failed (best set: %s)\n", passed, failed,
              flce::simd::best_kernels().isa);
  return failed ? 1 : 0;
}
