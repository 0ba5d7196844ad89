// Tests for the `flce` command line (src/cli): each test runs the binary on
// .npy files in a fresh temporary directory. A bad input must give a non-zero
// exit, a message on stderr naming the flag (or file) and the offending
// value, and nothing at all in --out; good runs write exactly the expected
// files, with the right shapes and dtypes.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "flce/flce.h"
#include "io/npy.h"
#include "support/cli_process.h"
#include "support/npy_files.h"

namespace {

using flce::Dtype;
using flce_test::Bytes;
using flce_test::npy_bytes;
using flce_test::snapshot_dir;
using flce_test::write_array;
using flce_test::write_bytes;
namespace fs = std::filesystem;

constexpr int64_t N = 4, H = 3, V = 5;
using Args = std::vector<std::string>;
using FileSet = std::set<std::string>;

using Result = flce_test::CliResult;
using flce_test::shell_quote;
using flce_test::slurp;

std::vector<double> x_values() {
  std::vector<double> v;
  for (int64_t i = 0; i < N * H; ++i) v.push_back(0.25 * double((i * 7) % 11) - 1.0);
  return v;
}
std::vector<double> w_values() {
  std::vector<double> v;
  for (int64_t i = 0; i < V * H; ++i) v.push_back(0.125 * double((i * 5) % 13) - 0.75);
  return v;
}
std::vector<double> transpose(const std::vector<double>& a, int64_t rows, int64_t cols) {
  std::vector<double> t(a.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[size_t(c * rows + r)] = a[size_t(r * cols + c)];
  return t;
}

// The standard good problem (N = 4, H = 3, V = 5) written as .npy files into
// a fresh directory, and the argument list that runs it; each test perturbs
// a copy of `args`.
class Cli : public ::testing::Test {
 protected:
  flce_test::TempDir tmp;
  std::string out = tmp.file("out");
  std::string x, w, labels, bias, logits, token_w, class_w;
  Args args;  // run --x --w --labels --out

  Cli() {
    x = write_array(tmp.file("x.npy"), Dtype::f32, {N, H}, x_values());
    w = write_array(tmp.file("w.npy"), Dtype::f32, {V, H}, w_values());
    labels = write_array(tmp.file("labels.npy"), Dtype::i64, {N}, {0, 4, 2, 1});
    bias = write_array(tmp.file("bias.npy"), Dtype::f32, {V}, {0.1, -0.2, 0.0, 0.3, 0.05});
    std::vector<double> z;
    for (int64_t i = 0; i < N * V; ++i) z.push_back(0.3 * double((i * 3) % 7) - 0.9);
    logits = write_array(tmp.file("logits.npy"), Dtype::f32, {N, V}, z);
    token_w = write_array(tmp.file("tw.npy"), Dtype::f32, {N}, {1, 0.5, 2, 1});
    class_w = write_array(tmp.file("cw.npy"), Dtype::f64, {V}, {1, 2, 0.5, 1, 1.5});
    args = {"run", "--x", x, "--w", w, "--labels", labels, "--out", out};
  }

  // Runs the binary with `a` (and `env`, "NAME=value ..." put in front).
  Result run(const Args& a, const std::string& env = "") {
    return flce_test::run_cli(a, tmp.path(), env);
  }

  // `args` with --flag set to value (replaced when present, else added).
  Args with(const std::string& flag, const std::string& value) const {
    return with(args, flag, value);
  }
  static Args with(Args a, const std::string& flag, const std::string& value) {
    for (size_t i = 0; i + 1 < a.size(); ++i)
      if (a[i] == flag) {
        a[i + 1] = value;
        return a;
      }
    a.push_back(flag);
    a.push_back(value);
    return a;
  }
  // `a` plus extra arguments.
  static Args plus(Args a, std::initializer_list<std::string> extra) {
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  }
  // `a` without --flag and its value.
  static Args without(Args a, const std::string& flag) {
    for (size_t i = 0; i < a.size(); ++i)
      if (a[i] == flag) {
        a.erase(a.begin() + long(i), a.begin() + long(std::min(i + 2, a.size())));
        break;
      }
    return a;
  }
  // The logits-level arguments.
  Args logits_args() const {
    return {"run", "--logits", logits, "--labels", labels, "--out", out};
  }

  // Expects a clean failure: an exit status in [1, 125] (not a signal),
  // stderr containing every needle, and no file at all in --out. Returns
  // stderr.
  std::string fails(const Args& a, const std::vector<std::string>& needles,
                    const std::string& env = "") {
    const auto before = snapshot_dir(out);
    const Result r = run(a, env);
    EXPECT_GE(r.code, 1) << "exit " << r.code << "; stderr: " << r.err;
    EXPECT_LE(r.code, 125) << "exit " << r.code << "; stderr: " << r.err;
    EXPECT_FALSE(r.err.empty());
    for (const std::string& n : needles)
      EXPECT_NE(r.err.find(n), std::string::npos)
          << "stderr does not mention '" << n << "': " << r.err;
    EXPECT_TRUE(snapshot_dir(out) == before)
        << "a failed run changed --out; stderr: " << r.err;
    return r.err;
  }

  // Expects exit 0; returns the names of the files in --out.
  FileSet succeeds(const Args& a, const std::string& env = "") {
    const Result r = run(a, env);
    EXPECT_EQ(r.code, 0) << r.err;
    FileSet names;
    for (const auto& [name, bytes] : snapshot_dir(out)) names.insert(name);
    return names;
  }

  flce::io::NpyArray read(const std::string& name) {
    flce::io::NpyArray a;
    const std::string e = flce::io::read_npy(out + "/" + name, &a);
    EXPECT_EQ(e, "");
    return a;
  }
  void expect_array(const std::string& name, Dtype dtype, std::vector<int64_t> shape) {
    SCOPED_TRACE(name);
    const flce::io::NpyArray a = read(name);
    EXPECT_EQ(int(a.dtype), int(dtype)) << flce::dtype_name(a.dtype);
    EXPECT_EQ(a.shape, shape);
  }
};

const FileSet kForwardFiles = {"argmax.npy", "entropy.npy", "logprob.npy",
                               "loss.npy",   "lse.npy",     "zloss.npy"};
// The forward files plus `more`.
FileSet forward_and(std::initializer_list<std::string> more) {
  FileSet a = kForwardFiles;
  a.insert(more.begin(), more.end());
  return a;
}

// ---------------------------------------------------------------------------
// The commands besides `run`, and help.

using CliCommands = Cli;

TEST_F(CliCommands, HelpVersionAndBackends) {
  Result r = run({"--help"});
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("usage: flce"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("run"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("backends"), std::string::npos) << r.out;
  r = run({"run", "--help"});
  EXPECT_EQ(r.code, 0);
  for (const char* flag : {"--x", "--w", "--labels", "--logits", "--softcap", "--label-smoothing",
                           "--z-loss", "--reduction", "--grad", "--out-dtype", "--out"})
    EXPECT_NE(r.out.find(flag), std::string::npos) << flag << " not in: " << r.out;
  r = run({"--version"});
  EXPECT_EQ(r.code, 0);
  EXPECT_EQ(r.out, std::string("flce ") + flce::version() + "\n");
  r = run({"backends"});
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("reference"), std::string::npos) << r.out;
  r = run({"backends", "--help"});  // `flce <command> --help`, as the usage says
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("usage: flce backends"), std::string::npos) << r.out;
  for (const char* command : {"run", "eval", "bench"}) {  // -h as `flce -h` takes it
    r = run({command, "-h"});
    EXPECT_EQ(r.code, 0) << command << ": " << r.err;
    EXPECT_NE(r.out.find(std::string("usage: flce ") + command), std::string::npos) << r.out;
  }
}

TEST_F(CliCommands, OneDnnHasBf16OnlyWithBf16DotProducts) {
  // Capped at plain AVX-512, oneDNN answers bf16 with an emulating gemm:jit,
  // which flce took for native bf16 (slower than converting to f32).
  const Result native = run({"backends"});
  if (native.out.find("onednn") == std::string::npos) GTEST_SKIP() << "no oneDNN in this build";
  const Result capped = run({"backends"}, "ONEDNN_MAX_CPU_ISA=AVX512_CORE");
  ASSERT_EQ(capped.code, 0) << capped.err;
  EXPECT_NE(capped.out.find("onednn"), std::string::npos) << capped.out;
  EXPECT_EQ(capped.out.find("bf16: gemm:jit"), std::string::npos) << capped.out;
  EXPECT_NE(capped.out.find(", no bf16"), std::string::npos) << capped.out;
}

TEST_F(CliCommands, BadCommands) {
  Result r = run({});
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("usage"), std::string::npos) << r.err;
  r = run({"frobnicate"});
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("frobnicate"), std::string::npos) << r.err;
  r = run({"backends", "--all"});
  EXPECT_NE(r.code, 0);
  EXPECT_FALSE(r.err.empty());
  fails(plus(args, {"--help=yes"}), {"--help", "yes"});
}

