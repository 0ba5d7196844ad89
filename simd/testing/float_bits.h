// The bits of an f32 and back (memcpy: no aliasing questions), for checks
// that walk floats bit pattern by bit pattern (kernel_checks.h, and tests/).
#pragma once

#include <cstdint>
#include <cstring>

namespace flce::simd::testing {

inline uint32_t bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

inline float from_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

}  // namespace flce::simd::testing
