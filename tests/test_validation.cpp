// Tests for src/validate.cpp through the public API: every kind of bad input
// gets an error status whose message names the argument and the offending
// value, and leaves every output untouched; NaN and Inf inside the data
// propagate to the affected rows without a crash.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "flce/flce.h"

namespace {

using flce::Dtype;
using flce::Pass;
using flce::Problem;
using flce::Reduction;
using flce::RunConfig;
using flce::Status;
using flce::Tensor;
using flce::WeightLayout;

constexpr int64_t N = 4, H = 3, V = 5;
constexpr double kSentinel = 12345;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

using Call = Status (*)(const Problem&, const RunConfig&);

// A pointer that must never be dereferenced: validation has to reject the
// problem from the shapes alone.
void* fake_pointer() { return reinterpret_cast<void*>(uintptr_t{0x1000}); }

Tensor vec(void* data, Dtype dtype, int64_t n) { return flce::vector_view(data, dtype, n); }
Tensor mat(void* data, Dtype dtype, int64_t r, int64_t c) {
  return flce::matrix_view(data, dtype, r, c);
}

// A small valid problem (N = 4, H = 3, V = 5) with f32 inputs and f64 outputs,
// and every output buffer filled with kSentinel so that a rejected call can
// be seen not to have written anything.
class Validation : public ::testing::Test {
 protected:
  std::vector<float> x, w, bias, logits, token_w, class_w;
  std::vector<int64_t> labels = {0, 4, 2, 1};
  // Cotangents.
  std::vector<double> grad_loss = std::vector<double>(N, 1.0),
                      grad_lse = std::vector<double>(N, 0.5),
                      grad_entropy = std::vector<double>(N, 0.25);
  // Outputs.
  std::vector<double> loss, lse, logprob, entropy, zloss, grad_x, grad_w, grad_bias, grad_logits;
  std::vector<int64_t> argmax;

  Validation() {
    for (int64_t i = 0; i < N * H; ++i) x.push_back(float(0.25 * ((i * 7) % 11) - 1.0));
    for (int64_t i = 0; i < V * H; ++i) w.push_back(float(0.125 * ((i * 5) % 13) - 0.75));
    for (int64_t j = 0; j < V; ++j) bias.push_back(float(0.1 * j - 0.2));
    for (int64_t i = 0; i < N * V; ++i) logits.push_back(float(0.3 * ((i * 3) % 7) - 0.9));
    token_w = {1.0f, 0.5f, 2.0f, 1.0f};
    class_w = {1.0f, 2.0f, 0.5f, 1.0f, 1.5f};
    fill();
  }

  std::vector<std::vector<double>*> real_outputs() {
    return {&loss, &lse, &logprob, &entropy, &zloss, &grad_x, &grad_w, &grad_bias, &grad_logits};
  }
  void fill() {
    for (auto* b : real_outputs()) b->assign(size_t(N * V * H), kSentinel);
    argmax.assign(size_t(N), int64_t(kSentinel));
  }
  // Every output buffer still holds only the sentinel.
  bool untouched() {
    for (auto* b : real_outputs())
      for (double v : *b)
        if (v != kSentinel) return false;
    for (int64_t v : argmax)
      if (v != int64_t(kSentinel)) return false;
    return true;
  }

  // The inputs of the head entry (mean reduction, no outputs).
  Problem head() {
    Problem p;
    p.x = mat(x.data(), Dtype::f32, N, H);
    p.w = mat(w.data(), Dtype::f32, V, H);
    p.bias = vec(bias.data(), Dtype::f32, V);
    p.labels = vec(labels.data(), Dtype::i64, N);
    p.token_weights = vec(token_w.data(), Dtype::f32, N);
    p.class_weights = vec(class_w.data(), Dtype::f32, V);
    return p;
  }
  // The same problem at the logits level.
  Problem logits_head() {
    Problem p = head();
    p.x = p.w = p.bias = Tensor{};
    p.logits = mat(logits.data(), Dtype::f32, N, V);
    return p;
  }
  void add_forward_outputs(Problem& p) {
    p.loss = p.options.reduction == Reduction::none ? vec(loss.data(), Dtype::f64, N)
                                                    : flce::scalar_view(loss.data(), Dtype::f64);
    p.lse = vec(lse.data(), Dtype::f64, N);
    p.logprob = vec(logprob.data(), Dtype::f64, N);
    p.argmax = vec(argmax.data(), Dtype::i64, N);
    p.entropy = vec(entropy.data(), Dtype::f64, N);
    p.zloss = vec(zloss.data(), Dtype::f64, N);
  }
  void add_grad_outputs(Problem& p) {
    if (p.logits.present()) {
      p.grad_logits = mat(grad_logits.data(), Dtype::f64, N, V);
      return;
    }
    p.grad_x = mat(grad_x.data(), Dtype::f64, N, H);
    p.grad_w = mat(grad_w.data(), Dtype::f64, p.w.shape[0], p.w.shape[1]);
    if (p.bias.present()) p.grad_bias = vec(grad_bias.data(), Dtype::f64, V);
  }
  Problem fwd() {
    Problem p = head();
    add_forward_outputs(p);
    return p;
  }
  Problem train() {
    Problem p = fwd();
    add_grad_outputs(p);
    return p;
  }
  // backward(): lse is an input, the cotangents are given.
  Problem bwd() {
    Problem p = head();
    p.lse = vec(lse.data(), Dtype::f64, N);
    p.grad_loss = flce::scalar_view(grad_loss.data(), Dtype::f64);
    p.grad_lse = vec(grad_lse.data(), Dtype::f64, N);
    p.grad_entropy = vec(grad_entropy.data(), Dtype::f64, N);
    add_grad_outputs(p);
    return p;
  }
  Problem logits_train() {
    Problem p = logits_head();
    add_forward_outputs(p);
    add_grad_outputs(p);
    return p;
  }

