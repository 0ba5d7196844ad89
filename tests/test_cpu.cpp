// The cpu backend against the brute force under the float32 tolerance
// policy: every option and combination, dtype, layout and entry, at shapes
// that straddle the tile boundaries, with large, NaN and Inf logits; and its
// determinism across thread counts. ctest runs this suite once per ISA the
// machine has (FLCE_MAX_ISA, see tests/CMakeLists.txt).
#include <gtest/gtest.h>

#include <cfenv>
#include <cfloat>
#include <cstring>
#include <sys/mman.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "cpu/gemm/gemm.h"
#include "common/parallel.h"
#include "common/loss_terms.h"
#include "cpu/plan.h"
#include "flce/flce.h"
#include "simd/kernels.h"
#include "support/agreement.h"
#include "support/host_problem.h"
#include "support/shared_cases.h"

namespace flce_test {
namespace {

using flce::Dtype;
using flce::GradLogitsDtype;
using flce::Pass;
using flce::Reduction;
using flce::WeightLayout;
using flce_test::ZeroStep;

constexpr int64_t kTile = flce::cpu::kVocabTile;

flce::RunConfig cpu(int threads = 0, std::string gemm = "") {
  flce::RunConfig config;
  config.backend = "cpu";
  config.threads = threads;
  config.gemm = std::move(gemm);
  return config;
}

// Whether the default GEMM engine multiplies bf16 here, so that a bf16
// step with bf16 dlogits runs its GEMMs in bf16 (cpu::Plan::grad_gemm);
// oneDNN takes bf16 only with AVX512-BF16 or AMX dot products, and
// otherwise G stays f32 (the tests of bf16 G then skip, saying so).
bool bf16_gemm_here() {
  flce::Problem p = flce_test::step_shapes(64, 64, 512, Dtype::bf16, Dtype::f32);
  p.options.grad_logits_dtype = GradLogitsDtype::storage;
  return flce::cpu::make_plan(p, Pass::loss_and_grad, cpu()).grad_gemm == Dtype::bf16;
}

// Those skips must not hide a probe that lost bf16 where the CPU has it.
TEST(CpuGemm, Bf16GemmsWhereTheCpuHasBf16DotProducts) {
#if defined(__x86_64__)
  if (!__builtin_cpu_supports("avx512bf16")) GTEST_SKIP() << "no AVX512-BF16 on this CPU";
#else
  GTEST_SKIP() << "x86-64 only";
#endif
  if (std::getenv("ONEDNN_MAX_CPU_ISA") != nullptr) GTEST_SKIP() << "ONEDNN_MAX_CPU_ISA caps oneDNN";
  bool onednn = false;
  for (const flce::cpu::GemmEngine* engine : flce::cpu::gemm_engines())
    onednn |= std::string(engine->name()) == "onednn";
  if (!onednn) GTEST_SKIP() << "built without oneDNN";
  EXPECT_TRUE(bf16_gemm_here());
}

// The policy for the cpu backend: f32 accumulation, plus u_q where a
// gradient pass may read its scores back from the 16-bit store
// (cpu::Plan::packed_scores: bf16 storage with bf16 dlogits and a bf16
// GEMM, on a kernel set that packs, unless FLCE_CPU_PACK_SCORES=0). A pass
// or GEMM engine that ends up not packing meets the bound all the more.
Precision cpu_precision(const DenseProblem& d, const Storage& st) {
  Precision p = float32_precision(d, st);
  const char* env = std::getenv("FLCE_CPU_PACK_SCORES");
  const bool packs = st.inputs == Dtype::bf16 && !d.logits_entry &&
                     d.options.grad_logits_dtype == GradLogitsDtype::storage &&
                     flce::simd::best_kernels().pack_scores != nullptr && bf16_gemm_here() &&
                     !(env != nullptr && std::string(env) == "0");
  if (packs) p.u_packed = 0x1p-11;
  return p;
}

void check(const DenseProblem& d, const Storage& st, Pass pass = Pass::loss_and_grad,
           const flce::RunConfig& config = cpu(), bool in_place = false) {
  expect_agreement(d, st, pass, config, cpu_precision(d, st), in_place);
}

void check_all_passes(const Case& c, const flce::RunConfig& config = cpu()) {
  for (Pass pass : {Pass::forward, Pass::backward, Pass::loss_and_grad}) {
    SCOPED_TRACE(flce::pass_name(pass));
    check(c.problem(), c.storage(), pass, config);
  }
}

// The cpu backend stores x and W in f32, bf16 or f16: every case starts f32.
Case head(int64_t n, int64_t h, int64_t v, uint64_t seed = 1) {
  Case c = Case::head(n, h, v, seed);
  c.stored_as(Dtype::f32).outputs_as(Dtype::f64);
  return c;
}
Case logits(int64_t n, int64_t v, uint64_t seed = 1) {
  Case c = Case::logits(n, v, seed);
  c.stored_as(Dtype::f32).outputs_as(Dtype::f64);
  return c;
}

TEST(CpuBasics, RunsFirstAndNamesItselfAndItsIsa) {
  const auto list = flce::list_backends();
  ASSERT_FALSE(list.empty());
  EXPECT_EQ(list.front().name, "cpu");
  EXPECT_NE(list.front().description.find(std::string("isa ") + flce::simd::best_kernels().isa),
            std::string::npos)
      << list.front().description;
  const Case c = head(3, 4, 5);
  Request rq;
  rq.config = flce::RunConfig{};  // no backend named: the first that accepts
  const Outputs out = run_library(c.problem(), c.storage(), rq);
  EXPECT_EQ(out.status.backend, "cpu");
  EXPECT_EQ(out.status.declined, "");  // none passed over
}

// FLCE_TEST_KERNELS (tests/support/kernels_for_testing.cpp) reaches the
// plans: with the emulated AVX-512 set and a bf16 GEMM (ctest
// cpu_backend_isa_avx512_emulated), grad_W goes through its gemm_tn in f32
// and gemm_tn_bf16 with bf16 G (but where oneDNN's bf16 runs on AMX),
// whose scores are packed: the paths it is there to run.
TEST(CpuBasics, PlansTakeTheKernelSetThatFlceTestKernelsNames) {
  const char* env = std::getenv("FLCE_TEST_KERNELS");
  if (env == nullptr || *env == 0) GTEST_SKIP() << "FLCE_TEST_KERNELS is not set";
  ASSERT_STREQ(env, "avx512_emulated");  // the one set it can name
  flce::Problem p = flce_test::step_shapes(8, 16, 64, Dtype::f32, Dtype::f32);
  const flce::cpu::Plan f32 = flce::cpu::make_plan(p, Pass::loss_and_grad, cpu());
  EXPECT_STREQ(f32.kernels->isa, "avx512 (emulated)");
  EXPECT_TRUE(f32.grad_w_gemm_tn);
  p.x.dtype = p.w.dtype = Dtype::bf16;
  p.options.grad_logits_dtype = GradLogitsDtype::storage;
  const flce::cpu::Plan bf16 = flce::cpu::make_plan(p, Pass::loss_and_grad, cpu());
  EXPECT_EQ(bf16.grad_gemm, Dtype::bf16);
  EXPECT_EQ(bf16.grad_w_gemm_tn, !bf16.gemm->bf16_on_matrix_unit());  // AMX: oneDNN's
  EXPECT_TRUE(bf16.packed_scores);
}

TEST(CpuBasics, DeclinesFloat64StorageWithAReason) {
  const Case c = Case::head(3, 4, 5).stored_as(Dtype::f64);
  Request rq;
  rq.config = cpu();
  const Outputs forced = run_library(c.problem(), c.storage(), rq);
  EXPECT_FALSE(forced.status.ok());
  EXPECT_NE(forced.status.error.find("f64"), std::string::npos) << forced.status.error;
  EXPECT_EQ(forced.status.declined, "");  // named: an error, nothing passed over
  rq.config = flce::RunConfig{};
  const Outputs chosen = run_library(c.problem(), c.storage(), rq);
  EXPECT_EQ(chosen.status.backend, "reference");
  // Status::declined says why the reference ran: the cpu backend's reason.
  EXPECT_EQ(chosen.status.declined, "cpu: " + forced.status.error.substr(forced.status.error.find(
                                                  "declines this problem: ") + 23));
}

TEST(CpuBasics, DeclinesAScaleOrSoftcapOutsideFloat32WithAReason) {
  // In float32 a softcap of 1e300 made NaN scores and one of 1e-300 turned
  // the softcap off: the cpu backend declines them, the reference takes them.
  for (double v : {1e300, 1e-300, 1e-39, 4e38, 3e38}) {
    for (bool softcap : {true, false}) {
      if (v == 3e38 && !softcap) continue;  // a float32 scale, but 1/softcap is subnormal
      SCOPED_TRACE(std::string(softcap ? "softcap " : "logit_scale ") + std::to_string(v));
      Case c = head(3, 4, 5);
      softcap ? c.softcap(v) : c.logit_scale(v);
      Request rq;
      rq.config = cpu();
      const Outputs forced = run_library(c.problem(), c.storage(), rq);
      EXPECT_FALSE(forced.status.ok());
      EXPECT_NE(forced.status.error.find(softcap ? "softcap = " : "logit_scale = "),
                std::string::npos) << forced.status.error;
      rq.config = flce::RunConfig{};
      const Outputs chosen = run_library(c.problem(), c.storage(), rq);
      EXPECT_EQ(chosen.status.backend, "reference");
      EXPECT_NE(chosen.status.declined.find(softcap ? "cpu: softcap = " : "cpu: logit_scale = "),
                std::string::npos) << chosen.status.declined;
    }
  }
  // Just below the range's end, the message tells the value from the end
  // ("%g" printed both as 1.17549e-38; FLT_MIN as a double takes 17 digits).
  Case below = head(3, 4, 5).logit_scale(std::nextafter(double(FLT_MIN), 0.0));
  Request rq;
  rq.config = cpu();
  const Outputs declined = run_library(below.problem(), below.storage(), rq);
  EXPECT_NE(declined.status.error.find("logit_scale = 1.1754943508222874e-38 is outside "
                                       "float32's normal range [1.1754943508222875e-38, "
                                       "3.4028234663852886e+38]"),
            std::string::npos) << declined.status.error;
  // The ends of the softcap's range (k and 1/k normal) are taken, and the
  // forward agrees with the oracle (the policy's gradient bounds are NaN at
  // these ends).
  for (double k : {double(FLT_MIN), 1 / double(FLT_MIN)}) {
    const Case c = head(3, 4, 5).softcap(k);
    check(c.problem(), c.storage(), Pass::forward);
  }
}

TEST(CpuBasics, UnknownGemmEngineIsAnError) {
  const Case c = head(3, 4, 5);
  Request rq;
  rq.config = flce::RunConfig{};
  rq.config.gemm = "nope";
  const Outputs out = run_library(c.problem(), c.storage(), rq);
  EXPECT_FALSE(out.status.ok());
  EXPECT_NE(out.status.error.find("nope"), std::string::npos) << out.status.error;
  // workspace_size() says so too (it reported the default engine's bytes).
  ZeroStep step(3, 4, 5, false);
  size_t bytes = 0;
  const flce::Status sized = flce::workspace_size(step.p, Pass::forward, rq.config, &bytes);
  EXPECT_FALSE(sized.ok());
  EXPECT_EQ(sized.error, out.status.error);
}

TEST(CpuBasics, ThreadsBeyondTheWorkGetNoScratch) {
  // A 5 x 8 x 12 step at --threads 4096 asked for 2 GB of per-thread
  // scratch; no loop has more than 12 iterations. The reference likewise.
  ZeroStep step(5, 8, 12, true);
  const flce::Problem& p = step.p;
  for (const char* backend : {"cpu", "reference"}) {
    flce::RunConfig config;
    config.backend = backend;
    size_t at_4096 = 0, at_12 = 0;
    config.threads = 4096;
    ASSERT_TRUE(flce::workspace_size(p, Pass::loss_and_grad, config, &at_4096).ok());
    config.threads = 12;
    ASSERT_TRUE(flce::workspace_size(p, Pass::loss_and_grad, config, &at_12).ok());
    EXPECT_EQ(at_4096, at_12) << backend;
    config.threads = 4096;
    EXPECT_TRUE(flce::loss_and_grad(p, config).ok()) << backend;
  }
}

TEST(CpuOptions, EachAlone) {
  for (const Case& c : each_option_alone(head)) check_all_passes(c);
}

TEST(CpuCombinations, HeadEntrySweep) {
  uint64_t seed = 300;
  for (Reduction r : {Reduction::none, Reduction::sum, Reduction::mean})
    for (WeightLayout layout : {WeightLayout::vh, WeightLayout::hv})
      for (int extras = 0; extras < 4; ++extras)  // bit 0: bias + weights, bit 1: cotangents
        for (double k : {0.0, 2.5})
          for (double e : {0.0, 0.15})
            for (double l : {0.0, 0.05}) {
              SCOPED_TRACE("reduction " + std::to_string(int(r)) + " layout " +
                           std::to_string(int(layout)) + " extras " + std::to_string(extras) +
                           " softcap " + std::to_string(k) + " smoothing " + std::to_string(e) +
                           " z_loss " + std::to_string(l));
              Case c = head(6, 5, 2 * kTile + 3, ++seed).layout(layout).reduction(r).softcap(k)
                           .label_smoothing(e).z_loss(l).logit_scale(1.5).ignore_rows({2})
                           .logit_magnitude(6);
              if (extras & 1) c.with_bias().with_token_weights().with_class_weights();
              if (extras & 2) c.with_grad_loss().with_grad_lse().with_grad_entropy();
              check(c.problem(), c.storage());
            }
}

TEST(CpuCombinations, LogitsEntrySweep) {
  uint64_t seed = 700;
  for (Reduction r : {Reduction::none, Reduction::mean})
    for (double k : {0.0, 2.5})
      for (double e : {0.0, 0.15})
        for (int cot = 0; cot < 2; ++cot) {
          Case c = logits(5, kTile + 7, ++seed).reduction(r).softcap(k).label_smoothing(e)
                       .z_loss(0.01).logit_scale(0.75).ignore_rows({1}).with_class_weights();
          if (cot) c.with_grad_loss().with_grad_lse().with_grad_entropy();
          check_all_passes(c);
        }
}

TEST(CpuLogitsEntry, InPlaceGradLogits) {
  for (Dtype dtype : {Dtype::f32, Dtype::bf16}) {
    const Case c = logits(6, kTile + 1).stored_as(dtype).outputs_as(Dtype::f32)
                       .gradients_as(dtype).softcap(3).with_grad_entropy();
    for (Pass pass : {Pass::backward, Pass::loss_and_grad})
      check(c.problem(), c.storage(), pass, cpu(), /*in_place=*/true);
  }
}

// dlogits rounded to the 16-bit storage (grad_logits_dtype = storage) and
// written into a wider grad_logits: the cast's error is in the bound
// (tolerance.h, section 6), below f16's normal range for a mean too.
TEST(CpuLogitsEntry, SixteenBitDlogitsIntoAWiderOutput) {
  for (Dtype dtype : {Dtype::bf16, Dtype::f16})
    for (Reduction r : {Reduction::sum, Reduction::mean}) {
      SCOPED_TRACE(std::string(flce::dtype_name(dtype)) + (r == Reduction::sum ? ", sum" : ", mean"));
      const Case c = logits(16, 300).stored_as(dtype).gradients_as(Dtype::f32).reduction(r)
                         .grad_logits(GradLogitsDtype::storage);
      check(c.problem(), c.storage());
    }
}

TEST(CpuStorage, DtypesLayoutsAndGradientDtypes) {
  for (Dtype dtype : {Dtype::f32, Dtype::bf16, Dtype::f16}) {
    SCOPED_TRACE(flce::dtype_name(dtype));
    for (WeightLayout layout : {WeightLayout::vh, WeightLayout::hv}) {
      check_all_passes(head(5, 9, kTile + 5).layout(layout).with_bias().stored_as(dtype).softcap(4));
      check_all_passes(head(5, 9, 40).layout(layout).stored_as(dtype).gradients_as(dtype));
      check_all_passes(head(5, 9, 40).layout(layout).stored_as(dtype).outputs_as(Dtype::f32));
    }
    check_all_passes(logits(5, kTile + 5).stored_as(dtype).label_smoothing(0.1));
  }
}

TEST(CpuStorage, GradLogitsInTheStorageDtype) {
  for (Dtype dtype : {Dtype::f32, Dtype::bf16, Dtype::f16})
    for (WeightLayout layout : {WeightLayout::vh, WeightLayout::hv}) {
      SCOPED_TRACE(flce::dtype_name(dtype));
      DenseProblem d = head(7, 9, kTile + 9).layout(layout).stored_as(dtype).with_bias()
                           .with_grad_entropy().problem();
      d.options.grad_logits_dtype = GradLogitsDtype::storage;
      Storage st = head(1, 1, 1).stored_as(dtype).storage();
      check(d, st, Pass::loss_and_grad);
      check(d, st, Pass::backward);
    }
  // bf16 G: grad_W through gemm_tn_bf16 where the CPU has it, with whole
  // 8 x 48 micro-tiles in each layout and an odd row count (k = 17).
  for (WeightLayout layout : {WeightLayout::vh, WeightLayout::hv}) {
    DenseProblem d = head(17, 100, kTile + 9).layout(layout).stored_as(Dtype::bf16).problem();
    d.options.grad_logits_dtype = GradLogitsDtype::storage;
    check(d, head(1, 1, 1).stored_as(Dtype::bf16).storage(), Pass::loss_and_grad);
  }
}

TEST(CpuTiles, VocabAroundTheTileWidth) {
  for (int64_t v : {int64_t(1), int64_t(2), kTile - 1, kTile, kTile + 1, 3 * kTile - 1}) {
    SCOPED_TRACE("V = " + std::to_string(v));
    check_all_passes(head(3, 4, v).with_bias().label_smoothing(0.1).with_grad_entropy());
  }
}

TEST(CpuTiles, RowsAroundTheRowBlock) {
  // V = kTile + 1 keeps the row block at its cap: the block edge is at kMaxRowBlock.
  const int64_t block = flce::cpu::kMaxRowBlock;
  for (int64_t n : {int64_t(1), block - 1, block, block + 1}) {
    SCOPED_TRACE("N = " + std::to_string(n));
    check(head(n, 1, kTile + 1).reduction(Reduction::sum).problem(),
          head(n, 1, kTile + 1).storage());
  }
  check_all_passes(head(block + 1, 3, kTile + 1).layout(WeightLayout::hv).with_bias()
                       .reduction(Reduction::none).with_grad_loss());
  // f32 gradients: grad_W accumulates in place across the two blocks, in
  // each layout (Plan::grad_w_in_place; simd::KernelSet::gemm_tn's C).
  for (WeightLayout layout : {WeightLayout::vh, WeightLayout::hv})
    check_all_passes(head(block + 1, 3, kTile + 1).layout(layout).gradients_as(Dtype::f32));
}

// grad_x tasks (Plan::h_chunk): H in up to kGradXTasks chunks of at least
// kMinHiddenChunk columns, rounded up to 16, then rows in groups; H around
// those edges (short last chunks) and N not a multiple of the groups.
TEST(CpuTiles, HiddenAroundTheChunks) {
  const int64_t c = flce::cpu::kMinHiddenChunk, tasks = flce::cpu::kGradXTasks;
  for (int64_t h : {int64_t(1), c - 1, c, c + 1, 2 * c + 1, tasks * c + 1, tasks * c + 33})
    for (int64_t n : {int64_t(4), int64_t(7)}) {
      SCOPED_TRACE("N = " + std::to_string(n) + ", H = " + std::to_string(h));
      check(head(n, h, 33).with_bias().problem(), head(n, h, 33).storage());
    }
}

TEST(CpuEdge, LargeLogits) {
  for (const Case& c : large_logit_cases(head, logits, 5, kTile + 3)) check_all_passes(c);
}

TEST(CpuEdge, AllRowsIgnored) {
  for (const Case& c : all_rows_ignored(head)) check_all_passes(c);
}

TEST(CpuEdge, NaNAndInfRows) {
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  constexpr double kInf = std::numeric_limits<double>::infinity();
  for (double bad : {kNaN, kInf, -kInf}) {
    SCOPED_TRACE("value " + std::to_string(bad));
    const Case c = head(5, 6, kTile + 9).reduction(Reduction::none);
    DenseProblem d = c.problem();
    d.x[2 * d.h + 3] = bad;
    d.w[7 * d.h + 1] = bad;  // class 7's logit is non-finite in every row
    check(d, c.storage(), Pass::loss_and_grad);
    check(d, c.storage(), Pass::forward);
  }
}

// The default floating-point environment on the calling thread and on every
// thread of the OpenMP pool.
void default_float_env_everywhere() {
  const auto reset = [] {
    std::fesetenv(FE_DFL_ENV);
#if defined(__x86_64__) || defined(__i386__)
    _mm_setcsr(0x1F80);
#endif
  };
  reset();
#pragma omp parallel num_threads(8)
  reset();
}

// A logits step of 2 rows over 4 tiles whose p are e^-100 but for class 0:
// subnormal in f32, as are their dlogits. Returns loss, lse and grad_logits'
// bytes. `caller_env` sets the environment on the calling thread and on
// the OpenMP pool's threads (which keep theirs between regions) before the
// call; right after it, the caller's must be as it was.
std::vector<float> tiny_probabilities_step(const flce::RunConfig& config, void (*caller_env)()) {
  constexpr int64_t kN = 2, kV = 4 * kTile;
  std::vector<float> z(size_t(kN * kV), -100.0f), grad(size_t(kN * kV)), out(1 + kN);
  for (int64_t i = 0; i < kN; ++i) z[size_t(i * kV)] = 0.0f;
  const std::vector<int64_t> y = {0, 3};
  flce::Problem p;
  p.logits = flce::matrix_view(z.data(), Dtype::f32, kN, kV);
  p.labels = flce::vector_view(y.data(), Dtype::i64, kN);
  p.loss = flce::scalar_view(&out[0], Dtype::f32);
  p.lse = flce::vector_view(&out[1], Dtype::f32, kN);
  p.grad_logits = flce::matrix_view(grad.data(), Dtype::f32, kN, kV);
  if (caller_env) {
    caller_env();
#pragma omp parallel num_threads(8)
    caller_env();
  }
  const int rounding = std::fegetround();
#if defined(__x86_64__) || defined(__i386__)
  const unsigned csr = _mm_getcsr() & ~0x3Fu;  // all but the sticky flags
#endif
  const flce::Status status = flce::loss_and_grad(p, config);
  EXPECT_EQ(std::fegetround(), rounding) << "the caller's rounding did not come back";
#if defined(__x86_64__) || defined(__i386__)
  EXPECT_EQ(_mm_getcsr() & ~0x3Fu, csr) << "the caller's MXCSR did not come back";
#endif
  default_float_env_everywhere();
  EXPECT_TRUE(status.ok()) << status.error;
  out.insert(out.end(), grad.begin(), grad.end());
  return out;
}

// The caller's floating-point environment changes no bit, for any thread
// count, on the cpu backend and the oracle: threads that flush subnormals
// (MXCSR's FTZ and DAZ, which torch.set_flush_denormal(True) sets on the
// thread that calls it) or round upward. Every thread of a call computes in
// the default environment (common/float_env.h); before, the calling
// thread's tiles followed the caller's and the pool's kept their own.
TEST(CpuEdge, TheCallersFloatEnvironmentChangesNoBit) {
  std::vector<std::pair<const char*, void (*)()>> envs = {
      {"rounding upward", [] { std::fesetround(FE_UPWARD); }}};
#if defined(__x86_64__) || defined(__i386__)
  envs.push_back({"flush to zero", [] { _mm_setcsr(_mm_getcsr() | 0x8040); }});
#endif
  for (const char* backend : {"cpu", "reference"}) {
    flce::RunConfig config = cpu(1);
    config.backend = backend;
    const std::vector<float> want = tiny_probabilities_step(config, nullptr);
    ASSERT_NE(want.back(), 0.0f);  // a subnormal dlogit: e^-100 / 2
    for (const auto& [name, env] : envs)
      for (int threads : {1, 2, 5}) {
        SCOPED_TRACE(std::string(backend) + ", " + name + ", " + std::to_string(threads) +
                     " threads");
        config.threads = threads;
        const std::vector<float> got = tiny_probabilities_step(config, env);
        ASSERT_EQ(got.size(), want.size());
        EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0);
      }
  }
}

// A vocabulary mask written as the lowest float (a bias of -FLT_MAX, or
// such logits) over a whole tile: the tile's f32 sum of e^(s - max) s (the
// entropy's sum until it became e^(s - max) (s - max)) was -inf, its weight
// in the row's entropy e^(max - lse) 0, and 0 * inf made every entropy and,
// with an entropy cotangent, every gradient NaN (the oracle's are finite).
TEST(CpuEdge, AVocabularyMaskAtTheLowestFloatKeepsTheEntropyFinite) {
  for (bool head_entry : {false, true}) {
    SCOPED_TRACE(head_entry ? "bias" : "logits");
    Case c = head_entry ? head(6, 8, 3 * kTile).with_bias() : logits(6, 3 * kTile);
    c.with_grad_entropy();
    DenseProblem d = c.problem();
    for (int64_t j = kTile; j < 2 * kTile; ++j) {
      if (head_entry) d.bias[size_t(j)] = -double(FLT_MAX);
      else
        for (int64_t i = 0; i < d.n; ++i) d.logits[size_t(i * d.v + j)] = -double(FLT_MAX);
    }
    for (Pass pass : {Pass::forward, Pass::loss_and_grad, Pass::backward}) {
      SCOPED_TRACE(flce::pass_name(pass));
      check(d, c.storage(), pass);
    }
  }
}

// Rows of one huge logit (a row masked whole), over three tiles: p_ij =
// 1/V, as the oracle gives, forward, in a step and in a backward from the
// forward's lse; and a row at 1e8 with an entropy cotangent
// (expect_rows_masked_whole_are_uniform). The dlogits kernels' e^(s -
// lse32) was 1 there, and a G row summed to 1.5 V; the loss and entropy
// came out 0; the entropy term at 1e8 lost u |s|. Logits, and heads in f32
// and bf16.
TEST(CpuEdge, ARowMaskedWholeIsUniform) {
  expect_rows_masked_whole_are_uniform(cpu(2), 2 * kTile + 5);
  for (Dtype dtype : {Dtype::f32, Dtype::bf16}) {
    SCOPED_TRACE(flce::dtype_name(dtype));
    expect_rows_masked_whole_are_uniform(cpu(2), 2 * kTile + 5, MaskedRowsEntry::head, dtype);
  }
}

// The entropy is formed from differences to the row's max (simd/kernels.h,
// sum_exp_d; row_terms.h), as the oracle's: logits moved by 2^20, their
// differences exact (offset_pair), give the same entropy to lse's rounding
// in double. Formed as lse - sum_j p_j s_j from unshifted scores, it moved
// by about 0.06 (by 4e-4 at an offset of 1e4). Logits, and a head moved by
// its bias.
TEST(CpuEdge, TheEntropyIgnoresALargeCommonOffsetOfTheLogits) {
  for (Case c : {logits(6, 3 * kTile + 77), head(6, 16, 3 * kTile + 77).with_bias()}) {
    c.with_grad_entropy();
    DenseProblem d = c.problem(), moved;
    offset_pair(&d, &moved, 17);
    SCOPED_TRACE(d.logits_entry ? "logits" : "head");
    expect_entropy_ignores_offset(d, moved, c.storage(), cpu());
  }
}

// Label smoothing on a class of weight 0 whose logit is infinite: c_j logp_j
// is 0 * inf, NaN in the semantics (as in PyTorch); the kernels dropped the
// class and gave a finite loss. (Where the logit is +inf, lse is too and the
// row's gradients are NaN, in the oracle as well.)
TEST(CpuEdge, SmoothingOnAnInfiniteLogitOfWeightZeroIsNaN) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  for (double bad : {-kInf, kInf}) {
    SCOPED_TRACE("value " + std::to_string(bad));
    const Case c = logits(5, kTile + 9).reduction(Reduction::none).with_class_weights()
                       .label_smoothing(0.1);
    DenseProblem d = c.problem();
    d.class_weights[7] = 0;
    for (int64_t i = 0; i < d.n; i += 2) d.logits[i * d.v + 7] = bad;
    check(d, c.storage(), Pass::forward);
    check(d, c.storage(), Pass::loss_and_grad);
  }
}

