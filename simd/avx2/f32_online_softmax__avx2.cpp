// online_softmax, AVX2: pass 1 the tile max (4 accumulators), pass 2 the
// sums relative to the new shift (2 accumulator sets; sum_exp_d and sum_cs
// only with kSoftmaxMoments), masked tails; the argmax and first-NaN
// searches stop at the first hit, the argmax one runs only with
// kSoftmaxArgmax and the NaN one only when sum_exp came out NaN.
#include "simd/avx2/vmath_avx2.h"
#include "simd/common.h"
#include "simd/isa_kernels.h"

namespace flce::simd {
namespace {

using namespace avx2;

// Loads lanes [0, n) of p, -inf elsewhere.
inline __m256 load_tail_ninf(const float* p, __m256i m) {
  return _mm256_blendv_ps(splat(-detail::kInf), _mm256_maskload_ps(p, m), _mm256_castsi256_ps(m));
}

float tile_max(const float* s, int64_t n) {
  const __m256 ninf = splat(-detail::kInf);
  __m256 m0 = ninf, m1 = ninf, m2 = ninf, m3 = ninf;
  int64_t i = 0;
  // maxps(x, m) returns m when x is NaN: NaNs are skipped.
  for (; i + 32 <= n; i += 32) {
    m0 = _mm256_max_ps(_mm256_loadu_ps(s + i), m0);
    m1 = _mm256_max_ps(_mm256_loadu_ps(s + i + 8), m1);
    m2 = _mm256_max_ps(_mm256_loadu_ps(s + i + 16), m2);
    m3 = _mm256_max_ps(_mm256_loadu_ps(s + i + 24), m3);
  }
  for (; i + 8 <= n; i += 8) m0 = _mm256_max_ps(_mm256_loadu_ps(s + i), m0);
  if (i < n) m1 = _mm256_max_ps(load_tail_ninf(s + i, tail_mask(n - i)), m1);
  return hmax(_mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
}

// Lowest i with s[i] == v (ordered compare: never a NaN), or -1.
int64_t find_equal(const float* s, int64_t n, float v) {
  const __m256 vv = splat(v);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const int k = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(s + i), vv, _CMP_EQ_OQ));
    if (k) return i + __builtin_ctz(k);
  }
  if (i < n) {
    const __m256i m = tail_mask(n - i);
    const int k = _mm256_movemask_ps(_mm256_and_ps(
        _mm256_castsi256_ps(m), _mm256_cmp_ps(_mm256_maskload_ps(s + i, m), vv, _CMP_EQ_OQ)));
    if (k) return i + __builtin_ctz(k);
  }
  return -1;
}

int64_t find_nan(const float* s, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(s + i);
    const int k = _mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    if (k) return i + __builtin_ctz(k);
  }
  if (i < n) {
    const __m256 x = _mm256_maskload_ps(s + i, tail_mask(n - i));  // zeros past the end
    const int k = _mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    if (k) return i + __builtin_ctz(k);
  }
  return -1;
}

struct Acc {
  __m256 se, sed, scs;
};

// One vector of terms; masked-off tail lanes arrive as s = -inf, c = 0, and
// `m` keeps them out of sum_cs (kTail only). A weight of 0 on an infinite s
// gives NaN, as c_j logp_j does in the semantics.
template <bool kClassW, bool kMoments, bool kTail = false>
inline void accumulate(Acc& acc, __m256 x, __m256 c, __m256 shift, __m256 m = __m256()) {
  const __m256 d = _mm256_sub_ps(x, shift);
  const __m256 e = exp_ps(d);
  acc.se = _mm256_add_ps(acc.se, e);
  if (!kMoments) return;
  // e * max(d, -FLT_MAX): e == 0 exactly where d = -inf, so no 0 * inf.
  acc.sed = _mm256_fmadd_ps(e, _mm256_max_ps(splat(-0x1.fffffep127f), d), acc.sed);
  if (kClassW) {
    const __m256 cx = _mm256_mul_ps(c, x);  // 0 * -inf in a tail lane: NaN, masked off
    acc.scs = _mm256_add_ps(acc.scs, kTail ? _mm256_and_ps(m, cx) : cx);
  } else {
    acc.scs = _mm256_add_ps(acc.scs, kTail ? _mm256_and_ps(m, x) : x);
  }
}

template <bool kClassW, bool kMoments>
void sums(const float* s, const float* class_w, int64_t n, float shift_f, float* out) {
  const __m256 shift = splat(shift_f);
  const __m256 zero = _mm256_setzero_ps();
  Acc a0{zero, zero, zero}, a1{zero, zero, zero};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    accumulate<kClassW, kMoments>(a0, _mm256_loadu_ps(s + i),
                                  kClassW ? _mm256_loadu_ps(class_w + i) : zero, shift);
    accumulate<kClassW, kMoments>(a1, _mm256_loadu_ps(s + i + 8),
                                  kClassW ? _mm256_loadu_ps(class_w + i + 8) : zero, shift);
  }
  if (i + 8 <= n) {
    accumulate<kClassW, kMoments>(a0, _mm256_loadu_ps(s + i),
                                  kClassW ? _mm256_loadu_ps(class_w + i) : zero, shift);
    i += 8;
  }
  if (i < n) {
    const __m256i m = tail_mask(n - i);
    accumulate<kClassW, kMoments, true>(a1, load_tail_ninf(s + i, m),
                                        kClassW ? _mm256_maskload_ps(class_w + i, m) : zero,
                                        shift, _mm256_castsi256_ps(m));
  }
  out[0] = hsum(_mm256_add_ps(a0.se, a1.se));
  out[1] = hsum(_mm256_add_ps(a0.sed, a1.sed));
  out[2] = hsum(_mm256_add_ps(a0.scs, a1.scs));
}

}  // namespace

void f32_online_softmax__avx2(const float* s, const float* class_w, int64_t n, int64_t j0,
                              unsigned extras, SoftmaxState* state) {
  const float tmax = tile_max(s, n);
  const float shift = detail::shift_of(tmax > state->max ? tmax : state->max);
  float t[3];
  if (!(extras & kSoftmaxMoments)) sums<false, false>(s, nullptr, n, shift, t);
  else if (class_w) sums<true, true>(s, class_w, n, shift, t);
  else sums<false, true>(s, class_w, n, shift, t);
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
