// simd/testing/avx512_emulated_set.h: the AVX-512 kernel set, compiled over
// the model of its intrinsics (avx512_emulation/immintrin.h), as a KernelSet
// that runs on any x86-64 CPU. Tests only.
//
// tests/CMakeLists.txt compiles simd/avx512/*.cpp a second time into the
// library flce_simd_avx512_emulated, with the model first on the include path
// and each kernel renamed (f32_exp__avx512 -> f32_exp__avx512_emulated, ...),
// so it links beside flce_simd's real AVX-512 set. Its users:
//  * flce_avx512_emulated_tests checks it kernel by kernel against the
//    scalar set (avx512_emulated_test_main.cpp);
//  * the ctest cpu_backend_isa_avx512_emulated runs the cpu backend's tests
//    with it (tests/support/kernels_for_testing.cpp), so the plan paths that
//    only this set enables (grad_W by gemm_tn and gemm_tn_bf16, packed
//    scores) run on a CPU without AVX-512.
#pragma once

#include "simd/kernels.h"

namespace flce::simd::testing {

// isa "avx512 (emulated)", width 16, every kernel set, bf16 GEMM included
// (the model has vdpbf16ps), whatever this CPU has.
const KernelSet& avx512_emulated_kernels();

}  // namespace flce::simd::testing
