// pack_scores and unpack_scores, AVX-512 (isa_kernels.h has the semantics):
// d = f16(ref - s), finite differences below -65504 raised to it, and back,
// s = ref - f32(d). vcvtps2ph rounds to nearest even (imm 0), overflows to
// +inf (a score that far below ref reads back as -inf: p = 0, as exactly)
// and keeps NaN a NaN and an infinity infinite.
#include "simd/avx512/vmath_avx512.h"
#include "simd/common.h"
#include "simd/isa_kernels.h"

namespace flce::simd {
namespace {

using namespace avx512;

constexpr float kF16Max = 65504.0f;

inline __m256i pack16(__m512 s, __m512 ref) {
  const __m512 x = _mm512_sub_ps(ref, s);
  // Finite lanes (|x| < inf, ordered) raised to -65504 (ref 0 beside an
  // infinite max); inf and NaN as they are.
  const __mmask16 finite = _mm512_cmp_ps_mask(_mm512_abs_ps(x), splat(detail::kInf), _CMP_LT_OQ);
  const __m512 clamped = _mm512_max_ps(x, splat(-kF16Max));
  return _mm512_cvtps_ph(_mm512_mask_mov_ps(x, finite, clamped), _MM_FROUND_TO_NEAREST_INT);
}

}  // namespace

void f32_pack_scores__avx512(const float* s, int64_t n, float ref_f, uint16_t* d) {
  const __m512 ref = splat(ref_f);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256i a = pack16(_mm512_loadu_ps(s + i), ref);
    const __m256i b = pack16(_mm512_loadu_ps(s + i + 16), ref);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), a);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i + 16), b);
  }
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), pack16(_mm512_loadu_ps(s + i), ref));
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    _mm256_mask_storeu_epi16(d + i, m, pack16(_mm512_maskz_loadu_ps(m, s + i), ref));
  }
}

void f32_unpack_scores__avx512(const uint16_t* d, int64_t n, float ref_f, float* s) {
  const __m512 ref = splat(ref_f);
  auto one = [&](__m256i h) { return _mm512_sub_ps(ref, _mm512_cvtph_ps(h)); };
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 a = one(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + i)));
    const __m512 b = one(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + i + 16)));
    _mm512_storeu_ps(s + i, a);
    _mm512_storeu_ps(s + i + 16, b);
  }
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(s + i, one(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + i))));
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    _mm512_mask_storeu_ps(s + i, m, one(_mm256_maskz_loadu_epi16(m, d + i)));
  }
}

}  // namespace flce::simd