// An ignored row with a +inf logit: lse = +inf, and the loss's coefficient
// g_loss (2 l lse) was 0 * inf = NaN, which made the row's whole gradient NaN
// where the oracle has NaN at the infinite class only (p = e^(inf - inf)).
TEST(CpuEdge, AnIgnoredRowWithAnInfiniteLogitHasNaNGradientsOnlyThere) {
  const Case c = logits(5, kTile + 9).reduction(Reduction::none).ignore_rows({2, 3});
  DenseProblem d = c.problem();
  d.logits[2 * d.v + 7] = std::numeric_limits<double>::infinity();
  check(d, c.storage(), Pass::loss_and_grad);
  check(d, c.storage(), Pass::backward);
}

// The label's column under a saturated softcap: p_y -> 1, and G_y =
// a (1 - t^2)(p_y - 1) is tiny. The label term used a double ds/dz and the
// kernel's p_y term an f32 one, whose difference (~2^-24 t^2) is then the
// slope itself: 96% off, 8.8 times the bound, at z = 25 with k = 5.
TEST(CpuEdge, TheLabelColumnUnderASaturatedSoftcap) {
  for (double z : {20.0, 25.0, 40.0}) {
    SCOPED_TRACE("z = " + std::to_string(z));
    const Case c = logits(3, 4).softcap(5).reduction(Reduction::sum);
    DenseProblem d = c.problem();
    for (int64_t j = 0; j < d.v; ++j) d.logits[j] = j == 0 ? z : -z;
    d.labels[0] = 0;
    check(d, c.storage(), Pass::loss_and_grad);
  }
}

