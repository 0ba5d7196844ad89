// io/npy.cpp: the .npy reader and writer (see npy.h).
//
// The format (NEP 1, numpy/lib/format.py): the magic "\x93NUMPY", a major
// and a minor version byte, the header length (2 bytes little-endian in
// version 1, 4 bytes in versions 2 and 3), then the header: a Python dict
// literal with the keys 'descr', 'fortran_order' and 'shape', padded with
// spaces and a final '\n'. The raw array data follows the header.
#include "io/npy.h"

#include <sys/stat.h>

#include <algorithm>
#include <bit>
#include <cctype>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <new>
#include <string_view>
#include <utility>

namespace flce::io {

// Element bytes are copied as they are, so the host must be little-endian
// like the files ('=' and '|' descrs are read as little-endian too).
static_assert(std::endian::native == std::endian::little,
              "the .npy I/O assumes a little-endian host");

namespace {

constexpr unsigned char kMagic[] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
constexpr size_t kMagicLen = sizeof(kMagic);
constexpr size_t kAlign = 64;         // numpy's ARRAY_ALIGN
constexpr size_t kGrowthDigits = 21;  // numpy's GROWTH_AXIS_MAX_DIGITS
// Which arrays take which: a uint8 labels file was told of the floats too.
constexpr const char* kAccepted =
    "<f2 (float16), <f4 (float32) or <f8 (float64) for every array but labels; "
    "<i4 (int32) or <i8 (int64) for labels";

// A dtype the library supports, with numpy's type code and name for it.
struct NpyType {
  Dtype dtype;
  std::string_view code;  // without the byte-order character
  const char* name;
  size_t size;
};

constexpr NpyType kTypes[] = {
    {Dtype::f16, "f2", "float16", 2}, {Dtype::f32, "f4", "float32", 4},
    {Dtype::f64, "f8", "float64", 8}, {Dtype::i32, "i4", "int32", 4},
    {Dtype::i64, "i8", "int64", 8},
};

const NpyType* find_type(Dtype dtype) {
  for (const NpyType& t : kTypes)
    if (t.dtype == dtype) return &t;
  return nullptr;  // bf16: numpy has no such dtype
}

const NpyType* find_type(std::string_view code) {
  for (const NpyType& t : kTypes)
    if (t.code == code) return &t;
  return nullptr;
}

// numpy's name for a type code we do not support, so the message can say
// "'|u1' (uint8)"; nullptr when we do not know it.
const char* unsupported_type_name(std::string_view code) {
  static const std::pair<std::string_view, const char*> names[] = {
      {"b1", "bool"},        {"?", "bool"},         {"i1", "int8"},
      {"i2", "int16"},       {"u1", "uint8"},       {"u2", "uint16"},
      {"u4", "uint32"},      {"u8", "uint64"},      {"f12", "float96"},
      {"f16", "float128"},   {"c8", "complex64"},   {"c16", "complex128"},
      {"c32", "complex256"},
  };
  for (const auto& [c, name] : names)
    if (c == code) return name;
  if (code.empty()) return nullptr;
  switch (code[0]) {  // the families whose codes carry a size or unit
    case 'U': return "str";
    case 'S': return "bytes";
    case 'V': return "void";
    case 'M': return "datetime64";
    case 'm': return "timedelta64";
    default: return nullptr;
  }
}

// Python's repr of a shape tuple: "()", "(5,)", "(2, 3)".
std::string shape_repr(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(shape[i]);
  }
  if (shape.size() == 1) s += ",";
  return s + ")";
}

// Up to 40 bytes of `text`, quoted and with unprintable bytes escaped, for
// showing a bad piece of header in a message.
std::string snippet(std::string_view text) {
  constexpr size_t kMax = 40;
  std::string s = "\"";
  for (size_t i = 0; i < text.size() && i < kMax; ++i) {
    unsigned char ch = static_cast<unsigned char>(text[i]);
    if (ch >= 0x20 && ch < 0x7f && ch != '"' && ch != '\\') {
      s += static_cast<char>(ch);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", ch);
      s += buf;
    }
  }
  if (text.size() > kMax) s += "...";
  return s + "\"";
}

// Element count and byte size of `shape`, or an error when either does not
// fit in int64. A shape with a 0 in it holds nothing, whatever its other
// entries are.
std::string checked_size(const std::vector<int64_t>& shape, const NpyType& type,
                         int64_t* numel, int64_t* nbytes) {
  int64_t n = 1;
  bool empty = false, overflow = false;
  for (int64_t d : shape) {
    if (d == 0) empty = true;
    if (!empty && !overflow) overflow = __builtin_mul_overflow(n, d, &n);
  }
  if (empty) n = 0;
  if (!empty && overflow)
    return "shape " + shape_repr(shape) +
           " overflows int64: it has too many elements";
  if (__builtin_mul_overflow(n, static_cast<int64_t>(type.size), nbytes))
    return "shape " + shape_repr(shape) + " of " + type.name +
           " overflows int64: its size in bytes is too large";
  *numel = n;
  return "";
}

// ---- Reading the header: the little Python literal syntax it uses. ----

struct Header {
  std::string descr;
  bool fortran_order = false;
  std::vector<int64_t> shape;
};

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' ||
         c == '\v';
}

