// io/npy_map.cpp: memory-mapped .npy input, in-place .npy output (see
// npy_map.h).
//
// No second .npy parser lives here. parse_npy (io/npy.cpp) judges every
// header; it needs the array data to be present and copies it, so this file
// calls it only where it cannot reach the copy:
//   1. on the preamble and header alone: a malformed file fails there with
//      parse_npy's own message (only a well-formed header with data fails
//      later, on the data length or the int64 size check);
//   2. on a copy of the header with a shape of no elements appended (a
//      repeated key replaces the value, as in Python), as many of whose
//      dimensions are above 1 as the file's (which decides whether a
//      fortran_order array is also C-ordered): the header is then proven
//      well-formed apart from its shape, and parse_npy returns its dtype;
//   3. on the whole file only when the data is too short, where it fails
//      before copying anything, with its own message.
// The shape itself is read by a plain scan of the header's `'shape': (d0,
// d1, ...)` tuple, before step 2 proves the header (a header it cannot
// prove fails with parse_npy's message of step 1). Output headers are encode_npy's header of
// the same array with no rows, the first dimension then put in place using
// the spaces numpy reserves for it (GROWTH_AXIS_MAX_DIGITS), and checked by
// reading the created file back.
#include "io/npy_map.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string_view>

#include "io/npy.h"

namespace flce::io {
namespace {

constexpr unsigned char kMagic[] = {0x93, 'N', 'U', 'M', 'P', 'Y'};

// The magic, version and header length of a file that has them all; false
// otherwise (parse_npy then says what is wrong).
bool read_preamble(const unsigned char* data, size_t size, int* major, size_t* prefix,
                   size_t* header_len) {
  if (size < 8 || std::memcmp(data, kMagic, sizeof kMagic) != 0) return false;
  *major = data[6];
  if (*major < 1 || *major > 3 || data[7] != 0) return false;
  const size_t len_bytes = *major == 1 ? 2 : 4;
  *prefix = 8 + len_bytes;
  if (size < *prefix) return false;
  uint64_t len = 0;
  for (size_t i = 0; i < len_bytes; ++i) len |= uint64_t{data[8 + i]} << (8 * i);
  if (len > size - *prefix) return false;
  *header_len = size_t(len);
  return true;
}

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

// `header` (the dict text) with `'shape': (min(d0, 2), ..., 0)` added as its
// last entry (no elements; as many dimensions above 1 as `shape`), in a
// version 2 (or 3, for a utf-8 header) preamble; empty when there is no
// closing brace to put it in front of.
std::vector<unsigned char> probe_without_elements(std::string_view header, int major,
                                                  const std::vector<int64_t>& shape) {
  std::string text(header);
  const size_t close = text.rfind('}');
  if (close == std::string::npos) return {};
  size_t k = close;
  while (k > 0 && is_space(text[k - 1])) --k;
  const bool comma = k > 0 && text[k - 1] == ',';
  std::string tuple = "(";
  for (int64_t d : shape) tuple += std::to_string(std::min<int64_t>(d, 2)) + ", ";
  tuple += "0,)";
  text.insert(close, (comma ? " 'shape': " : ", 'shape': ") + tuple + (comma ? ", " : " "));
  std::vector<unsigned char> bytes(kMagic, kMagic + sizeof kMagic);
  bytes.push_back(static_cast<unsigned char>(major == 3 ? 3 : 2));
  bytes.push_back(0);
  const uint64_t len = text.size();
  for (int i = 0; i < 4; ++i) bytes.push_back(static_cast<unsigned char>(len >> (8 * i)));
  bytes.insert(bytes.end(), text.begin(), text.end());
  return bytes;
}

// The last `'shape': (...)` tuple of a header parse_npy has accepted (the
// last one is the one Python keeps). False if there is none.
bool scan_shape(std::string_view t, std::vector<int64_t>* shape) {
  size_t pos = std::string_view::npos;
  for (std::string_view key : {"'shape'", "\"shape\""}) {
    const size_t at = t.rfind(key);
    if (at != std::string_view::npos && (pos == std::string_view::npos || at > pos)) pos = at;
  }
  if (pos == std::string_view::npos) return false;
  pos += 7;
  auto skip = [&] {
    while (pos < t.size() && is_space(t[pos])) ++pos;
  };
  skip();
  if (pos >= t.size() || t[pos] != ':') return false;
  ++pos;
  skip();
  if (pos >= t.size() || t[pos] != '(') return false;
  ++pos;
  shape->clear();
  for (;;) {
    skip();
    if (pos >= t.size()) return false;
    if (t[pos] == ')') return true;
    const size_t start = pos;
    int64_t v = 0;
    while (pos < t.size() && t[pos] >= '0' && t[pos] <= '9') {
      if (__builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, t[pos] - '0', &v))
        return false;
      ++pos;
    }
    const std::string_view digits = t.substr(start, pos - start);
    if (digits.empty() || (digits[0] == '0' && digits.find_first_not_of('0') != digits.npos))
      return false;  // parse_dim's rules
    if (pos < t.size() && t[pos] == 'L') ++pos;  // Python 2's long suffix
    shape->push_back(v);
    skip();
    if (pos < t.size() && t[pos] == ',') ++pos;
  }
}

std::string errno_text(int e) { return std::strerror(e != 0 ? e : EIO); }

}  // namespace

