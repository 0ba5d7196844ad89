// dlogits, AVX2 (isa_kernels.h has the semantics); one instantiation per
// combination of optional terms so the loop carries only what is used.
#include "simd/avx2/vmath_avx2.h"
#include "simd/isa_kernels.h"

namespace flce::simd {
namespace {

template <bool kClassW, bool kSmooth, bool kEntropy, bool kCap>
void dlogits(const float* s, const float* class_w, int64_t n, const DlogitsParams& q, float* g) {
  using namespace avx2;
  const __m256 lse = splat(q.lse), cp = splat(q.coef_p), cc = splat(q.coef_c);
  const __m256 ch = splat(q.coef_h), shift = splat(q.shift), sbar_d = splat(q.sbar_d);
  const __m256 a = splat(q.scale);
  const __m256 inv_k = splat(kCap ? 1.0f / q.softcap : 0.0f);
  auto one = [&](__m256 v, __m256 c) {
    const __m256 p = exp_ps(_mm256_sub_ps(v, lse));
    __m256 d = _mm256_mul_ps(cp, p);
    if (kSmooth) d = kClassW ? _mm256_add_ps(d, _mm256_mul_ps(cc, c)) : _mm256_add_ps(d, cc);
    if (kEntropy) {
      const __m256 nz = _mm256_cmp_ps(p, _mm256_setzero_ps(), _CMP_NEQ_UQ);
      const __m256 dev = _mm256_sub_ps(_mm256_sub_ps(v, shift), sbar_d);  // s - sbar
      const __m256 h = _mm256_and_ps(nz, _mm256_mul_ps(p, dev));
      d = _mm256_sub_ps(d, _mm256_mul_ps(ch, h));
    }
    if (kCap) {
      const __m256 t = _mm256_mul_ps(v, inv_k);
      return _mm256_mul_ps(_mm256_mul_ps(a, _mm256_fnmadd_ps(t, t, splat(1.0f))), d);
    }
    return _mm256_mul_ps(a, d);
  };
  auto cw = [&](int64_t i) { return kClassW ? _mm256_loadu_ps(class_w + i) : a; };
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 r0 = one(_mm256_loadu_ps(s + i), cw(i));
    const __m256 r1 = one(_mm256_loadu_ps(s + i + 8), cw(i + 8));
    _mm256_storeu_ps(g + i, r0);
    _mm256_storeu_ps(g + i + 8, r1);
  }
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(g + i, one(_mm256_loadu_ps(s + i), cw(i)));
  if (i < n) {
    const __m256i m = tail_mask(n - i);
    const __m256 c = kClassW ? _mm256_maskload_ps(class_w + i, m) : a;
    _mm256_maskstore_ps(g + i, m, one(_mm256_maskload_ps(s + i, m), c));
  }
}

template <bool kClassW, bool kSmooth, bool kEntropy>
void dispatch_cap(const float* s, const float* class_w, int64_t n, const DlogitsParams& q, float* g) {
  if (q.softcap > 0) dlogits<kClassW, kSmooth, kEntropy, true>(s, class_w, n, q, g);
  else dlogits<kClassW, kSmooth, kEntropy, false>(s, class_w, n, q, g);
}

template <bool kClassW, bool kSmooth>
void dispatch_entropy(const float* s, const float* class_w, int64_t n, const DlogitsParams& q, float* g) {
  if (q.coef_h != 0) dispatch_cap<kClassW, kSmooth, true>(s, class_w, n, q, g);
  else dispatch_cap<kClassW, kSmooth, false>(s, class_w, n, q, g);
}

}  // namespace

void f32_dlogits__avx2(const float* s, const float* class_w, int64_t n,
                       const DlogitsParams* params, float* g) {
  const DlogitsParams& q = *params;
  if (q.coef_c == 0) dispatch_entropy<false, false>(s, class_w, n, q, g);
  else if (class_w) dispatch_entropy<true, true>(s, class_w, n, q, g);
  else dispatch_entropy<false, true>(s, class_w, n, q, g);
}

}  // namespace flce::simd