// A report that cannot be written (stdout on a full device) fails the
// command with a message, instead of exiting 0 with nothing printed.
TEST_F(CliCommands, UnwritableStdoutFails) {
  if (access("/dev/full", W_OK) != 0) GTEST_SKIP() << "no writable /dev/full on this machine";
  for (const char* command : {"backends", "--version"}) {
    const std::string e = tmp.file("stderr.txt");
    const std::string cmd = shell_quote(FLCE_CLI_PATH) + " " + command + " >/dev/full 2>" + shell_quote(e);
    const int status = std::system(cmd.c_str());
    ASSERT_TRUE(status != -1 && WIFEXITED(status)) << command;
    EXPECT_EQ(WEXITSTATUS(status), 2) << command;
    EXPECT_NE(slurp(e).find("writing standard output"), std::string::npos) << command << ": " << slurp(e);
  }
}

// `flce bench` refuses sizes whose arrays overflow 64 bits or exceed the
// machine's memory, before allocating (it aborted on std::bad_alloc).
TEST_F(CliCommands, BenchRefusesSizesBeyondTheMachine) {
  const struct {
    Args args;
    std::string message;
  } cases[] = {
      {{"--n", "1000000000", "--h", "1000000", "--v", "8"}, "GiB of host memory"},
      {{"--n", "4294967296", "--h", "4294967296", "--v", "2"}, "more than 2^63 bytes"},
      {{"--n", "9223372036854775807", "--h", "2", "--v", "2"}, "--n 9223372036854775807"},
      {{"--n", "2", "--h", "2", "--v", "2199023255552"}, "--v 2199023255552"},
      // Small arrays, but the reference GEMM's blocks (4096 x 2048 floats
      // per thread) take 128 GiB: it failed after minutes as "out of host
      // memory for the problem's arrays".
      {{"--n", "4096", "--h", "1", "--v", "16777216", "--threads", "4096"},
       "the reference GEMM's output blocks (one per thread) need 128.3 GiB"},
      // Not a size, but refused as early: a forward has no gradients to filter.
      {{"--n", "2", "--h", "2", "--v", "2", "--pass", "fwd", "--filter-eps", "auto"},
       "--filter-eps: filters gradients, so applies to --pass bwd or step, not fwd"},
      {{"--n", "2", "--h", "2", "--v", "2", "--pass", "fwd", "--grad-logits", "storage"},
       "--grad-logits: sets the dtype of gradients, so applies to --pass bwd or step, not fwd"},
      {{"--n", "2", "--h", "2", "--v", "2", "--pass", "fwd", "--grad-dtype", "f32"},
       "--grad-dtype: sets the dtype of gradients, so applies to --pass bwd or step, not fwd"},
  };
  const double gib = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGESIZE)) / (1 << 30);
  for (const auto& c : cases) {
    if (gib > 120 && c.message.find("128.3 GiB") != std::string::npos) continue;  // it would run
    Args a = {"bench"};
    a.insert(a.end(), c.args.begin(), c.args.end());
    const Result r = run(a);
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_NE(r.err.find(c.message), std::string::npos) << r.err;
  }
}