  // Runs `call`, expecting an error whose message contains every one of
  // `needles`, and no output written. Returns the message.
  std::string reject(Call call, const Problem& p, const std::vector<std::string>& needles,
                     const RunConfig& config = {}) {
    fill();
    const Status s = call(p, config);
    EXPECT_FALSE(s.ok()) << "accepted; expected an error mentioning "
                         << ::testing::PrintToString(needles);
    for (const std::string& n : needles)
      EXPECT_NE(s.error.find(n), std::string::npos)
          << "the message does not mention '" << n << "': " << s.error;
    EXPECT_TRUE(untouched()) << "an output was written by a rejected call: " << s.error;
    return s.error;
  }
  void accept(Call call, const Problem& p, const RunConfig& config = {}) {
    const Status s = call(p, config);
    EXPECT_TRUE(s.ok()) << s.error;
  }
  // The workspace bytes loss_and_grad of train() takes under `config`.
  size_t train_workspace(const RunConfig& config) {
    size_t need = 0;
    const Status s = flce::workspace_size(train(), Pass::loss_and_grad, config, &need);
    EXPECT_TRUE(s.ok()) << s.error;
    return need;
  }
};

Call const kForward = &flce::forward;
Call const kBackward = &flce::backward;
Call const kTrain = &flce::loss_and_grad;

// ---------------------------------------------------------------------------
// The baseline: the unperturbed problems are accepted by every pass.

TEST_F(Validation, GoodProblemsAreAccepted) {
  accept(kForward, fwd());
  accept(kTrain, train());
  accept(kBackward, bwd());
  accept(kTrain, logits_train());
  Problem p = train();
  p.options.reduction = Reduction::none;
  add_forward_outputs(p);
  accept(kTrain, p);
  EXPECT_TRUE(std::isfinite(loss[0]));
}

// ---------------------------------------------------------------------------
// Shape mismatches.

using ValidationShapes = Validation;

TEST_F(ValidationShapes, WeightHiddenSizeDiffersFromX) {
  std::vector<float> big(64);
  Problem p = fwd();
  p.w = mat(big.data(), Dtype::f32, V, H + 1);
  reject(kForward, p, {"w", "[5, 4]", "H = 3"});
  // hv: W is [H, V]; a [V, H] W (H != V) does not fit.
  p.w_layout = WeightLayout::hv;
  p.w = mat(w.data(), Dtype::f32, V, H);
  reject(kForward, p, {"w", "[5, 3]", "hv"});
  p.w = mat(w.data(), Dtype::f32, H, V);
  accept(kForward, p);
}

TEST_F(ValidationShapes, BiasLabelsAndWeightsAgainstNAndV) {
  std::vector<float> big(64);
  std::vector<int64_t> big_labels(64, 0);
  Problem p = fwd();
  p.bias = vec(big.data(), Dtype::f32, V + 1);
  reject(kForward, p, {"bias", "[6]", "V = 5"});
  p = fwd();
  p.labels = vec(labels.data(), Dtype::i64, N - 1);
  reject(kForward, p, {"labels", "[3]", "N = 4"});
  p.labels = vec(big_labels.data(), Dtype::i64, N + 1);
  reject(kForward, p, {"labels", "[5]", "N = 4"});
  p = fwd();
  p.token_weights = vec(big.data(), Dtype::f32, N + 2);
  reject(kForward, p, {"token_weights", "[6]", "N = 4"});
  p = fwd();
  p.class_weights = vec(big.data(), Dtype::f32, V - 1);
  reject(kForward, p, {"class_weights", "[4]", "V = 5"});
  // Logits entry: labels against the logits' N.
  p = logits_train();
  p.labels = vec(big_labels.data(), Dtype::i64, N + 1);
  reject(kTrain, p, {"labels", "[5]", "N = 4"});
}

TEST_F(ValidationShapes, WrongRanks) {
  Problem p = fwd();
  p.x = vec(x.data(), Dtype::f32, N * H);
  reject(kForward, p, {"x", "2-D", "got 1-D"});
  p = fwd();
  p.w = vec(w.data(), Dtype::f32, V * H);
  reject(kForward, p, {"w", "got 1-D"});
  p = fwd();
  p.labels = mat(labels.data(), Dtype::i64, N, 1);
  reject(kForward, p, {"labels", "got 2-D"});
  p = fwd();
  p.bias = mat(bias.data(), Dtype::f32, 1, V);
  reject(kForward, p, {"bias", "got 2-D"});
  p = fwd();
  p.x.ndim = 3;  // not a rank flce takes
  reject(kForward, p, {"x", "got 3-D"});
}

TEST_F(ValidationShapes, EveryForwardOutput) {
  for (int k = 0; k < 5; ++k) {
    Problem p = fwd();
    Tensor* outs[] = {&p.lse, &p.logprob, &p.argmax, &p.entropy, &p.zloss};
    const char* names[] = {"lse", "logprob", "argmax", "entropy", "zloss"};
    SCOPED_TRACE(names[k]);
    outs[k]->shape[0] = N + 1;
    reject(kForward, p, {names[k], "[5]", "[4]"});
    outs[k]->shape[0] = N - 1;
    reject(kForward, p, {names[k], "[3]", "[4]"});
  }
}

TEST_F(ValidationShapes, LossRankFollowsTheReduction) {
  for (Reduction r : {Reduction::sum, Reduction::mean}) {
    Problem p = fwd();
    p.options.reduction = r;
    p.loss = vec(loss.data(), Dtype::f64, N);  // [N] for a scalar reduction
    reject(kForward, p, {std::string("loss: expected a 0-D tensor [] (reduction ") +
                             (r == Reduction::sum ? "sum" : "mean") + "), got 1-D"});
    p.loss = flce::scalar_view(loss.data(), Dtype::f64);
    accept(kForward, p);
  }
  Problem p = fwd();
  p.options.reduction = Reduction::none;
  p.loss = flce::scalar_view(loss.data(), Dtype::f64);
  reject(kForward, p, {"loss: expected a 1-D tensor [N] (reduction none), got 0-D"});
  p.loss = vec(loss.data(), Dtype::f64, N + 1);
  reject(kForward, p, {"loss", "[5]", "[4]"});
  p.loss = vec(loss.data(), Dtype::f64, N);
  accept(kForward, p);
}

TEST_F(ValidationShapes, CotangentsFollowTheReduction) {
  Problem p = bwd();  // mean: grad_loss must be 0-D
  p.grad_loss = vec(grad_loss.data(), Dtype::f64, N);
  reject(kBackward, p, {"grad_loss", "0-D", "got 1-D"});
  p = bwd();
  p.options.reduction = Reduction::none;
  reject(kBackward, p, {"grad_loss", "1-D", "got 0-D"});
  p.grad_loss = vec(grad_loss.data(), Dtype::f64, N - 1);
  reject(kBackward, p, {"grad_loss", "[3]", "[4]"});
  p.grad_loss = vec(grad_loss.data(), Dtype::f64, N);
  accept(kBackward, p);
  p = bwd();
  p.grad_lse.shape[0] = N - 1;
  reject(kBackward, p, {"grad_lse", "[3]", "[4]"});
  p = bwd();
  p.grad_entropy.shape[0] = N - 2;
  reject(kBackward, p, {"grad_entropy", "[2]", "[4]"});
  p = bwd();
  p.lse.shape[0] = N - 1;  // lse is an input of backward
  reject(kBackward, p, {"lse", "[3]", "[4]"});
}

TEST_F(ValidationShapes, GradientOutputs) {
  Problem p = train();
  p.grad_x = mat(grad_x.data(), Dtype::f64, N, H + 1);
  reject(kTrain, p, {"grad_x", "[4, 4]", "[4, 3]"});
  p = train();
  p.grad_x = mat(grad_x.data(), Dtype::f64, N + 1, H);
  reject(kTrain, p, {"grad_x", "[5, 3]", "[4, 3]"});
  p = train();
  p.grad_bias = vec(grad_bias.data(), Dtype::f64, V + 1);
  reject(kTrain, p, {"grad_bias", "[6]", "[5]"});
  // grad_w has w's shape, so w's layout: the transpose is wrong for both.
  p = train();
  p.grad_w = mat(grad_w.data(), Dtype::f64, H, V);
  reject(kTrain, p, {"grad_w", "[3, 5]", "[5, 3]"});
  p = train();
  p.w_layout = WeightLayout::hv;
  p.w = mat(w.data(), Dtype::f32, H, V);
  p.grad_w = mat(grad_w.data(), Dtype::f64, V, H);
  reject(kTrain, p, {"grad_w", "[5, 3]", "[3, 5]"});
  p.grad_w = mat(grad_w.data(), Dtype::f64, H, V);
  accept(kTrain, p);
  p = logits_train();
  p.grad_logits = mat(grad_logits.data(), Dtype::f64, N, V + 1);
  reject(kTrain, p, {"grad_logits", "[4, 6]", "[4, 5]"});
  p.grad_logits = mat(grad_logits.data(), Dtype::f64, N - 1, V);
  reject(kTrain, p, {"grad_logits", "[3, 5]", "[4, 5]"});
}

// ---------------------------------------------------------------------------
// Sizes <= 0, bad strides, and shapes too large to index.

using ValidationSizes = Validation;

TEST_F(ValidationSizes, ZeroAndNegative) {
  for (int64_t bad : {int64_t{0}, int64_t{-1}, int64_t{-7}}) {
    const std::string size = "size " + std::to_string(bad);
    SCOPED_TRACE(size);
    Problem p = fwd();
    p.x.shape[0] = bad;
    reject(kForward, p, {"x", size});
    p = fwd();
    p.x.shape[1] = bad;
    reject(kForward, p, {"x", size});
    p.x.stride[0] = 0;  // numpy's strides of an empty (N, 0) array: the size is named
    reject(kForward, p, {"x", size + " in dimension 1"});
    p = fwd();
    p.w.shape[0] = bad;
    reject(kForward, p, {"w", size});
    p = fwd();
    p.labels.shape[0] = bad;
    reject(kForward, p, {"labels", size});
    p = fwd();
    p.bias.shape[0] = bad;
    reject(kForward, p, {"bias", size});
    p = fwd();
    p.lse.shape[0] = bad;
    reject(kForward, p, {"lse", size});
    p = logits_train();
    p.logits.shape[1] = bad;
    reject(kTrain, p, {"logits", size});
  }
}

TEST_F(ValidationSizes, BadStrides) {
  Problem p = fwd();
  p.x.stride[0] = -3;
  reject(kForward, p, {"x", "stride[0] = -3"});
  p = fwd();
  p.labels.stride[0] = 0;
  reject(kForward, p, {"labels", "stride[0] = 0"});
  p = fwd();
  p.x.stride[0] = kMax / 2;  // (N - 1) * stride overflows
  reject(kForward, p, {"x", "too large"});
}

TEST_F(ValidationSizes, TooLargeToIndexIsRejectedBeforeTouchingData) {
  void* fake = fake_pointer();
  // x alone: INT64_MAX rows of f32 overflow a byte offset.
  Problem p = fwd();
  p.x = mat(fake, Dtype::f32, kMax, H);
  p.labels = vec(fake, Dtype::i64, kMax);
  reject(kForward, p, {"x", "9223372036854775807", "too large"});
  p.x = mat(fake, Dtype::f32, kMax, 1);
  reject(kForward, p, {"x", "9223372036854775807", "too large"});
  // Two elements INT64_MAX apart: the last offset fits, one past it does not
  // (signed overflow, which UBSan reports, before the checked add).
  p = fwd();
  p.lse.stride[0] = kMax;
  reject(kForward, p, {"lse", "too large"});
  // W alone.
  p = fwd();
  p.w = mat(fake, Dtype::f32, kMax / 2, H);
  reject(kForward, p, {"w", std::to_string(kMax / 2), "too large"});
  // Each fits, but N * V does not.
  p = fwd();
  const int64_t big = int64_t{1} << 32;
  p.x = mat(fake, Dtype::f32, big, 1);
  p.w = mat(fake, Dtype::f32, big, 1);
  p.bias = Tensor{};
  p.labels = vec(fake, Dtype::i64, big);
  p.token_weights = p.class_weights = Tensor{};
  reject(kForward, p, {"x", "4294967296", "too large"});
  // Logits entry.
  p = logits_train();
  p.logits = mat(fake, Dtype::f32, big, big);
  p.labels = vec(fake, Dtype::i64, big);
  reject(kTrain, p, {"logits", "4294967296", "too large"});
  // An output too large (and so the wrong shape) is rejected too.
  p = fwd();
  p.lse = vec(fake, Dtype::f64, kMax);
  reject(kForward, p, {"lse", "9223372036854775807"});
}

// ---------------------------------------------------------------------------
// Null pointers.

using ValidationNull = Validation;

TEST_F(ValidationNull, EveryInput) {
  struct Case {
    const char* name;
    Tensor Problem::*field;
    Call call;
  };
  const Case cases[] = {
      {"x", &Problem::x, kTrain},
      {"w", &Problem::w, kTrain},
      {"bias", &Problem::bias, kTrain},
      {"labels", &Problem::labels, kTrain},
      {"token_weights", &Problem::token_weights, kTrain},
      {"class_weights", &Problem::class_weights, kTrain},
      {"grad_loss", &Problem::grad_loss, kBackward},
      {"grad_lse", &Problem::grad_lse, kBackward},
      {"grad_entropy", &Problem::grad_entropy, kBackward},
      {"lse", &Problem::lse, kBackward},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Problem p = c.call == kBackward ? bwd() : train();
    (p.*c.field).data = nullptr;
    reject(c.call, p, {std::string(c.name) + ": data pointer is null"});
  }
  Problem p = logits_train();
  p.logits.data = nullptr;
  reject(kTrain, p, {"logits: data pointer is null"});
}

TEST_F(ValidationNull, EveryOutput) {
  const char* names[] = {"loss", "lse", "logprob", "argmax", "entropy", "zloss",
                         "grad_x", "grad_w", "grad_bias"};
  for (int k = 0; k < 9; ++k) {
    SCOPED_TRACE(names[k]);
    Problem p = train();
    Tensor* outs[] = {&p.loss, &p.lse, &p.logprob, &p.argmax, &p.entropy, &p.zloss,
                      &p.grad_x, &p.grad_w, &p.grad_bias};
    outs[k]->data = nullptr;
    reject(kTrain, p, {std::string(names[k]) + ": data pointer is null"});
  }
  Problem p = logits_train();
  p.grad_logits.data = nullptr;
  reject(kTrain, p, {"grad_logits: data pointer is null"});
}

TEST_F(ValidationNull, MissingRequiredArguments) {
  Problem p = fwd();
  p.loss = Tensor{};
  reject(kForward, p, {"loss: missing"});
  p = train();
  p.loss = Tensor{};
  reject(kTrain, p, {"loss: missing"});
  p = fwd();
  p.lse = Tensor{};
  reject(kForward, p, {"lse: missing"});
  p = bwd();
  p.lse = Tensor{};
  reject(kBackward, p, {"lse: missing", "backward"});
  p = fwd();
  p.labels = Tensor{};
  reject(kForward, p, {"labels: missing"});
  p = fwd();
  p.x = Tensor{};
  reject(kForward, p, {"x: missing"});
  p = fwd();
  p.w = Tensor{};
  reject(kForward, p, {"w: missing"});
  p = fwd();
  p.x = p.w = p.bias = Tensor{};
  reject(kForward, p, {"x: missing"});
  // Backward with nothing to write.
  p = bwd();
  p.grad_x = p.grad_w = p.grad_bias = Tensor{};
  reject(kBackward, p, {"grad_x", "no gradient output"});
}

// ---------------------------------------------------------------------------
// Outputs that overlap inputs or other outputs.

using ValidationAliasing = Validation;

TEST_F(ValidationAliasing, OutputOverlapsInput) {
  // Outputs pointing into the input arrays (dtypes chosen to pass the
  // dtype checks, so that only the overlap is wrong).
  std::vector<double> x64(size_t(N * H), 0.5);
  Problem p = train();
  p.x = mat(x64.data(), Dtype::f64, N, H);
  p.grad_x = mat(x64.data(), Dtype::f64, N, H);  // grad_x == x: not allowed
  reject(kTrain, p, {"grad_x", "overlaps x"});
  p = train();
  p.x = mat(x64.data(), Dtype::f64, N, H);
  p.lse = vec(x64.data() + 5, Dtype::f64, N);  // partly inside x
  reject(kTrain, p, {"lse", "overlaps x"});
  p = fwd();
  p.loss = flce::scalar_view(labels.data() + 3, Dtype::f64);
  reject(kForward, p, {"loss", "overlaps labels"});
  p = fwd();
  p.argmax = vec(labels.data(), Dtype::i64, N);
  reject(kForward, p, {"argmax", "overlaps labels"});
  p = fwd();
  p.zloss = vec(reinterpret_cast<double*>(w.data()) + 1, Dtype::f64, N);
  reject(kForward, p, {"zloss", "overlaps w"});
  std::vector<double> tw64(16, 1.0);
  p = train();
  p.token_weights = vec(tw64.data(), Dtype::f64, N);
  p.grad_bias = vec(tw64.data() + 2, Dtype::f64, V);
  reject(kTrain, p, {"grad_bias", "overlaps token_weights"});
  // backward: lse and the cotangents are inputs.
  p = bwd();
  p.grad_bias = vec(lse.data(), Dtype::f64, V);
  reject(kBackward, p, {"grad_bias", "overlaps lse"});
  p = bwd();
  p.grad_lse = vec(grad_x.data() + 3, Dtype::f64, N);
  reject(kBackward, p, {"grad_x", "overlaps grad_lse"});
}

TEST_F(ValidationAliasing, OutputOverlapsOutput) {
  Problem p = fwd();
  p.entropy = p.logprob;
  std::string e = reject(kForward, p, {"overlaps"});
  EXPECT_NE(e.find("logprob"), std::string::npos) << e;
  EXPECT_NE(e.find("entropy"), std::string::npos) << e;
  p = fwd();
  p.loss = flce::scalar_view(lse.data() + N - 1, Dtype::f64);  // last element of lse
  e = reject(kForward, p, {"overlaps"});
  EXPECT_NE(e.find("loss"), std::string::npos) << e;
  EXPECT_NE(e.find("lse"), std::string::npos) << e;
  p = train();
  p.grad_bias = vec(grad_w.data() + 2, Dtype::f64, V);
  e = reject(kTrain, p, {"overlaps"});
  EXPECT_NE(e.find("grad_w"), std::string::npos) << e;
  EXPECT_NE(e.find("grad_bias"), std::string::npos) << e;
}

TEST_F(ValidationAliasing, InterleavedOutputsThatShareNoByteAreAccepted) {
  // lse, logprob and (int32) argmax as the columns of one [N, 3] buffer of
  // 8-byte cells: their byte ranges overlap, their elements do not (the
  // check refused them as overlapping). Values as from separate arrays.
  Problem p = fwd();
  accept(kForward, p);
  const std::vector<double> lse_alone = lse, logprob_alone = logprob;
  const std::vector<int64_t> argmax_alone = argmax;
  std::vector<double> cells(size_t(3 * N), kSentinel);
  p.lse = vec(cells.data(), Dtype::f64, N);
  p.logprob = vec(cells.data() + 1, Dtype::f64, N);
  p.argmax = vec(cells.data() + 2, Dtype::i32, N);
  p.lse.stride[0] = p.logprob.stride[0] = 3;
  p.argmax.stride[0] = 6;  // 4-byte elements, 24 bytes apart
  accept(kForward, p);
  for (int64_t i = 0; i < N; ++i) {
    EXPECT_EQ(cells[size_t(3 * i)], lse_alone[size_t(i)]) << i;
    EXPECT_EQ(cells[size_t(3 * i + 1)], logprob_alone[size_t(i)]) << i;
    int32_t got = 0;
    std::memcpy(&got, &cells[size_t(3 * i + 2)], 4);
    EXPECT_EQ(got, argmax_alone[size_t(i)]) << i;
  }
  // Half an element apart: they share bytes.
  p.logprob = vec(reinterpret_cast<char*>(cells.data()) + 4, Dtype::f64, N);
  p.logprob.stride[0] = 3;
  reject(kForward, p, {"logprob", "overlaps lse"});
  // Another stride: told by byte ranges, as before.
  p.logprob = vec(cells.data() + 1, Dtype::f64, N);
  p.logprob.stride[0] = 4;
  reject(kForward, p, {"logprob: overlaps "});
}

TEST_F(ValidationAliasing, OutputOverlapsItself) {
  // A writable view whose elements share memory ([N, H] with strides {1, 1}
  // puts (0, 1) and (1, 0) at the same address): which write wins is
  // undefined, so it must be refused like any other overlap.
  Problem p = train();
  p.grad_x.stride[0] = 1;
  p.grad_x.stride[1] = 1;
  reject(kTrain, p, {"grad_x", "overlap"});
}

TEST_F(ValidationAliasing, GradLogitsInPlace) {
  // grad_logits may be exactly the logits: written in place.
  std::vector<double> z(size_t(N * V)), z_copy;
  for (int64_t i = 0; i < N * V; ++i) z[size_t(i)] = logits[size_t(i)];
  z_copy = z;
  Problem p = logits_train();
  p.logits = mat(z_copy.data(), Dtype::f64, N, V);
  accept(kTrain, p);  // out of place, into grad_logits
  const std::vector<double> expected(grad_logits.begin(), grad_logits.begin() + N * V);
  p.logits = mat(z.data(), Dtype::f64, N, V);
  p.grad_logits = p.logits;
  accept(kTrain, p);
  for (int64_t i = 0; i < N * V; ++i) EXPECT_DOUBLE_EQ(z[size_t(i)], expected[size_t(i)]) << i;
  // One row: the size-1 dimension's stride addresses nothing and may differ
  // between the two views (it was refused as an overlap).
  Problem one = logits_train();
  one.options.reduction = Reduction::sum;
  one.logits = mat(z.data(), Dtype::f64, 1, V);
  one.labels.shape[0] = one.token_weights.shape[0] = one.lse.shape[0] = 1;
  one.loss = flce::scalar_view(loss.data(), Dtype::f64);
  one.logprob = one.argmax = one.entropy = one.zloss = Tensor{};
  one.grad_logits = one.logits;
  one.grad_logits.stride[0] = 0;
  accept(kTrain, one);
}

TEST_F(ValidationAliasing, GradLogitsOverlappingLogitsOtherwise) {
  std::vector<double> z(size_t(2 * N * V), 0.25);
  Problem p = logits_train();
  p.logits = mat(z.data(), Dtype::f64, N, V);
  p.grad_logits = mat(z.data() + 1, Dtype::f64, N, V);  // shifted by one element
  reject(kTrain, p, {"grad_logits", "overlaps logits"});
  p.grad_logits = mat(z.data() + V, Dtype::f64, N, V);  // shifted by one row
  reject(kTrain, p, {"grad_logits", "overlaps logits"});
  p.grad_logits = p.logits;  // same start, other strides
  p.grad_logits.stride[0] = V + 1;
  reject(kTrain, p, {"grad_logits", "overlaps logits"});
  p.grad_logits = p.logits;  // same bytes, other dtype
  p.grad_logits.dtype = Dtype::f32;
  reject(kTrain, p, {"grad_logits", "overlaps logits"});
  // In place is only for grad_logits: another output on the logits is not.
  p = logits_train();
  p.logits = mat(z.data(), Dtype::f64, N, V);
  p.lse = vec(z.data(), Dtype::f64, N);
  reject(kTrain, p, {"lse", "overlaps logits"});
}

// ---------------------------------------------------------------------------
// Option ranges.

using ValidationOptions = Validation;

struct OptionCase {
  double value;
  const char* shown;  // how the message prints it
};

TEST_F(ValidationOptions, Softcap) {
  for (OptionCase c : {OptionCase{-1, "-1"}, {-1e-9, "-1e-09"}, {kNaN, "nan"}, {kInf, "inf"},
                       {-kInf, "-inf"}}) {
    SCOPED_TRACE(c.shown);
    Problem p = fwd();
    p.options.softcap = c.value;
    reject(kForward, p, {"softcap", c.shown});
  }
  Problem p = fwd();
  p.options.softcap = 0;  // off
  accept(kForward, p);
  p.options.softcap = 30;
  accept(kForward, p);
}

TEST_F(ValidationOptions, LabelSmoothing) {
  // 1.0000001 printed with "%g"'s 6 digits read "label_smoothing = 1: must
  // be in [0, 1]"; a value keeps the digits that tell it apart.
  for (OptionCase c : {OptionCase{-0.1, "-0.1"}, {1.5, "1.5"}, {kNaN, "nan"}, {kInf, "inf"},
                       {1.0000001, "label_smoothing = 1.0000001: must be in [0, 1]"},
                       {std::nextafter(1.0, 2.0), "= 1.0000000000000002:"}}) {
    SCOPED_TRACE(c.shown);
    Problem p = train();
    p.options.label_smoothing = c.value;
    reject(kTrain, p, {"label_smoothing", c.shown});
  }
  Problem p = train();
  p.options.label_smoothing = 0.999;
  accept(kTrain, p);
  p.options.label_smoothing = 1;  // all uniform: PyTorch's upper end too
  accept(kTrain, p);
}

TEST_F(ValidationOptions, ZLoss) {
  for (OptionCase c : {OptionCase{-1, "-1"}, {kNaN, "nan"}, {kInf, "inf"}}) {
    SCOPED_TRACE(c.shown);
    Problem p = bwd();
    p.options.z_loss = c.value;
    reject(kBackward, p, {"z_loss", c.shown});
  }
  Problem p = fwd();
  p.options.z_loss = 1e-4;
  accept(kForward, p);
}

TEST_F(ValidationOptions, FilterEps) {
  for (OptionCase c : {OptionCase{-2, "-2"}, {-0.5, "-0.5"}, {kNaN, "nan"}, {kInf, "inf"}}) {
    SCOPED_TRACE(c.shown);
    Problem p = train();
    p.options.filter_eps = c.value;
    reject(kTrain, p, {"filter_eps", c.shown});
  }
  Problem p = train();
  for (double ok : {0.0, 1e-4, flce::kFilterEpsAuto}) {
    p.options.filter_eps = ok;
    accept(kTrain, p);
  }
}

TEST_F(ValidationOptions, LogitScale) {
  for (OptionCase c : {OptionCase{0, "= 0"}, {-1, "-1"}, {kNaN, "nan"}, {kInf, "inf"},
                       {-kInf, "-inf"}}) {
    SCOPED_TRACE(c.shown);
    Problem p = fwd();
    p.options.logit_scale = c.value;
    reject(kForward, p, {"logit_scale", c.shown});
  }
  Problem p = fwd();
  p.options.logit_scale = 0.5;
  accept(kForward, p);
}

TEST_F(ValidationOptions, EnumValuesOutsideTheirRange) {
  Problem p = fwd();
  p.options.reduction = Reduction(7);
  reject(kForward, p, {"reduction", "7"});
  p = fwd();
  p.w_layout = WeightLayout(9);
  reject(kForward, p, {"w_layout", "9"});
  p = fwd();
  size_t bytes = 0;
  const Status s = flce::workspace_size(p, Pass(5), {}, &bytes);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.error.find("pass"), std::string::npos) << s.error;
  EXPECT_NE(s.error.find("5"), std::string::npos) << s.error;
}

