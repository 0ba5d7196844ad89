// simd/testing/kernel_checks.h: the checks of a kernel set against the
// scalar reference, shared by tests/test_simd.cpp (GoogleTest, x86) and
// simd/testing/neon_test_main.cpp (standalone, run under qemu-aarch64).
//
// Each check_* function runs one family of cases and records every
// comparison in a Report; the callers turn a Report into a gtest failure or
// a line of output. Header-only and plain C++ (no gtest).
//
// Tolerances. u = 2^-24 is the unit roundoff of f32; an error of E ulp is at
// most 2E u relative. The kernels' documented accuracy (AVX2 and AVX-512
// measured over every float with FLCE_SIMD_SWEEP_STRIDE=1: README): vector
// exp <= 1.2 ulp, vector tanh <= 1.6 ulp (bounded by 2 ulp = 4u below);
// libm's expf <= 1 ulp (2u), tanhf <= 2.5 ulp (5u).
//  * Element-wise results (exp, scores, dlogits) get a running-error bound:
//    every f32 operation of either implementation perturbs its result by a
//    factor (1 + d), |d| <= u, so the difference of the two results is at
//    most the sum, over the terms of the expression, of |term| times the
//    relative perturbations on the path of that term in both evaluations
//    (first order; the constants below round the counts up).
//  * Sums (online_softmax): a sum of n terms accumulated in any order (any
//    binary tree, so also the lane-wise + horizontal vector order) has error
//    <= gamma_{n-1} * sum|x_i|, gamma_k = k u / (1 - k u) (Higham, Accuracy
//    and Stability, 4.2). Both sums start from terms that carry their own
//    relative error (exp: 4u + 2u; a product: u each side), so
//      |S_vec - S_ref| <= (e_terms + 2 gamma_{n-1}) * sum|t_i|
//    plus the last addition of the old state's (identically rescaled) sum,
//    which rounds on each side: 2u (|old| + sum|t_i|).
//    Exp results in the subnormal range carry an absolute error of up to
//    ~1 ulp of 2^-149 on each side as well: 2^-148 per term is added for that.
// argmax, first_nan and the max are compared exactly; NaN must match NaN and
// an infinite reference must match exactly.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "simd/dispatch.h"
#include "simd/kernels.h"
#include "simd/testing/float_bits.h"

namespace flce::simd::testing {

constexpr double kU = 0x1p-24;      // unit roundoff of f32
constexpr double kTiny = 0x1p-148;  // absolute slack for a subnormal exp result
constexpr float kInf = INFINITY;
constexpr float kNaN = NAN;

// Accuracy bounds (ulp) asserted by the accuracy checks.
// The vector sets' maxima over every float (FLCE_SIMD_SWEEP_STRIDE=1, see
// tests/test_simd.cpp) are in README.md; the bounds leave room above them.
constexpr double kVecExpUlp = 1.5, kVecTanhUlp = 2.0;
// libm's, as the policy assumes them (tests/support/tolerance.h: tanhf 2.5 ulp).
constexpr double kRefExpUlp = 1.0, kRefTanhUlp = 2.5;

inline std::string format(const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return buf;
}

struct Report {
  int64_t checked = 0;
  int64_t failed = 0;
  std::string log;  // the first failures
  void pass() { ++checked; }
  void fail(const std::string& msg) {
    ++checked;
    if (failed++ < 12) log += msg + "\n";
  }
  void expect(bool ok, const std::string& msg) { ok ? pass() : fail(msg); }
  // The message made only for a failure: for checks of every element, where
  // formatting each one took most of the time.
  template <class MakeMessage, class = decltype(std::declval<MakeMessage>()())>
  void expect(bool ok, MakeMessage&& make_message) { ok ? pass() : fail(make_message()); }
  std::string summary() const {
    return format("%lld comparisons, %lld failed", (long long)checked, (long long)failed) +
           (failed ? "\n" + log : std::string());
  }
};

// ---------------------------------------------------------------- helpers

inline bool same_bits(float a, float b) { return bits(a) == bits(b); }
inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}
inline bool same_or_both_nan(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || same_bits(a, b);
}

// Distance in representable floats (0 for +0 vs -0).
inline int64_t ulp_distance(float a, float b) {
  auto key = [](float f) {
    const int64_t m = int64_t(bits(f) & 0x7fffffffu);
    return (bits(f) >> 31) ? -m : m;
  };
  const int64_t d = key(a) - key(b);
  return d < 0 ? -d : d;
}

// Error of y in ulps of the f32 format at the exact value r.
inline double ulp_error(float y, double r) {
  const double ar = std::fabs(r);
  double ulp = 0x1p-149;
  if (ar >= 0x1p-126) {
    int e;
    std::frexp(ar, &e);  // ar = m 2^e, m in [0.5, 1)
    ulp = std::ldexp(1.0, e - 24);
  }
  return std::fabs(double(y) - r) / ulp;
}

inline double gamma(int64_t k) { return double(k) * kU / (1 - double(k) * kU); }

struct Rng {  // splitmix64
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed) {}
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return double(next() >> 11) * 0x1p-53; }
  float uniform(float lo, float hi) { return float(lo + (hi - lo) * uniform()); }
  int64_t below(int64_t n) { return int64_t(next() % uint64_t(n)); }
};

// An f32 array at a chosen misalignment (in floats, from a 64-byte boundary),
// with guard values before and after that must survive the kernel.
class Guarded {
 public:
  Guarded(int64_t n, int offset) : n_(n), store_(size_t(n + 2 * kGuard + 64)) {
    const auto addr = reinterpret_cast<uintptr_t>(store_.data());
    const size_t lead = ((64 - addr % 64) % 64) / sizeof(float);
    begin_ = lead + kGuard + size_t(offset);
    for (size_t i = 0; i < store_.size(); ++i) store_[i] = from_bits(kGuardBits);
  }
  float* data() { return store_.data() + begin_; }
  const float* data() const { return store_.data() + begin_; }
  float& operator[](int64_t i) { return data()[i]; }
  int64_t size() const { return n_; }
  void assign(const std::vector<float>& v) { std::memcpy(data(), v.data(), v.size() * 4); }
  std::vector<float> values() const { return std::vector<float>(data(), data() + n_); }
  bool guards_intact() const {
    for (size_t i = 0; i < store_.size(); ++i) {
      if (i >= begin_ && i < begin_ + size_t(n_)) continue;
      if (bits(store_[i]) != kGuardBits) return false;
    }
    return true;
  }

 private:
  static constexpr int64_t kGuard = 64;
  static constexpr uint32_t kGuardBits = 0x7fa5a5a5u;  // a NaN payload
  int64_t n_;
  std::vector<float> store_;
  size_t begin_ = 0;
};

