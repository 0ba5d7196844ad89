// `flce eval`: the forward pass over a data set too large for memory.
//
// x and the labels are memory-mapped (io/npy_map.h) and read front to back
// in blocks of --block-rows rows; each block is one flce::forward call with
// reduction none, and the pages of the block are dropped once it is done,
// so resident memory is W (loaded once, as the computation needs it all),
// the backend's tiles and one block, whatever N is. Per-token outputs go to
// .npy files created at full size under temporary names and filled block by
// block; they are renamed into place only when every block succeeded, and
// removed on any error, so --out never holds partial files.
#include "cli/eval.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "cli/args.h"
#include "cli/inputs.h"
#include "cli/out_dir.h"
#include "common/tensor_access.h"
#include "flce/flce.h"
#include "io/npy.h"
#include "io/npy_map.h"

namespace flce::cli {
namespace {

constexpr int64_t kDefaultBlockRows = 4096;

const std::vector<Flag>& eval_flags() {
  static const std::vector<Flag> flags = {
      {"x", "X.npy", "hidden states [N, H] (memory-mapped, read block by block)"},
      {"w", "W.npy", "head weight [V, H] (or [H, V] with --w-layout hv), loaded once"},
      {"labels", "Y.npy", "labels [N], int32 or int64 (memory-mapped)"},
      {"bias", "B.npy", "bias [V]"},
      {"w-layout", "vh|hv", "how W is stored (default vh, PyTorch's lm_head.weight)"},
      {"dtype", "f32|bf16|f16", "round x (block by block), W and bias to this storage first "
                                "(default: as stored in the files)"},
      {"logit-scale", "A", "logit scale a > 0 (default 1)"},
      {"softcap", "K", "softcap k >= 0, 0 = off (default 0)"},
      {"ignore-index", "I", "label of rows that are not scored (default -100)"},
      {"label-smoothing", "E", "label smoothing in [0, 1] (default 0)"},
      {"z-loss", "L", "z-loss weight >= 0 (default 0)"},
      {"block-rows", "R", "rows per forward call, >= 1 (default 4096)"},
      {"backend", "NAME", "backend (default: FLCE_BACKEND if set, else cpu; see `flce backends`)"},
      {"gemm", "NAME", "the GEMM engine: openblas|onednn|eigen for cpu, cublas for cuda"},
      {"threads", "T", "CPU threads, 0 to 4096 (default 0: all)"},
      {"out", "DIR", "also write DIR/logprob.npy, entropy.npy and argmax.npy (int64), [N] each"},
      {"out-dtype", "f32|f64", "dtype of logprob.npy and entropy.npy (default f32)"},
      {"json", nullptr, "print the summary as one JSON line"},
      {"no-progress", nullptr, "never show the progress bar (shown only when stderr is a terminal)"},
      {"help", nullptr, "show this help"},
  };
  return flags;
}

// "--x X.npy": the flag and its file, the prefix of every input error.
std::string where(const Args& args, const char* flag) {
  return std::string("--") + flag + " " + args.get(flag);
}

std::string shape_repr(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

// W or bias: read whole, a float array of `ndim` dimensions, rounded to
// --dtype when given.
io::NpyArray load_storage(const Args& args, const char* flag, int storage, size_t ndim) {
  io::NpyArray a = cli::load_storage(args, flag, storage);
  if (a.shape.size() != ndim)
    throw Failure{where(args, flag) + ": shape " + shape_repr(a.shape) + " is " +
                  std::to_string(a.shape.size()) + "-D; " + flag + " must be " +
                  (ndim == 2 ? "2-D" : "1-D")};
  return a;
}

// The inputs: x and labels mapped, W and bias in memory.
struct Inputs {
  io::NpyMap x, labels;
  io::NpyArray w, bias;
  bool has_bias = false;
  WeightLayout layout = WeightLayout::vh;
  int storage = -1;           // index for storage_dtype(), -1: as stored
  Dtype x_storage = Dtype::f32;  // the dtype x blocks are handed over in
  int64_t n = 0, h = 0, v = 0;
  int64_t ignored = 0;        // rows whose label is ignore_index
};

// Below, with the other signal handling: a file that shrinks under its
// mapping ends eval with a message naming `flag` instead of a bare SIGBUS.
void watch_for_bus_errors(const io::NpyMap& map, const std::string& flag, bool out);

void open_inputs(const Args& args, const Options& options, Inputs& in) {
  int layout = 0;
  check(args.get_choice("dtype", {"f32", "bf16", "f16"}, &in.storage));
  check(args.get_choice("w-layout", {"vh", "hv"}, &layout));
  in.layout = WeightLayout(layout);

  if (auto e = in.x.open(args.get("x")); !e.empty()) throw Failure{"--x: " + e};
  watch_for_bus_errors(in.x, "--x", args.has("out"));
  const std::vector<int64_t>& xs = in.x.shape();
  if (!dtype_is_float(in.x.dtype()))
    throw Failure{where(args, "x") + ": dtype " + dtype_name(in.x.dtype()) +
                  " is not a float type (float16, float32 or float64)"};
  if (xs.size() != 2)
    throw Failure{where(args, "x") + ": shape " + shape_repr(xs) + " is " +
                  std::to_string(xs.size()) + "-D; x must be 2-D [N, H]"};
  if (xs[0] < 1 || xs[1] < 1)
    throw Failure{where(args, "x") + ": shape " + shape_repr(xs) +
                  "; N and H must be >= 1"};
  in.n = xs[0];
  in.h = xs[1];
  in.x_storage = in.storage < 0 ? in.x.dtype() : storage_dtype(in.storage);

  in.w = load_storage(args, "w", in.storage, 2);
  const bool vh = in.layout == WeightLayout::vh;
  const int64_t w_h = in.w.shape[vh ? 1 : 0];
  in.v = in.w.shape[vh ? 0 : 1];
  if (w_h != in.h)
    throw Failure{where(args, "w") + ": shape " + shape_repr(in.w.shape) + " does not match " +
                  where(args, "x") + " " + shape_repr(xs) + ": with --w-layout " +
                  (vh ? "vh, W is [V, H]" : "hv, W is [H, V]") + " with H = " +
                  std::to_string(in.h)};
  if (in.v < 1)
    throw Failure{where(args, "w") + ": shape " + shape_repr(in.w.shape) + "; V must be >= 1"};
  if (args.has("bias")) {
    in.bias = load_storage(args, "bias", in.storage, 1);
    in.has_bias = true;
    if (in.bias.shape[0] != in.v)
      throw Failure{where(args, "bias") + ": shape " + shape_repr(in.bias.shape) +
                    " does not match V = " + std::to_string(in.v) + " (from " +
                    where(args, "w") + ")"};
  }

  if (auto e = in.labels.open(args.get("labels")); !e.empty()) throw Failure{"--labels: " + e};
  watch_for_bus_errors(in.labels, "--labels", args.has("out"));
  const Dtype ly = in.labels.dtype();
  if (ly != Dtype::i32 && ly != Dtype::i64)
    throw Failure{where(args, "labels") + ": dtype " + dtype_name(ly) +
                  "; labels must be int32 or int64"};
  if (in.labels.shape() != std::vector<int64_t>{in.n})
    throw Failure{where(args, "labels") + ": shape " + shape_repr(in.labels.shape()) +
                  " does not match " + where(args, "x") + ": labels must be [N] with N = " +
                  std::to_string(in.n)};

  // Every label in range before any work, with the message the API would
  // give but the row's index in the whole file. Counts the ignored rows.
  in.labels.advise_sequential();
  const Tensor y = vector_view(in.labels.data(), ly, in.n);
  constexpr int64_t kChunk = int64_t(1) << 20;
  for (int64_t i = 0; i < in.n; ++i) {
    const int64_t label = load_int(y, i);
    if (label == options.ignore_index) {
      ++in.ignored;
    } else if (label < 0 || label >= in.v) {
      throw Failure{where(args, "labels") + ": labels[" + std::to_string(i) + "] = " +
                    std::to_string(label) + " is outside [0, V) with V = " +
                    std::to_string(in.v) + " and is not ignore_index (" +
                    std::to_string(options.ignore_index) + ")"};
    }
    if ((i + 1) % kChunk == 0) in.labels.release_before(size_t(i + 1) * dtype_size(ly));
  }
  in.labels.release_before(size_t(in.n) * dtype_size(ly));
  in.labels.rescan();  // the blocks read them again
}

// A progress bar on stderr, redrawn at most 10 times a second; only when
// stderr is a terminal.
class Progress {
 public:
  Progress(bool enabled, int64_t total) : enabled_(enabled), total_(total) {}
  ~Progress() {  // an error ends the bar's line before its message
    if (drawn_ && !finished_) std::fputc('\n', stderr);
  }
  void update(int64_t done) {
    if (!enabled_) return;
    const auto now = Clock::now();
    if (drawn_ && now - last_ < std::chrono::milliseconds(100)) return;
    draw(done, now);
  }
  void finish(int64_t done) {
    if (!enabled_) return;
    draw(done, Clock::now());
    finished_ = true;
    std::fputc('\n', stderr);
    std::fflush(stderr);
  }

 private:
  using Clock = std::chrono::steady_clock;

  static std::string duration(double s) {
    char buf[32];
    const long long t = (long long)std::llround(s);
    if (t >= 3600) std::snprintf(buf, sizeof buf, "%lldh%02lldm%02llds", t / 3600, t / 60 % 60, t % 60);
    else if (t >= 60) std::snprintf(buf, sizeof buf, "%lldm%02llds", t / 60, t % 60);
    else std::snprintf(buf, sizeof buf, "%llds", t);
    return buf;
  }

  void draw(int64_t done, Clock::time_point now) {
    drawn_ = true;
    last_ = now;
    const double elapsed = std::chrono::duration<double>(now - start_).count();
    const double frac = total_ > 0 ? double(done) / double(total_) : 1.0;
    constexpr int kWidth = 24;
    const int filled = int(frac * kWidth);
    std::string bar(size_t(filled), '#');
    bar.resize(kWidth, '.');
    char rate[32] = "-", left[32] = "-";
    if (elapsed > 0 && done > 0) {
      const double r = double(done) / elapsed;
      if (r >= 1e6) std::snprintf(rate, sizeof rate, "%.2fM", r / 1e6);
      else if (r >= 1e3) std::snprintf(rate, sizeof rate, "%.1fk", r / 1e3);
      else std::snprintf(rate, sizeof rate, "%.1f", r);
      std::snprintf(left, sizeof left, "%s", duration(double(total_ - done) / r).c_str());
    }
    std::fprintf(stderr, "\r[%s] %lld/%lld rows %5.1f%%  %s tok/s  %s left\033[K", bar.c_str(),
                 (long long)done, (long long)total_, 100.0 * frac, rate, left);
    std::fflush(stderr);
  }

  bool enabled_;
  int64_t total_;
  bool drawn_ = false, finished_ = false;
  Clock::time_point start_ = Clock::now(), last_;
};

// SIGINT or SIGTERM while output files are being filled: the block loop
// stops at the next block (or after the last) and removes them; a second
// signal removes them in the handler and ends the process at once.
volatile sig_atomic_t g_signal = 0;
// Set by commit(): from there a signal is only recorded, so that the
// renames are all done or none (the handler may run on any thread, so
// blocking signals in this one would not hold it off).
volatile sig_atomic_t g_committing = 0;

// The temporary files' paths for that handler (unlink is async-signal-safe):
// g_tmp_count of them are complete.
constexpr int kMaxTmp = 3;
char g_tmp_paths[kMaxTmp][PATH_MAX];
volatile sig_atomic_t g_tmp_count = 0;

void on_signal(int sig) {
  if (g_signal == 0 || g_committing) {
    g_signal = sig;
    return;
  }
  for (int k = 0; k < g_tmp_count; ++k) ::unlink(g_tmp_paths[k]);
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

// Stops the run (the Outputs' destructor removes their files) once a
// signal came, saying `where`.
void throw_if_interrupted(const std::string& where) {
  if (g_signal != 0)
    throw Failure{"interrupted by signal " + std::to_string(int(g_signal)) + " " + where +
                  "; --out left as it was"};
}

// Ctrl-C, kill's default, a closed terminal (SIGHUP) and Ctrl-\.
void catch_interrupts() {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT}) sigaction(sig, &sa, nullptr);
}

// Adds `path` to the handler's list.
void remove_on_second_signal(const std::string& path) {
  if (g_tmp_count >= kMaxTmp || path.size() >= PATH_MAX) return;
  std::memcpy(g_tmp_paths[g_tmp_count], path.c_str(), path.size() + 1);
  std::atomic_signal_fence(std::memory_order_seq_cst);  // the path before the count
  g_tmp_count = g_tmp_count + 1;
}

// The mapped inputs, for on_bus_error: a read past the new end of a file
// that another process truncated (np.save over it) is a SIGBUS at an
// address inside its mapping. Messages are made ahead, as the handler may
// only write them (write, unlink and _exit are async-signal-safe).
struct WatchedMap {
  const io::NpyMap* map;
  char message[PATH_MAX + 160];
  size_t length;
};
WatchedMap g_watched[2];
volatile sig_atomic_t g_watched_count = 0;

void on_bus_error(int sig, siginfo_t* info, void*) {
  const bool fault = info->si_code > 0;  // not a kill(): an access that faulted
  for (int k = 0; fault && k < g_watched_count; ++k) {
    if (!g_watched[k].map->maps(info->si_addr)) continue;
    (void)!::write(STDERR_FILENO, g_watched[k].message, g_watched[k].length);
    for (int t = 0; t < g_tmp_count; ++t) ::unlink(g_tmp_paths[t]);
    ::_exit(2);
  }
  // Not a mapped input's: the temporaries removed, then what SIGBUS would
  // have done (a fault faults again on return; a sent one needs raising).
  for (int t = 0; t < g_tmp_count; ++t) ::unlink(g_tmp_paths[t]);
  ::signal(sig, SIG_DFL);
  if (!fault) ::raise(sig);
}

void watch_for_bus_errors(const io::NpyMap& map, const std::string& flag, bool out) {
  if (g_watched_count >= 2) return;
  WatchedMap& w = g_watched[g_watched_count];
  w.map = &map;
  const char* after_bar = ::isatty(STDERR_FILENO) == 1 ? "\n" : "";  // a progress bar's line
  const std::string text = after_bar + std::string("flce eval: error: ") + flag + ": " + map.path() +
                           ": changed while it was read (truncated, or unreadable: a read of its "
                           "pages raised SIGBUS)" + (out ? "; --out left as it was" : "") + "\n";
  w.length = std::min(text.size(), sizeof w.message);
  std::memcpy(w.message, text.data(), w.length);
  std::atomic_signal_fence(std::memory_order_seq_cst);  // the entry before the count
  g_watched_count = g_watched_count + 1;
  struct sigaction sa {};
  sa.sa_sigaction = on_bus_error;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGBUS, &sa, nullptr);
}

// The per-token output files, in Outputs' order.
const std::vector<std::string> kOutputNames = {"logprob.npy", "entropy.npy", "argmax.npy"};

// The per-token output files, under temporary names until commit().
class Outputs {
 public:
  explicit Outputs(const std::string& dir) : dir_(dir) {}
  // Creates the directory if missing and the files at full size; whatever
  // was created is removed by the destructor unless commit() ran.
  void create(int64_t n, Dtype real) {
    const std::string& dir = dir_;
    make_out_dir(dir, "flce eval");
    const std::pair<std::string, Dtype> files[] = {
        {kOutputNames[0], real}, {kOutputNames[1], real}, {kOutputNames[2], Dtype::i64}};
    for (auto [name, dtype] : files) {
      File f{name, temporary_path(dir, name).string(), std::make_unique<io::NpyOutFile>()};
      remove_on_second_signal(f.tmp);
      files_.push_back(std::move(f));  // listed before creation: removed on failure
      if (auto e = files_.back().out->create(files_.back().tmp, dtype, {n}); !e.empty())
        throw Failure{"--out: " + e};
    }
  }
  ~Outputs() {  // not committed: remove every temporary file
    std::error_code ec;
    for (File& f : files_) {
      f.out->close();
      if (!committed_) std::filesystem::remove(f.tmp, ec);
    }
  }

