// The cpu backend against the brute force under the float32 tolerance
// policy: every option and combination, dtype, layout and entry, at shapes
// that straddle the tile boundaries, with large, NaN and Inf logits; and its
// determinism across thread counts. ctest runs this suite once per ISA the
// machine has (FLCE_MAX_ISA, see tests/CMakeLists.txt).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

#include "cpu/gemm/gemm.h"
#include "cpu/plan.h"
#include "flce/flce.h"
#include "simd/kernels.h"
#include "support/agreement.h"
#include "support/shared_cases.h"

namespace flce_test {
namespace {

using flce::Dtype;
using flce::GradLogitsDtype;
using flce::Pass;
using flce::Reduction;
using flce::WeightLayout;

constexpr int64_t kTile = flce::cpu::kVocabTile;

flce::RunConfig cpu(int threads = 0, std::string gemm = "") {
  flce::RunConfig config;
  config.backend = "cpu";
  config.threads = threads;
  config.gemm = std::move(gemm);
  return config;
}

void check(const DenseProblem& d, const Storage& st, Pass pass = Pass::loss_and_grad,
           const flce::RunConfig& config = cpu(), bool in_place = false) {
  expect_agreement(d, st, pass, config, float32_precision(d, st), in_place);
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
  EXPECT_EQ(run_library(c.problem(), c.storage(), rq).status.backend, "cpu");
}

TEST(CpuBasics, DeclinesFloat64StorageWithAReason) {
  const Case c = Case::head(3, 4, 5).stored_as(Dtype::f64);
  Request rq;
  rq.config = cpu();
  const Outputs forced = run_library(c.problem(), c.storage(), rq);
  EXPECT_FALSE(forced.status.ok());
  EXPECT_NE(forced.status.error.find("f64"), std::string::npos) << forced.status.error;
  rq.config = flce::RunConfig{};
  EXPECT_EQ(run_library(c.problem(), c.storage(), rq).status.backend, "reference");
}

TEST(CpuBasics, UnknownGemmEngineIsAnError) {
  const Case c = head(3, 4, 5);
  Request rq;
  rq.config = flce::RunConfig{};
  rq.config.gemm = "nope";
  const Outputs out = run_library(c.problem(), c.storage(), rq);
  EXPECT_FALSE(out.status.ok());
  EXPECT_NE(out.status.error.find("nope"), std::string::npos) << out.status.error;
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
}

TEST(CpuTiles, HiddenAroundTheChunk) {
  for (int64_t h : {int64_t(1), flce::cpu::kHiddenChunk, flce::cpu::kHiddenChunk + 1})
    check(head(4, h, 33).with_bias().problem(), head(4, h, 33).storage());
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

Outputs run_cpu(const Case& c, int threads, Pass pass = Pass::loss_and_grad) {
  Request rq;
  rq.pass = pass;
  rq.config = cpu(threads);
  Outputs out = run_library(c.problem(), c.storage(), rq);
  EXPECT_TRUE(out.status.ok()) << out.status.error;
  return out;
}

TEST(CpuDeterminism, SameBitsForAnyThreadCountAndRun) {
  for (const Case& c : {head(300, 20, 3 * kTile + 17).with_bias().with_token_weights().softcap(3)
                            .label_smoothing(0.1).with_grad_entropy(),
                        head(70, 300, kTile + 1).layout(WeightLayout::hv).reduction(Reduction::sum)
                            .stored_as(Dtype::bf16),
                        logits(70, 2 * kTile + 1).reduction(Reduction::none).with_grad_loss()}) {
    const Outputs one = run_cpu(c, 1);
    for (int threads : {1, 2, 3}) {
      SCOPED_TRACE("threads = " + std::to_string(threads));
      expect_identical_outputs(run_cpu(c, threads), one);
    }
  }
}

}  // namespace
}  // namespace flce_test