// --filter-eps compares a filtered pass with an unfiltered one; the backends
// that ignore the option would time one pass twice and report the noise as
// the filter's speed-up.
TEST_F(CliCommands, BenchFilterComparisonNeedsTheCpuBackend) {
  for (const char* backend : {"reference", "cuda"}) {
    const Result r = run({"bench", "--n", "64", "--h", "8", "--v", "100", "--reps", "1",
                          "--filter-eps", "auto", "--backend", backend});
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_NE(r.err.find(std::string("--filter-eps: the ") + backend + " backend ignores it"),
              std::string::npos) << r.err;
  }
}

const Args kSmallBench = {"bench", "--n", "64", "--h", "32", "--v", "300", "--reps", "2",
                          "--threads", "1"};

// One JSON line, and nothing on stderr when it is not a terminal; the GEMM
// timed beside the pass only where the cpu backend ran it (the reference's
// JSON named a GEMM it never used and a ratio to it).
TEST_F(CliCommands, BenchComparesWithTheGemmOnlyWhereTheCpuBackendRan) {
  const Args& small = kSmallBench;
  Result r = run(small);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
  EXPECT_NE(r.out.find("\"backend\": \"cpu\""), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("\"ratio_to_gemm\": null"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("\"gemm\": null"), std::string::npos) << r.out;
  r = run(plus(small, {"--backend", "reference"}));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("\"backend\": \"reference\""), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"gemm_seconds\": null, \"ratio_to_gemm\": null"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("\"gemm\": null"), std::string::npos) << r.out;
}

// Each call's time on stderr as it ends, on a terminal: a step of the
// production shape takes minutes, and the JSON comes after every call.
// (Piped, stderr stays empty: BenchComparesWithTheGemmOnlyWhereTheCpuBackendRan.)
TEST_F(CliCommands, BenchShowsEachCallOnATerminal) {
  const Args& small = kSmallBench;
  int code = -1;
  const std::string tty = flce_test::run_cli_on_terminal(small, &code);
  ASSERT_EQ(code, 0) << tty;
  // Each line names the call, then its seconds; the JSON comes last.
  for (const char* line : {"flce bench: generating the problem ... ", "flce bench: warm-up ... ",
                           "flce bench: logits GEMM, warm-up ... ", "flce bench: call 1/2 ... ",
                           "flce bench: logits GEMM 1/2 ... ", "flce bench: call 2/2 ... ",
                           "flce bench: logits GEMM 2/2 ... "}) {
    const size_t at = tty.find(line);
    ASSERT_NE(at, std::string::npos) << "missing '" << line << "' in: " << tty;
    const size_t end = tty.find('\n', at);
    char* after = nullptr;
    const std::string tail = tty.substr(at + std::strlen(line), end - at - std::strlen(line));
    const double seconds = std::strtod(tail.c_str(), &after);
    EXPECT_GE(seconds, 0.0) << tail;
    EXPECT_EQ(std::string(after), " s\r") << tail;  // the terminal's \r\n
  }
  EXPECT_LT(tty.rfind("flce bench: "), tty.find("{\"n\": 64")) << tty;

  // A failure ends the line of the call it stopped before its message.
  const std::string failed = flce_test::run_cli_on_terminal(
      plus(small, {"--pass", "bwd", "--backend", "no-such-backend"}), &code);
  EXPECT_EQ(code, 2) << failed;
  EXPECT_NE(failed.find(" ...\r\nflce bench: error: "), std::string::npos) << failed;

  const std::string quiet = flce_test::run_cli_on_terminal(plus(small, {"--no-progress"}), &code);
  EXPECT_EQ(code, 0) << quiet;
  EXPECT_EQ(quiet.find("flce bench: "), std::string::npos) << quiet;
  EXPECT_NE(quiet.find("{\"n\": 64"), std::string::npos) << quiet;
}

// ---------------------------------------------------------------------------
// Good runs.

using CliRun = Cli;

TEST_F(CliRun, ForwardWritesExactlyTheForwardOutputs) {
  EXPECT_EQ(succeeds(args), kForwardFiles);
  expect_array("loss.npy", Dtype::f32, {});
  for (const char* f : {"lse.npy", "logprob.npy", "entropy.npy", "zloss.npy"})
    expect_array(f, Dtype::f32, {N});
  expect_array("argmax.npy", Dtype::i64, {N});
  // The same numbers as the API on the same data.
  const std::vector<double> xd = x_values(), wd = w_values();
  std::vector<int64_t> y = {0, 4, 2, 1};
  std::vector<float> xf(xd.begin(), xd.end()), wf(wd.begin(), wd.end());
  double loss = 0;
  std::vector<double> lse(N);
  flce::Problem p;
  p.x = flce::matrix_view(xf.data(), Dtype::f32, N, H);
  p.w = flce::matrix_view(wf.data(), Dtype::f32, V, H);
  p.labels = flce::vector_view(y.data(), Dtype::i64, N);
  p.loss = flce::scalar_view(&loss, Dtype::f64);
  p.lse = flce::vector_view(lse.data(), Dtype::f64, N);
  ASSERT_TRUE(flce::forward(p).ok());
  EXPECT_FLOAT_EQ(float(flce_test::npy_values(read("loss.npy"))[0]), float(loss));
  const std::vector<double> lse_cli = flce_test::npy_values(read("lse.npy"));
  for (int64_t i = 0; i < N; ++i) EXPECT_FLOAT_EQ(float(lse_cli[size_t(i)]), float(lse[size_t(i)]));
  const std::vector<double> am = flce_test::npy_values(read("argmax.npy"));
  for (double a : am) EXPECT_TRUE(a >= 0 && a < V) << a;
}