// ---------------------------------------------------------------------------
// Label values and weight values.

using ValidationValues = Validation;

TEST_F(ValidationValues, LabelsOutOfRange) {
  for (int64_t bad : {V, int64_t{-1}, int64_t{-99}, int64_t{1000}, kMax,
                      std::numeric_limits<int64_t>::min()}) {
    SCOPED_TRACE(bad);
    labels = {0, 4, bad, 1};
    reject(kForward, fwd(), {"labels[2] = " + std::to_string(bad), "V = 5"});
  }
  // int32 labels too.
  std::vector<int32_t> l32 = {0, 1, 2, 7};
  Problem p = fwd();
  p.labels = vec(l32.data(), Dtype::i32, N);
  reject(kForward, p, {"labels[3] = 7"});
  // Another ignore_index: -100 is then an ordinary, out-of-range label.
  labels = {0, -100, 2, 1};
  p = fwd();
  p.options.ignore_index = 3;
  reject(kForward, p, {"labels[1] = -100", "ignore_index (3)"});
}

TEST_F(ValidationValues, IgnoredLabelsAreFine) {
  labels = {0, -100, 2, -100};
  accept(kTrain, train());
  // A custom ignore_index outside [0, V).
  labels = {7, 1, 7, 4};
  Problem p = train();
  p.options.ignore_index = 7;
  accept(kTrain, p);
  // ... and inside it: rows labelled 2 carry no loss.
  labels = {2, 1, 2, 4};
  p = fwd();
  p.options.ignore_index = 2;
  p.options.reduction = Reduction::none;
  add_forward_outputs(p);
  accept(kForward, p);
  EXPECT_EQ(loss[0], 0.0);
  EXPECT_EQ(logprob[2], 0.0);
  EXPECT_NE(loss[1], 0.0);
}

