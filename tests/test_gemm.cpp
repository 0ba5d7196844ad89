// Tests for cpu/gemm: every compiled-in engine against a double-precision
// product under a derived error bound, over all transposes, padded leading
// dimensions, beta 0 and 1, odd sizes and both input dtypes; the degenerate
// sizes and argument checks; concurrent calls (bitwise equal to sequential
// ones); and that an engine computes on the calling thread only.
//
// The bound. The engines accumulate in f32. An entry of op(A) op(B) is a sum
// of k products; computed in any order (blocked, split over k, with or
// without FMA) each product passes through at most k roundings, so
//   |c - c_exact| <= gamma_k(u) * sum_p |a_ip| |b_pj|,
//   gamma_k(u) = k u / (1 - k u), u = 2^-24 (Higham, Accuracy and Stability
// of Numerical Algorithms, 2nd ed., section 3.5). With beta != 0 the old C is
// one more term of the sum, each term then sees at most k + 1 roundings:
//   |c - c_exact| <= gamma_{k+1}(u) * (|beta c0| + sum_p |a_ip| |b_pj|).
// For bf16 inputs the same holds with a and b the bf16 values: the product of
// two 8-bit significands fits in f32's 24 bits, so the products are exact and
// only the f32 accumulation rounds. The reference is computed in double from
// the same values, and its own error (gamma_{k+1}(2^-53) times the same sum)
// is added to the bound. Values are drawn from +-[1/16, 1] so nothing is
// subnormal (oneDNN's bf16 kernels flush subnormals to zero).
#include <gtest/gtest.h>
#include <omp.h>
#include <sys/resource.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/float16.h"
#include "cpu/gemm/gemm.h"
#include "support/bf16_widening_engine.h"

namespace {

using flce::Dtype;
using flce::cpu::GemmArgs;
using flce::cpu::GemmEngine;

const float kSentinel = 12345.0f;  // in C's padding; must survive every call

double gamma_n(int64_t n, double u) { return double(n) * u / (1.0 - double(n) * u); }

// A stored row-major matrix of `rows` x `cols` with leading dimension ld >
// cols. Padding holds NaN so that an engine that used it would show NaN.
struct Stored {
  int64_t rows = 0, cols = 0, ld = 0;
  Dtype dtype = Dtype::f32;
  std::vector<float> f32;      // when dtype == f32
  std::vector<uint16_t> bf16;  // when dtype == bf16
  std::vector<double> value;   // the element values, rows x cols, dense

  const void* data() const {
    return dtype == Dtype::f32 ? static_cast<const void*>(f32.data())
                               : static_cast<const void*>(bf16.data());
  }
  double at(int64_t r, int64_t c) const { return value[size_t(r * cols + c)]; }
};

float draw(std::mt19937_64& rng) {
  std::uniform_real_distribution<float> mag(1.0f / 16.0f, 1.0f);
  std::bernoulli_distribution neg(0.5);
  float v = mag(rng);
  return neg(rng) ? -v : v;
}

Stored make_stored(int64_t rows, int64_t cols, int64_t pad, Dtype dtype, std::mt19937_64& rng) {
  Stored s;
  s.rows = rows;
  s.cols = cols;
  s.ld = cols + pad;
  s.dtype = dtype;
  size_t total = size_t(std::max<int64_t>(rows * s.ld, 1));
  s.value.assign(size_t(rows * cols), 0.0);
  if (dtype == Dtype::f32) {
    s.f32.assign(total, std::numeric_limits<float>::quiet_NaN());
  } else {
    s.bf16.assign(total, flce::f32_to_bf16(std::numeric_limits<float>::quiet_NaN()));
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      float v = draw(rng);
      size_t i = size_t(r * s.ld + c);
      if (dtype == Dtype::f32) {
        s.f32[i] = v;
        s.value[size_t(r * cols + c)] = v;
      } else {
        uint16_t bits = flce::f32_to_bf16(v);
        s.bf16[i] = bits;
        s.value[size_t(r * cols + c)] = flce::bf16_to_f32(bits);
      }
    }
  }
  return s;
}

