// simd/testing/avx512_emulated_set.cpp: the KernelSet of the emulated AVX-512
// kernels (avx512_emulated_set.h). Compiled with the renaming definitions of
// the kernels (tests/CMakeLists.txt), so the names below are the emulated ones.
#include "simd/testing/avx512_emulated_set.h"

#include "simd/isa_kernels.h"

// Without the renames these would be the real AVX-512 kernels.
#if !defined(f32_exp__avx512) || !defined(f32_scores__avx512) || !defined(f32_online_softmax__avx512) || \
    !defined(f32_dlogits__avx512) || !defined(f32_gemm_tn__avx512) ||                           \
    !defined(bf16_gemm_tn__avx512bf16) || !defined(f32_pack_scores__avx512) ||                  \
    !defined(f32_unpack_scores__avx512)
#error "compile with the renaming definitions of tests/CMakeLists.txt (flce_simd_avx512_emulated)"
#endif

namespace flce::simd::testing {

const KernelSet& avx512_emulated_kernels() {
  static const KernelSet set{.isa = "avx512 (emulated)",
                             .width = 16,
                             .exp = f32_exp__avx512,
                             .scores = f32_scores__avx512,
                             .online_softmax = f32_online_softmax__avx512,
                             .dlogits = f32_dlogits__avx512,
                             .gemm_tn = f32_gemm_tn__avx512,
                             .gemm_tn_bf16 = bf16_gemm_tn__avx512bf16,
                             .pack_scores = f32_pack_scores__avx512,
                             .unpack_scores = f32_unpack_scores__avx512};
  return set;
}

}  // namespace flce::simd::testing
