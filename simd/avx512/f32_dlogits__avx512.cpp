// dlogits, AVX-512 (isa_kernels.h has the semantics); one instantiation per
// combination of optional terms so the loop carries only what is used.
#include "simd/avx512/vmath_avx512.h"
#include "simd/isa_kernels.h"

namespace flce::simd {
namespace {

template <bool kClassW, bool kSmooth, bool kEntropy, bool kCap>
void dlogits(const float* s, const float* class_w, int64_t n, const DlogitsParams& q, float* g) {
  using namespace avx512;
  const __m512 lse = splat(q.lse), cp = splat(q.coef_p), cc = splat(q.coef_c);
  const __m512 ch = splat(q.coef_h), shift = splat(q.shift), sbar_d = splat(q.sbar_d);
  const __m512 a = splat(q.scale);
  const __m512 inv_k = splat(kCap ? 1.0f / q.softcap : 0.0f);
  auto one = [&](__m512 v, __m512 c) {
    const __m512 p = exp_ps(_mm512_sub_ps(v, lse));
    __m512 d = _mm512_mul_ps(cp, p);
    if (kSmooth) d = kClassW ? _mm512_add_ps(d, _mm512_mul_ps(cc, c)) : _mm512_add_ps(d, cc);
    if (kEntropy) {
      const __mmask16 nz = _mm512_cmp_ps_mask(p, _mm512_setzero_ps(), _CMP_NEQ_UQ);
      const __m512 dev = _mm512_sub_ps(_mm512_sub_ps(v, shift), sbar_d);  // s - sbar
      d = _mm512_sub_ps(d, _mm512_mul_ps(ch, _mm512_maskz_mul_ps(nz, p, dev)));
    }
    if (kCap) {
      const __m512 t = _mm512_mul_ps(v, inv_k);
      return _mm512_mul_ps(_mm512_mul_ps(a, _mm512_fnmadd_ps(t, t, splat(1.0f))), d);
    }
    return _mm512_mul_ps(a, d);
  };
  auto cw = [&](int64_t i) { return kClassW ? _mm512_loadu_ps(class_w + i) : a; };
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 r0 = one(_mm512_loadu_ps(s + i), cw(i));
    const __m512 r1 = one(_mm512_loadu_ps(s + i + 16), cw(i + 16));
    _mm512_storeu_ps(g + i, r0);
    _mm512_storeu_ps(g + i + 16, r1);
  }
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(g + i, one(_mm512_loadu_ps(s + i), cw(i)));
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 c = kClassW ? _mm512_maskz_loadu_ps(m, class_w + i) : a;
    _mm512_mask_storeu_ps(g + i, m, one(_mm512_maskz_loadu_ps(m, s + i), c));
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

void f32_dlogits__avx512(const float* s, const float* class_w, int64_t n,
                         const DlogitsParams* params, float* g) {
  const DlogitsParams& q = *params;
  if (q.coef_c == 0) dispatch_entropy<false, false>(s, class_w, n, q, g);
  else if (class_w) dispatch_entropy<true, true>(s, class_w, n, q, g);
  else dispatch_entropy<false, true>(s, class_w, n, q, g);
}

}  // namespace flce::simd