// One product: the operands as stored, C's initial contents, and the call.
struct Problem {
  int64_t m, n, k;
  bool trans_a, trans_b;
  float beta;
  Dtype dtype;
  Stored a, b;
  int64_t ldc;
  std::vector<float> c0;  // initial C, ldc-padded, padding = kSentinel

  GemmArgs args(float* c) const {
    GemmArgs g;
    g.m = m;
    g.n = n;
    g.k = k;
    g.ab_dtype = dtype;
    g.a = a.data();
    g.lda = a.ld;
    g.trans_a = trans_a;
    g.b = b.data();
    g.ldb = b.ld;
    g.trans_b = trans_b;
    g.c = c;
    g.ldc = ldc;
    g.beta = beta;
    return g;
  }
  double op_a(int64_t i, int64_t p) const { return trans_a ? a.at(p, i) : a.at(i, p); }
  double op_b(int64_t p, int64_t j) const { return trans_b ? b.at(j, p) : b.at(p, j); }
};

Problem make_problem(int64_t m, int64_t n, int64_t k, bool trans_a, bool trans_b, float beta,
                     Dtype dtype, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Problem p{m, n, k, trans_a, trans_b, beta, dtype, {}, {}, 0, {}};
  // Different paddings per operand, so no engine can confuse the three.
  p.a = trans_a ? make_stored(k, m, 3, dtype, rng) : make_stored(m, k, 3, dtype, rng);
  p.b = trans_b ? make_stored(n, k, 5, dtype, rng) : make_stored(k, n, 5, dtype, rng);
  p.ldc = n + 7;
  p.c0.assign(size_t(std::max<int64_t>(m * p.ldc, 1)), kSentinel);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j)
      // beta == 0: C is write-only, so start from NaN to prove it is not read.
      p.c0[size_t(i * p.ldc + j)] =
          beta == 0.0f ? std::numeric_limits<float>::quiet_NaN() : draw(rng);
  return p;
}

std::string describe(const GemmEngine* e, const Problem& p);

// The double-precision product and the error bound of each entry of C.
struct Reference {
  std::vector<double> exact, bound;  // m x n, dense
};

Reference reference(const Problem& p) {
  const double u32 = std::ldexp(1.0, -24), u64 = std::ldexp(1.0, -53);
  Reference r;
  r.exact.assign(size_t(p.m * p.n), 0.0);
  r.bound.assign(size_t(p.m * p.n), 0.0);
  for (int64_t i = 0; i < p.m; ++i) {
    for (int64_t j = 0; j < p.n; ++j) {
      double exact = 0.0, abs_sum = 0.0;
      for (int64_t q = 0; q < p.k; ++q) {
        double t = p.op_a(i, q) * p.op_b(q, j);
        exact += t;
        abs_sum += std::fabs(t);
      }
      int64_t terms = p.k;
      if (p.beta != 0.0f) {
        double c0 = double(p.beta) * double(p.c0[size_t(i * p.ldc + j)]);
        exact += c0;
        abs_sum += std::fabs(c0);
        terms += 1;
      }
      r.exact[size_t(i * p.n + j)] = exact;
      r.bound[size_t(i * p.n + j)] = (gamma_n(terms, u32) + gamma_n(terms, u64)) * abs_sum;
    }
  }
  return r;
}

