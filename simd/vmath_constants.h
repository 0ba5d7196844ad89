// simd/vmath_constants.h: the constants of the vector exp and tanh, shared
// by every ISA's vmath header so the sets evaluate the same approximations
// (AVX-512's exp adds the table form below, from -87 up).
#pragma once

namespace flce::simd::vmath {

// exp(x) = 2^n exp(r), n = round(x log2 e), r = x - n ln2 with ln2 split in
// two (Cody-Waite): with FMA, x - n*kLn2Hi is exact for every n that occurs,
// so r carries one rounding. |r| <= ln2/2 (+ a hair from rounding x log2 e).
constexpr float kLog2e = 0x1.715476p+0f;
constexpr float kLn2Hi = 0x1.62e430p-1f;   // float(ln 2)
constexpr float kLn2Lo = -0x1.05c610p-29f;  // ln 2 - kLn2Hi
// exp(r) ~ 1 + r (c1 + r (c2 + ... + r c6)): minimax for relative error on
// [-ln2/2, ln2/2] (own Remez, long double), |error| 2.6e-9 = 0.02 ulp.
constexpr float kExpC1 = 0x1.000000p+0f;
constexpr float kExpC2 = 0x1.000002p-1f;
constexpr float kExpC3 = 0x1.5553c2p-3f;
constexpr float kExpC4 = 0x1.55515ep-5f;
constexpr float kExpC5 = 0x1.12903ep-7f;
constexpr float kExpC6 = 0x1.709b64p-10f;
// Range: x is clamped to [kExpLo, kExpHi] with NaN-propagating min/max, so
// NaN stays NaN. exp(88.75) > FLT_MAX: the product p 2^n overflows to +inf
// exactly where a correctly rounded exp would; exp(-104) < 2^-150 rounds to
// +0, so -inf gives +0. Results below FLT_MIN = 2^-126 (x < -87.3365) are
// subnormal, rounded once, as a correctly rounded exp would; the x86 sets
// build them without any subnormal floating-point operation (x86 cores take a
// microcode assist on each subnormal result: ~10x slower for AVX2 on Zen 5).
constexpr float kExpHi = 88.75f;
constexpr float kExpLo = -104.0f;
// 1.5 * 2^23: x log2e + kRound rounds x log2e to an integer n held in the
// low mantissa bits (|n| < 2^22).
constexpr float kRound = 0x1.8p23f;
// The same with the exponent bias 127 added: for n + 127 in [1, 254] the
// low 9 bits of the sum are n + 127, so shifting its bits left by 23 gives
// the bits of 2^n. Used where |x| <= kExpFast, which keeps n in [-126, 126]
// and p 2^n normal (the fast path; the rest takes the full path).
constexpr float kRoundBiased = 0x1.8p23f + 127.0f;
constexpr float kExpFast = 87.0f;

// The table form, on AVX-512 (simd/avx512/vmath_avx512.h): exp(x) =
// 2^q 2^(j/16) exp(r), n = round(16 x / ln 2) = 16 q + j (j in 0..15),
// r = x - n ln2/16 (Cody-Waite again), |r| <= ln2/32 (+ a hair). 2^(j/16)
// comes from a 16-entry table (one permute), so exp(r) needs only degree 3:
// exp(r) - 1 ~ r + c2 r^2 + c3 r^3, minimax for relative error on
// [-ln2/32, ln2/32] (own fit), 1.6e-9 = 0.03 ulp. With the table entries
// rounded to f32 (0.5 ulp) and the final fma's rounding: 0.99 ulp at most,
// measured against double exp over every f32 in [-87, 87].
constexpr float kExp16Log2e = 0x1.715476p+4f;      // 16 / ln 2
constexpr float kLn2Over16Hi = 0x1.62e430p-5f;     // float(ln2 / 16)
constexpr float kLn2Over16Lo = -0x1.05c610p-33f;   // ln2/16 - kLn2Over16Hi
constexpr float kExpLutC2 = 0x1.00021ep-1f;
constexpr float kExpLutC3 = 0x1.55559ep-3f;
// Bits of 2^(j/16) rounded to nearest f32, j = 0..15.
constexpr unsigned kExp2Sixteenths[16] = {
    0x3f800000u, 0x3f85aac3u, 0x3f8b95c2u, 0x3f91c3d3u, 0x3f9837f0u, 0x3f9ef532u,
    0x3fa5fed7u, 0x3fad583fu, 0x3fb504f3u, 0x3fbd08a4u, 0x3fc5672au, 0x3fce248cu,
    0x3fd744fdu, 0x3fe0ccdfu, 0x3feac0c7u, 0x3ff5257du};

// tanh(x) for |x| < kTanhSmall: x + x^3 (t0 + y (t1 + ... + y t4)), y = x^2,
// minimax for relative error on [0, 0.625] (own Remez), 4.4e-9 = 0.04 ulp.
// For |x| >= kTanhSmall: tanh|x| = em1 / (em1 + 2), em1 = expm1(2|x|)
// = fma(2^n, exp(r), -1), |x| clamped to kTanhSat where tanh rounds to 1.
constexpr float kTanhSmall = 0.625f;
constexpr float kTanhSat = 10.0f;
constexpr float kTanhT0 = -0x1.555532p-2f;
constexpr float kTanhT1 = 0x1.110726p-3f;
constexpr float kTanhT2 = -0x1.b83c5ap-5f;
constexpr float kTanhT3 = 0x1.52269cp-6f;
constexpr float kTanhT4 = -0x1.75e1cep-8f;

}  // namespace flce::simd::vmath