// A problem the cpu backend declines runs on the (much slower) float64
// reference: said on stderr with the reason, where nothing asked for that.
// It ran silently before.
TEST_F(CliRun, AFallbackToTheReferenceSaysWhy) {
  const std::string x16 = write_array(tmp.file("x16.npy"), Dtype::f16, {N, H}, x_values());
  Result r = run(with("--x", x16));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("backend: reference"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("flce run: note: ran on the float64 reference backend (much slower): cpu: "
                       "the cpu backend needs x, w and bias in one storage dtype; x is f16, w is f32"),
            std::string::npos) << r.err;
  r = run(plus(args, {"--softcap", "1e-39"}));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("note: ran on the float64 reference backend (much slower): cpu: softcap = 1e-39"),
            std::string::npos) << r.err;
  // Not where it was asked for, by name or by float64 inputs (as documented).
  const std::string x64 = write_array(tmp.file("x64.npy"), Dtype::f64, {N, H}, x_values());
  const std::string w64 = write_array(tmp.file("w64.npy"), Dtype::f64, {V, H}, w_values());
  for (const Args& a : {plus(with("--x", x16), {"--backend", "reference"}), with(with("--x", x64), "--w", w64),
                        args}) {
    r = run(a);
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_EQ(r.err, "");
  }
}

TEST_F(CliRun, GradientFileSets) {
  EXPECT_EQ(succeeds(plus(args, {"--grad"})), (forward_and({"grad_x.npy", "grad_w.npy"})));
  expect_array("grad_x.npy", Dtype::f32, {N, H});
  expect_array("grad_w.npy", Dtype::f32, {V, H});
  fs::remove_all(out);
  EXPECT_EQ(succeeds(plus(args, {"--grad", "--bias", bias})),
            (forward_and({"grad_x.npy", "grad_w.npy", "grad_bias.npy"})));
  expect_array("grad_bias.npy", Dtype::f32, {V});
  fs::remove_all(out);
  // hv: W is [H, V] and so is grad_w.
  const std::string w_hv =
      write_array(tmp.file("w_hv.npy"), Dtype::f32, {H, V}, transpose(w_values(), V, H));
  EXPECT_EQ(succeeds(plus(with("--w", w_hv), {"--w-layout", "hv", "--grad"})),
            (forward_and({"grad_x.npy", "grad_w.npy"})));
  expect_array("grad_w.npy", Dtype::f32, {H, V});
  fs::remove_all(out);
  // Logits entry.
  EXPECT_EQ(succeeds(logits_args()), kForwardFiles);
  fs::remove_all(out);
  EXPECT_EQ(succeeds(plus(logits_args(), {"--grad"})), (forward_and({"grad_logits.npy"})));
  expect_array("grad_logits.npy", Dtype::f32, {N, V});
}

TEST_F(CliRun, ReductionsOutDtypeAndOptionalInputs) {
  EXPECT_EQ(succeeds(plus(args, {"--reduction", "none"})), kForwardFiles);
  expect_array("loss.npy", Dtype::f32, {N});
  fs::remove_all(out);
  EXPECT_EQ(succeeds(plus(args, {"--out-dtype", "f64", "--grad", "--reduction", "sum"})),
            (forward_and({"grad_x.npy", "grad_w.npy"})));
  expect_array("loss.npy", Dtype::f64, {});
  expect_array("lse.npy", Dtype::f64, {N});
  expect_array("argmax.npy", Dtype::i64, {N});
  expect_array("grad_w.npy", Dtype::f64, {V, H});
  fs::remove_all(out);
  // Everything optional at once, and a nested --out that does not exist yet.
  const std::string g0 = write_array(tmp.file("g0.npy"), Dtype::f32, {1}, {2.0});
  const std::string gn = write_array(tmp.file("gn.npy"), Dtype::f64, {N}, {0.1, 0.2, 0.3, 0.4});
  const std::string nested = out + "/a/b";
  Args a = plus(with("--out", nested),
                {"--bias", bias, "--token-weights", token_w, "--class-weights", class_w,
                 "--dtype", "bf16", "--logit-scale", "0.5", "--softcap", "30",
                 "--ignore-index", "4", "--label-smoothing", "0.1", "--z-loss", "1e-4",
                 "--grad", "--grad-loss", g0, "--grad-lse", gn, "--grad-entropy", gn,
                 "--backend", "reference", "--threads", "2"});
  const Result r = run(a);
  EXPECT_EQ(r.code, 0) << r.err;
  FileSet names;
  for (const auto& [name, bytes] : snapshot_dir(nested)) names.insert(name);
  EXPECT_EQ(names, (forward_and({"grad_x.npy", "grad_w.npy", "grad_bias.npy"})));
}

TEST_F(CliRun, RerunOverwritesCleanly) {
  EXPECT_EQ(succeeds(args), kForwardFiles);
  const auto first = snapshot_dir(out);
  EXPECT_EQ(succeeds(plus(args, {"--softcap", "0.5"})), kForwardFiles);
  const auto second = snapshot_dir(out);
  EXPECT_NE(first.at("loss.npy"), second.at("loss.npy"));  // rewritten, not appended
  EXPECT_EQ(second.at("loss.npy").size(), first.at("loss.npy").size());
  EXPECT_EQ(succeeds(args), kForwardFiles);  // no temporary files left behind
  EXPECT_TRUE(snapshot_dir(out) == first);
}