// Checks `c` (an engine's result) against the reference and its bound, and
// that C's padding is untouched. Returns the number of bad entries (the first
// few reported through gtest).
int check_result(const Problem& p, const Reference& ref, const std::vector<float>& c,
                 const std::string& what) {
  int bad = 0;
  for (int64_t i = 0; i < p.m; ++i) {
    for (int64_t j = 0; j < p.ldc; ++j) {
      float got = c[size_t(i * p.ldc + j)];
      if (j >= p.n) {
        if (!(got == kSentinel) && bad++ < 3)
          ADD_FAILURE() << what << ": C padding written at (" << i << ", " << j << ")";
        continue;
      }
      double exact = ref.exact[size_t(i * p.n + j)], bound = ref.bound[size_t(i * p.n + j)];
      double err = std::fabs(double(got) - exact);
      if (!(err <= bound) && bad++ < 3)
        ADD_FAILURE() << what << ": C(" << i << ", " << j << ") = " << got << ", exact "
                      << exact << ", |err| " << err << " > bound " << bound;
    }
  }
  return bad;
}

// Runs every engine that takes `p.dtype` on `p` and checks each result.
// Returns how many engines failed.
int check_all_engines(const Problem& p) {
  Reference ref = reference(p);
  int failed = 0;
  for (const GemmEngine* e : flce::cpu::gemm_engines()) {
    if (!e->supports(p.dtype)) continue;
    std::vector<float> c = p.c0;
    e->run(p.args(c.data()));
    failed += check_result(p, ref, c, describe(e, p)) > 0;
  }
  return failed;
}

std::string describe(const GemmEngine* e, const Problem& p) {
  return std::string(e->name()) + " " + flce::dtype_name(p.dtype) + " m=" + std::to_string(p.m) +
         " n=" + std::to_string(p.n) + " k=" + std::to_string(p.k) +
         (p.trans_a ? " A^T" : " A") + (p.trans_b ? " B^T" : " B") +
         " beta=" + std::to_string(int(p.beta));
}

std::vector<float> run_once(const GemmEngine* e, const Problem& p) {
  std::vector<float> c = p.c0;
  e->run(p.args(c.data()));
  return c;
}

std::vector<Dtype> dtypes_of(const GemmEngine* e) {
  std::vector<Dtype> d{Dtype::f32};
  if (e->supports(Dtype::bf16)) d.push_back(Dtype::bf16);
  return d;
}

TEST(GemmRegistry, EnginesCompiledIn) {
  const auto& engines = flce::cpu::gemm_engines();
  ASSERT_FALSE(engines.empty());
  for (const GemmEngine* e : engines) {
    EXPECT_EQ(flce::cpu::find_gemm_engine(e->name()), e);
    EXPECT_TRUE(e->supports(Dtype::f32)) << e->name();
    EXPECT_FALSE(e->supports(Dtype::f64)) << e->name();
    std::printf("[          ] engine %s\n", e->describe().c_str());
  }
  EXPECT_NE(flce::cpu::find_gemm_engine("eigen"), nullptr);
#ifdef FLCE_HAVE_OPENBLAS
  EXPECT_NE(flce::cpu::find_gemm_engine("openblas"), nullptr);
#endif
#ifdef FLCE_HAVE_ONEDNN
  EXPECT_NE(flce::cpu::find_gemm_engine("onednn"), nullptr);
#endif
  EXPECT_EQ(flce::cpu::find_gemm_engine("no-such-engine"), nullptr);
  const GemmEngine* f32 = flce::cpu::default_gemm_engine(Dtype::f32);
  ASSERT_NE(f32, nullptr);
  EXPECT_TRUE(f32->supports(Dtype::f32));
  const GemmEngine* bf16 = flce::cpu::default_gemm_engine(Dtype::bf16);
  if (bf16 != nullptr) {
    EXPECT_TRUE(bf16->supports(Dtype::bf16));
  }
  bool any_bf16 = false;
  for (const GemmEngine* e : engines) any_bf16 = any_bf16 || e->supports(Dtype::bf16);
  EXPECT_EQ(bf16 != nullptr, any_bf16);
}

std::vector<Dtype> tested_dtypes() {
  std::vector<Dtype> d{Dtype::f32};
  for (const GemmEngine* e : flce::cpu::gemm_engines())
    if (e->supports(Dtype::bf16)) return {Dtype::f32, Dtype::bf16};
  return d;
}

