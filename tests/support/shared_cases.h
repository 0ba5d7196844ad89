// Cases every backend's suite runs (tests/test_cpu.cpp, tests/test_cuda.cpp),
// built with the suite's own head()/logits() makers so that they carry its
// storage dtypes: each option alone, large logits, all rows ignored. Each
// suite adds the shapes that cross its own tiles.
#pragma once

#include <cstdint>
#include <vector>

#include "support/random_problem.h"

namespace flce_test {

using HeadMaker = Case (*)(int64_t n, int64_t h, int64_t v, uint64_t seed);
using LogitsMaker = Case (*)(int64_t n, int64_t v, uint64_t seed);

// Every option once on a small head, and the three reductions with all
// cotangents.
std::vector<Case> each_option_alone(HeadMaker head);

// |logits| of 100 and 1000 with bias, smoothing + entropy, softcap 30, and
// the logits entry; `rows` rows, the first case `wide_v` classes wide.
std::vector<Case> large_logit_cases(HeadMaker head, LogitsMaker logits, int64_t rows,
                                    int64_t wide_v);

// Every row ignored, without and with the lse and entropy cotangents.
std::vector<Case> all_rows_ignored(HeadMaker head);

}  // namespace flce_test