TEST_F(CliRun, StaleGradientsAreRemovedButNotInputs) {
  EXPECT_EQ(succeeds(plus(args, {"--grad"})), (forward_and({"grad_x.npy", "grad_w.npy"})));
  // The first run's gradients are gone, with a note (they may have been
  // the user's own files of those names).
  const Result r = run(args);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("flce run: note: removed grad_x.npy, grad_w.npy from --out " + out +
                       " (output names this run does not write)"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(snapshot_dir(out).size(), kForwardFiles.size());
  EXPECT_EQ(run(args).err, "");  // nothing to remove: no note
  fs::remove_all(out);
  EXPECT_EQ(succeeds(plus(logits_args(), {"--grad"})), (forward_and({"grad_logits.npy"})));
  const auto first = snapshot_dir(out);
  // That grad_logits.npy as the next run's input: it stays.
  const Args again = with(logits_args(), "--logits", out + "/grad_logits.npy");
  EXPECT_EQ(succeeds(again), (forward_and({"grad_logits.npy"})));
  EXPECT_EQ(snapshot_dir(out).at("grad_logits.npy"), first.at("grad_logits.npy"));
}

TEST_F(CliRun, AStaleGradientThatCannotBeRemovedIsNamedInAWarning) {
  EXPECT_EQ(succeeds(plus(args, {"--grad"})), (forward_and({"grad_x.npy", "grad_w.npy"})));
  const flce_test::ImmutableFile pinned(out + "/grad_x.npy");  // not even root removes it
  if (!pinned.ok()) GTEST_SKIP() << "cannot set the immutable flag here (needs root and ext4/xfs/btrfs)";
  const Result r = run(args);
  EXPECT_EQ(r.code, 0) << r.err;  // this run's outputs are in place
  EXPECT_NE(r.err.find("flce run: note: removed grad_w.npy from --out " + out), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("flce run: warning: --out " + out + " keeps grad_x.npy: "),
            std::string::npos)
      << r.err;
  EXPECT_EQ(snapshot_dir(out).size(), kForwardFiles.size() + 1);
}

TEST_F(CliRun, BadRunLeavesEarlierOutputsUntouched) {
  EXPECT_EQ(succeeds(plus(args, {"--grad"})), (forward_and({"grad_x.npy", "grad_w.npy"})));
  const auto good = snapshot_dir(out);
  const std::string bad_npy = tmp.file("bad.npy");
  write_bytes(bad_npy, {'n', 'o', 't', ' ', 'n', 'p', 'y', '!', '!', '!'});
  const std::string big_label = write_array(tmp.file("y9.npy"), Dtype::i64, {N}, {0, 9, 1, 2});
  fails(plus(args, {"--softcap", "-1"}), {"--softcap"});                       // option
  fails(with("--x", bad_npy), {"--x", bad_npy});                               // reading
  fails(with("--labels", big_label), {"--labels", "labels[1] = 9"});           // API
  fails(plus(args, {"--backend", "nope"}), {"--backend", "nope"});             // backend
  fails(plus(args, {"--frobnicate"}), {"--frobnicate"});                       // parsing
  EXPECT_TRUE(snapshot_dir(out) == good);
}

TEST_F(CliRun, NaNInXGivesNaNInItsRow) {
  std::vector<double> xs = x_values();
  xs[size_t(2 * H + 1)] = std::nan("");
  const std::string x_nan = write_array(tmp.file("x_nan.npy"), Dtype::f32, {N, H}, xs);
  EXPECT_EQ(succeeds(plus(with("--x", x_nan), {"--reduction", "none", "--grad"})),
            (forward_and({"grad_x.npy", "grad_w.npy"})));
  const std::vector<double> loss = flce_test::npy_values(read("loss.npy"));
  ASSERT_EQ(loss.size(), size_t(N));
  for (int64_t i = 0; i < N; ++i) EXPECT_EQ(std::isnan(loss[size_t(i)]), i == 2) << i;
  fs::remove_all(out);
  EXPECT_EQ(succeeds(with("--x", x_nan)), kForwardFiles);  // mean: NaN
  EXPECT_TRUE(std::isnan(flce_test::npy_values(read("loss.npy"))[0]));
}

// ---------------------------------------------------------------------------
// Malformed .npy files, written byte by byte.

using CliNpy = Cli;

const char* kGoodHeader = "{'descr': '<f4', 'fortran_order': False, 'shape': (4, 3), }";
const Bytes kData48(48, 0);  // 4 x 3 float32 zeros

TEST_F(CliNpy, MalformedFiles) {
  struct Case {
    const char* what;
    Bytes bytes;
    std::vector<std::string> needles;
  };
  Bytes bad_magic = npy_bytes(kGoodHeader, kData48);
  bad_magic[1] = 'X';
  Bytes truncated = npy_bytes(kGoodHeader, kData48);
  truncated.resize(30);
  Bytes bad_version = npy_bytes(kGoodHeader, kData48);
  bad_version[6] = 9;
  const std::vector<Case> cases = {
      {"bad magic", bad_magic, {"magic"}},
      {"empty file", {}, {"too short"}},
      {"truncated header", truncated, {"header length", "past the end"}},
      {"unknown version", bad_version, {"version 9.0"}},
      {"header not a dict", npy_bytes("[4, 3]", kData48), {"not a Python dict"}},
      {"header missing a key", npy_bytes("{'descr': '<f4', 'shape': (4, 3), }", kData48),
       {"fortran_order"}},
      {"big-endian",
       npy_bytes("{'descr': '>f4', 'fortran_order': False, 'shape': (4, 3), }", kData48),
       {"big-endian", ">f4"}},
      {"fortran order",
       npy_bytes("{'descr': '<f4', 'fortran_order': True, 'shape': (4, 3), }", kData48),
       {"fortran_order"}},
      {"object dtype",
       npy_bytes("{'descr': '|O', 'fortran_order': False, 'shape': (4, 3), }", kData48),
       {"object", "|O"}},
      {"structured dtype",
       npy_bytes("{'descr': [('a', '<f4'), ('b', '<f4')], 'fortran_order': False, "
                 "'shape': (4, 3), }",
                 kData48),
       {"structured"}},
      {"unsupported dtype",
       npy_bytes("{'descr': '|u1', 'fortran_order': False, 'shape': (4, 3), }", kData48),
       {"|u1", "uint8"}},
      {"data shorter than the shape", npy_bytes(kGoodHeader, Bytes(20, 0)),
       {"data is 20 bytes", "48"}},
      {"negative shape",
       npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (-4, 3), }", kData48),
       {"negative"}},
      {"shape overflowing int64",
       npy_bytes("{'descr': '<f4', 'fortran_order': False, "
                 "'shape': (4611686018427387904, 4), }",
                 kData48),
       {"overflows"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const std::string path = tmp.file("bad.npy");
    write_bytes(path, c.bytes);
    std::vector<std::string> needles = {"--x", path};
    needles.insert(needles.end(), c.needles.begin(), c.needles.end());
    fails(with("--x", path), needles);
  }
}

TEST_F(CliNpy, MissingFileAndDirectory) {
  const std::string missing = tmp.file("missing.npy");
  fails(with("--x", missing), {"--x", missing, "cannot open"});
  fails(with("--labels", missing), {"--labels", missing});
  const std::string dir = tmp.file("dir.npy");
  fs::create_directory(dir);
  fails(with("--w", dir), {"--w", dir, "Is a directory"});
  if (::geteuid() != 0) {  // root reads anything
    fs::permissions(x, fs::perms::none);
    fails(args, {"--x", x, "Permission denied"});
  }
}

TEST_F(CliNpy, EveryFileFlagNamesItsFile) {
  const std::string bad = tmp.file("bad.npy");
  write_bytes(bad, {0x93, 'N', 'U', 'M', 'P', 'X', 1, 0, 0, 0});
  for (const char* flag : {"--w", "--labels", "--bias", "--token-weights", "--class-weights"}) {
    SCOPED_TRACE(flag);
    fails(with(flag, bad), {flag, bad, "magic"});
  }
  fails(with(logits_args(), "--logits", bad), {"--logits", bad});
  for (const char* flag : {"--grad-loss", "--grad-lse", "--grad-entropy"}) {
    SCOPED_TRACE(flag);
    fails(plus(args, {"--grad", flag, bad}), {flag, bad});
  }
}

TEST_F(CliNpy, WrongDtypesAndRanks) {
  const std::string y_float = write_array(tmp.file("yf.npy"), Dtype::f32, {N}, {0, 4, 2, 1});
  fails(with("--labels", y_float), {"--labels", y_float, "f32", "int32 or int64"});
  const std::string x_int =
      write_array(tmp.file("xi.npy"), Dtype::i32, {N, H}, std::vector<double>(N * H, 1));
  fails(with("--x", x_int), {"--x", x_int, "i32"});
  const std::string w_int =
      write_array(tmp.file("wi.npy"), Dtype::i64, {V, H}, std::vector<double>(V * H, 1));
  fails(with("--w", w_int), {"--w", w_int, "i64"});
  const std::string tw_int = write_array(tmp.file("twi.npy"), Dtype::i32, {N}, {1, 1, 1, 1});
  fails(plus(args, {"--token-weights", tw_int}), {"--token-weights", tw_int, "i32"});
  const std::string x3 =
      write_array(tmp.file("x3.npy"), Dtype::f32, {2, 2, H}, std::vector<double>(4 * H, 1));
  fails(with("--x", x3), {"--x", x3, "3-D"});
  const std::string x1 = write_array(tmp.file("x1.npy"), Dtype::f32, {N * H}, x_values());
  fails(with("--x", x1), {"--x", x1, "1-D"});
  const std::string y2 = write_array(tmp.file("y2.npy"), Dtype::i64, {N, 1}, {0, 4, 2, 1});
  fails(with("--labels", y2), {"--labels", y2, "2-D"});
  const std::string x0 = write_array(tmp.file("x0.npy"), Dtype::f32, {0, H}, {});
  fails(with("--x", x0), {"--x", x0, "size 0"});
}

// ---------------------------------------------------------------------------
// Shape mismatches between files, and bad values inside them.

using CliShapes = Cli;

TEST_F(CliShapes, MismatchesBetweenFiles) {
  const std::string w4 =
      write_array(tmp.file("w4.npy"), Dtype::f32, {V, H + 1}, std::vector<double>(V * (H + 1), 0));
  fails(with("--w", w4), {"--w", w4, "[5, 4]"});
  fails(plus(args, {"--w-layout", "hv"}), {"--w", w, "hv"});  // a [V, H] file read as [H, V]
  const std::string y5 = write_array(tmp.file("y5.npy"), Dtype::i64, {N + 1}, {0, 1, 2, 3, 4});
  fails(with("--labels", y5), {"--labels", y5, "[5]", "N = 4"});
  const std::string b6 = write_array(tmp.file("b6.npy"), Dtype::f32, {V + 1}, {0, 0, 0, 0, 0, 0});
  fails(plus(args, {"--bias", b6}), {"--bias", b6, "[6]", "V = 5"});
  fails(plus(args, {"--token-weights", class_w}), {"--token-weights", class_w, "[5]", "N = 4"});
  fails(plus(args, {"--class-weights", token_w}), {"--class-weights", token_w, "[4]", "V = 5"});
  // Logits entry: labels against the logits' rows.
  fails(with(logits_args(), "--labels", y5), {"--labels", y5, "N = 4"});
  // Cotangents.
  fails(plus(args, {"--grad", "--grad-lse", class_w}), {"--grad-lse", class_w, "[5]"});
  fails(plus(args, {"--grad", "--grad-entropy", class_w}), {"--grad-entropy", class_w, "[5]"});
  fails(plus(args, {"--grad", "--grad-loss", token_w}), {"--grad-loss", token_w, "0-D"});
  fails(plus(args, {"--grad", "--reduction", "none", "--grad-loss", class_w}),
        {"--grad-loss", class_w, "[5]"});
}

// The inputs are checked before the outputs are sized from them: an empty
// x of 2^50 rows (a header and no data) asked for a 4 PiB lse and said
// "out of memory".
TEST_F(CliShapes, AnEmptyInputIsNamedBeforeItsOutputsAreSized) {
  const std::string x = tmp.file("x_empty.npy"), w = tmp.file("w_empty.npy");
  write_bytes(x, npy_bytes("{'descr': '<f4', 'fortran_order': False, "
                           "'shape': (1125899906842624, 0), }",
                           {}));
  write_bytes(w, npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (5, 0), }", {}));
  for (const char* grad : {"", "--grad"}) {
    SCOPED_TRACE(grad);
    Args a = with(with("--x", x), "--w", w);
    if (*grad) a = plus(a, {grad});
    fails(a, {"--x", x, "size 0 in dimension 1"});
  }
}

TEST_F(CliShapes, BadValuesInsideFiles) {
  const std::string y = write_array(tmp.file("y.npy"), Dtype::i32, {N}, {0, 1, 5, 2});
  fails(with("--labels", y), {"--labels", y, "labels[2] = 5"});
  // The file is named whatever its name ends in (it was only for ".npy").
  const std::string y_bin = write_array(tmp.file("labels.bin"), Dtype::i32, {N}, {0, 1, 5, 2});
  fails(with("--labels", y_bin), {"--labels " + y_bin + ": labels[2] = 5"});
  const std::string yn = write_array(tmp.file("yn.npy"), Dtype::i64, {N}, {0, -1, 1, 2});
  fails(with("--labels", yn), {"--labels", yn, "labels[1] = -1"});
  // ... but -1 is fine as the ignore index.
  EXPECT_EQ(succeeds(plus(with("--labels", yn), {"--ignore-index", "-1"})), kForwardFiles);
  fs::remove_all(out);
  const std::string tw = write_array(tmp.file("tw_neg.npy"), Dtype::f32, {N}, {1, 1, -1, 1});
  fails(plus(args, {"--token-weights", tw}), {"--token-weights", tw, "token_weights[2] = -1"});
  const std::string cw =
      write_array(tmp.file("cw_nan.npy"), Dtype::f64, {V}, {1, std::nan(""), 1, 1, 1});
  fails(plus(args, {"--class-weights", cw}), {"--class-weights", cw, "class_weights[1] = nan"});
  const std::string cwi =
      write_array(tmp.file("cw_inf.npy"), Dtype::f32, {V}, {1, 1, 1, 1, INFINITY});
  fails(plus(args, {"--class-weights", cwi}), {"--class-weights", cwi, "class_weights[4] = inf"});
}

// ---------------------------------------------------------------------------
// Options: out-of-range, non-numeric, unknown options and values, missing or
// conflicting flags.

using CliOptions = Cli;

TEST_F(CliOptions, OutOfRangeValues) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--softcap", "-1"},        {"--softcap", "nan"},         {"--softcap", "inf"},
      {"--label-smoothing", "1.5"}, {"--label-smoothing", "-0.1"},
      {"--label-smoothing", "nan"}, {"--z-loss", "-1"},         {"--z-loss", "nan"},
      {"--z-loss", "inf"},        {"--logit-scale", "0"},       {"--logit-scale", "-1"},
      {"--logit-scale", "nan"},   {"--logit-scale", "inf"},
      {"--threads", "-1"},        {"--threads", "5000"},
      {"--softcap", "1e999"},     {"--softcap", "1e-400"},  // overflow; underflow to 0 (was off)
  };
  for (const auto& [flag, value] : cases) {
    SCOPED_TRACE(flag + " " + value);
    fails(plus(args, {flag, value}), {flag, value});
  }
  // 0 is all cores, as for flce bench and Python's threads=0 (it was refused).
  fails(plus(args, {"--threads", "-1"}), {"--threads: -1 is not in [0, 4096] (0: all cores)"});
  EXPECT_EQ(succeeds(plus(args, {"--threads", "0"})), kForwardFiles);
}