// Every (m, n, k) in sizes^3, with every transpose pair and beta 0 and 1:
// 8 |sizes|^3 problems of one dtype, seeds counting up from first_seed.
std::vector<Problem> odd_size_problems(const std::vector<int64_t>& sizes, Dtype dtype,
                                       uint64_t first_seed) {
  std::vector<Problem> problems;
  uint64_t seed = first_seed;
  for (int64_t m : sizes)
    for (int64_t n : sizes)
      for (int64_t k : sizes)
        for (int t = 0; t < 4; ++t)
          for (float beta : {0.0f, 1.0f})
            problems.push_back(make_problem(m, n, k, t & 1, t & 2, beta, dtype, seed++));
  return problems;
}

// Every size in {1, 3, 17, 65}^3, every transpose pair, beta 0 and 1.
TEST(GemmAccuracy, OddSizesAllTransposes) {
  for (Dtype dtype : tested_dtypes()) {
    int failures = 0;
    for (const Problem& p : odd_size_problems({1, 3, 17, 65}, dtype, 1)) {
      failures += check_all_engines(p);
      if (failures > 5) FAIL() << "too many failures, stopping";
    }
  }
}

// The shapes the cpu backend uses, and some that are not multiples of any
// kernel's blocking: logits tile (trans_b, W stored [V, H]), grad_x, grad_W.
TEST(GemmAccuracy, BackendShapes) {
  struct Shape {
    int64_t m, n, k;
    bool ta, tb;
    float beta;
  };
  const Shape shapes[] = {
      {64, 256, 768, false, true, 0.0f},   // logits = x W^T
      {64, 768, 256, false, false, 1.0f},  // grad_x += dlogits W
      {256, 768, 64, true, false, 1.0f},   // grad_W += dlogits^T x
      {100, 300, 257, false, true, 0.0f},  {129, 65, 513, true, true, 1.0f},
      {33, 1000, 130, true, false, 0.0f},  {250, 17, 1025, false, false, 1.0f},
  };
  uint64_t seed = 1000;
  for (Dtype dtype : tested_dtypes())
    for (const Shape& s : shapes)
      check_all_engines(make_problem(s.m, s.n, s.k, s.ta, s.tb, s.beta, dtype, seed++));
}

// The bf16 engine that the cpu suite runs with where no engine here has
// bf16 (FLCE_TEST_KERNELS, support/bf16_widening_engine.h) meets the same
// bound: sizes in {1, 17, 65}^3, every transpose pair, beta 0 and 1.
TEST(GemmAccuracy, TheTestsBf16WideningEngine) {
  const flce_test::Bf16WideningEngine engine(flce::cpu::default_gemm_engine(Dtype::f32));
  for (const Problem& p : odd_size_problems({1, 17, 65}, Dtype::bf16, 500))
    ASSERT_EQ(check_result(p, reference(p), run_once(&engine, p), describe(&engine, p)), 0);
}

// A beta other than 0 and 1 (not used by the backend, but part of the
// contract), also with k == 0.
TEST(GemmAccuracy, OtherBeta) {
  for (Dtype dtype : tested_dtypes()) {
    check_all_engines(make_problem(37, 45, 29, false, true, 0.5f, dtype, 77));
    check_all_engines(make_problem(37, 45, 0, true, false, -2.0f, dtype, 78));
  }
}

