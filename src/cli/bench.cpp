// `flce bench`: a generated problem (cli/bench_problem.h) timed through the
// public API, and the logits GEMM of the same shape timed after each of its
// repetitions (GemmTimes). The ratio is the pass's time over the GEMMs it
// cannot avoid: one for fwd, three for bwd and step (logits, grad_x,
// grad_W, each 2NHV flops).
// gemm_seconds is 0 when the engine has no native GEMM for the dtype.
#include "cli/bench.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "cli/args.h"
#include "cli/bench_problem.h"
#include "cli/inputs.h"
#include "common/tensor_access.h"
#include "cpu/gemm/gemm.h"
#include "cuda/device_copy.h"
#include "flce/flce.h"
#include "simd/kernels.h"

namespace flce::cli {
namespace {

const std::vector<Flag>& bench_flags() {
  static const std::vector<Flag> flags = {
      {"n", "N", "rows (tokens)"},
      {"h", "H", "hidden size"},
      {"v", "V", "vocabulary size"},
      {"dtype", "f32|bf16", "storage dtype of x and W (default f32)"},
      {"pass", "fwd|bwd|step", "forward, backward from a saved lse, or loss_and_grad (default step)"},
      {"softcap", "K", "softcap (default 0)"},
      {"grad-logits", "f32|storage", "dtype of dlogits before the gradient GEMMs (default f32)"},
      {"filter-eps", "E|auto", "gradient filtering: E >= 0, or auto = storage epsilon / 32 (default 0, off)"},
      {"grad-dtype", "f32|storage", "dtype of grad_x and grad_W: f32 (mixed precision) or the storage dtype (default f32)"},
      {"data", "gaussian|peaky", "generated data: gaussian, or a trained-LM-like Zipf head (default gaussian)"},
      {"threads", "T", "CPU threads, 0 to 4096 (default 0: all)"},
      {"reps", "R", "timed repetitions (default 5)"},
      {"warmup", "W", "untimed calls before them, 0 or 1 (default 1; 0 for shapes that take minutes)"},
      {"backend", "NAME", "force a backend (default: the first that accepts)"},
      {"gemm", "NAME", "the GEMM engine: openblas|onednn|eigen for cpu, cublas for cuda"},
      {"no-progress", nullptr, "never show each call's time on stderr (shown only when stderr is a terminal)"},
      {"help", nullptr, "show this help"},
  };
  return flags;
}

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Timing {
  double median = 0, min = 0;
};

// What a CallProgress line names: "what", or "what i+1/n" for the i-th of
// n calls (no string is built, so nothing is allocated between a
// PeakMemory reset and the timed call when progress is off).
struct CallName {
  const char* what;
  int i = -1, n = 0;
};

// One line on stderr per call, as it runs: what is running, then its
// seconds when it ends. A step of the production shape takes minutes on a
// CPU, and the JSON comes only after every call. Off unless stderr is a
// terminal (and --no-progress is not given), so piped output is unchanged.
class CallProgress {
 public:
  explicit CallProgress(bool enabled) : enabled_(enabled) {}
  ~CallProgress() {  // an error's message goes on a line of its own
    if (open_) std::fputc('\n', stderr);
  }
  CallProgress(const CallProgress&) = delete;
  CallProgress& operator=(const CallProgress&) = delete;

  // Shows `name`, runs timed() (which returns its seconds), shows them.
  template <typename Timed>
  double show(CallName name, Timed&& timed) {
    if (enabled_) {
      if (name.i >= 0) std::fprintf(stderr, "flce bench: %s %d/%d ...", name.what, name.i + 1, name.n);
      else std::fprintf(stderr, "flce bench: %s ...", name.what);
      std::fflush(stderr);
      open_ = true;
    }
    const double seconds = timed();
    if (enabled_) {
      std::fprintf(stderr, " %.3f s\n", seconds);
      open_ = false;
    }
    return seconds;
  }

  // Runs run() and returns its wall-clock seconds, shown as `name`.
  template <typename Run>
  double time(CallName name, Run&& run) {
    return show(name, [&] {
      const double t0 = now();
      run();
      return now() - t0;
    });
  }