// A position in the header text. Only ASCII matters to the syntax, so
// latin-1 (v1, v2) and utf-8 (v3) headers are parsed the same way.
struct Cursor {
  std::string_view text;
  size_t pos = 0;

  void skip_space() {
    while (pos < text.size() && is_space(text[pos])) ++pos;
  }
  char peek() const { return pos < text.size() ? text[pos] : '\0'; }
  std::string_view rest() const { return text.substr(pos); }
  // Skips spaces, then takes `c` if it is next.
  bool eat(char c) {
    skip_space();
    if (peek() != c) return false;
    ++pos;
    return true;
  }
};

// A string literal in single or double quotes (numpy writes single ones;
// nothing in a valid header needs escapes).
bool parse_string(Cursor& c, std::string* out) {
  c.skip_space();
  char quote = c.peek();
  if (quote != '\'' && quote != '"') return false;
  size_t end = c.text.find(quote, c.pos + 1);
  if (end == std::string_view::npos) return false;
  *out = std::string(c.text.substr(c.pos + 1, end - c.pos - 1));
  c.pos = end + 1;
  return true;
}

std::string parse_descr(Cursor& c, std::string* descr) {
  c.skip_space();
  if (c.peek() == '[')
    return "structured dtype (descr is a list of fields) is not supported; "
           "save a plain numeric array";
  if (!parse_string(c, descr))
    return "the value of 'descr' is not a string: " + snippet(c.rest());
  return "";
}

std::string parse_bool(Cursor& c, bool* value) {
  c.skip_space();
  std::string_view rest = c.rest();
  for (bool b : {true, false}) {
    std::string_view word = b ? "True" : "False";
    bool word_ends = rest.size() == word.size() ||
                     (rest.size() > word.size() &&
                      !std::isalnum(static_cast<unsigned char>(rest[word.size()])) &&
                      rest[word.size()] != '_');
    if (rest.substr(0, word.size()) == word && word_ends) {
      *value = b;
      c.pos += word.size();
      return "";
    }
  }
  return "the value of 'fortran_order' is not True or False: " + snippet(rest);
}

// One entry of the shape tuple: a non-negative decimal integer, maybe with
// Python 2's long suffix ("(4L, 8L)"), which numpy still reads.
std::string parse_dim(std::string_view token, int64_t* value) {
  const std::string_view written = token;
  const std::string shown(written);
  if (token.size() > 1 && token.back() == 'L') token.remove_suffix(1);
  bool negative = token[0] == '-';
  std::string_view digits = negative ? token.substr(1) : token;
  bool all_digits = !digits.empty();
  for (char ch : digits) all_digits = all_digits && ch >= '0' && ch <= '9';
  if (!all_digits)
    return "shape entry " + snippet(written) + " is not an integer";
  if (negative) return "shape entry " + shown + " is negative";
  // Python (numpy's reader) takes 0, 00, ... but no other leading zero.
  if (digits[0] == '0' && digits.find_first_not_of('0') != std::string_view::npos)
    return "shape entry " + shown + " has a leading zero (not a Python integer)";
  int64_t v = 0;
  for (char ch : digits) {
    if (__builtin_mul_overflow(v, 10, &v) ||
        __builtin_add_overflow(v, ch - '0', &v))
      return "shape entry " + shown + " overflows int64";
  }
  *value = v;
  return "";
}

