// Dtype names and sizes, and the contiguous host views of flce/tensor.h.
#include "flce/tensor.h"

namespace flce {

const char* dtype_name(Dtype dtype) {
  switch (dtype) {
    case Dtype::f32: return "f32";
    case Dtype::f64: return "f64";
    case Dtype::bf16: return "bf16";
    case Dtype::f16: return "f16";
    case Dtype::i32: return "i32";
    case Dtype::i64: return "i64";
  }
  return nullptr;
}

size_t dtype_size(Dtype dtype) {
  switch (dtype) {
    case Dtype::f32: case Dtype::i32: return 4;
    case Dtype::f64: case Dtype::i64: return 8;
    case Dtype::bf16: case Dtype::f16: return 2;
  }
  return 0;
}

bool dtype_is_float(Dtype dtype) {
  return dtype == Dtype::f32 || dtype == Dtype::f64 || dtype == Dtype::bf16 ||
         dtype == Dtype::f16;
}

int64_t Tensor::numel() const {
  if (ndim < 0) return 0;
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

Tensor scalar_view(const void* data, Dtype dtype) {
  Tensor t;
  t.data = const_cast<void*>(data);
  t.dtype = dtype;
  t.ndim = 0;
  return t;
}

Tensor vector_view(const void* data, Dtype dtype, int64_t n) {
  Tensor t = scalar_view(data, dtype);
  t.ndim = 1;
  t.shape[0] = n;
  t.stride[0] = 1;
  return t;
}

Tensor matrix_view(const void* data, Dtype dtype, int64_t rows, int64_t cols) {
  Tensor t = scalar_view(data, dtype);
  t.ndim = 2;
  t.shape[0] = rows;
  t.shape[1] = cols;
  t.stride[0] = cols;
  t.stride[1] = 1;
  return t;
}

}  // namespace flce
