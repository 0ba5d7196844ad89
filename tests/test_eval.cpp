// Tests for `flce eval` (src/cli/eval.cpp) and the memory-mapped .npy I/O
// under it (src/io/npy_map.h).
//
// - EvalNpyMap, EvalNpyOutFile: the mapped reader gives exactly read_npy's
//   result (values, or the same error message) on good and malformed files;
//   the in-place writer produces the bytes write_npy would.
// - EvalVsRun: eval's per-token files and summary equal `flce run
//   --reduction none` on the same data and backend, bit for bit, for block
//   sizes that do and do not divide N. Exact equality is expected: both run
//   the same backend code on the same rows, whose per-row results do not
//   depend on how many rows share a call, and eval's statistics are float64
//   sums in row order of the same float64 per-row values that run writes
//   with --out-dtype f64 (recomputed here in the same order).
// - EvalProgress: the progress bar appears on a terminal only.
// - EvalErrors: bad inputs exit 2 naming the flag, and --out is untouched.
// - EvalMemory: resident memory does not grow with N.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "cli/bench_problem.h"
#include "flce/flce.h"
#include "io/npy.h"
#include "io/npy_map.h"
#include "support/cli_process.h"
#include "support/npy_files.h"

namespace {

using flce::Dtype;
using flce::io::NpyArray;
using flce_test::Bytes;
using flce_test::npy_bytes;
using flce_test::snapshot_dir;
using flce_test::write_array;
using flce_test::write_bytes;
using Args = std::vector<std::string>;
namespace fs = std::filesystem;

#define EXPECT_HAS(text, part) \
  EXPECT_NE((text).find(part), std::string::npos) << "missing '" << (part) << "' in: " << (text)

using Result = flce_test::CliResult;
using flce_test::run_cli;
using flce_test::run_cli_on_terminal;
using flce_test::slurp;
using flce_test::spawn_cli;

// The value of `key` in a one-line JSON object, as its text.
std::string json_field(const std::string& line, const std::string& key) {
  const std::string k = "\"" + key + "\": ";
  const size_t at = line.find(k);
  if (at == std::string::npos) return "";
  const size_t start = at + k.size();
  return line.substr(start, line.find_first_of(",}", start) - start);
}
double json_double(const std::string& line, const std::string& key) {
  return std::strtod(json_field(line, key).c_str(), nullptr);
}
int64_t json_int(const std::string& line, const std::string& key) {
  return std::strtoll(json_field(line, key).c_str(), nullptr, 10);
}

NpyArray read(const std::string& path) {
  NpyArray a;
  EXPECT_EQ(flce::io::read_npy(path, &a), "");
  return a;
}

// ---------------------------------------------------------------------------
// The mapped reader against read_npy.

Bytes raw_f32(std::vector<float> v) {
  Bytes b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// Maps `bytes` written to a file and reads them with read_npy: both must
// agree, on the error message or on dtype, shape and data.
void expect_same_as_read_npy(const std::string& path, const Bytes& bytes) {
  write_bytes(path, bytes);
  NpyArray want;
  const std::string want_error = flce::io::read_npy(path, &want);
  flce::io::NpyMap map;
  const std::string got_error = map.open(path);
  EXPECT_EQ(got_error, want_error);
  if (!want_error.empty() || !got_error.empty()) return;
  EXPECT_EQ(int(map.dtype()), int(want.dtype));
  EXPECT_EQ(map.shape(), want.shape);
  EXPECT_EQ(map.numel(), want.numel());
  ASSERT_EQ(map.header().data_bytes, want.bytes.size());
  EXPECT_TRUE(std::equal(want.bytes.begin(), want.bytes.end(), map.data()));
}

TEST(EvalNpyMap, AgreesWithReadNpyOnGoodAndMalformedFiles) {
  flce_test::TempDir tmp;
  const std::string p = tmp.file("a.npy");
  const std::string good = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  const Bytes six = raw_f32({1, 2, 3, 4, 5, 6});
  const std::vector<std::pair<std::string, Bytes>> cases = {
      {"numpy v1", npy_bytes(good, six, 1)},
      {"v2", npy_bytes(good, six, 2)},
      {"v3", npy_bytes(good, six, 3)},
      {"spacing, double quotes, key order",
       npy_bytes("{ \"shape\" :( 2 ,3 ) ,'fortran_order':False,\n'descr':'<f4'}", six)},
      {"repeated shape key: the last wins",
       npy_bytes("{'shape': (6,), 'descr': '<f4', 'fortran_order': False, 'shape': (3, 2)}", six)},
      {"0-D", npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': ()}", Bytes(8, 1))},
      {"empty", npy_bytes("{'descr': '<i8', 'fortran_order': False, 'shape': (4, 0)}", {})},
      {"trailing bytes", npy_bytes(good, raw_f32({1, 2, 3, 4, 5, 6, 7}))},
      {"Python 2 longs",
       npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (2L, 3L), }", six)},
      {"int32 native order", npy_bytes("{'descr': '=i4', 'fortran_order': False, 'shape': (6,)}", six)},
      {"empty file", {}},
      {"short", {0x93, 'N', 'U'}},
      {"bad magic", Bytes{'h', 'e', 'l', 'l', 'o', ' ', 'w', 'o', 'r', 'l', 'd'}},
      {"preamble only", {0x93, 'N', 'U', 'M', 'P', 'Y', 1}},
      {"version 4", npy_bytes(good, six, 4)},
      {"header past end", Bytes{0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, 0xf4, 0x01, '{', '}'}},
      {"not a dict", npy_bytes("[1, 2, 3]", six)},
      {"missing shape", npy_bytes("{'descr': '<f4', 'fortran_order': False}", six)},
      {"missing descr", npy_bytes("{'fortran_order': False, 'shape': (2, 3)}", six)},
      {"unknown key", npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (), 'x': 1}", six)},
      {"bad shape", npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (5)}", six)},
      {"bad bool", npy_bytes("{'descr': '<f4', 'fortran_order': maybe, 'shape': (2, 3)}", six)},
      {"text after the dict", npy_bytes(good + " xyz }", six)},
      {"big-endian", npy_bytes("{'descr': '>f4', 'fortran_order': False, 'shape': (2, 3)}", six)},
      {"fortran", npy_bytes("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3)}", six)},
      {"fortran vector", npy_bytes("{'descr': '<f4', 'fortran_order': True, 'shape': (6,)}", six)},
      {"fortran row", npy_bytes("{'descr': '<f4', 'fortran_order': True, 'shape': (1, 6)}", six)},
      {"uint8", npy_bytes("{'descr': '|u1', 'fortran_order': False, 'shape': (6,)}", six)},
      {"negative", npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (3, -2)}", six)},
      {"leading zero", npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (02, 3)}", six)},
      {"zero as 00", npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (00, 3)}", {})},
      {"no elements of huge dimensions",
       npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296, 0)}", {})},
      {"too many elements",
       npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296)}", six)},
      {"too many bytes",
       npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (4611686018427387904,)}", six)},
      {"data too short", npy_bytes(good, raw_f32({1, 2, 3, 4, 5}))},
      {"data missing", npy_bytes(good, {})},
  };
  for (const auto& [name, bytes] : cases) {
    SCOPED_TRACE(name);
    expect_same_as_read_npy(p, bytes);
  }
}

TEST(EvalNpyMap, ReleasedPagesReadBackFromTheFile) {
  flce_test::TempDir tmp;
  const int64_t n = 300000;  // 1.2 MB: many pages
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = double(i % 1000) - 500;
  const std::string p = write_array(tmp.file("big.npy"), Dtype::f32, {n}, v);
  flce::io::NpyMap map;
  ASSERT_EQ(map.open(p), "");
  map.advise_sequential();
  auto at = [&](int64_t i) {
    float f;
    std::memcpy(&f, map.data() + 4 * i, 4);
    return double(f);
  };
  for (int64_t i = 0; i < n; i += 997) {
    ASSERT_EQ(at(i), v[size_t(i)]);
    map.release_before(size_t(i) * 4);
  }
  map.release_before(size_t(n) * 4);
  for (int64_t i = 0; i < n; i += 4099) ASSERT_EQ(at(i), v[size_t(i)]) << i;
}

// Resident KiB of the mapping that holds `addr` (/proc/self/smaps's Rss),
// or -1 where the file cannot be read.
long resident_kb_of_mapping(const void* addr) {
  std::ifstream smaps("/proc/self/smaps");
  const auto at = reinterpret_cast<uintptr_t>(addr);
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(':') > line.find('-')) {
      inside = at >= lo && at < hi;
    } else if (inside && line.rfind("Rss:", 0) == 0) {
      return std::strtol(line.c_str() + 4, nullptr, 10);
    }
  }
  return -1;
}

