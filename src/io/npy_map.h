// io/npy_map.h: .npy files too large to read into memory.
//
// NpyMap maps a .npy file read-only (mmap) and gives a pointer to its data,
// so a caller can stream through an array of any size in blocks and drop
// the pages it has consumed (resident memory stays bounded by the block).
// NpyOutFile creates a .npy file of a known shape at full size and fills it
// in place, block by block, so an output of any size is written without
// holding it in memory.
//
// Headers are judged by the parser of io/npy.h (parse_npy), so a malformed
// file gets exactly the message `read_npy` would give it. The formats,
// dtypes and byte order accepted are the same: versions 1, 2 and 3;
// float16, float32, float64, int32, int64; little-endian, C order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "flce/tensor.h"

namespace flce::io {

// What a .npy header says, and where the data starts.
struct NpyHeader {
  Dtype dtype = Dtype::f32;
  std::vector<int64_t> shape;  // empty = 0-D
  size_t data_offset = 0;      // bytes from the start of the file
  int64_t numel = 0;           // product of shape (1 for 0-D)
  size_t data_bytes = 0;       // numel * element size
};

// Parses the header of the .npy file whose first `size` bytes are at `data`
// (the whole file: the data must be there, as parse_npy requires) without
// copying the array data. Returns "" or parse_npy's message for the file,
// which starts with `name`.
std::string parse_npy_header(const unsigned char* data, size_t size,
                             const std::string& name, NpyHeader* out);

// A .npy file mapped read-only (private mapping, never written).
class NpyMap {
 public:
  NpyMap() = default;
  ~NpyMap() { close(); }
  NpyMap(const NpyMap&) = delete;
  NpyMap& operator=(const NpyMap&) = delete;

  // Maps the file at `path` and parses its header. Returns "" or a message
  // that starts with the path (the same as read_npy's for a bad file).
  std::string open(const std::string& path);
  void close();

  const NpyHeader& header() const { return header_; }
  Dtype dtype() const { return header_.dtype; }
  const std::vector<int64_t>& shape() const { return header_.shape; }
  int64_t numel() const { return header_.numel; }
  // The first element (file bytes at header().data_offset): aligned to the
  // page plus the data offset, so to the element size only when the offset
  // is (numpy pads headers to 64 bytes; hand-made files may not).
  const unsigned char* data() const { return base_ + header_.data_offset; }
  const std::string& path() const { return path_; }

  // madvise(MADV_SEQUENTIAL) on the data: read ahead, reclaim behind.
  void advise_sequential() const;
  // Drops the pages that lie wholly in data bytes [0, end) and were not
  // dropped before (madvise(MADV_DONTNEED): the mapping is private and
  // read-only, so a later access would read them back from the file). Keeps
  // the resident memory of a front-to-back scan bounded.
  void release_before(size_t end);
  // Starts another front-to-back scan: release_before drops from the start
  // again (eval scans the labels once to check them, then block by block;
  // without it the second scan's pages stayed resident, 8 bytes a row).
  void rescan() { released_ = 0; }

  // "" while the file is as it was opened, else a message starting with the
  // path: another process changed its size or its modification time. A
  // mapping shows such a change (a dropped page reads back the new bytes;
  // one past a new end is a SIGBUS), so a long scan checks between blocks.
  std::string changed() const;
  // Whether `address` lies in the mapping (for a SIGBUS handler).
  bool maps(const void* address) const;

 private:
  unsigned char* base_ = nullptr;  // the mapping; nullptr for an empty file
  size_t size_ = 0;                // file size = mapping length
  size_t released_ = 0;            // file bytes [0, released_) were dropped
  int fd_ = -1;                    // kept open for changed()
  int64_t mtime_ns_ = 0;           // the modification time when opened
  NpyHeader header_;
  std::string path_;
};

// A .npy file created at its full size and filled in place.
class NpyOutFile {
 public:
  NpyOutFile() = default;
  ~NpyOutFile();  // closes the file if open; never removes it
  NpyOutFile(const NpyOutFile&) = delete;
  NpyOutFile& operator=(const NpyOutFile&) = delete;

  // Creates (or truncates) `path` as a .npy file of `dtype` (f16, f32, f64,
  // i32 or i64) and `shape` (at least 1-D), its header written as numpy
  // writes it and its data zero. Returns "" or a message starting with the
  // path.
  std::string create(const std::string& path, Dtype dtype, const std::vector<int64_t>& shape);
  // Writes `count` elements from `src` at element index `first` (C order).
  std::string write(int64_t first, const void* src, int64_t count);
  // Closes the file; "" or the error (a failed close means lost data).
  std::string close();
  const std::string& path() const { return path_; }

 private:
  int fd_ = -1;
  std::string path_;
  size_t data_offset_ = 0;
  size_t element_size_ = 0;
  int64_t numel_ = 0;
};

}  // namespace flce::io