std::string parse_shape(Cursor& c, std::vector<int64_t>* shape) {
  c.skip_space();
  if (c.peek() != '(')
    return "the value of 'shape' is not a tuple: " + snippet(c.rest());
  size_t open = c.pos++;
  bool trailing_comma = false;
  while (!c.eat(')')) {
    // The entry runs to the next separator; parse_dim judges what it is.
    size_t start = c.pos;
    while (c.pos < c.text.size() && c.text[c.pos] != ',' &&
           c.text[c.pos] != ')' && !is_space(c.text[c.pos]))
      ++c.pos;
    if (c.pos == start)
      return "the value of 'shape' is not a valid tuple: " +
             snippet(c.text.substr(open));
    int64_t dim = 0;
    std::string err = parse_dim(c.text.substr(start, c.pos - start), &dim);
    if (!err.empty()) return err;
    shape->push_back(dim);
    trailing_comma = c.eat(',');
    if (!trailing_comma) {
      if (!c.eat(')'))
        return "the value of 'shape' is not a valid tuple: " +
               snippet(c.text.substr(open));
      break;
    }
  }
  // In Python "(5)" is the integer 5; numpy rejects it as a shape.
  if (shape->size() == 1 && !trailing_comma)
    return "the value of 'shape' is (" + std::to_string((*shape)[0]) +
           "), which Python reads as an integer, not a tuple; a 1-element "
           "shape is written (" + std::to_string((*shape)[0]) + ",)";
  return "";
}

// Parses the header dict; the errors do not name the file yet.
std::string parse_header(std::string_view text, Header* h) {
  Cursor c{text};
  if (!c.eat('{'))
    return "header is not a Python dict literal: " + snippet(text);
  bool seen_descr = false, seen_fortran = false, seen_shape = false;
  while (!c.eat('}')) {
    std::string key;
    if (!parse_string(c, &key))
      return "header dict has a malformed key at " + snippet(c.rest());
    if (!c.eat(':'))
      return "header dict has no ':' after the key '" + key + "'";
    std::string err;
    if (key == "descr") {
      err = parse_descr(c, &h->descr);
      seen_descr = true;
    } else if (key == "fortran_order") {
      err = parse_bool(c, &h->fortran_order);
      seen_fortran = true;
    } else if (key == "shape") {
      h->shape.clear();  // a repeated key replaces the value, as in Python
      err = parse_shape(c, &h->shape);
      seen_shape = true;
    } else {
      return "header has an unknown key '" + key +
             "' (a .npy header has exactly 'descr', 'fortran_order' and "
             "'shape')";
    }
    if (!err.empty()) return err;
    if (!c.eat(',')) {
      if (!c.eat('}'))
        return "header dict is malformed after the value of '" + key +
               "': " + snippet(c.rest());
      break;
    }
  }
  c.skip_space();
  if (c.pos != text.size())
    return "header has unexpected text after the dict: " + snippet(c.rest());
  for (auto [seen, key] : {std::pair{seen_descr, "descr"},
                           std::pair{seen_fortran, "fortran_order"},
                           std::pair{seen_shape, "shape"}})
    if (!seen) return std::string("header is missing the key '") + key + "'";
  return "";
}

// Maps a descr such as "<f4" to a supported type, or says why it is not one.
std::string check_descr(const std::string& descr, const NpyType** type) {
  std::string_view code = descr;
  char order = descr.empty() ? '\0' : descr[0];
  bool has_order = order == '<' || order == '>' || order == '=' ||
                   order == '|' || order == '!';
  if (has_order) code.remove_prefix(1);
  if (!code.empty() && code[0] == 'O')
    return "object dtype '" + descr +
           "' is not supported: the file holds Python objects, not numbers";
  *type = find_type(code);
  if (*type == nullptr) {
    const char* name = unsupported_type_name(code);
    return "dtype '" + descr + "'" +
           (name ? std::string(" (") + name + ")" : std::string()) +
           " is not supported; accepted dtypes: " + kAccepted;
  }
  if (order == '>' || order == '!')
    return "big-endian dtype '" + descr +
           "' is not supported; save it little-endian";
  return "";
}

std::string bad_magic_message(const unsigned char* data) {
  std::string s =
      "not a .npy file: it does not start with the magic string "
      "\\x93NUMPY (its first bytes are";
  for (size_t i = 0; i < kMagicLen; ++i) {
    char buf[8];
    std::snprintf(buf, sizeof buf, " %02x", data[i]);
    s += buf;
  }
  s += ")";
  if (std::memcmp(data, "PK\x03\x04", 4) == 0)
    s += "; it looks like a zip archive (.npz), which is not supported: "
         "save each array with np.save";
  return s;
}

// ---- Writing. ----

// The header dict exactly as numpy writes it, including the spaces numpy
// adds after it so that the first axis can grow in place.
std::string header_dict(const NpyType& type, const std::vector<int64_t>& shape) {
  std::string dict = "{'descr': '<" + std::string(type.code) +
                     "', 'fortran_order': False, 'shape': " +
                     shape_repr(shape) + ", }";
  if (!shape.empty()) {
    size_t digits = std::to_string(shape[0]).size();
    if (digits < kGrowthDigits) dict.append(kGrowthDigits - digits, ' ');
  }
  return dict;
}

