// The gemm engine registry and the default choice.
//
// MEASUREMENTS: filled in below from bench/gemm_engines.cpp.
#include "cpu/gemm/gemm.h"

#include <climits>
#include <cstring>
#include <stdexcept>
#include <string>

namespace flce::cpu {

#ifdef FLCE_HAVE_ONEDNN
const GemmEngine* onednn_gemm_engine();
#endif
#ifdef FLCE_HAVE_OPENBLAS
const GemmEngine* openblas_gemm_engine();
#endif
const GemmEngine* eigen_gemm_engine();

const std::vector<const GemmEngine*>& gemm_engines() {
  // In order of preference, from the measurements above.
  static const std::vector<const GemmEngine*> engines = [] {
    std::vector<const GemmEngine*> list;
#ifdef FLCE_HAVE_ONEDNN
    list.push_back(onednn_gemm_engine());
#endif
#ifdef FLCE_HAVE_OPENBLAS
    list.push_back(openblas_gemm_engine());
#endif
    list.push_back(eigen_gemm_engine());
    return list;
  }();
  return engines;
}

const GemmEngine* find_gemm_engine(const std::string& name) {
  for (const GemmEngine* e : gemm_engines())
    if (name == e->name()) return e;
  return nullptr;
}

const GemmEngine* default_gemm_engine(Dtype ab_dtype) {
  for (const GemmEngine* e : gemm_engines())
    if (e->supports(ab_dtype)) return e;
  return nullptr;
}

namespace gemm_detail {

namespace {
[[noreturn]] void fail(const char* engine, const std::string& what) {
  throw std::invalid_argument(std::string("gemm engine ") + engine + ": " + what);
}
}  // namespace

void check_args(const GemmArgs& g, const char* engine) {
  if (g.m < 0 || g.n < 0 || g.k < 0)
    fail(engine, "negative size m=" + std::to_string(g.m) + " n=" + std::to_string(g.n) +
                     " k=" + std::to_string(g.k));
  // Kept within 32 bits so every library can take them (OpenBLAS's blasint).
  if (g.m > INT_MAX || g.n > INT_MAX || g.k > INT_MAX || g.lda > INT_MAX ||
      g.ldb > INT_MAX || g.ldc > INT_MAX)
    fail(engine, "a size or leading dimension exceeds 2^31-1");
  if (g.ab_dtype != Dtype::f32 && g.ab_dtype != Dtype::bf16)
    fail(engine, "A and B must be f32 or bf16");
  if (g.m == 0 || g.n == 0) return;
  int64_t a_cols = g.trans_a ? g.m : g.k;
  int64_t b_cols = g.trans_b ? g.k : g.n;
  if (g.ldc < g.n) fail(engine, "ldc=" + std::to_string(g.ldc) + " < n=" + std::to_string(g.n));
  if (g.c == nullptr) fail(engine, "C is null");
  if (g.k == 0) return;
  if (g.lda < a_cols)
    fail(engine, "lda=" + std::to_string(g.lda) + " < " + std::to_string(a_cols) +
                     (g.trans_a ? " (m, A transposed)" : " (k)"));
  if (g.ldb < b_cols)
    fail(engine, "ldb=" + std::to_string(g.ldb) + " < " + std::to_string(b_cols) +
                     (g.trans_b ? " (k, B transposed)" : " (n)"));
  if (g.a == nullptr || g.b == nullptr) fail(engine, "A or B is null");
}

bool run_degenerate(const GemmArgs& g) {
  if (g.m == 0 || g.n == 0) return true;
  if (g.k != 0) return false;
  for (int64_t i = 0; i < g.m; ++i) {
    float* row = g.c + i * g.ldc;
    if (g.beta == 0.0f) {
      std::memset(row, 0, sizeof(float) * size_t(g.n));
    } else if (g.beta != 1.0f) {
      for (int64_t j = 0; j < g.n; ++j) row[j] *= g.beta;
    }
  }
  return true;
}

}  // namespace gemm_detail
}  // namespace flce::cpu