// Views whose strides a GEMM cannot take as they are: size-1 dimensions of
// stride 0 (api.cpp makes them contiguous for every backend) and x and W
// whose rows overlap (the cpu backend copies such a W): the policy of
// contiguous arrays.
TEST(CpuStrides, SizeOneDimensionsOfStride0) {
  const int64_t shapes[][3] = {{1, 24, 40}, {5, 24, 1}, {4, 1, 40}, {1, 1, 1}};
  for (const auto& s : shapes) {
    for (WeightLayout layout : {WeightLayout::vh, WeightLayout::hv}) {
      SCOPED_TRACE(std::to_string(s[0]) + " x " + std::to_string(s[1]) + " x " +
                   std::to_string(s[2]) + (layout == WeightLayout::vh ? ", vh" : ", hv"));
      const Case c = head(s[0], s[1], s[2]).layout(layout).with_bias();
      const DenseProblem d = c.problem();
      for (Pass pass : {Pass::forward, Pass::backward, Pass::loss_and_grad})
        expect_agreement(d, c.storage(), pass, cpu(), cpu_precision(d, c.storage()), false,
                         WeightGradients::elementwise, RowOutputs::all, Views::size_one_stride_0);
    }
  }
}

TEST(CpuStrides, InputsWhoseRowsOverlap) {
  for (Dtype storage : {Dtype::f32, Dtype::bf16}) {
    for (WeightLayout layout : {WeightLayout::vh, WeightLayout::hv}) {
      SCOPED_TRACE(std::string(flce::dtype_name(storage)) +
                   (layout == WeightLayout::vh ? ", vh" : ", hv"));
      const Case c = head(9, 24, kTile + 9).layout(layout).stored_as(storage);
      DenseProblem d = c.problem();
      make_hankel_inputs(&d);
      for (Pass pass : {Pass::forward, Pass::loss_and_grad})
        expect_agreement(d, c.storage(), pass, cpu(), cpu_precision(d, c.storage()), false,
                         WeightGradients::elementwise, RowOutputs::all, Views::overlapping_rows);
    }
  }
}

// A row whose logits are all -inf: lse -inf, and every p_j = e^(-inf + inf)
// NaN, so the entropy is NaN as in the oracle (it came out -inf).
TEST(CpuEdge, RowOfMinusInfinityLogits) {
  const Case c = logits(5, kTile + 9).reduction(Reduction::none);
  DenseProblem d = c.problem();
  for (int64_t j = 0; j < d.v; ++j) d.logits[2 * d.v + j] = -std::numeric_limits<double>::infinity();
  check(d, c.storage(), Pass::forward);
  check(d, c.storage(), Pass::loss_and_grad);
}

// W's rows 2^31 elements apart (8 GiB of address space, two pages touched):
// too far for the GEMMs' int leading dimension, so W is copied, not read in
// place (an exception inside the parallel region terminated the process).
// Judged by the policy, as every cpu result.
TEST(CpuStrides, WRowsFartherApartThanAnInt) {
  const Case c = head(3, 4, 2);
  const DenseProblem d = c.problem();
  const int64_t row_stride = int64_t(1) << 31;
  const size_t bytes = size_t(row_stride + d.h) * sizeof(float);
  void* map = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  ASSERT_NE(map, MAP_FAILED);
  float* w = static_cast<float*>(map);
  std::vector<float> x(d.x.begin(), d.x.end());  // exact: the case's values are f32
  for (int64_t j = 0; j < d.v; ++j)
    for (int64_t k = 0; k < d.h; ++k) w[j * row_stride + k] = float(d.w[j * d.h + k]);
  flce::Problem p;
  p.x = flce::matrix_view(x.data(), Dtype::f32, d.n, d.h);
  p.w = flce::matrix_view(w, Dtype::f32, d.v, d.h);
  p.w.stride[0] = row_stride;
  p.labels = flce::vector_view(d.labels.data(), Dtype::i64, d.n);
  double loss = 0;
  std::vector<double> lse(size_t(d.n));
  p.loss = flce::scalar_view(&loss, Dtype::f64);
  p.lse = flce::vector_view(lse.data(), Dtype::f64, d.n);
  const flce::Status st = flce::forward(p, cpu());
  munmap(map, bytes);
  ASSERT_TRUE(st.ok()) << st.error;
  const BruteForce exact = brute_force(d);
  const Bounds b = error_bounds(d, exact, cpu_precision(d, c.storage()));
  EXPECT_TRUE(within_bounds("loss", {loss}, exact.loss, b.loss));
  EXPECT_TRUE(within_bounds("lse", lse, exact.lse, b.lse));
}

TEST(CpuGemm, EveryEngineAgrees) {
  for (const flce::cpu::GemmEngine* engine : flce::cpu::gemm_engines()) {
    SCOPED_TRACE(engine->name());
    for (Dtype dtype : {Dtype::f32, Dtype::bf16}) {
      check_all_passes(head(9, 17, kTile + 5).stored_as(dtype).with_bias(), cpu(0, engine->name()));
      check_all_passes(head(9, 17, 70).layout(WeightLayout::hv).stored_as(dtype),
                       cpu(0, engine->name()));
    }
  }
}

// ---- Determinism ------------------------------------------------------------

Outputs run_cpu(const Case& c, int threads, Pass pass = Pass::loss_and_grad,
                const std::string& gemm = "") {
  Request rq;
  rq.pass = pass;
  rq.config = cpu(threads, gemm);
  Outputs out = run_library(c.problem(), c.storage(), rq);
  EXPECT_TRUE(out.status.ok()) << out.status.error;
  return out;
}

