#include "support/random_problem.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <thread>
#include <utility>

#include <gtest/gtest.h>

#include "common/float16.h"
#include "cuda/device_copy.h"
#include "validate.h"

namespace flce_test {
namespace {

// Exact decoders, written here so that the library's own are checked by the
// tests rather than trusted by them.
double bf16_bits_to_double(uint16_t bits) {
  const uint32_t wide = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

double f16_bits_to_double(uint16_t bits) {
  const double sign = (bits & 0x8000) ? -1.0 : 1.0;
  const int exponent = (bits >> 10) & 0x1f, mantissa = bits & 0x3ff;
  if (exponent == 0) return sign * std::ldexp(double(mantissa), -24);
  if (exponent == 31)
    return mantissa ? std::numeric_limits<double>::quiet_NaN()
                    : sign * std::numeric_limits<double>::infinity();
  return sign * std::ldexp(double(1024 + mantissa), exponent - 25);
}

bool is_index(flce::Dtype dtype) {
  return dtype == flce::Dtype::i32 || dtype == flce::Dtype::i64;
}

size_t element_size(flce::Dtype dtype) {
  switch (dtype) {
    case flce::Dtype::f64:
    case flce::Dtype::i64: return 8;
    case flce::Dtype::f32:
    case flce::Dtype::i32: return 4;
    default: return 2;
  }
}

template <typename T>
void store(unsigned char* at, T value) {
  std::memcpy(at, &value, sizeof value);
}

template <typename T>
T load(const unsigned char* at) {
  T value;
  std::memcpy(&value, at, sizeof value);
  return value;
}

// An owned host array that the library sees through a Tensor.
class HostArray {
 public:
  HostArray() = default;  // absent
  // A 2-D array's rows are `padding` elements apart beyond cols
  // (Views::padded_rows); the padding's bytes are 0xFF, a NaN in every
  // floating dtype, and are checked by row_with_padding_written().
  HostArray(flce::Dtype dtype, int ndim, int64_t rows, int64_t cols, int64_t padding = 0)
      : dtype_(dtype), ndim_(ndim), rows_(rows), cols_(cols), padding_(ndim == 2 ? padding : 0),
        bytes_(size_t(ndim == 2 ? rows * (cols + padding_) : count()) * element_size(dtype), 0xFF) {
    for (int64_t k = 0; k < count(); ++k)
      set(k, is_index(dtype) ? -7.0 : std::numeric_limits<double>::quiet_NaN());
  }
  static HostArray of(const std::vector<double>& values, flce::Dtype dtype, int ndim,
                      int64_t rows, int64_t cols = 1, int64_t padding = 0) {
    HostArray a(dtype, ndim, rows, cols, padding);
    for (int64_t k = 0; k < a.count(); ++k) a.set(k, values[k]);
    return a;
  }

  bool present() const { return ndim_ >= 0; }
  int64_t count() const {
    if (ndim_ < 0) return 0;
    return ndim_ == 0 ? 1 : ndim_ == 1 ? rows_ : rows_ * cols_;
  }

  flce::Tensor view() {
    flce::Tensor t;
    if (!present()) return t;
    t.data = bytes_.data();
    t.dtype = dtype_;
    t.ndim = ndim_;
    if (ndim_ >= 1) {
      t.shape[0] = rows_;
      t.stride[0] = ndim_ == 2 ? cols_ + padding_ : 1;
    }
    if (ndim_ == 2) {
      t.shape[1] = cols_;
      t.stride[1] = 1;
    }
    return t;
  }

  // The first row whose padding bytes changed, or -1.
  int64_t row_with_padding_written() const {
    const size_t e = element_size(dtype_);
    for (int64_t r = 0; r < (padding_ ? rows_ : 0); ++r) {
      const unsigned char* pad = bytes_.data() + (size_t(r * (cols_ + padding_) + cols_)) * e;
      for (size_t b = 0; b < size_t(padding_) * e; ++b)
        if (pad[b] != 0xFF) return r;
    }
    return -1;
  }

  void set(int64_t k, double value) {
    unsigned char* at = bytes_.data() + offset(k);
    switch (dtype_) {
      case flce::Dtype::f64: return store(at, value);
      case flce::Dtype::f32: return store(at, float(value));
      case flce::Dtype::bf16: return store(at, flce::f64_to_bf16(value));
      case flce::Dtype::f16: return store(at, flce::f64_to_f16(value));
      case flce::Dtype::i32: return store(at, int32_t(value));
      case flce::Dtype::i64: return store(at, int64_t(value));
    }
  }

  double get(int64_t k) const {
    const unsigned char* at = bytes_.data() + offset(k);
    switch (dtype_) {
      case flce::Dtype::f64: return load<double>(at);
      case flce::Dtype::f32: return load<float>(at);
      case flce::Dtype::bf16: return bf16_bits_to_double(load<uint16_t>(at));
      case flce::Dtype::f16: return f16_bits_to_double(load<uint16_t>(at));
      case flce::Dtype::i32: return load<int32_t>(at);
      case flce::Dtype::i64: return double(load<int64_t>(at));
    }
    return 0;
  }

  std::vector<double> values() const {
    std::vector<double> v(count());
    for (int64_t k = 0; k < count(); ++k) v[k] = get(k);
    return v;
  }
  std::vector<int64_t> indices() const {
    std::vector<int64_t> v(count());
    for (int64_t k = 0; k < count(); ++k) {
      const unsigned char* at = bytes_.data() + offset(k);
      v[k] = dtype_ == flce::Dtype::i64 ? load<int64_t>(at) : load<int32_t>(at);
    }
    return v;
  }

 private:
  // Element k of the row-major [rows, cols] values, in bytes.
  size_t offset(int64_t k) const {
    const int64_t at = padding_ ? k / cols_ * (cols_ + padding_) + k % cols_ : k;
    return size_t(at) * element_size(dtype_);
  }

  flce::Dtype dtype_ = flce::Dtype::f64;
  int ndim_ = -1;
  int64_t rows_ = 0, cols_ = 0, padding_ = 0;
  std::vector<unsigned char> bytes_;
};

void round_all(std::vector<double>* values, flce::Dtype dtype) {
  for (double& v : *values) v = round_to(v, dtype);
}

}  // namespace

double round_to(double v, flce::Dtype dtype) {
  HostArray a(dtype, 0, 0, 0);
  a.set(0, v);
  return a.get(0);
}

// ---- Case ------------------------------------------------------------------

std::vector<double> Case::draw(int64_t count, double lo, double hi) {
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> v(count);
  for (double& x : v) x = dist(rng_);
  return v;
}

Case Case::head(int64_t n, int64_t h, int64_t v, uint64_t seed) {
  Case c;
  c.rng_.seed(seed);
  c.dense_.n = n;
  c.dense_.h = h;
  c.dense_.v = v;
  c.dense_.x = c.draw(n * h, -1, 1);
  c.dense_.w = c.draw(v * h, -1, 1);
  std::uniform_int_distribution<int64_t> label(0, v - 1);
  for (int64_t i = 0; i < n; ++i) c.dense_.labels.push_back(label(c.rng_));
  return c;
}

Case Case::peaky_head(int64_t n, int64_t h, int64_t v, uint64_t seed) {
  Case c = head(n, h, v, seed);
  const double noise_w = h > 1 ? std::sqrt(3.0 / double(h - 1)) : 0.0;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < h; ++k) c.dense_.x[i * h + k] = k == 0 ? 1.0 : c.dense_.x[i * h + k] * std::sqrt(3.0);
  for (int64_t j = 0; j < v; ++j)
    for (int64_t k = 0; k < h; ++k) {
      double& w = c.dense_.w[j * h + k];  // [V, H] until layout() says otherwise
      w = k == 0 ? -2.0 * std::log(double(j + 1)) : w * noise_w;
    }
  std::vector<double> cdf(v);
  double total = 0;
  for (int64_t j = 0; j < v; ++j) cdf[j] = total += 1.0 / double((j + 1) * (j + 1));
  std::uniform_real_distribution<double> u(0.0, total);
  for (int64_t& y : c.dense_.labels)
    y = std::min<int64_t>(std::lower_bound(cdf.begin(), cdf.end(), u(c.rng_)) - cdf.begin(), v - 1);
  return c;
}

Case Case::logits(int64_t n, int64_t v, uint64_t seed) {
  Case c;
  c.rng_.seed(seed);
  c.dense_.n = n;
  c.dense_.v = v;
  c.dense_.logits_entry = true;
  c.dense_.logits = c.draw(n * v, -4, 4);
  std::uniform_int_distribution<int64_t> label(0, v - 1);
  for (int64_t i = 0; i < n; ++i) c.dense_.labels.push_back(label(c.rng_));
  return c;
}

Case& Case::layout(flce::WeightLayout layout) {
  if (layout != dense_.w_layout) {  // the same W, transposed in memory
    std::vector<double> w(dense_.w.size());
    DenseProblem t = dense_;
    t.w_layout = layout;
    for (int64_t j = 0; j < dense_.v; ++j)
      for (int64_t k = 0; k < dense_.h; ++k) w[t.w_index(j, k)] = dense_.weight(j, k);
    dense_.w = std::move(w);
    dense_.w_layout = layout;
  }
  return *this;
}

Case& Case::with_bias() { dense_.bias = draw(dense_.v, -1, 1); return *this; }
Case& Case::with_token_weights() { dense_.token_weights = draw(dense_.n, 0.25, 2); return *this; }
Case& Case::with_class_weights() { dense_.class_weights = draw(dense_.v, 0.25, 2); return *this; }
Case& Case::with_grad_lse() { dense_.grad_lse = draw(dense_.n, -1, 1); return *this; }
Case& Case::with_grad_entropy() { dense_.grad_entropy = draw(dense_.n, -1, 1); return *this; }
Case& Case::with_grad_loss() {
  grad_loss_ = true;
  grad_loss_scalar_ = draw(1, -2, 2)[0];
  grad_loss_rows_ = draw(dense_.n, -2, 2);
  return *this;
}
Case& Case::ignore_rows(std::vector<int64_t> rows) { ignored_ = std::move(rows); return *this; }
Case& Case::reduction(flce::Reduction r) { dense_.options.reduction = r; return *this; }
Case& Case::logit_scale(double a) { dense_.options.logit_scale = a; return *this; }
Case& Case::softcap(double k) { dense_.options.softcap = k; return *this; }
Case& Case::label_smoothing(double e) { dense_.options.label_smoothing = e; return *this; }
Case& Case::z_loss(double l) { dense_.options.z_loss = l; return *this; }
Case& Case::filter_eps(double eps) { dense_.options.filter_eps = eps; return *this; }
Case& Case::grad_logits(flce::GradLogitsDtype g) { dense_.options.grad_logits_dtype = g; return *this; }
Case& Case::ignore_index(int64_t index) { dense_.options.ignore_index = index; return *this; }
Case& Case::logit_magnitude(double m) { magnitude_ = m; return *this; }
Case& Case::stored_as(flce::Dtype d) { storage_.inputs = d; return *this; }
Case& Case::outputs_as(flce::Dtype d) { storage_.outputs = storage_.gradients = d; return *this; }
Case& Case::gradients_as(flce::Dtype d) { storage_.gradients = d; return *this; }
Case& Case::reals_as(flce::Dtype d) { storage_.reals = d; return *this; }
Case& Case::labels_as(flce::Dtype d) { storage_.labels = d; return *this; }

DenseProblem Case::problem() const {
  DenseProblem d = dense_;
  if (magnitude_ > 0) {
    double largest = 0;
    for (int64_t i = 0; i < d.n; ++i)
      for (int64_t j = 0; j < d.v; ++j) {
        double dot = d.logits_entry ? d.logits[i * d.v + j] : (d.bias.empty() ? 0 : d.bias[j]);
        for (int64_t k = 0; k < d.h; ++k) dot += d.x[i * d.h + k] * d.weight(j, k);
        largest = std::max(largest, std::fabs(dot));
      }
    const double f = magnitude_ / largest;
    for (auto* a : {&d.x, &d.bias, &d.logits})
      for (double& v : *a) v *= f;
  }
  for (int64_t i : ignored_) d.labels[i] = d.options.ignore_index;
  if (grad_loss_) {
    d.grad_loss = d.options.reduction == flce::Reduction::none
                      ? grad_loss_rows_
                      : std::vector<double>{grad_loss_scalar_};
  }
  for (auto* a : {&d.x, &d.w, &d.bias, &d.logits}) round_all(a, storage_.inputs);
  for (auto* a : {&d.token_weights, &d.class_weights, &d.grad_loss, &d.grad_lse, &d.grad_entropy})
    round_all(a, storage_.reals);
  return d;
}

// ---- Running the library ---------------------------------------------------

namespace {

// The b of a Hankel [rows, cols] matrix a[i][c] = b[i + c]: its first row,
// then its last column.
std::vector<double> hankel_base(const std::vector<double>& a, int64_t rows, int64_t cols) {
  std::vector<double> b(a.begin(), a.begin() + cols);
  for (int64_t i = 1; i < rows; ++i) b.push_back(a[i * cols + cols - 1]);
  return b;
}

void make_hankel(std::vector<double>* a, int64_t rows, int64_t cols) {
  const std::vector<double> b = hankel_base(*a, rows, cols);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = 0; c < cols; ++c) (*a)[i * cols + c] = b[i + c];
}

// An array for the Hankel matrix `a`, stored as its r + c - 1 values; view()
// of it is [r + c - 1], which overlapping_view() reshapes.
HostArray hankel_array(const std::vector<double>& a, flce::Dtype dtype, int64_t rows,
                       int64_t cols) {
  const std::vector<double> b = hankel_base(a, rows, cols);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = 0; c < cols; ++c)
      EXPECT_EQ(a[i * cols + c], b[i + c]) << "not Hankel at (" << i << ", " << c << ")";
  return HostArray::of(b, dtype, 1, rows + cols - 1);
}