// eval reads its labels twice, front to back: once to check them, then
// block by block. Each scan must drop its pages; the second scan's stayed
// resident (8 MB here, 8 bytes a row of eval) until rescan().
TEST(EvalNpyMap, EachScanDropsThePagesItRead) {
  flce_test::TempDir tmp;
  const int64_t n = 1 << 20;
  const std::string p = write_array(tmp.file("labels.npy"), Dtype::i64, {n},
                                    std::vector<double>(size_t(n), 3.0));
  flce::io::NpyMap map;
  ASSERT_EQ(map.open(p), "");
  long sum = 0;
  for (int scan = 0; scan < 2; ++scan) {
    SCOPED_TRACE("scan " + std::to_string(scan));
    for (int64_t i = 0; i < n; i += 512) sum += map.data()[8 * i];  // every page
    EXPECT_GT(resident_kb_of_mapping(map.data()), 4096);
    map.release_before(size_t(n) * 8);
    EXPECT_LT(resident_kb_of_mapping(map.data()), 64);
    map.rescan();
  }
  EXPECT_EQ(sum, 2 * (n / 512) * 3);
}

TEST(EvalNpyMap, MissingFileAndDirectory) {
  flce_test::TempDir tmp;
  flce::io::NpyMap map;
  EXPECT_EQ(map.open(tmp.file("none.npy")), tmp.file("none.npy") + ": cannot open: No such file or directory");
  EXPECT_HAS(map.open(tmp.path()), "Is a directory");
}

TEST(EvalNpyOutFile, FilledInPiecesEqualsWriteNpy) {
  flce_test::TempDir tmp;
  for (Dtype dtype : {Dtype::f32, Dtype::f64, Dtype::i64, Dtype::i32, Dtype::f16}) {
    for (int64_t n : {1, 9, 10, 11, 99, 100, 12345}) {
      SCOPED_TRACE(std::string(flce::dtype_name(dtype)) + " n = " + std::to_string(n));
      std::vector<double> v(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) v[size_t(i)] = double((i * 37) % 101) - 50;
      const NpyArray want = flce_test::npy_array(dtype, {n}, v);
      flce::io::NpyOutFile f;
      const std::string p = tmp.file("o.npy");
      ASSERT_EQ(f.create(p, dtype, {n}), "");
      const size_t elt = flce::dtype_size(dtype);
      for (int64_t first = 0; first < n; first += 7) {
        const int64_t count = std::min<int64_t>(7, n - first);
        ASSERT_EQ(f.write(first, want.bytes.data() + size_t(first) * elt, count), "");
      }
      EXPECT_HAS(f.write(n - 1, want.bytes.data(), 2), "outside the array");
      ASSERT_EQ(f.close(), "");
      EXPECT_EQ(flce_test::read_bytes(p), flce::io::encode_npy(want));
    }
  }
  flce::io::NpyOutFile f2;
  EXPECT_HAS(f2.create(tmp.file("x.npy"), Dtype::bf16, {3}), "no .npy equivalent");
  EXPECT_HAS(f2.create(tmp.file("no/such/dir.npy"), Dtype::f32, {3}), "cannot open for writing");
}

// ---------------------------------------------------------------------------
// eval against run.

constexpr int64_t N = 37, H = 12, V = 29;

