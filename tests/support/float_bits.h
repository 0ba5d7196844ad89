// The bits of an f32 and back (memcpy: no aliasing questions), for tests
// that walk floats bit pattern by bit pattern.
#pragma once

#include <cstdint>
#include <cstring>

namespace flce_test {

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace flce_test
