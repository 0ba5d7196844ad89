// Element access to host Tensors in float64, for the reference backend, the
// validation and the CLI: one switch on the dtype per call or per row. Hot
// paths of fast backends never use these.
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>

#include "common/float16.h"
#include "flce/tensor.h"

namespace flce {

template <typename T>
inline T raw_at(const Tensor& t, int64_t offset) {
  T value;
  std::memcpy(&value, static_cast<const char*>(t.data) + offset * sizeof(T), sizeof(T));
  return value;
}

// Element at an offset in elements from t.data, converted exactly to double.
inline double load_at(const Tensor& t, int64_t offset) {
  switch (t.dtype) {
    case Dtype::f32: return raw_at<float>(t, offset);
    case Dtype::f64: return raw_at<double>(t, offset);
    case Dtype::bf16: return bf16_to_f32(raw_at<uint16_t>(t, offset));
    case Dtype::f16: return f16_to_f32(raw_at<uint16_t>(t, offset));
    case Dtype::i32: return raw_at<int32_t>(t, offset);
    case Dtype::i64: return double(raw_at<int64_t>(t, offset));
  }
  return 0;
}

inline int64_t load_int_at(const Tensor& t, int64_t offset) {
  return t.dtype == Dtype::i32 ? raw_at<int32_t>(t, offset) : raw_at<int64_t>(t, offset);
}

// Store `value` rounded to t's dtype (nearest even for bf16 and f16).
inline void store_at(const Tensor& t, int64_t offset, double value) {
  char* base = static_cast<char*>(t.data);
  auto put = [&](auto v) { std::memcpy(base + offset * sizeof(v), &v, sizeof(v)); };
  switch (t.dtype) {
    case Dtype::f32: put(float(value)); break;
    case Dtype::f64: put(value); break;
    case Dtype::bf16: put(f64_to_bf16(value)); break;
    case Dtype::f16: put(f64_to_f16(value)); break;
    case Dtype::i32: put(int32_t(value)); break;
    case Dtype::i64: put(int64_t(value)); break;
  }
}

// 0-D and 1-D access.
inline double load(const Tensor& t, int64_t i = 0) {
  return load_at(t, t.ndim == 0 ? 0 : i * t.stride[0]);
}
inline int64_t load_int(const Tensor& t, int64_t i) { return load_int_at(t, i * t.stride[0]); }
inline void store(const Tensor& t, int64_t i, double value) {
  store_at(t, t.ndim == 0 ? 0 : i * t.stride[0], value);
}

// 2-D access.
inline double load(const Tensor& t, int64_t r, int64_t c) {
  return load_at(t, r * t.stride[0] + c * t.stride[1]);
}
inline void store(const Tensor& t, int64_t r, int64_t c, double value) {
  store_at(t, r * t.stride[0] + c * t.stride[1], value);
}

// Row r of a 2-D tensor into out[0, shape[1]).
// The switch sits outside the loop: this feeds the reference's dot products.
inline void load_row(const Tensor& t, int64_t r, double* out) {
  const int64_t n = t.shape[1], step = t.stride[1], start = r * t.stride[0];
  auto convert = [&](auto decode) {
    for (int64_t c = 0; c < n; ++c) out[c] = decode(start + c * step);
  };
  switch (t.dtype) {
    case Dtype::f32: convert([&](int64_t o) { return double(raw_at<float>(t, o)); }); break;
    case Dtype::f64: convert([&](int64_t o) { return raw_at<double>(t, o); }); break;
    case Dtype::bf16: convert([&](int64_t o) { return double(bf16_to_f32(raw_at<uint16_t>(t, o))); }); break;
    case Dtype::f16: convert([&](int64_t o) { return double(f16_to_f32(raw_at<uint16_t>(t, o))); }); break;
    default: convert([&](int64_t o) { return load_at(t, o); }); break;
  }
}

// The same matrix seen transposed: swaps shape and strides, no copy.
inline Tensor transposed(Tensor t) {
  std::swap(t.shape[0], t.shape[1]);
  std::swap(t.stride[0], t.stride[1]);
  return t;
}

}  // namespace flce
