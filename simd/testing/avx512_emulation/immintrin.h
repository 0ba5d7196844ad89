// simd/testing/avx512_emulation/immintrin.h: a plain C++ model, lane by
// lane, of the AVX-512 intrinsics that simd/avx512/ uses, so that those
// kernels run and are checked on a CPU without AVX-512 (this CI machine).
// The library flce_simd_avx512_emulated (tests/CMakeLists.txt;
// simd/testing/avx512_emulated_set.h) compiles the unchanged
// simd/avx512/*.cpp with this directory first on the include path, so their
// `#include <immintrin.h>` lands here; the emulated test's main includes it
// for the counter below; nothing else sees it. The intrinsics have internal
// linkage, so no copy the compiler emits can meet one of another TU.
//
// Semantics follow the Intel SDM for each instruction. Where a kernel could
// lean on the hardware, the model is stricter:
//  * an unmasked 64-byte load or store touches all 64 bytes (memcpy), so a
//    read past an array faults at check_reads_stay_inside's guard page and
//    AddressSanitizer reports it; a masked one touches only the mask's lanes
//    (the hardware suppresses faults on the others);
//  * an aligned load or store of a misaligned address aborts (#GP there);
//  * rcp14 returns 1/x off by 0.97 * 2^-14 relative, up where x's last
//    mantissa bit is 0 and down where it is 1: the documented bound
//    (< 2^-14) at its edge, where the hardware's table is usually closer,
//    and like the hardware's a function of x alone, whatever the lane;
//  * the f16 conversions round to nearest even by their own arithmetic, not
//    through src/common/float16.cpp, whose results the checks expect.
// _mm512_reduce_*_ps are not instructions: GCC 12's avx512fintrin.h defines
// them as a tree of halvings, which is copied here so the sums group alike.
// Not modelled: exceptions and their flags, MXCSR's DAZ/FTZ (the kernels'
// calls run in the default environment, src/common/float_env.h), and which
// of two NaN operands a two-operand instruction returns (the compiler picks
// the operand order). A review compared every intrinsic here with SIMDe,
// with this CPU's AVX2/F16C counterparts (all 2^32 floats for roundscale,
// cvtps_epi32 and the f16 conversions) and with the SDM's special-case
// tables, on special values and random lanes and masks (2026-11-28).
#pragma once

#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

#include "simd/testing/float_bits.h"

struct __m512 {
  float f[16];
};
struct __m512i {
  union {
    int32_t d[16];
    uint32_t ud[16];
    int16_t w[32];
    uint16_t uw[32];
  };
};
struct __m256i {
  union {
    int32_t d[8];
    uint16_t uw[16];
  };
};
typedef __m512i __m512bh;  // 32 bf16 codes; the kernels cast __m512i to it
typedef uint16_t __mmask16;
typedef uint32_t __mmask32;

#define _CMP_EQ_OQ 0x00
#define _CMP_UNORD_Q 0x03
#define _CMP_NEQ_UQ 0x04
#define _CMP_LT_OQ 0x11
#define _CMP_GT_OQ 0x1e
#define _MM_FROUND_TO_NEAREST_INT 0x00
#define _MM_FROUND_TO_NEG_INF 0x01
#define _MM_FROUND_NO_EXC 0x08
#define _MM_HINT_T0 3

