// One generic rounding routine serves both 16-bit formats: scale |v| by the
// format's quantum at its exponent, round to an integer (ties to even, the
// default FP environment), scale back. Every step but the rounding is exact
// in double, so the result is the correctly rounded value.
#include "common/float16.h"

#include <cmath>
#include <cstring>

namespace flce {
namespace {

struct Format16 {
  int mantissa_bits;  // stored fraction bits (7 for bf16, 10 for f16)
  int bias;           // exponent bias (127, 15)
  int emax;           // largest unbiased exponent of a finite value
  uint16_t quiet_nan;
};
constexpr Format16 kBf16{7, 127, 127, 0x7FC0};
constexpr Format16 kF16{10, 15, 15, 0x7E00};

uint16_t round_to_format(double v, const Format16& f) {
  const uint16_t sign = std::signbit(v) ? 0x8000 : 0;
  const uint16_t inf = uint16_t((2 * f.bias + 1) << f.mantissa_bits);
  if (std::isnan(v)) return sign | f.quiet_nan;
  double a = std::fabs(v);
  if (std::isinf(a)) return sign | inf;
  if (a == 0) return sign;
  const int emin = 1 - f.bias;
  int exp2 = 0;
  std::frexp(a, &exp2);  // a = m * 2^exp2, m in [0.5, 1)
  const int e = std::max(exp2 - 1, emin);
  const double quantum = std::ldexp(1.0, e - f.mantissa_bits);
  const double rounded = std::nearbyint(a / quantum) * quantum;
  if (rounded >= std::ldexp(1.0, f.emax + 1)) return sign | inf;
  if (rounded < std::ldexp(1.0, emin)) {  // subnormal (or zero)
    const double units = rounded / std::ldexp(1.0, emin - f.mantissa_bits);
    return sign | uint16_t(units);
  }
  std::frexp(rounded, &exp2);  // rounding may have carried into a new binade
  const int biased = exp2 - 1 + f.bias;
  const double fraction =
      rounded / std::ldexp(1.0, exp2 - 1 - f.mantissa_bits) - std::ldexp(1.0, f.mantissa_bits);
  return sign | uint16_t(biased << f.mantissa_bits) | uint16_t(fraction);
}

}  // namespace

float bf16_to_f32(uint16_t bits) {
  const uint32_t wide = uint32_t(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
}

float f16_to_f32(uint16_t bits) {
  const int exponent = (bits >> 10) & 0x1F;
  const int fraction = bits & 0x3FF;
  double magnitude;
  if (exponent == 0x1F) {
    magnitude = fraction ? NAN : INFINITY;
  } else if (exponent == 0) {
    magnitude = std::ldexp(double(fraction), -24);  // subnormal: f * 2^-14 / 2^10
  } else {
    magnitude = std::ldexp(double(fraction | 0x400), exponent - 25);
  }
  return float((bits & 0x8000) ? -magnitude : magnitude);
}

// bf16 is the top half of an f32: for a finite f32, adding half an ulp of
// bf16 less one, plus the lowest kept bit, and truncating rounds to nearest
// even. Exact and much faster than the generic routine, which stays for
// values that are not f32s (rounding them through f32 would round twice).
uint16_t f32_to_bf16(float value) {
  uint32_t u;
  std::memcpy(&u, &value, sizeof u);
  if ((u & 0x7F800000) == 0x7F800000) return round_to_format(value, kBf16);  // Inf, NaN
  return uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
uint16_t f64_to_bf16(double value) {
  const float narrow = float(value);
  if (double(narrow) == value) return f32_to_bf16(narrow);
  return round_to_format(value, kBf16);
}
uint16_t f32_to_f16(float value) { return round_to_format(value, kF16); }
uint16_t f64_to_f16(double value) { return round_to_format(value, kF16); }

}  // namespace flce