// Memory between two inaccessible pages: an array placed flush against
// either of them faults at the first element read or written beyond it, so
// the process dies where the NaN guards of Guarded would only catch writes.
class PageGuarded {
 public:
  explicit PageGuarded(size_t bytes) {
    page_ = size_t(sysconf(_SC_PAGESIZE));
    span_ = (bytes + page_ - 1) / page_ * page_;
    void* m = mmap(nullptr, span_ + 2 * page_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
    if (m == MAP_FAILED) std::abort();
    base_ = static_cast<char*>(m);
    if (mprotect(base_, page_, PROT_NONE) != 0 ||
        mprotect(base_ + page_ + span_, page_, PROT_NONE) != 0)
      std::abort();
  }
  PageGuarded(const PageGuarded&) = delete;
  PageGuarded& operator=(const PageGuarded&) = delete;
  ~PageGuarded() { munmap(base_, span_ + 2 * page_); }
  // n elements right after the leading guard page, or right before the
  // trailing one.
  template <class T>
  T* place(int64_t n, bool at_end) {
    return at_end ? reinterpret_cast<T*>(base_ + page_ + span_) - n
                  : reinterpret_cast<T*>(base_ + page_);
  }

 private:
  size_t page_ = 0, span_ = 0;
  char* base_ = nullptr;
};

// Every length 1 .. 4W+1 (every tail a W-wide loop can leave, after zero to
// three full vectors: a 2W-wide unrolled loop's leftover vector too), then
// 8W+2, 1000 and 4099.
inline std::vector<int64_t> test_lengths(int width) {
  const int64_t w = width;
  std::vector<int64_t> out;
  for (int64_t n = 1; n <= 4 * w + 1; ++n) out.push_back(n);
  for (int64_t n : {8 * w + 2, int64_t(1000), int64_t(4099)})
    if (n > 4 * w + 1) out.push_back(n);
  return out;
}
// Offsets in floats from a 64-byte boundary: 0 .. 3, and for wider vectors
// one in the middle and the last (W/2 + 1, W - 1), deduplicated.
inline std::vector<int> test_offsets(int width) {
  std::vector<int> out = {0, 1, 2, 3};
  for (int off : {width / 2 + 1, width - 1})
    if (off > 3 && off != out.back()) out.push_back(off);
  return out;
}

// ---------------------------------------------------------------- inputs

enum class Pattern {
  normal,      // U(-10, 10)
  big_pos,     // U(90, 110): exp(s) overflows, exp(s - max) does not
  big_neg,     // U(-110, -90)
  huge,        // U(-1000, 1000)
  huge_pos,    // U(900, 1100)
  ties,        // integers 0..3: many ties of the max
  underflow,   // one 0, the rest U(-104, -86): exp(s - max) subnormal
  nan_first,   // normal, NaN at 0 and in the middle
  nan_middle,  // normal, NaN in the middle and at the end
  nan_last,    // normal, NaN at the end
  pinf,        // normal, +inf in the middle and at the end
  ninf,        // normal, -inf at the start, middle and end
  all_ninf,    // every s = -inf
  all_nan,     // every s = NaN
  nan_ninf,    // -inf everywhere but one NaN
  specials,    // normal with NaN, +inf and -inf
  zeros,       // -0, +0 and U(-3, 0) mixed: a max of either zero
};
constexpr Pattern kPatterns[] = {
    Pattern::normal,    Pattern::big_pos,   Pattern::big_neg,    Pattern::huge,
    Pattern::huge_pos,  Pattern::ties,      Pattern::underflow,  Pattern::nan_first,
    Pattern::nan_middle, Pattern::nan_last, Pattern::pinf,       Pattern::ninf,
    Pattern::all_ninf,  Pattern::all_nan,   Pattern::nan_ninf,   Pattern::specials,
    Pattern::zeros};

inline const char* pattern_name(Pattern p) {
  switch (p) {
    case Pattern::normal: return "normal";
    case Pattern::big_pos: return "big_pos";
    case Pattern::big_neg: return "big_neg";
    case Pattern::huge: return "huge";
    case Pattern::huge_pos: return "huge_pos";
    case Pattern::ties: return "ties";
    case Pattern::underflow: return "underflow";
    case Pattern::nan_first: return "nan_first";
    case Pattern::nan_middle: return "nan_middle";
    case Pattern::nan_last: return "nan_last";
    case Pattern::pinf: return "pinf";
    case Pattern::ninf: return "ninf";
    case Pattern::all_ninf: return "all_ninf";
    case Pattern::all_nan: return "all_nan";
    case Pattern::nan_ninf: return "nan_ninf";
    case Pattern::specials: return "specials";
    case Pattern::zeros: return "zeros";
  }
  return "?";
}

inline std::vector<float> make_values(Pattern p, int64_t n, Rng& rng) {
  std::vector<float> s(size_t(n), 0.0f);
  auto fill = [&](float lo, float hi) {
    for (auto& v : s) v = rng.uniform(lo, hi);
  };
  const int64_t mid = n / 2, last = n - 1;
  switch (p) {
    case Pattern::normal: fill(-10, 10); break;
    case Pattern::big_pos: fill(90, 110); break;
    case Pattern::big_neg: fill(-110, -90); break;
    case Pattern::huge: fill(-1000, 1000); break;
    case Pattern::huge_pos: fill(900, 1100); break;
    case Pattern::ties:
      for (auto& v : s) v = float(rng.below(4));
      break;
    case Pattern::underflow:
      fill(-104, -86);
      s[size_t(rng.below(n))] = 0;
      break;
    case Pattern::nan_first:
      fill(-10, 10);
      s[0] = kNaN;
      s[size_t(mid)] = kNaN;
      break;
    case Pattern::nan_middle:
      fill(-10, 10);
      s[size_t(mid)] = kNaN;
      s[size_t(last)] = kNaN;
      break;
    case Pattern::nan_last:
      fill(-10, 10);
      s[size_t(last)] = kNaN;
      break;
    case Pattern::pinf:
      fill(-10, 10);
      s[size_t(mid)] = kInf;
      s[size_t(last)] = kInf;
      break;
    case Pattern::ninf:
      fill(-10, 10);
      s[0] = -kInf;
      s[size_t(mid)] = -kInf;
      s[size_t(last)] = -kInf;
      break;
    case Pattern::all_ninf:
      for (auto& v : s) v = -kInf;
      break;
    case Pattern::all_nan:
      for (auto& v : s) v = kNaN;
      break;
    case Pattern::nan_ninf:
      for (auto& v : s) v = -kInf;
      s[size_t(mid)] = kNaN;
      break;
    case Pattern::specials:
      fill(-10, 10);
      s[size_t(rng.below(n))] = -kInf;
      s[size_t(rng.below(n))] = kInf;
      s[size_t(rng.below(n))] = kNaN;
      break;
    case Pattern::zeros:
      for (auto& v : s) {
        const int64_t pick = rng.below(3);
        v = pick == 0 ? -0.0f : pick == 1 ? 0.0f : rng.uniform(-3, 0);
      }
      break;
  }
  return s;
}

// Class weights U(0, 2) with some exact zeros (every 5th, and at s = -inf
// positions half of the time).
inline std::vector<float> make_class_weights(const std::vector<float>& s, Rng& rng) {
  std::vector<float> c(s.size());
  for (size_t i = 0; i < c.size(); ++i) {
    c[i] = rng.uniform(0, 2);
    if (i % 5 == 3 || (std::isinf(s[i]) && s[i] < 0 && (i & 1))) c[i] = 0;
  }
  return c;
}

// ---------------------------------------------------------------- exp

// Vector exp vs the reference element-wise (ulp distance <= 3: 2 ulp + 1 ulp,
// subnormal results included) with exact NaN / inf agreement, in place ==
// out of place, one element at a
// time == the whole array (no dependence on the position in the vector or
// the tail), guards intact.
inline void check_exp(const KernelSet& ks, const KernelSet& ref, Report& r) {
  Rng rng(1);
  const Pattern pats[] = {Pattern::normal, Pattern::big_pos, Pattern::big_neg, Pattern::huge,
                          Pattern::underflow, Pattern::specials, Pattern::nan_middle,
                          Pattern::ninf};
  for (int64_t n : test_lengths(ks.width))
    for (int off : test_offsets(ks.width))
      for (Pattern p : pats) {
        const auto x = make_values(p, n, rng);
        Guarded in(n, off), out(n, (off + 1) % 4), inplace(n, off);
        in.assign(x);
        inplace.assign(x);
        std::vector<float> y_ref(static_cast<size_t>(n));
        ref.exp(x.data(), y_ref.data(), n);
        ks.exp(in.data(), out.data(), n);
        ks.exp(inplace.data(), inplace.data(), n);
        const std::string where =
            format("%s exp n=%lld off=%d %s", ks.isa, (long long)n, off, pattern_name(p));
        r.expect(in.guards_intact() && out.guards_intact() && inplace.guards_intact(),
                 where + ": wrote outside [0, n)");
        r.expect(same_bits(in.values(), x), where + ": input modified");
        for (int64_t i = 0; i < n; ++i) {
          const float v = out[i], e = y_ref[size_t(i)];
          bool ok;
          if (std::isnan(e) || std::isnan(v)) ok = std::isnan(e) && std::isnan(v);
          else if (std::isinf(e) || std::isinf(v)) ok = v == e;
          else ok = ulp_distance(v, e) <= 3;
          if (!ok)
            r.fail(format("%s i=%lld: exp(%a) = %a, reference %a", where.c_str(), (long long)i,
                          x[size_t(i)], v, e));
          else r.pass();
          r.expect(same_or_both_nan(inplace[i], v), [&] {
            return format("%s i=%lld: in place %a != out of place %a", where.c_str(),
                          (long long)i, inplace[i], v);
          });
        }
        if (n <= 64) {
          for (int64_t i = 0; i < n; ++i) {
            float one;
            ks.exp(&x[size_t(i)], &one, 1);
            r.expect(same_or_both_nan(one, out[i]), [&] {
              return format("%s i=%lld: alone %a, in the array %a",
                            where.c_str(), (long long)i, one, out[i]);
            });
          }
        }
      }
}

// The accuracy checks' sweep: every `stride`-th f32 bit pattern (stride 1:
// every float), runs of 2000 consecutive floats on each side of each of
// `centers`, `extra` (more values), then +inf, -inf and NaN. fn(xs, n) gets
// them in chunks, so that stride 1 (2^32 values) needs no 16 GiB array.
constexpr uint32_t kSweepStride = 4099;  // the suite's; stride 1 measures every float
template <class Fn>
void for_each_sweep_chunk(uint32_t stride, const std::vector<float>& centers,
                          const std::vector<float>& extra, const Fn& fn) {
  constexpr size_t kChunk = size_t(1) << 20;
  std::vector<float> xs;
  xs.reserve(kChunk);
  const auto add = [&](float v) {
    xs.push_back(v);
    if (xs.size() == kChunk) fn(xs.data(), int64_t(xs.size())), xs.clear();
  };
  for (uint64_t b = 0; b < (1ull << 32); b += stride) add(from_bits(uint32_t(b)));
  for (float c : centers) {
    float v = c, w = c;
    for (int k = 0; k < 2000; ++k) {
      add(v);
      add(w);
      v = std::nextafter(v, kInf);
      w = std::nextafter(w, -kInf);
    }
  }
  for (float v : extra) add(v);
  for (float v : {kInf, -kInf, kNaN}) add(v);
  if (!xs.empty()) fn(xs.data(), int64_t(xs.size()));
}

// max ulp error of exp against double-precision exp over a sweep of the
// whole f32 range (subnormal results in ulps of 2^-149), exact NaN / inf
// behaviour. Deep in the subnormal range (exact result below 2^-130, at
// most 2^19 ulps) the relative error of p contributes < 2^19 * 2.4u = 0.08
// ulp, so a result rounded once must be within 0.6 ulp there.
inline void check_exp_accuracy(const KernelSet& ks, double max_ulp, Report& r,
                               double* measured = nullptr, uint32_t stride = kSweepStride) {
  double worst = 0;
  std::vector<float> ys;
  const std::vector<float> centers = {88.72284f, -87.33654f, -103.97208f, -103.27893f, 0.0f,
                                      0.34657359f, -0.34657359f, 1.0f, -1.0f};
  for_each_sweep_chunk(stride, centers, {}, [&](const float* xs, int64_t n) {
    ys.resize(size_t(n));
    ks.exp(xs, ys.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      const double e = std::exp(double(xs[i]));
      const float ef = float(e);
      const float y = ys[size_t(i)];
      bool ok;
      if (xs[i] == -kInf) ok = same_bits(y, 0.0f);  // +0, not -0
      else if (std::isnan(e) || std::isnan(y)) ok = std::isnan(e) && std::isnan(y);
      else if (std::isinf(ef) || std::isinf(y)) ok = y == ef;
      else {
        const double err = ulp_error(y, e);
        worst = err > worst ? err : worst;
        ok = err <= (e < 0x1p-130 ? 0.6 : max_ulp);
      }
      if (!ok) r.fail(format("%s exp(%a) = %a, exact %a", ks.isa, xs[i], y, e));
      else r.pass();
    }
  });
  float minus_inf = -kInf, y = 1.0f;  // alone too (a tail of one)
  ks.exp(&minus_inf, &y, 1);
  r.expect(same_bits(y, 0.0f), format("%s exp(-inf) = %a, not +0", ks.isa, y));
  if (measured) *measured = worst;
}

// max ulp error of tanh (scores with a = 1, k = 1) against double tanh.
// The quotient branch (|x| >= 0.625) is swept densely (every 5th float of
// [0.6, 10.5]): its error depends on the reciprocal's refinement.
inline void check_tanh_accuracy(const KernelSet& ks, double max_ulp, Report& r,
                                double* measured = nullptr, uint32_t stride = kSweepStride) {
  std::vector<float> dense;
  if (stride > 5)
    for (uint32_t b = bits(0.6f); b < bits(10.5f); b += 5) dense.push_back(from_bits(b));
  double worst = 0;
  std::vector<float> ys;
  const std::vector<float> centers = {0.625f, -0.625f, 0.0f, 9.0f, 10.0f, 0.17f, 1e-20f};
  for_each_sweep_chunk(stride, centers, dense, [&](const float* xs, int64_t n) {
    ys.assign(xs, xs + n);
    ks.scores(ys.data(), nullptr, n, 1.0f, 1.0f);
    for (int64_t i = 0; i < n; ++i) {
      const double e = std::tanh(double(xs[i]));
      const float y = ys[size_t(i)];
      bool ok;
      if (std::isnan(e) || std::isnan(y)) ok = std::isnan(e) && std::isnan(y);
      else {
        const double err = ulp_error(y, e);
        worst = err > worst ? err : worst;
        ok = err <= max_ulp && std::fabs(y) <= 1.0f;
      }
      if (!ok) r.fail(format("%s tanh(%a) = %a, exact %a", ks.isa, xs[i], y, e));
      else r.pass();
    }
  });
  float sat[4] = {kInf, -kInf, 1e30f, -0.0f};
  ks.scores(sat, nullptr, 4, 1.0f, 1.0f);
  r.expect(sat[0] == 1.0f && sat[1] == -1.0f && sat[2] == 1.0f && same_bits(sat[3], -0.0f),
           format("%s tanh(inf, -inf, 1e30, -0) = %a %a %a %a", ks.isa, sat[0], sat[1], sat[2],
                  sat[3]));
  if (measured) *measured = worst;
}

// ---------------------------------------------------------------- scores

// No softcap: bit-identical to the reference (the same two operations).
// Softcap: |v - r| <= 16u |r| + k 2^-147: the argument z/k vs z*(1/k) differs
// by <= 4u relative, tanh's condition number |x tanh'(x) / tanh(x)| <= 1
// carries that over, the two tanh are within 4u + 5u, times k adds u each.
inline void check_scores(const KernelSet& ks, const KernelSet& ref, Report& r) {
  Rng rng(2);
  const Pattern pats[] = {Pattern::normal, Pattern::big_pos, Pattern::huge,
                          Pattern::specials, Pattern::nan_first, Pattern::ninf};
  const float scales[] = {1.0f, 0.37f};
  const float caps[] = {0.0f, 1.0f, 30.0f};
  for (int64_t n : test_lengths(ks.width))
    for (int off : test_offsets(ks.width))
      for (Pattern p : pats)
        for (bool with_bias : {false, true})
          for (float a : scales)
            for (float k : caps) {
              const auto s = make_values(p, n, rng);
              std::vector<float> b(static_cast<size_t>(n));
              for (auto& v : b) v = rng.uniform(-2, 2);
              if (with_bias && n > 2) b[1] = kInf;  // inf + finite, inf + NaN, ...
              Guarded sv(n, off), bv(n, (off + 2) % 4);
              sv.assign(s);
              bv.assign(b);
              std::vector<float> sr = s;
              ref.scores(sr.data(), with_bias ? b.data() : nullptr, n, a, k);
              ks.scores(sv.data(), with_bias ? bv.data() : nullptr, n, a, k);
              const std::string where =
                  format("%s scores n=%lld off=%d %s bias=%d a=%g k=%g", ks.isa, (long long)n,
                         off, pattern_name(p), int(with_bias), a, k);
              r.expect(sv.guards_intact() && bv.guards_intact(), where + ": wrote outside [0, n)");
              r.expect(same_bits(bv.values(), b), where + ": bias modified");
              for (int64_t i = 0; i < n; ++i) {
                const float v = sv[i], e = sr[size_t(i)];
                bool ok;
                if (k == 0 || std::isnan(e) || std::isnan(v)) ok = same_or_both_nan(v, e);
                else ok = std::fabs(double(v) - e) <= 16 * kU * std::fabs(e) + k * 0x1p-147;
                if (!ok)
                  r.fail(format("%s i=%lld: s=%a b=%a -> %a, reference %a", where.c_str(),
                                (long long)i, s[size_t(i)], with_bias ? b[size_t(i)] : 0.0f, v, e));
                else r.pass();
              }
              if (n <= 64 && k > 0) {  // no dependence on the position
                for (int64_t i = 0; i < n; ++i) {
                  float one = s[size_t(i)];
                  ks.scores(&one, with_bias ? &b[size_t(i)] : nullptr, 1, a, k);
                  r.expect(same_or_both_nan(one, sv[i]), [&] {
                    return format("%s i=%lld: alone %a, in the array %a",
                                  where.c_str(), (long long)i, one, sv[i]);
                  });
                }
              }
            }
}

// ---------------------------------------------------------------- online_softmax

struct NamedState {
  const char* name;
  SoftmaxState st;
};

// Incoming states, placed relative to the tile (max m over non-NaN s, -inf
// if none; anchor = m if finite else 0) and its first column j0.
inline std::vector<NamedState> incoming_states(float m, int64_t j0, int64_t n) {
  const float anchor = std::isfinite(m) ? m : 0.0f;
  std::vector<NamedState> out;
  SoftmaxState fresh;
  softmax_state_init(&fresh);
  out.push_back({"fresh", fresh});
  out.push_back({"below", {anchor - 3.0f, 2.5f, -1.25f, 4.0f, j0 - 5, -1}});
  out.push_back({"above", {anchor + 3.0f, 1.5f, -0.7f, -2.0f, j0 - 9, -1}});
  out.push_back({"far_below", {anchor - 200.0f, 3.0f, -1.0f, 0.5f, j0 - 4, -1}});
  if (std::isfinite(m)) {
    out.push_back({"tie_before", {m, 1.0f, -0.5f, 1.0f, j0 - 1, -1}});
    out.push_back({"tie_after", {m, 1.0f, -0.5f, 1.0f, j0 + n + 10, -1}});
  }
  out.push_back({"ninf_seen", {-kInf, 0.0f, 0.0f, -kInf, j0 - 2, -1}});
  out.push_back({"nan_seen", {anchor - 1.0f, kNaN, kNaN, kNaN, j0 - 8, j0 - 7}});
  out.push_back({"nan_later", {anchor - 1.0f, kNaN, kNaN, kNaN, j0 - 8, j0 + n + 3}});
  out.push_back({"pinf", {kInf, kInf, kInf, 3.0f, j0 - 3, -1}});
  return out;
}

// The factor fold_tile rescales an old state's sums by when the max goes
// from m0 to mt: exp(shift(m0) - shift(mt)), 0 for m0 = -inf, 1 if unchanged.
inline float rescale_factor(float m0, float mt) {
  if (m0 == mt) return 1.0f;
  if (m0 == -kInf) return 0.0f;
  return std::exp((std::isfinite(m0) ? m0 : 0.0f) - (std::isfinite(mt) ? mt : 0.0f));
}

// Compares one sum: NaN <-> NaN, inf exactly, else within tol.
inline void expect_sum(Report& r, const std::string& where, const char* what, float v, float e,
                       double tol) {
  bool ok;
  if (std::isnan(e) || std::isnan(v)) ok = std::isnan(e) && std::isnan(v);
  else if (std::isinf(e) || std::isinf(v)) ok = v == e;
  else ok = std::fabs(double(v) - double(e)) <= tol;
  if (!ok)
    r.fail(format("%s: %s = %a (%.9g), reference %a (%.9g), tolerance %.3g", where.c_str(), what, v,
                  v, e, e, tol));
  else r.pass();
}

inline void check_online_softmax(const KernelSet& ks, const KernelSet& ref, Report& r) {
  Rng rng(3);
  const int64_t j0s[] = {0, 5000000000ll};  // the second needs 64-bit indices
  for (int64_t n : test_lengths(ks.width))
    for (int off : test_offsets(ks.width))
      for (Pattern p : kPatterns)
        for (bool with_cw : {false, true}) {
          const auto s = make_values(p, n, rng);
          const auto c = make_class_weights(s, rng);
          Guarded sv(n, off), cv(n, (off + 3) % 4);
          sv.assign(s);
          cv.assign(c);
          const float* cw_ref = with_cw ? c.data() : nullptr;
          const float* cw_vec = with_cw ? cv.data() : nullptr;
          float m = -kInf;
          for (float v : s) m = v > m ? v : m;
          const int64_t j0 = j0s[size_t(off) % 2];
          for (const NamedState& in : incoming_states(m, j0, n)) {
            // Only the fresh state at every offset; the rest at offsets 0, 1.
            if (off > 1 && std::string(in.name) != "fresh") continue;
            SoftmaxState sr = in.st, sk = in.st;
            ref.online_softmax(s.data(), cw_ref, n, j0, kSoftmaxAll, &sr);
            ks.online_softmax(sv.data(), cw_vec, n, j0, kSoftmaxAll, &sk);
            const std::string where =
                format("%s online_softmax n=%lld off=%d %s cw=%d j0=%lld state=%s", ks.isa,
                       (long long)n, off, pattern_name(p), int(with_cw), (long long)j0, in.name);
            r.expect(sv.guards_intact() && cv.guards_intact(), where + ": wrote outside [0, n)");
            r.expect(same_bits(sv.values(), s) && same_bits(cv.values(), c),
                     where + ": inputs modified");
            r.expect(bits(sk.max) == bits(sr.max),
                     format("%s: max %a, reference %a", where.c_str(), sk.max, sr.max));
            r.expect(sk.argmax == sr.argmax, format("%s: argmax %lld, reference %lld", where.c_str(),
                                                    (long long)sk.argmax, (long long)sr.argmax));
            r.expect(sk.first_nan == sr.first_nan,
                     format("%s: first_nan %lld, reference %lld", where.c_str(),
                            (long long)sk.first_nan, (long long)sr.first_nan));
            // Tolerances (see the top of the file), terms in double from the
            // same f32 arguments fl(s - shift) the kernels exponentiate.
            const float m0 = in.st.max, mt = m > m0 ? m : m0;
            const float shift = std::isfinite(mt) ? mt : 0.0f;
            double se = 0, sed = 0, scs = 0, dmax = 0;  // sums of |term|
            double xse = 0, xsed = 0, xscs = 0;         // exact sums of the terms
            for (int64_t i = 0; i < n; ++i) {
              const float si = s[size_t(i)];
              const float di = si - shift;
              const double e = std::exp(double(di));
              se += e;
              xse += e;
              if (e != 0) sed += std::fabs(e * di), xsed += e * di;
              const float ci = with_cw ? c[size_t(i)] : 1.0f;
              scs += std::fabs(double(ci) * si), xscs += double(ci) * si;  // 0 * inf: NaN
              if (std::isfinite(di)) dmax = std::fabs(di) > dmax ? std::fabs(di) : dmax;
            }
            const float f = rescale_factor(m0, mt);
            const double old_se = double(in.st.sum_exp * f);
            // The old sum_exp_d moved to the new shift: f (sum_exp_d + delta
            // sum_exp), 0 where f is; its three roundings join the tolerance.
            const double delta = double((std::isfinite(m0) ? m0 : 0.0f) - shift);
            const bool moved = m0 != mt;
            const double moved_terms = !moved || f == 0 ? 0.0
                : std::fabs(double(f) * in.st.sum_exp_d) + std::fabs(delta * f * in.st.sum_exp);
            const double old_sed = !moved ? double(in.st.sum_exp_d) : f == 0 ? 0.0 * in.st.sum_exp_d
                : double(f) * (double(in.st.sum_exp_d) + delta * double(in.st.sum_exp));
            const double old_scs = double(in.st.sum_cs);
            // (1) Against the reference: each side's terms and sum, and the
            // final addition on each side.
            const double g2 = 2 * gamma(n - 1);
            // exp: 4u + 2u; tail of subnormal terms: n 2^-148.
            const double tol_se =
                (6 * kU + g2) * se + 2 * kU * (std::fabs(old_se) + se) + n * kTiny;
            // e * d: exp 6u, the reference's product u.
            const double tol_sed = (7 * kU + g2) * sed + 2 * kU * (std::fabs(old_sed) + sed) +
                                   n * kTiny * dmax;
            // c * s: the product u on each side.
            const double tol_scs = (2 * kU + g2) * scs + 2 * kU * (std::fabs(old_scs) + scs);
            expect_sum(r, where, "sum_exp", sk.sum_exp, sr.sum_exp, tol_se);
            expect_sum(r, where, "sum_exp_d", sk.sum_exp_d, sr.sum_exp_d, tol_sed);
            expect_sum(r, where, "sum_cs", sk.sum_cs, sr.sum_cs, tol_scs);
            // (2) The set under test against the exact sums, with the height h
            // of its summation tree instead of n - 1 (a lane sums at most
            // ceil(n/W) terms, then the accumulators, log2 W horizontal steps
            // and the old state's sum): this catches a dropped or doubled
            // term that the reference's gamma_{n-1} could hide at large n.
            int64_t h = (n + ks.width - 1) / ks.width + 3;
            for (int w = ks.width; w > 1; w /= 2) ++h;
            const double gh = gamma(h);
            auto exact = [&](const char* what, float v, double old, double sum, double abs_sum,
                             double term_err, double slack) {
              const double total = old + sum;
              if (std::isnan(total)) {  // a NaN term: the sum must be NaN too
                r.expect(std::isnan(v), format("%s: %s = %.9g, exact NaN", where.c_str(), what, v));
                return;
              }
              if (!std::isfinite(total) || !std::isfinite(abs_sum)) return;
              const double tol = (term_err + gh) * abs_sum + 2 * kU * (std::fabs(old) + abs_sum) + slack;
              r.expect(std::fabs(double(v) - total) <= tol,
                       format("%s: %s = %.9g, exact %.9g, tolerance %.3g (tree height %lld)",
                              where.c_str(), what, v, total, tol, (long long)h));
            };
            exact("sum_exp", sk.sum_exp, old_se, xse, se, 4 * kU, n * kTiny);
            exact("sum_exp_d", sk.sum_exp_d, old_sed, xsed, sed, 5 * kU,
                  n * kTiny * dmax + 3 * kU * moved_terms);
            exact("sum_cs", sk.sum_cs, old_scs, xscs, scs, kU, 0.0);
          }
        }
}

// The kernels that walk one array (exp, scores, online_softmax, dlogits,
// pack and unpack; not gemm_tn, whose operands are matrices) on arrays that
// end against an inaccessible page, and on arrays that start right after
// one, with and without class weights: a read or write past either end (an
// unmasked tail load, say) kills the process instead of passing.
inline void check_reads_stay_inside(const KernelSet& ks, Report& r) {
  Rng rng(11);
  for (int64_t n : test_lengths(ks.width))
    for (bool at_end : {true, false}) {
      const auto s = make_values(Pattern::specials, n, rng);
      const auto c = make_class_weights(s, rng);
      PageGuarded sg(size_t(n) * 4), cg(size_t(n) * 4), og(size_t(n) * 4), dg(size_t(n) * 2);
      float* sv = sg.place<float>(n, at_end);
      float* cv = cg.place<float>(n, at_end);
      float* out = og.place<float>(n, at_end);
      uint16_t* codes = dg.place<uint16_t>(n, at_end);
      std::memcpy(sv, s.data(), size_t(n) * 4);
      std::memcpy(cv, c.data(), size_t(n) * 4);
      ks.exp(sv, out, n);
      const DlogitsParams q{2.0f, 0.5f, -0.01f, 0.2f, 0.5f, -0.4f, 1.25f, 7.0f};
      for (const float* weights : {static_cast<const float*>(cv), static_cast<const float*>(nullptr)}) {
        std::memcpy(out, s.data(), size_t(n) * 4);
        ks.scores(out, weights, n, 1.25f, 7.0f);
        SoftmaxState st;
        softmax_state_init(&st);
        ks.online_softmax(sv, weights, n, 0, kSoftmaxAll, &st);
        ks.dlogits(sv, weights, n, &q, out);
      }
      if (ks.pack_scores != nullptr) {
        ks.pack_scores(sv, n, 3.0f, codes);
        ks.unpack_scores(codes, n, 3.0f, out);
      }
      r.expect(std::memcmp(sv, s.data(), size_t(n) * 4) == 0 &&
                   std::memcmp(cv, c.data(), size_t(n) * 4) == 0,
               format("%s n=%lld %s: inputs modified", ks.isa, (long long)n,
                      at_end ? "against the end" : "after the start"));
    }
}

// online_softmax folds the same values into the same bits wherever they lie
// (every offset from a 64-byte boundary): a kernel that peeled its loop to
// an aligned address would sum in an order that depends on the address.
inline void check_online_softmax_offsets(const KernelSet& ks, Report& r) {
  Rng rng(12);
  for (int64_t n : test_lengths(ks.width))
    for (Pattern p : {Pattern::normal, Pattern::huge, Pattern::specials}) {
      const auto s = make_values(p, n, rng);
      const auto c = make_class_weights(s, rng);
      SoftmaxState first{};
      for (int off : test_offsets(ks.width)) {
        Guarded sv(n, off), cv(n, off);
        sv.assign(s);
        cv.assign(c);
        SoftmaxState st;
        softmax_state_init(&st);
        ks.online_softmax(sv.data(), cv.data(), n, 0, kSoftmaxAll, &st);
        if (off == 0) first = st;
        const bool same = bits(st.max) == bits(first.max) &&
                          bits(st.sum_exp) == bits(first.sum_exp) &&
                          bits(st.sum_exp_d) == bits(first.sum_exp_d) &&
                          bits(st.sum_cs) == bits(first.sum_cs) && st.argmax == first.argmax &&
                          st.first_nan == first.first_nan;
        r.expect(same, format("%s online_softmax n=%lld %s: offset %d folds to other bits than "
                              "offset 0 (sum_exp %a against %a)",
                              ks.isa, (long long)n, pattern_name(p), off, st.sum_exp,
                              first.sum_exp));
      }
    }
}

// Leaving SoftmaxExtras out (kernels.h): the max, sum_exp and first_nan keep
// the bits of the call with every extra; sum_exp_d and sum_cs keep theirs
// with kSoftmaxMoments and are the old state's, rescaled, without; argmax
// keeps its value with kSoftmaxArgmax and is the old state's without.
inline void check_online_softmax_extras(const KernelSet& ks, Report& r) {
  Rng rng(5);
  for (int64_t n : test_lengths(ks.width))
    for (Pattern p : kPatterns)
      for (bool with_cw : {false, true}) {
        const auto s = make_values(p, n, rng);
        const auto c = make_class_weights(s, rng);
        const float* cw = with_cw ? c.data() : nullptr;
        float m = -kInf;
        for (float v : s) m = v > m ? v : m;
        const int64_t j0 = 7;
        for (const NamedState& in : incoming_states(m, j0, n)) {
          SoftmaxState all = in.st;
          ks.online_softmax(s.data(), cw, n, j0, kSoftmaxAll, &all);
          for (unsigned extras : {0u, unsigned(kSoftmaxMoments), unsigned(kSoftmaxArgmax)}) {
            SoftmaxState got = in.st;
            ks.online_softmax(s.data(), cw, n, j0, extras, &got);
            const std::string where =
                format("%s online_softmax extras=%u n=%lld %s cw=%d state=%s", ks.isa, extras,
                       (long long)n, pattern_name(p), int(with_cw), in.name);
            r.expect(bits(got.max) == bits(all.max) && bits(got.sum_exp) == bits(all.sum_exp) &&
                         got.first_nan == all.first_nan,
                     where + ": max, sum_exp or first_nan differ from the call with every extra");
            // The old sums rescaled as fold_tile does, plus the tile's 0.
            const float m0 = in.st.max, mt = m > m0 ? m : m0, f = rescale_factor(m0, mt);
            const bool moments = extras & kSoftmaxMoments;
            const float delta = (std::isfinite(m0) ? m0 : 0.0f) - (std::isfinite(mt) ? mt : 0.0f);
            const float moved_sed = m0 == mt ? in.st.sum_exp_d
                                    : f == 0 ? in.st.sum_exp_d * f
                                    : std::fma(f, in.st.sum_exp_d, delta * (f * in.st.sum_exp));
            const float want_sed = moments ? all.sum_exp_d : moved_sed + 0.0f;
            const float want_scs = moments ? all.sum_cs : in.st.sum_cs + 0.0f;
            auto same = [](float a, float b) { return bits(a) == bits(b) || (a != a && b != b); };
            r.expect(same(got.sum_exp_d, want_sed) && same(got.sum_cs, want_scs),
                     format("%s: sum_exp_d %a sum_cs %a, expected %a %a", where.c_str(),
                            got.sum_exp_d, got.sum_cs, want_sed, want_scs));
            const int64_t want_arg = (extras & kSoftmaxArgmax) ? all.argmax : in.st.argmax;
            r.expect(got.argmax == want_arg, format("%s: argmax %lld, expected %lld", where.c_str(),
                                                    (long long)got.argmax, (long long)want_arg));
          }
        }
      }
}

// The reference itself against double precision on a few rows: max, argmax,
// first_nan, lse = max + log(sum_exp) when folded tile by tile.
inline void check_softmax_semantics(const KernelSet& ks, Report& r) {
  Rng rng(4);
  for (Pattern p : kPatterns) {
    const int64_t n = 1000;
    const auto s = make_values(p, n, rng);
    SoftmaxState st;
    softmax_state_init(&st);
    for (int64_t j = 0; j < n; j += 300) {
      const int64_t len = n - j < 300 ? n - j : 300;
      ks.online_softmax(s.data() + j, nullptr, len, j, kSoftmaxAll, &st);
    }
    // Expected, in double.
    double m = -INFINITY;
    int64_t am = -1, fn = -1;
    for (int64_t i = 0; i < n; ++i) {
      const float v = s[size_t(i)];
      if (std::isnan(v)) {
        if (fn < 0) fn = i;
        continue;
      }
      if (am < 0 || v > m) m = v, am = i;
    }
    const double shift = std::isfinite(m) ? m : 0.0;
    double se = 0;
    for (float v : s) se += std::exp(double(v) - shift);
    const std::string where = format("%s semantics %s", ks.isa, pattern_name(p));
    r.expect(double(st.max) == m, format("%s: max %a, expected %a", where.c_str(), st.max, m));
    r.expect(st.argmax == am, format("%s: argmax %lld, expected %lld", where.c_str(),
                                     (long long)st.argmax, (long long)am));
    r.expect(st.first_nan == fn, format("%s: first_nan %lld, expected %lld", where.c_str(),
                                        (long long)st.first_nan, (long long)fn));
    const double lse = shift + std::log(double(st.sum_exp));
    const double lse_exact = shift + std::log(se);
    bool ok;
    if (std::isnan(lse_exact) || std::isnan(lse)) ok = std::isnan(lse_exact) && std::isnan(lse);
    else if (std::isinf(lse_exact) || std::isinf(lse)) ok = lse == lse_exact;
    else ok = std::fabs(lse - lse_exact) <= 1e-5 * (1 + std::fabs(lse_exact));
    r.expect(ok, format("%s: lse %.9g, expected %.9g", where.c_str(), lse, lse_exact));
  }
}

// ---------------------------------------------------------------- dlogits

struct DlogitsCase {
  const char* name;
  DlogitsParams q;
};

inline std::vector<DlogitsCase> dlogits_cases(const std::vector<float>& s, Rng& rng) {
  double m = -INFINITY;
  for (float v : s)
    if (v > m) m = v;
  double se = 0;
  const double shift = std::isfinite(m) ? m : 0.0;
  for (float v : s)
    if (!std::isnan(v)) se += std::exp(double(v) - shift);
  const float lse = float(shift + std::log(se));
  auto coef = [&] { return rng.uniform(-2, 2); };
  std::vector<DlogitsCase> out;
  // name, {lse, coef_p, coef_c, coef_h, shift, sbar_d, scale, softcap}; the
  // entropy's shift the row's max (where finite), as the backends pass it.
  const float m_f = float(shift);
  out.push_back({"plain", {lse, coef(), 0.0f, 0.0f, 0.0f, 0.0f, 1.0f, 0.0f}});
  out.push_back({"smooth", {lse, coef(), coef(), 0.0f, 0.0f, 0.0f, 0.7f, 0.0f}});
  out.push_back({"entropy", {lse, coef(), 0.0f, coef(), m_f, rng.uniform(-3, 3), 1.0f, 0.0f}});
  out.push_back({"all", {lse, coef(), coef(), coef(), m_f, rng.uniform(-3, 3), 1.3f, 0.0f}});
  out.push_back({"cap", {lse, coef(), 0.0f, 0.0f, 0.0f, 0.0f, 1.0f, 30.0f}});
  out.push_back({"all_cap", {lse, coef(), coef(), coef(), m_f, rng.uniform(-3, 3), 0.5f, 15.0f}});
  out.push_back({"shifted_lse", {lse + 3.0f, coef(), coef(), coef(), m_f, 1.0f, 1.0f, 0.0f}});
  // As the backends pass a row whose max is not finite: shift = lse, sbar_d
  // NaN (the p == 0 terms still 0).
  const bool finite = std::isfinite(m);
  out.push_back({"entropy_as_passed",
                 {lse, coef(), 0.0f, coef(), finite ? m_f : lse, finite ? -1.5f : NAN, 1.0f, 0.0f}});
  return out;
}

// Element bound (see the top of the file), with p = exp(fl(s - lse)) exact:
//   A = coef_p p: exp 6u + mul 2u;  B = coef_c c: 2u;
//   C = coef_h p ((s - shift) - sbar_d): exp 6u + sub, mul, mul 6u, and the
//   inner sub's u |s - shift| relative to the difference's size: 2u |C_s|,
//   C_s = coef_h p (s - shift);  two adds: 4u on all.
//   => |d_v - d_r| <= 16u (|A| + |B| + |C| + |C_s|) =: ed (+ the subnormal
//   slack: p's own, and 2^-150 per rounding once d is subnormal; |a dz|
//   scales both).
//   t = s/k vs s * (1/k): 4u |t|; 1 - t^2: 2|t| 4u|t| + 2u t^2 + 2u |1 - t^2|.
//   g = a dz d: |a| (|dz| ed + |d| edz) + 4u |a dz d|.
inline double dlogits_tolerance(float s, float c, const DlogitsParams& q) {
  const float x = s - q.lse;
  const double p = std::exp(double(x));
  const double A = double(q.coef_p) * p;
  const double B = q.coef_c != 0 ? double(q.coef_c) * c : 0.0;
  const bool h = q.coef_h != 0 && p != 0;
  const double s_d = double(s) - q.shift, h_diff = s_d - q.sbar_d;
  const double C = h ? double(q.coef_h) * p * h_diff : 0.0;
  const double C_s = h ? double(q.coef_h) * p * s_d : 0.0;
  const double d = A + B - C;
  const double ed = 16 * kU * (std::fabs(A) + std::fabs(B) + std::fabs(C) + std::fabs(C_s)) +
                    kTiny * std::fabs(q.coef_p) +
                    (q.coef_h != 0 && std::isfinite(h_diff)
                         ? kTiny * std::fabs(q.coef_h) * std::fabs(h_diff)
                         : 0.0) +
                    0x1p-147;  // the roundings of d when it is subnormal, 2^-150 each
  double dz = 1, edz = 0;
  if (q.softcap > 0) {
    const double t = double(s) / q.softcap;
    dz = 1 - t * t;
    edz = 12 * kU * t * t + 2 * kU * std::fabs(dz);
  }
  const double a = std::fabs(q.scale);
  return a * (std::fabs(dz) * ed + std::fabs(d) * edz) + 4 * kU * a * std::fabs(dz * d) + 1e-44;
}

inline void check_dlogits(const KernelSet& ks, const KernelSet& ref, Report& r) {
  Rng rng(5);
  const Pattern pats[] = {Pattern::normal, Pattern::big_pos, Pattern::big_neg, Pattern::huge,
                          Pattern::underflow, Pattern::ties, Pattern::nan_middle, Pattern::pinf,
                          Pattern::ninf, Pattern::specials, Pattern::all_ninf};
  for (int64_t n : test_lengths(ks.width))
    for (int off : test_offsets(ks.width))
      for (Pattern p : pats)
        for (bool with_cw : {false, true}) {
          const auto s = make_values(p, n, rng);
          const auto c = make_class_weights(s, rng);
          for (const DlogitsCase& dc : dlogits_cases(s, rng)) {
            const DlogitsParams& q = dc.q;
            Guarded sv(n, off), cv(n, (off + 1) % 4), gv(n, (off + 2) % 4), inplace(n, off);
            sv.assign(s);
            cv.assign(c);
            inplace.assign(s);
            std::vector<float> gr(static_cast<size_t>(n));
            ref.dlogits(s.data(), with_cw ? c.data() : nullptr, n, &q, gr.data());
            ks.dlogits(sv.data(), with_cw ? cv.data() : nullptr, n, &q, gv.data());
            ks.dlogits(inplace.data(), with_cw ? cv.data() : nullptr, n, &q, inplace.data());
            const std::string where =
                format("%s dlogits n=%lld off=%d %s cw=%d %s", ks.isa, (long long)n, off,
                       pattern_name(p), int(with_cw), dc.name);
            r.expect(sv.guards_intact() && cv.guards_intact() && gv.guards_intact() &&
                         inplace.guards_intact(),
                     where + ": wrote outside [0, n)");
            r.expect(same_bits(sv.values(), s) && same_bits(cv.values(), c),
                     where + ": inputs modified");
            for (int64_t i = 0; i < n; ++i) {
              const float v = gv[i], e = gr[size_t(i)];
              bool ok;
              if (std::isnan(e) || std::isnan(v)) ok = std::isnan(e) && std::isnan(v);
              else if (std::isinf(e) || std::isinf(v)) ok = v == e;
              else
                ok = std::fabs(double(v) - e) <=
                     dlogits_tolerance(s[size_t(i)], with_cw ? c[size_t(i)] : 1.0f, q);
              if (!ok)
                r.fail(format("%s i=%lld: s=%a -> %a, reference %a, tolerance %.3g", where.c_str(),
                              (long long)i, s[size_t(i)], v, e,
                              dlogits_tolerance(s[size_t(i)], with_cw ? c[size_t(i)] : 1.0f, q)));
              else r.pass();
              r.expect(same_or_both_nan(inplace[i], v), [&] {
                return format("%s i=%lld: in place %a, out of place %a",
                              where.c_str(), (long long)i, inplace[i], v);
              });
            }
            if (n <= 64) {
              for (int64_t i = 0; i < n; ++i) {
                float one;
                ks.dlogits(&s[size_t(i)], with_cw ? &c[size_t(i)] : nullptr, 1, &q, &one);
                r.expect(same_or_both_nan(one, gv[i]), [&] {
                  return format("%s i=%lld: alone %a, in the array %a",
                                where.c_str(), (long long)i, one, gv[i]);
                });
              }
            }
          }
        }
}

// ---------------------------------------------------------------- dispatch

// kernels_for_cap and best_kernels on this machine (any architecture).
inline void check_dispatch(Report& r) {
  const KernelSet& sc = scalar_kernels();
  r.expect(std::string(sc.isa) == "scalar" && sc.width == 1, "scalar set: wrong isa/width");
  const KernelSet* a2 = avx2_kernels();
  const KernelSet* a5 = avx512_kernels();
  const KernelSet* ne = neon_kernels();
  r.expect(!a2 || (std::string(a2->isa) == "avx2" && a2->width == 8), "avx2 set: wrong isa/width");
  r.expect(!a5 || (std::string(a5->isa) == "avx512" && a5->width == 16),
           "avx512 set: wrong isa/width");
  r.expect(!ne || (std::string(ne->isa) == "neon" && ne->width == 4), "neon set: wrong isa/width");
  for (const KernelSet* k : {&sc, a2, a5, ne})
    r.expect(!k || (k->exp && k->scores && k->online_softmax && k->dlogits),
             format("%s set: a null kernel", k ? k->isa : "?"));
#if defined(__aarch64__)
  const KernelSet* best = ne ? ne : &sc;
  r.expect(&kernels_for_cap("neon") == best, "cap neon");
  r.expect(&kernels_for_cap("NEON") == best, "cap NEON (case-insensitive)");
  r.expect(&kernels_for_cap("avx2") == best, "cap avx2 on arm: ignored");
#else
  const KernelSet* best = a5 ? a5 : a2 ? a2 : &sc;
  r.expect(&kernels_for_cap("avx512") == best, "cap avx512");
  r.expect(&kernels_for_cap("AVX512") == best, "cap AVX512 (case-insensitive)");
  r.expect(&kernels_for_cap("avx2") == (a2 ? a2 : &sc),
           format("cap avx2 gave %s", kernels_for_cap("avx2").isa));
  r.expect(&kernels_for_cap("neon") == best, "cap neon on x86: ignored");
#endif
  r.expect(&kernels_for_cap("scalar") == &sc,
           format("cap scalar gave %s", kernels_for_cap("scalar").isa));
  r.expect(&kernels_for_cap(nullptr) == best, "no cap");
  r.expect(&kernels_for_cap("") == best, "empty cap");
  r.expect(&kernels_for_cap("bogus") == best, "unknown cap: ignored");
  const char* env = std::getenv("FLCE_MAX_ISA");
  r.expect(&best_kernels() == &kernels_for_cap(env),
           format("best_kernels() = %s, FLCE_MAX_ISA=%s", best_kernels().isa, env ? env : "(unset)"));
  r.expect(&best_kernels() == &best_kernels(), "best_kernels() not stable");
  SoftmaxState st{1, 2, 3, 4, 5, 6};
  softmax_state_init(&st);
  r.expect(st.max == -kInf && st.sum_exp == 0 && st.sum_exp_d == 0 && st.sum_cs == 0 &&
               st.argmax == -1 && st.first_nan == -1,
           "softmax_state_init");
}

}  // namespace flce::simd::testing
