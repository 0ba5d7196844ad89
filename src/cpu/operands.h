// GEMM operands of the cpu backend: blocks of x and pieces of W in the dtype
// a GEMM takes (f32 or bf16), used in place when they already are, else
// converted into scratch.
#pragma once

#include <cstdint>

#include "flce/flce.h"

namespace flce::cpu {

// Rows [i0, i0 + rows) of x (or of the logits) as a contiguous [rows, cols]
// array of `dtype` (f32 or bf16).
void load_rows(const Tensor& x, int64_t i0, int64_t rows, Dtype dtype, void* out);

// Vocabulary rows [j0, j0 + n) by hidden columns [h0, h0 + hc) of W.
struct WPiece {
  const void* data;
  int64_t ld;
  bool vocab_major;  // (j, h) at data[(j - j0) * ld + (h - h0)]; else data[(h - h0) * ld + (j - j0)]
};
// Whether the GEMMs may read W in place as `dtype`: W has that dtype, a unit
// inner stride and rows that do not overlap (a leading dimension of at least
// a row, as BLAS needs; an input's rows may overlap, e.g. a strided window),
// and a leading dimension that fits the GEMMs' int.
bool w_in_place(const Tensor& w, Dtype dtype);

// In place when w_in_place(w, dtype); otherwise converted into `scratch`
// (room for n * hc elements), vocab-major.
WPiece w_piece(const Tensor& w, WeightLayout layout, int64_t j0, int64_t n, int64_t h0, int64_t hc,
               Dtype dtype, void* scratch);

// f32 values rounded to bf16 or f16 precision and back, in place
// (grad_logits_dtype = storage on the f32 GEMM path).
void round_to_storage(float* values, int64_t n, Dtype storage);
// Every |value| below f32's normal range (2^-126) set to 0, in place.
void flush_subnormals(float* values, int64_t n);
// f32 -> bf16 bits, nearest even.
void f32_to_bf16_bits(const float* in, int64_t n, uint16_t* out);
// Row r of the 2-D tensor t = src[0, n), each value rounded once to t's
// dtype (the bits of store(), vectorized where the row is contiguous).
void store_row(const Tensor& t, int64_t r, const float* src, int64_t n);
// values[0, n) rounded to bf16 bits, written over the first 2n bytes of values.
void f32_to_bf16_in_place(float* values, int64_t n);

}  // namespace flce::cpu