TEST_F(CliOptions, NonNumericValues) {
  for (const char* flag : {"--softcap", "--logit-scale", "--label-smoothing", "--z-loss"}) {
    SCOPED_TRACE(flag);
    fails(plus(args, {flag, "abc"}), {flag, "'abc'", "not a number"});
    fails(plus(args, {flag, "1.5x"}), {flag, "'1.5x'"});
    fails(plus(args, {std::string(flag) + "="}), {flag, "''"});
    fails(plus(args, {flag, " 0.5"}), {flag, "' 0.5'", "not a number"});  // strtod skips spaces
  }
  fails(plus(args, {"--threads", " 1"}), {"--threads", "' 1'", "not an integer"});
  fails(plus(args, {"--ignore-index", "1.5"}), {"--ignore-index", "'1.5'", "not an integer"});
  fails(plus(args, {"--ignore-index", "99999999999999999999"}),
        {"--ignore-index", "99999999999999999999"});
  fails(plus(args, {"--threads", "two"}), {"--threads", "'two'"});
  fails(plus(args, {"--threads", "99999999999"}), {"--threads", "99999999999"});
}

TEST_F(CliOptions, UnknownOptionsAndValues) {
  fails(plus(args, {"--frobnicate"}), {"--frobnicate"});
  fails(plus(args, {"--frobnicate", "3"}), {"--frobnicate"});
  fails(plus(args, {"-x", x}), {"-x"});
  fails(plus(args, {"stray"}), {"stray"});
  fails(plus(args, {"--reduction", "avg"}), {"--reduction", "avg", "none|sum|mean"});
  fails(plus(args, {"--dtype", "f8"}), {"--dtype", "f8"});
  fails(plus(args, {"--w-layout", "xy"}), {"--w-layout", "xy"});
  fails(plus(args, {"--out-dtype", "f16"}), {"--out-dtype", "f16"});
  fails(plus(args, {"--backend", "nope"}), {"--backend", "nope", "reference"});
  fails(args, {"FLCE_BACKEND", "nope", "reference"}, "FLCE_BACKEND=nope");
  fails(plus(args, {"--softcap", "1", "--softcap", "2"}), {"--softcap", "more than once"});
  fails(plus(args, {"--grad=yes"}), {"--grad", "yes"});
  fails(plus(args, {"--softcap"}), {"--softcap", "missing"});
  // A forgotten value is not filled by the next option: that ran into a
  // directory named "--grad" without gradients, and exited 0.
  fails(plus(without(args, "--out"), {"--out", "--grad"}), {"--out", "missing", "'--grad'"});
  fails(plus(args, {"--bias", "--grad"}), {"--bias", "missing", "'--grad'"});
}

