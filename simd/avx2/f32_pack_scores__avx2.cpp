// pack_scores and unpack_scores, AVX2 + F16C (isa_kernels.h has the
// semantics; f32_pack_scores__avx512.cpp is the same with 16 lanes). The
// tail goes through an 8-lane buffer: AVX2 has no masked 16-bit store.
#include <cstring>

#include "simd/avx2/vmath_avx2.h"
#include "simd/common.h"
#include "simd/isa_kernels.h"

namespace flce::simd {
namespace {

using namespace avx2;

constexpr float kF16Max = 65504.0f;

inline __m128i pack8(__m256 s, __m256 ref) {
  const __m256 x = _mm256_sub_ps(ref, s);
  // Finite lanes (|x| < inf, ordered) raised to -65504 (ref 0 beside an
  // infinite max); inf and NaN as they are.
  const __m256 abs = _mm256_andnot_ps(splat(-0.0f), x);
  const __m256 finite = _mm256_cmp_ps(abs, splat(detail::kInf), _CMP_LT_OQ);
  const __m256 clamped = _mm256_max_ps(x, splat(-kF16Max));
  return _mm256_cvtps_ph(_mm256_blendv_ps(x, clamped, finite), _MM_FROUND_TO_NEAREST_INT);
}

inline __m256 unpack8(__m128i h, __m256 ref) { return _mm256_sub_ps(ref, _mm256_cvtph_ps(h)); }

}  // namespace

void f32_pack_scores__avx2(const float* s, int64_t n, float ref_f, uint16_t* d) {
  const __m256 ref = splat(ref_f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m128i a = pack8(_mm256_loadu_ps(s + i), ref);
    const __m128i b = pack8(_mm256_loadu_ps(s + i + 8), ref);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i + 8), b);
  }
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), pack8(_mm256_loadu_ps(s + i), ref));
  if (i < n) {
    const __m256 x = _mm256_maskload_ps(s + i, tail_mask(n - i));
    uint16_t out[8];
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), pack8(x, ref));
    std::memcpy(d + i, out, size_t(n - i) * sizeof(uint16_t));
  }
}

void f32_unpack_scores__avx2(const uint16_t* d, int64_t n, float ref_f, float* s) {
  const __m256 ref = splat(ref_f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 a = unpack8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + i)), ref);
    const __m256 b = unpack8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + i + 8)), ref);
    _mm256_storeu_ps(s + i, a);
    _mm256_storeu_ps(s + i + 8, b);
  }
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(s + i, unpack8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + i)), ref));
  if (i < n) {
    uint16_t in[8] = {};
    std::memcpy(in, d + i, size_t(n - i) * sizeof(uint16_t));
    _mm256_maskstore_ps(s + i, tail_mask(n - i),
                        unpack8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in)), ref));
  }
}

}  // namespace flce::simd
