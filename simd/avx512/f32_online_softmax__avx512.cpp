// online_softmax, AVX-512: pass 1 the tile max (4 accumulators), pass 2 the
// sums relative to the new shift (2 accumulator sets; sum_exp_d and sum_cs
// only with kSoftmaxMoments), masked tails; the argmax and first-NaN
// searches stop at the first hit, the argmax one runs only with
// kSoftmaxArgmax and the NaN one only when sum_exp came out NaN.
#include "simd/avx512/vmath_avx512.h"
#include "simd/common.h"
#include "simd/isa_kernels.h"

namespace flce::simd {
namespace {

using namespace avx512;

float tile_max(const float* s, int64_t n) {
  const __m512 ninf = splat(-detail::kInf);
  __m512 m0 = ninf, m1 = ninf, m2 = ninf, m3 = ninf;
  int64_t i = 0;
  // maxps(x, m) returns m when x is NaN: NaNs are skipped.
  for (; i + 64 <= n; i += 64) {
    m0 = _mm512_max_ps(_mm512_loadu_ps(s + i), m0);
    m1 = _mm512_max_ps(_mm512_loadu_ps(s + i + 16), m1);
    m2 = _mm512_max_ps(_mm512_loadu_ps(s + i + 32), m2);
    m3 = _mm512_max_ps(_mm512_loadu_ps(s + i + 48), m3);
  }
  for (; i + 16 <= n; i += 16) m0 = _mm512_max_ps(_mm512_loadu_ps(s + i), m0);
  if (i < n) m1 = _mm512_max_ps(_mm512_mask_loadu_ps(ninf, tail_mask(n - i), s + i), m1);
  return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
}

// Lowest i with s[i] == v (ordered compare: never a NaN), or -1.
int64_t find_equal(const float* s, int64_t n, float v) {
  const __m512 vv = splat(v);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __mmask16 k = _mm512_cmp_ps_mask(_mm512_loadu_ps(s + i), vv, _CMP_EQ_OQ);
    if (k) return i + __builtin_ctz(k);
  }
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    const __mmask16 k = _mm512_mask_cmp_ps_mask(m, _mm512_maskz_loadu_ps(m, s + i), vv, _CMP_EQ_OQ);
    if (k) return i + __builtin_ctz(k);
  }
  return -1;
}

int64_t find_nan(const float* s, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(s + i);
    const __mmask16 k = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    if (k) return i + __builtin_ctz(k);
  }
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 x = _mm512_maskz_loadu_ps(m, s + i);
    const __mmask16 k = _mm512_mask_cmp_ps_mask(m, x, x, _CMP_UNORD_Q);
    if (k) return i + __builtin_ctz(k);
  }
  return -1;
}

struct Acc {
  __m512 se, sed, scs;
};

// One vector of terms; masked-off tail lanes arrive as s = -inf, c = 0, and
// `m` keeps them out of sum_cs.
// kFinite: the shift is the (finite) max, so every x - shift <= 0 (or NaN)
// and the exp's range check needs one side only.
template <bool kClassW, bool kMoments, bool kFinite>
inline void accumulate(Acc& acc, __m512 x, __m512 c, __m512 shift, __mmask16 m) {
  const __m512 t = _mm512_sub_ps(x, shift);
  const __m512 e = kFinite ? exp_nonpositive_ps(t) : exp_ps(t);
  acc.se = _mm512_add_ps(acc.se, e);
  if (!kMoments) return;
  // e * max(t, -FLT_MAX): e == 0 exactly where t = -inf, so no 0 * inf.
  acc.sed = _mm512_fmadd_ps(e, _mm512_max_ps(splat(-0x1.fffffep127f), t), acc.sed);
  if (kClassW) {  // a weight of 0 on an infinite s: NaN, as c_j logp_j in the semantics
    acc.scs = _mm512_mask3_fmadd_ps(c, x, acc.scs, m);
  } else {
    acc.scs = _mm512_mask_add_ps(acc.scs, m, acc.scs, x);
  }
}

template <bool kClassW, bool kMoments, bool kFinite>
void sums(const float* s, const float* class_w, int64_t n, float shift_f, float* out) {
  const __m512 shift = splat(shift_f);
  const __m512 zero = _mm512_setzero_ps();
  const __mmask16 all = 0xffff;
  Acc a0{zero, zero, zero}, a1{zero, zero, zero};
  int64_t i = 0;
  const auto add = [shift](Acc& a, __m512 x, __m512 c, __mmask16 m) {
    accumulate<kClassW, kMoments, kFinite>(a, x, c, shift, m);
  };
  for (; i + 32 <= n; i += 32) {
    add(a0, _mm512_loadu_ps(s + i), kClassW ? _mm512_loadu_ps(class_w + i) : zero, all);
    add(a1, _mm512_loadu_ps(s + i + 16), kClassW ? _mm512_loadu_ps(class_w + i + 16) : zero, all);
  }
  if (i + 16 <= n) {
    add(a0, _mm512_loadu_ps(s + i), kClassW ? _mm512_loadu_ps(class_w + i) : zero, all);
    i += 16;
  }
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    add(a1, _mm512_mask_loadu_ps(splat(-detail::kInf), m, s + i),
        kClassW ? _mm512_maskz_loadu_ps(m, class_w + i) : zero, m);
  }
  out[0] = _mm512_reduce_add_ps(_mm512_add_ps(a0.se, a1.se));
  out[1] = _mm512_reduce_add_ps(_mm512_add_ps(a0.sed, a1.sed));
  out[2] = _mm512_reduce_add_ps(_mm512_add_ps(a0.scs, a1.scs));
}

template <bool kFinite>
void sums_by_class_w(const float* s, const float* class_w, int64_t n, unsigned extras, float shift,
                     float* t) {
  if (!(extras & kSoftmaxMoments)) sums<false, false, kFinite>(s, nullptr, n, shift, t);
  else if (class_w) sums<true, true, kFinite>(s, class_w, n, shift, t);
  else sums<false, true, kFinite>(s, class_w, n, shift, t);
}

}  // namespace

void f32_online_softmax__avx512(const float* s, const float* class_w, int64_t n, int64_t j0,
                                unsigned extras, SoftmaxState* state) {
  const float tmax = tile_max(s, n);
  const float max = tmax > state->max ? tmax : state->max;
  const float shift = detail::shift_of(max);
  float t[3];
  if (detail::is_finite(max)) sums_by_class_w<true>(s, class_w, n, extras, shift, t);
  else sums_by_class_w<false>(s, class_w, n, extras, shift, t);
  int64_t argmax = -1;
  if ((extras & kSoftmaxArgmax) && detail::tile_argmax_needed(state, tmax, j0)) {
    const int64_t i = find_equal(s, n, tmax);
    if (i >= 0) argmax = j0 + i;
  }
  int64_t first_nan = -1;
  if (detail::is_nan(t[0])) {
    const int64_t i = find_nan(s, n);
    if (i >= 0) first_nan = j0 + i;
  }
  detail::fold_tile(state, tmax, t[0], t[1], t[2], argmax, first_nan);
}

}  // namespace flce::simd