flce::Tensor overlapping_view(flce::Tensor base, int64_t rows, int64_t cols) {
  base.ndim = 2;
  base.shape[0] = rows, base.shape[1] = cols;
  base.stride[0] = 1, base.stride[1] = 1;
  return base;
}

void stride_0_where_size_1(flce::Problem* p) {
  for (auto named : flce::tensors_of(*p))
    for (int d = 0; d < named.tensor->ndim; ++d)
      if (named.tensor->shape[d] == 1) named.tensor->stride[d] = 0;
}

}  // namespace

void make_hankel_inputs(DenseProblem* d) {
  const bool vh = d->w_layout == flce::WeightLayout::vh;
  make_hankel(&d->x, d->n, d->h);
  make_hankel(&d->w, vh ? d->v : d->h, vh ? d->h : d->v);
}

Outputs run_library(const DenseProblem& d, const Storage& st, const Request& rq) {
  const bool fwd = rq.pass != flce::Pass::backward, bwd = rq.pass != flce::Pass::forward;
  const bool vh = d.w_layout == flce::WeightLayout::vh;
  const bool none = d.options.reduction == flce::Reduction::none;
  auto optional = [](const std::vector<double>& v, flce::Dtype dtype, int ndim, int64_t rows) {
    return v.empty() ? HostArray() : HostArray::of(v, dtype, ndim, rows);
  };
  HostArray x, w, bias, logits;
  const int64_t w_rows = vh ? d.v : d.h, w_cols = vh ? d.h : d.v;
  const bool overlapping = rq.views == Views::overlapping_rows && !d.logits_entry;
  const int64_t pad = rq.views == Views::padded_rows ? kRowPadding : 0;  // of 2-D arrays
  if (d.logits_entry) {
    logits = HostArray::of(d.logits, st.inputs, 2, d.n, d.v, pad);
  } else if (overlapping) {
    x = hankel_array(d.x, st.inputs, d.n, d.h);
    w = hankel_array(d.w, st.inputs, w_rows, w_cols);
    bias = optional(d.bias, st.inputs, 1, d.v);
  } else {
    x = HostArray::of(d.x, st.inputs, 2, d.n, d.h, pad);
    w = HostArray::of(d.w, st.inputs, 2, w_rows, w_cols, pad);
    bias = optional(d.bias, st.inputs, 1, d.v);
  }
  std::vector<double> labels(d.labels.begin(), d.labels.end());
  HostArray label_array = HostArray::of(labels, st.labels, 1, d.n);
  HostArray token_weights = optional(d.token_weights, st.reals, 1, d.n);
  HostArray class_weights = optional(d.class_weights, st.reals, 1, d.v);

  HostArray loss, lse, logprob, argmax, entropy, zloss;
  if (fwd) {
    loss = HostArray(st.outputs, none ? 1 : 0, d.n, 1);
    lse = HostArray(st.outputs, 1, d.n, 1);
    if (rq.per_row_outputs) {
      logprob = HostArray(st.outputs, 1, d.n, 1);
      if (rq.argmax) argmax = HostArray(st.argmax, 1, d.n, 1);
      entropy = HostArray(st.outputs, 1, d.n, 1);
      zloss = HostArray(st.outputs, 1, d.n, 1);
    }
  } else {
    lse = HostArray::of(rq.saved_lse, st.outputs, 1, d.n);
  }
  HostArray grad_loss, grad_lse, grad_entropy, grad_x, grad_w, grad_bias, grad_logits;
  if (bwd) {
    grad_loss = optional(d.grad_loss, st.reals, none ? 1 : 0, d.n);
    grad_lse = optional(d.grad_lse, st.reals, 1, d.n);
    grad_entropy = optional(d.grad_entropy, st.reals, 1, d.n);
    if (rq.gradients && d.logits_entry && !rq.in_place) {
      grad_logits = HostArray(st.gradients, 2, d.n, d.v, pad);
    } else if (rq.gradients && !d.logits_entry) {
      const GradientSet& g = rq.head_gradients;
      if (g.x) grad_x = HostArray(st.gradients, 2, d.n, d.h, pad);
      if (g.w) grad_w = HostArray(st.gradients, 2, w_rows, w_cols, pad);
      if (g.bias && !d.bias.empty()) grad_bias = HostArray(st.gradients, 1, d.v, 1);
    }
  }

  flce::Problem p;
  p.x = overlapping ? overlapping_view(x.view(), d.n, d.h) : x.view();
  p.w = overlapping ? overlapping_view(w.view(), w_rows, w_cols) : w.view();
  p.w_layout = d.w_layout;
  p.bias = bias.view();
  p.logits = logits.view();
  p.labels = label_array.view();
  p.token_weights = token_weights.view();
  p.class_weights = class_weights.view();
  p.options = d.options;
  p.loss = loss.view();
  p.lse = lse.view();
  p.logprob = logprob.view();
  p.argmax = argmax.view();
  p.entropy = entropy.view();
  p.zloss = zloss.view();
  p.grad_loss = grad_loss.view();
  p.grad_lse = grad_lse.view();
  p.grad_entropy = grad_entropy.view();
  p.grad_x = grad_x.view();
  p.grad_w = grad_w.view();
  p.grad_bias = grad_bias.view();
  p.grad_logits = rq.in_place && bwd && rq.gradients ? logits.view() : grad_logits.view();
  if (rq.views == Views::size_one_stride_0) stride_0_where_size_1(&p);

  Outputs out;
  // The cuda backend runs on device copies of the arrays (outputs included,
  // so unwritten ones keep their poison), copied back afterwards.
  flce::cuda::DeviceProblem on_device;
  const bool cuda = rq.config.backend == "cuda";
  if (cuda) {
    out.status.error = on_device.upload(p, rq.device);
    if (!out.status.ok()) return out;
  }
  const flce::Problem& run = cuda ? on_device.problem() : p;
  auto call = [&] {
    switch (rq.pass) {
      case flce::Pass::forward: out.status = flce::forward(run, rq.config); break;
      case flce::Pass::backward: out.status = flce::backward(run, rq.config); break;
      case flce::Pass::loss_and_grad: out.status = flce::loss_and_grad(run, rq.config); break;
    }
  };
  if (rq.call_on_new_thread) std::thread(call).join();
  else call();
  if (cuda && out.status.ok()) out.status.error = on_device.download(p);
  const std::pair<const char*, const HostArray*> two_d[] = {
      {"x", &x}, {"W", &w}, {"logits", &logits}, {"grad_x", &grad_x}, {"grad_W", &grad_w},
      {"grad_logits", &grad_logits}};
  for (const auto& [name, array] : two_d)
    if (const int64_t row = array->row_with_padding_written(); row >= 0)
      ADD_FAILURE() << name << ": the padding after row " << row << " was written";
  if (fwd) {
    out.loss = loss.values();
    out.lse = lse.values();
    out.logprob = logprob.values();
    out.argmax = argmax.indices();
    out.entropy = entropy.values();
    out.zloss = zloss.values();
  }
  out.grad_x = grad_x.values();
  out.grad_w = grad_w.values();
  out.grad_bias = grad_bias.values();
  out.grad_logits = rq.in_place && bwd && rq.gradients ? logits.values() : grad_logits.values();
  return out;
}

}  // namespace flce_test