std::string parse_npy_header(const unsigned char* data, size_t size, const std::string& name,
                             NpyHeader* out) {
  NpyArray array;
  int major = 0;
  size_t prefix = 0, header_len = 0;
  if (!read_preamble(data, size, &major, &prefix, &header_len)) {
    // parse_npy fails on the same preamble, before it reads any data.
    std::string err = parse_npy(data, size, name, &array);
    return err.empty() ? name + ": malformed .npy preamble" : err;
  }
  const size_t end = prefix + header_len;
  // 1. The header alone: an array with no data parses completely here.
  const std::string header_error = parse_npy(data, end, name, &array);
  if (header_error.empty()) {
    *out = {array.dtype, array.shape, end, array.numel(), 0};
    return "";
  }
  // 2. Well-formed apart from the shape? Then this gives the dtype.
  const std::string_view text(reinterpret_cast<const char*>(data + prefix), header_len);
  NpyHeader h;
  if (!scan_shape(text, &h.shape)) return header_error;
  const std::vector<unsigned char> probe = probe_without_elements(text, major, h.shape);
  if (probe.empty() || !parse_npy(probe.data(), probe.size(), name, &array).empty())
    return header_error;
  h.dtype = array.dtype;
  // The int64 size checks parse_npy made on this shape (header_error says
  // which one failed, if one did).
  int64_t numel = 1, nbytes = 0;
  bool empty = false;
  for (int64_t d : h.shape) {
    if (d == 0) empty = true;
    if (!empty && __builtin_mul_overflow(numel, d, &numel)) return header_error;
  }
  if (empty) numel = 0;
  if (__builtin_mul_overflow(numel, int64_t(dtype_size(h.dtype)), &nbytes)) return header_error;
  // 3. Too little data: parse_npy says so before it copies anything.
  if (uint64_t(nbytes) > size - end) {
    std::string err = parse_npy(data, size, name, &array);
    return err.empty() ? header_error : err;
  }
  h.data_offset = end;
  h.numel = numel;
  h.data_bytes = size_t(nbytes);
  *out = std::move(h);
  return "";
}

// ---- NpyMap ----

namespace {

int64_t mtime_ns(const struct stat& st) {
  return int64_t(st.st_mtim.tv_sec) * 1000000000 + int64_t(st.st_mtim.tv_nsec);
}

}  // namespace

std::string NpyMap::open(const std::string& path) {
  close();
  path_ = path;
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) return path + ": cannot open: " + std::strerror(errno);
  struct stat st;
  if (::fstat(fd_, &st) != 0) {
    const int e = errno;
    close();
    return path + ": cannot read: " + errno_text(e);
  }
  if (!S_ISREG(st.st_mode)) {
    close();
    return path + ": cannot read: " +
           (S_ISDIR(st.st_mode) ? errno_text(EISDIR) : std::string("not a regular file"));
  }
  mtime_ns_ = mtime_ns(st);
  size_ = size_t(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd_, 0);
    if (p == MAP_FAILED) {
      const int e = errno;
      size_ = 0;
      close();
      return path + ": cannot map: " + errno_text(e);
    }
    base_ = static_cast<unsigned char*>(p);
  }
  static const unsigned char kNothing[1] = {0};
  std::string err = parse_npy_header(base_ ? base_ : kNothing, size_, path, &header_);
  if (!err.empty()) close();
  return err;
}

void NpyMap::close() {
  if (base_ != nullptr) ::munmap(base_, size_);
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  base_ = nullptr;
  size_ = 0;
  released_ = 0;
  header_ = NpyHeader{};
}

void NpyMap::advise_sequential() const {
  if (base_ == nullptr) return;
  // Advice only: a kernel that ignores it changes nothing but speed.
  (void)::madvise(base_, size_, MADV_SEQUENTIAL);
}

void NpyMap::release_before(size_t end) {
  if (base_ == nullptr) return;
  const size_t page = size_t(::sysconf(_SC_PAGESIZE));
  const size_t stop = std::min(header_.data_offset + end, size_) / page * page;
  if (stop <= released_) return;
  if (::madvise(base_ + released_, stop - released_, MADV_DONTNEED) == 0) released_ = stop;
}