// A caller's workspace may arrive dirty: `bytes` of 0xFF (NaN as f32) must
// give the call `own` the bits of the backend's own workspace, so no piece
// is read before it is written. (The backend's own comes from
// aligned_alloc, often zero-filled pages, which would hide such a read.)
void expect_stale_workspace_changes_no_bit(const Case& c, const Request& own, size_t bytes) {
  const Outputs want = run_library(c.problem(), c.storage(), own);
  ASSERT_TRUE(want.status.ok()) << want.status.error;
  std::vector<unsigned char> stale(bytes, 0xFF);
  Request theirs = own;
  theirs.config.workspace = stale.data();
  theirs.config.workspace_bytes = stale.size();
  const Outputs got = run_library(c.problem(), c.storage(), theirs);
  ASSERT_TRUE(got.status.ok()) << got.status.error;
  expect_identical_outputs(got, want);
}

// With bf16 gradient GEMMs G is rounded to bf16 once, by the conversion;
// where the f32 G is also read (here the filter, with an eps that keeps
// every block) it is rounded in f32 first. The two must give the same bits.
TEST(CpuBf16Gradients, RoundingBeforeTheConversionChangesNoBit) {
  for (WeightLayout layout : {WeightLayout::vh, WeightLayout::hv}) {
    const Case plain = head(70, 40, 3 * kTile + 5).layout(layout).stored_as(Dtype::bf16)
                           .grad_logits(GradLogitsDtype::storage).softcap(5);
    Case read = plain;
    read.filter_eps(1e-30);
    const Outputs filtered = run_cpu(read, 2);
    EXPECT_GT(filtered.status.stats.grad_blocks, 0) << "the filter never read G";
    expect_identical_outputs(run_cpu(plain, 2), filtered);
  }
}

// Every GEMM engine, forward (one tile at a time, short blocks padded) and
// step; 300 rows make two row blocks of the forward.
TEST(CpuDeterminism, SameBitsForAnyThreadCountAndRun) {
  for (const flce::cpu::GemmEngine* engine : flce::cpu::gemm_engines())
    for (Pass pass : {Pass::forward, Pass::loss_and_grad})
      for (const Case& c :
           {head(300, 20, 3 * kTile + 17).with_bias().with_token_weights().softcap(3)
                .label_smoothing(0.1).with_grad_entropy(),
            head(70, 300, kTile + 1).layout(WeightLayout::hv).reduction(Reduction::sum)
                .stored_as(Dtype::bf16),
            logits(70, 2 * kTile + 1).reduction(Reduction::none).with_grad_loss()}) {
        const Outputs one = run_cpu(c, 1, pass, engine->name());
        for (int threads : {1, 2, 3, 5}) {
          SCOPED_TRACE(std::string(engine->name()) + ", " + flce::pass_name(pass) +
                       ", threads = " + std::to_string(threads));
          expect_identical_outputs(run_cpu(c, threads, pass, engine->name()), one);
        }
      }
}

// Without per-row outputs the softmax kernels skip the entropy and
// smoothing sums and the argmax search (Plan::softmax_extras); what is
// computed either way must keep its bits. Label smoothing needs sum_cs for
// the loss, and grad_entropy needs sum_exp_d for G, so there they stay on.
TEST(CpuSoftmaxExtras, LossLseAndGradientsKeepTheirBitsWithoutPerRowOutputs) {
  for (const Case& c : {head(70, 20, 2 * kTile + 17).with_bias().softcap(3),
                        head(70, 20, kTile + 9).stored_as(Dtype::bf16).label_smoothing(0.1),
                        head(40, 12, kTile + 3).with_grad_entropy()}) {
    for (Pass pass : {Pass::forward, Pass::loss_and_grad}) {
      Request all, fewer;
      all.pass = fewer.pass = pass;
      all.config = fewer.config = cpu(2);
      fewer.per_row_outputs = false;
      const Outputs a = run_library(c.problem(), c.storage(), all);
      const Outputs b = run_library(c.problem(), c.storage(), fewer);
      ASSERT_TRUE(a.status.ok() && b.status.ok()) << a.status.error << b.status.error;
      EXPECT_EQ(a.loss, b.loss);
      EXPECT_EQ(a.lse, b.lse);
      EXPECT_EQ(a.grad_x, b.grad_x);
      EXPECT_EQ(a.grad_w, b.grad_w);
      EXPECT_EQ(a.grad_bias, b.grad_bias);
    }
  }
}

// The rows [r0, r0 + b) of a head problem as a problem of their own: x and
// the labels only, so the problem must have no per-row inputs besides them.
flce_test::DenseProblem row_slice(const flce_test::DenseProblem& d, int64_t r0, int64_t b) {
  flce_test::DenseProblem s = d;
  s.n = b;
  s.x.assign(d.x.begin() + r0 * d.h, d.x.begin() + (r0 + b) * d.h);
  s.labels.assign(d.labels.begin() + r0, d.labels.begin() + r0 + b);
  return s;
}

// A forward row's outputs do not depend on which rows share its call (flce
// eval's blocks against flce run): every logits GEMM of a forward has
// kMaxRowBlock rows, since the engines pick kernels that round differently
// by the number of rows (oneDNN: at N = 37, V = 1000 one-row calls changed 7
// of 37 logprobs before).
TEST(CpuDeterminism, ForwardRowsDoNotDependOnTheirBlock) {
  for (Dtype dtype : {Dtype::f32, Dtype::bf16}) {
    const Case c = head(37, 16, 2 * kTile - 24).stored_as(dtype).with_bias().reduction(Reduction::none);
    const flce_test::DenseProblem d = c.problem();
    Request rq;
    rq.pass = Pass::forward;
    rq.config = cpu(2);
    const Outputs all = run_library(d, c.storage(), rq);
    for (int64_t b : {int64_t(1), int64_t(7), int64_t(16), int64_t(17)})
      for (int64_t r0 = 0; r0 < d.n; r0 += b) {
        SCOPED_TRACE(std::string(flce::dtype_name(dtype)) + ": rows " + std::to_string(r0) + " + " +
                     std::to_string(b));
        const int64_t m = std::min(b, d.n - r0);
        const Outputs part = run_library(row_slice(d, r0, m), c.storage(), rq);
        for (int64_t i = 0; i < m; ++i) {
          ASSERT_EQ(part.lse[i], all.lse[r0 + i]) << "row " << r0 + i;
          ASSERT_EQ(part.logprob[i], all.logprob[r0 + i]) << "row " << r0 + i;
          ASSERT_EQ(part.entropy[i], all.entropy[r0 + i]) << "row " << r0 + i;
        }
      }
  }
}

// The vocabulary-outer order of a training step (cpu::Plan), forced with
// cuts (FLCE_CPU_GRAD_ORDER = vocab:RxT) into several super-blocks, the
// last one short, with chunks of two tiles, the last a single short tile;
// and into super-blocks of two forward pieces (kMaxRowBlock rows each), the
// second one short.
class CpuVocabOuter : public ::testing::Test {
 protected:
  void TearDown() override {
    unsetenv("FLCE_CPU_GRAD_ORDER");
    unsetenv("FLCE_CPU_SCORE_MIB");
  }
};

struct VocabCut {
  const char* order;
  int64_t n;
};
constexpr int64_t kCutH = 24, kCutV = 2 * kTile + 428;
const VocabCut kVocabCuts[] = {{"vocab:100x2", 250}, {"vocab:300x1", 310}};

// An f32 step's shapes, for make_plan.
flce::Problem step_shapes(int64_t n, int64_t h, int64_t v) {
  return flce_test::step_shapes(n, h, v, Dtype::f32, Dtype::f32);
}

// What CpuSoftmaxExtras compares: without per-row outputs, smoothing or an
// entropy cotangent the plan asks the kernels for no extra sums, and each
// of those turns its sums back on.
TEST(CpuSoftmaxExtras, OffWithoutPerRowOutputsSmoothingOrEntropy) {
  static const float none = 0;
  flce::Problem p = step_shapes(70, 20, 2 * kTile + 17);
  EXPECT_EQ(flce::cpu::make_plan(p, Pass::loss_and_grad, cpu(2)).softmax_extras, 0u);
  flce::Problem with = p;
  with.argmax = flce::vector_view(&none, Dtype::i64, 70);
  EXPECT_EQ(flce::cpu::make_plan(with, Pass::loss_and_grad, cpu(2)).softmax_extras,
            flce::simd::kSoftmaxArgmax);
  with = p;
  with.options.label_smoothing = 0.1;
  EXPECT_EQ(flce::cpu::make_plan(with, Pass::loss_and_grad, cpu(2)).softmax_extras,
            flce::simd::kSoftmaxMoments);
  with = p;
  with.grad_entropy = flce::vector_view(&none, Dtype::f32, 70);
  EXPECT_EQ(flce::cpu::make_plan(with, Pass::loss_and_grad, cpu(2)).softmax_extras,
            flce::simd::kSoftmaxMoments);
}

TEST_F(CpuVocabOuter, AgreesAcrossSuperBlocksAndChunks) {
  for (const VocabCut& cut : kVocabCuts) {
    setenv("FLCE_CPU_GRAD_ORDER", cut.order, 1);
    const flce::cpu::Plan plan = flce::cpu::make_plan(step_shapes(cut.n, kCutH, kCutV), Pass::loss_and_grad, cpu());
    ASSERT_TRUE(plan.vocab_outer);
    for (Dtype dtype : {Dtype::f32, Dtype::bf16})
      for (WeightLayout layout : {WeightLayout::vh, WeightLayout::hv}) {
        SCOPED_TRACE(std::string(cut.order) + ", " + flce::dtype_name(dtype) + ", layout " +
                     std::to_string(int(layout)));
        const Case c = head(cut.n, kCutH, kCutV).layout(layout).stored_as(dtype).with_bias().softcap(4)
                           .label_smoothing(0.1).ignore_rows({3, cut.n - 1}).with_grad_entropy();
        check(c.problem(), c.storage(), Pass::loss_and_grad);
        // A backward without an entropy cotangent takes the statistics it
        // needs from the saved lse (Plan::stats_from_inputs), with every
        // per-row term of G.
        const Case plain = head(cut.n, kCutH, kCutV, 2).layout(layout).stored_as(dtype).softcap(4)
                               .ignore_rows({3}).with_grad_lse().with_bias().label_smoothing(0.1)
                               .with_class_weights().with_token_weights().z_loss(1e-3)
                               .reduction(Reduction::none).with_grad_loss();
        check(plain.problem(), plain.storage(), Pass::backward);
        if (layout == WeightLayout::hv) continue;
        check(c.problem(), c.storage(), Pass::backward);
        // dlogits in the storage dtype into its GEMMs, and gradients in it
        // (accumulated in f32 scratch).
        Case stored = c;
        stored.grad_logits(GradLogitsDtype::storage).gradients_as(dtype);
        check(stored.problem(), stored.storage());
      }
  }
}

TEST_F(CpuVocabOuter, SameBitsForAnyThreadCount) {
  for (const VocabCut& cut : kVocabCuts) {
    setenv("FLCE_CPU_GRAD_ORDER", cut.order, 1);
    for (Dtype dtype : {Dtype::f32, Dtype::bf16}) {
      SCOPED_TRACE(std::string(cut.order) + ", " + flce::dtype_name(dtype));
      const Case c = head(cut.n, kCutH, kCutV).stored_as(dtype).with_token_weights().softcap(3);
      const Outputs one = run_cpu(c, 1);
      for (int threads : {2, 3}) expect_identical_outputs(run_cpu(c, threads), one);
    }
  }
}