// The preamble (magic, version, length, padded header); false when the
// header does not fit in `version`'s length field.
bool wrap_header(const std::string& dict, int version,
                 std::vector<unsigned char>* out) {
  size_t len_bytes = version == 1 ? 2 : 4;
  size_t prefix = kMagicLen + 2 + len_bytes;
  size_t hlen = dict.size() + 1;  // with the final '\n'
  // Like numpy: 1 to kAlign spaces, so the data starts on a kAlign boundary.
  size_t pad = kAlign - (prefix + hlen) % kAlign;
  uint64_t field = hlen + pad;
  if (field >> (8 * len_bytes) != 0) return false;
  out->assign(kMagic, kMagic + kMagicLen);
  out->push_back(static_cast<unsigned char>(version));
  out->push_back(0);
  for (size_t i = 0; i < len_bytes; ++i)
    out->push_back(static_cast<unsigned char>(field >> (8 * i)));
  out->insert(out->end(), dict.begin(), dict.end());
  out->insert(out->end(), pad, ' ');
  out->push_back('\n');
  return true;
}

// encode_npy with the reason for a failure; the errors do not name a file.
std::string encode(const NpyArray& array, int version,
                   std::vector<unsigned char>* out) {
  if (version < 0 || version > 3)
    return "unknown .npy format version " + std::to_string(version) +
           " (use 0 to choose automatically, or 1, 2 or 3)";
  const NpyType* type = find_type(array.dtype);
  if (type == nullptr)
    return array.dtype == Dtype::bf16
               ? "bfloat16 has no .npy dtype; convert the array to float32 "
                 "first"
               : "the array's dtype has no .npy equivalent";
  for (int64_t d : array.shape)
    if (d < 0)
      return "shape " + shape_repr(array.shape) + " has a negative entry";
  int64_t numel = 0, nbytes = 0;
  std::string err = checked_size(array.shape, *type, &numel, &nbytes);
  if (!err.empty()) return err;
  if (array.bytes.size() != static_cast<uint64_t>(nbytes))
    return "the array holds " + std::to_string(array.bytes.size()) +
           " bytes but its shape " + shape_repr(array.shape) + " of " +
           type->name + " needs " + std::to_string(nbytes);
  std::string dict = header_dict(*type, array.shape);
  // numpy writes version 1 unless the header is too long for it.
  bool ok = version == 0 ? wrap_header(dict, 1, out) || wrap_header(dict, 2, out)
                         : wrap_header(dict, version, out);
  if (!ok)
    return "the header (" + std::to_string(dict.size()) +
           " bytes) is too long for .npy format version " +
           std::to_string(version);
  out->insert(out->end(), array.bytes.begin(), array.bytes.end());
  return "";
}

}  // namespace

