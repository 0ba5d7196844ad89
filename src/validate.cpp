// Every check on a Problem that does not depend on the backend, in one place.
// Order: which entry (head or logits), each tensor alone (rank, sizes,
// strides, dtype, device), shapes against each other, options, label and
// weight values, which outputs the pass reads or writes, and aliasing.
#include "validate.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include "common/number_text.h"
#include "common/tensor_access.h"

namespace flce {
namespace {

std::string format(const char* fmt, auto... args) {
  char buf[512];
  std::snprintf(buf, sizeof buf, fmt, args...);
  return buf;
}

std::string shape_str(const Tensor& t) {
  std::string s = "[";
  for (int d = 0; d < t.ndim; ++d) s += (d ? ", " : "") + std::to_string(t.shape[d]);
  return s + "]";
}

// "f32 or f64 or bf16", each dtype once (a list may name the input's dtype,
// which can repeat one already there).
std::string dtype_list(std::initializer_list<Dtype> dtypes) {
  std::string s;
  for (auto d = dtypes.begin(); d != dtypes.end(); ++d)
    if (std::find(dtypes.begin(), d, *d) == d)
      s += (s.empty() ? "" : " or ") + std::string(dtype_name(*d));
  return s;
}

constexpr std::initializer_list<Dtype> kStorage = {Dtype::f32, Dtype::bf16, Dtype::f16,
                                                   Dtype::f64};
constexpr std::initializer_list<Dtype> kReal = {Dtype::f32, Dtype::f64};
constexpr std::initializer_list<Dtype> kIndex = {Dtype::i64, Dtype::i32};

// Rank, sizes, strides, null data, addressable extent and dtype of one tensor.
std::string check_tensor(const char* name, const Tensor& t, int ndim, const char* dims,
                         std::initializer_list<Dtype> dtypes) {
  if (t.ndim != ndim)
    return format("%s: expected a %d-D tensor %s, got %d-D", name, ndim, dims, t.ndim);
  if (dtype_name(t.dtype) == nullptr)
    return format("%s: dtype value %d is not a flce::Dtype", name, int(t.dtype));
  bool allowed = false;
  for (Dtype d : dtypes) allowed |= (d == t.dtype);
  if (!allowed)
    return format("%s: dtype %s is not accepted here (expected %s)", name, dtype_name(t.dtype),
                  dtype_list(dtypes).c_str());
  if (t.device != Device::cpu && t.device != Device::cuda)
    return format("%s: device value %d is not a flce::Device", name, int(t.device));
  // Sizes first: an empty array's other strides may be 0 (numpy's (2, 0)
  // has strides (0, 8)), and the size is what the caller must fix.
  for (int d = 0; d < ndim; ++d)
    if (t.shape[d] <= 0)
      return format("%s: size %lld in dimension %d (shape %s); every size must be >= 1", name,
                    (long long)t.shape[d], d, shape_str(t).c_str());
  int64_t last = 0;  // offset of the last element, in elements
  for (int d = 0; d < ndim; ++d) {
    if (t.shape[d] > 1 && t.stride[d] < 1)
      return format("%s: stride[%d] = %lld; strides must be >= 1", name, d,
                    (long long)t.stride[d]);
    int64_t span;
    if (__builtin_mul_overflow(t.shape[d] - 1, t.stride[d], &span) ||
        __builtin_add_overflow(last, span, &last))
      return format("%s: shape %s is too large to index with 64-bit offsets", name,
                    shape_str(t).c_str());
  }
  int64_t count, bytes;  // elements from the first to the last, then bytes
  if (__builtin_add_overflow(last, 1, &count) ||
      __builtin_mul_overflow(count, int64_t(dtype_size(t.dtype)), &bytes))
    return format("%s: shape %s is too large to index with 64-bit offsets", name,
                  shape_str(t).c_str());
  if (t.data == nullptr) return format("%s: data pointer is null", name);
  return "";
}

std::string check_size(const char* name, const Tensor& t, int dim, int64_t want,
                       const char* what) {
  if (t.shape[dim] == want) return "";
  return format("%s: shape %s does not match %s = %lld", name, shape_str(t).c_str(), what,
                (long long)want);
}

// The head (x, w, bias) or the logits, and the sizes they imply.
std::string check_inputs(const Problem& p, Dims* d) {
  const bool head = p.x.present() || p.w.present() || p.bias.present();
  if (p.logits.present() && head)
    return "logits: given together with x/w/bias; give either the head (x, w, bias) or the logits";
  if (!p.logits.present() && !(p.x.present() && p.w.present()))
    return p.x.present() ? "w: missing (the head needs x and w)"
                         : "x: missing (give x and w, or logits)";
  if (p.logits.present()) {
    if (auto e = check_tensor("logits", p.logits, 2, "[N, V]", kStorage); !e.empty()) return e;
    *d = {p.logits.shape[0], 0, p.logits.shape[1], true};
  } else {
    if (auto e = check_tensor("x", p.x, 2, "[N, H]", kStorage); !e.empty()) return e;
    if (p.w_layout != WeightLayout::vh && p.w_layout != WeightLayout::hv)
      return format("w_layout: value %d is neither vh nor hv", int(p.w_layout));
    const bool vh = p.w_layout == WeightLayout::vh;
    if (auto e = check_tensor("w", p.w, 2, vh ? "[V, H]" : "[H, V]", kStorage); !e.empty())
      return e;
    const int h_dim = vh ? 1 : 0;
    if (p.w.shape[h_dim] != p.x.shape[1])
      return format("w: shape %s does not match x %s: with w_layout %s, w is %s with H = %lld",
                    shape_str(p.w).c_str(), shape_str(p.x).c_str(), vh ? "vh" : "hv",
                    vh ? "[V, H]" : "[H, V]", (long long)p.x.shape[1]);
    *d = {p.x.shape[0], p.x.shape[1], p.w.shape[1 - h_dim], false};
    if (p.bias.present()) {
      if (auto e = check_tensor("bias", p.bias, 1, "[V]", kStorage); !e.empty()) return e;
      if (auto e = check_size("bias", p.bias, 0, d->v, "V"); !e.empty()) return e;
    }
  }
  int64_t nv;
  if (__builtin_mul_overflow(d->n, d->v, &nv) ||
      (!d->logits_entry && __builtin_mul_overflow(d->v, d->h, &nv)))
    return format("x: N = %lld, H = %lld, V = %lld are too large to index with 64-bit offsets",
                  (long long)d->n, (long long)d->h, (long long)d->v);
  if (auto e = check_tensor("labels", p.labels, 1, "[N]", kIndex); !e.empty())
    return p.labels.present() ? e : "labels: missing";
  if (auto e = check_size("labels", p.labels, 0, d->n, "N"); !e.empty()) return e;
  if (p.token_weights.present()) {
    if (auto e = check_tensor("token_weights", p.token_weights, 1, "[N]", kReal); !e.empty())
      return e;
    if (auto e = check_size("token_weights", p.token_weights, 0, d->n, "N"); !e.empty()) return e;
  }
  if (p.class_weights.present()) {
    if (auto e = check_tensor("class_weights", p.class_weights, 1, "[V]", kReal); !e.empty())
      return e;
    if (auto e = check_size("class_weights", p.class_weights, 0, d->v, "V"); !e.empty()) return e;
  }
  return "";
}

std::string check_options(const Options& o) {
  if (!(std::isfinite(o.logit_scale) && o.logit_scale > 0))
    return format("logit_scale = %s: must be finite and > 0",
                  number_text(o.logit_scale).c_str());
  if (!(std::isfinite(o.softcap) && o.softcap >= 0))
    return format("softcap = %s: must be finite and >= 0 (0 turns the softcap off)",
                  number_text(o.softcap).c_str());
  if (!(o.label_smoothing >= 0 && o.label_smoothing <= 1))
    return format("label_smoothing = %s: must be in [0, 1]",
                  number_text(o.label_smoothing).c_str());
  if (!(std::isfinite(o.z_loss) && o.z_loss >= 0))
    return format("z_loss = %s: must be finite and >= 0", number_text(o.z_loss).c_str());
  if (o.reduction != Reduction::none && o.reduction != Reduction::sum &&
      o.reduction != Reduction::mean)
    return format("reduction: value %d is not none, sum or mean", int(o.reduction));
  if (o.grad_logits_dtype != GradLogitsDtype::f32 &&
      o.grad_logits_dtype != GradLogitsDtype::storage)
    return format("grad_logits_dtype: value %d is neither f32 nor storage",
                  int(o.grad_logits_dtype));
  if (!(o.filter_eps == kFilterEpsAuto || (std::isfinite(o.filter_eps) && o.filter_eps >= 0)))
    return format("filter_eps = %s: must be finite and >= 0 (0 turns filtering off), or "
                  "kFilterEpsAuto (-1) for the storage dtype's epsilon / 32",
                  number_text(o.filter_eps).c_str());
  return "";
}

// Label range and weight signs need the data: checked here for host tensors.
// (A device backend checks device-resident values itself.)
std::string check_values(const Problem& p, const Dims& d) {
  if (p.labels.device == Device::cpu) {
    for (int64_t i = 0; i < d.n; ++i) {
      const int64_t y = load_int(p.labels, i);
      if (y != p.options.ignore_index && (y < 0 || y >= d.v))
        return format("labels[%lld] = %lld is outside [0, V) with V = %lld and is not "
                      "ignore_index (%lld)",
                      (long long)i, (long long)y, (long long)d.v,
                      (long long)p.options.ignore_index);
    }
  }
  for (auto [name, t] : {std::pair{"token_weights", &p.token_weights},
                         std::pair{"class_weights", &p.class_weights}}) {
    if (!t->present() || t->device != Device::cpu) continue;
    for (int64_t i = 0; i < t->shape[0]; ++i) {
      const double w = load(*t, i);
      if (!(std::isfinite(w) && w >= 0))
        return format("%s[%lld] = %s: weights must be finite and >= 0", name, (long long)i,
                      number_text(w, t->dtype).c_str());
    }
  }
  return "";
}

struct Arg {
  const char* name;
  const Tensor* t;
};

// Which outputs and cotangents each pass takes, and their shapes and dtypes.
std::string check_outputs(const Problem& p, Pass pass, const Dims& d) {
  const bool fwd = pass != Pass::backward, bwd = pass != Pass::forward;
  const Dtype in = d.logits_entry ? p.logits.dtype : p.x.dtype;
  const std::initializer_list<Dtype> grad_dtypes = {Dtype::f32, Dtype::f64, in};
  const bool scalar_loss = p.options.reduction != Reduction::none;
  if (fwd && !p.loss.present()) return format("loss: missing; %s() writes the loss", pass_name(pass));
  if (!p.lse.present())
    return bwd && !fwd ? "lse: missing; backward() reads the lse saved by forward()"
                       : format("lse: missing; %s() writes the lse", pass_name(pass));
  for (Arg a : {Arg{"loss", &p.loss}, Arg{"logprob", &p.logprob}, Arg{"argmax", &p.argmax},
                Arg{"entropy", &p.entropy}, Arg{"zloss", &p.zloss}}) {
    if (a.t->present() && !fwd)
      return format("%s: given, but backward() writes no forward outputs (use loss_and_grad())",
                    a.name);
  }
  for (Arg a : {Arg{"grad_loss", &p.grad_loss}, Arg{"grad_lse", &p.grad_lse},
                Arg{"grad_entropy", &p.grad_entropy}, Arg{"grad_x", &p.grad_x},
                Arg{"grad_w", &p.grad_w}, Arg{"grad_bias", &p.grad_bias},
                Arg{"grad_logits", &p.grad_logits}}) {
    if (a.t->present() && !bwd)
      return format("%s: given, but forward() computes no gradients (use loss_and_grad())",
                    a.name);
  }
  if (bwd && !p.grad_x.present() && !p.grad_w.present() && !p.grad_bias.present() &&
      !p.grad_logits.present())
    return format("grad_x: %s() was given no gradient output (grad_x, grad_w, grad_bias or "
                  "grad_logits)", pass_name(pass));
  for (Arg a : {Arg{"grad_x", &p.grad_x}, Arg{"grad_w", &p.grad_w},
                Arg{"grad_bias", &p.grad_bias}}) {
    if (d.logits_entry && a.t->present())
      return format("%s: the logits-level entry writes grad_logits, not grad_x/grad_w/grad_bias",
                    a.name);
  }
  if (!d.logits_entry && p.grad_logits.present())
    return "grad_logits: only the logits-level entry (logits given) writes grad_logits";
  if (p.grad_bias.present() && !p.bias.present())
    return "grad_bias: given, but the problem has no bias";

  struct Want {
    const char* name;
    const Tensor* t;
    int ndim;
    const char* dims;
    std::initializer_list<Dtype> dtypes;
    int64_t size0, size1;
  };
  const int64_t w0 = p.w.shape[0], w1 = p.w.shape[1];
  const char* loss_dims = p.options.reduction == Reduction::none ? "[N] (reduction none)"
                          : p.options.reduction == Reduction::sum ? "[] (reduction sum)"
                                                                  : "[] (reduction mean)";
  const Want wants[] = {
      {"loss", &p.loss, scalar_loss ? 0 : 1, loss_dims, kReal, d.n, 0},
      {"lse", &p.lse, 1, "[N]", kReal, d.n, 0},
      {"logprob", &p.logprob, 1, "[N]", kReal, d.n, 0},
      {"argmax", &p.argmax, 1, "[N]", kIndex, d.n, 0},
      {"entropy", &p.entropy, 1, "[N]", kReal, d.n, 0},
      {"zloss", &p.zloss, 1, "[N]", kReal, d.n, 0},
      {"grad_loss", &p.grad_loss, scalar_loss ? 0 : 1, loss_dims, kReal, d.n, 0},
      {"grad_lse", &p.grad_lse, 1, "[N]", kReal, d.n, 0},
      {"grad_entropy", &p.grad_entropy, 1, "[N]", kReal, d.n, 0},
      {"grad_x", &p.grad_x, 2, "[N, H]", grad_dtypes, d.n, d.h},
      {"grad_w", &p.grad_w, 2, "w's shape", grad_dtypes, w0, w1},
      {"grad_bias", &p.grad_bias, 1, "[V]", grad_dtypes, d.v, 0},
      {"grad_logits", &p.grad_logits, 2, "[N, V]", grad_dtypes, d.n, d.v},
  };
  for (const Want& w : wants) {
    if (!w.t->present()) continue;
    if (auto e = check_tensor(w.name, *w.t, w.ndim, w.dims, w.dtypes); !e.empty()) return e;
    if (w.ndim >= 1 && w.t->shape[0] != w.size0)
      return format("%s: shape %s, expected %s = [%lld%s]", w.name, shape_str(*w.t).c_str(),
                    w.dims, (long long)w.size0,
                    w.ndim == 2 ? (", " + std::to_string(w.size1)).c_str() : "");
    if (w.ndim == 2 && w.t->shape[1] != w.size1)
      return format("%s: shape %s, expected %s = [%lld, %lld]", w.name, shape_str(*w.t).c_str(),
                    w.dims, (long long)w.size0, (long long)w.size1);
  }
  return "";
}

// Every tensor, for the device and aliasing checks.
std::vector<Arg> inputs_of(const Problem& p, Pass pass) {
  std::vector<Arg> v = {{"x", &p.x},         {"w", &p.w},
                        {"bias", &p.bias},   {"logits", &p.logits},
                        {"labels", &p.labels}, {"token_weights", &p.token_weights},
                        {"class_weights", &p.class_weights}, {"grad_loss", &p.grad_loss},
                        {"grad_lse", &p.grad_lse}, {"grad_entropy", &p.grad_entropy}};
  if (pass == Pass::backward) v.push_back({"lse", &p.lse});
  return v;
}

std::vector<Arg> outputs_of(const Problem& p, Pass pass) {
  std::vector<Arg> v = {{"loss", &p.loss},       {"logprob", &p.logprob},
                        {"argmax", &p.argmax},   {"entropy", &p.entropy},
                        {"zloss", &p.zloss},     {"grad_x", &p.grad_x},
                        {"grad_w", &p.grad_w},   {"grad_bias", &p.grad_bias},
                        {"grad_logits", &p.grad_logits}};
  if (pass != Pass::backward) v.push_back({"lse", &p.lse});
  return v;
}

struct ByteRange {
  uintptr_t begin, end;
};
ByteRange bytes_of(const Tensor& t) {
  int64_t last = 0;
  for (int d = 0; d < t.ndim; ++d) last += (t.shape[d] - 1) * t.stride[d];
  const auto begin = reinterpret_cast<uintptr_t>(t.data);
  return {begin, begin + uintptr_t(last + 1) * dtype_size(t.dtype)};
}

bool overlap(ByteRange a, ByteRange b) { return a.begin < b.end && b.begin < a.end; }

// Every tensor a pass reads or writes, inputs first.
std::vector<Arg> tensors_of_pass(const Problem& p, Pass pass) {
  std::vector<Arg> all = inputs_of(p, pass), outs = outputs_of(p, pass);
  all.insert(all.end(), outs.begin(), outs.end());
  return all;
}

// The same elements at the same addresses: a size-1 dimension's stride,
// which addresses nothing, may differ (a [1, V] view from torch's expand).
bool same_view(const Tensor& a, const Tensor& b) {
  if (a.data != b.data || a.dtype != b.dtype || a.ndim != b.ndim) return false;
  for (int d = 0; d < a.ndim; ++d)
    if (a.shape[d] != b.shape[d] || (a.shape[d] > 1 && a.stride[d] != b.stride[d])) return false;
  return true;
}

// Whether two views address a common byte. Past their byte ranges one case
// is told exactly: vectors of one stride in bytes (columns of one buffer:
// lse and logprob side by side in an [N, 2] array), which interleave
// without sharing a byte when, modulo that stride, each one's elements
// fall in the other's gaps.
bool share_memory(const Tensor& a, const Tensor& b) {
  if (!overlap(bytes_of(a), bytes_of(b))) return false;
  if (a.ndim != 1 || b.ndim != 1 || a.shape[0] < 2 || b.shape[0] < 2) return true;
  const int64_t size_a = int64_t(dtype_size(a.dtype)), size_b = int64_t(dtype_size(b.dtype));
  const int64_t step = a.stride[0] * size_a;
  if (step != b.stride[0] * size_b) return true;
  const int64_t apart = int64_t(reinterpret_cast<uintptr_t>(b.data) -
                                reinterpret_cast<uintptr_t>(a.data));
  const int64_t phase = (apart % step + step) % step;  // where b's elements sit in a's stride
  return !(phase >= size_a && phase + size_b <= step);
}

// Two indices of a 2-D view map to one address unless one dimension's
// stride steps over the whole extent of the other.
bool overlaps_itself(const Tensor& t) {
  if (t.ndim < 2 || t.shape[0] < 2 || t.shape[1] < 2) return false;
  return !(t.stride[0] >= t.shape[1] * t.stride[1] || t.stride[1] >= t.shape[0] * t.stride[0]);
}

std::string check_devices_and_aliasing(const Problem& p, Pass pass) {
  const Tensor& first = p.logits.present() ? p.logits : p.x;
  const std::vector<Arg> all = tensors_of_pass(p, pass), outs = outputs_of(p, pass);
  for (Arg a : all) {
    if (a.t->present() && (a.t->device != first.device || a.t->device_index != first.device_index))
      return format("%s: lives on %s:%d but %s is on %s:%d; all tensors must share one device",
                    a.name, a.t->device == Device::cpu ? "cpu" : "cuda", a.t->device_index,
                    p.logits.present() ? "logits" : "x", first.device == Device::cpu ? "cpu" : "cuda",
                    first.device_index);
  }
  for (size_t i = 0; i < outs.size(); ++i) {
    if (!outs[i].t->present()) continue;
    if (overlaps_itself(*outs[i].t))
      return format("%s: strides [%lld, %lld] with shape %s make elements share memory; outputs "
                    "may not overlap themselves",
                    outs[i].name, (long long)outs[i].t->stride[0], (long long)outs[i].t->stride[1],
                    shape_str(*outs[i].t).c_str());
    for (Arg other : all) {
      if (other.t == outs[i].t || !other.t->present()) continue;
      if (outs[i].t == &p.grad_logits && other.t == &p.logits && same_view(p.grad_logits, p.logits))
        continue;  // in place, as Liger and Unsloth do
      if (share_memory(*outs[i].t, *other.t))
        return format("%s: overlaps %s in memory; outputs may not alias inputs or other outputs "
                      "(only grad_logits may be exactly the logits, for in-place use)",
                      outs[i].name, other.name);
    }
  }
  return "";
}

}  // namespace

std::string check_workspace_aliasing(const Problem& p, Pass pass, const void* workspace,
                                     size_t bytes) {
  if (workspace == nullptr || bytes == 0) return "";
  const auto begin = reinterpret_cast<uintptr_t>(workspace);
  for (Arg a : tensors_of_pass(p, pass)) {
    if (a.t->present() && overlap({begin, begin + bytes}, bytes_of(*a.t)))
      return format("workspace: its %zu bytes overlap %s in memory; the backend overwrites its "
                    "workspace, so it may not alias an input or output",
                    bytes, a.name);
  }
  return "";
}

std::string validate(const Problem& p, Pass pass, Dims* dims) {
  if (pass != Pass::forward && pass != Pass::backward && pass != Pass::loss_and_grad)
    return format("pass: value %d is not forward, backward or loss_and_grad", int(pass));
  Dims d;
  if (auto e = validate_inputs(p, &d); !e.empty()) return e;
  if (auto e = check_outputs(p, pass, d); !e.empty()) return e;
  if (auto e = check_devices_and_aliasing(p, pass); !e.empty()) return e;
  if (auto e = check_values(p, d); !e.empty()) return e;
  *dims = d;
  return "";
}

std::string validate_inputs(const Problem& p, Dims* dims) {
  if (auto e = check_inputs(p, dims); !e.empty()) return e;
  return check_options(p.options);
}

Dims dims_of(const Problem& p) {
  if (p.logits.present()) return {p.logits.shape[0], 0, p.logits.shape[1], true};
  const bool vh = p.w_layout == WeightLayout::vh;
  return {p.x.shape[0], p.x.shape[1], p.w.shape[vh ? 0 : 1], false};
}

Problem with_canonical_strides(const Problem& p) {
  Problem c = p;
  for (auto named : tensors_of(c)) {
    Tensor* t = named.tensor;
    for (int d = t->ndim - 1; d >= 0; --d) {
      if (t->shape[d] != 1) continue;
      t->stride[d] = d == t->ndim - 1 ? 1 : t->stride[d + 1] * t->shape[d + 1];
    }
  }
  return c;
}

std::string validate_config(const RunConfig& config) {
  if (config.threads < 0 || config.threads > kMaxThreads)
    return format("threads = %d: must be in [0, %d] (0 = the backend's default)", config.threads,
                  kMaxThreads);
  return "";
}

Tensor w_as_vh(const Tensor& w, WeightLayout layout) {
  return layout == WeightLayout::vh ? w : transposed(w);
}

}  // namespace flce