// Stashed scores (Plan::stash_scores): vocab outer keeps the forward
// pieces' f32 scores in grad_W's memory and copies each chunk back instead
// of a second logits GEMM. Exact (the same f32 scores), so judged by the
// plain policy; forced cuts put the stash in grad_W written in place (one
// super-block, H = N: every chunk's grad_W rows reach over its own stash)
// and in a grad_W accumulated in the workspace (bf16 gradients, three
// super-blocks, both layouts).
class CpuStashedScores : public CpuVocabOuter {
 protected:
  void TearDown() override {
    CpuVocabOuter::TearDown();
    unsetenv("FLCE_CPU_STASH");
  }
};

constexpr int64_t kStashH = 64, kStashV = 2 * kTile + 300;

// Whether a step of these shapes stashes under the current env.
bool stashes(int64_t n, Dtype grads, WeightLayout layout = WeightLayout::vh, Dtype storage = Dtype::f32) {
  flce::Problem p = step_shapes(n, kStashH, kStashV);
  static const float none = 0;
  if (layout == WeightLayout::hv) {
    p.w_layout = layout;
    p.w = flce::matrix_view(&none, Dtype::f32, kStashH, kStashV);
    p.grad_w = flce::matrix_view(&none, Dtype::f32, kStashH, kStashV);
  }
  p.x.dtype = p.w.dtype = storage;
  p.grad_x.dtype = p.grad_w.dtype = grads;
  return flce::cpu::make_plan(p, Pass::loss_and_grad, cpu(2)).stash_scores;
}

struct StashCut {
  const char* order;
  int64_t n;
  bool in_place;  // f32 gradients; else the storage dtype's, or f64 for f32 storage
};
// 4 R <= H |grad_W dtype|: R = 64 with f32 grad_W in place (R = N), R = 32
// with a bf16 or f64 grad_W (accumulated in the workspace; N = 70: 32 + 32
// + 6).
const StashCut kStashCuts[] = {{"vocab:64x2", 64, true}, {"vocab:32x2", 70, false}};
Dtype grads_of(const StashCut& cut, Dtype storage) {
  return cut.in_place ? Dtype::f32 : storage == Dtype::f32 ? Dtype::f64 : storage;
}

TEST_F(CpuStashedScores, AgreeWithTheOracleInPlaceAndAccumulated) {
  for (const StashCut& cut : kStashCuts) {
    setenv("FLCE_CPU_GRAD_ORDER", cut.order, 1);
    for (Dtype dtype : {Dtype::f32, Dtype::bf16})
      for (WeightLayout layout : {WeightLayout::vh, WeightLayout::hv}) {
        SCOPED_TRACE(std::string(cut.order) + ", " + flce::dtype_name(dtype) + ", layout " +
                     std::to_string(int(layout)));
        // hv with grad_W in place writes columns: recomputed instead (the control).
        const bool control = layout == WeightLayout::hv && cut.in_place;
        const Dtype grads = grads_of(cut, dtype);
        EXPECT_EQ(stashes(cut.n, grads, layout, dtype), !control);
        const Case c = head(cut.n, kStashH, kStashV).layout(layout).stored_as(dtype).gradients_as(grads)
                           .with_bias().softcap(4).logit_scale(0.8).label_smoothing(0.1).with_class_weights()
                           .z_loss(1e-3).with_token_weights().with_grad_lse().with_grad_entropy()
                           .ignore_rows({3, cut.n - 1});
        check(c.problem(), c.storage(), Pass::loss_and_grad);
        check(c.problem(), c.storage(), Pass::backward);  // grad_entropy: pass 1 runs
        Case stored = c;
        stored.grad_logits(GradLogitsDtype::storage);
        check(stored.problem(), stored.storage());
      }
  }
  // A super-block row too many for the f32 grad_W: recomputed.
  setenv("FLCE_CPU_GRAD_ORDER", "vocab:65x2", 1);
  EXPECT_FALSE(stashes(65, Dtype::f32));
}

TEST_F(CpuStashedScores, NonFiniteScoresAndTheSameBitsForAnyThreadCount) {
  setenv("FLCE_CPU_GRAD_ORDER", "vocab:32x2", 1);
  ASSERT_TRUE(stashes(70, Dtype::f64));
  constexpr double kInf = std::numeric_limits<double>::infinity();
  for (double bad : {std::numeric_limits<double>::quiet_NaN(), kInf, -kInf}) {
    SCOPED_TRACE("value " + std::to_string(bad));
    const Case c = head(70, kStashH, kStashV).gradients_as(Dtype::f64).reduction(Reduction::none)
                       .label_smoothing(0.1);
    DenseProblem d = c.problem();
    d.x[2 * d.h + 3] = bad;
    d.w[7 * d.h + 1] = bad;  // class 7's logit is non-finite in every row
    check(d, c.storage(), Pass::loss_and_grad);
  }
  const Case c = head(70, kStashH, kStashV, 4).gradients_as(Dtype::f64).softcap(3).with_bias();
  const Outputs one = run_cpu(c, 1);
  for (int threads : {2, 3}) expect_identical_outputs(run_cpu(c, threads), one);
}

TEST_F(CpuStashedScores, MalformedValueIsAnErrorNamingIt) {
  setenv("FLCE_CPU_STASH", "no", 1);
  const Outputs out = run_library(head(4, 3, 10).problem(), head(4, 3, 10).storage(), Request{});
  EXPECT_FALSE(out.status.ok());
  EXPECT_NE(out.status.error.find("FLCE_CPU_STASH = 'no'"), std::string::npos) << out.status.error;
}

TEST_F(CpuVocabOuter, MalformedOrderIsAnErrorNamingIt) {
  setenv("FLCE_CPU_GRAD_ORDER", "vocab:0x2", 1);
  const Outputs out = run_library(head(4, 3, 10).problem(), head(4, 3, 10).storage(), Request{});
  EXPECT_FALSE(out.status.ok());
  EXPECT_NE(out.status.error.find("FLCE_CPU_GRAD_ORDER = 'vocab:0x2'"), std::string::npos) << out.status.error;
  // The workspace query plans as if it were unset (a negative chunk wrapped
  // the sizes around before; config_error() is where it is refused).
  const flce::Problem p = step_shapes(4096, 64, 999);
  setenv("FLCE_CPU_GRAD_ORDER", "vocab:5x-1", 1);
  const size_t malformed = flce::cpu::workspace_bytes(flce::cpu::make_plan(p, Pass::backward, cpu(2)), p);
  unsetenv("FLCE_CPU_GRAD_ORDER");
  EXPECT_EQ(malformed, flce::cpu::workspace_bytes(flce::cpu::make_plan(p, Pass::backward, cpu(2)), p));
}

// G below f32's normal range reaches the f32 gradient GEMMs as 0
// (Plan::flush_subnormal_g): with logits 0 and -100, p_1 = e^-100 (about
// 3.7e-44) is subnormal and so is G_1 = p_1, so grad_W_1 = G_1 x_0 is 0. The
// logits entry, whose G is its output (no GEMM), keeps the subnormal.
TEST(CpuFlush, SubnormalDlogitsReachTheGradientGemmsAsZero) {
  float x[1] = {1.0f}, w[2] = {0.0f, -100.0f}, z[2] = {0.0f, -100.0f};
  int64_t y[1] = {0};
  float loss = 0, lse[1] = {0}, gx[1] = {0}, gw[2] = {-1, -1}, gz[2] = {0, 0};
  flce::Problem p;
  p.x = flce::matrix_view(x, Dtype::f32, 1, 1);
  p.w = flce::matrix_view(w, Dtype::f32, 2, 1);
  p.labels = flce::vector_view(y, Dtype::i64, 1);
  p.options.reduction = Reduction::sum;
  p.loss = flce::scalar_view(&loss, Dtype::f32);
  p.lse = flce::vector_view(lse, Dtype::f32, 1);
  p.grad_x = flce::matrix_view(gx, Dtype::f32, 1, 1);
  p.grad_w = flce::matrix_view(gw, Dtype::f32, 2, 1);
  flce::Status s = flce::loss_and_grad(p, cpu(1));
  ASSERT_TRUE(s.ok()) << s.error;
  EXPECT_EQ(gw[1], 0.0f);
  flce::Problem q;
  q.logits = flce::matrix_view(z, Dtype::f32, 1, 2);
  q.labels = p.labels, q.options = p.options, q.loss = p.loss, q.lse = p.lse;
  q.grad_logits = flce::matrix_view(gz, Dtype::f32, 1, 2);
  s = flce::loss_and_grad(q, cpu(1));
  ASSERT_TRUE(s.ok()) << s.error;
  EXPECT_GT(gz[1], 0.0f);
  EXPECT_LT(gz[1], std::numeric_limits<float>::min());
}

// The bf16 copies of G's tiles (Workspace::g16_tiles, [R, 512] each) share
// the vocabulary-outer cut's budget with the super-block's scores, and the
// cut is the same for any thread count: R is the K of grad_W's products and
// the chunk decides which tiles share a grad_x product, so a cut that moved
// with the threads changed the bits (one copy per thread did; and took
// 1 GiB of a bf16 backward at 128 threads before it counted in the budget).
TEST_F(CpuVocabOuter, CopiesOfGFitTheBudgetAndTheCutIgnoresThreads) {
  flce::Problem p = step_shapes(16384, 64, 999);
  p.x.dtype = p.w.dtype = Dtype::bf16;
  p.options.grad_logits_dtype = flce::GradLogitsDtype::storage;
  const flce::cpu::Plan first = flce::cpu::make_plan(p, Pass::backward, cpu(1));
  for (int threads : {1, 2, 8, 128}) {
    SCOPED_TRACE(threads);
    const flce::cpu::Plan plan = flce::cpu::make_plan(p, Pass::backward, cpu(threads));
    ASSERT_TRUE(plan.vocab_outer);
    if (plan.grad_gemm != Dtype::bf16) GTEST_SKIP() << "no bf16 GEMM on this machine: no copies of G";
    EXPECT_EQ(plan.row_block, first.row_block);
    EXPECT_EQ(plan.chunk_tiles, first.chunk_tiles);
    const int64_t scores = plan.row_block * plan.chunk_tiles * kTile * 4;
    const int64_t copies = plan.chunk_tiles * plan.row_block * kTile * 2;
    EXPECT_LE(scores + copies, flce::cpu::kScoreBudgetBytes);
  }
}

// The same, in bits: a bf16 backward with bf16 dlogits whose automatic cut
// is bound by a small budget (FLCE_CPU_SCORE_MIB=2: super-blocks of 256 or
// 512 rows), at 1, 2, 3 and 8 threads.
TEST_F(CpuVocabOuter, AutomaticCutSameBitsForAnyThreadCount) {
  setenv("FLCE_CPU_SCORE_MIB", "2", 1);
  const Case c = head(512, 64, 16 * kTile).stored_as(Dtype::bf16).softcap(3).with_grad_lse()
                     .grad_logits(GradLogitsDtype::storage).gradients_as(Dtype::bf16);
  flce::Problem shapes = step_shapes(512, 64, 16 * kTile);
  shapes.x.dtype = shapes.w.dtype = Dtype::bf16;
  shapes.options.grad_logits_dtype = flce::GradLogitsDtype::storage;
  const bool vocab_outer = flce::cpu::make_plan(shapes, Pass::backward, cpu(1)).vocab_outer;
  Request rq;
  rq.pass = Pass::forward;
  rq.config = cpu(1);
  rq.saved_lse = run_library(c.problem(), c.storage(), rq).lse;
  rq.pass = Pass::backward;
  const Outputs one = run_library(c.problem(), c.storage(), rq);
  ASSERT_TRUE(one.status.ok()) << one.status.error;
  for (int threads : {2, 3, 8}) {
    SCOPED_TRACE(threads);
    rq.config = cpu(threads);
    expect_identical_outputs(run_library(c.problem(), c.storage(), rq), one);
  }
  EXPECT_TRUE(vocab_outer) << "the case meant to take the vocabulary-outer order did not";
}