TEST_F(ValidationValues, NegativeOrNonFiniteWeights) {
  for (OptionCase c : {OptionCase{-1, "-1"}, {-1e-30, "-1e-30"}, {kNaN, "nan"}, {kInf, "inf"},
                       {-kInf, "-inf"}}) {
    SCOPED_TRACE(c.shown);
    token_w = {1.0f, float(c.value), 2.0f, 1.0f};
    reject(kTrain, train(), {"token_weights[1]", c.shown});
    token_w = {1.0f, 0.5f, 2.0f, 1.0f};
    class_w = {1.0f, 2.0f, 0.5f, float(c.value), 1.5f};
    reject(kTrain, train(), {"class_weights[3]", c.shown});
    class_w = {1.0f, 2.0f, 0.5f, 1.0f, 1.5f};
  }
  // f64 weights, checked the same way.
  std::vector<double> tw64 = {1, 1, 1, -2};
  Problem p = fwd();
  p.token_weights = vec(tw64.data(), Dtype::f64, N);
  reject(kForward, p, {"token_weights[3]", "-2"});
  // Zero weights are fine.
  token_w = {0.0f, 0.0f, 1.0f, 0.0f};
  class_w = {0.0f, 1.0f, 0.0f, 1.0f, 0.0f};
  accept(kTrain, train());
}