namespace avx512_emulation {

// Aligned accesses checked (the test reports it, so a run that never
// reached one shows).
inline long aligned_accesses = 0;

inline void require_aligned(const void* p, const char* what) {
  ++aligned_accesses;
  if (reinterpret_cast<uintptr_t>(p) % 64 != 0) {
    std::fprintf(stderr, "avx512 emulation: %s of the misaligned address %p\n", what, p);
    std::abort();
  }
}
using flce::simd::testing::bits;
using flce::simd::testing::from_bits;
inline float quieted(float x) { return from_bits(bits(x) | 0x00400000u); }  // SNaN -> QNaN
inline const float kIndefinite = from_bits(0xFFC00000u);  // the QNaN an invalid operation gives

// v rounded to an integer, ties to even, whatever the rounding mode: the
// immediate-rounding instructions ignore MXCSR. |v| < 2^52 here.
inline double round_half_even(double v) {
  const double f = std::floor(v), rest = v - f;
  if (rest != 0.5) return rest < 0.5 ? f : f + 1;
  return std::fmod(f, 2.0) == 0 ? f : f + 1;
}

// vcvtps2ph with round to nearest even; NaN keeps its payload's top bits, quieted.
inline uint16_t f16_code(float x) {
  const uint16_t sign = uint16_t((bits(x) >> 16) & 0x8000u);
  if (std::isnan(x)) return uint16_t(sign | 0x7E00u | ((bits(x) >> 13) & 0x3FFu));
  const double a = std::fabs(double(x));
  if (a >= 65520.0) return uint16_t(sign | 0x7C00u);  // the tie above 65504 goes to inf
  int e;
  std::frexp(a, &e);  // a in [2^(e-1), 2^e)
  const double quantum = a < 0x1p-14 ? 0x1p-24 : std::ldexp(1.0, e - 11);
  const double r = round_half_even(a / quantum) * quantum;  // exact: quantum is a power of 2
  if (r < 0x1p-14) return uint16_t(sign | uint16_t(r / 0x1p-24));  // zero or subnormal
  const double m = std::frexp(r, &e);  // r = m 2^e, m in [0.5, 1)
  return uint16_t(sign | uint16_t(e + 14) << 10 | uint16_t((2 * m - 1) * 1024));
}
// vcvtph2ps: exact.
inline float f16_value(uint16_t h) {
  const uint32_t exponent = (h >> 10) & 31u, mantissa = h & 0x3FFu;
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  if (exponent == 31)
    return from_bits(sign | 0x7F800000u | (mantissa ? 0x00400000u | mantissa << 13 : 0));
  const double magnitude =
      exponent == 0 ? std::ldexp(double(mantissa), -24) : std::ldexp(double(1024 + mantissa), int(exponent) - 25);
  return from_bits(sign | bits(float(magnitude)));
}
// vdpbf16ps reads subnormal inputs as zero and flushes subnormal results.
inline float flushed(float x) { return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x; }
inline float bf16_value(uint16_t h) { return flushed(from_bits(uint32_t(h) << 16)); }

}  // namespace avx512_emulation

namespace emu_ = avx512_emulation;

namespace {  // the intrinsics (see the top)

inline void _mm_prefetch(const char*, int) {}

// ---------------------------------------------------------------- set, cast
inline __m512 _mm512_undefined_ps() { return __m512{}; }
inline __m512 _mm512_setzero_ps() { return __m512{}; }
inline __m512i _mm512_setzero_si512() { return __m512i{}; }
inline __m512 _mm512_set1_ps(float v) {
  __m512 r;
  for (float& x : r.f) x = v;
  return r;
}
inline __m512i _mm512_set1_epi32(int32_t v) {
  __m512i r;
  for (int32_t& x : r.d) x = v;
  return r;
}
inline __m512i _mm512_setr_epi32(int e0, int e1, int e2, int e3, int e4, int e5, int e6, int e7, int e8,
                                 int e9, int e10, int e11, int e12, int e13, int e14, int e15) {
  return __m512i{{{e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11, e12, e13, e14, e15}}};
}
// The first argument is the highest element (element 31).
template <class... Int>
inline __m512i _mm512_set_epi16(Int... e) {
  static_assert(sizeof...(Int) == 32, "_mm512_set_epi16 takes 32 elements");
  const int v[32] = {int(e)...};
  __m512i r;
  for (int i = 0; i < 32; ++i) r.w[i] = int16_t(v[31 - i]);
  return r;
}
inline __m512i _mm512_castps_si512(__m512 a) { return std::bit_cast<__m512i>(a); }
inline __m512 _mm512_castsi512_ps(__m512i a) { return std::bit_cast<__m512>(a); }

// ---------------------------------------------------------------- arithmetic
#define FLCE_EMULATED_LANEWISE(name, expr)   \
  inline __m512 name(__m512 a, __m512 b) {  \
    __m512 r;                               \
    for (int i = 0; i < 16; ++i) {          \
      const float x = a.f[i], y = b.f[i];   \
      r.f[i] = (expr);                      \
    }                                       \
    return r;                               \
  }
FLCE_EMULATED_LANEWISE(_mm512_add_ps, x + y)
FLCE_EMULATED_LANEWISE(_mm512_sub_ps, x - y)
FLCE_EMULATED_LANEWISE(_mm512_mul_ps, x * y)
// maxps / minps give the second operand when either is NaN or both are zeros.
FLCE_EMULATED_LANEWISE(_mm512_max_ps, x > y ? x : y)
FLCE_EMULATED_LANEWISE(_mm512_min_ps, x < y ? x : y)
FLCE_EMULATED_LANEWISE(_mm512_or_ps, emu_::from_bits(emu_::bits(x) | emu_::bits(y)))
#undef FLCE_EMULATED_LANEWISE

inline __m512 _mm512_fmadd_ps(__m512 a, __m512 b, __m512 c) {
  __m512 r;
  for (int i = 0; i < 16; ++i) r.f[i] = std::fma(a.f[i], b.f[i], c.f[i]);
  return r;
}
// -(a b) + c, one rounding; a NaN operand comes out as it went in (quieted),
// its sign not flipped by the negation.
inline __m512 _mm512_fnmadd_ps(__m512 a, __m512 b, __m512 c) {
  __m512 r;
  for (int i = 0; i < 16; ++i) {
    const float x = a.f[i], y = b.f[i], z = c.f[i];
    r.f[i] = std::isnan(x)   ? emu_::quieted(x)
             : std::isnan(y) ? emu_::quieted(y)
             : std::isnan(z) ? emu_::quieted(z)
                             : std::fma(-x, y, z);
  }
  return r;
}
inline __m512 _mm512_mask3_fmadd_ps(__m512 a, __m512 b, __m512 c, __mmask16 k) {
  __m512 r = c;
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) r.f[i] = std::fma(a.f[i], b.f[i], c.f[i]);
  return r;
}
inline __m512 _mm512_mask_add_ps(__m512 src, __mmask16 k, __m512 a, __m512 b) {
  __m512 r = src;
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) r.f[i] = a.f[i] + b.f[i];
  return r;
}
inline __m512 _mm512_maskz_mul_ps(__mmask16 k, __m512 a, __m512 b) {
  __m512 r{};
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) r.f[i] = a.f[i] * b.f[i];
  return r;
}
inline __m512 _mm512_mask_mov_ps(__m512 src, __mmask16 k, __m512 a) {
  __m512 r = src;
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) r.f[i] = a.f[i];
  return r;
}
inline __m512 _mm512_mask_blend_ps(__mmask16 k, __m512 a, __m512 b) { return _mm512_mask_mov_ps(a, k, b); }
inline __m512 _mm512_abs_ps(__m512 a) {
  __m512 r;
  for (int i = 0; i < 16; ++i) r.f[i] = emu_::from_bits(emu_::bits(a.f[i]) & 0x7FFFFFFFu);
  return r;
}

