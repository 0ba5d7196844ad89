#include "cli/bench_problem.h"

#include <omp.h>

#include <sys/resource.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#include <string>
#include <chrono>
#include <cmath>
#include <random>
#include <vector>

#include "common/float16.h"
#include "common/parallel.h"

namespace flce::cli {

namespace {

// Index j in [0, v) drawn with probability proportional to (j + 1)^-2.
class ZipfSampler {
 public:
  explicit ZipfSampler(int64_t v) : cdf_(size_t(v)) {
    double total = 0;
    for (int64_t j = 0; j < v; ++j) cdf_[size_t(j)] = total += 1.0 / double((j + 1) * (j + 1));
    for (double& c : cdf_) c /= total;
  }
  int64_t operator()(std::mt19937_64& rng) {
    const double u = std::uniform_real_distribution<double>(0, 1)(rng);
    const auto it = std::lower_bound(cdf_.begin(), cdf_.end(), u);
    return std::min<int64_t>(it - cdf_.begin(), int64_t(cdf_.size()) - 1);
  }

 private:
  std::vector<double> cdf_;
};

}  // namespace

BenchProblem::BenchProblem(int64_t n_, int64_t h_, int64_t v_, Dtype dtype_, Options options,
                           BenchData data, Dtype grad_dtype_)
    : n(n_), h(h_), v(v_), dtype(dtype_), grad_dtype(grad_dtype_), options_(options) {
  std::mt19937_64 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // Values go straight into the storage dtype: no f32 copy of a bf16 problem.
  const bool bf16 = dtype == Dtype::bf16;
  (bf16 ? x16_.resize(size_t(n * h)) : x32_.resize(size_t(n * h)));
  (bf16 ? w16_.resize(size_t(v * h)) : w32_.resize(size_t(v * h)));
  auto set_x = [&](int64_t at, float e) { bf16 ? void(x16_[size_t(at)] = f32_to_bf16(e)) : void(x32_[size_t(at)] = e); };
  auto set_w = [&](int64_t at, float e) { bf16 ? void(w16_[size_t(at)] = f32_to_bf16(e)) : void(w32_[size_t(at)] = e); };
  labels_.resize(size_t(n));
  if (data == BenchData::gaussian) {
    const float w_scale = 2.0f / std::sqrt(float(h));
    for (int64_t at = 0; at < n * h; ++at) set_x(at, normal(rng));
    for (int64_t at = 0; at < v * h; ++at) set_w(at, w_scale * normal(rng));
    for (int64_t& y : labels_) y = int64_t(rng() % uint64_t(v));
  } else {  // peaky (see the header)
    const float w_scale = h > 1 ? 1.0f / std::sqrt(float(h - 1)) : 0.0f;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t k = 0; k < h; ++k) set_x(i * h + k, k == 0 ? 1.0f : normal(rng));
    for (int64_t j = 0; j < v; ++j)
      for (int64_t k = 0; k < h; ++k)
        set_w(j * h + k, k == 0 ? float(-2 * std::log(double(j + 1))) : w_scale * normal(rng));
    ZipfSampler zipf(v);
    for (int64_t& y : labels_) y = zipf(rng);
  }
  lse_.resize(size_t(n));
}

const void* BenchProblem::x() const {
  return dtype == Dtype::bf16 ? static_cast<const void*>(x16_.data()) : x32_.data();
}
const void* BenchProblem::w() const {
  return dtype == Dtype::bf16 ? static_cast<const void*>(w16_.data()) : w32_.data();
}

Problem BenchProblem::problem(Pass pass) {
  Problem p;
  p.x = matrix_view(x(), dtype, n, h);
  p.w = matrix_view(w(), dtype, v, h);
  p.labels = vector_view(labels_.data(), Dtype::i64, n);
  p.options = options_;
  p.lse = vector_view(lse_.data(), Dtype::f32, n);
  if (pass != Pass::backward) p.loss = scalar_view(&loss_, Dtype::f32);
  if (pass != Pass::forward) {
    if (grad_x_.empty()) {
      grad_x_.resize(size_t(n * h) * dtype_size(grad_dtype));
      grad_w_.resize(size_t(v * h) * dtype_size(grad_dtype));
    }
    p.grad_x = matrix_view(grad_x_.data(), grad_dtype, n, h);
    p.grad_w = matrix_view(grad_w_.data(), grad_dtype, v, h);
  }
  return p;
}