  io::NpyOutFile& logprob() { return *files_[0].out; }
  io::NpyOutFile& entropy() { return *files_[1].out; }
  io::NpyOutFile& argmax() { return *files_[2].out; }

  // Closes the files and renames them into place (commit_outputs: all or
  // none). Returns the other output names (of an earlier `flce run`) in DIR.
  std::vector<std::string> commit(const std::vector<std::string>& inputs) {
    namespace fs = std::filesystem;
    Renames renames;
    for (File& f : files_) {
      if (auto e = f.out->close(); !e.empty()) throw Failure{"--out: " + e};
      renames.push_back({f.tmp, fs::path(dir_) / f.name});
    }
    g_committing = 1;
    std::atomic_signal_fence(std::memory_order_seq_cst);
    throw_if_interrupted("after the last row");  // one that came before the flag
    const std::vector<std::string> others =
        commit_outputs(dir_, renames, inputs, /*remove_others=*/false);
    committed_ = true;
    g_tmp_count = 0;  // renamed: nothing for the handler to remove
    return others;
  }

 private:
  struct File {
    std::string name, tmp;
    std::unique_ptr<io::NpyOutFile> out;
  };
  std::string dir_;
  std::vector<File> files_;
  bool committed_ = false;
};

// The summary statistics, summed in float64 in row order.
struct Totals {
  int64_t rows = 0, ignored = 0, scored = 0, correct = 0;
  double sum_loss = 0, sum_entropy = 0;
};

std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

std::string json_string(const std::string& s) {
  std::string q = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') q += '\\', q += char(c);
    else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      q += buf;
    } else q += char(c);
  }
  return q + "\"";
}