inline bool emulated_compare(float x, float y, int predicate) {
  switch (predicate) {
    case _CMP_EQ_OQ: return x == y;
    case _CMP_UNORD_Q: return std::isnan(x) || std::isnan(y);
    case _CMP_NEQ_UQ: return !(x == y);
    case _CMP_LT_OQ: return x < y;
    case _CMP_GT_OQ: return x > y;
  }
  std::fprintf(stderr, "avx512 emulation: compare predicate %d not modelled\n", predicate);
  std::abort();
}
inline __mmask16 _mm512_cmp_ps_mask(__m512 a, __m512 b, int predicate) {
  __mmask16 k = 0;
  for (int i = 0; i < 16; ++i)
    if (emulated_compare(a.f[i], b.f[i], predicate)) k = __mmask16(k | 1u << i);
  return k;
}
inline __mmask16 _mm512_mask_cmp_ps_mask(__mmask16 k, __m512 a, __m512 b, int predicate) {
  return __mmask16(k & _mm512_cmp_ps_mask(a, b, predicate));
}

// vrndscaleps with scale 0: imm bits 1:0 pick the rounding, bit 3 only
// silences the inexact flag; MXCSR rounding (bit 2) and scales are not used.
inline __m512 _mm512_roundscale_ps(__m512 a, int imm) {
  if ((imm & ~0x0B) != 0) {
    std::fprintf(stderr, "avx512 emulation: roundscale immediate %#x not modelled\n", imm);
    std::abort();
  }
  __m512 r;
  for (int i = 0; i < 16; ++i) {
    const float x = a.f[i];
    if (std::isnan(x)) r.f[i] = emu_::quieted(x);
    else if (std::isinf(x) || std::fabs(x) >= 0x1p23f) r.f[i] = x;  // already an integer
    else {
      const double v = x;
      const double n = (imm & 3) == 0 ? emu_::round_half_even(v) : (imm & 3) == 1 ? std::floor(v)
                     : (imm & 3) == 2 ? std::ceil(v) : std::trunc(v);
      r.f[i] = std::copysign(float(n), x);  // -0.3 rounds to -0
    }
  }
  return r;
}
// vscalefps: a 2^floor(b), rounded once; the SDM's table for NaN and
// infinities (in it a quiet NaN times 2^+inf is +inf and times 2^-inf +0).
inline __m512 _mm512_scalef_ps(__m512 a, __m512 b) {
  __m512 r;
  for (int i = 0; i < 16; ++i) {
    const float x = a.f[i], y = b.f[i];
    const bool quiet_nan = std::isnan(x) && (emu_::bits(x) & 0x00400000u) != 0;
    if (quiet_nan && std::isinf(y)) r.f[i] = y > 0 ? INFINITY : 0.0f;
    else if (std::isnan(x)) r.f[i] = emu_::quieted(x);
    else if (std::isnan(y)) r.f[i] = emu_::quieted(y);
    else if (std::isinf(y) && y > 0) r.f[i] = x == 0 ? emu_::kIndefinite : std::copysign(INFINITY, x);
    else if (std::isinf(y)) r.f[i] = std::isinf(x) ? emu_::kIndefinite : std::copysign(0.0f, x);
    else {
      // Past +-400 the result is 0 or inf either way; within, x 2^e is
      // exact in double, so the cast is the only rounding.
      const double e = std::fmin(std::fmax(std::floor(double(y)), -400.0), 400.0);
      r.f[i] = float(std::ldexp(double(x), int(e)));
    }
  }
  return r;
}
// vcvtps2dq under MXCSR's rounding; NaN and out of range give INT32_MIN.
inline __m512i _mm512_cvtps_epi32(__m512 a) {
  __m512i r;
  for (int i = 0; i < 16; ++i) {
    const double v = std::nearbyint(double(a.f[i]));
    r.d[i] = std::isnan(v) || v >= 0x1p31 || v < -0x1p31 ? INT32_MIN : int32_t(v);
  }
  return r;
}
inline __m512 _mm512_rcp14_ps(__m512 a) {
  __m512 r;
  for (int i = 0; i < 16; ++i) {
    const float x = a.f[i];
    if (std::isnan(x)) r.f[i] = emu_::quieted(x);
    else if (std::fabs(x) <= 0x1p-128f) r.f[i] = std::copysign(INFINITY, x);  // 0 too (SDM)
    else if (std::isinf(x)) r.f[i] = 1.0f / x;  // +-0
    else {
      const double v = (1.0 / double(x)) * (1.0 + (emu_::bits(x) & 1 ? -1 : 1) * 0.97 * 0x1p-14);
      r.f[i] = float(std::fmax(std::fmin(v, double(FLT_MAX)), -double(FLT_MAX)));  // finite past 2^-128
    }
  }
  return r;
}