int64_t NpyArray::numel() const {
  // 0 for any zero dimension, before a product of the others could
  // overflow (a header may declare (2^32, 2^32, 0)).
  for (int64_t d : shape)
    if (d == 0) return 0;
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace {

// What parse_npy checks, without copying the data: the array's dtype and
// shape into *out (bytes left alone), where its data starts and its size.
std::string parse_npy_layout(const unsigned char* data, size_t size, const std::string& name,
                             NpyArray* out, size_t* data_offset, size_t* data_bytes) {
  auto fail = [&](const std::string& what) { return name + ": " + what; };
  if (size < kMagicLen)
    return fail("file is " + std::to_string(size) +
                " bytes, too short to be a .npy file (the magic string "
                "alone is 6 bytes)");
  if (std::memcmp(data, kMagic, kMagicLen) != 0)
    return fail(bad_magic_message(data));
  if (size < kMagicLen + 2)
    return fail("file ends inside the format version bytes");
  int major = data[6], minor = data[7];
  if ((major < 1 || major > 3) || minor != 0)
    return fail("unknown .npy format version " + std::to_string(major) + "." +
                std::to_string(minor) + " (supported: 1.0, 2.0, 3.0)");

  size_t len_bytes = major == 1 ? 2 : 4;
  size_t prefix = kMagicLen + 2 + len_bytes;
  if (size < prefix)
    return fail("file ends inside the header length (file is " +
                std::to_string(size) + " bytes)");
  uint64_t header_len = 0;
  for (size_t i = 0; i < len_bytes; ++i)
    header_len |= uint64_t{data[kMagicLen + 2 + i]} << (8 * i);
  if (header_len > size - prefix)
    return fail("header length " + std::to_string(header_len) +
                " runs past the end of the file (the header would end at "
                "byte " + std::to_string(prefix + header_len) +
                " but the file is " + std::to_string(size) + " bytes)");

  Header h;
  std::string err = parse_header(
      std::string_view(reinterpret_cast<const char*>(data + prefix), header_len),
      &h);
  if (!err.empty()) return fail(err);
  const NpyType* type = nullptr;
  err = check_descr(h.descr, &type);
  if (!err.empty()) return fail(err);
  // Column-major bytes are row-major ones when at most one dimension is
  // above 1 (vectors, scalars): some writers mark vectors fortran_order.
  const auto above_1 = std::count_if(h.shape.begin(), h.shape.end(),
                                     [](int64_t d) { return d > 1; });
  if (h.fortran_order && above_1 > 1)
    return fail("fortran_order is True (column-major data), which is not "
                "supported; save a C-ordered array (np.ascontiguousarray)");
  int64_t numel = 0, nbytes = 0;
  err = checked_size(h.shape, *type, &numel, &nbytes);
  if (!err.empty()) return fail(err);

  const unsigned char* body = data + prefix + header_len;
  size_t available = size - prefix - header_len;
  if (available < static_cast<uint64_t>(nbytes))
    return fail("data is " + std::to_string(available) +
                " bytes but the header's shape " + shape_repr(h.shape) +
                " of " + type->name + " needs " + std::to_string(nbytes));

  out->dtype = type->dtype;
  out->shape = std::move(h.shape);
  *data_offset = size_t(body - data);
  *data_bytes = size_t(nbytes);  // trailing bytes are ignored
  return "";
}

}  // namespace

std::string parse_npy(const unsigned char* data, size_t size,
                      const std::string& name, NpyArray* out) {
  size_t offset = 0, nbytes = 0;
  if (auto e = parse_npy_layout(data, size, name, out, &offset, &nbytes); !e.empty()) return e;
  out->bytes.assign(data + offset, data + offset + nbytes);
  return "";
}

std::string read_npy(const std::string& path, NpyArray* out) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return path + ": cannot open: " + std::strerror(errno);
  // The whole file in one buffer of its size, which then becomes the
  // array's bytes in place: memory peaks at the file's size, not at the
  // 1.6x that a growing buffer plus a copy of the data took.
  std::vector<unsigned char> contents;
  struct stat st {};
  try {
    if (::fstat(::fileno(f), &st) == 0 && st.st_size > 0) contents.reserve(size_t(st.st_size));
    unsigned char chunk[1 << 16];
    size_t got;
    while ((got = std::fread(chunk, 1, sizeof chunk, f)) > 0)
      contents.insert(contents.end(), chunk, chunk + got);
  } catch (const std::bad_alloc&) {
    std::fclose(f);
    return path + ": cannot read: out of memory after " + std::to_string(contents.size()) +
           " bytes" +
           (S_ISREG(st.st_mode) ? " of " + std::to_string(st.st_size) + " (the file is more than "
                                  "this process can allocate)"
                                : "");
  }
  if (std::ferror(f)) {
    int e = errno;  // fclose may change errno
    std::fclose(f);
    return path + ": cannot read: " + std::strerror(e);
  }
  std::fclose(f);
  size_t offset = 0, nbytes = 0;
  if (auto e = parse_npy_layout(contents.data(), contents.size(), path, out, &offset, &nbytes);
      !e.empty())
    return e;
  contents.erase(contents.begin(), contents.begin() + std::ptrdiff_t(offset));
  contents.resize(nbytes);
  out->bytes = std::move(contents);
  return "";
}

std::vector<unsigned char> encode_npy(const NpyArray& array, int version) {
  std::vector<unsigned char> bytes;
  if (!encode(array, version, &bytes).empty()) bytes.clear();
  return bytes;
}

std::string write_npy(const std::string& path, const NpyArray& array,
                      int version) {
  std::vector<unsigned char> bytes;
  std::string err = encode(array, version, &bytes);
  if (!err.empty()) return path + ": cannot write: " + err;
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr)
    return path + ": cannot open for writing: " + std::strerror(errno);
  errno = 0;
  bool ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  int e = errno;
  // Buffered data may only fail to reach the disk when the file is closed.
  if (std::fclose(f) != 0 && ok) {
    ok = false;
    e = errno;
  }
  if (!ok) {
    // Do not leave a truncated file behind; but a path that is not a
    // regular file (a device, a FIFO) is not ours to remove.
    std::error_code ec;
    if (std::filesystem::is_regular_file(path, ec)) std::remove(path.c_str());
    return path + ": cannot write: " + std::strerror(e != 0 ? e : EIO);
  }
  return "";
}

}  // namespace flce::io
