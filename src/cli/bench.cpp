// `flce bench`: a generated problem (x ~ N(0,1), W ~ N(0, 4/H), uniform
// labels) timed through the public API, and the logits GEMM of the same
// shape timed in the same process with the cpu backend's GEMM engine, split
// over the same threads (vocab blocks, one single-threaded call each). The
// ratio is the pass's time over the GEMMs it cannot avoid: one for fwd,
// three for bwd and step (logits, grad_x, grad_W, each 2NHV flops).
#include "cli/bench.h"

#include <omp.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "cli/args.h"
#include "common/float16.h"
#include "cpu/gemm/gemm.h"
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
      {"threads", "T", "threads (default: all)"},
      {"reps", "R", "timed repetitions after one warm-up (default 5)"},
      {"backend", "NAME", "force a backend (default: the first that accepts)"},
      {"gemm", "NAME", "force the cpu backend's GEMM engine"},
      {"help", nullptr, "show this help"},
  };
  return flags;
}

struct Failure {
  std::string message;
};
void check(const std::string& e) {
  if (!e.empty()) throw Failure{e};
}

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

long peak_rss_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss * 1024L;
}

struct Timing {
  double median = 0, min = 0;
};

template <typename F>
Timing time_reps(int reps, F&& f) {
  f();  // warm-up: first-touch of buffers, GEMM primitive creation
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const double t0 = now();
    f();
    t.push_back(now() - t0);
  }
  std::sort(t.begin(), t.end());
  return {t[t.size() / 2], t.front()};
}

// U[N, V] = X W^T by vocab blocks of 2048 over `threads` threads, one
// single-threaded engine call per block, into a [threads, N, 2048] scratch.
Timing time_gemm(const cpu::GemmEngine& engine, Dtype dtype, const void* x, const void* w,
                 int64_t N, int64_t H, int64_t V, int threads, int reps) {
  const int64_t block = 2048;
  std::vector<float> out(size_t(threads) * size_t(N) * block);
  const size_t elt = dtype_size(dtype);
  return time_reps(reps, [&] {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j0 = 0; j0 < V; j0 += block) {
      cpu::GemmArgs g{};
      g.m = N, g.n = std::min(block, V - j0), g.k = H;
      g.ab_dtype = dtype;
      g.a = x, g.lda = H;
      g.b = static_cast<const char*>(w) + size_t(j0 * H) * elt, g.ldb = H, g.trans_b = true;
      g.c = out.data() + size_t(omp_get_thread_num()) * size_t(N) * block, g.ldc = block;
      engine.run(g);
    }
  });
}

struct Setup {
  int64_t n = 0, h = 0, v = 0;
  Dtype dtype = Dtype::f32;
  int pass = 2;  // fwd, bwd, step
  int threads = 0, reps = 5;
  Options options;
  RunConfig config;
};

Setup read_setup(const Args& args) {
  Setup s;
  check(args.get_int("n", &s.n));
  check(args.get_int("h", &s.h));
  check(args.get_int("v", &s.v));
  for (auto [flag, value] : {std::pair{"n", s.n}, std::pair{"h", s.h}, std::pair{"v", s.v}})
    if (!args.has(flag) || value < 1)
      throw Failure{std::string("--") + flag + ": required, an integer >= 1"};
  int dtype = 0, grad_logits = 0;
  check(args.get_choice("dtype", {"f32", "bf16"}, &dtype));
  s.dtype = dtype == 0 ? Dtype::f32 : Dtype::bf16;
  check(args.get_choice("pass", {"fwd", "bwd", "step"}, &s.pass));
  check(args.get_double("softcap", &s.options.softcap));
  check(args.get_choice("grad-logits", {"f32", "storage"}, &grad_logits));
  s.options.grad_logits_dtype = GradLogitsDtype(grad_logits);
  int64_t threads = 0, reps = 5;
  check(args.get_int("threads", &threads));
  check(args.get_int("reps", &reps));
  if (threads < 0 || threads > 4096) throw Failure{"--threads: " + std::to_string(threads) + " is not in [1, 4096]"};
  if (reps < 1 || reps > 1000) throw Failure{"--reps: " + std::to_string(reps) + " is not in [1, 1000]"};
  s.threads = threads > 0 ? int(threads) : omp_get_max_threads();
  s.reps = int(reps);
  s.config.threads = s.threads;
  s.config.backend = args.get("backend");
  s.config.gemm = args.get("gemm");
  return s;
}