// ---------------------------------------------------------------- integers
inline __m512i _mm512_add_epi32(__m512i a, __m512i b) {
  __m512i r;
  for (int i = 0; i < 16; ++i) r.ud[i] = a.ud[i] + b.ud[i];
  return r;
}
inline __m512i _mm512_and_si512(__m512i a, __m512i b) {
  __m512i r;
  for (int i = 0; i < 16; ++i) r.ud[i] = a.ud[i] & b.ud[i];
  return r;
}
inline __m512i _mm512_slli_epi32(__m512i a, unsigned n) {
  __m512i r;
  for (int i = 0; i < 16; ++i) r.ud[i] = n > 31 ? 0 : a.ud[i] << n;
  return r;
}
inline __m512i _mm512_permutexvar_epi32(__m512i index, __m512i a) {
  __m512i r;
  for (int i = 0; i < 16; ++i) r.d[i] = a.d[index.d[i] & 15];
  return r;
}
// Index bit 5 picks b over a, bits 4:0 the element.
inline __m512i _mm512_permutex2var_epi16(__m512i a, __m512i index, __m512i b) {
  __m512i r;
  for (int i = 0; i < 32; ++i) {
    const int j = index.w[i] & 63;
    r.w[i] = j & 32 ? b.w[j & 31] : a.w[j & 31];
  }
  return r;
}