// B packed once (GemmEngine::pack_b) for grad_W's tile products: A^T with
// lda = m, as the cpu backend calls them (Workspace::g16_tiles). Where an
// engine packs a shape, the packed call must give the plain call's bits (it
// only reorders B) and stay within the bound; f32 is never packed.
TEST(GemmPackedB, SameBitsAsPlainCalls) {
  struct Shape {
    int64_t m, n, k;
  };
  const Shape shapes[] = {{512, 768, 496}, {512, 100, 33}, {512, 256, 1024}, {64, 300, 17}};
  int packed_calls = 0;
  uint64_t seed = 4000;
  for (const GemmEngine* e : flce::cpu::gemm_engines()) {
    if (!e->supports(Dtype::bf16)) continue;
    for (const Shape& s : shapes)
      for (float beta : {0.0f, 1.0f}) {
        Problem p = make_problem(s.m, s.n, s.k, true, false, beta, Dtype::bf16, seed++);
        std::mt19937_64 rng(seed);
        p.a = make_stored(s.k, s.m, 0, Dtype::bf16, rng);  // lda = m, as the backend's tiles
        GemmArgs f32_shape = p.args(nullptr);
        f32_shape.ab_dtype = Dtype::f32;
        EXPECT_EQ(e->packed_b_bytes(f32_shape), 0u) << describe(e, p);
        std::vector<float> plain = p.c0, packed = p.c0;
        GemmArgs g = p.args(plain.data());
        const size_t bytes = e->packed_b_bytes(g);
        if (bytes == 0) continue;
        e->run(g);
        std::vector<uint16_t> b(bytes / 2 + 1);
        e->pack_b(g, b.data());
        g.c = packed.data();
        g.b = b.data();
        g.b_packed = true;
        e->run(g);
        ++packed_calls;
        EXPECT_EQ(check_result(p, reference(p), packed, describe(e, p) + " packed B"), 0);
        EXPECT_EQ(0, std::memcmp(plain.data(), packed.data(), plain.size() * 4)) << describe(e, p);
      }
  }
  if (packed_calls == 0)
    GTEST_SKIP() << "no engine packs B on this machine (oneDNN does with AMX: "
                    "GemmEngine::bf16_on_matrix_unit)";
}

// An engine that does not pack says so rather than running a packed call.
TEST(GemmPackedB, EnginesThatDoNotPackRefuse) {
  for (const GemmEngine* e : flce::cpu::gemm_engines()) {
    Problem p = make_problem(64, 32, 16, true, false, 0.0f, Dtype::f32, 99);
    std::vector<float> c = p.c0;
    GemmArgs g = p.args(c.data());
    std::vector<float> packed(64 * 64);
    if (e->packed_b_bytes(g) == 0) {
      EXPECT_THROW(e->pack_b(g, packed.data()), std::invalid_argument) << e->name();
    }
  }
}

// k == 0: C = beta * C (zeros for beta == 0, even over NaN); m == 0 or n == 0:
// C untouched.
TEST(GemmDegenerate, EmptySizes) {
  for (const GemmEngine* e : flce::cpu::gemm_engines()) {
    for (float beta : {0.0f, 1.0f}) {
      Problem p = make_problem(5, 6, 0, false, false, beta, Dtype::f32, 5);
      std::vector<float> c = run_once(e, p);
      for (int64_t i = 0; i < 5; ++i)
        for (int64_t j = 0; j < p.ldc; ++j) {
          float want = j >= 6 ? kSentinel : beta == 0.0f ? 0.0f : p.c0[size_t(i * p.ldc + j)];
          EXPECT_EQ(c[size_t(i * p.ldc + j)], want) << e->name() << " k=0 beta=" << beta;
        }
    }
    std::vector<float> c(8, kSentinel);
    GemmArgs g;
    g.m = 0;
    g.n = 4;
    g.k = 3;
    g.c = c.data();
    g.ldc = 4;
    e->run(g);  // null A and B are fine: nothing is read
    g.m = 2;
    g.n = 0;
    e->run(g);
    for (float v : c) EXPECT_EQ(v, kSentinel) << e->name();
  }
}