std::vector<double> transpose(const std::vector<double>& a, int64_t rows, int64_t cols) {
  std::vector<double> t(a.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[size_t(c * rows + r)] = a[size_t(r * cols + c)];
  return t;
}

// A generated problem on disk: x and W in several dtypes and layouts,
// labels with ignored rows, a third of them the row's top class.
class EvalProblem : public ::testing::Test {
 protected:
  flce_test::TempDir tmp;
  std::string out = tmp.file("out");
  std::vector<double> xv, wv;
  std::vector<int64_t> yv;

  EvalProblem() {
    std::mt19937_64 rng(12345);
    std::uniform_real_distribution<double> u(-1, 1);
    for (int64_t i = 0; i < N * H; ++i) xv.push_back(u(rng));
    for (int64_t i = 0; i < V * H; ++i) wv.push_back(0.8 * u(rng));
    std::vector<double> y, y_custom, bias;
    for (int64_t i = 0; i < N; ++i) {
      int64_t best = 0;
      double top = -1e300;
      for (int64_t j = 0; j < V; ++j) {
        double s = 0;
        for (int64_t k = 0; k < H; ++k) s += xv[size_t(i * H + k)] * wv[size_t(j * H + k)];
        if (s > top) top = s, best = j;
      }
      const int64_t label = i % 3 == 0 ? best : int64_t(rng() % uint64_t(V));
      yv.push_back(i % 5 == 2 ? -100 : label);
      y.push_back(double(yv.back()));
      y_custom.push_back(i % 4 == 1 ? 3.0 : double(label));  // --ignore-index 3
    }
    for (int64_t j = 0; j < V; ++j) bias.push_back(0.3 * u(rng));
    write_array(tmp.file("x.npy"), Dtype::f32, {N, H}, xv);
    write_array(tmp.file("x64.npy"), Dtype::f64, {N, H}, xv);
    write_array(tmp.file("x16.npy"), Dtype::f16, {N, H}, xv);
    write_array(tmp.file("w.npy"), Dtype::f32, {V, H}, wv);
    write_array(tmp.file("w64.npy"), Dtype::f64, {V, H}, wv);
    write_array(tmp.file("w16.npy"), Dtype::f16, {V, H}, wv);
    write_array(tmp.file("w_hv.npy"), Dtype::f32, {H, V}, transpose(wv, V, H));
    write_array(tmp.file("bias.npy"), Dtype::f32, {V}, bias);
    write_array(tmp.file("y.npy"), Dtype::i64, {N}, y);
    write_array(tmp.file("y32.npy"), Dtype::i32, {N}, y_custom);
    // x as float32 behind a header of odd length: the data is not aligned
    // to 4 bytes in the file (nor in the mapping), so eval copies blocks.
    const NpyArray x32 = flce_test::npy_array(Dtype::f32, {N, H}, xv);
    std::string h = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + std::to_string(N) +
                    ", " + std::to_string(H) + ")}";
    while ((10 + h.size() + 1) % 4 != 1) h += ' ';
    h += '\n';
    Bytes odd = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
    odd.push_back(static_cast<unsigned char>(h.size()));
    odd.push_back(0);
    for (char c : h) odd.push_back(static_cast<unsigned char>(c));
    odd.insert(odd.end(), x32.bytes.begin(), x32.bytes.end());
    write_bytes(tmp.file("x_odd.npy"), odd);
  }

  Result run(const Args& a) { return run_cli(a, tmp.path()); }
};

// One configuration: the input flags, given alike to run and eval.
struct Case {
  const char* name;
  Args inputs;
};

class EvalVsRun : public EvalProblem, public ::testing::WithParamInterface<Case> {};

// Reads an [N] file written by eval or run as doubles.
std::vector<double> values(const std::string& path) { return flce_test::npy_values(read(path)); }

TEST_P(EvalVsRun, PerTokenFilesAndSummaryEqualRunForAnyBlockSize) {
  Args inputs;
  for (const std::string& a : GetParam().inputs)
    inputs.push_back(a.size() > 4 && a.substr(a.size() - 4) == ".npy" ? tmp.file(a) : a);
  const std::string r32 = tmp.file("run32"), r64 = tmp.file("run64");
  Args run_args = {"run"};
  run_args.insert(run_args.end(), inputs.begin(), inputs.end());
  run_args.insert(run_args.end(), {"--reduction", "none"});
  Args a32 = run_args, a64 = run_args;
  a32.insert(a32.end(), {"--out", r32});
  a64.insert(a64.end(), {"--out-dtype", "f64", "--out", r64});
  Result r = run(a32);
  ASSERT_EQ(r.code, 0) << r.err;
  r = run(a64);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string backend = r.out.substr(9, r.out.find('\n') - 9);  // "backend: cpu"

  // The expected summary, from run's float64 per-row values in row order.
  int64_t ignore = -100;
  for (size_t i = 0; i + 1 < inputs.size(); ++i)
    if (inputs[i] == "--ignore-index") ignore = std::stoll(inputs[i + 1]);
  std::string labels_file;
  for (size_t i = 0; i + 1 < inputs.size(); ++i)
    if (inputs[i] == "--labels") labels_file = inputs[i + 1];
  const std::vector<double> y = values(labels_file), loss = values(r64 + "/loss.npy"),
                            ent = values(r64 + "/entropy.npy"),
                            arg = values(r64 + "/argmax.npy");
  double sum_loss = 0, sum_ent = 0;
  int64_t scored = 0, correct = 0;
  for (int64_t i = 0; i < N; ++i) {
    if (int64_t(y[size_t(i)]) == ignore) continue;
    ++scored;
    sum_loss += loss[size_t(i)];
    sum_ent += ent[size_t(i)];
    correct += arg[size_t(i)] == y[size_t(i)];
  }
  ASSERT_GT(scored, 0);
  ASSERT_LT(scored, N);

  for (int64_t block : {int64_t(1), int64_t(7), N, N + 5}) {
    SCOPED_TRACE("--block-rows " + std::to_string(block));
    for (const char* out_dtype : {"f32", "f64"}) {
      SCOPED_TRACE(std::string("--out-dtype ") + out_dtype);
      const std::string dir = tmp.file(std::string("eval_") + out_dtype);
      Args e = {"eval"};
      e.insert(e.end(), inputs.begin(), inputs.end());
      e.insert(e.end(), {"--block-rows", std::to_string(block), "--out-dtype", out_dtype,
                         "--out", dir, "--json"});
      r = run(e);
      ASSERT_EQ(r.code, 0) << r.err;
      EXPECT_EQ(r.err, "");
      const std::string& j = r.out;
      EXPECT_EQ(j.find('\n'), j.size() - 1) << "one JSON line: " << j;
      EXPECT_EQ(json_field(j, "backend"), "\"" + backend + "\"");
      EXPECT_EQ(json_int(j, "rows"), N);
      EXPECT_EQ(json_int(j, "ignored"), N - scored);
      EXPECT_EQ(json_int(j, "scored"), scored);
      EXPECT_EQ(json_int(j, "correct"), correct);
      EXPECT_EQ(json_double(j, "mean_loss"), sum_loss / double(scored));
      EXPECT_EQ(json_double(j, "perplexity"), std::exp(sum_loss / double(scored)));
      EXPECT_EQ(json_double(j, "accuracy"), double(correct) / double(scored));
      EXPECT_EQ(json_double(j, "mean_entropy"), sum_ent / double(scored));
      const std::string ref = std::string(out_dtype) == "f32" ? r32 : r64;
      for (const char* f : {"logprob.npy", "entropy.npy", "argmax.npy"}) {
        SCOPED_TRACE(f);
        const NpyArray got = read(dir + "/" + f), want = read(ref + "/" + f);
        EXPECT_EQ(int(got.dtype), int(want.dtype));
        EXPECT_EQ(got.shape, std::vector<int64_t>{N});
        EXPECT_TRUE(got.bytes == want.bytes) << "not bit-identical to flce run";
      }
      // Only the three files, no temporaries left behind.
      std::vector<std::string> names;
      for (const auto& [name, bytes] : snapshot_dir(dir)) names.push_back(name);
      EXPECT_EQ(names, (std::vector<std::string>{"argmax.npy", "entropy.npy", "logprob.npy"}));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Eval, EvalVsRun,
    ::testing::Values(
        Case{"f32", {"--x", "x.npy", "--w", "w.npy", "--labels", "y.npy"}},
        Case{"hv", {"--x", "x.npy", "--w", "w_hv.npy", "--w-layout", "hv", "--labels", "y.npy"}},
        Case{"bias", {"--x", "x.npy", "--w", "w.npy", "--bias", "bias.npy", "--labels", "y.npy"}},
        Case{"bf16", {"--x", "x.npy", "--w", "w.npy", "--bias", "bias.npy", "--labels", "y.npy",
                      "--dtype", "bf16"}},
        Case{"bf16_from_f64", {"--x", "x64.npy", "--w", "w64.npy", "--labels", "y.npy",
                               "--dtype", "bf16"}},
        Case{"f16_files", {"--x", "x16.npy", "--w", "w16.npy", "--labels", "y.npy"}},
        Case{"f16_dtype", {"--x", "x.npy", "--w", "w.npy", "--labels", "y.npy", "--dtype", "f16"}},
        Case{"options", {"--x", "x.npy", "--w", "w.npy", "--labels", "y32.npy", "--ignore-index",
                         "3", "--logit-scale", "0.7", "--softcap", "4", "--label-smoothing",
                         "0.1", "--z-loss", "0.001"}},
        Case{"unaligned_x", {"--x", "x_odd.npy", "--w", "w.npy", "--labels", "y.npy"}},
        Case{"threads", {"--x", "x.npy", "--w", "w.npy", "--labels", "y.npy", "--threads", "1"}},
        Case{"reference_f64", {"--x", "x64.npy", "--w", "w64.npy", "--bias", "bias.npy",
                               "--labels", "y.npy", "--backend", "reference"}},
        Case{"reference_bf16", {"--x", "x.npy", "--w", "w_hv.npy", "--w-layout", "hv",
                                "--labels", "y32.npy", "--ignore-index", "3", "--dtype", "bf16",
                                "--label-smoothing", "0.2", "--backend", "reference"}}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

TEST_F(EvalProblem, TextSummaryNamesEveryQuantity) {
  const Result r = run({"eval", "--x", tmp.file("x.npy"), "--w", tmp.file("w.npy"), "--labels",
                        tmp.file("y.npy")});
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* part : {"backend: cpu\n", "rows: 37 (ignored: 7, scored: 30)\n",
                           "mean loss: ", "perplexity: ", "accuracy: ", "mean entropy: ",
                           "tokens/s"})
    EXPECT_HAS(r.out, part);
  EXPECT_EQ(r.err, "");
  EXPECT_FALSE(fs::exists(out)) << "no --out, no files";
}

TEST_F(EvalProblem, AllRowsIgnoredGivesNullMeans) {
  const std::string y = write_array(tmp.file("y_none.npy"), Dtype::i64, {N},
                                    std::vector<double>(size_t(N), -100));
  const Result r = run({"eval", "--x", tmp.file("x.npy"), "--w", tmp.file("w.npy"), "--labels",
                        y, "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(json_int(r.out, "scored"), 0);
  EXPECT_EQ(json_field(r.out, "mean_loss"), "null");
  EXPECT_EQ(json_field(r.out, "accuracy"), "null");
  const Result text = run({"eval", "--x", tmp.file("x.npy"), "--w", tmp.file("w.npy"),
                           "--labels", y});
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_NE(text.out.find("mean loss: nan\n"), std::string::npos) << text.out;  // not -nan
  EXPECT_NE(text.out.find("accuracy: nan (0/0)\n"), std::string::npos) << text.out;
}

// ---------------------------------------------------------------------------
// The progress bar.

TEST_F(EvalProblem, ProgressBarOnlyOnATerminal) {
  const Args a = {"eval", "--x", tmp.file("x.npy"), "--w", tmp.file("w.npy"), "--labels",
                  tmp.file("y.npy"), "--block-rows", "5"};
  const Result piped = run(a);
  ASSERT_EQ(piped.code, 0) << piped.err;
  EXPECT_EQ(piped.err, "") << "no progress bar when stderr is not a terminal";
  EXPECT_EQ(piped.out.find("tok/s"), std::string::npos);

  int code = -1;
  const std::string tty = run_cli_on_terminal(a, &code);
  EXPECT_EQ(code, 0) << tty;
  EXPECT_HAS(tty, "\r[########################] 37/37 rows 100.0%");
  EXPECT_HAS(tty, " tok/s ");
  EXPECT_HAS(tty, "mean loss: ");

  Args quiet = a;
  quiet.push_back("--no-progress");
  const std::string silent = run_cli_on_terminal(quiet, &code);
  EXPECT_EQ(code, 0) << silent;
  EXPECT_EQ(silent.find("tok/s"), std::string::npos) << silent;
  EXPECT_HAS(silent, "mean loss: ");
}

// ---------------------------------------------------------------------------
// Bad input: exit 2, a message naming the flag, nothing in --out.

class EvalErrors : public EvalProblem {
 protected:
  Args args;
  EvalErrors() {
    args = {"eval", "--x", tmp.file("x.npy"), "--w", tmp.file("w.npy"), "--labels",
            tmp.file("y.npy"), "--out", out};
  }
  Args with(const std::string& flag, const std::string& value) const {
    Args a = args;
    for (size_t i = 0; i + 1 < a.size(); ++i)
      if (a[i] == flag) {
        a[i + 1] = value;
        return a;
      }
    a.push_back(flag);
    a.push_back(value);
    return a;
  }
  Args without(const std::string& flag) const {
    Args a = args;
    for (size_t i = 0; i + 1 < a.size(); ++i)
      if (a[i] == flag) {
        a.erase(a.begin() + long(i), a.begin() + long(i) + 2);
        break;
      }
    return a;
  }
  void fails(const Args& a, const std::vector<std::string>& needles) {
    const auto before = snapshot_dir(out);
    const Result r = run(a);
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_HAS(r.err, "flce eval: error: ");
    for (const std::string& n : needles) EXPECT_HAS(r.err, n);
    EXPECT_TRUE(snapshot_dir(out) == before) << "a failed eval changed --out: " << r.err;
    EXPECT_EQ(r.out, "");
  }
};

TEST_F(EvalErrors, MissingArgumentsAndFiles) {
  fails(without("--x"), {"--x: missing"});
  fails(without("--w"), {"--w: missing"});
  fails(without("--labels"), {"--labels: missing"});
  fails(with("--x", tmp.file("nope.npy")),
        {"--x: ", tmp.file("nope.npy"), "cannot open: No such file or directory"});
  fails(with("--w", tmp.file("nope.npy")), {"--w: ", "nope.npy: cannot open"});
  fails(with("--labels", tmp.file("nope.npy")), {"--labels: ", "nope.npy: cannot open"});
  fails(with("--bias", tmp.file("nope.npy")), {"--bias: ", "nope.npy: cannot open"});
  fails(with("--x", tmp.path()), {"--x: ", "Is a directory"});
}

TEST_F(EvalErrors, MalformedNpy) {
  write_bytes(tmp.file("junk.npy"), Bytes{'n', 'o', 't', ' ', 'n', 'p', 'y', '!', '!', '!'});
  fails(with("--x", tmp.file("junk.npy")), {"--x: ", "junk.npy: not a .npy file"});
  fails(with("--labels", tmp.file("junk.npy")), {"--labels: ", "junk.npy: not a .npy file"});
  // x's header promises more rows than the file holds.
  const Bytes x = flce_test::read_bytes(tmp.file("x.npy"));
  ASSERT_GT(x.size(), 10u);
  write_bytes(tmp.file("short.npy"), Bytes(x.begin(), x.end() - 10));
  fails(with("--x", tmp.file("short.npy")), {"--x: ", "short.npy: data is", "needs 1776"});
  write_bytes(tmp.file("fortran.npy"),
              npy_bytes("{'descr': '<f4', 'fortran_order': True, 'shape': (37, 12)}",
                        Bytes(size_t(N * H) * 4)));
  fails(with("--x", tmp.file("fortran.npy")), {"--x: ", "fortran_order is True"});
}

TEST_F(EvalErrors, ShapeMismatches) {
  write_array(tmp.file("w_h.npy"), Dtype::f32, {V, H + 1}, std::vector<double>(size_t(V * (H + 1))));
  fails(with("--w", tmp.file("w_h.npy")),
        {"--w ", "w_h.npy: shape (29, 13) does not match --x ", "with H = 12"});
  fails(with("--w-layout", "hv"), {"--w ", "with --w-layout hv, W is [H, V] with H = 12"});
  write_array(tmp.file("y36.npy"), Dtype::i64, {N - 1}, std::vector<double>(size_t(N - 1)));
  fails(with("--labels", tmp.file("y36.npy")),
        {"--labels ", "y36.npy: shape (36,) does not match --x", "N = 37"});
  write_array(tmp.file("y2d.npy"), Dtype::i64, {N, 1}, std::vector<double>(size_t(N)));
  fails(with("--labels", tmp.file("y2d.npy")), {"--labels ", "shape (37, 1)"});
  write_array(tmp.file("x1d.npy"), Dtype::f32, {N}, std::vector<double>(size_t(N)));
  fails(with("--x", tmp.file("x1d.npy")), {"--x ", "x1d.npy: shape (37,) is 1-D; x must be 2-D"});
  write_array(tmp.file("x0.npy"), Dtype::f32, {0, H}, {});
  fails(with("--x", tmp.file("x0.npy")), {"--x ", "shape (0, 12); N and H must be >= 1"});
  write_array(tmp.file("b.npy"), Dtype::f32, {V + 1}, std::vector<double>(size_t(V + 1)));
  fails(with("--bias", tmp.file("b.npy")), {"--bias ", "b.npy: shape (30,) does not match V = 29"});
}

TEST_F(EvalErrors, WrongDtypesAndLabels) {
  write_array(tmp.file("yf.npy"), Dtype::f32, {N}, std::vector<double>(size_t(N)));
  fails(with("--labels", tmp.file("yf.npy")),
        {"--labels ", "yf.npy: dtype f32; labels must be int32 or int64"});
  write_array(tmp.file("xi.npy"), Dtype::i32, {N, H}, std::vector<double>(size_t(N * H)));
  fails(with("--x", tmp.file("xi.npy")), {"--x ", "xi.npy: dtype i32 is not a float type"});
  fails(with("--w", tmp.file("xi.npy")), {"--w ", "is not a float type"});
  // float64 x: the cpu backend, eval's default, declines it. No --backend was
  // given, so the message says the backend was the default, not the flag's.
  write_array(tmp.file("x64.npy"), Dtype::f64, {N, H}, std::vector<double>(size_t(N * H)));
  fails(with("--x", tmp.file("x64.npy")),
        {"error: the default backend (--backend picks another): backend = cpu: declines"});
  std::vector<double> y(size_t(N), 1);
  y[30] = 29;
  write_array(tmp.file("ybad.npy"), Dtype::i64, {N}, y);
  fails(with("--labels", tmp.file("ybad.npy")),
        {"--labels ", "labels[30] = 29 is outside [0, V) with V = 29 and is not ignore_index (-100)"});
  y[30] = -100;  // fine by default, out of range once ignore_index is another value
  write_array(tmp.file("ybad2.npy"), Dtype::i32, {N}, y);
  Args a = with("--labels", tmp.file("ybad2.npy"));
  a.insert(a.end(), {"--ignore-index", "1"});
  fails(a, {"labels[30] = -100 is outside [0, V)", "ignore_index (1)"});
}

TEST_F(EvalErrors, BadOptions) {
  fails(with("--block-rows", "0"), {"--block-rows: 0 is not >= 1"});
  fails(with("--block-rows", "many"), {"--block-rows: 'many' is not an integer"});
  fails(with("--logit-scale", "-1"), {"--logit-scale: logit_scale = -1"});
  fails(with("--softcap", "abc"), {"--softcap: 'abc' is not a number"});
  fails(with("--label-smoothing", "1.5"), {"--label-smoothing: label_smoothing = 1.5"});
  fails(with("--z-loss", "-0.5"), {"--z-loss: z_loss = -0.5"});
  fails(with("--dtype", "f8"), {"--dtype: 'f8' is not one of f32|bf16|f16"});
  fails(with("--w-layout", "vv"), {"--w-layout: 'vv' is not one of vh|hv"});
  fails(with("--out-dtype", "i8"), {"--out-dtype: 'i8' is not one of f32|f64"});
  fails(with("--threads", "-1"), {"--threads: -1 is not in [0, 4096] (0: all cores)"});
  fails(with("--backend", "gpu9"), {"--backend: ", "gpu9"});
  fails(with("--gemm", "nosuch"), {"--gemm: ", "nosuch"});
  // The default backend declines a softcap float32 cannot hold: both named.
  fails(with("--softcap", "1e300"), {"the default backend (--backend picks another) with "
                                     "--softcap: ", "softcap = 1e+300"});
  fails(with("--reduction", "sum"), {"unknown option '--reduction'"});
  Args a = args;
  a.push_back("--json=1");
  fails(a, {"--json: takes no value"});
}

TEST_F(EvalErrors, FailuresLeaveEarlierOutputsAlone) {
  // A good eval fills --out; later failures must leave exactly those files.
  const Result good = run(args);
  ASSERT_EQ(good.code, 0) << good.err;
  ASSERT_EQ(snapshot_dir(out).size(), 3u);
  fails(with("--x", tmp.file("nope.npy")), {"--x: "});
  fails(with("--logit-scale", "0"), {"--logit-scale"});
  // A failure after every block was written (a final name is taken by a
  // directory): the temporary files are removed, nothing is renamed.
  fs::remove(out + "/argmax.npy");
  fs::create_directory(out + "/argmax.npy");
  fails(with("--block-rows", "4"), {"--out: ", "argmax.npy exists and is not a regular file"});
  // --out is a file.
  write_bytes(tmp.file("file"), Bytes{1});
  const Result r = run(with("--out", tmp.file("file")));
  EXPECT_EQ(r.code, 2);
  EXPECT_HAS(r.err, "--out " + tmp.file("file") + ": cannot create the directory");
}

TEST_F(EvalErrors, OutputsOfAnEarlierRunAreLeftAndNamed) {
  // A `flce run --grad` into --out, then an eval there: eval's three files
  // are replaced; the run's others stay (they may be the user's own) and
  // eval names them on stderr, since a leftover lse.npy could pass for this
  // eval's.
  // `flce run` on this fixture's problem, per sample, with `extra`.
  const auto run_problem = [&](Args extra) {
    Args args = {"run", "--x", tmp.file("x.npy"), "--w", tmp.file("w.npy"),
                 "--labels", tmp.file("y.npy"), "--reduction", "none"};
    args.insert(args.end(), extra.begin(), extra.end());
    return run(args);
  };
  const Result ran = run_problem({"--grad", "--out", out});
  ASSERT_EQ(ran.code, 0) << ran.err;
  const auto before = snapshot_dir(out);
  const Result evaluated = run(with("--logit-scale", "0.5"));
  ASSERT_EQ(evaluated.code, 0) << evaluated.err;
  EXPECT_HAS(evaluated.err, "flce eval: note: --out " + out +
                                " also holds loss.npy, lse.npy, zloss.npy, grad_x.npy, "
                                "grad_w.npy, which this eval did not write");
  const Result again = run_problem({"--logit-scale", "0.5", "--out", tmp.file("run")});
  ASSERT_EQ(again.code, 0) << again.err;
  const auto after = snapshot_dir(out);
  EXPECT_EQ(after.size(), before.size());
  for (const auto& [name, bytes] : before) {
    const bool evals = name == "logprob.npy" || name == "entropy.npy" || name == "argmax.npy";
    EXPECT_EQ(after.at(name), evals ? flce_test::read_bytes(tmp.file("run") + "/" + name) : bytes)
        << name;
  }
  EXPECT_NE(after.at("logprob.npy"), before.at("logprob.npy"));
  // An eval into a directory of its own outputs says nothing.
  const Result quiet = run(with("--out", tmp.file("evals")));
  ASSERT_EQ(quiet.code, 0) << quiet.err;
  const Result twice = run(with("--out", tmp.file("evals")));
  EXPECT_EQ(twice.err.find("note"), std::string::npos) << twice.err;
}

// `flce eval ARGS` (with --out), and `meanwhile(pid)` once its temporary
// output files all appear (SIGKILL if they never do): whether they
// appeared, the exit status, stderr.
struct Interrupted {
  bool started = false;
  int status = 0;
  std::string err;
};

Interrupted eval_and_meanwhile(const Args& args, const std::string& out,
                               const std::string& err_file,
                               const std::function<void(pid_t)>& meanwhile) {
  const pid_t pid = spawn_cli(args, err_file);
  Interrupted r;
  if (pid <= 0) return r;
  for (int i = 0; i < 2000 && !r.started; ++i) {  // up to 20 s
    for (const auto& [name, bytes] : snapshot_dir(out))  // the last of the three it creates
      r.started |= name.rfind(".argmax.npy.tmp", 0) == 0;
    if (!r.started) ::usleep(10000);
  }
  if (r.started) meanwhile(pid);
  else ::kill(pid, SIGKILL);
  ::waitpid(pid, &r.status, 0);
  r.err = slurp(err_file);
  return r;
}

// The eval sent `signal` (and a second SIGINT 50 ms later if `twice`)
// `delay_us` after its files appear.
Interrupted interrupt_eval(const Args& args, const std::string& out, const std::string& err_file,
                           useconds_t delay_us, bool twice = false, int signal = SIGINT) {
  return eval_and_meanwhile(args, out, err_file, [&](pid_t pid) {
    ::usleep(delay_us);
    ::kill(pid, signal);
    if (twice) {
      ::usleep(50000);
      ::kill(pid, SIGINT);
    }
  });
}

// The args of an eval of 20000 rows one at a time (seconds), into `out`.
Args long_eval(const flce_test::TempDir& tmp, const std::string& out) {
  constexpr int64_t kRows = 20000;
  std::vector<double> x(static_cast<size_t>(kRows * H)), y(static_cast<size_t>(kRows));
  for (size_t i = 0; i < x.size(); ++i) x[i] = double(i % 17) / 17.0 - 0.5;
  for (size_t i = 0; i < y.size(); ++i) y[i] = double(i % size_t(V));
  write_array(tmp.file("x_long.npy"), Dtype::f32, {kRows, H}, x);
  write_array(tmp.file("y_long.npy"), Dtype::i64, {kRows}, y);
  return {"eval", "--x", tmp.file("x_long.npy"), "--w", tmp.file("w.npy"), "--labels",
          tmp.file("y_long.npy"), "--block-rows", "1", "--out", out};
}

TEST_F(EvalErrors, InterruptRemovesTheTemporaryFiles) {
  // A long eval (one row per call), interrupted once its output files exist.
  const Interrupted r = interrupt_eval(long_eval(tmp, out), out, tmp.file("interrupt_stderr.txt"), 0);
  ASSERT_TRUE(r.started) << "the output files never appeared";
  ASSERT_TRUE(WIFEXITED(r.status)) << "killed by a signal instead of stopping cleanly";
  EXPECT_EQ(WEXITSTATUS(r.status), 2);
  EXPECT_HAS(r.err, "flce eval: error: interrupted by signal 2 at row ");
  EXPECT_TRUE(snapshot_dir(out).empty()) << "temporary files left in --out";
}

TEST_F(EvalErrors, HangupAndQuitRemoveTheTemporaryFilesToo) {
  // A closed terminal or ssh session (SIGHUP) and Ctrl+backslash (SIGQUIT) left
  // full-size temporaries: only SIGINT and SIGTERM were caught.
  for (int sig : {SIGHUP, SIGQUIT}) {
    SCOPED_TRACE(sig);
    const Interrupted r =
        interrupt_eval(long_eval(tmp, out), out, tmp.file("interrupt_stderr.txt"), 0, false, sig);
    ASSERT_TRUE(r.started) << "the output files never appeared";
    ASSERT_TRUE(WIFEXITED(r.status)) << "killed by the signal instead of stopping cleanly";
    EXPECT_EQ(WEXITSTATUS(r.status), 2);
    EXPECT_HAS(r.err, "flce eval: error: interrupted by signal " + std::to_string(sig));
    EXPECT_TRUE(snapshot_dir(out).empty()) << "temporary files left in --out";
  }
}

// An input rewritten in place while eval reads it (np.save over the same
// path): truncated, a read past its new end was a SIGBUS that killed eval
// with no message and left its temporaries; rewritten at the same size,
// the outputs silently mixed old and new rows. Either way eval now stops
// with an error naming the file, and --out is left as it was.
TEST_F(EvalErrors, AnInputRewrittenDuringTheEvalStopsIt) {
  const Args args = long_eval(tmp, out);
  const std::string x = tmp.file("x_long.npy"), y = tmp.file("y_long.npy");
  const Bytes x_bytes = flce_test::read_bytes(x), y_bytes = flce_test::read_bytes(y);
  struct Case {
    const char* what;
    std::string path, flag;
    Bytes replacement;
  };
  Bytes x_other = x_bytes;  // the same size, other values
  for (size_t k = x_other.size() / 2; k < x_other.size(); ++k) x_other[k] ^= 0x40;
  const std::vector<Case> cases = {
      {"x truncated", x, "--x", Bytes(x_bytes.begin(), x_bytes.begin() + 256)},
      {"x rewritten at its size", x, "--x", x_other},
      {"labels truncated", y, "--labels", Bytes(y_bytes.begin(), y_bytes.begin() + 200)},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const Interrupted r = eval_and_meanwhile(args, out, tmp.file("rewrite_stderr.txt"),
                                             [&](pid_t) { write_bytes(c.path, c.replacement); });
    ASSERT_TRUE(r.started) << "the output files never appeared";
    ASSERT_TRUE(WIFEXITED(r.status)) << "killed by signal " << WTERMSIG(r.status) << "; " << r.err;
    EXPECT_EQ(WEXITSTATUS(r.status), 2) << r.err;
    EXPECT_HAS(r.err, "flce eval: error: " + c.flag + ": " + c.path + ": changed while it was read");
    EXPECT_TRUE(snapshot_dir(out).empty()) << "temporary files left in --out";
    write_bytes(x, x_bytes);
    write_bytes(y, y_bytes);
  }
}

TEST_F(EvalErrors, TheNextEvalRemovesWhatAKilledOneLeft) {
  // SIGKILL (the OOM killer, a scheduler's hard stop) leaves the hidden
  // temporaries, which can be as large as the outputs; the next command
  // into --out removes them and says so.
  const Interrupted r = interrupt_eval(long_eval(tmp, out), out, tmp.file("interrupt_stderr.txt"), 0,
                                       false, SIGKILL);
  ASSERT_TRUE(r.started) << "the output files never appeared";
  ASSERT_EQ(snapshot_dir(out).size(), 3u) << "the killed eval left no temporaries to test with";
  const Result again = run(with("--out", out));
  ASSERT_EQ(again.code, 0) << again.err;
  EXPECT_HAS(again.err, "flce eval: note: removed .argmax.npy.tmp.");
  EXPECT_HAS(again.err, "(left by a flce process of this host that is no longer running)");
  std::vector<std::string> names;
  for (const auto& [name, bytes] : snapshot_dir(out)) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"argmax.npy", "entropy.npy", "logprob.npy"}));
}

TEST_F(EvalErrors, InterruptDuringTheLastBlockLeavesOutAsItWas) {
  // Two blocks of about a second each on the reference backend; the files
  // appear after the first, and the signal comes 0.1 s later, inside the
  // last block, whose end no block-start check follows: eval used to commit
  // and exit 0. (Had the signal come before the second block's check, the
  // outcome is the same.)
  constexpr int64_t kRows = 4096, kH = 64, kV = 8192;
  std::vector<double> x(static_cast<size_t>(kRows * kH)), w(static_cast<size_t>(kV * kH)),
      y(static_cast<size_t>(kRows));
  for (size_t i = 0; i < x.size(); ++i) x[i] = double(i % 17) / 17.0 - 0.5;
  for (size_t i = 0; i < w.size(); ++i) w[i] = double(i % 13) / 26.0 - 0.25;
  for (size_t i = 0; i < y.size(); ++i) y[i] = double(i * 7 % size_t(kV));
  write_array(tmp.file("x_wide.npy"), Dtype::f32, {kRows, kH}, x);
  write_array(tmp.file("w_wide.npy"), Dtype::f32, {kV, kH}, w);
  write_array(tmp.file("y_wide.npy"), Dtype::i64, {kRows}, y);
  const Args args = {"eval", "--x", tmp.file("x_wide.npy"), "--w", tmp.file("w_wide.npy"),
                     "--labels", tmp.file("y_wide.npy"), "--block-rows", "2048", "--backend",
                     "reference", "--threads", "1", "--out", out};
  const Interrupted r = interrupt_eval(args, out, tmp.file("interrupt_stderr.txt"), 100000);
  ASSERT_TRUE(r.started) << "the output files never appeared";
  ASSERT_TRUE(WIFEXITED(r.status)) << "killed by a signal instead of stopping cleanly";
  EXPECT_EQ(WEXITSTATUS(r.status), 2) << r.err;
  EXPECT_HAS(r.err, "flce eval: error: interrupted by signal 2");
  EXPECT_TRUE(snapshot_dir(out).empty()) << "files left in --out";

  // A second signal 50 ms after the first ends eval at once (or the first
  // stopped it already): either way no temporary file stays behind (they
  // did: the second signal killed eval before its cleanup).
  const Interrupted twice = interrupt_eval(args, out, tmp.file("interrupt_stderr.txt"), 100000,
                                           true);
  ASSERT_TRUE(twice.started) << "the output files never appeared";
  EXPECT_TRUE(WIFSIGNALED(twice.status) ? WTERMSIG(twice.status) == SIGINT
                                        : WIFEXITED(twice.status) && WEXITSTATUS(twice.status) == 2)
      << twice.status;
  EXPECT_TRUE(snapshot_dir(out).empty()) << "files left in --out";
}

// ---------------------------------------------------------------------------
// Memory: x is mapped and its pages dropped block by block, so peak resident
// memory does not grow with N.

struct Measured {
  int code = -1;
  long max_rss_kb = 0;
};

Measured run_measured(const Args& args) {
  const pid_t pid = spawn_cli(args);
  Measured m;
  int status = 0;
  struct rusage usage {};
  if (pid > 0 && ::wait4(pid, &status, 0, &usage) == pid) {
    m.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    m.max_rss_kb = usage.ru_maxrss;
  }
  return m;
}

TEST(EvalMemory, PeakResidentMemoryDoesNotGrowWithN) {
#ifdef __SANITIZE_ADDRESS__
  // ASan's quarantine keeps every freed workspace for a while and its shadow
  // grows with what is touched: the RSS then says nothing about eval.
  GTEST_SKIP() << "resident memory is measured in builds without AddressSanitizer";
#endif
  flce_test::TempDir tmp;
  constexpr int64_t kH = 128, kV = 64, kSmall = 4096, kLarge = 262144;  // x: 2 MB vs 128 MB
  std::vector<float> row_block(size_t(4096 * kH));
  std::vector<int64_t> labels(4096);
  auto file = [&](const char* stem, int64_t n) {
    std::string name(stem);
    return tmp.file(name.append(std::to_string(n)).append(".npy"));
  };
  for (int64_t n : {kSmall, kLarge}) {
    flce::io::NpyOutFile x, y;
    ASSERT_EQ(x.create(file("x", n), Dtype::f32, {n, kH}), "");
    ASSERT_EQ(y.create(file("y", n), Dtype::i64, {n}), "");
    for (int64_t r0 = 0; r0 < n; r0 += 4096) {
      for (size_t i = 0; i < row_block.size(); ++i)
        row_block[i] = float(int64_t((size_t(r0) * kH + i) * 2654435761u % 2001) - 1000) / 1000.0f;
      for (int64_t i = 0; i < 4096; ++i) labels[size_t(i)] = (r0 + i) % kV;
      ASSERT_EQ(x.write(r0 * kH, row_block.data(), 4096 * kH), "");
      ASSERT_EQ(y.write(r0, labels.data(), 4096), "");
    }
    ASSERT_EQ(x.close(), "");
    ASSERT_EQ(y.close(), "");
  }
  std::vector<double> w(size_t(kV * kH));
  for (size_t i = 0; i < w.size(); ++i) w[i] = double(int64_t(i * 7919 % 201) - 100) / 500.0;
  write_array(tmp.file("w.npy"), Dtype::f32, {kV, kH}, w);
  Measured small, large;
  const long forked_at_kb = std::max(0L, flce::cli::process_rss_bytes() / 1024);
  for (int64_t n : {kSmall, kLarge}) {
    const Measured m = run_measured({"eval", "--x", file("x", n), "--w", tmp.file("w.npy"),
                                     "--labels", file("y", n), "--out", file("out", n)});
    ASSERT_EQ(m.code, 0);
    (n == kSmall ? small : large) = m;
  }
  std::printf("peak RSS: %ld KiB with 2 MB of x, %ld KiB with 128 MB of x\n", small.max_rss_kb,
              large.max_rss_kb);
  // A child's ru_maxrss starts from this process's resident size at the
  // fork (Linux keeps it across the exec): where other tests in this
  // process left it above eval's own peak, both runs read that figure and
  // the check below could not fail. ctest runs each test in a process of
  // its own.
  if (small.max_rss_kb <= forked_at_kb)
    GTEST_SKIP() << "blind here: this process was " << forked_at_kb
                 << " KiB resident when it started eval, at least the small run's peak ("
                 << small.max_rss_kb << " KiB); run this test alone, as ctest does";
  // Without dropping consumed pages the large run would hold all 128 MB of
  // x resident (mapped file pages count in the RSS).
  EXPECT_LT(large.max_rss_kb - small.max_rss_kb, 24 * 1024)
      << "small: " << small.max_rss_kb << " KiB, large: " << large.max_rss_kb << " KiB";
}

}  // namespace