 private:
  bool enabled_, open_ = false;
};

Timing timing_of(const std::vector<double>& seconds) {  // at least one
  return {median(seconds), *std::min_element(seconds.begin(), seconds.end())};
}

// The reference GEMM's seconds, one timing after each of the pass's reps, so
// that the two see the same machine: on a shared 2-core VM the GEMM timed
// after all the reps measured 0.59-1.03 s from run to run at S1 bf16 while
// the step moved 3%. Empty where the engine has no native GEMM.
struct GemmTimes {
  std::function<double()> time_once;  // null: no reference
  std::vector<double> seconds;
  void warm_up(CallProgress& progress) const {
    if (time_once) progress.show({"logits GEMM, warm-up"}, time_once);
  }
  void after_rep(CallProgress& progress, int rep, int reps) {
    if (time_once) seconds.push_back(progress.show({"logits GEMM", rep, reps}, time_once));
  }
  Timing timing() const { return seconds.empty() ? Timing{} : timing_of(seconds); }
};

struct Setup {
  int64_t n = 0, h = 0, v = 0;
  Dtype dtype = Dtype::f32;
  int pass = 2;  // fwd, bwd, step
  int threads = 0, reps = 5;
  bool warmup = true;
  bool progress = false;  // CallProgress
  int data = 0;  // BenchData
  Dtype grad_dtype = Dtype::f32;
  Options options;
  RunConfig config;
};

// The host bytes of the problem's arrays (BenchProblem: x and W in the
// storage dtype, grad_x and grad_W in the gradients' for bwd and step,
// labels and lse, and the peaky data's CDF over V) and of the reference
// GEMM's output blocks (one per thread, where the cpu backend may run and
// its engine has the dtype's GEMM), or -1 when that overflows 64 bits.
int64_t problem_bytes(const Setup& s) {
  const int64_t per_value =
      int64_t(dtype_size(s.dtype) + (s.pass == 0 ? 0 : dtype_size(s.grad_dtype)));
  const LogitsGemmBlocks b = logits_gemm_blocks(s.n, s.v, s.threads);
  const bool cpu_may_run =
      (s.config.backend.empty() || s.config.backend == "cpu") && !wants_device(s.config);
  const bool times_gemm = cpu_may_run && bench_engine(s.dtype, s.config.gemm)->supports(s.dtype);
  // At most 4096 threads x 32 MiB.
  const int64_t gemm = times_gemm ? int64_t(s.threads) * b.rows * b.cols * 4 : 0;
  int64_t nh = 0, vh = 0, values = 0, bytes = 0;
  if (__builtin_mul_overflow(s.n, s.h, &nh) || __builtin_mul_overflow(s.v, s.h, &vh) ||
      __builtin_add_overflow(nh, vh, &values) ||
      __builtin_mul_overflow(values, per_value, &bytes) ||
      __builtin_add_overflow(bytes, 12 * s.n + 8 * s.v + gemm, &bytes))  // n, v <= 2^40
    return -1;
  return bytes;
}

// Refuses, before allocating anything, a problem whose arrays exceed this
// machine's memory.
void check_problem_fits(const Setup& s) {
  const int64_t physical = int64_t(sysconf(_SC_PHYS_PAGES)) * int64_t(sysconf(_SC_PAGESIZE));
  const int64_t bytes = problem_bytes(s);
  if (bytes >= 0 && (physical <= 0 || bytes <= physical)) return;
  char need[64] = "more than 2^63 bytes";
  if (bytes >= 0) std::snprintf(need, sizeof need, "%.1f GiB", double(bytes) / double(1 << 30));
  char msg[320];
  std::snprintf(msg, sizeof msg,
                "--n %lld --h %lld --v %lld --threads %d: the problem's arrays (x, W and their "
                "gradients) and the reference GEMM's output blocks (one per thread) need %s of "
                "host memory; this machine has %.1f GiB",
                (long long)s.n, (long long)s.h, (long long)s.v, s.threads, need,
                double(physical) / double(1 << 30));
  throw Failure{msg};
}

// --filter-eps given where `backend` runs the pass: only the cpu's filters.
Failure filter_eps_ignored_by(const std::string& backend) {
  return Failure{"--filter-eps: the " + backend + " backend ignores it (it computes the exact "
                 "gradients), so there is no filtered pass to compare"};
}

Setup read_setup(const Args& args) {
  Setup s;
  check(args.get_int("n", &s.n));
  check(args.get_int("h", &s.h));
  check(args.get_int("v", &s.v));
  for (auto [flag, value] : {std::pair{"n", s.n}, std::pair{"h", s.h}, std::pair{"v", s.v}}) {
    if (!args.has(flag)) throw Failure{std::string("--") + flag + ": required, an integer >= 1"};
    if (value < 1 || value > (int64_t(1) << 40))
      throw Failure{std::string("--") + flag + " " + std::to_string(value) +
                    ": must be in [1, 2^40]"};
  }
  int dtype = 0, grad_logits = 0;
  check(args.get_choice("dtype", {"f32", "bf16"}, &dtype));
  s.dtype = dtype == 0 ? Dtype::f32 : Dtype::bf16;
  check(args.get_choice("pass", {"fwd", "bwd", "step"}, &s.pass));
  check(args.get_double("softcap", &s.options.softcap));
  check(args.get_choice("grad-logits", {"f32", "storage"}, &grad_logits));
  s.options.grad_logits_dtype = GradLogitsDtype(grad_logits);
  check(get_filter_eps(args, &s.options.filter_eps));
  // A forward has no gradients: options about them would be reported as if
  // they had been measured.
  for (const char* flag : {"filter-eps", "grad-logits", "grad-dtype"})
    if (args.has(flag) && s.pass == 0)
      throw Failure{std::string("--") + flag + ": " + (flag[0] == 'f' ? "filters" : "sets the dtype of") +
                    " gradients, so applies to --pass bwd or step, not fwd"};
  check(args.get_choice("data", {"gaussian", "peaky"}, &s.data));
  int grad_dtype = 0;
  check(args.get_choice("grad-dtype", {"f32", "storage"}, &grad_dtype));
  s.grad_dtype = grad_dtype == 0 ? Dtype::f32 : s.dtype;
  int64_t threads = 0, reps = 5;
  check(args.get_int("threads", &threads));
  check(args.get_int("reps", &reps));
  if (threads < 0 || threads > 4096)
    throw Failure{"--threads: " + std::to_string(threads) + " is not in [0, 4096] (0: all cores)"};
  if (reps < 1 || reps > 1000) throw Failure{"--reps: " + std::to_string(reps) + " is not in [1, 1000]"};
  s.threads = threads > 0 ? int(threads) : omp_get_max_threads();
  s.reps = int(reps);
  int64_t warmup = 1;
  check(args.get_int("warmup", &warmup));
  if (warmup != 0 && warmup != 1) throw Failure{"--warmup: " + std::to_string(warmup) + " is not 0 or 1"};
  s.warmup = warmup == 1;
  s.progress = ::isatty(STDERR_FILENO) == 1 && !args.has("no-progress");
  s.config.threads = s.threads;
  s.config.backend = args.get("backend");
  s.config.gemm = args.get("gemm");
  if (s.options.filter_eps != 0 && wants_device(s.config))
    throw filter_eps_ignored_by("cuda");
  check_problem_fits(s);
  return s;
}

// --filter-eps: the filtered pass against the same pass unfiltered, timed
// alternately in this process, and the norm-wise relative difference of
// their gradients, ||filtered - unfiltered||_2 / ||unfiltered||_2.
struct FilterReport {
  bool ran = false;
  Timing unfiltered;
  long peak_extra = 0;  // over the timed calls, before the comparison's copies
  double rel_diff_grad_x = 0, rel_diff_grad_w = 0;
};

std::vector<double> values_of(const Tensor& t) {
  std::vector<double> out(size_t(t.shape[0] * t.shape[1]));
  for (int64_t r = 0; r < t.shape[0]; ++r)
    for (int64_t c = 0; c < t.shape[1]; ++c) out[size_t(r * t.shape[1] + c)] = load(t, r, c);
  return out;
}

double relative_difference(const std::vector<double>& a, const std::vector<double>& b) {
  double diff = 0, norm = 0;
  for (size_t k = 0; k < a.size(); ++k) diff += (a[k] - b[k]) * (a[k] - b[k]), norm += b[k] * b[k];
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

// The pass's reps, each followed by one reference GEMM (GemmTimes). The
// peak memory is the first timed call's, taken before any GEMM's buffers.
template <typename Run>
Timing time_pass(const Setup& s, Run&& run, PeakMemory& peak, long* peak_extra, GemmTimes& gemm,
                 CallProgress& progress) {
  if (s.warmup) progress.time({"warm-up"}, run), gemm.warm_up(progress);
  std::vector<double> t;
  for (int rep = 0; rep < s.reps; ++rep) {
    if (rep == 0) peak.reset();
    t.push_back(progress.time({"call", rep, s.reps}, run));
    if (rep == 0) *peak_extra = peak.extra_bytes();
    gemm.after_rep(progress, rep, s.reps);
  }
  return timing_of(t);
}

template <typename Run>
FilterReport compare_with_unfiltered(const Setup& s, const Problem& filtered, Run&& run,
                                     PeakMemory& peak, GemmTimes& gemm, CallProgress& progress,
                                     Timing* t) {
  Problem unfiltered = filtered;
  unfiltered.options.filter_eps = 0;
  FilterReport r;
  r.ran = true;
  if (s.warmup) {
    progress.time({"unfiltered warm-up"}, [&] { run(unfiltered); });
    progress.time({"filtered warm-up"}, [&] { run(filtered); });
    gemm.warm_up(progress);
  }
  std::vector<double> with, without;
  for (int rep = 0; rep < s.reps; ++rep) {
    if (rep == 0) peak.reset();
    without.push_back(progress.time({"unfiltered call", rep, s.reps}, [&] { run(unfiltered); }));
    with.push_back(progress.time({"filtered call", rep, s.reps}, [&] { run(filtered); }));
    if (rep == 0) r.peak_extra = peak.extra_bytes();
    gemm.after_rep(progress, rep, s.reps);
  }
  *t = timing_of(with);
  r.unfiltered = timing_of(without);
  const std::vector<double> gx = values_of(filtered.grad_x), gw = values_of(filtered.grad_w);
  progress.time({"unfiltered call for the comparison"}, [&] { run(unfiltered); });
  r.rel_diff_grad_x = relative_difference(gx, values_of(unfiltered.grad_x));
  r.rel_diff_grad_w = relative_difference(gw, values_of(unfiltered.grad_w));
  // The last call's stats are the filtered one's.
  progress.time({"filtered call for the comparison"}, [&] { run(filtered); });
  return r;
}

void print_result(const Setup& s, const Timing& t, double gemm_seconds, long peak_extra,
                  size_t workspace, const Status& st, const char* gemm, const char* isa,
                  const FilterReport& filter = {}) {
  const double gemms = s.pass == 0 ? 1 : 3;
  const double flops = 2.0 * double(s.n) * double(s.h) * double(s.v) * gemms;
  const RunStats& r = st.stats;
  // null where no GEMM was timed beside the pass (no native GEMM in the
  // dtype, or a backend that runs none of the engine's), and no engine
  // named where the backend that ran uses none.
  char gemm_json[96] = "\"gemm_seconds\": null, \"ratio_to_gemm\": null";
  if (gemm_seconds > 0)
    std::snprintf(gemm_json, sizeof gemm_json, "\"gemm_seconds\": %.6g, \"ratio_to_gemm\": %.4g",
                  gemm_seconds * gemms, t.median / (gemm_seconds * gemms));
  const std::string gemm_name = gemm ? std::string("\"") + gemm + "\"" : "null";
  const std::string isa_name = isa ? std::string("\"") + isa + "\"" : "null";
  char eps[48], compared[256] = "";
  std::snprintf(eps, sizeof eps, s.options.filter_eps == kFilterEpsAuto ? "\"auto\"" : "%g",
                s.options.filter_eps);
  if (filter.ran)
    std::snprintf(compared, sizeof compared,
                  "\"unfiltered_seconds\": %.6g, \"filtered_over_unfiltered\": %.4g, "
                  "\"rel_diff_grad_x\": %.3g, \"rel_diff_grad_w\": %.3g, ",
                  filter.unfiltered.median, t.median / filter.unfiltered.median,
                  filter.rel_diff_grad_x, filter.rel_diff_grad_w);
  std::printf(
      "{\"n\": %lld, \"h\": %lld, \"v\": %lld, \"dtype\": \"%s\", \"pass\": \"%s\", "
      "\"softcap\": %g, \"grad_logits\": \"%s\", \"grad_dtype\": \"%s\", \"data\": \"%s\", "
      "\"filter_eps\": %s, "
      "\"seconds\": %.6g, \"min_seconds\": %.6g, "
      "\"tokens_per_s\": %.6g, \"gflops\": %.6g, %s, "
      "\"peak_extra_bytes\": %ld, \"peak_rss_bytes\": %ld, \"workspace_bytes\": %zu, "
      "\"grad_blocks\": %lld, "
      "\"grad_blocks_skipped\": %lld, \"skipped_fraction\": %.4g, %s\"backend\": \"%s\", "
      "\"gemm\": %s, \"isa\": %s, \"threads\": %d}\n",
      (long long)s.n, (long long)s.h, (long long)s.v, dtype_name(s.dtype),
      s.pass == 0 ? "fwd" : s.pass == 1 ? "bwd" : "step", s.options.softcap,
      s.options.grad_logits_dtype == GradLogitsDtype::f32 ? "f32" : "storage",
      dtype_name(s.grad_dtype), s.data == 0 ? "gaussian" : "peaky", eps, t.median, t.min,
      double(s.n) / t.median, flops / t.median * 1e-9, gemm_json, peak_extra,
      process_peak_rss_bytes(), workspace,
      (long long)r.grad_blocks, (long long)r.grad_blocks_skipped,
      r.grad_blocks > 0 ? double(r.grad_blocks_skipped) / double(r.grad_blocks) : 0.0, compared,
      st.backend.c_str(), gemm_name.c_str(), isa_name.c_str(), s.threads);
}

// --backend cuda: the problem copied to GPU 0 once, each call timed to a
// device synchronize, and after each, cuBLAS' logits GEMM of the same shape
// and dtype (GemmTimes). peak_extra_bytes is the device workspace the call
// allocates.
int run_bench_on_device(const Setup& s, Pass pass, BenchProblem& bp, CallProgress& progress) {
  if (pass == Pass::backward) {  // backward reads the lse a forward wrote
    progress.time({"forward, for the lse the backward reads"}, [&] {
      const Status fs = call_on_host_arrays(bp.problem(Pass::forward), Pass::forward, s.config);
      if (!fs.ok()) throw Failure{fs.error};
    });
  }
  cuda::DeviceProblem device;
  if (auto e = device.upload(bp.problem(pass), 0); !e.empty()) throw Failure{"backend = cuda: " + e};
  const Problem& p = device.problem();
  size_t workspace = 0;
  Status st = workspace_size(p, pass, s.config, &workspace);
  if (!st.ok()) throw Failure{st.error};
  GemmTimes gemm;
  gemm.time_once = [&] {
    double seconds = 0;
    check(cuda::time_logits_gemm(p, &seconds));
    return seconds;
  };
  PeakMemory unused;  // the host's: the device workspace is reported instead
  long unused_peak = 0;
  const Timing t = time_pass(s, [&] {
    st = call_pass(p, pass, s.config);
    if (!st.ok()) throw Failure{st.error};
    check(cuda::synchronize());
  }, unused, &unused_peak, gemm, progress);
  print_result(s, t, gemm.timing().median, long(workspace), workspace, st, "cublas", "cuda");
  return 0;
}

int run_bench(const Args& args) {
  const Setup s = read_setup(args);
  const Pass pass = s.pass == 0 ? Pass::forward : s.pass == 1 ? Pass::backward : Pass::loss_and_grad;
  CallProgress progress(s.progress);
  std::unique_ptr<BenchProblem> generated;
  progress.time({"generating the problem"}, [&] {
    generated = std::make_unique<BenchProblem>(s.n, s.h, s.v, s.dtype, s.options,
                                               BenchData(s.data), s.grad_dtype);
  });
  BenchProblem& bp = *generated;
  if (wants_device(s.config)) return run_bench_on_device(s, pass, bp, progress);
  Problem p = bp.problem(pass);
  if (pass == Pass::backward) {  // backward reads the lse a forward wrote
    progress.time({"forward, for the lse the backward reads"}, [&] {
      const Status fs = forward(bp.problem(Pass::forward), s.config);
      if (!fs.ok()) throw Failure{fs.error};
    });
  }
  size_t workspace = 0;
  Status st = workspace_size(p, pass, s.config, &workspace);
  if (!st.ok()) throw Failure{st.error};
  const cpu::GemmEngine* engine = bench_engine(s.dtype, s.config.gemm);
  const bool native = engine->supports(s.dtype);
  GemmTimes gemm;
  if (native) gemm.time_once = [&] { return logits_gemm_seconds(*engine, bp, s.threads); };
  auto run = [&](const Problem& q) {
    st = call_pass(q, pass, s.config);
    if (!st.ok()) throw Failure{st.error};
    if (st.backend != "cpu") gemm.time_once = nullptr;  // the only backend that runs the engine
  };
  PeakMemory peak;
  Timing t;
  FilterReport filter;
  long peak_extra = 0;
  if (s.options.filter_eps != 0 && pass != Pass::forward) {
    // Which backend runs it: only the cpu's filters.
    progress.time({"filtered call, to see which backend runs it"}, [&] { run(p); });
    if (st.backend != "cpu")
      throw filter_eps_ignored_by(st.backend);
    filter = compare_with_unfiltered(s, p, run, peak, gemm, progress, &t);
    peak_extra = filter.peak_extra;
  } else {
    t = time_pass(s, [&] { run(p); }, peak, &peak_extra, gemm, progress);
  }
  const Timing g = gemm.timing();
  const bool cpu_ran = st.backend == "cpu";  // the only backend that runs the engine
  print_result(s, t, native && cpu_ran ? g.median : 0.0, peak_extra, workspace, st,
               cpu_ran ? engine->name() : nullptr, cpu_ran ? simd::best_kernels().isa : nullptr,
               filter);
  return 0;
}

}  // namespace

int bench_command(int argc, char** argv, int first) {
  Args args;
  try {
    check(args.parse(argc, argv, first, bench_flags()));
    if (args.has("help")) {
      std::printf("usage: flce bench --n N --h H --v V [options]\n\n"
                  "Times a generated problem and, after each repetition, its logits GEMM\n"
                  "(gemm_seconds: the GEMM's median, counted once for fwd and three times\n"
                  "for bwd and step).\n"
                  "With --filter-eps it also times the same pass unfiltered, alternating\n"
                  "the two, and reports the norm-wise relative differences of the gradients.\n"
                  "With --backend cuda the problem is copied to GPU 0 once, each call is\n"
                  "timed to a device synchronize against cuBLAS' GEMM, and\n"
                  "peak_extra_bytes is the device workspace the call allocates.\n"
                  "When stderr is a terminal, each call's time is shown there as it ends.\n\n"
                  "options:\n%s",
                  describe_flags(bench_flags()).c_str());
      return 0;
    }
    return run_bench(args);
  } catch (const Failure& f) {  // the library's messages name its arguments: add the flag
    std::fprintf(stderr, "flce bench: error: %s\n", explain_api_error(f.message, args).c_str());
    return 2;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "flce bench: error: out of host memory (the problem's arrays, the "
                 "backend's workspace or the reference GEMM's output blocks)\n");
    return 2;
  }
}

}  // namespace flce::cli