int run_bench(const Args& args) {
  const Setup s = read_setup(args);
  const int64_t N = s.n, H = s.h, V = s.v;
  std::mt19937_64 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const float w_scale = 2.0f / std::sqrt(float(H));
  std::vector<float> x32(size_t(N * H)), w32(size_t(V * H));
  for (float& e : x32) e = normal(rng);
  for (float& e : w32) e = w_scale * normal(rng);
  std::vector<uint16_t> x16, w16;
  const void* x = x32.data();
  const void* w = w32.data();
  if (s.dtype == Dtype::bf16) {
    for (float e : x32) x16.push_back(f32_to_bf16(e));
    for (float e : w32) w16.push_back(f32_to_bf16(e));
    x = x16.data(), w = w16.data();
    std::vector<float>().swap(x32), std::vector<float>().swap(w32);
  }
  std::vector<int64_t> labels(static_cast<size_t>(N));
  for (int64_t& y : labels) y = int64_t(rng() % uint64_t(V));
  float loss = 0;
  std::vector<float> lse(static_cast<size_t>(N));
  std::vector<uint16_t> grad_x(size_t(N * H) * (s.dtype == Dtype::bf16 ? 1 : 2)),
      grad_w(size_t(V * H) * (s.dtype == Dtype::bf16 ? 1 : 2));

  Problem p;
  p.x = matrix_view(x, s.dtype, N, H);
  p.w = matrix_view(w, s.dtype, V, H);
  p.labels = vector_view(labels.data(), Dtype::i64, N);
  p.options = s.options;
  p.lse = vector_view(lse.data(), Dtype::f32, N);
  if (s.pass != 1) p.loss = scalar_view(&loss, Dtype::f32);
  if (s.pass != 0) {  // gradients in the storage dtype, as a training step keeps them
    p.grad_x = matrix_view(grad_x.data(), s.dtype, N, H);
    p.grad_w = matrix_view(grad_w.data(), s.dtype, V, H);
  }
  if (s.pass == 1) {  // backward reads a saved lse
    Problem f = p;
    f.loss = scalar_view(&loss, Dtype::f32);
    f.grad_x = f.grad_w = Tensor{};
    const Status fs = forward(f, s.config);
    if (!fs.ok()) throw Failure{fs.error};
  }
  size_t workspace = 0;
  const Pass pass = s.pass == 0 ? Pass::forward : s.pass == 1 ? Pass::backward : Pass::loss_and_grad;
  Status st = workspace_size(p, pass, s.config, &workspace);
  if (!st.ok()) throw Failure{st.error};
  const long rss_before = peak_rss_bytes();
  const Timing t = time_reps(s.reps, [&] {
    st = pass == Pass::forward ? forward(p, s.config)
         : pass == Pass::backward ? backward(p, s.config) : loss_and_grad(p, s.config);
    if (!st.ok()) throw Failure{st.error};
  });
  const long peak_extra = std::max(0L, peak_rss_bytes() - rss_before);

  const cpu::GemmEngine* engine = !s.config.gemm.empty() ? cpu::find_gemm_engine(s.config.gemm)
                                                         : cpu::default_gemm_engine(s.dtype);
  if (engine == nullptr) engine = cpu::default_gemm_engine(Dtype::f32);
  const Dtype gemm_dtype = engine->supports(s.dtype) ? s.dtype : Dtype::f32;
  const Timing g = gemm_dtype == s.dtype
                       ? time_gemm(*engine, gemm_dtype, x, w, N, H, V, s.threads, s.reps)
                       : Timing{};
  const double gemms = s.pass == 0 ? 1 : 3;
  const double flops = 2.0 * double(N) * double(H) * double(V) * gemms;
  std::printf(
      "{\"n\": %lld, \"h\": %lld, \"v\": %lld, \"dtype\": \"%s\", \"pass\": \"%s\", "
      "\"softcap\": %g, \"grad_logits\": \"%s\", \"seconds\": %.6g, \"min_seconds\": %.6g, "
      "\"tokens_per_s\": %.6g, \"gflops\": %.6g, \"gemm_seconds\": %.6g, \"ratio_to_gemm\": %.4g, "
      "\"peak_extra_bytes\": %ld, \"workspace_bytes\": %zu, \"backend\": \"%s\", \"gemm\": \"%s\", "
      "\"isa\": \"%s\", \"threads\": %d}\n",
      (long long)N, (long long)H, (long long)V, dtype_name(s.dtype),
      s.pass == 0 ? "fwd" : s.pass == 1 ? "bwd" : "step", s.options.softcap,
      s.options.grad_logits_dtype == GradLogitsDtype::f32 ? "f32" : "storage", t.median, t.min,
      double(N) / t.median, flops / t.median * 1e-9, g.median * gemms,
      g.median > 0 ? t.median / (g.median * gemms) : 0.0, peak_extra, workspace,
      st.backend.c_str(), engine->name(), simd::best_kernels().isa, s.threads);
  return 0;
}

}  // namespace

int bench_command(int argc, char** argv, int first) {
  Args args;
  try {
    check(args.parse(argc, argv, first, bench_flags()));
    if (args.has("help")) {
      std::printf("usage: flce bench --n N --h H --v V [options]\n\n"
                  "Times a generated problem and, in the same run, its logits GEMM\n"
                  "(gemm_seconds counts it once for fwd and three times for bwd and step).\n\n"
                  "options:\n%s",
                  describe_flags(bench_flags()).c_str());
      return 0;
    }
    return run_bench(args);
  } catch (const Failure& f) {
    std::fprintf(stderr, "flce bench: error: %s\n", f.message.c_str());
    return 2;
  }
}

}  // namespace flce::cli
