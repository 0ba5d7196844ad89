// common/float_env.h: the floating-point environment a backend computes in.
//
// A caller's thread may flush subnormals to zero (x86's MXCSR FTZ and DAZ
// bits, which torch.set_flush_denormal(True) sets; AArch64's FPCR.FZ) or
// round other than to nearest. The cpu backend splits its work between the
// calling thread and OpenMP threads that keep the environment they started
// with, so such a caller made the bits depend on the thread count, and every
// bound of the tolerance policy assumes IEEE arithmetic. DefaultFloatEnv
// puts the thread in the default environment (round to nearest, subnormals
// kept, every exception masked, x87's too) for its lifetime and gives the
// caller's back: its rounding, flush bits, traps and the exception flags it
// had raised. Flags raised inside are dropped with the call's environment
// (NaN and infinity are results of flce's semantics, not errors).
#pragma once

#include <cfenv>
#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace flce {

class DefaultFloatEnv {
 public:
  DefaultFloatEnv() {
#if defined(__x86_64__) || defined(__i386__)
    saved_csr_ = _mm_getcsr();
#elif defined(__aarch64__)
    __asm__ volatile("mrs %0, fpcr" : "=r"(saved_fpcr_));
#endif
    std::fegetenv(&saved_);
    std::fesetenv(FE_DFL_ENV);  // x87 and SSE (or FPCR): to nearest, all masked
    // The flush bits too, whatever the C library's default leaves of them.
#if defined(__x86_64__) || defined(__i386__)
    _mm_setcsr(kDefaultCsr);
#elif defined(__aarch64__)
    __asm__ volatile("msr fpcr, %0" : : "r"(uint64_t(0)));
#endif
  }
  ~DefaultFloatEnv() {
    std::fesetenv(&saved_);
#if defined(__x86_64__) || defined(__i386__)
    _mm_setcsr(saved_csr_);
#elif defined(__aarch64__)
    __asm__ volatile("msr fpcr, %0" : : "r"(saved_fpcr_));
#endif
  }
  DefaultFloatEnv(const DefaultFloatEnv&) = delete;
  DefaultFloatEnv& operator=(const DefaultFloatEnv&) = delete;

 private:
  std::fenv_t saved_;
#if defined(__x86_64__) || defined(__i386__)
  // Every exception masked, round to nearest, FTZ and DAZ off; the sticky
  // flags cleared (the caller's come back with saved_csr_).
  static constexpr unsigned kDefaultCsr = 0x1F80;
  unsigned saved_csr_ = kDefaultCsr;
#elif defined(__aarch64__)
  uint64_t saved_fpcr_ = 0;  // 0: round to nearest, no flush, no traps
#endif
};

}  // namespace flce