void print_summary(const Args& args, const std::string& backend, const Totals& t,
                   double seconds) {
  // Means over no scored rows are nan (0 / 0 on x86 is -nan, printed so).
  const double s = double(t.scored), nan = std::numeric_limits<double>::quiet_NaN();
  const double mean_loss = s > 0 ? t.sum_loss / s : nan,
               accuracy = s > 0 ? double(t.correct) / s : nan,
               mean_entropy = s > 0 ? t.sum_entropy / s : nan, perplexity = std::exp(mean_loss);
  const double rate = seconds > 0 ? double(t.rows) / seconds : 0.0;
  if (args.has("json")) {
    std::printf(
        "{\"backend\": %s, \"rows\": %lld, \"ignored\": %lld, \"scored\": %lld, "
        "\"mean_loss\": %s, \"perplexity\": %s, \"accuracy\": %s, \"correct\": %lld, "
        "\"mean_entropy\": %s, \"seconds\": %s, \"tokens_per_second\": %s, \"out\": %s}\n",
        json_string(backend).c_str(), (long long)t.rows, (long long)t.ignored,
        (long long)t.scored, json_number(mean_loss).c_str(), json_number(perplexity).c_str(),
        json_number(accuracy).c_str(), (long long)t.correct, json_number(mean_entropy).c_str(),
        json_number(seconds).c_str(), json_number(rate).c_str(),
        args.has("out") ? json_string(args.get("out")).c_str() : "null");
    return;
  }
  std::printf("backend: %s\n", backend.c_str());
  std::printf("rows: %lld (ignored: %lld, scored: %lld)\n", (long long)t.rows,
              (long long)t.ignored, (long long)t.scored);
  std::printf("mean loss: %.9g\n", mean_loss);
  std::printf("perplexity: %.9g\n", perplexity);
  std::printf("accuracy: %.9g (%lld/%lld)\n", accuracy, (long long)t.correct,
              (long long)t.scored);
  std::printf("mean entropy: %.9g\n", mean_entropy);
  std::printf("time: %.3f s (%.1f tokens/s)\n", seconds, rate);
  if (args.has("out"))
    std::printf("wrote logprob.npy, entropy.npy, argmax.npy to %s\n", args.get("out").c_str());
}

