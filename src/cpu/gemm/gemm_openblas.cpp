// The OpenBLAS engine: cblas_sgemm, f32 only (0.3.21 has no cblas_sbgemm).
//
// Threading. Debian's libopenblas0-pthread is built with USE_OPENMP=0: it runs
// its own pthread pool, sized to the core count when the library loads. We
// set that pool's width to 1 once, before the first call, so every
// cblas_sgemm runs entirely on the calling thread and never hands work to the
// pool. Without that, a large enough product splits over the pool even when
// called from inside an OpenMP parallel region: oversubscription (measured:
// twice the CPU time of the calling threads). With one thread, OpenBLAS is
// safe to call from several threads at once: each call takes its packing
// buffers from the library's buffer pool, which serves concurrent callers.
// tests/test_gemm.cpp checks both (bitwise-equal results under concurrency,
// CPU time on the calling threads only).
//
// openblas_set_num_threads is process-wide: anything else in the process
// that calls OpenBLAS also gets one thread. The cpu backend is the only user.
//
// Other Debian variants, should the alternatives point at one (untested
// here, only the pthreads build is installed): the serial build needs
// nothing. The OpenMP build (libopenblas0-openmp) must NOT get
// openblas_set_num_threads(1), which there also calls omp_set_num_threads(1)
// and would shrink every later parallel region of the calling thread;
// instead, each call runs with the calling thread's OpenMP thread count set to
// 1 and then restored.
//
// Kernels. Debian builds with DYNAMIC_ARCH: the kernels are picked when the
// library loads, from CPUID, or from OPENBLAS_CORETYPE if that is set. On
// this Zen 5 (AVX-512 + AVX512-BF16) 0.3.21 detects "Cooperlake" and uses
// its AVX-512 sgemm kernels; OPENBLAS_CORETYPE=Haswell (which the dev
// environment here exports) forces AVX2 kernels at about half the speed (see
// gemm.cpp). The variable is read only at load time: setenv() from inside the
// process changes nothing (checked with bench/gemm_engines --setenv-coretype).
// describe() reports which kernels are in use.
#include <cblas.h>
#include <omp.h>

#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

#include "cpu/gemm/gemm.h"

namespace flce::cpu {
namespace {

// Returns openblas_get_parallel(): OPENBLAS_SEQUENTIAL, OPENBLAS_THREAD
// (pthreads) or OPENBLAS_OPENMP.
int init_openblas_once() {
  static const int parallel = [] {
    int p = openblas_get_parallel();
    if (p == OPENBLAS_THREAD) openblas_set_num_threads(1);
    return p;
  }();
  return parallel;
}

// The calls holding OpenBLAS at one thread (hold_for_calls), and the count
// to give back when the last one ends (0: it was 1 already).
struct OneThreadHold {
  std::mutex mutex;
  int holders = 0;
  int restore = 0;
};
OneThreadHold& one_thread_hold() {
  static OneThreadHold hold;
  return hold;
}

// Sets the calling thread's OpenMP thread count to 1 for its lifetime, when
// `active`.
class OneOmpThread {
 public:
  explicit OneOmpThread(bool active) : saved_(active ? omp_get_max_threads() : 1) {
    if (saved_ != 1) omp_set_num_threads(1);
  }
  ~OneOmpThread() {
    if (saved_ != 1) omp_set_num_threads(saved_);
  }
  OneOmpThread(const OneOmpThread&) = delete;
  OneOmpThread& operator=(const OneOmpThread&) = delete;

 private:
  int saved_;
};

class OpenBlasEngine final : public GemmEngine {
 public:
  const char* name() const override { return "openblas"; }

  std::string describe() const override {
    std::string s = "openblas";
#ifdef OPENBLAS_VERSION
    // OPENBLAS_VERSION is " OpenBLAS 0.3.21 "; keep the number.
    std::string v = OPENBLAS_VERSION;
    size_t p = v.find_first_of("0123456789");
    if (p != std::string::npos) {
      v = v.substr(p);
      v.erase(v.find_last_not_of(' ') + 1);
      s += " " + v;
    }
#endif
    int parallel = init_openblas_once();
    s += " (";
    s += openblas_get_corename();
    s += parallel == OPENBLAS_THREAD   ? " kernels, pthreads build"
         : parallel == OPENBLAS_OPENMP ? " kernels, OpenMP build"
                                       : " kernels, serial build";
    s += ", 1 thread per call)";
    return s;
  }

  bool supports(Dtype ab_dtype) const override { return ab_dtype == Dtype::f32; }

  // A pthreads build's thread count is set to 1 at first use
  // (init_openblas_once), but numpy, threadpoolctl or the user may raise it
  // later: then the GEMMs of flce's OpenMP threads would each start
  // OpenBLAS's own threads as well. Held at 1 while any call runs (calls
  // may overlap, from several host threads), and the raised count given
  // back when the last one ends.
  std::shared_ptr<void> hold_for_calls() const override {
    if (init_openblas_once() != OPENBLAS_THREAD) return nullptr;
    OneThreadHold& h = one_thread_hold();
    std::lock_guard<std::mutex> lock(h.mutex);
    const int now = openblas_get_num_threads();
    if (now != 1) {
      h.restore = now;
      openblas_set_num_threads(1);
    }
    ++h.holders;
    return std::shared_ptr<void>(nullptr, [](void*) {
      OneThreadHold& held = one_thread_hold();
      std::lock_guard<std::mutex> relock(held.mutex);
      if (--held.holders == 0 && held.restore != 0) {
        openblas_set_num_threads(held.restore);
        held.restore = 0;
      }
    });
  }

  void run(const GemmArgs& g) const override {
    gemm_detail::check_args(g, "openblas");
    if (g.ab_dtype != Dtype::f32)
      throw std::invalid_argument("gemm engine openblas: A and B must be f32");
    if (gemm_detail::run_degenerate(g)) return;
    OneOmpThread one(init_openblas_once() == OPENBLAS_OPENMP);
    // blasint is int here (USE_64BITINT unset); check_args bounds the sizes.
    cblas_sgemm(CblasRowMajor, g.trans_a ? CblasTrans : CblasNoTrans,
                g.trans_b ? CblasTrans : CblasNoTrans, blasint(g.m), blasint(g.n),
                blasint(g.k), 1.0f, static_cast<const float*>(g.a), blasint(g.lda),
                static_cast<const float*>(g.b), blasint(g.ldb), g.beta, g.c,
                blasint(g.ldc));
  }
};

}  // namespace

const GemmEngine* openblas_gemm_engine() {
  static const OpenBlasEngine engine;
  return &engine;
}

}  // namespace flce::cpu
