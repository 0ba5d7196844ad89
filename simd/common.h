// simd/common.h: helpers shared by every ISA's kernels (internal).
//
// Everything here has internal linkage and uses only builtins: the header is
// compiled into TUs built with -mavx512f / -mavx2, and an inline function
// with external linkage (a std:: template, say) instantiated there could be
// the copy the linker keeps for the baseline code too.
#pragma once

#include <cstdint>

#include "simd/kernels.h"

namespace flce::simd::detail {
namespace {

constexpr float kInf = __builtin_inff();

inline bool is_finite(float v) { return __builtin_isfinite(v); }
inline bool is_nan(float v) { return __builtin_isnan(v); }

// The shift every sum of a state is relative to: the max if finite, else 0
// (an infinite max is not subtracted, as the reference's lse: +inf scores give
// sum_exp = +inf, a state that has seen only -inf (or nothing) has zero sums).
inline float shift_of(float max) { return is_finite(max) ? max : 0.0f; }

// The kernels' element copies, fills and minima: std::copy_n, std::fill and
// std::min would be instantiated with external linkage (weak symbols at -O0),
// which the rule above forbids.
template <class T>
inline void copy_elements(const T* src, int64_t n, T* dst) {
  if (n > 0) __builtin_memcpy(dst, src, static_cast<unsigned long>(n) * sizeof(T));
}
template <class T>
inline void fill_elements(T* begin, T* end, T value) {
  for (T* p = begin; p < end; ++p) *p = value;
}
inline int64_t min_i64(int64_t a, int64_t b) { return a < b ? a : b; }

// Lower of two indices where -1 means "none".
inline int64_t min_index(int64_t a, int64_t b) {
  if (a < 0) return b;
  if (b < 0) return a;
  return a < b ? a : b;
}

// Whether the tile's own argmax can change the state's: the state's max is
// beaten, or tied and the state's argmax is not already below the tile.
inline bool tile_argmax_needed(const SoftmaxState* st, float tile_max, int64_t j0) {
  if (tile_max > st->max) return true;
  if (tile_max < st->max) return false;
  return !(st->argmax >= 0 && st->argmax < j0);
}

// sum_exp_d of a state moved from shift m0 to shift m (delta = m0 - m,
// f = exp(delta)): sum_j e^(s_j - m) (s_j - m) = f (sum_exp_d + delta
// sum_exp). Where f is 0 (every term's weight below 2^-149) so is the
// result, NaN kept, without the delta term: delta may be infinite (shifts
// near -FLT_MAX and FLT_MAX), and 0 * inf is NaN. One explicit FMA: the
// vector sets' files are compiled with contraction on, the scalar set's
// without, and the state's bits must not depend on which contracted what.
inline float moved_sum_exp_d(float sum_exp_d, float sum_exp, float f, float delta) {
  return f == 0 ? sum_exp_d * f : __builtin_fmaf(f, sum_exp_d, delta * (f * sum_exp));
}

// Folds one tile into *st. The tile's sums are relative to
// shift_of(max(st->max, tile_max)); tile_argmax/tile_first_nan are global
// indices or -1. The old sums move to the new shift (moved_sum_exp_d): a
// state whose max is -inf has (non-NaN) zero sums, so its factor is 0, and
// a NaN in its sum_exp still propagates.
inline void fold_tile(SoftmaxState* st, float tile_max, float sum_exp, float sum_exp_d,
                      float sum_cs, int64_t tile_argmax, int64_t tile_first_nan) {
  const float m0 = st->max;
  const float m = tile_max > m0 ? tile_max : m0;
  if (m0 != m) {
    const float delta = shift_of(m0) - shift_of(m);
    const float f = (m0 == -kInf) ? 0.0f : __builtin_expf(delta);
    st->sum_exp_d = moved_sum_exp_d(st->sum_exp_d, st->sum_exp, f, delta);
    st->sum_exp = st->sum_exp * f;
  }
  st->sum_exp = st->sum_exp + sum_exp;
  st->sum_exp_d = st->sum_exp_d + sum_exp_d;
  st->sum_cs = st->sum_cs + sum_cs;
  if (tile_max > m0) {
    if (tile_argmax >= 0) st->argmax = tile_argmax;
  } else if (tile_max == m0) {
    st->argmax = min_index(st->argmax, tile_argmax);
  }
  // + 0: a max of -0 is kept as +0. Which zero a max instruction returns
  // for -0 against +0 differs between ISAs (and from the scalar loop), so
  // the state's bits would otherwise depend on the kernel set.
  st->max = m + 0.0f;
  st->first_nan = min_index(st->first_nan, tile_first_nan);
}

}  // namespace
}  // namespace flce::simd::detail
