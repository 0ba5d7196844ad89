// bench/gemm_engines.cpp: GFLOP/s of each cpu gemm engine on the products
// the cpu backend makes, run the way the backend runs them: T OpenMP threads
// (default 2), each calling the engine single-threaded on its own tiles.
//
// For rows R (a row block of x), a vocab tile T and hidden size H:
//   logits  C[R, T]  = x[R, H] W[T, H]^T            m=R n=T k=H  trans_b, beta 0
//   grad_x  C[R, H] += dlogits[R, T] W[T, H]        m=R n=H k=T  beta 1
//   grad_W  C[T, H] += dlogits[R, T]^T x[R, H]      m=T n=H k=R  trans_a, beta 1
// W (and dW for grad_W) is a [V, H] array of at least 64 MiB, walked tile by
// tile as the backend walks the vocabulary, so it streams from memory as it
// would; each thread takes the tiles t = thread, thread + T, ...
//
// Usage: flce_gemm_engines [--seconds S] [--repeats N] [--threads N]
//          [--engines onednn,openblas,eigen] [--dtypes f32,bf16]
//          [--kinds logits,grad_x,grad_W] [--rows 64,256] [--tiles 256,1024]
//          [--hidden 128,768,2304,4096] [--setenv-coretype NAME]
// Besides the engines, "gemm_tn" is the cpu backend's own short-k kernel for
// grad_W (simd::KernelSet::gemm_tn: f32 on AVX-512, bf16 with AVX512-BF16),
// timed for grad_W only.
// Each cell is the best of --repeats runs of --seconds each. Two rates: wall
// (all threads' flops over wall time) and cpu (each thread's flops over its
// own CPU time, summed): on a loaded machine the cpu rate is the one to
// trust. OPENBLAS_CORETYPE must be in the environment when the process
// starts; --setenv-coretype sets it from inside, to show that is too late.
#include <omp.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/float16.h"
#include "cpu/gemm/gemm.h"
#include "simd/kernels.h"

namespace {

using flce::Dtype;
using flce::cpu::GemmArgs;
using flce::cpu::GemmEngine;

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t comma = s.find(',', start);
    if (comma == std::string::npos) comma = s.size();
    if (comma > start) out.push_back(s.substr(start, comma - start));
    start = comma + 1;
  }
  return out;
}

// Exits with status 2 and a message naming the flag and the value.
[[noreturn]] void bad(const std::string& flag, const std::string& why) {
  std::fprintf(stderr, "flce_gemm_engines: %s: %s\n", flag.c_str(), why.c_str());
  std::exit(2);
}

// `text` as a whole integer in [lo, hi], else bad().
int64_t integer(const std::string& flag, const std::string& text, int64_t lo, int64_t hi) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0])) || *end != '\0' ||
      errno == ERANGE || v < lo || v > hi)
    bad(flag, "'" + text + "' is not an integer in [" + std::to_string(lo) + ", " +
                  std::to_string(hi) + "]");
  return v;
}

// A comma-separated list of sizes in [1, 2^20].
std::vector<int64_t> split_sizes(const std::string& flag, const std::string& s) {
  std::vector<int64_t> out;
  for (const std::string& t : split(s)) out.push_back(integer(flag, t, 1, int64_t(1) << 20));
  if (out.empty()) bad(flag, "'" + s + "' names no size");
  return out;
}

// Every entry of a comma-separated list is one of `choices`, else bad().
std::vector<std::string> split_choices(const std::string& flag, const std::string& s,
                                       const std::vector<std::string>& choices) {
  const std::vector<std::string> out = split(s);
  for (const std::string& t : out)
    if (std::find(choices.begin(), choices.end(), t) == choices.end()) {
      std::string list;
      for (const std::string& c : choices) list += (list.empty() ? "" : ", ") + c;
      bad(flag, "'" + t + "' is not one of " + list);
    }
  if (out.empty()) bad(flag, "'" + s + "' names nothing");
  return out;
}

