// Test helpers for .npy files on disk: a scratch directory per test, arrays
// written from plain doubles, and raw .npy bytes assembled by hand for the
// malformed-file cases.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "flce/tensor.h"
#include "io/npy.h"

namespace flce_test {

using Bytes = std::vector<unsigned char>;

// A fresh directory under $TMPDIR (default /tmp), removed with everything in
// it when the object dies.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// An array of `dtype` (f16, f32, f64, i32 or i64) holding `values`, converted
// (rounded for f16/f32, truncated for the integer types).
flce::io::NpyArray npy_array(flce::Dtype dtype, std::vector<int64_t> shape,
                             const std::vector<double>& values);

// Writes npy_array(...) to `path`; throws std::runtime_error on failure.
// Returns `path`.
std::string write_array(const std::string& path, flce::Dtype dtype, std::vector<int64_t> shape,
                        const std::vector<double>& values);

// Every element of `a` as a double, in C order.
std::vector<double> npy_values(const flce::io::NpyArray& a);

// Hand-made .npy bytes: the magic, version `major`.0, the header length
// field, `header` padded with spaces and a final '\n' to a 64-byte boundary,
// then `data`. Nothing is checked, so any header can be written.
Bytes npy_bytes(std::string_view header, const Bytes& data, int major = 1);

// Raw bytes to and from files; throw std::runtime_error on failure.
void write_bytes(const std::string& path, const Bytes& bytes);
Bytes read_bytes(const std::string& path);

// Name -> contents of every entry directly in `dir`, hidden ones included
// (a subdirectory maps to no bytes); empty when `dir` does not exist.
std::map<std::string, Bytes> snapshot_dir(const std::string& dir);

// Sets a file's immutable flag (chattr +i) for its lifetime, so that even
// root cannot remove or replace the file; ok() is false where the
// filesystem or the user's privileges do not allow the flag.
class ImmutableFile {
 public:
  explicit ImmutableFile(std::string path);
  ~ImmutableFile();  // clears the flag, else the file's TempDir cannot go
  ImmutableFile(const ImmutableFile&) = delete;
  ImmutableFile& operator=(const ImmutableFile&) = delete;
  bool ok() const { return ok_; }

 private:
  std::string path_;
  bool ok_ = false;
};

}  // namespace flce_test
