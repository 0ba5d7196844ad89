// flce/tensor.h: a non-owning view of an array on some device.
//
// Every argument of the public API is a Tensor: inputs, outputs and
// cotangents alike. A view carries where the data lives (device), how each
// element is stored (dtype), and its shape and strides in elements, so a
// backend never has to guess layouts and a GPU backend can accept device
// pointers through the same struct.
#pragma once

#include <cstddef>
#include <cstdint>

namespace flce {

enum class Dtype : int {
  f32,   // IEEE binary32
  f64,   // IEEE binary64
  bf16,  // bfloat16, stored as its 16 bits
  f16,   // IEEE binary16, stored as its 16 bits
  i32,
  i64,
};

enum class Device : int { cpu, cuda };

// "f32", "bf16", ...; nullptr for a value outside the enum.
const char* dtype_name(Dtype dtype);
// Bytes per element.
size_t dtype_size(Dtype dtype);
bool dtype_is_float(Dtype dtype);

// A view of a 0-D, 1-D or 2-D array. `ndim == -1` means "not given": the
// optional arguments of the API (bias, weights, cotangents, outputs that are
// not wanted) are left that way.
struct Tensor {
  void* data = nullptr;
  Dtype dtype = Dtype::f32;
  Device device = Device::cpu;
  int device_index = 0;
  int ndim = -1;
  int64_t shape[2] = {0, 0};
  int64_t stride[2] = {0, 0};  // in elements, not bytes

  bool present() const { return ndim >= 0; }
  int64_t numel() const;
};

// Contiguous, row-major views of host memory. The pointer is taken as
// writable for outputs; inputs are only ever read.
Tensor scalar_view(const void* data, Dtype dtype);
Tensor vector_view(const void* data, Dtype dtype, int64_t n);
Tensor matrix_view(const void* data, Dtype dtype, int64_t rows, int64_t cols);

}  // namespace flce
