// tests/support/bf16_widening_engine.cpp: bf16 A and B widened to f32 (see
// the header), then the f32 engine's product.
#include "support/bf16_widening_engine.h"

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "common/float16.h"

namespace flce_test {
namespace {

// A stored [rows, cols] at leading dimension ld, widened to a dense f32 copy.
std::vector<float> widened(const void* data, int64_t rows, int64_t cols, int64_t ld) {
  const auto* bits = static_cast<const uint16_t*>(data);
  std::vector<float> out(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[size_t(r * cols + c)] = flce::bf16_to_f32(bits[r * ld + c]);
  return out;
}

}  // namespace

std::string Bf16WideningEngine::describe() const {
  return std::string("bf16 widened to f32 for ") + f32_->describe() + " (tests only)";
}

void Bf16WideningEngine::run(const flce::cpu::GemmArgs& g) const {
  flce::cpu::gemm_detail::check_args(g, name());
  if (g.ab_dtype != flce::Dtype::bf16) return f32_->run(g);
  if (g.b_packed) throw std::invalid_argument("gemm engine bf16-widened: B is never packed");
  if (flce::cpu::gemm_detail::run_degenerate(g)) return;
  // op(A) [m, k] is stored [m, k], or [k, m] when transposed; likewise B.
  const int64_t a_rows = g.trans_a ? g.k : g.m, a_cols = g.trans_a ? g.m : g.k;
  const int64_t b_rows = g.trans_b ? g.n : g.k, b_cols = g.trans_b ? g.k : g.n;
  const std::vector<float> a = widened(g.a, a_rows, a_cols, g.lda);
  const std::vector<float> b = widened(g.b, b_rows, b_cols, g.ldb);
  flce::cpu::GemmArgs w = g;
  w.ab_dtype = flce::Dtype::f32;
  w.a = a.data(), w.lda = a_cols;
  w.b = b.data(), w.ldb = b_cols;
  f32_->run(w);
}

}  // namespace flce_test