TEST_F(CliOptions, EmptyBackendName) {
  // An explicitly empty --backend is an unknown backend name, not "choose
  // for me" (that is what leaving the flag out means).
  fails(plus(args, {"--backend="}), {"--backend", "''"});
}

TEST_F(CliOptions, ADeclineNamesTheFlagItIsAbout) {
  // The reference backend declines any --gemm: the message names --gemm
  // beside --backend, since changing either one would do.
  const std::string err = fails(plus(args, {"--backend", "reference", "--gemm", "eigen"}),
                                {"--backend with --gemm:", "no GEMM engine"});
  EXPECT_EQ(err.find("--backend with --gemm"), err.find("--")) << err;
  // The backend named by the environment: the flag is named before it.
  fails(plus(args, {"--gemm", "eigen"}), {"--gemm: FLCE_BACKEND = reference: declines"},
        "FLCE_BACKEND=reference");
  // Host arrays go to cpu, whose engines cublas is not one of.
  fails(plus(args, {"--gemm", "cublas"}), {"--gemm:", "cublas is the cuda backend's"});
}

TEST_F(CliOptions, MissingAndConflictingFlags) {
  fails(without(args, "--out"), {"--out", "missing"});
  fails(without(args, "--labels"), {"--labels", "missing"});
  fails(without(args, "--w"), {"--w", "missing"});
  fails(without(args, "--x"), {"--x", "missing"});
  fails({"run"}, {"--x"});
  fails(plus(logits_args(), {"--x", x}), {"--logits", "--x"});
  fails(plus(logits_args(), {"--bias", bias}), {"--logits", "--bias"});
  fails(plus(logits_args(), {"--w-layout", "vh"}), {"--w-layout"});
  for (const char* g : {"--grad-loss", "--grad-lse", "--grad-entropy"}) {
    SCOPED_TRACE(g);
    fails(plus(args, {g, token_w}), {g, "--grad"});
  }
  fails(plus(args, {"--filter-eps", "auto"}), {"--filter-eps", "--grad"});
  fails(plus(args, {"--grad-logits", "storage"}), {"--grad-logits", "--grad"});
}

