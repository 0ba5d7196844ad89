// Throughput of the cpu backend at the LM-head shapes people train, with the
// GEMM of each shape timed in the same run:
//   S1 GPT-2 head        N = 4096, H = 768,  V = 50257
//   S2 Llama-3-8B head   N = 1024, H = 4096, V = 128256
//   S3 small hidden      N = 8192, H = 128,  V = 32768
//   S4 Gemma-2-2B head   N = 1024, H = 2304, V = 256000, softcap 30
// Benchmarks are named flce/<shape>/<dtype>/<pass>/threads:<T> and
// gemm/<shape>/<dtype>/threads:<T>, each followed by
// /iterations:<I>/manual_time. Counters: items_per_second (tokens/s),
// FLOPS (2NHV for fwd, 6NHV for bwd and step), peak_extra_bytes (resident
// memory the timed calls added, cli::PeakMemory), workspace_bytes (the
// backend's scratch), median_seconds (the median pass; Google Benchmark's
// own time is the mean), ratio_to_gemm (seconds per pass over the GEMMs
// it cannot avoid, one GEMM timed after each pass: run_pass) and, at more
// than one thread, speedup_vs_1_thread (a 1-thread pass timed after each
// pass too: the scaling measured side by side, not across two rows). bf16 runs cast
// dlogits to bf16 (grad_logits_dtype = storage), as GPU kernels do, and
// write f32 gradients, as mixed-precision training keeps f32 master weights.
//   build/bench/flce_benchmarks --benchmark_filter='S1/f32' --benchmark_format=json
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "cli/bench_problem.h"

