// The Eigen engine: the fallback that is always compiled in. f32 only.
//
// Operands are Eigen::Maps of the caller's memory with an outer stride (the
// leading dimension), transposed as expressions, so nothing is copied.
//
// Threads. The flce target is built with -fopenmp, which would turn on
// Eigen's own OpenMP parallelism in products; EIGEN_DONT_PARALLELIZE turns it
// off for this file, so a product always runs on the calling thread (Eigen
// would also stay serial inside an active parallel region, but not outside
// one). Nothing else in flce includes Eigen, so no other instantiation of its
// product templates with different settings can be linked in instead.
//
// Speed. This file is compiled for the baseline x86-64 ISA like the rest of
// the library (one binary has to run on any x86-64), so Eigen uses SSE2
// packets: see gemm.cpp for what that costs against the libraries that
// dispatch on the CPU at run time.
#define EIGEN_DONT_PARALLELIZE
#include <Eigen/Core>

#include <mutex>
#include <stdexcept>
#include <string>

#include "cpu/gemm/gemm.h"

namespace flce::cpu {
namespace {

using RowMajorF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstMap = Eigen::Map<const RowMajorF, Eigen::Unaligned, Eigen::OuterStride<>>;
using MutMap = Eigen::Map<RowMajorF, Eigen::Unaligned, Eigen::OuterStride<>>;

template <class OpA, class OpB>
void multiply(MutMap& c, const OpA& a, const OpB& b, float beta) {
  if (beta == 0.0f) {
    c.noalias() = a * b;
  } else {
    if (beta != 1.0f) c *= beta;
    c.noalias() += a * b;
  }
}

class EigenEngine final : public GemmEngine {
 public:
  const char* name() const override { return "eigen"; }

  std::string describe() const override {
    return "eigen " + std::to_string(EIGEN_WORLD_VERSION) + "." +
           std::to_string(EIGEN_MAJOR_VERSION) + "." + std::to_string(EIGEN_MINOR_VERSION) +
           " (" + Eigen::SimdInstructionSetsInUse() + ", 1 thread per call)";
  }

  bool supports(Dtype ab_dtype) const override { return ab_dtype == Dtype::f32; }

  void run(const GemmArgs& g) const override {
    gemm_detail::check_args(g, "eigen");
    if (g.ab_dtype != Dtype::f32)
      throw std::invalid_argument("gemm engine eigen: A and B must be f32");
    if (gemm_detail::run_degenerate(g)) return;
    static std::once_flag once;
    std::call_once(once, [] { Eigen::initParallel(); });

    const float* a = static_cast<const float*>(g.a);
    const float* b = static_cast<const float*>(g.b);
    // The stored shapes: A is [m, k] or, transposed, [k, m]; likewise B.
    ConstMap a_st(a, g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, Eigen::OuterStride<>(g.lda));
    ConstMap b_st(b, g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, Eigen::OuterStride<>(g.ldb));
    MutMap c(g.c, g.m, g.n, Eigen::OuterStride<>(g.ldc));
    if (!g.trans_a && !g.trans_b) multiply(c, a_st, b_st, g.beta);
    else if (!g.trans_a) multiply(c, a_st, b_st.transpose(), g.beta);
    else if (!g.trans_b) multiply(c, a_st.transpose(), b_st, g.beta);
    else multiply(c, a_st.transpose(), b_st.transpose(), g.beta);
  }
};

}  // namespace

const GemmEngine* eigen_gemm_engine() {
  static const EigenEngine engine;
  return &engine;
}

}  // namespace flce::cpu