int eval(const Args& args) {
  const auto start = std::chrono::steady_clock::now();
  for (const char* flag : {"x", "w", "labels"})
    if (!args.has(flag))
      throw Failure{std::string("--") + flag + ": missing (give --x, --w and --labels)"};

  Options options;
  check(args.get_double("logit-scale", &options.logit_scale));
  check(args.get_double("softcap", &options.softcap));
  check(args.get_int("ignore-index", &options.ignore_index));
  check(args.get_double("label-smoothing", &options.label_smoothing));
  check(args.get_double("z-loss", &options.z_loss));
  options.reduction = Reduction::none;
  int64_t block_rows = kDefaultBlockRows, threads = 0;
  check(args.get_int("block-rows", &block_rows));
  if (block_rows < 1)
    throw Failure{"--block-rows: " + std::to_string(block_rows) + " is not >= 1"};
  check(args.get_int("threads", &threads));
  // 0: the backend's default (all cores), as for flce bench and Python's threads=0.
  if (threads < 0 || threads > 4096)
    throw Failure{"--threads: " + std::to_string(threads) + " is not in [0, 4096] (0: all cores)"};
  int out_dtype = 0;
  check(args.get_choice("out-dtype", {"f32", "f64"}, &out_dtype));
  const Dtype real_out = out_dtype == 0 ? Dtype::f32 : Dtype::f64;

  RunConfig config;
  config.backend = args.get("backend");
  if (config.backend.empty()) {
    const char* env = std::getenv("FLCE_BACKEND");
    if (env == nullptr || *env == '\0') config.backend = "cpu";
  }
  config.gemm = args.get("gemm");
  config.threads = int(threads);

  if (args.has("out")) refuse_outputs_over_inputs(args, eval_flags(), args.get("out"), kOutputNames);
  Inputs in;
  struct Unwatch {  // before `in` unmaps: no handler reads a dead mapping
    ~Unwatch() { g_watched_count = 0; }
  } unwatch;
  open_inputs(args, options, in);
  in.x.advise_sequential();

  const int64_t N = in.n, H = in.h, B = std::min(block_rows, N);
  const size_t x_elt = dtype_size(in.x.dtype()), y_elt = dtype_size(in.labels.dtype());
  // x blocks go to the API straight from the mapping when no rounding is
  // asked for and the data is aligned to its elements; otherwise each block
  // is converted (or copied) into one buffer.
  const bool direct = in.x_storage == in.x.dtype() &&
                      reinterpret_cast<uintptr_t>(in.x.data()) % x_elt == 0;
  std::vector<double> x_buffer(direct ? 0 : (size_t(B * H) * dtype_size(in.x_storage) + 7) / 8);
  const size_t rows = size_t(B);
  std::vector<double> loss(rows), lse(rows), logprob(rows), entropy(rows);
  std::vector<int64_t> argmax(rows);
  std::vector<float> narrow(real_out == Dtype::f32 ? rows : 0);

  Problem p;
  p.options = options;
  p.w_layout = in.layout;
  p.w = view_of(in.w);
  if (in.has_bias) p.bias = view_of(in.bias);

  // Runs rows [r0, r0 + b) through forward into the block buffers.
  ForwardOnHostBlocks forward_block;
  auto compute = [&](int64_t r0, int64_t b) -> Status {
    const unsigned char* src = in.x.data() + size_t(r0 * H) * x_elt;
    const void* x_block = src;
    if (!direct) {
      if (in.x_storage == in.x.dtype()) {
        std::memcpy(x_buffer.data(), src, size_t(b * H) * x_elt);
      } else {
        const Tensor from = vector_view(src, in.x.dtype(), b * H);
        const Tensor to = vector_view(x_buffer.data(), in.x_storage, b * H);
        for (int64_t i = 0; i < b * H; ++i) store(to, i, load(from, i));
      }
      x_block = x_buffer.data();
    }
    p.x = matrix_view(x_block, in.x_storage, b, H);
    p.labels = vector_view(in.labels.data() + size_t(r0) * y_elt, in.labels.dtype(), b);
    p.loss = vector_view(loss.data(), Dtype::f64, b);
    p.lse = vector_view(lse.data(), Dtype::f64, b);
    p.logprob = vector_view(logprob.data(), Dtype::f64, b);
    p.entropy = vector_view(entropy.data(), Dtype::f64, b);
    p.argmax = vector_view(argmax.data(), Dtype::i64, b);
    return forward_block(p, config);
  };

  // Started before the first block, which its rate counts (started after
  // it, the first frame's rate counted one block's rows in no time).
  Progress progress(::isatty(STDERR_FILENO) == 1 && !args.has("no-progress"), N);
  // The first block before any file is created: every error the API can
  // find (options, dtypes, the backend or GEMM engine) is found here.
  Status status = compute(0, B);
  if (!status.ok()) throw Failure{explain_api_error(status.error, args)};
  const std::string backend = status.backend;

  std::unique_ptr<Outputs> outputs;
  if (args.has("out")) {
    catch_interrupts();
    outputs = std::make_unique<Outputs>(args.get("out"));
    outputs->create(N, real_out);
  }
  auto write_real = [&](io::NpyOutFile& f, int64_t r0, int64_t b, const std::vector<double>& v) {
    if (real_out == Dtype::f64) return f.write(r0, v.data(), b);
    for (int64_t i = 0; i < b; ++i) narrow[size_t(i)] = float(v[size_t(i)]);
    return f.write(r0, narrow.data(), b);
  };

  Totals t;
  const Tensor y_all = vector_view(in.labels.data(), in.labels.dtype(), N);
  for (int64_t r0 = 0; r0 < N; r0 += B) {
    const int64_t b = std::min(B, N - r0);
    throw_if_interrupted("at row " + std::to_string(r0) + " of " + std::to_string(N));
    if (r0 > 0) {
      status = compute(r0, b);
      if (!status.ok())
        throw Failure{"rows [" + std::to_string(r0) + ", " + std::to_string(r0 + b) + "): " +
                      explain_api_error(status.error, args)};
    }
    for (int64_t i = 0; i < b; ++i) {
      const int64_t label = load_int(y_all, r0 + i);
      if (label == options.ignore_index) {
        ++t.ignored;
        continue;
      }
      ++t.scored;
      t.sum_loss += loss[size_t(i)];
      t.sum_entropy += entropy[size_t(i)];
      t.correct += argmax[size_t(i)] == label;
    }
    // What this block read was the file as opened (a rewrite of the same
    // size would otherwise mix old and new rows silently).
    for (const io::NpyMap* m : {&in.x, &in.labels})
      if (auto e = m->changed(); !e.empty())
        throw Failure{std::string(m == &in.x ? "--x: " : "--labels: ") + e +
                      " at row " + std::to_string(r0) + " of " + std::to_string(N) +
                      (outputs ? "; --out left as it was" : "")};
    t.rows += b;
    if (outputs) {
      for (const std::string& e : {write_real(outputs->logprob(), r0, b, logprob),
                                   write_real(outputs->entropy(), r0, b, entropy),
                                   outputs->argmax().write(r0, argmax.data(), b)})
        if (!e.empty()) throw Failure{"--out: " + e};
    }
    in.x.release_before(size_t((r0 + b) * H) * x_elt);
    in.labels.release_before(size_t(r0 + b) * y_elt);
    progress.update(r0 + b);
  }
  progress.finish(N);
  std::vector<std::string> others;  // stops at commit for a signal inside the last block
  if (outputs) others = outputs->commit(input_files(args, eval_flags()));
  if (!others.empty())  // left as they were: they may be the user's
    std::fprintf(stderr, "flce eval: note: --out %s also holds %s, which this eval did not write\n",
                 args.get("out").c_str(), name_list(others).c_str());
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  print_summary(args, backend, t, seconds);
  return 0;
}

}  // namespace