// ---------------------------------------------------------------------------
// Dtypes.

using ValidationDtypes = Validation;

TEST_F(ValidationDtypes, WrongDtypes) {
  Problem p = fwd();
  p.x.dtype = Dtype::i32;
  reject(kForward, p, {"x", "i32"});
  p = fwd();
  p.w.dtype = Dtype::i64;
  reject(kForward, p, {"w", "i64"});
  p = fwd();
  p.labels.dtype = Dtype::f32;  // float labels
  reject(kForward, p, {"labels", "f32"});
  p = fwd();
  p.labels.dtype = Dtype::f64;
  reject(kForward, p, {"labels", "f64"});
  p = fwd();
  p.loss.dtype = Dtype::i32;
  reject(kForward, p, {"loss", "i32"});
  p = fwd();
  p.lse.dtype = Dtype::bf16;
  reject(kForward, p, {"lse", "bf16"});
  p = fwd();
  p.argmax.dtype = Dtype::f64;
  reject(kForward, p, {"argmax", "f64"});
  p = fwd();
  p.token_weights.dtype = Dtype::f16;
  reject(kForward, p, {"token_weights", "f16"});
  p = fwd();
  p.class_weights.dtype = Dtype::i32;
  reject(kForward, p, {"class_weights", "i32"});
  p = bwd();
  p.grad_lse.dtype = Dtype::i64;
  reject(kBackward, p, {"grad_lse", "i64"});
  // Gradients: f32, f64 or the input's dtype.
  p = train();
  p.grad_x.dtype = Dtype::bf16;  // x is f32: the input's dtype is listed once
  reject(kTrain, p, {"grad_x", "bf16", "(expected f32 or f64)"});
  p = train();
  p.grad_w.dtype = Dtype::i32;
  reject(kTrain, p, {"grad_w", "i32"});
  // Values outside the enums.
  p = fwd();
  p.x.dtype = Dtype(42);
  reject(kForward, p, {"x", "42"});
  p = fwd();
  p.x.device = flce::Device(7);
  reject(kForward, p, {"x", "7"});
}

