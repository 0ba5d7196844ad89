// simd/dispatch.cpp: the kernel sets and the choice among them.
// Built with the baseline flags: only the per-ISA sources use -mavx2 etc.
#include "simd/dispatch.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>

#include "simd/isa_kernels.h"

namespace flce::simd {

void softmax_state_init(SoftmaxState* state) {
  state->max = -__builtin_inff();
  state->sum_exp = 0;
  state->sum_exp_d = 0;
  state->sum_cs = 0;
  state->argmax = -1;
  state->first_nan = -1;
}

const KernelSet& scalar_kernels() {
  static const KernelSet set{"scalar", 1, f32_exp__scalar, f32_scores__scalar,
                             f32_online_softmax__scalar, f32_dlogits__scalar, nullptr, nullptr,
                             nullptr, nullptr};
  return set;
}

#if defined(FLCE_SIMD_HAVE_AVX2) || defined(FLCE_SIMD_HAVE_AVX512)
namespace {

// __builtin_cpu_init first: these may run from another TU's static
// initializer, before libgcc's constructor. GCC's __builtin_cpu_supports
// also checks XCR0, i.e. that the OS saves the ymm / zmm and mask state.
bool cpu_has_avx2_fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

bool cpu_has_f16c() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("f16c");
}

bool cpu_has_avx512_fbwvldq() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("fma");
}

bool cpu_has_avx512_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16");
}

}  // namespace
#endif

const KernelSet* avx2_kernels() {
#if defined(FLCE_SIMD_HAVE_AVX2)
  static const KernelSet set{"avx2", 8, f32_exp__avx2, f32_scores__avx2,
                             f32_online_softmax__avx2, f32_dlogits__avx2, nullptr, nullptr,
                             cpu_has_f16c() ? f32_pack_scores__avx2 : nullptr,
                             cpu_has_f16c() ? f32_unpack_scores__avx2 : nullptr};
  static const bool ok = cpu_has_avx2_fma();
  return ok ? &set : nullptr;
#else
  return nullptr;
#endif
}

const KernelSet* avx512_kernels() {
#if defined(FLCE_SIMD_HAVE_AVX512)
  static const KernelSet set{"avx512", 16, f32_exp__avx512, f32_scores__avx512,
                             f32_online_softmax__avx512, f32_dlogits__avx512,
                             f32_gemm_tn__avx512,
                             cpu_has_avx512_bf16() ? bf16_gemm_tn__avx512bf16 : nullptr,
                             f32_pack_scores__avx512, f32_unpack_scores__avx512};
  static const bool ok = cpu_has_avx512_fbwvldq();
  return ok ? &set : nullptr;
#else
  return nullptr;
#endif
}

const KernelSet* neon_kernels() {
#if defined(FLCE_SIMD_HAVE_NEON)
  static const KernelSet set{"neon", 4, f32_exp__neon, f32_scores__neon,
                             f32_online_softmax__neon, f32_dlogits__neon, nullptr, nullptr,
                             nullptr, nullptr};
  return &set;  // Advanced SIMD is part of the AArch64 base ISA
#else
  return nullptr;
#endif
}

namespace {

bool equals_lower(const char* a, const char* lower) {
  for (; *a && *lower; ++a, ++lower) {
    const char c = (*a >= 'A' && *a <= 'Z') ? char(*a - 'A' + 'a') : *a;
    if (c != *lower) return false;
  }
  return *a == 0 && *lower == 0;
}

}  // namespace

const KernelSet& kernels_for_cap(const char* cap) {
  // The sets of this architecture, best first.
#if defined(__aarch64__)
  const char* const names[] = {"neon", "scalar"};
  const KernelSet* const sets[] = {neon_kernels(), &scalar_kernels()};
  const char* const known = "scalar|neon";
#else
  const char* const names[] = {"avx512", "avx2", "scalar"};
  const KernelSet* const sets[] = {avx512_kernels(), avx2_kernels(), &scalar_kernels()};
  const char* const known = "scalar|avx2|avx512";
#endif
  constexpr int count = int(sizeof(names) / sizeof(names[0]));
  int first = 0;  // the best allowed
  if (cap && *cap) {
    int found = -1;
    for (int i = 0; i < count; ++i)
      if (equals_lower(cap, names[i])) found = i;
    if (found < 0)
      std::fprintf(stderr, "flce: ignoring FLCE_MAX_ISA=%s (expected %s on this machine)\n", cap,
                   known);
    else
      first = found;
  }
  for (int i = first; i < count; ++i)
    if (sets[i]) return *sets[i];
  return scalar_kernels();
}

namespace {
std::atomic<const KernelSet*> kernels_for_testing{nullptr};  // constant-initialized
}  // namespace

void set_best_kernels_for_testing(const KernelSet* set) { kernels_for_testing.store(set); }

const KernelSet& best_kernels() {
  if (const KernelSet* set = kernels_for_testing.load()) return *set;
  static const KernelSet& chosen = kernels_for_cap(std::getenv("FLCE_MAX_ISA"));
  return chosen;
}

}  // namespace flce::simd