TEST(GemmDegenerate, RejectsBadArguments) {
  std::vector<float> a(64, 1.0f), b(64, 1.0f), c(64, 0.0f);
  std::vector<uint16_t> a16(64, 0x3f80), b16(64, 0x3f80);
  for (const GemmEngine* e : flce::cpu::gemm_engines()) {
    GemmArgs g;
    g.m = 4;
    g.n = 4;
    g.k = 4;
    g.a = a.data();
    g.lda = 4;
    g.b = b.data();
    g.ldb = 4;
    g.c = c.data();
    g.ldc = 4;
    EXPECT_NO_THROW(e->run(g)) << e->name();
    GemmArgs bad = g;
    bad.lda = 3;
    EXPECT_THROW(e->run(bad), std::invalid_argument) << e->name();
    bad = g;
    bad.trans_b = true;
    bad.ldb = 3;
    EXPECT_THROW(e->run(bad), std::invalid_argument) << e->name();
    bad = g;
    bad.ldc = 2;
    EXPECT_THROW(e->run(bad), std::invalid_argument) << e->name();
    bad = g;
    bad.m = -1;
    EXPECT_THROW(e->run(bad), std::invalid_argument) << e->name();
    bad = g;
    bad.ab_dtype = Dtype::f64;
    EXPECT_THROW(e->run(bad), std::invalid_argument) << e->name();
    bad = g;
    bad.ab_dtype = Dtype::bf16;
    bad.a = a16.data();
    bad.b = b16.data();
    if (e->supports(Dtype::bf16)) {
      EXPECT_NO_THROW(e->run(bad)) << e->name();
      for (int i = 0; i < 16; ++i) EXPECT_EQ(c[size_t(i)], 4.0f) << e->name();
    } else {
      EXPECT_THROW(e->run(bad), std::invalid_argument) << e->name();
    }
  }
}

// Many different products at once from 2, 3 and 4 OpenMP threads, each into
// its own C: the results are bitwise those of the same calls made one after
// another on one thread (outside any parallel region), and stay so over
// repeated rounds in shuffled order.
TEST(GemmConcurrency, ParallelCallsMatchSequential) {
  for (const GemmEngine* e : flce::cpu::gemm_engines()) {
    std::vector<Problem> problems;
    uint64_t seed = 5000;
    const int64_t ms[] = {1, 17, 64, 100};
    const int64_t ns[] = {3, 65, 256};
    const int64_t ks[] = {17, 128, 300};
    int i = 0;
    for (Dtype dtype : dtypes_of(e))
      for (int64_t m : ms)
        for (int64_t n : ns)
          for (int64_t k : ks) {
            ++i;
            problems.push_back(
                make_problem(m, n, k, i % 3 == 0, i % 2 == 0, float(i % 2), dtype, seed++));
          }
    std::vector<std::vector<float>> want;
    for (const Problem& p : problems) want.push_back(run_once(e, p));

    const int count = int(problems.size());
    for (int threads : {2, 3, 4}) {
      std::vector<std::vector<float>> got(problems.size());
      for (int round = 0; round < 3; ++round) {
        std::vector<int> mismatched(problems.size(), 0);
        // A different order per round; dynamic so the threads interleave.
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
        for (int t = 0; t < count; ++t) {
          int idx = (t * 7 + round * 13) % count;
          std::vector<float> c = problems[size_t(idx)].c0;
          e->run(problems[size_t(idx)].args(c.data()));
          mismatched[size_t(idx)] =
              std::memcmp(c.data(), want[size_t(idx)].data(), c.size() * sizeof(float)) != 0;
        }
        for (int idx = 0; idx < count; ++idx)
          EXPECT_FALSE(mismatched[size_t(idx)])
              << threads << " threads, round " << round << ": "
              << describe(e, problems[size_t(idx)]) << " differs from the sequential call";
      }
    }
  }
}

