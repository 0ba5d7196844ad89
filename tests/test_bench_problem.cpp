// The reference GEMM of `flce bench` and flce_benchmarks (src/cli/bench_problem.h):
// its blocks cover the logits exactly and share the work evenly between
// threads, so that no thread idles while another finishes its share.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "cli/bench_problem.h"

namespace {

using flce::cli::logits_gemm_blocks;
using flce::cli::median;
using flce::cli::LogitsGemmBlocks;

// The logits each thread computes under OpenMP's static schedule of the
// blocks (contiguous chunks, the first `count % threads` threads one more).
std::vector<int64_t> work_per_thread(const LogitsGemmBlocks& b, int64_t n, int64_t v, int threads) {
  const int64_t count = b.row_blocks * b.col_blocks;
  std::vector<int64_t> work(size_t(threads), 0);
  int64_t k = 0;
  for (int t = 0; t < threads; ++t)
    for (int64_t c = 0; c < count / threads + (t < count % threads ? 1 : 0); ++c, ++k) {
      const int64_t i0 = (k / b.col_blocks) * b.rows, j0 = (k % b.col_blocks) * b.cols;
      work[size_t(t)] += std::min(b.rows, n - i0) * std::min(b.cols, v - j0);
    }
  return work;
}

TEST(BenchGemmBlocks, CoverTheLogitsInBoundedBlocks) {
  for (int64_t n : {1, 7, 4096, 4097, 8192, 10000})
    for (int64_t v : {1, 63, 64, 2048, 2049, 50257, 256000})
      for (int threads : {1, 2, 3, 16}) {
        SCOPED_TRACE(testing::Message() << n << " x " << v << ", " << threads << " threads");
        const LogitsGemmBlocks b = logits_gemm_blocks(n, v, threads);
        EXPECT_LE(b.rows, 4096);
        EXPECT_LE(b.cols, 2048);
        // Every block starts inside the logits, and together they reach the end.
        EXPECT_LT((b.row_blocks - 1) * b.rows, n);
        EXPECT_GE(b.row_blocks * b.rows, n);
        EXPECT_LT((b.col_blocks - 1) * b.cols, v);
        EXPECT_GE(b.col_blocks * b.cols, v);
        int64_t total = 0;
        for (int64_t w : work_per_thread(b, n, v, threads)) total += w;
        EXPECT_EQ(total, n * v);
      }
}

TEST(BenchGemmBlocks, ShareTheWorkEvenlyAtTheBenchmarkShapes) {
  // S1-S4 and one block's worth, at 2 to 8 threads: no thread does more
  // than 1% above an even share (the 4096 x 2048 blocks gave one of two
  // threads 6% more at S1, and all of the 4096 x 2048 shape to one thread).
  const int64_t shapes[][2] = {{4096, 50257}, {1024, 128256}, {8192, 32768}, {1024, 256000},
                               {4096, 2048}};
  for (const auto& [n, v] : shapes)
    for (int threads : {2, 3, 4, 8}) {
      SCOPED_TRACE(testing::Message() << n << " x " << v << ", " << threads << " threads");
      const auto work = work_per_thread(logits_gemm_blocks(n, v, threads), n, v, threads);
      const int64_t most = *std::max_element(work.begin(), work.end());
      EXPECT_LE(double(most), 1.01 * double(n * v) / threads);
    }
}

TEST(BenchMedian, OfAnEvenCountIsTheMeanOfTheMiddleTwo) {
  // It was the upper one: with --reps 2, the slower run.
  EXPECT_EQ(median({3.0}), 3.0);
  EXPECT_EQ(median({4.0, 2.0}), 3.0);
  EXPECT_EQ(median({5.0, 1.0, 3.0}), 3.0);
  EXPECT_EQ(median({8.0, 1.0, 2.0, 4.0}), 3.0);
}

}  // namespace