TEST_F(ValidationDtypes, MixedDevices) {
  Problem p = fwd();
  p.lse.device = flce::Device::cuda;
  reject(kForward, p, {"lse", "cuda:0", "cpu:0"});
  p = fwd();
  p.labels.device = flce::Device::cuda;
  p.labels.device_index = 1;
  reject(kForward, p, {"labels", "cuda:1"});
}

TEST_F(ValidationDtypes, GradientInTheInputsDtype) {
  std::vector<uint16_t> xh(size_t(N * H), 0x3c00), gxh(size_t(N * H), 0);  // 1.0 in f16
  Problem p = train();
  p.x = mat(xh.data(), Dtype::f16, N, H);
  p.grad_x = mat(gxh.data(), Dtype::f16, N, H);
  accept(kTrain, p);
}

// ---------------------------------------------------------------------------
// Which outputs each pass takes.

using ValidationPasses = Validation;

TEST_F(ValidationPasses, GradientOutputsInForward) {
  const char* names[] = {"grad_x", "grad_w", "grad_bias", "grad_loss", "grad_lse",
                         "grad_entropy"};
  for (int k = 0; k < 6; ++k) {
    SCOPED_TRACE(names[k]);
    Problem p = fwd();
    Problem g = bwd();
    Tensor Problem::*fields[] = {&Problem::grad_x, &Problem::grad_w, &Problem::grad_bias,
                                 &Problem::grad_loss, &Problem::grad_lse,
                                 &Problem::grad_entropy};
    p.*fields[k] = g.*fields[k];
    reject(kForward, p, {std::string(names[k]) + ": given", "forward()"});
  }
  Problem p = logits_train();
  p.grad_x = p.grad_w = p.grad_bias = Tensor{};
  reject(kForward, p, {"grad_logits: given", "forward()"});
}

