#include "cli/bench_problem.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>

#include "common/float16.h"

namespace flce::cli {

BenchProblem::BenchProblem(int64_t n_, int64_t h_, int64_t v_, Dtype dtype_, Options options)
    : n(n_), h(h_), v(v_), dtype(dtype_), options_(options) {
  std::mt19937_64 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const float w_scale = 2.0f / std::sqrt(float(h));
  x32_.resize(size_t(n * h));
  w32_.resize(size_t(v * h));
  for (float& e : x32_) e = normal(rng);
  for (float& e : w32_) e = w_scale * normal(rng);
  if (dtype == Dtype::bf16) {
    for (float e : x32_) x16_.push_back(f32_to_bf16(e));
    for (float e : w32_) w16_.push_back(f32_to_bf16(e));
    std::vector<float>().swap(x32_);
    std::vector<float>().swap(w32_);
  }
  labels_.resize(size_t(n));
  for (int64_t& y : labels_) y = int64_t(rng() % uint64_t(v));
  lse_.resize(size_t(n));
  grad_x_.resize(size_t(n * h) * dtype_size(dtype));
  grad_w_.resize(size_t(v * h) * dtype_size(dtype));
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
    p.grad_x = matrix_view(grad_x_.data(), dtype, n, h);
    p.grad_w = matrix_view(grad_w_.data(), dtype, v, h);
  }
  return p;
}

double logits_gemm_seconds(const cpu::GemmEngine& engine, const BenchProblem& p, int threads) {
  const int64_t block = 2048;
  std::vector<float> out(size_t(threads) * size_t(p.n) * block);
  const size_t elt = dtype_size(p.dtype);
  const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t j0 = 0; j0 < p.v; j0 += block) {
    cpu::GemmArgs g{};
    g.m = p.n, g.n = std::min(block, p.v - j0), g.k = p.h;
    g.ab_dtype = p.dtype;
    g.a = p.x(), g.lda = p.h;
    g.b = static_cast<const char*>(p.w()) + size_t(j0 * p.h) * elt, g.ldb = p.h, g.trans_b = true;
    g.c = out.data() + size_t(omp_get_thread_num()) * size_t(p.n) * block, g.ldc = block;
    engine.run(g);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

const cpu::GemmEngine* bench_engine(Dtype dtype, const std::string& name) {
  const cpu::GemmEngine* e = name.empty() ? cpu::default_gemm_engine(dtype) : cpu::find_gemm_engine(name);
  return e ? e : cpu::default_gemm_engine(Dtype::f32);
}

}  // namespace flce::cli