// grad_x's two task splits of a rows-outer step (Plan::grad_x_vocab_split),
// each forced with FLCE_CPU_GRAD_X_SPLIT: runs of vocabulary tiles (six
// tiles, the last short, over four tasks: 2, 2, 2 and none) into parts
// summed in order, or hidden chunks (80 and 50 columns) x row groups.
class CpuGradXSplit : public ::testing::Test {
 protected:
  void TearDown() override {
    unsetenv("FLCE_CPU_GRAD_X_SPLIT");
    unsetenv("FLCE_CPU_PACK_SCORES");
  }
};

constexpr int64_t kSplitN = 70, kSplitH = 130, kSplitV = 5 * kTile + 100;

TEST_F(CpuGradXSplit, EachSplitAgreesWithTheOracle) {
  for (const char* split : {"vocab", "hidden"}) {
    setenv("FLCE_CPU_GRAD_X_SPLIT", split, 1);
    const flce::cpu::Plan plan =
        flce::cpu::make_plan(step_shapes(kSplitN, kSplitH, kSplitV), Pass::loss_and_grad, cpu());
    ASSERT_FALSE(plan.vocab_outer);
    ASSERT_EQ(plan.grad_x_vocab_split, std::string(split) == "vocab");
    for (Dtype dtype : {Dtype::f32, Dtype::bf16}) {
      SCOPED_TRACE(std::string(split) + ", " + flce::dtype_name(dtype));
      Case c = head(kSplitN, kSplitH, kSplitV).stored_as(dtype).with_bias().label_smoothing(0.1)
                   .ignore_rows({5});
      check(c.problem(), c.storage());
      c.grad_logits(GradLogitsDtype::storage);
      check(c.problem(), c.storage());
    }
  }
}

TEST_F(CpuGradXSplit, VocabSplitSameBitsForAnyThreadCount) {
  setenv("FLCE_CPU_GRAD_X_SPLIT", "vocab", 1);
  for (Dtype dtype : {Dtype::f32, Dtype::bf16}) {
    SCOPED_TRACE(flce::dtype_name(dtype));
    const Case c = head(kSplitN, kSplitH, kSplitV).stored_as(dtype).softcap(3);
    const Outputs one = run_cpu(c, 1);
    for (int threads : {2, 3}) expect_identical_outputs(run_cpu(c, threads), one);
  }
}

TEST_F(CpuGradXSplit, ChosenForSmallHiddenSizesRowsOuter) {
  EXPECT_TRUE(flce::cpu::make_plan(step_shapes(8192, 128, 32768), Pass::loss_and_grad, cpu(2))
                  .grad_x_vocab_split);
  EXPECT_FALSE(flce::cpu::make_plan(step_shapes(4096, 768, 50257), Pass::loss_and_grad, cpu(2))
                   .grad_x_vocab_split);
  flce::Problem no_grad_x = step_shapes(8192, 128, 32768);
  no_grad_x.grad_x = flce::Tensor{};
  EXPECT_FALSE(flce::cpu::make_plan(no_grad_x, Pass::loss_and_grad, cpu(2)).grad_x_vocab_split);
}

// Plan::grad_x_by_tile, forced with FLCE_CPU_GRAD_X_SPLIT=tile (the plan
// takes it itself only where bf16 runs on a matrix unit): bf16 G, rows
// outer, six tiles dealt to four parts (2, 2, 1 and 1) and two tiles (1, 1
// and two empty parts), from packed scores and from f32 ones, with and
// without the gradient filter.
TEST_F(CpuGradXSplit, ByTileAgreesWithTheOracle) {
  if (!bf16_gemm_here()) GTEST_SKIP() << "the default GEMM engine has no bf16 here: no bf16 G to split";
  setenv("FLCE_CPU_GRAD_X_SPLIT", "tile", 1);
  for (int64_t v : {kSplitV, kTile + 100}) {
    flce::Problem shapes = step_shapes(kSplitN, kSplitH, v);
    shapes.x.dtype = shapes.w.dtype = Dtype::bf16;
    shapes.options.grad_logits_dtype = GradLogitsDtype::storage;
    const flce::cpu::Plan plan = flce::cpu::make_plan(shapes, Pass::loss_and_grad, cpu());
    ASSERT_TRUE(plan.grad_x_by_tile);
    ASSERT_FALSE(plan.vocab_outer);
    ASSERT_FALSE(plan.grad_x_vocab_split);
    for (const char* pack : {"1", "0"}) {
      setenv("FLCE_CPU_PACK_SCORES", pack, 1);
      for (double eps : {0.0, double(flce::kFilterEpsAuto)}) {
        SCOPED_TRACE("V " + std::to_string(v) + ", packed scores " + pack + ", filter_eps " +
                     std::to_string(eps));
        Case c = head(kSplitN, kSplitH, v).stored_as(Dtype::bf16).with_bias().label_smoothing(0.1)
                     .ignore_rows({5}).grad_logits(GradLogitsDtype::storage).filter_eps(eps);
        check(c.problem(), c.storage());
      }
    }
  }
}

// A dirty caller workspace (expect_stale_workspace_changes_no_bit), the
// grad_x parts that own no tile included (two tiles, four parts).
TEST_F(CpuGradXSplit, ByTileDirtyCallerWorkspaceSameBits) {
  if (!bf16_gemm_here()) GTEST_SKIP() << "the default GEMM engine has no bf16 here: no bf16 G to split";
  setenv("FLCE_CPU_GRAD_X_SPLIT", "tile", 1);
  const Case c = head(kSplitN, kSplitH, kTile + 100).stored_as(Dtype::bf16).with_bias()
                     .grad_logits(GradLogitsDtype::storage);
  Request own;
  own.config = cpu(2);
  expect_stale_workspace_changes_no_bit(c, own, size_t(16) << 20);
}

TEST_F(CpuGradXSplit, ByTileSameBitsForAnyThreadCount) {
  if (!bf16_gemm_here()) GTEST_SKIP() << "the default GEMM engine has no bf16 here: no bf16 G to split";
  setenv("FLCE_CPU_GRAD_X_SPLIT", "tile", 1);
  const Case c = head(kSplitN, kSplitH, kSplitV).stored_as(Dtype::bf16).softcap(3)
                     .grad_logits(GradLogitsDtype::storage);
  const Outputs one = run_cpu(c, 1);
  for (int threads : {2, 3, 5}) expect_identical_outputs(run_cpu(c, threads), one);
}

// Unforced, tile by tile wherever bf16 products run on a matrix unit and
// the step goes rows outer with bf16 G (S1); never with f32 G.
TEST_F(CpuGradXSplit, ByTileChosenWhereBf16RunsOnAMatrixUnit) {
  flce::Problem s1 = step_shapes(4096, 768, 50257);
  s1.x.dtype = s1.w.dtype = Dtype::bf16;
  s1.options.grad_logits_dtype = GradLogitsDtype::storage;
  const flce::cpu::Plan plan = flce::cpu::make_plan(s1, Pass::loss_and_grad, cpu(2));
  ASSERT_FALSE(plan.vocab_outer);
  EXPECT_EQ(plan.grad_x_by_tile, plan.gemm->bf16_on_matrix_unit()) << plan.gemm->name();
  s1.options.grad_logits_dtype = GradLogitsDtype::f32;
  EXPECT_FALSE(flce::cpu::make_plan(s1, Pass::loss_and_grad, cpu(2)).grad_x_by_tile);
  EXPECT_FALSE(flce::cpu::make_plan(step_shapes(4096, 768, 50257), Pass::loss_and_grad, cpu(2)).grad_x_by_tile);
}

TEST_F(CpuGradXSplit, MalformedValueIsAnErrorNamingIt) {
  setenv("FLCE_CPU_GRAD_X_SPLIT", "rows", 1);
  const Outputs out = run_library(head(4, 3, 10).problem(), head(4, 3, 10).storage(), Request{});
  EXPECT_FALSE(out.status.ok());
  EXPECT_NE(out.status.error.find("FLCE_CPU_GRAD_X_SPLIT = 'rows'"), std::string::npos) << out.status.error;
}

// The plan's own choice: vocab outer where the rows-outer block would be
// short (large V) and there is more than one block. Either order's
// workspace stays within the performance issue's 64 MiB at S4, S2 and the
// production shape, not counting the per-thread W conversion tiles, which
// only a W that needs converting touches (f16, or a strided W).
TEST_F(CpuVocabOuter, ChosenForLargeVocabulariesWithinTheBudget) {
  struct Shape {
    int64_t n, h, v;
    bool vocab_outer;
  };
  // S4 and S2 (and V = 200000 at H = N = 1024) stash their scores in the
  // f32 grad_W (H >= N, one super-block), so vocab outer costs three GEMMs.
  for (Shape s : {Shape{1024, 2304, 256000, true}, Shape{1024, 4096, 128256, true},
                  Shape{131072, 1024, 128256, false}, Shape{4096, 768, 50257, false},
                  Shape{40, 2304, 256000, false}, Shape{1024, 1024, 200000, true}})
    for (Dtype dtype : {Dtype::f32, Dtype::bf16}) {
      SCOPED_TRACE(std::to_string(s.n) + " x " + std::to_string(s.h) + " x " + std::to_string(s.v) + " " +
                   flce::dtype_name(dtype));
      flce::Problem p = step_shapes(s.n, s.h, s.v);
      p.x.dtype = p.w.dtype = dtype;
      const size_t bound = (size_t(64) << 20) + 2 * size_t(kTile * s.h) * 4;
      const flce::cpu::Plan plan = flce::cpu::make_plan(p, Pass::loss_and_grad, cpu(2));
      EXPECT_EQ(plan.vocab_outer, s.vocab_outer);
      EXPECT_EQ(plan.stash_scores, s.vocab_outer);
      if (s.vocab_outer) {
        EXPECT_EQ(plan.row_block, s.n);  // one super-block of every row
      } else {  // blocks within the score budget's cap
        EXPECT_GE(plan.row_block, 1);
        EXPECT_LE(plan.row_block, plan.packed_scores ? flce::cpu::kMaxPackedRowBlock
                                                     : flce::cpu::kMaxRowBlock);
      }
      EXPECT_LE(flce::cpu::workspace_bytes(plan, p), bound);
      setenv("FLCE_CPU_GRAD_ORDER", "vocab", 1);
      const flce::cpu::Plan forced = flce::cpu::make_plan(p, Pass::loss_and_grad, cpu(2));
      unsetenv("FLCE_CPU_GRAD_ORDER");
      EXPECT_TRUE(forced.vocab_outer);
      EXPECT_LE(flce::cpu::workspace_bytes(forced, p), bound);
    }
}

// A backward needs only the saved lse unless it has an entropy cotangent:
// then vocab outer wherever there is more than one row block.
TEST_F(CpuVocabOuter, ChosenForABackwardFromTheSavedLse) {
  flce::Problem p = step_shapes(4096, 768, 50257);
  const flce::cpu::Plan plain = flce::cpu::make_plan(p, Pass::backward, cpu(2));
  EXPECT_TRUE(plain.vocab_outer);
  EXPECT_TRUE(plain.stats_from_inputs);
  EXPECT_FALSE(flce::cpu::make_plan(p, Pass::loss_and_grad, cpu(2)).vocab_outer);
  static const float none = 0;
  p.grad_entropy = flce::vector_view(&none, Dtype::f32, 4096);
  EXPECT_FALSE(flce::cpu::make_plan(p, Pass::backward, cpu(2)).vocab_outer);
  EXPECT_FALSE(flce::cpu::make_plan(step_shapes(200, 768, 50257), Pass::backward, cpu(2)).vocab_outer);
}

// Packed scores (Plan::packed_scores): a bf16 step with bf16 dlogits keeps
// each score as the f16 bits of its running max minus it, so twice the rows
// fit the budget; judged by the policy with u_q (cpu_precision).
class CpuPackedScores : public ::testing::Test {
 protected:
  void SetUp() override {
    if (flce::simd::best_kernels().pack_scores == nullptr)
      GTEST_SKIP() << "the " << flce::simd::best_kernels().isa << " kernel set has no pack_scores: scores stay f32";
    if (!bf16_gemm_here())
      GTEST_SKIP() << "the default GEMM engine has no bf16 here: G stays f32, and scores unpacked";
  }
  void TearDown() override {
    unsetenv("FLCE_CPU_PACK_SCORES");
    unsetenv("FLCE_CPU_STASH");
  }
};