const char* eval_usage() {
  static const std::string text =
      "usage: flce eval --x X.npy --w W.npy --labels Y.npy [options] [--out DIR]\n\n"
      "Evaluates the head over a data set of any size: x and the labels are\n"
      "memory-mapped and streamed through flce::forward in blocks of --block-rows\n"
      "rows (memory does not grow with N), W and the bias are loaded once.\n"
      "Prints, over the S scored rows (label != ignore-index):\n"
      "  mean loss     (1/S) * sum of loss_i over the scored rows, loss_i the per-token\n"
      "                loss of `flce run --reduction none` (cross-entropy with label\n"
      "                smoothing, plus the z-loss term), summed in float64 in row order\n"
      "  perplexity    exp(mean loss)\n"
      "  accuracy      the fraction of scored rows whose argmax is the label\n"
      "  mean entropy  (1/S) * sum of the entropy H_i over the scored rows\n"
      "and the number of rows, ignored rows and the backend (--json: as one JSON line;\n"
      "means over S = 0 rows are nan, null in JSON). With --out, writes\n"
      "DIR/logprob.npy, entropy.npy (every row) and argmax.npy (int64), filled block\n"
      "by block; nothing is written unless every input is valid and every block\n"
      "succeeded. A progress bar goes to stderr when it is a terminal.\n\noptions:\n" +
      describe_flags(eval_flags());
  return text.c_str();
}

int eval_command(int argc, char** argv, int first) {
  Args args;
  try {
    check(args.parse(argc, argv, first, eval_flags()));
    if (args.has("help")) {
      std::fputs(eval_usage(), stdout);
      return 0;
    }
    return eval(args);
  } catch (const Failure& f) {
    std::fprintf(stderr, "flce eval: error: %s\n", f.message.c_str());
    return 2;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "flce eval: error: out of memory\n");
    return 2;
  }
}

}  // namespace flce::cli