TEST_F(ValidationPasses, ForwardOutputsInBackward) {
  const char* names[] = {"loss", "logprob", "argmax", "entropy", "zloss"};
  for (int k = 0; k < 5; ++k) {
    SCOPED_TRACE(names[k]);
    Problem f = fwd();
    Problem p = bwd();
    Tensor Problem::*fields[] = {&Problem::loss, &Problem::logprob, &Problem::argmax,
                                 &Problem::entropy, &Problem::zloss};
    p.*fields[k] = f.*fields[k];
    reject(kBackward, p, {std::string(names[k]) + ": given", "backward()"});
  }
}

TEST_F(ValidationPasses, EntryAndGradientMismatches) {
  Problem p = train();
  p.bias = p.grad_bias = Tensor{};
  p.grad_bias = vec(grad_bias.data(), Dtype::f64, V);
  reject(kTrain, p, {"grad_bias", "no bias"});
  // logits together with x (or w, or bias).
  p = fwd();
  p.logits = mat(logits.data(), Dtype::f32, N, V);
  reject(kForward, p, {"logits", "together with x"});
  p = logits_train();
  p.bias = vec(bias.data(), Dtype::f32, V);
  reject(kTrain, p, {"logits", "together with"});
  // The logits entry writes grad_logits; the head entry does not.
  p = logits_train();
  p.grad_x = mat(grad_x.data(), Dtype::f64, N, H);
  reject(kTrain, p, {"grad_x", "grad_logits"});
  p = logits_train();  // the message names the gradient given
  p.grad_w = mat(grad_w.data(), Dtype::f64, V, H);
  reject(kTrain, p, {"grad_w: the logits-level entry writes grad_logits"});
  p = train();
  p.grad_logits = mat(grad_logits.data(), Dtype::f64, N, V);
  reject(kTrain, p, {"grad_logits", "logits-level"});
}

// ---------------------------------------------------------------------------
// RunConfig: backend names, FLCE_BACKEND, threads, workspace.

using ValidationConfig = Validation;

TEST_F(ValidationConfig, UnknownBackend) {
  RunConfig config;
  config.backend = "nope";
  reject(kForward, fwd(), {"backend", "nope", "available", "reference"}, config);
  config.backend = "reference";
  accept(kForward, fwd(), config);
}

// Sets an environment variable for the scope, restoring the old value.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    ::setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_) ::setenv(name_, old_.c_str(), 1);
    else ::unsetenv(name_);
  }

 private:
  const char* name_;
  bool had_ = false;
  std::string old_;
};

TEST_F(ValidationConfig, UnknownBackendInTheEnvironment) {
  {
    ScopedEnv env("FLCE_BACKEND", "nope");
    reject(kForward, fwd(), {"FLCE_BACKEND", "nope", "reference"});
    reject(kTrain, train(), {"FLCE_BACKEND", "nope", "reference"});
    // An explicit RunConfig.backend wins over the environment.
    RunConfig config;
    config.backend = "reference";
    accept(kForward, fwd(), config);
  }
  {
    ScopedEnv env("FLCE_BACKEND", "reference");
    accept(kForward, fwd());
  }
  accept(kForward, fwd());
}

TEST_F(ValidationConfig, NoBackendAcceptsDeviceTensors) {
  // Every tensor claims to be on a CUDA device: validation must not read the
  // labels or weights, and the reference backend declines with its reason.
  Problem p = train();
  for (Tensor* t : {&p.x, &p.w, &p.bias, &p.labels, &p.token_weights, &p.class_weights, &p.loss,
                    &p.lse, &p.logprob, &p.argmax, &p.entropy, &p.zloss, &p.grad_x, &p.grad_w,
                    &p.grad_bias})
    t->device = flce::Device::cuda;
  labels[1] = 1000;  // out of range, but on the "device": not checked on the host
  reject(kTrain, p, {"no backend accepts", "reference", "CUDA"});
  RunConfig config;
  config.backend = "reference";
  reject(kTrain, p, {"backend = reference", "declines", "CUDA"}, config);
}

// A GEMM engine asked for is not ignored: the reference backend, which has
// none, declines (it ran as if none had been named).
TEST_F(ValidationConfig, GemmEngineForTheReferenceIsDeclined) {
  RunConfig config;
  config.backend = "reference";
  config.gemm = "eigen";
  reject(kTrain, train(), {"backend = reference", "declines", "gemm = 'eigen'"}, config);
  config.gemm.clear();
  accept(kTrain, train(), config);
}

TEST_F(ValidationConfig, Threads) {
  RunConfig config;
  config.threads = -1;
  reject(kForward, fwd(), {"threads", "-1"}, config);
  config.threads = std::numeric_limits<int>::min();
  reject(kTrain, train(), {"threads", std::to_string(std::numeric_limits<int>::min())}, config);
  config.threads = 1;
  accept(kTrain, train(), config);
  config.threads = 3;
  accept(kTrain, train(), config);
}

// A thread count the machine cannot start must be refused (or clamped), not
// handed to OpenMP: run in a child process, since today it crashes.
TEST_F(ValidationConfig, HugeThreadCountDoesNotCrash) {
  const std::string style = GTEST_FLAG_GET(death_test_style);
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto run = [this] {
    RunConfig config;
    config.threads = 1000000;
    const Status s = flce::forward(fwd(), config);
    const bool named = s.error.find("threads") != std::string::npos &&
                       s.error.find("1000000") != std::string::npos;
    std::fprintf(stderr, "status: '%s'\n", s.error.c_str());
    std::_Exit(s.ok() || named ? 0 : 3);
  };
  EXPECT_EXIT(run(), ::testing::ExitedWithCode(0), "")
      << "flce::forward with RunConfig.threads = 1000000 crashed or gave an error that does "
         "not name threads";
  GTEST_FLAG_SET(death_test_style, style);
}

