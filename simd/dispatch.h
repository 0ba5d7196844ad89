// simd/dispatch.h: the kernel-set choice behind best_kernels() (internal,
// exposed for tests).
#pragma once

#include "simd/kernels.h"

namespace flce::simd {

// The best set this CPU supports, capped by `cap` ("scalar", "avx2",
// "avx512" on x86; "scalar", "neon" on AArch64; case-insensitive). A null or
// empty cap means no cap; any other value prints one warning line to stderr
// and is ignored. A cap above what the CPU supports gives the best supported
// set below it. best_kernels() is kernels_for_cap(getenv("FLCE_MAX_ISA")),
// evaluated once.
const KernelSet& kernels_for_cap(const char* cap);

// Tests only: best_kernels() returns *set from now on; nullptr goes back to
// the CPU's choice. A plan keeps the set it was made with (cpu::Plan::kernels),
// so set it before any run that should use it, never while another thread
// makes a plan. tests/support/kernels_for_testing.cpp sets the emulated
// AVX-512 set (simd/testing/avx512_emulated_set.h) for the ctest
// cpu_backend_isa_avx512_emulated.
void set_best_kernels_for_testing(const KernelSet* set);

}  // namespace flce::simd
