// io/npy.h: reading and writing NumPy .npy files (format versions 1, 2, 3).
//
// The `flce run` CLI takes its inputs and writes its outputs as .npy files.
// Only the dtypes the library computes with are supported: float16, float32,
// float64, int32 and int64, little-endian, C order. Everything else is
// rejected with a message that names the file and says what is wrong, so a
// user can fix the file rather than guess.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "flce/tensor.h"

namespace flce::io {

struct NpyArray {
  // The file's dtype: f16 (<f2), f32 (<f4), f64 (<f8), i32 (<i4), i64 (<i8).
  Dtype dtype = Dtype::f32;
  std::vector<int64_t> shape;        // empty = 0-D
  std::vector<unsigned char> bytes;  // raw little-endian element data, C order
  int64_t numel() const;             // product of shape (1 for 0-D)
};

// Reads the .npy file at `path` into *out. Returns "" on success, else a
// message that starts with the path and says exactly what is wrong.
std::string read_npy(const std::string& path, NpyArray* out);

// The parser behind read_npy: parses the `size` bytes at `data`, naming them
// `name` in error messages. Bytes after the array data are ignored, as numpy
// does.
std::string parse_npy(const unsigned char* data, size_t size,
                      const std::string& name, NpyArray* out);

// Writes `array` to `path` as numpy would: little-endian, fortran_order
// False, header padded so that the data starts at a multiple of 64 bytes.
// `version` 0 picks the smallest of 1 or 2 that fits the header (like numpy);
// 1, 2 or 3 force that version (3 = utf-8 header). Returns "" on success,
// else a message that starts with the path.
std::string write_npy(const std::string& path, const NpyArray& array,
                      int version = 0);

// The bytes write_npy writes. Returns an empty vector when the array cannot
// be encoded (bf16 dtype, bytes not matching the shape, bad version, ...);
// write_npy reports the reason.
std::vector<unsigned char> encode_npy(const NpyArray& array, int version = 0);

}  // namespace flce::io