// ---------------------------------------------------------------- reductions
// GCC 12's tree: halves (high op low), then quarters, then lanes {2,3,0,1};
// lane 0 op lane 1 of that.
template <class Op>
inline float emulated_reduce(__m512 a, Op op) {
  float h[8], q[4], s[2];
  for (int i = 0; i < 8; ++i) h[i] = op(a.f[8 + i], a.f[i]);
  for (int i = 0; i < 4; ++i) q[i] = op(h[4 + i], h[i]);
  s[0] = op(q[0], q[2]), s[1] = op(q[1], q[3]);
  return op(s[0], s[1]);
}
inline float _mm512_reduce_add_ps(__m512 a) {
  return emulated_reduce(a, [](float x, float y) { return x + y; });
}
inline float _mm512_reduce_max_ps(__m512 a) {
  return emulated_reduce(a, [](float x, float y) { return x > y ? x : y; });
}

// ---------------------------------------------------------------- memory
inline __m512 _mm512_loadu_ps(const void* p) {
  __m512 r;
  std::memcpy(&r, p, 64);
  return r;
}
inline __m512 _mm512_load_ps(const void* p) {
  emu_::require_aligned(p, "load_ps");
  return _mm512_loadu_ps(p);
}
inline void _mm512_storeu_ps(void* p, __m512 a) { std::memcpy(p, &a, 64); }
inline __m512 _mm512_mask_loadu_ps(__m512 src, __mmask16 k, const void* p) {
  __m512 r = src;
  const float* f = static_cast<const float*>(p);
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) r.f[i] = f[i];
  return r;
}
inline __m512 _mm512_maskz_loadu_ps(__mmask16 k, const void* p) { return _mm512_mask_loadu_ps(__m512{}, k, p); }
inline void _mm512_mask_storeu_ps(void* p, __mmask16 k, __m512 a) {
  float* f = static_cast<float*>(p);
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) f[i] = a.f[i];
}
inline __m512i _mm512_load_si512(const void* p) {
  emu_::require_aligned(p, "load_si512");
  __m512i r;
  std::memcpy(&r, p, 64);
  return r;
}
inline void _mm512_store_si512(void* p, __m512i a) {
  emu_::require_aligned(p, "store_si512");
  std::memcpy(p, &a, 64);
}
inline __m512i _mm512_maskz_loadu_epi16(__mmask32 k, const void* p) {
  __m512i r{};
  const uint16_t* h = static_cast<const uint16_t*>(p);
  for (int i = 0; i < 32; ++i)
    if (k >> i & 1) r.uw[i] = h[i];
  return r;
}
inline __m256i _mm256_loadu_si256(const void* p) {
  __m256i r;
  std::memcpy(&r, p, 32);
  return r;
}
inline void _mm256_storeu_si256(void* p, __m256i a) { std::memcpy(p, &a, 32); }
inline __m256i _mm256_maskz_loadu_epi16(__mmask16 k, const void* p) {
  __m256i r{};
  const uint16_t* h = static_cast<const uint16_t*>(p);
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) r.uw[i] = h[i];
  return r;
}
inline void _mm256_mask_storeu_epi16(void* p, __mmask16 k, __m256i a) {
  uint16_t* h = static_cast<uint16_t*>(p);
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) h[i] = a.uw[i];
}

// ---------------------------------------------------------------- f16, bf16
inline __m256i _mm512_cvtps_ph(__m512 a, int imm) {
  if (imm != _MM_FROUND_TO_NEAREST_INT) {
    std::fprintf(stderr, "avx512 emulation: cvtps_ph rounding %d not modelled\n", imm);
    std::abort();
  }
  __m256i r;
  for (int i = 0; i < 16; ++i) r.uw[i] = emu_::f16_code(a.f[i]);
  return r;
}
inline __m512 _mm512_cvtph_ps(__m256i h) {
  __m512 r;
  for (int i = 0; i < 16; ++i) r.f[i] = emu_::f16_value(h.uw[i]);
  return r;
}
// vdpbf16ps (SDM pseudo-code): per lane, the odd pair's product added first,
// then the even one's, each a fused multiply-add (the product not rounded
// alone) rounded to nearest even and flushed.
inline __m512 _mm512_dpbf16_ps(__m512 c, __m512bh a, __m512bh b) {
  __m512 r;
  for (int j = 0; j < 16; ++j) {
    float sum = emu_::flushed(c.f[j]);
    for (const int half : {1, 0})
      sum = emu_::flushed(
          std::fma(emu_::bf16_value(a.uw[2 * j + half]), emu_::bf16_value(b.uw[2 * j + half]), sum));
    r.f[j] = sum;
  }
  return r;
}

}  // namespace
