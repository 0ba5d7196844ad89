// The tolerance policy's bounds on three fixed problems, kept in
// tests/policy_golden.txt, which the Python port (flce.testing's _bounds.py,
// tests/python/test_package_testing.py) must reproduce to rounding.
//
// This test fails when the C++ bounds move away from the file. After a
// deliberate change to the policy, rewrite the file from the C++ bounds:
//   FLCE_UPDATE_POLICY_GOLDEN=1 build/tests/flce_tests --gtest_filter='PolicyGolden.*'
// and port the same change to _bounds.py, whose test then checks the port.
//
// File format: one line per (problem, output), "problem output v0 v1 ...",
// values printed with 17 significant digits ("inf" where the bound is
// infinite); '#' starts a comment line.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "support/brute_force.h"
#include "support/tolerance.h"

namespace flce_test {
namespace {

const char* golden_path() { return FLCE_TESTS_DIR "/policy_golden.txt"; }

// Problem 0: a head with every option, bf16 storage, an f16 dlogits cast
// (whose tiny(u_g) / 2 is large enough to show in the file),
// scores read back from f16 differences (u_q, the cpu backend's packed
// scores), a saved f32 lse, f32 outputs (the Python test's
// _golden_problems()[0]).
DenseProblem head_problem(Precision* pr) {
  DenseProblem d;
  d.n = 3, d.h = 4, d.v = 5;
  for (int64_t i = 0; i < d.n; ++i)
    for (int64_t k = 0; k < d.h; ++k) d.x.push_back(std::sin(1.3 * double(i) + 0.7 * double(k)));
  for (int64_t j = 0; j < d.v; ++j)
    for (int64_t k = 0; k < d.h; ++k) d.w.push_back(std::cos(0.9 * double(j) - 0.4 * double(k)) / 2);
  for (int64_t j = 0; j < d.v; ++j) d.bias.push_back(0.1 * double(j) - 0.3);
  d.labels = {2, -100, 4};
  d.token_weights = {1.0, 0.5, 2.0};
  d.class_weights = {1.0, 0.5, 2.0, 1.5, 0.25};
  d.grad_lse = {0.5, -1.0, 0.25};
  d.grad_entropy = {-0.3, 0.2, 0.7};
  d.options.logit_scale = 1.7, d.options.softcap = 2.5;
  d.options.label_smoothing = 0.1, d.options.z_loss = 0.01;
  d.options.reduction = flce::Reduction::mean;
  pr->u_accum = 0x1p-24, pr->u_store = 0x1p-8, pr->u_grad = 0x1p-11, pr->u_packed = 0x1p-11;
  pr->u_saved_lse = 0x1p-24, pr->u_out = 0x1p-24;
  return d;
}

// Problem 1: the logits entry with a -inf logit, ignore_index -1, no
// reduction, grad_logits cast to f16 (as a 16-bit grad_logits is), f64
// outputs (_golden_problems()[1]).
DenseProblem logits_problem(Precision* pr) {
  DenseProblem d;
  d.n = 4, d.v = 6, d.logits_entry = true;
  for (int64_t i = 0; i < d.n; ++i)
    for (int64_t j = 0; j < d.v; ++j) d.logits.push_back(3.0 * std::cos(double(i) * 1.1 + double(j) * 0.6));
  d.logits[1] = -INFINITY;
  d.labels = {1, 0, 5, -1};
  d.grad_loss = {1.0, -2.0, 0.5, 3.0};
  d.grad_entropy = {0.1, 0.2, -0.3, 0.4};
  d.options.ignore_index = -1;
  d.options.reduction = flce::Reduction::none;
  d.options.label_smoothing = 0.2;
  pr->u_accum = pr->u_store = 0x1p-24, pr->u_grad = 0x1p-11, pr->u_saved_lse = 0, pr->u_out = 0x1p-53;
  return d;
}

// Problem 2: a head with a bias and without softcap, with label smoothing (G' = G - u c^T)
// and class weights, bf16 storage, dlogits cast to bf16 (cast_underflow's
// bf16 branch), and gradient filtering with a large eps, so that some of
// its entries fall within the filter's allowance (_golden_problems()[2]).
DenseProblem filtered_problem(Precision* pr) {
  DenseProblem d;
  d.n = 4, d.h = 3, d.v = 6;
  for (int64_t i = 0; i < d.n; ++i)
    for (int64_t k = 0; k < d.h; ++k) d.x.push_back(2.0 * std::sin(0.8 * double(i) - 1.1 * double(k)));
  for (int64_t j = 0; j < d.v; ++j)
    for (int64_t k = 0; k < d.h; ++k) d.w.push_back(std::cos(1.7 * double(j) + 0.5 * double(k)));
  for (int64_t j = 0; j < d.v; ++j) d.bias.push_back(0.2 * double(j % 3) - 0.1);
  d.labels = {0, 3, 5, 1};
  d.class_weights = {1.0, 2.0, 0.5, 1.0, 1.5, 0.75};
  d.grad_lse = {0.0, 0.25, 0.0, -0.5};
  d.options.label_smoothing = 0.1, d.options.z_loss = 0.02;
  d.options.reduction = flce::Reduction::sum;
  pr->u_accum = 0x1p-24, pr->u_store = 0x1p-8, pr->u_grad = 0x1p-8, pr->u_out = 0x1p-24;
  pr->filter_eps = 0x1p-4;
  return d;
}

using Golden = std::map<std::string, std::vector<double>>;  // "problem output" -> bounds

Golden computed() {
  Golden g;
  for (int which : {0, 1, 2}) {
    Precision pr;
    const DenseProblem d = which == 0   ? head_problem(&pr)
                           : which == 1 ? logits_problem(&pr)
                                        : filtered_problem(&pr);
    const Bounds b = error_bounds(d, brute_force(d), pr);
    const std::string p = std::to_string(which) + " ";
    g[p + "lse"] = b.lse, g[p + "logprob"] = b.logprob, g[p + "entropy"] = b.entropy;
    g[p + "zloss"] = b.zloss, g[p + "loss"] = b.loss;
    if (which != 1) {
      g[p + "grad_x"] = b.grad_x, g[p + "grad_w"] = b.grad_w, g[p + "grad_bias"] = b.grad_bias;
    } else {
      g[p + "grad_logits"] = b.grad_logits;
    }
  }
  return g;
}

Golden read_golden(const std::string& path) {
  Golden g;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream fields(line);
    std::string problem, output, value;
    fields >> problem >> output;
    std::vector<double>& values = g[problem + " " + output];
    while (fields >> value) values.push_back(std::strtod(value.c_str(), nullptr));
  }
  return g;
}

void write_golden(const std::string& path, const Golden& g) {
  std::ofstream out(path);
  out << "# Tolerance-policy bounds of three fixed problems (tests/test_policy_golden.cpp\n"
         "# writes them; tests/python/test_package_testing.py checks the Python port).\n";
  char buf[40];
  for (const auto& [key, values] : g) {
    out << key;
    for (double v : values) {
      std::snprintf(buf, sizeof buf, " %.17g", v);
      out << buf;
    }
    out << "\n";
  }
}

TEST(PolicyGolden, CppBoundsMatchTheSharedFile) {
  const Golden now = computed();
  if (const char* env = std::getenv("FLCE_UPDATE_POLICY_GOLDEN"); env && std::string(env) == "1") {
    write_golden(golden_path(), now);
    GTEST_SKIP() << "rewrote " << golden_path() << " from the C++ bounds";
  }
  const Golden file = read_golden(golden_path());
  ASSERT_EQ(file.size(), now.size()) << golden_path() << " is missing outputs (or unreadable)";
  for (const auto& [key, values] : now) {
    ASSERT_TRUE(file.count(key)) << key << " is not in " << golden_path();
    const std::vector<double>& want = file.at(key);
    ASSERT_EQ(want.size(), values.size()) << key;
    for (size_t e = 0; e < values.size(); ++e) {
      const bool same = values[e] == want[e] || std::fabs(values[e] - want[e]) <= 1e-12 * std::fabs(want[e]);
      EXPECT_TRUE(same) << key << "[" << e << "]: C++ " << values[e] << ", file " << want[e];
    }
  }
}

}  // namespace
}  // namespace flce_test
