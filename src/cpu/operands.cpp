#include "cpu/operands.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/float16.h"
#include "common/tensor_access.h"

namespace flce::cpu {
namespace {

float f32_of_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t bits_of_f32(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Round-to-nearest-even on the f32 bits, the bf16 in the upper half; NaN
// stays a quiet NaN. Branch-free, so that the loops below vectorize.
inline uint32_t bf16_rounded_bits(uint32_t u) {
  const uint32_t nearest_even = u + 0x7FFF + ((u >> 16) & 1);
  return (u & 0x7FFFFFFF) > 0x7F800000 ? (u | 0x400000) : nearest_even;
}

uint16_t bf16_of(float f) { return uint16_t(bf16_rounded_bits(bits_of_f32(f)) >> 16); }

float f32_of_f16(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1F, fraction = h & 0x3FF;
  if (exponent == 0) {  // zero or subnormal: fraction * 2^-24
    const float magnitude = float(fraction) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 0x1F) return f32_of_bits(sign | 0x7F800000 | (fraction << 13));
  return f32_of_bits(sign | ((exponent + 112) << 23) | (fraction << 13));
}

// Reads element `offset` of a storage-dtype array as f32.
template <Dtype From>
float read_f32(const void* base, int64_t offset) {
  if constexpr (From == Dtype::f32) {
    return static_cast<const float*>(base)[offset];
  } else if constexpr (From == Dtype::bf16) {
    return f32_of_bits(uint32_t(static_cast<const uint16_t*>(base)[offset]) << 16);
  } else {
    return f32_of_f16(static_cast<const uint16_t*>(base)[offset]);
  }
}

// out[r * cols + c] = src(r, c) converted, for a strided 2-D source.
template <Dtype From>
void convert_2d(const void* src, int64_t rs, int64_t cs, int64_t rows, int64_t cols, Dtype to,
                void* out) {
  for (int64_t r = 0; r < rows; ++r) {
    if (to == Dtype::f32) {
      float* o = static_cast<float*>(out) + r * cols;
      for (int64_t c = 0; c < cols; ++c) o[c] = read_f32<From>(src, r * rs + c * cs);
    } else if (From == Dtype::bf16) {  // bf16 -> bf16: a strided copy
      uint16_t* o = static_cast<uint16_t*>(out) + r * cols;
      for (int64_t c = 0; c < cols; ++c) o[c] = static_cast<const uint16_t*>(src)[r * rs + c * cs];
    } else {
      uint16_t* o = static_cast<uint16_t*>(out) + r * cols;
      for (int64_t c = 0; c < cols; ++c) o[c] = bf16_of(read_f32<From>(src, r * rs + c * cs));
    }
  }
}

// A [rows, cols] region of t starting at (r0, c0), with (rs, cs) the strides
// along the output's rows and columns.
void convert_region(const Tensor& t, int64_t start, int64_t rs, int64_t cs, int64_t rows,
                    int64_t cols, Dtype to, void* out) {
  const char* base = static_cast<const char*>(t.data) + start * int64_t(dtype_size(t.dtype));
  switch (t.dtype) {
    case Dtype::f32: convert_2d<Dtype::f32>(base, rs, cs, rows, cols, to, out); break;
    case Dtype::bf16: convert_2d<Dtype::bf16>(base, rs, cs, rows, cols, to, out); break;
    case Dtype::f16: convert_2d<Dtype::f16>(base, rs, cs, rows, cols, to, out); break;
    default: break;  // the cpu backend declines other storage dtypes
  }
}

}  // namespace

void load_rows(const Tensor& x, int64_t i0, int64_t rows, Dtype dtype, void* out) {
  convert_region(x, i0 * x.stride[0], x.stride[0], x.stride[1], rows, x.shape[1], dtype, out);
}

bool w_in_place(const Tensor& w, Dtype dtype) {
  return w.dtype == dtype && w.stride[1] == 1 && w.stride[0] >= w.shape[1] &&
         w.stride[0] <= INT_MAX;
}

WPiece w_piece(const Tensor& w, WeightLayout layout, int64_t j0, int64_t n, int64_t h0, int64_t hc,
               Dtype dtype, void* scratch) {
  const bool vh = layout == WeightLayout::vh;
  // Strides of W along the vocabulary and along the hidden dimension.
  const int64_t sj = vh ? w.stride[0] : w.stride[1], sh = vh ? w.stride[1] : w.stride[0];
  const int64_t start = j0 * sj + h0 * sh;
  if (w_in_place(w, dtype)) {
    const char* base = static_cast<const char*>(w.data) + start * int64_t(dtype_size(dtype));
    return {base, w.stride[0], vh};
  }
  convert_region(w, start, sj, sh, n, hc, dtype, scratch);
  return {scratch, hc, true};
}

namespace {

// The bf16 conversions run over every dlogit of a bf16 training step, so
// they are compiled for AVX-512 and AVX2 too (GCC picks a clone at load
// time). They are integer operations: every clone gives the same bits.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FLCE_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FLCE_VECTOR_CLONES
#endif

FLCE_VECTOR_CLONES void round_to_bf16(float* values, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, values + i, 4);
    u = bf16_rounded_bits(u) & 0xFFFF0000u;
    std::memcpy(values + i, &u, 4);
  }
}

}  // namespace

void round_to_storage(float* values, int64_t n, Dtype storage) {
  if (storage == Dtype::bf16) {
    round_to_bf16(values, n);
  } else if (storage == Dtype::f16) {
    for (int64_t i = 0; i < n; ++i) values[i] = f32_of_f16(f32_to_f16(values[i]));
  }
}

FLCE_VECTOR_CLONES void flush_subnormals(float* values, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    values[i] = std::fabs(values[i]) < std::numeric_limits<float>::min() ? 0.0f : values[i];
}

FLCE_VECTOR_CLONES void f32_to_bf16_bits(const float* in, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, in + i, 4);
    out[i] = uint16_t(bf16_rounded_bits(u) >> 16);
  }
}

void store_row(const Tensor& t, int64_t r, const float* src, int64_t n) {
  char* row = static_cast<char*>(t.data) + r * t.stride[0] * int64_t(dtype_size(t.dtype));
  const bool contiguous = n <= 1 || t.stride[1] == 1;
  if (contiguous && t.dtype == Dtype::f32) {
    std::memcpy(row, src, size_t(n) * 4);
  } else if (contiguous && t.dtype == Dtype::bf16) {
    f32_to_bf16_bits(src, n, reinterpret_cast<uint16_t*>(row));
  } else if (contiguous && t.dtype == Dtype::f16) {
    for (int64_t j = 0; j < n; ++j) {
      const uint16_t h = f32_to_f16(src[j]);
      std::memcpy(row + 2 * j, &h, 2);
    }
  } else {
    for (int64_t j = 0; j < n; ++j) store(t, r, j, src[j]);
  }
}

void f32_to_bf16_in_place(float* values, int64_t n) {
  // Through a stack buffer: no reliance on how a loop over aliasing float
  // and uint16_t pointers gets compiled.
  uint16_t buffer[256];
  for (int64_t i0 = 0; i0 < n; i0 += 256) {
    const int64_t len = std::min<int64_t>(256, n - i0);
    f32_to_bf16_bits(values + i0, len, buffer);
    std::memcpy(reinterpret_cast<char*>(values) + 2 * i0, buffer, size_t(len) * 2);
  }
}

}  // namespace flce::cpu