double thread_cpu_seconds() {
  rusage ru{};
  getrusage(RUSAGE_THREAD, &ru);
  return double(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         1e-6 * double(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
}

// A buffer of n elements of f32 or bf16 with values in [-1, 1].
struct Buffer {
  Dtype dtype;
  std::vector<float> f32;
  std::vector<uint16_t> bf16;
  Buffer(Dtype d, size_t n, uint64_t seed) : dtype(d) {
    // xorshift64: the values only need to be ordinary numbers, and fast.
    uint64_t state = seed * 0x9e3779b97f4a7c15ull + 1;
    auto next = [&state] {
      state ^= state << 13;
      state ^= state >> 7;
      state ^= state << 17;
      return float(int64_t(state >> 40) - (int64_t(1) << 23)) * (1.0f / float(1 << 23));
    };
    if (d == Dtype::f32) {
      f32.resize(n);
      for (float& v : f32) v = next();
    } else {
      bf16.resize(n);
      for (uint16_t& v : bf16) v = flce::f32_to_bf16(next());
    }
  }
  const void* at(size_t offset) const {
    return dtype == Dtype::f32 ? static_cast<const void*>(f32.data() + offset)
                               : static_cast<const void*>(bf16.data() + offset);
  }
};

// simd::KernelSet::gemm_tn (f32) and gemm_tn_bf16 behind the engine
// interface, for grad_W's calls (A transposed) alone, as the backend uses them.
class GemmTnKernel final : public GemmEngine {
 public:
  const char* name() const override { return "gemm_tn"; }
  std::string describe() const override {
    const flce::simd::KernelSet& ks = flce::simd::best_kernels();
    return std::string("gemm_tn: flce's short-k grad_W kernel, ") + ks.isa +
           (ks.gemm_tn_bf16 ? " (f32, bf16)" : " (f32)");
  }
  bool supports(Dtype ab_dtype) const override {
    const flce::simd::KernelSet& ks = flce::simd::best_kernels();
    return ab_dtype == Dtype::f32 ? ks.gemm_tn != nullptr
                                  : ab_dtype == Dtype::bf16 && ks.gemm_tn_bf16 != nullptr;
  }
  void run(const GemmArgs& g) const override {
    if (!supports(g.ab_dtype) || !g.trans_a || g.trans_b)
      throw std::invalid_argument("gemm_tn runs C (+)= A^T B only");
    // The calling thread's packing scratch, as the backend carves one per
    // thread from its workspace.
    thread_local std::vector<float> store(size_t(flce::simd::kGemmTnScratchFloats) + 16);
    float* scratch = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(store.data()) + 63) / 64 * 64);
    const flce::simd::KernelSet& ks = flce::simd::best_kernels();
    if (g.ab_dtype == Dtype::f32)
      ks.gemm_tn(g.m, g.n, g.k, static_cast<const float*>(g.a), g.lda, static_cast<const float*>(g.b),
                 g.ldb, g.c, g.ldc, g.beta != 0.0f, scratch);
    else
      ks.gemm_tn_bf16(g.m, g.n, g.k, static_cast<const uint16_t*>(g.a), g.lda,
                      static_cast<const uint16_t*>(g.b), g.ldb, g.c, g.ldc, g.beta != 0.0f, scratch);
  }
};

struct Rate {
  double wall_gflops = 0.0, cpu_gflops = 0.0;
};

enum class Kind { logits, grad_x, grad_W };

const char* kind_name(Kind k) {
  return k == Kind::logits ? "logits" : k == Kind::grad_x ? "grad_x" : "grad_W";
}

// The operands of one (kind, dtype, R, T, H), shared by every engine.
struct Workload {
  Kind kind;
  Dtype dtype;
  int64_t R, T, H, tiles;
  Buffer W, x, dlogits;
  std::vector<float> dW;  // [V, H], grad_W's C

  static int64_t tiles_for(Dtype dtype, int64_t T, int64_t H, int threads) {
    // Enough vocab tiles that W is >= 64 MiB, and at least 2 per thread.
    const int64_t elt = dtype == Dtype::f32 ? 4 : 2;
    return std::max<int64_t>(2 * threads, (int64_t(64) << 20) / (T * H * elt) + 1);
  }
  Workload(Kind kind_, Dtype dtype_, int64_t R_, int64_t T_, int64_t H_, int threads)
      : kind(kind_), dtype(dtype_), R(R_), T(T_), H(H_), tiles(tiles_for(dtype_, T_, H_, threads)),
        W(dtype_, size_t(tiles * T_ * H_), 1),
        x(dtype_, size_t(R_ * H_), 2),
        dlogits(dtype_, size_t(R_ * T_) * size_t(threads), 3) {
    if (kind == Kind::grad_W) dW.assign(size_t(tiles * T * H), 0.0f);
  }
};

