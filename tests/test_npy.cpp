// Tests for io/npy: numpy-exact headers, round trips through files, what the
// reader accepts, and one test per kind of malformed file.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

#include "io/npy.h"

namespace {

using flce::Dtype;
using flce::io::encode_npy;
using flce::io::NpyArray;
using flce::io::parse_npy;
using flce::io::read_npy;
using flce::io::write_npy;
using Bytes = std::vector<unsigned char>;
namespace fs = std::filesystem;

Bytes bytes_of(std::string_view s) { return Bytes(s.begin(), s.end()); }

// The raw (little-endian, on the hosts we run on) bytes of `values`.
template <class T>
Bytes raw(const std::vector<T>& values) {
  Bytes b(values.size() * sizeof(T));
  if (!b.empty()) std::memcpy(b.data(), values.data(), b.size());
  return b;
}

NpyArray make_array(Dtype dtype, std::vector<int64_t> shape, Bytes bytes) {
  NpyArray a;
  a.dtype = dtype;
  a.shape = std::move(shape);
  a.bytes = std::move(bytes);
  return a;
}

Bytes concat(Bytes a, const Bytes& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// A .npy file whose header is `header` verbatim (no padding added), with the
// given major version and data after it.
Bytes make_npy(std::string_view header, const Bytes& data = {}, int major = 1) {
  Bytes f = bytes_of("\x93NUMPY");
  f.push_back(static_cast<unsigned char>(major));
  f.push_back(0);
  int len_bytes = major == 1 ? 2 : 4;
  for (int i = 0; i < len_bytes; ++i)
    f.push_back(static_cast<unsigned char>(header.size() >> (8 * i)));
  return concat(concat(f, bytes_of(header)), data);
}

// The header dict numpy would write, with each value's text given as is.
std::string dict(std::string_view descr, std::string_view fortran,
                 std::string_view shape) {
  return "{'descr': " + std::string(descr) + ", 'fortran_order': " +
         std::string(fortran) + ", 'shape': " + std::string(shape) + ", }";
}

// Parses `file` as "X.npy", expects a failure, and returns its message.
std::string parse_error(const Bytes& file) {
  NpyArray out;
  std::string err = parse_npy(file.data(), file.size(), "X.npy", &out);
  EXPECT_FALSE(err.empty()) << "parsing unexpectedly succeeded";
  EXPECT_EQ(err.rfind("X.npy: ", 0), 0u) << err;
  return err;
}

std::string header_error(std::string_view header, const Bytes& data = {}) {
  return parse_error(make_npy(header, data));
}

// A fresh directory for one test's files, removed afterwards. The pid keeps
// tests that ctest runs in parallel apart.
class NpyFile : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("flce_npy_" + std::to_string(getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  static Bytes slurp(const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return Bytes(std::istreambuf_iterator<char>(in), {});
  }

  fs::path dir_;
};

// ---- Headers numpy 1.24 wrote (np.lib.format.write_array), byte for byte.

struct NumpyCase {
  const char* what;
  int version;  // as passed to encode_npy
  NpyArray array;
  std::string header;
};

std::vector<NumpyCase> numpy_cases() {
  using S = std::string;
  return {
      {"arange(6, f4).reshape(2, 3)", 0,
       make_array(Dtype::f32, {2, 3}, raw<float>({0, 1, 2, 3, 4, 5})),
       S("\x93" "NUMPY\x01" "\x00" "v\x00" "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }                                                          \n", 128)},
      {"arange(5, i8)", 0,
       make_array(Dtype::i64, {5}, raw<int64_t>({0, 1, 2, 3, 4})),
       S("\x93" "NUMPY\x01" "\x00" "v\x00" "{'descr': '<i8', 'fortran_order': False, 'shape': (5,), }                                                            \n", 128)},
      {"array(1.5, f8), 0-D", 0,
       make_array(Dtype::f64, {}, raw<double>({1.5})),
       S("\x93" "NUMPY\x01" "\x00" "v\x00" "{'descr': '<f8', 'fortran_order': False, 'shape': (), }                                                              \n", 128)},
      {"arange(3, f2), version (2, 0)", 2,
       make_array(Dtype::f16, {3}, raw<uint16_t>({0x0000, 0x3c00, 0x4000})),
       S("\x93" "NUMPY\x02" "\x00" "t\x00" "\x00" "\x00" "{'descr': '<f2', 'fortran_order': False, 'shape': (3,), }                                                          \n", 128)},
      {"zeros((1, 1), i4), version (3, 0)", 3,
       make_array(Dtype::i32, {1, 1}, raw<int32_t>({0})),
       S("\x93" "NUMPY\x03" "\x00" "t\x00" "\x00" "\x00" "{'descr': '<i4', 'fortran_order': False, 'shape': (1, 1), }                                                        \n", 128)},
      // numpy's 20 spaces for growing the first axis push this one to 192.
      {"arange(15, i8).reshape((3, 5) + (1,) * 13)", 0,
       make_array(Dtype::i64, {3, 5, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1},
                  raw<int64_t>({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14})),
       S("\x93" "NUMPY\x01" "\x00" "\xb6" "\x00" "{'descr': '<i8', 'fortran_order': False, 'shape': (3, 5, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1), }                                                                                   \n", 192)},
  };
}

TEST(NpyWrite, MatchesNumpyByteForByte) {
  for (const NumpyCase& c : numpy_cases()) {
    SCOPED_TRACE(c.what);
    ASSERT_EQ(c.header.size() % 64, 0u);
    EXPECT_EQ(encode_npy(c.array, c.version), concat(bytes_of(c.header), c.array.bytes));
  }
}

TEST(NpyRead, ParsesNumpyFiles) {
  for (const NumpyCase& c : numpy_cases()) {
    SCOPED_TRACE(c.what);
    Bytes file = concat(bytes_of(c.header), c.array.bytes);
    NpyArray out;
    ASSERT_EQ(parse_npy(file.data(), file.size(), "ref.npy", &out), "");
    EXPECT_EQ(out.dtype, c.array.dtype);
    EXPECT_EQ(out.shape, c.array.shape);
    EXPECT_EQ(out.bytes, c.array.bytes);
  }
}

// ---- Round trips through files.

TEST_F(NpyFile, RoundTripsEveryDtypeShapeAndVersion) {
  const struct { Dtype dtype; size_t size; } dtypes[] = {
      {Dtype::f16, 2}, {Dtype::f32, 4}, {Dtype::f64, 8}, {Dtype::i32, 4}, {Dtype::i64, 8}};
  const std::vector<std::vector<int64_t>> shapes = {{}, {5}, {2, 3}};
  for (int version : {0, 1, 2, 3}) {
    for (const auto& d : dtypes) {
      for (const auto& shape : shapes) {
        SCOPED_TRACE("version " + std::to_string(version) + ", dtype #" +
                     std::to_string(static_cast<int>(d.dtype)) + ", ndim " +
                     std::to_string(shape.size()));
        NpyArray a = make_array(d.dtype, shape, {});
        a.bytes.resize(a.numel() * d.size);
        for (size_t i = 0; i < a.bytes.size(); ++i) a.bytes[i] = static_cast<unsigned char>(i * 37 + 11);
        std::string p = path("a.npy");
        ASSERT_EQ(write_npy(p, a, version), "");

        Bytes file = slurp(p);
        ASSERT_GT(file.size(), 10u);
        EXPECT_EQ(file[6], version == 0 ? 1 : version);
        EXPECT_EQ((file.size() - a.bytes.size()) % 64, 0u) << "data is not 64-byte aligned";

        NpyArray back;
        ASSERT_EQ(read_npy(p, &back), "");
        EXPECT_EQ(back.dtype, a.dtype);
        EXPECT_EQ(back.shape, a.shape);
        EXPECT_EQ(back.bytes, a.bytes);
      }
    }
  }
}

TEST_F(NpyFile, RoundTripsZeroSizeArray) {
  NpyArray a = make_array(Dtype::f32, {0, 3}, {});
  ASSERT_EQ(write_npy(path("z.npy"), a), "");
  NpyArray back;
  ASSERT_EQ(read_npy(path("z.npy"), &back), "");
  EXPECT_EQ(back.shape, (std::vector<int64_t>{0, 3}));
  EXPECT_EQ(back.numel(), 0);
  EXPECT_TRUE(back.bytes.empty());
}

TEST_F(NpyFile, ReadErrorsNameThePath) {
  std::string p = path("bad.npy");
  std::ofstream(p, std::ios::binary) << "this is not numpy";
  NpyArray out;
  std::string err = read_npy(p, &out);
  EXPECT_EQ(err.rfind(p + ": ", 0), 0u) << err;
  EXPECT_NE(err.find("magic"), std::string::npos) << err;
}

TEST_F(NpyFile, MissingFileReportsStrerror) {
  std::string p = path("no_such.npy");
  NpyArray out;
  std::string err = read_npy(p, &out);
  EXPECT_NE(err.find(p), std::string::npos) << err;
  EXPECT_NE(err.find("No such file or directory"), std::string::npos) << err;
}

TEST_F(NpyFile, DirectoryIsUnreadable) {
  NpyArray out;
  std::string err = read_npy(dir_.string(), &out);
  EXPECT_NE(err.find(dir_.string()), std::string::npos) << err;
  EXPECT_NE(err.find("Is a directory"), std::string::npos) << err;
}

TEST_F(NpyFile, UnwritablePathReportsStrerror) {
  std::string p = path("missing_dir/out.npy");
  std::string err = write_npy(p, make_array(Dtype::f32, {}, raw<float>({1})));
  EXPECT_NE(err.find(p), std::string::npos) << err;
  EXPECT_NE(err.find("No such file or directory"), std::string::npos) << err;
}

// A failed write removes the truncated file it made, but only a regular
// file: a device at the path stays (it used to be unlinked). Reached here
// through a link to /dev/full, so that the old code removed the link only.
TEST_F(NpyFile, FailedWriteRemovesOnlyRegularFiles) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full on this system";
  const std::string link = path("full.npy");
  fs::create_symlink("/dev/full", link);
  std::string err = write_npy(link, make_array(Dtype::f32, {}, raw<float>({1})));
  EXPECT_NE(err.find("cannot write"), std::string::npos) << err;
  EXPECT_TRUE(fs::is_symlink(link));
}

// ---- Writer errors.

TEST(NpyWrite, RejectsBf16) {
  NpyArray a = make_array(Dtype::bf16, {2}, Bytes(4));
  EXPECT_TRUE(encode_npy(a).empty());
  std::string err = write_npy("/nonexistent/b.npy", a);
  EXPECT_NE(err.find("/nonexistent/b.npy"), std::string::npos) << err;
  EXPECT_NE(err.find("bfloat16"), std::string::npos) << err;
}

TEST(NpyWrite, RejectsBytesNotMatchingShape) {
  NpyArray a = make_array(Dtype::f32, {2, 3}, Bytes(20));
  EXPECT_TRUE(encode_npy(a).empty());
  std::string err = write_npy("o.npy", a);
  EXPECT_NE(err.find("holds 20 bytes but its shape (2, 3) of float32 needs 24"), std::string::npos) << err;
}

TEST(NpyWrite, RejectsNegativeShapeAndUnknownVersion) {
  EXPECT_NE(write_npy("o.npy", make_array(Dtype::f32, {-1}, {})).find("(-1,) has a negative entry"),
            std::string::npos);
  NpyArray ok = make_array(Dtype::f32, {}, Bytes(4));
  EXPECT_TRUE(encode_npy(ok, 4).empty());
  EXPECT_NE(write_npy("o.npy", ok, 4).find("version 4"), std::string::npos);
}

// numpy falls back to version 2 when the header length does not fit in 2
// bytes; 30000 axes of length 1 make a header of about 90 kB.
TEST(NpyWrite, LongHeaderNeedsVersion2) {
  NpyArray a = make_array(Dtype::f32, std::vector<int64_t>(30000, 1), raw<float>({7}));
  Bytes file = encode_npy(a);
  ASSERT_FALSE(file.empty());
  EXPECT_EQ(file[6], 2);
  EXPECT_EQ((file.size() - 4) % 64, 0u);
  NpyArray back;
  ASSERT_EQ(parse_npy(file.data(), file.size(), "long.npy", &back), "");
  EXPECT_EQ(back.shape, a.shape);
  EXPECT_EQ(back.bytes, a.bytes);

  EXPECT_TRUE(encode_npy(a, 1).empty());
  EXPECT_NE(write_npy("o.npy", a, 1).find("too long for .npy format version 1"), std::string::npos);
}

// ---- What the reader accepts beyond numpy's own output.

TEST(NpyRead, AcceptsAnyKeyOrderSpacingQuotesAndPadding) {
  Bytes file = make_npy("{ \"shape\" :( 2 ,3 ) ,'fortran_order':False,\n'descr':'<i4'}",
                        raw<int32_t>({1, 2, 3, 4, 5, 6}), 2);
  NpyArray out;
  ASSERT_EQ(parse_npy(file.data(), file.size(), "X.npy", &out), "");
  EXPECT_EQ(out.dtype, Dtype::i32);
  EXPECT_EQ(out.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(out.bytes, raw<int32_t>({1, 2, 3, 4, 5, 6}));
}

TEST(NpyRead, AcceptsNativeAndNotApplicableByteOrder) {
  for (const char* descr : {"'=f8'", "'|f8'", "'f8'"}) {
    SCOPED_TRACE(descr);
    Bytes file = make_npy(dict(descr, "False", "(1,)"), raw<double>({2.5}));
    NpyArray out;
    ASSERT_EQ(parse_npy(file.data(), file.size(), "X.npy", &out), "");
    EXPECT_EQ(out.dtype, Dtype::f64);
  }
}

// Python 2's numpy wrote shapes as reprs of longs; numpy 2 still reads them.
TEST(NpyRead, AcceptsPython2LongShapeEntries) {
  Bytes file = make_npy(dict("'<f4'", "False", "(2L, 3L)"), raw<float>({1, 2, 3, 4, 5, 6}));
  NpyArray out;
  ASSERT_EQ(parse_npy(file.data(), file.size(), "X.npy", &out), "");
  EXPECT_EQ(out.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(out.bytes, raw<float>({1, 2, 3, 4, 5, 6}));
}

TEST(NpyRead, IgnoresTrailingBytes) {
  Bytes file = make_npy(dict("'<f4'", "False", "(2,)"), raw<float>({1, 2, 3}));
  NpyArray out;
  ASSERT_EQ(parse_npy(file.data(), file.size(), "X.npy", &out), "");
  EXPECT_EQ(out.bytes, raw<float>({1, 2}));
}

TEST(NpyRead, ParsesZeroSizeShape) {
  Bytes file = make_npy(dict("'<i8'", "False", "(4, 0)"));
  NpyArray out;
  ASSERT_EQ(parse_npy(file.data(), file.size(), "X.npy", &out), "");
  EXPECT_EQ(out.shape, (std::vector<int64_t>{4, 0}));
  EXPECT_EQ(out.numel(), 0);
  // No elements, however large the other dimensions: numel() is 0 without
  // forming their product (2^64, a signed overflow UBSan stops on).
  file = make_npy(dict("'<i8'", "False", "(4294967296, 4294967296, 0)"));
  ASSERT_EQ(parse_npy(file.data(), file.size(), "X.npy", &out), "");
  EXPECT_EQ(out.numel(), 0);
}

// ---- Malformed files: each fails with a message naming what is wrong.

#define EXPECT_HAS(message, part) \
  EXPECT_NE((message).find(part), std::string::npos) << (message)

TEST(NpyMalformed, FileShorterThanMagic) {
  std::string err = parse_error(bytes_of("\x93NU"));
  EXPECT_HAS(err, "file is 3 bytes, too short");
}

TEST(NpyMalformed, BadMagic) {
  std::string err = parse_error(bytes_of("hello world, not numpy"));
  EXPECT_HAS(err, "magic string");
  EXPECT_HAS(err, "68 65 6c 6c 6f 20");
  EXPECT_HAS(parse_error(bytes_of("PK\x03\x04 zipped arrays")), "zip archive (.npz)");
}

TEST(NpyMalformed, UnknownVersion) {
  EXPECT_HAS(parse_error(make_npy(dict("'<f4'", "False", "()"), Bytes(4), 4)), "version 4.0");
  Bytes minor = make_npy(dict("'<f4'", "False", "()"), Bytes(4));
  minor[7] = 1;
  EXPECT_HAS(parse_error(minor), "version 1.1");
}

TEST(NpyMalformed, FileEndsInPreamble) {
  EXPECT_HAS(parse_error(bytes_of("\x93NUMPY\x01")), "format version");
  EXPECT_HAS(parse_error(bytes_of(std::string_view("\x93NUMPY\x02\x00\x10\x00", 10))),
             "inside the header length");
}

TEST(NpyMalformed, HeaderLengthPastEnd) {
  Bytes file = make_npy(dict("'<f4'", "False", "()"));
  file[8] = 0xf4;  // 500, little-endian
  file[9] = 0x01;
  EXPECT_HAS(parse_error(file), "header length 500 runs past the end of the file");
  Bytes v2 = make_npy("{}", {}, 2);
  v2[8] = v2[9] = v2[10] = v2[11] = 0xff;
  EXPECT_HAS(parse_error(v2), "header length 4294967295 runs past");
}

TEST(NpyMalformed, HeaderNotADict) {
  std::string err = header_error("[1, 2, 3]");
  EXPECT_HAS(err, "header is not a Python dict literal");
  EXPECT_HAS(err, "[1, 2, 3]");
}

TEST(NpyMalformed, MissingKey) {
  EXPECT_HAS(header_error("{'descr': '<f4', 'fortran_order': False}"),
             "missing the key 'shape'");
  EXPECT_HAS(header_error("{'shape': (2,), 'fortran_order': False}"),
             "missing the key 'descr'");
}

TEST(NpyMalformed, UnknownKey) {
  std::string err = header_error("{'descr': '<f4', 'fortran_order': False, 'shape': (), 'foo': 1}");
  EXPECT_HAS(err, "unknown key 'foo'");
}

TEST(NpyMalformed, UnparsableValues) {
  EXPECT_HAS(header_error(dict("42", "False", "()")), "'descr' is not a string: \"42");
  EXPECT_HAS(header_error(dict("'<f4'", "maybe", "()")), "not True or False: \"maybe");
  EXPECT_HAS(header_error(dict("'<f4'", "False", "[2, 3]")), "'shape' is not a tuple: \"[2, 3]");
  EXPECT_HAS(header_error(dict("'<f4'", "False", "(2 3)")), "not a valid tuple: \"(2 3)");
  EXPECT_HAS(header_error(dict("'<f4'", "False", "(5)")), "a 1-element shape is written (5,)");
  EXPECT_HAS(header_error("{'descr': '<f4' 'shape': ()}"), "malformed after the value of 'descr'");
  EXPECT_HAS(header_error("{'descr' '<f4'}"), "no ':' after the key 'descr'");
  EXPECT_HAS(header_error("{'descr': '<f4', "), "malformed key");
  EXPECT_HAS(header_error(dict("'<f4'", "False", "()") + " xyz"), "unexpected text after the dict: \"xyz");
}

TEST(NpyMalformed, BigEndian) {
  EXPECT_EQ(header_error(dict("'>f4'", "False", "(2,)"), Bytes(8)),
            "X.npy: big-endian dtype '>f4' is not supported; save it little-endian");
  EXPECT_HAS(header_error(dict("'>i8'", "False", "()"), Bytes(8)), "big-endian dtype '>i8'");
  EXPECT_HAS(header_error(dict("'!f8'", "False", "()"), Bytes(8)), "big-endian dtype '!f8'");
}

TEST(NpyMalformed, FortranOrder) {
  EXPECT_HAS(header_error(dict("'<f4'", "True", "(2, 3)"), Bytes(24)), "fortran_order is True");
  EXPECT_HAS(header_error(dict("'<f4'", "True", "(2, 1, 3)"), Bytes(24)), "fortran_order is True");
}

// With at most one dimension above 1, column-major bytes are row-major ones.
TEST(NpyRead, AcceptsFortranOrderWhereItIsCOrder) {
  for (const char* shape : {"(3,)", "()", "(1, 3)", "(3, 1)", "(1, 3, 1)", "(0, 2)"}) {
    SCOPED_TRACE(shape);
    const std::string s(shape);
    const int64_t n = s == "()" ? 1 : s == "(0, 2)" ? 0 : 3;
    const std::vector<float> values = {1.5f, -2.0f, 3.25f};
    const Bytes data = raw<float>(std::vector<float>(values.begin(), values.begin() + n));
    Bytes file = make_npy(dict("'<f4'", "True", shape), data);
    NpyArray out;
    ASSERT_EQ(parse_npy(file.data(), file.size(), "X.npy", &out), "");
    EXPECT_EQ(out.bytes, data);
  }
}

TEST(NpyMalformed, ObjectDtype) {
  EXPECT_HAS(header_error(dict("'|O'", "False", "(2,)")), "object dtype '|O' is not supported");
}

TEST(NpyMalformed, StructuredDtype) {
  EXPECT_HAS(header_error(dict("[('a', '<f4'), ('b', '<i4')]", "False", "(2,)")),
             "structured dtype (descr is a list of fields) is not supported");
}

TEST(NpyMalformed, UnsupportedDtypes) {
  const std::pair<const char*, const char*> cases[] = {
      {"'|b1'", "'|b1' (bool)"},       {"'|u1'", "'|u1' (uint8)"},
      {"'<i2'", "'<i2' (int16)"},      {"'<u8'", "'<u8' (uint64)"},
      {"'<c8'", "'<c8' (complex64)"},  {"'<U3'", "'<U3' (str)"},
      {"'<f16'", "'<f16' (float128)"}, {"'<q9'", "'<q9' is not"},
  };
  for (const auto& [descr, detail] : cases) {
    SCOPED_TRACE(descr);
    std::string err = header_error(dict(descr, "False", "(1,)"), Bytes(16));
    EXPECT_HAS(err, detail);
    EXPECT_HAS(err, "is not supported; accepted dtypes: <f2 (float16), <f4 (float32) or "
                    "<f8 (float64) for every array but labels; <i4 (int32) or <i8 (int64) "
                    "for labels");
  }
}

TEST(NpyMalformed, NegativeShapeEntry) {
  EXPECT_HAS(header_error(dict("'<f4'", "False", "(3, -4)")), "shape entry -4 is negative");
}

TEST(NpyMalformed, NonIntegerShapeEntry) {
  EXPECT_HAS(header_error(dict("'<f4'", "False", "(2.5, 3)")), "shape entry \"2.5\" is not an integer");
  EXPECT_HAS(header_error(dict("'<f4'", "False", "('a',)")), "shape entry \"'a'\" is not an integer");
  EXPECT_HAS(header_error(dict("'<f4'", "False", "(None,)")), "shape entry \"None\" is not an integer");
  EXPECT_HAS(header_error(dict("'<f4'", "False", "(L,)")), "shape entry \"L\" is not an integer");
  EXPECT_HAS(header_error(dict("'<f4'", "False", "(3LL,)")), "shape entry \"3LL\" is not an integer");
}

// Python has no integer literal with a leading zero but zero itself, so
// numpy's reader refuses "(010,)"; read as 10 it would accept a file numpy
// cannot load. "0" and "00" are zero in Python too.
TEST(NpyMalformed, ShapeEntryWithALeadingZero) {
  EXPECT_HAS(header_error(dict("'<f4'", "False", "(010, 2)")),
             "shape entry 010 has a leading zero (not a Python integer)");
  EXPECT_HAS(header_error(dict("'<f4'", "False", "(2, 001)")), "shape entry 001 has a leading zero");
  for (const char* zero : {"(0, 10)", "(00, 10)"}) {
    SCOPED_TRACE(zero);
    Bytes file = make_npy(dict("'<f4'", "False", zero));
    NpyArray out;
    ASSERT_EQ(parse_npy(file.data(), file.size(), "X.npy", &out), "");
    EXPECT_EQ(out.shape, (std::vector<int64_t>{0, 10}));
  }
}

TEST(NpyMalformed, ShapeOverflowsInt64) {
  EXPECT_HAS(header_error(dict("'<f4'", "False", "(99999999999999999999,)")),
             "shape entry 99999999999999999999 overflows int64");
  EXPECT_HAS(header_error(dict("'<f4'", "False", "(4294967296, 4294967296)")),
             "shape (4294967296, 4294967296) overflows int64: it has too many elements");
  // 2^62 elements fit; 2^62 float32s are 2^64 bytes, which do not.
  EXPECT_HAS(header_error(dict("'<f4'", "False", "(4611686018427387904,)")),
             "shape (4611686018427387904,) of float32 overflows int64: its size in bytes");
}

TEST(NpyMalformed, DataShorterThanShape) {
  Bytes file = make_npy(dict("'<f4'", "False", "(3, 4)"), Bytes(40));
  NpyArray out;
  EXPECT_EQ(parse_npy(file.data(), file.size(), "Y.npy", &out),
            "Y.npy: data is 40 bytes but the header's shape (3, 4) of float32 needs 48");
  EXPECT_TRUE(out.shape.empty()) << "a failed parse must leave the output alone";
}

}  // namespace