TEST_F(CliRun, AnOutputNeverReplacesAnInput) {
  // `--x Q/grad_x.npy --out Q --grad` put the gradient in the input's place.
  fs::create_directories(out);
  const std::string x_in_out = out + "/grad_x.npy";
  fs::copy_file(x, x_in_out);
  const Bytes before = flce_test::read_bytes(x_in_out);
  fails(plus(with("--x", x_in_out), {"--grad"}),
        {"--out " + out + ": writing grad_x.npy there would replace the input --x " + x_in_out});
  EXPECT_EQ(flce_test::read_bytes(x_in_out), before);
  // Without --grad no grad_x.npy is written: the input is read and kept.
  EXPECT_EQ(succeeds(with("--x", x_in_out)), forward_and({"grad_x.npy"}));
  EXPECT_EQ(flce_test::read_bytes(x_in_out), before);
  // eval's outputs too, whatever path names the input.
  fs::copy_file(labels, out + "/logprob.npy", fs::copy_options::overwrite_existing);
  fails({"eval", "--x", x, "--w", w, "--labels", out + "/../out/logprob.npy", "--out", out},
        {"writing logprob.npy there would replace the input --labels"});
  // An output entry that is a hard link or a symlink to an input is only
  // renamed over: the input stays as it was, and the run goes ahead.
  const Bytes x_bytes = flce_test::read_bytes(x);
  fs::remove(out + "/lse.npy");
  fs::create_hard_link(x, out + "/lse.npy");
  fs::remove(out + "/zloss.npy");
  fs::create_symlink(x, out + "/zloss.npy");
  EXPECT_EQ(succeeds(args), kForwardFiles);  // the stale grad_x.npy, not an input now, removed
  EXPECT_EQ(flce_test::read_bytes(x), x_bytes);
  EXPECT_FALSE(fs::is_symlink(out + "/zloss.npy"));
}

// ---------------------------------------------------------------------------
// --out itself.

using CliOut = Cli;

TEST_F(CliOut, ARegularFileInTheWay) {
  write_bytes(out, {'k', 'e', 'e', 'p'});
  const Result r = run(args);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("--out"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(out), std::string::npos) << r.err;
  EXPECT_EQ(flce_test::read_bytes(out), (Bytes{'k', 'e', 'e', 'p'}));
  // A file in the way of a parent directory.
  const Result nested = run(with("--out", out + "/sub"));
  EXPECT_NE(nested.code, 0);
  EXPECT_NE(nested.err.find("--out"), std::string::npos) << nested.err;
}

TEST_F(CliOut, AFailedRenameLeavesNoPartialOutputs) {
  // zloss.npy is a directory, so writing it fails after loss.npy ... entropy.npy
  // could already have been put in place: none of them may be.
  fs::create_directories(out + "/zloss.npy");
  const Result r = run(args);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("zloss.npy"), std::string::npos) << r.err;
  // The reason is the one that stopped the write, not that of the clean-up.
  EXPECT_NE(r.err.find("not a regular file"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("Success"), std::string::npos) << r.err;
  FileSet names;
  for (const auto& [name, bytes] : snapshot_dir(out)) names.insert(name);
  EXPECT_EQ(names, FileSet{"zloss.npy"}) << "stderr: " << r.err;
}

TEST_F(CliOut, EmptyOutDir) {
  fails(with("--out", ""), {"--out"});
}

}  // namespace