namespace {

using flce::Dtype;
using flce::Pass;
using flce::cli::median;

// iterations: timed passes per benchmark. S3's take 0.2-1.3 s on 2 cores,
// short enough that one pause of a shared 2-vCPU machine moves a whole row,
// so it gets more of them for its medians.
struct Shape {
  const char* name;
  int64_t n, h, v;
  double softcap;
  int iterations;
};
constexpr Shape kShapes[] = {{"S1", 4096, 768, 50257, 0, 3},
                             {"S2", 1024, 4096, 128256, 0, 3},
                             {"S3", 8192, 128, 32768, 0, 9},
                             {"S4", 1024, 2304, 256000, 30, 3}};

// One problem alive at a time: the big shapes take gigabytes.
flce::cli::BenchProblem& problem_for(const Shape& s, Dtype dtype) {
  static std::unique_ptr<flce::cli::BenchProblem> current;
  static std::string key;
  const std::string want = std::string(s.name) + flce::dtype_name(dtype);
  if (!current || key != want) {
    current.reset();
    flce::Options o;
    o.softcap = s.softcap;
    if (dtype == Dtype::bf16) o.grad_logits_dtype = flce::GradLogitsDtype::storage;
    current = std::make_unique<flce::cli::BenchProblem>(s.n, s.h, s.v, dtype, o,
                                                         flce::cli::BenchData::gaussian, Dtype::f32);
    key = want;
  }
  return *current;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Each iteration times the pass, then the shape's GEMM once (outside the
// benchmark's manual time), so that both see the same machine: on a shared
// 2-core VM the GEMM alone moves 20-30% between runs. ratio_to_gemm is the
// pass's median over the GEMM's median, as `flce bench` reports it. At more
// than one thread the same pass at 1 thread follows, for the same reason:
// on a 2-vCPU machine, S3's bf16 forward scaled 1.76x and 2.00x in two
// consecutive runs of the 1- and 2-thread rows. The peak is the largest
// resident growth of a timed pass, before its GEMM allocates.
void run_pass(benchmark::State& state, const Shape& shape, Dtype dtype, Pass pass) {
  flce::cli::BenchProblem& bp = problem_for(shape, dtype);
  const int threads = int(state.range(0));
  flce::RunConfig config;
  config.threads = threads;
  flce::Problem p = bp.problem(pass);
  if (pass == Pass::backward) flce::forward(bp.problem(Pass::forward), config);
  const flce::cli::BenchProblem& cbp = bp;
  const flce::cpu::GemmEngine& engine = *flce::cli::bench_engine(dtype, "");
  // Without a native GEMM in this dtype (bf16 without oneDNN's, say) there
  // is no GEMM to compare with: the row times the pass alone.
  const bool native = engine.supports(dtype);
  flce::Status status = flce::cli::call_pass(p, pass, config);  // warm-ups: first touch of the outputs
  if (native) flce::cli::logits_gemm_seconds(engine, cbp, threads);
  flce::cli::PeakMemory peak;
  long peak_extra = 0;
  std::vector<double> pass_seconds, gemm_seconds, one_thread_seconds;
  flce::RunConfig one_thread = config;
  one_thread.threads = 1;
  for (auto _ : state) {
    peak.reset();
    const auto t0 = std::chrono::steady_clock::now();
    status = flce::cli::call_pass(p, pass, config);
    const double seconds = seconds_since(t0);
    if (!status.ok()) {
      state.SkipWithError(status.error.c_str());
      return;
    }
    peak_extra = std::max(peak_extra, peak.extra_bytes());
    state.SetIterationTime(seconds);
    pass_seconds.push_back(seconds);
    if (native) gemm_seconds.push_back(flce::cli::logits_gemm_seconds(engine, cbp, threads));
    if (threads > 1) {
      const auto t1 = std::chrono::steady_clock::now();
      status = flce::cli::call_pass(p, pass, one_thread);
      one_thread_seconds.push_back(seconds_since(t1));
      if (!status.ok()) {
        state.SkipWithError(("1 thread: " + status.error).c_str());
        return;
      }
    }
  }
  const double gemms = pass == Pass::forward ? 1 : 3;
  const double flops = 2.0 * double(shape.n) * double(shape.h) * double(shape.v) * gemms;
  size_t workspace = 0;
  flce::workspace_size(p, pass, config, &workspace);
  state.SetItemsProcessed(int64_t(state.iterations()) * shape.n);
  state.counters["FLOPS"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["peak_extra_bytes"] = double(peak_extra);
  state.counters["workspace_bytes"] = double(workspace);
  state.counters["median_seconds"] = median(pass_seconds);
  if (threads > 1)
    state.counters["speedup_vs_1_thread"] = median(one_thread_seconds) / median(pass_seconds);
  if (native) {
    state.counters["ratio_to_gemm"] = median(pass_seconds) / (median(gemm_seconds) * gemms);
    state.SetLabel(status.backend);
  } else {
    state.SetLabel(status.backend + ", no ratio: gemm engine " + engine.name() + " has no native " +
                   flce::dtype_name(dtype) + " GEMM");
  }
}

void run_gemm(benchmark::State& state, const Shape& shape, Dtype dtype) {
  const flce::cli::BenchProblem& bp = problem_for(shape, dtype);
  const flce::cpu::GemmEngine& engine = *flce::cli::bench_engine(dtype, "");
  if (!engine.supports(dtype)) {
    state.SkipWithError(("gemm engine " + std::string(engine.name()) + " has no native " +
                         flce::dtype_name(dtype) + " GEMM").c_str());
    return;
  }
  // The GEMM's own timer, as run_pass's ratio uses it: the output buffer's
  // allocation and zeroing around it are not the GEMM's (counted in wall
  // time, they made 2-thread scaling read 1.44x at S3). One call first:
  // the engine's setup and the threads' start are not the GEMM's either.
  flce::cli::logits_gemm_seconds(engine, bp, int(state.range(0)));
  for (auto _ : state)
    state.SetIterationTime(flce::cli::logits_gemm_seconds(engine, bp, int(state.range(0))));
  state.SetItemsProcessed(int64_t(state.iterations()) * shape.n);
  state.counters["FLOPS"] = benchmark::Counter(2.0 * shape.n * shape.h * shape.v,
                                               benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(engine.name());
}

// Registered in shape order so each shape's problem is built once.
int register_all() {
  for (const Shape& s : kShapes)
    for (Dtype dtype : {Dtype::f32, Dtype::bf16}) {
      const std::string tag = std::string(s.name) + "/" + flce::dtype_name(dtype);
      benchmark::RegisterBenchmark(("gemm/" + tag).c_str(), run_gemm, s, dtype)
          ->Arg(1)->Arg(2)->ArgName("threads")->Unit(benchmark::kMillisecond)->UseManualTime()
          ->Iterations(3);
      for (Pass pass : {Pass::forward, Pass::backward, Pass::loss_and_grad}) {
        const char* name = pass == Pass::forward ? "fwd" : pass == Pass::backward ? "bwd" : "step";
        benchmark::RegisterBenchmark(("flce/" + tag + "/" + name).c_str(), run_pass, s, dtype, pass)
            ->Arg(1)->Arg(2)->ArgName("threads")->Unit(benchmark::kMillisecond)->UseManualTime()
            ->Iterations(s.iterations);
      }
    }
  return 0;
}
const int registered = register_all();

}  // namespace

BENCHMARK_MAIN();
