// bf16 and f16 <-> f32/f64 conversions. Narrowing rounds to nearest, ties to
// even, directly from the source value (an f64 is rounded once, never through
// f32), with overflow to +-Inf and NaN kept NaN (quiet).
#pragma once

#include <cstdint>

namespace flce {

float bf16_to_f32(uint16_t bits);
float f16_to_f32(uint16_t bits);
uint16_t f32_to_bf16(float value);
uint16_t f64_to_bf16(double value);
uint16_t f32_to_f16(float value);
uint16_t f64_to_f16(double value);

}  // namespace flce
