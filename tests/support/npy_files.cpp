#include "support/npy_files.h"

#include <fcntl.h>
#include <linux/fs.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>

#include "common/float16.h"

namespace flce_test {

namespace fs = std::filesystem;

TempDir::TempDir() {
  const char* base = std::getenv("TMPDIR");
  std::string tmpl = std::string(base && *base ? base : "/tmp") + "/flce_test_XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed: " + tmpl);
  path_ = tmpl;
}

TempDir::~TempDir() {
  std::error_code ec;
  fs::remove_all(path_, ec);
}

flce::io::NpyArray npy_array(flce::Dtype dtype, std::vector<int64_t> shape,
                             const std::vector<double>& values) {
  flce::io::NpyArray a;
  a.dtype = dtype;
  a.shape = std::move(shape);
  if (int64_t(values.size()) != a.numel())
    throw std::runtime_error("npy_array: " + std::to_string(values.size()) +
                             " values for " + std::to_string(a.numel()) + " elements");
  a.bytes.resize(values.size() * flce::dtype_size(dtype));
  unsigned char* out = a.bytes.data();
  for (size_t i = 0; i < values.size(); ++i) {
    auto put = [&](auto v) { std::memcpy(out + i * sizeof(v), &v, sizeof(v)); };
    switch (dtype) {
      case flce::Dtype::f16: put(flce::f64_to_f16(values[i])); break;
      case flce::Dtype::bf16: put(flce::f64_to_bf16(values[i])); break;
      case flce::Dtype::f32: put(float(values[i])); break;
      case flce::Dtype::f64: put(values[i]); break;
      case flce::Dtype::i32: put(int32_t(values[i])); break;
      case flce::Dtype::i64: put(int64_t(values[i])); break;
    }
  }
  return a;
}

std::string write_array(const std::string& path, flce::Dtype dtype, std::vector<int64_t> shape,
                        const std::vector<double>& values) {
  if (auto e = flce::io::write_npy(path, npy_array(dtype, std::move(shape), values)); !e.empty())
    throw std::runtime_error(e);
  return path;
}

std::vector<double> npy_values(const flce::io::NpyArray& a) {
  std::vector<double> v(size_t(a.numel()));
  const unsigned char* in = a.bytes.data();
  for (size_t i = 0; i < v.size(); ++i) {
    auto get = [&](auto t) {
      std::memcpy(&t, in + i * sizeof(t), sizeof(t));
      return t;
    };
    switch (a.dtype) {
      case flce::Dtype::f16: v[i] = flce::f16_to_f32(get(uint16_t{})); break;
      case flce::Dtype::bf16: v[i] = flce::bf16_to_f32(get(uint16_t{})); break;
      case flce::Dtype::f32: v[i] = get(float{}); break;
      case flce::Dtype::f64: v[i] = get(double{}); break;
      case flce::Dtype::i32: v[i] = get(int32_t{}); break;
      case flce::Dtype::i64: v[i] = double(get(int64_t{})); break;
    }
  }
  return v;
}

Bytes npy_bytes(std::string_view header, const Bytes& data, int major) {
  const size_t len_bytes = major == 1 ? 2 : 4;
  const size_t prefix = 6 + 2 + len_bytes;
  std::string h(header);
  while ((prefix + h.size() + 1) % 64 != 0) h += ' ';
  h += '\n';
  Bytes b = {0x93, 'N', 'U', 'M', 'P', 'Y', static_cast<unsigned char>(major), 0};
  for (size_t i = 0; i < len_bytes; ++i)
    b.push_back(static_cast<unsigned char>(h.size() >> (8 * i)));
  b.insert(b.end(), h.begin(), h.end());
  b.insert(b.end(), data.begin(), data.end());
  return b;
}

void write_bytes(const std::string& path, const Bytes& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  if (!f) throw std::runtime_error("cannot write " + path);
}

Bytes read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + path);
  return Bytes(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

std::map<std::string, Bytes> snapshot_dir(const std::string& dir) {
  std::map<std::string, Bytes> files;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return files;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    files[name] = entry.is_regular_file() ? read_bytes(entry.path().string()) : Bytes{};
  }
  return files;
}

namespace {

bool set_immutable(const std::string& path, bool on) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return false;
  int flags = 0;
  bool ok = ::ioctl(fd, FS_IOC_GETFLAGS, &flags) == 0;
  flags = on ? flags | FS_IMMUTABLE_FL : flags & ~FS_IMMUTABLE_FL;
  ok = ok && ::ioctl(fd, FS_IOC_SETFLAGS, &flags) == 0;
  ::close(fd);
  return ok;
}

}  // namespace

ImmutableFile::ImmutableFile(std::string path) : path_(std::move(path)) {
  ok_ = set_immutable(path_, true);
}

ImmutableFile::~ImmutableFile() {
  if (ok_) set_immutable(path_, false);
}

}  // namespace flce_test
