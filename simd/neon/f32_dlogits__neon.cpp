// dlogits, NEON (isa_kernels.h has the semantics); one instantiation per
// combination of optional terms so the loop carries only what is used.
#include "simd/isa_kernels.h"
#include "simd/neon/vmath_neon.h"

namespace flce::simd {
namespace {

template <bool kClassW, bool kSmooth, bool kEntropy, bool kCap>
void dlogits(const float* s, const float* class_w, int64_t n, const DlogitsParams& q, float* g) {
  using namespace neon;
  const float32x4_t lse = splat(q.lse), cp = splat(q.coef_p), cc = splat(q.coef_c);
  const float32x4_t ch = splat(q.coef_h), shift = splat(q.shift), sbar_d = splat(q.sbar_d);
  const float32x4_t a = splat(q.scale);
  const float32x4_t inv_k = splat(kCap ? 1.0f / q.softcap : 0.0f);
  auto one = [&](float32x4_t v, float32x4_t c) {
    const float32x4_t p = exp_ps(vsubq_f32(v, lse));
    float32x4_t d = vmulq_f32(cp, p);
    if (kSmooth) d = kClassW ? vaddq_f32(d, vmulq_f32(cc, c)) : vaddq_f32(d, cc);
    if (kEntropy) {
      const uint32x4_t z = vceqq_f32(p, splat(0.0f));  // NaN: false, kept
      const float32x4_t dev = vsubq_f32(vsubq_f32(v, shift), sbar_d);  // s - sbar
      const float32x4_t h =
          vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(vmulq_f32(p, dev)), z));
      d = vsubq_f32(d, vmulq_f32(ch, h));
    }
    if (kCap) {
      const float32x4_t t = vmulq_f32(v, inv_k);
      return vmulq_f32(vmulq_f32(a, vfmsq_f32(splat(1.0f), t, t)), d);
    }
    return vmulq_f32(a, d);
  };
  auto cw = [&](int64_t i) { return kClassW ? vld1q_f32(class_w + i) : a; };
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const float32x4_t r0 = one(vld1q_f32(s + i), cw(i));
    const float32x4_t r1 = one(vld1q_f32(s + i + 4), cw(i + 4));
    vst1q_f32(g + i, r0);
    vst1q_f32(g + i + 4, r1);
  }
  for (; i + 4 <= n; i += 4) vst1q_f32(g + i, one(vld1q_f32(s + i), cw(i)));
  if (i < n) {
    const float32x4_t c = kClassW ? load_partial(class_w + i, n - i, 0.0f) : a;
    store_partial(g + i, n - i, one(load_partial(s + i, n - i, 0.0f), c));
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

void f32_dlogits__neon(const float* s, const float* class_w, int64_t n,
                       const DlogitsParams* params, float* g) {
  const DlogitsParams& q = *params;
  if (q.coef_c == 0) dispatch_entropy<false, false>(s, class_w, n, q, g);
  else if (class_w) dispatch_entropy<true, true>(s, class_w, n, q, g);
  else dispatch_entropy<false, true>(s, class_w, n, q, g);
}

}  // namespace flce::simd