TEST_F(ValidationConfig, WorkspaceTooSmall) {
  double scratch[1];
  RunConfig config;
  config.workspace = scratch;
  config.workspace_bytes = sizeof scratch;
  reject(kTrain, train(), {"workspace_bytes = 8"}, config);
  size_t need = 0;
  ASSERT_TRUE(flce::workspace_size(train(), Pass::loss_and_grad, {}, &need).ok());
  std::vector<double> enough(need / sizeof(double) + 1);
  config.workspace = enough.data();
  config.workspace_bytes = need;
  accept(kTrain, train(), config);
  // workspace_size validates too.
  Problem p = train();
  p.options.softcap = -1;
  const Status s = flce::workspace_size(p, Pass::loss_and_grad, {}, &need);
  EXPECT_NE(s.error.find("softcap = -1"), std::string::npos) << s.error;
  const Status n = flce::workspace_size(train(), Pass::loss_and_grad, {}, nullptr);
  EXPECT_NE(n.error.find("bytes"), std::string::npos) << n.error;
}

// The backend overwrites the first workspace_size() bytes of a caller's
// scratch: those may not overlap a tensor of the call (bytes past them may).
TEST_F(ValidationConfig, WorkspaceOverlappingATensorIsRefused) {
  for (const char* backend : {"reference", "cpu"}) {
    SCOPED_TRACE(backend);
    RunConfig config;
    config.backend = backend;
    const size_t need = train_workspace(config);
    ASSERT_GT(need, 8u);
    // An arena holding the workspace and one tensor of the call: grad_w at
    // its last 8 of the bytes the backend uses, or x right after them, then
    // 4 bytes inside them.
    const size_t floats = (need + 3) / 4;
    std::vector<float> arena(floats + size_t(N * V * H) * 2 + 2);
    config.workspace = arena.data();
    config.workspace_bytes = arena.size() * sizeof(float);
    Problem p = train();
    p.grad_w = mat(reinterpret_cast<char*>(arena.data()) + (need - 8) / 8 * 8, Dtype::f64,
                   p.w.shape[0], p.w.shape[1]);
    reject(kTrain, p, {"workspace", "overlap grad_w"}, config);
    p = train();
    std::copy(x.begin(), x.end(), arena.begin() + std::ptrdiff_t(floats));
    p.x = mat(arena.data() + floats, Dtype::f32, N, H);
    accept(kTrain, p, config);
    std::copy(x.begin(), x.end(), arena.begin() + std::ptrdiff_t(floats - 1));
    p.x = mat(arena.data() + floats - 1, Dtype::f32, N, H);
    reject(kTrain, p, {"workspace", "overlap x"}, config);
  }
}

// A caller's scratch may start at any address: each backend aligns its
// pieces inside the bytes workspace_size reports (the reference read doubles
// at the caller's address, misaligned: UBSan's alignment check, in CI).
TEST_F(ValidationConfig, WorkspaceAtAnyAddress) {
  for (const char* backend : {"reference", "cpu"}) {
    SCOPED_TRACE(backend);
    RunConfig config;
    config.backend = backend;
    const size_t need = train_workspace(config);
    std::vector<double> scratch(need / sizeof(double) + 2);
    for (size_t offset : {1, 3, 8}) {
      SCOPED_TRACE(offset);
      config.workspace = reinterpret_cast<char*>(scratch.data()) + offset;
      config.workspace_bytes = need;
      accept(kTrain, train(), config);
    }
  }
}

// ---------------------------------------------------------------------------
// NaN and Inf inside the data propagate to the affected rows (as in PyTorch);
// they never crash or hang, and the other rows stay finite.

using ValidationNonFinite = Validation;

TEST_F(ValidationNonFinite, NaNOrInfInXAffectsOnlyItsRow) {
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    SCOPED_TRACE(bad);
    fill();
    std::vector<float> saved = x;
    x[size_t(1 * H + 2)] = bad;  // row 1
    Problem p = train();
    p.options.reduction = Reduction::none;
    add_forward_outputs(p);
    const Status s = flce::loss_and_grad(p);
    x = saved;
    ASSERT_TRUE(s.ok()) << s.error;
    for (int64_t i = 0; i < N; ++i) {
      SCOPED_TRACE(i);
      const bool hit = i == 1;
      EXPECT_EQ(std::isfinite(loss[size_t(i)]), !hit) << loss[size_t(i)];
      EXPECT_EQ(std::isfinite(lse[size_t(i)]), !hit) << lse[size_t(i)];
      for (int64_t k = 0; k < H; ++k)
        if (!hit) { EXPECT_TRUE(std::isfinite(grad_x[size_t(i * H + k)])); }
    }
    EXPECT_TRUE(0 <= argmax[0] && argmax[0] < V);
  }
}

TEST_F(ValidationNonFinite, NaNInWOrBiasAffectsEveryRow) {
  w[size_t(2 * H + 1)] = std::numeric_limits<float>::quiet_NaN();
  Problem p = train();
  p.options.reduction = Reduction::none;
  add_forward_outputs(p);
  ASSERT_TRUE(flce::loss_and_grad(p).ok());
  for (int64_t i = 0; i < N; ++i) EXPECT_FALSE(std::isfinite(lse[size_t(i)])) << i;
  w[size_t(2 * H + 1)] = 0.5f;
  bias[3] = std::numeric_limits<float>::infinity();
  fill();
  p.options.reduction = Reduction::mean;
  add_forward_outputs(p);
  ASSERT_TRUE(flce::loss_and_grad(p).ok());
  EXPECT_FALSE(std::isfinite(lse[0]));
}

TEST_F(ValidationNonFinite, NaNInLogitsAffectsOnlyItsRow) {
  logits[size_t(2 * V + 3)] = std::numeric_limits<float>::quiet_NaN();
  Problem p = logits_train();
  p.options.reduction = Reduction::none;
  add_forward_outputs(p);
  ASSERT_TRUE(flce::loss_and_grad(p).ok());
  for (int64_t i = 0; i < N; ++i) {
    EXPECT_EQ(std::isfinite(loss[size_t(i)]), i != 2) << i;
    for (int64_t j = 0; j < V; ++j)
      if (i != 2) { EXPECT_TRUE(std::isfinite(grad_logits[size_t(i * V + j)])) << i << "," << j; }
  }
  // Mean reduction: the NaN reaches the loss.
  fill();
  p.options.reduction = Reduction::mean;
  add_forward_outputs(p);
  ASSERT_TRUE(flce::loss_and_grad(p).ok());
  EXPECT_TRUE(std::isnan(loss[0]));
}

}  // namespace