Rate measure(const GemmEngine* engine, Workload& w, int threads, double seconds) {
  const Kind kind = w.kind;
  const Dtype dtype = w.dtype;
  const int64_t R = w.R, T = w.T, H = w.H, tiles = w.tiles;
  const Buffer &W = w.W, &x = w.x, &dlogits = w.dlogits;
  std::vector<float>& dW = w.dW;
  std::vector<std::vector<float>> c_own(static_cast<size_t>(threads));

  const int64_t m = kind == Kind::logits ? R : kind == Kind::grad_x ? R : T;
  const int64_t n = kind == Kind::logits ? T : H;
  const int64_t k = kind == Kind::logits ? H : kind == Kind::grad_x ? T : R;
  const double flops_per_call = 2.0 * double(m) * double(n) * double(k);

  std::atomic<bool> stop{false};
  std::vector<double> cpu(size_t(threads), 0.0);
  std::vector<int64_t> calls(size_t(threads), 0);
  double wall = 0.0;

#pragma omp parallel num_threads(threads)
  {
    const int me = omp_get_thread_num();
    const int nt = omp_get_num_threads();
    std::vector<float>& own = c_own[size_t(me)];
    own.assign(size_t(m * n), 0.0f);
    auto call = [&](int64_t tile) {
      GemmArgs g;
      g.m = m;
      g.n = n;
      g.k = k;
      g.ab_dtype = dtype;
      switch (kind) {
        case Kind::logits:
          g.a = x.at(0);
          g.lda = H;
          g.b = W.at(size_t(tile * T * H));
          g.ldb = H;
          g.trans_b = true;
          g.c = own.data();
          g.ldc = T;
          g.beta = 0.0f;
          break;
        case Kind::grad_x:
          g.a = dlogits.at(size_t(me) * size_t(R * T));
          g.lda = T;
          g.b = W.at(size_t(tile * T * H));
          g.ldb = H;
          g.c = own.data();
          g.ldc = H;
          g.beta = 1.0f;
          break;
        case Kind::grad_W:
          g.a = dlogits.at(size_t(me) * size_t(R * T));
          g.lda = T;
          g.trans_a = true;
          g.b = x.at(0);
          g.ldb = H;
          g.c = dW.data() + tile * T * H;
          g.ldc = H;
          g.beta = 1.0f;
          break;
      }
      engine->run(g);
    };
    // Warm up: plans, buffers, page faults on this thread's tiles.
    for (int64_t t = me; t < tiles; t += nt) call(t);
#pragma omp barrier
    auto t0 = std::chrono::steady_clock::now();
    double c0 = thread_cpu_seconds();
    int64_t tile = me, done = 0;
    while (!stop.load(std::memory_order_relaxed)) {
      call(tile);
      ++done;
      tile += nt;
      if (tile >= tiles) tile = me;
      if (me == 0 && std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() >=
                         seconds)
        stop.store(true, std::memory_order_relaxed);
    }
    cpu[size_t(me)] = thread_cpu_seconds() - c0;
    calls[size_t(me)] = done;
#pragma omp barrier
#pragma omp master
    wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  Rate r;
  int64_t total = 0;
  for (int i = 0; i < threads; ++i) {
    total += calls[size_t(i)];
    if (cpu[size_t(i)] > 0) r.cpu_gflops += double(calls[size_t(i)]) * flops_per_call / cpu[size_t(i)] * 1e-9;
  }
  r.wall_gflops = double(total) * flops_per_call / wall * 1e-9;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  double seconds = 0.3;
  int repeats = 3;
  int threads = 2;
  std::vector<std::string> engine_names, dtype_names{"f32", "bf16"},
      kind_names{"logits", "grad_x", "grad_W"};
  std::vector<int64_t> rows{64, 256}, tiles{256, 1024}, hidden{128, 768, 2304, 4096};
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--seconds") {
      const std::string text = value();
      char* end = nullptr;
      seconds = std::strtod(text.c_str(), &end);
      if (text.empty() || *end != '\0' || !(seconds > 0 && seconds <= 3600))
        bad(a, "'" + text + "' is not a number of seconds in (0, 3600]");
    } else if (a == "--repeats") repeats = int(integer(a, value(), 1, 1000));
    else if (a == "--threads") threads = int(integer(a, value(), 1, 1024));
    else if (a == "--engines") engine_names = split(value());
    else if (a == "--dtypes") dtype_names = split_choices(a, value(), {"f32", "bf16"});
    else if (a == "--kinds") kind_names = split_choices(a, value(), {"logits", "grad_x", "grad_W"});
    else if (a == "--rows") rows = split_sizes(a, value());
    else if (a == "--tiles") tiles = split_sizes(a, value());
    else if (a == "--hidden") hidden = split_sizes(a, value());
    else if (a == "--setenv-coretype") setenv("OPENBLAS_CORETYPE", value().c_str(), 1);
    else {
      std::fprintf(stderr, "unknown argument %s (see the comment at the top of %s)\n", a.c_str(),
                   __FILE__);
      return 2;
    }
  }
  static const GemmTnKernel gemm_tn;
  std::vector<const GemmEngine*> engines;
  if (engine_names.empty()) {
    engines = flce::cpu::gemm_engines();
    engines.push_back(&gemm_tn);
  } else {
    for (const std::string& name : engine_names) {
      const GemmEngine* e = name == gemm_tn.name() ? &gemm_tn : flce::cpu::find_gemm_engine(name);
      if (e == nullptr) {
        std::fprintf(stderr, "engine %s is not compiled in\n", name.c_str());
        return 2;
      }
      engines.push_back(e);
    }
  }
  const char* coretype = std::getenv("OPENBLAS_CORETYPE");
  std::printf("# threads=%d seconds=%g repeats=%d OPENBLAS_CORETYPE=%s\n", threads, seconds,
              repeats, coretype ? coretype : "(unset)");
  for (const GemmEngine* e : engines) std::printf("# engine %s\n", e->describe().c_str());
  std::printf("%-7s %5s %5s %5s  %-5s %-9s %10s %10s\n", "kind", "rows", "tile", "H", "dtype",
              "engine", "wall_GF/s", "cpu_GF/s");
  for (const std::string& kn : kind_names) {
    const Kind kind = kn == "logits" ? Kind::logits : kn == "grad_x" ? Kind::grad_x : Kind::grad_W;
    for (int64_t H : hidden)
      for (int64_t R : rows)
        for (int64_t T : tiles)
          for (const std::string& dn : dtype_names) {
            const Dtype dtype = dn == "bf16" ? Dtype::bf16 : Dtype::f32;
            bool any = false;
            // gemm_tn runs grad_W only.
            auto runs = [&](const GemmEngine* e) {
              return e->supports(dtype) && (e != &gemm_tn || kind == Kind::grad_W);
            };
            for (const GemmEngine* e : engines) any = any || runs(e);
            if (!any) continue;
            std::unique_ptr<Workload> owned;
            try {
              owned = std::make_unique<Workload>(kind, dtype, R, T, H, threads);
            } catch (const std::bad_alloc&) {
              bad("--rows " + std::to_string(R) + " --tiles " + std::to_string(T) + " --hidden " +
                      std::to_string(H),
                  "the operands do not fit in this machine's memory");
            }
            Workload& w = *owned;
            for (const GemmEngine* e : engines) {
              if (!runs(e)) continue;
              Rate best;
              for (int r = 0; r < repeats; ++r) {
                Rate got = measure(e, w, threads, seconds);
                best.wall_gflops = std::max(best.wall_gflops, got.wall_gflops);
                best.cpu_gflops = std::max(best.cpu_gflops, got.cpu_gflops);
              }
              std::printf("%-7s %5lld %5lld %5lld  %-5s %-9s %10.1f %10.1f\n", kind_name(kind),
                          (long long)R, (long long)T, (long long)H, dn.c_str(), e->name(),
                          best.wall_gflops, best.cpu_gflops);
              std::fflush(stdout);
            }
          }
  }
  return 0;
}