flce::Problem bf16_step(int64_t n, int64_t h, int64_t v) {
  flce::Problem p = step_shapes(n, h, v);
  p.x.dtype = p.w.dtype = Dtype::bf16;
  p.options.grad_logits_dtype = GradLogitsDtype::storage;
  return p;
}

TEST_F(CpuPackedScores, ChosenForBf16DlogitsOnlyAndDoublesTheRowBlock) {
  // S2 and S4 stash their scores vocab outer where they can (CpuStashedScores),
  // which needs no packing.
  EXPECT_TRUE(flce::cpu::make_plan(bf16_step(1024, 4096, 128256), Pass::loss_and_grad, cpu(2)).stash_scores);
  EXPECT_FALSE(flce::cpu::make_plan(bf16_step(1024, 4096, 128256), Pass::loss_and_grad, cpu(2)).packed_scores);
  setenv("FLCE_CPU_STASH", "0", 1);  // the rows-outer choices below
  const flce::Problem s2 = bf16_step(1024, 4096, 128256);
  const flce::cpu::Plan packed = flce::cpu::make_plan(s2, Pass::loss_and_grad, cpu(2));
  EXPECT_TRUE(packed.packed_scores);
  EXPECT_FALSE(packed.vocab_outer);
  EXPECT_EQ(packed.row_block, 192);
  // 64 MiB, not counting the per-thread W conversion tiles, as above.
  EXPECT_LE(flce::cpu::workspace_bytes(packed, s2), (size_t(64) << 20) + 2 * size_t(kTile * 4096) * 4);
  EXPECT_TRUE(flce::cpu::make_plan(s2, Pass::backward, cpu(2)).vocab_outer);  // from the saved lse
  // S4: 96 packed rows, no longer short enough for the vocabulary-outer order.
  EXPECT_FALSE(flce::cpu::make_plan(bf16_step(1024, 2304, 256000), Pass::loss_and_grad, cpu(2)).vocab_outer);
  // At most kMaxPackedRowBlock rows, and never more than N.
  EXPECT_EQ(flce::cpu::make_plan(bf16_step(8192, 128, 32768), Pass::loss_and_grad, cpu(2)).row_block,
            flce::cpu::kMaxPackedRowBlock);
  EXPECT_EQ(flce::cpu::make_plan(bf16_step(300, 128, 32768), Pass::loss_and_grad, cpu(2)).row_block, 300);

  flce::Problem f32_g = s2;
  f32_g.options.grad_logits_dtype = GradLogitsDtype::f32;
  EXPECT_FALSE(flce::cpu::make_plan(f32_g, Pass::loss_and_grad, cpu(2)).packed_scores);
  // A softcap up to 32752 keeps every ref - s within f16's range; above, no
  // codes (ds/dz reads s itself).
  flce::Problem capped = s2;
  capped.options.softcap = 32752;
  EXPECT_TRUE(flce::cpu::make_plan(capped, Pass::loss_and_grad, cpu(2)).packed_scores);
  capped.options.softcap = 32753;
  EXPECT_FALSE(flce::cpu::make_plan(capped, Pass::loss_and_grad, cpu(2)).packed_scores);
  EXPECT_FALSE(flce::cpu::make_plan(s2, Pass::forward, cpu(2)).packed_scores);
  EXPECT_FALSE(flce::cpu::make_plan(step_shapes(1024, 4096, 128256), Pass::loss_and_grad, cpu(2)).packed_scores);
  flce::Problem with_grad_logits = s2;  // it would need the f32 G of every entry
  with_grad_logits.grad_logits = flce::matrix_view(s2.x.data, Dtype::f32, 1024, 128256);
  EXPECT_FALSE(flce::cpu::make_plan(with_grad_logits, Pass::loss_and_grad, cpu(2)).packed_scores);
  setenv("FLCE_CPU_PACK_SCORES", "0", 1);
  const flce::cpu::Plan off = flce::cpu::make_plan(s2, Pass::loss_and_grad, cpu(2));
  EXPECT_FALSE(off.packed_scores);
  EXPECT_EQ(off.row_block, 96);
}

Case packed_case(int64_t n, int64_t h, int64_t v, uint64_t seed = 1) {
  return head(n, h, v, seed).stored_as(Dtype::bf16).grad_logits(GradLogitsDtype::storage);
}

// Every option, both layouts, rows around the packed block (N around 512),
// a V that is not a whole number of tiles.
TEST_F(CpuPackedScores, AgreesWithTheOracleAcrossRowBlocks) {
  const int64_t block = flce::cpu::kMaxPackedRowBlock;
  for (int64_t n : {block - 1, block + 1})
    for (WeightLayout layout : {WeightLayout::vh, WeightLayout::hv}) {
      SCOPED_TRACE("N = " + std::to_string(n) + ", layout " + std::to_string(int(layout)));
      check_all_passes(packed_case(n, 5, kTile + 33).layout(layout).with_bias().softcap(4).logit_scale(0.8)
                           .label_smoothing(0.1).with_class_weights().z_loss(1e-3).with_token_weights()
                           .with_grad_lse().with_grad_entropy().ignore_rows({3, n - 1}));
      check_all_passes(packed_case(n, 5, kTile + 33, 2).layout(layout).reduction(Reduction::sum)
                           .gradients_as(Dtype::f32));
    }
}

TEST_F(CpuPackedScores, NonFiniteScoresKeepTheirMeaning) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  for (double bad : {std::numeric_limits<double>::quiet_NaN(), kInf, -kInf}) {
    SCOPED_TRACE("value " + std::to_string(bad));
    const Case c = packed_case(5, 6, kTile + 9).reduction(Reduction::none).label_smoothing(0.1);
    DenseProblem d = c.problem();
    d.x[2 * d.h + 3] = bad;
    d.w[7 * d.h + 1] = bad;  // class 7's logit is non-finite in every row
    check(d, c.storage(), Pass::loss_and_grad);
  }
}

TEST_F(CpuPackedScores, SameBitsForAnyThreadCount) {
  const Case c = packed_case(600, 9, 3 * kTile + 7).softcap(3).with_bias();
  const Outputs one = run_cpu(c, 1);
  for (int threads : {2, 3}) expect_identical_outputs(run_cpu(c, threads), one);
}

TEST(CpuPackedScoresEnv, MalformedValueIsAnErrorNamingIt) {  // on any machine
  setenv("FLCE_CPU_PACK_SCORES", "yes", 1);
  const Outputs out = run_library(head(4, 3, 10).problem(), head(4, 3, 10).storage(), Request{});
  EXPECT_FALSE(out.status.ok());
  unsetenv("FLCE_CPU_PACK_SCORES");
  EXPECT_NE(out.status.error.find("FLCE_CPU_PACK_SCORES = 'yes'"), std::string::npos) << out.status.error;
}

// Gradient filtering (README, "Gradient filtering"): the filter is a license
// to drop small dlogits. Its results are judged by the policy plus what the
// license allows (Precision::filter_eps: every entry the filter may drop),
// elementwise, on a peaky head (flce bench --data peaky, shrunk) where it
// drops most blocks; and, when every block is dropped, against the exact
// rank-one term that label smoothing leaves.

Case peaky(Dtype storage, uint64_t seed = 1) {
  Case c = Case::peaky_head(300, 40, 5 * kTile + 77, seed);
  c.stored_as(storage).outputs_as(Dtype::f64).filter_eps(flce::kFilterEpsAuto);
  // 16-bit dlogits as GPU kernels use them. In f16 most dlogits of a mean
  // over 300 rows fall below the normal range, where the cast's rounding is
  // the policy's absolute tiny(u_g) / 2.
  if (storage != Dtype::f32) c.grad_logits(GradLogitsDtype::storage);
  return c;
}

TEST(CpuFilter, PeakyHeadSkipsBlocksWithinThePolicy) {
  for (Dtype storage : {Dtype::bf16, Dtype::f16, Dtype::f32}) {
    const std::vector<std::pair<const char*, Case>> cases = {
        {"plain", peaky(storage)},
        {"smoothing, class weights", peaky(storage, 2).label_smoothing(0.1).with_class_weights()},
        {"z-loss, token weights, lse and entropy cotangents",
         peaky(storage, 3).z_loss(1e-3).with_token_weights().with_grad_lse().with_grad_entropy()},
        {"softcap, scale, bias, hv", peaky(storage, 4).softcap(30).logit_scale(0.9).with_bias()
                                          .layout(WeightLayout::hv)},
        {"sum, ignored rows", peaky(storage, 5).reduction(Reduction::sum).ignore_rows({0, 7, 299})},
    };
    for (const auto& [name, c] : cases) {
      SCOPED_TRACE(std::string(flce::dtype_name(storage)) + ": " + name);
      const Outputs out = run_cpu(c, 2);
      // 300 rows: two blocks of up to 256, or one where bf16 scores are
      // packed (blocks of up to 512). bf16's eps 2^-12 drops most of the
      // blocks, f16's 2^-15 some; f32's 2^-28 lies below every probability
      // at this V.
      const int64_t row_blocks = cpu_precision(c.problem(), c.storage()).u_packed > 0 ? 1 : 2;
      EXPECT_EQ(out.status.stats.grad_blocks, row_blocks * 6);
      if (storage == Dtype::bf16) {
        EXPECT_GE(out.status.stats.grad_blocks_skipped, row_blocks * 3);
      }
      if (storage == Dtype::f16) {
        EXPECT_GE(out.status.stats.grad_blocks_skipped, 1);
      }
      for (Pass pass : {Pass::loss_and_grad, Pass::backward}) {
        if (pass == Pass::backward && std::string(name) != "plain") continue;  // one is enough
        const DenseProblem d = c.problem();
        Precision precision = cpu_precision(d, c.storage());
        precision.filter_eps = flce::filter_eps_for(d.options, storage);
        expect_agreement(d, c.storage(), pass, cpu(), precision);
      }
    }
  }
}

TEST(CpuFilter, OffWithSoftcapAndSmoothingTogether) {
  const Outputs out = run_cpu(peaky(Dtype::bf16).softcap(30).label_smoothing(0.1), 2);
  EXPECT_EQ(out.status.stats.grad_blocks, 0);  // the smoothing term is not rank one there
  EXPECT_EQ(out.status.stats.grad_blocks_skipped, 0);
}