double cpu_seconds(int who) {
  rusage ru{};
  getrusage(who, &ru);
  return double(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         1e-6 * double(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
}

// An engine starts no threads of its own: over a stretch of calls, the
// process uses no more CPU time than the calling threads do. Checked outside
// any parallel region (where oneDNN and Eigen would otherwise spread over
// omp_get_max_threads() threads) and inside a 2-thread region.
TEST(GemmThreading, ComputesOnCallingThreadOnly) {
  if (omp_get_num_procs() < 2) GTEST_SKIP() << "needs 2 CPUs to tell";
  for (const GemmEngine* e : flce::cpu::gemm_engines()) {
    for (Dtype dtype : dtypes_of(e)) {
      Problem p = make_problem(256, 512, 768, false, true, 0.0f, dtype, 9);
      std::vector<float> c = p.c0;
      e->run(p.args(c.data()));  // warm up: plans, buffers
      const double work = 0.2;   // seconds of calling-thread CPU time per check

      double self0 = cpu_seconds(RUSAGE_SELF), thread0 = cpu_seconds(RUSAGE_THREAD);
      while (cpu_seconds(RUSAGE_THREAD) - thread0 < work) e->run(p.args(c.data()));
      double self = cpu_seconds(RUSAGE_SELF) - self0;
      double thread = cpu_seconds(RUSAGE_THREAD) - thread0;
      EXPECT_LT(self, 1.3 * thread + 0.05)
          << e->name() << " " << flce::dtype_name(dtype) << " outside a parallel region: "
          << "process " << self << " s CPU, calling thread " << thread << " s";

      double threads_sum = 0.0;
      self0 = cpu_seconds(RUSAGE_SELF);
#pragma omp parallel num_threads(2) reduction(+ : threads_sum)
      {
        std::vector<float> mine = p.c0;
        double t0 = cpu_seconds(RUSAGE_THREAD);
        while (cpu_seconds(RUSAGE_THREAD) - t0 < work / 2) e->run(p.args(mine.data()));
        threads_sum += cpu_seconds(RUSAGE_THREAD) - t0;
      }
      self = cpu_seconds(RUSAGE_SELF) - self0;
      EXPECT_LT(self, 1.3 * threads_sum + 0.05)
          << e->name() << " " << flce::dtype_name(dtype) << " inside a parallel region: "
          << "process " << self << " s CPU, calling threads " << threads_sum << " s";
    }
  }
}

#ifdef FLCE_HAVE_OPENBLAS
extern "C" int openblas_get_parallel(void);
extern "C" int openblas_get_num_threads(void);
extern "C" void openblas_set_num_threads(int);

// OpenBLAS's thread count is process-wide: numpy (which shares Debian's
// libopenblas) or the user may raise it after flce set it to 1, and the
// GEMMs of flce's OpenMP threads then each started OpenBLAS threads too.
// A call holds it at 1 and gives the caller's value back after.
TEST(GemmThreading, OpenBlasIsHeldAtOneThreadForACallAndRestored) {
  const GemmEngine* e = flce::cpu::find_gemm_engine("openblas");
  ASSERT_NE(e, nullptr);
  Problem p = make_problem(8, 8, 8, false, true, 0.0f, Dtype::f32, 3);
  std::vector<float> c = p.c0;
  e->run(p.args(c.data()));  // first use: set to 1
  if (openblas_get_parallel() != 1) GTEST_SKIP() << "not a pthreads OpenBLAS";
  EXPECT_EQ(openblas_get_num_threads(), 1);
  openblas_set_num_threads(2);  // as numpy's threadpoolctl might
  {
    const std::shared_ptr<void> held = e->hold_for_calls();
    EXPECT_EQ(openblas_get_num_threads(), 1);
  }
  EXPECT_EQ(openblas_get_num_threads(), 2);
  // Overlapping calls (two host threads): the first to end must not give
  // the count back while the other still runs GEMMs.
  std::shared_ptr<void> first = e->hold_for_calls(), second = e->hold_for_calls();
  EXPECT_EQ(openblas_get_num_threads(), 1);
  first.reset();
  EXPECT_EQ(openblas_get_num_threads(), 1) << "given back while a call still held it";
  second.reset();
  EXPECT_EQ(openblas_get_num_threads(), 2);
  openblas_set_num_threads(1);
}
#endif

}  // namespace