double median(std::vector<double> seconds) {
  std::sort(seconds.begin(), seconds.end());
  const size_t mid = seconds.size() / 2;
  return seconds.size() % 2 ? seconds[mid] : (seconds[mid - 1] + seconds[mid]) / 2;
}

Status call_pass(const Problem& p, Pass pass, const RunConfig& config) {
  return pass == Pass::forward    ? forward(p, config)
         : pass == Pass::backward ? backward(p, config)
                                  : loss_and_grad(p, config);
}

LogitsGemmBlocks logits_gemm_blocks(int64_t n, int64_t v, int threads) {
  LogitsGemmBlocks b;
  b.row_blocks = (n + 4095) / 4096;
  b.rows = (n + b.row_blocks - 1) / b.row_blocks;
  const int64_t t = std::max(threads, 1);
  const int64_t per_thread = ((v + 2047) / 2048 + t - 1) / t;
  b.col_blocks = std::min(t * per_thread, (v + 63) / 64);  // at least 64 classes a block
  b.cols = (v + b.col_blocks - 1) / b.col_blocks;
  b.col_blocks = (v + b.cols - 1) / b.cols;
  return b;
}

double logits_gemm_seconds(const cpu::GemmEngine& engine, const BenchProblem& p, int threads) {
  const LogitsGemmBlocks b = logits_gemm_blocks(p.n, p.v, threads);
  std::vector<float> out(size_t(threads) * size_t(b.rows) * size_t(b.cols));
  const size_t elt = dtype_size(p.dtype);
  const auto t0 = std::chrono::steady_clock::now();
  parallel_for(threads, 0, b.row_blocks * b.col_blocks, [&](int64_t k) {
    const int64_t i0 = (k / b.col_blocks) * b.rows, j0 = (k % b.col_blocks) * b.cols;
    cpu::GemmArgs g{};
    g.m = std::min(b.rows, p.n - i0), g.n = std::min(b.cols, p.v - j0), g.k = p.h;
    g.ab_dtype = p.dtype;
    g.a = static_cast<const char*>(p.x()) + size_t(i0 * p.h) * elt, g.lda = p.h;
    g.b = static_cast<const char*>(p.w()) + size_t(j0 * p.h) * elt, g.ldb = p.h, g.trans_b = true;
    g.c = out.data() + size_t(omp_get_thread_num()) * size_t(b.rows) * size_t(b.cols);
    g.ldc = b.cols;
    engine.run(g);
  });
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

namespace {

long status_bytes(const char* field) {  // a "VmXXX:  123 kB" line of /proc/self/status
  std::ifstream f("/proc/self/status");
  std::string line;
  const size_t len = std::strlen(field);
  while (std::getline(f, line))
    if (line.compare(0, len, field) == 0 && line.size() > len && line[len] == ':')
      return std::stol(line.substr(len + 1)) * 1024;
  return -1;
}

}  // namespace

long process_peak_rss_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss * 1024L;
}

long process_rss_bytes() { return status_bytes("VmRSS"); }

void PeakMemory::reset() {
  // Memory the allocator kept after an earlier call's free() would be
  // resident already when this call's workspace reuses it, and the peak would
  // miss it (the S4 step's 28 MiB read 0 in the Google Benchmark matrix):
  // handed back to the system first.
#ifdef __GLIBC__
  malloc_trim(0);
#endif
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";  // 5: reset the peak resident size to the current one
  clear.flush();
  hwm_ = clear.good() && process_rss_bytes() >= 0;
  base_ = hwm_ ? process_rss_bytes() : process_peak_rss_bytes();
}

long PeakMemory::extra_bytes() const {
  const long peak = hwm_ ? status_bytes("VmHWM") : process_peak_rss_bytes();
  return std::max(0L, peak - base_);
}

const cpu::GemmEngine* bench_engine(Dtype dtype, const std::string& name) {
  const cpu::GemmEngine* e = name.empty() ? cpu::default_gemm_engine(dtype) : cpu::find_gemm_engine(name);
  return e ? e : cpu::default_gemm_engine(Dtype::f32);
}

}  // namespace flce::cli