TEST(CpuFilter, EveryBlockDroppedLeavesTheExactSmoothingTerm) {
  // With eps huge every block is dropped: grad_x_i = u_i sum_j c_j W_j and
  // grad_W_j = c_j sum_i u_i x_i, u_i = -e / (V D) for a plain mean. The cpu
  // forms both in double from class weights rounded to f32 (2^-24 each, on
  // the magnitude sum sum_j |c_j W_jk|) and rounds the result to f32 once
  // (2^-24 |value|); the double sums add (V + N) 2^-53 of their magnitudes,
  // well inside a second 2^-24 of the magnitude sums.
  // f32 gradients accumulate in grad_w itself, which starts as NaN here and
  // which no GEMM writes; f64 ones accumulate in an f32 scratch, copied out.
  const double e = 0.2;
  for (WeightLayout layout : {WeightLayout::vh, WeightLayout::hv})
  for (Dtype grads : {Dtype::f64, Dtype::f32}) {
    SCOPED_TRACE(std::string(layout == WeightLayout::hv ? "hv" : "vh") + ", " + flce::dtype_name(grads));
    Case c = head(70, 24, 2 * kTile + 5).label_smoothing(e).with_class_weights().layout(layout)
                 .filter_eps(1e300).ignore_rows({3}).gradients_as(grads);
    const DenseProblem d = c.problem();
    const Outputs out = run_cpu(c, 2);
    EXPECT_EQ(out.status.stats.grad_blocks_skipped, out.status.stats.grad_blocks);
    auto kept = [&](int64_t i) { return d.labels[i] != d.options.ignore_index; };
    double denom = 0;
    for (int64_t i = 0; i < d.n; ++i)
      if (kept(i)) denom += d.class_weights[d.labels[i]];
    const double u = -e / (double(d.v) * denom);
    std::vector<double> cw(d.h, 0.0), cw_mag(d.h, 0.0), ux(d.h, 0.0), ux_mag(d.h, 0.0);
    for (int64_t j = 0; j < d.v; ++j)
      for (int64_t k = 0; k < d.h; ++k) {
        cw[k] += d.class_weights[j] * d.weight(j, k);
        cw_mag[k] += std::fabs(d.class_weights[j] * d.weight(j, k));
      }
    for (int64_t i = 0; i < d.n; ++i)
      for (int64_t k = 0; k < d.h && kept(i); ++k) {
        ux[k] += u * d.x[i * d.h + k];
        ux_mag[k] += std::fabs(u * d.x[i * d.h + k]);
      }
    std::vector<double> want_x(d.n * d.h), bound_x(d.n * d.h), want_w(d.v * d.h), bound_w(d.v * d.h);
    for (int64_t i = 0; i < d.n; ++i)
      for (int64_t k = 0; k < d.h; ++k) {
        want_x[i * d.h + k] = kept(i) ? u * cw[k] : 0.0;
        bound_x[i * d.h + k] = 0x1p-23 * std::fabs(u) * cw_mag[k] + 0x1p-24 * std::fabs(want_x[i * d.h + k]);
      }
    for (int64_t j = 0; j < d.v; ++j)
      for (int64_t k = 0; k < d.h; ++k) {
        const int64_t at = d.w_index(j, k);
        want_w[at] = d.class_weights[j] * ux[k];
        bound_w[at] = 0x1p-23 * d.class_weights[j] * ux_mag[k] + 0x1p-24 * std::fabs(want_w[at]);
      }
    EXPECT_TRUE(within_bounds("grad_x", out.grad_x, want_x, bound_x, d.h));
    EXPECT_TRUE(within_bounds("grad_w", out.grad_w, want_w, bound_w));
  }
}

TEST(CpuFilter, SameBitsForAnyThreadCount) {
  const Case c = peaky(Dtype::bf16).label_smoothing(0.1).with_bias();
  const Outputs one = run_cpu(c, 1);
  EXPECT_GT(one.status.stats.grad_blocks_skipped, 0);
  for (int threads : {2, 3}) {
    SCOPED_TRACE("threads = " + std::to_string(threads));
    expect_identical_outputs(run_cpu(c, threads), one);
  }
}

// Calls that ask for part of what the backend can write, on each of its
// plans (cpu::Plan): rows outer with the vocabulary and the hidden split of
// grad_x, vocabulary outer in super-blocks, stashed scores, the gradient
// filter. What a call asks for changes what the plan runs (softmax_extras,
// which gradient GEMMs, copies and accumulators), so each subset is judged
// against the oracle as the whole call is.
struct PlanCase {
  const char* name;
  const char* grad_order;  // FLCE_CPU_GRAD_ORDER, or null for the default
  Case c;
};

std::vector<PlanCase> plan_cases() {
  return {
      {"rows outer, vocabulary split", nullptr,
       head(70, 20, 2 * kTile + 17).with_bias().softcap(3).z_loss(0.01)},
      {"rows outer, hidden split, hv", nullptr,
       head(40, 300, kTile + 9).layout(WeightLayout::hv).with_bias().label_smoothing(0.1)
           .with_class_weights()},
      {"vocabulary outer", "vocab:100x2",
       head(250, 24, 2 * kTile + 428).with_bias().softcap(4).ignore_rows({3})},
      {"stashed scores", "vocab:32x2",
       head(70, kStashH, kStashV).gradients_as(Dtype::f64).with_bias().label_smoothing(0.1)},
      {"filter", nullptr, peaky(Dtype::f16, 3).with_bias().label_smoothing(0.1)},
  };
}

class CpuPlanSubsets : public CpuVocabOuter {
 protected:
  static void use(const PlanCase& pc) {
    if (pc.grad_order) setenv("FLCE_CPU_GRAD_ORDER", pc.grad_order, 1);
    else unsetenv("FLCE_CPU_GRAD_ORDER");
    // (with grad_W: stashing needs its memory)
    if (std::string(pc.name) == "stashed scores") {
      EXPECT_TRUE(stashes(70, Dtype::f64));
    }
  }
  // The policy, with the filter's license where the case filters.
  static Precision policy(const Case& c) {
    const DenseProblem d = c.problem();
    Precision p = cpu_precision(d, c.storage());
    if (d.options.filter_eps != 0) p.filter_eps = flce::filter_eps_for(d.options, c.storage().inputs);
    return p;
  }
};

TEST_F(CpuPlanSubsets, LossAndLseAloneOrEveryRowOutputButTheArgmax) {
  for (const PlanCase& pc : plan_cases()) {
    if (std::string(pc.name) == "filter") continue;  // slow, and its smoothing keeps the sums on
    use(pc);
    // (A backward writes no per-row output: its subsets are the step's.)
    for (RowOutputs rows : {RowOutputs::none, RowOutputs::all_but_argmax})
      for (Pass pass : {Pass::forward, Pass::loss_and_grad}) {
        SCOPED_TRACE(std::string(pc.name) + (rows == RowOutputs::none ? ", loss and lse" : ", no argmax") +
                     ", " + flce::pass_name(pass));
        expect_agreement(pc.c.problem(), pc.c.storage(), pass, cpu(), policy(pc.c), false,
                         WeightGradients::elementwise, rows);
      }
  }
}

// grad_x alone (a frozen head), grad_W alone, grad_W with grad_b (a frozen
// trunk), grad_x with grad_b: no cpu test asked for fewer than all three
// before. Backward for the subsets without grad_x.
TEST_F(CpuPlanSubsets, EachGradientAloneOrInPairs) {
  const GradientSet subsets[] = {{true, false, false}, {false, true, false},
                                 {false, true, true}, {true, false, true}};
  for (const PlanCase& pc : plan_cases()) {
    use(pc);
    for (const GradientSet& g : subsets)
      for (Pass pass : {Pass::loss_and_grad, Pass::backward}) {
        if (pass == Pass::backward && g.x) continue;
        SCOPED_TRACE(std::string(pc.name) + ", grad_x " + std::to_string(g.x) + " grad_w " +
                     std::to_string(g.w) + " grad_bias " + std::to_string(g.bias) + ", " +
                     flce::pass_name(pass));
        expect_agreement(pc.c.problem(), pc.c.storage(), pass, cpu(), policy(pc.c), false,
                         WeightGradients::elementwise, RowOutputs::all, Views::contiguous, g);
      }
  }
}

// A dirty caller workspace (expect_stale_workspace_changes_no_bit) on
// every plan and pass.
TEST_F(CpuPlanSubsets, AStaleCallerWorkspaceGivesTheBitsOfTheBackendsOwn) {
  std::vector<PlanCase> cases = plan_cases();
  cases.push_back({"logits", nullptr, logits(30, 2 * kTile + 5).label_smoothing(0.1).with_grad_entropy()});
  for (const PlanCase& pc : cases) {
    use(pc);
    for (Pass pass : {Pass::forward, Pass::backward, Pass::loss_and_grad}) {
      SCOPED_TRACE(std::string(pc.name) + ", " + flce::pass_name(pass));
      Request own;
      own.pass = pass;
      own.config = cpu(2);
      if (pass == Pass::backward) {
        Request fwd = own;
        fwd.pass = Pass::forward;
        own.saved_lse = run_library(pc.c.problem(), pc.c.storage(), fwd).lse;
      }
      expect_stale_workspace_changes_no_bit(pc.c, own, size_t(96) << 20);
    }
  }
}

// Every plan on every GEMM engine, with f32 gradients, which the plans
// write in place (grad_W at its row stride, and on vocabulary outer a dense
// grad_x), and with each 2-D array a slice of a padded buffer
// (Views::padded_rows; the padding must stay unread and unwritten). The
// other plan tests run the default engine on contiguous arrays and f64
// gradients, which go through the backend's accumulators instead. The
// stash in an in-place grad_W needs one super-block over all rows and a
// dense grad_W: run apart (the "stashed scores" case's f32 runs recompute).
TEST_F(CpuPlanSubsets, EveryPlanOnEveryGemmEngineInPlaceAndWithPaddedRows) {
  for (const flce::cpu::GemmEngine* engine : flce::cpu::gemm_engines()) {
    setenv("FLCE_CPU_GRAD_ORDER", "vocab:64x2", 1);
    EXPECT_TRUE(stashes(64, Dtype::f32));
    const Case stash = head(64, kStashH, kStashV).with_bias().label_smoothing(0.1).gradients_as(Dtype::f32);
    SCOPED_TRACE(std::string(engine->name()) + ", scores stashed in grad_W");
    expect_agreement(stash.problem(), stash.storage(), Pass::loss_and_grad, cpu(0, engine->name()),
                     policy(stash));
    for (const PlanCase& pc : plan_cases()) {
      use(pc);
      Case f32 = pc.c;
      f32.gradients_as(Dtype::f32);
      const struct {
        const Case& c;
        Pass pass;
        Views views;
      } runs[] = {{pc.c, Pass::forward, Views::padded_rows},
                  {f32, Pass::loss_and_grad, Views::padded_rows},
                  {f32, Pass::loss_and_grad, Views::contiguous}};
      for (const auto& run : runs) {
        SCOPED_TRACE(std::string(engine->name()) + ", " + pc.name + ", " + flce::pass_name(run.pass) +
                     (&run.c == &f32 ? ", f32 gradients" : "") +
                     (run.views == Views::padded_rows ? ", padded rows" : ""));
        expect_agreement(run.c.problem(), run.c.storage(), run.pass, cpu(0, engine->name()), policy(run.c),
                         false, WeightGradients::elementwise, RowOutputs::all, run.views);
      }
    }
  }
  unsetenv("FLCE_CPU_GRAD_ORDER");
  // The logits entry (no GEMM): grad_logits apart and over the logits.
  Case c = logits(30, 2 * kTile + 5).label_smoothing(0.1).with_grad_entropy();
  c.gradients_as(Dtype::f32);
  for (bool in_place : {false, true}) {
    SCOPED_TRACE(in_place ? "logits, grad_logits in place" : "logits");
    expect_agreement(c.problem(), c.storage(), Pass::loss_and_grad, cpu(), cpu_precision(c.problem(), c.storage()),
                     in_place, WeightGradients::elementwise, RowOutputs::all, Views::padded_rows);
  }
}

}  // namespace
}  // namespace flce_test

// An exception thrown inside the backend's parallel loops leaves them as an
// exception (the OpenMP runtime would otherwise terminate the process): the
// lowest index's, after every other index has run.
TEST(CpuParallelFor, ExceptionsLeaveTheLoopLowestIndexFirst) {
  for (int threads : {1, 2, 3}) {
    std::vector<std::atomic<int>> ran(40);
    try {
      flce::parallel_for(threads, 0, 40, [&](int64_t i) {
        ran[size_t(i)]++;
        if (i == 29 || i == 7 || i == 8) throw std::runtime_error("index " + std::to_string(i));
      });
      ADD_FAILURE() << "no exception left the loop (" << threads << " threads)";
    } catch (const std::runtime_error& e) {
      EXPECT_STREQ(e.what(), "index 7") << threads << " threads";
    }
    for (size_t i = 0; i < ran.size(); ++i) EXPECT_EQ(ran[i].load(), 1) << "index " << i;
  }
  int sum = 0;  // no exception: every index once, in a range not starting at 0
  flce::parallel_for(1, 5, 9, [&](int64_t i) { sum += int(i); });
  EXPECT_EQ(sum, 5 + 6 + 7 + 8);
}