std::string NpyMap::changed() const {
  if (fd_ < 0) return "";
  struct stat st;
  if (::fstat(fd_, &st) != 0) return path_ + ": cannot read: " + errno_text(errno);
  if (size_t(st.st_size) != size_)
    return path_ + ": changed while it was read (" + std::to_string(size_) + " bytes, now " +
           std::to_string(st.st_size) + ")";
  if (mtime_ns(st) != mtime_ns_)
    return path_ + ": changed while it was read (rewritten: its modification time moved)";
  return "";
}

bool NpyMap::maps(const void* address) const {
  const auto* a = static_cast<const unsigned char*>(address);
  return base_ != nullptr && a >= base_ && a < base_ + size_;
}

// ---- NpyOutFile ----

NpyOutFile::~NpyOutFile() {
  if (fd_ >= 0) ::close(fd_);
}

std::string NpyOutFile::create(const std::string& path, Dtype dtype,
                               const std::vector<int64_t>& shape) {
  if (fd_ >= 0) (void)close();
  path_ = path;
  auto fail = [&](const std::string& what) { return path + ": cannot write: " + what; };
  if (shape.empty()) return fail("a 0-D array is not written in place");
  for (int64_t d : shape)
    if (d < 0) return fail("negative size in the shape");
  // encode_npy's header of the array with no rows: no data follows it.
  NpyArray rowless;
  rowless.dtype = dtype;
  rowless.shape = shape;
  rowless.shape[0] = 0;
  std::vector<unsigned char> head = encode_npy(rowless);
  if (head.empty())
    return fail(std::string("dtype ") + (dtype_name(dtype) ? dtype_name(dtype) : "?") +
                " has no .npy equivalent");
  // Put the first dimension in place of the 0, taking the room from the
  // padding spaces in front of the final '\n' so the data offset is kept.
  static constexpr std::string_view kKey = "'shape': (0";
  auto at = std::search(head.begin(), head.end(), kKey.begin(), kKey.end());
  const std::string rows = std::to_string(shape[0]);
  const size_t extra = rows.size() - 1;
  if (at == head.end() || head.back() != '\n' || head.size() < extra + 1)
    return fail("unexpected header from encode_npy");
  for (size_t k = 0; k < extra; ++k)
    if (head[head.size() - 2 - k] != ' ') return fail("no room in the header for the shape");
  head.erase(head.end() - 1 - long(extra), head.end() - 1);
  const size_t zero = size_t(at - head.begin()) + kKey.size() - 1;
  head.erase(head.begin() + long(zero));
  head.insert(head.begin() + long(zero), rows.begin(), rows.end());

  numel_ = 1;
  for (int64_t d : shape)
    if (__builtin_mul_overflow(numel_, d, &numel_)) return fail("the shape overflows int64");
  element_size_ = dtype_size(dtype);
  data_offset_ = head.size();
  int64_t nbytes = 0;
  if (__builtin_mul_overflow(numel_, int64_t(element_size_), &nbytes) ||
      __builtin_add_overflow(nbytes, int64_t(data_offset_), &nbytes))
    return fail("the array is too large");

  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (fd_ < 0) return path + ": cannot open for writing: " + std::strerror(errno);
  size_t done = 0;
  while (done < head.size()) {
    const ssize_t w = ::pwrite(fd_, head.data() + done, head.size() - done, off_t(done));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return fail(errno_text(w < 0 ? errno : EIO));
    done += size_t(w);
  }
  if (::ftruncate(fd_, off_t(nbytes)) != 0) return fail(errno_text(errno));

  // Read the header back with the parser: the file must say what we meant.
  NpyMap check;
  if (std::string e = check.open(path); !e.empty()) return fail("the header does not parse: " + e);
  if (check.dtype() != dtype || check.shape() != shape ||
      check.header().data_offset != data_offset_)
    return fail("the header does not read back as written");
  return "";
}

std::string NpyOutFile::write(int64_t first, const void* src, int64_t count) {
  if (fd_ < 0) return path_ + ": cannot write: the file is not open";
  if (first < 0 || count < 0 || first > numel_ || count > numel_ - first)
    return path_ + ": cannot write: elements [" + std::to_string(first) + ", " +
           std::to_string(first + count) + ") are outside the array of " +
           std::to_string(numel_);
  const auto* bytes = static_cast<const unsigned char*>(src);
  const size_t total = size_t(count) * element_size_;
  const size_t offset = data_offset_ + size_t(first) * element_size_;
  size_t done = 0;
  while (done < total) {
    const ssize_t w = ::pwrite(fd_, bytes + done, total - done, off_t(offset + done));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return path_ + ": cannot write: " + errno_text(w < 0 ? errno : EIO);
    done += size_t(w);
  }
  return "";
}

std::string NpyOutFile::close() {
  if (fd_ < 0) return "";
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) return path_ + ": cannot write: " + errno_text(errno);
  return "";
}

}  // namespace flce::io
