#include "cli/inputs.h"

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <utility>

#include "common/tensor_access.h"
#include "cuda/device_copy.h"

namespace flce::cli {
namespace {

// The flag each API argument name comes from, and whether its value is a
// file (named in messages).
struct FlagOf {
  const char* api;
  const char* flag;
  bool file;
};
const FlagOf* flag_of(const std::string& api_name) {
  static const FlagOf table[] = {
      {"x", "x", true}, {"w", "w", true}, {"bias", "bias", true}, {"logits", "logits", true},
      {"labels", "labels", true}, {"token_weights", "token-weights", true},
      {"class_weights", "class-weights", true}, {"logit_scale", "logit-scale", false},
      {"softcap", "softcap", false}, {"label_smoothing", "label-smoothing", false},
      {"z_loss", "z-loss", false}, {"grad_loss", "grad-loss", true},
      {"grad_lse", "grad-lse", true}, {"grad_entropy", "grad-entropy", true},
      {"backend", "backend", false}, {"threads", "threads", false}, {"gemm", "gemm", false},
      {"grad_logits_dtype", "grad-logits", false}, {"filter_eps", "filter-eps", false}};
  for (const FlagOf& f : table)
    if (api_name == f.api) return &f;
  return nullptr;
}

// "--x X.npy" for a file, "--backend" for a value (the message quotes the value).
std::string flag_and_value(const FlagOf& of, const Args& args) {
  std::string s = std::string("--") + of.flag;
  if (of.file) {
    s += ' ';
    s += args.get(of.flag);
  }
  return s;
}

std::string not_float(const Args& args, const char* flag, Dtype dtype) {
  return std::string("--") + flag + " " + args.get(flag) + ": dtype " + dtype_name(dtype) +
         " is not a float type (float16, float32 or float64)";
}

}  // namespace

void check(const std::string& error) {
  if (!error.empty()) throw Failure{error};
}

namespace {

// The flag a backend's decline is about where the user gave it ("backend =
// reference: declines this problem: gemm = 'eigen': ..." and --gemm eigen),
// to name beside the backend's source, since changing either one would do.
const FlagOf* decline_cause(const std::string& error, const Args& args) {
  const std::string declines = ": declines this problem: ";
  const size_t at = error.find(declines);
  if (at == std::string::npos) return nullptr;
  const std::string reason = error.substr(at + declines.size());
  const FlagOf* cause = flag_of(reason.substr(0, reason.find_first_of(" :[")));
  return cause != nullptr && args.has(cause->flag) ? cause : nullptr;
}

}  // namespace

std::string explain_api_error(const std::string& error, const Args& args) {
  const FlagOf* of = flag_of(error.substr(0, error.find_first_of(" :[")));
  const FlagOf* cause = decline_cause(error, args);
  if (of == nullptr)  // "FLCE_BACKEND = reference: declines this problem: ..."
    return cause ? flag_and_value(*cause, args) + ": " + error : error;
  const std::string with = cause && cause != of ? " with " + flag_and_value(*cause, args) : "";
  const char* flag = of->flag;
  if (!args.has(flag)) {  // a default, not the user's flag: say where it came from
    if (std::string(flag) != "backend") return error;
    const char* env = std::getenv("FLCE_BACKEND");
    return (env != nullptr && *env != '\0' ? std::string("FLCE_BACKEND=") + env
                                            : std::string("the default backend (--backend picks "
                                                          "another)")) +
           with + ": " + error;
  }
  return flag_and_value(*of, args) + with + ": " + error;
}

namespace {

// The given flags that name a .npy file (placeholder "X.npy").
std::vector<const Flag*> file_flags(const Args& args, const std::vector<Flag>& flags) {
  std::vector<const Flag*> given;
  for (const Flag& f : flags) {
    const std::string value = f.value != nullptr ? f.value : "";
    const bool file = value.size() > 4 && value.compare(value.size() - 4, 4, ".npy") == 0;
    if (file && args.has(f.name)) given.push_back(&f);
  }
  return given;
}

}  // namespace

std::vector<std::string> input_files(const Args& args, const std::vector<Flag>& flags) {
  std::vector<std::string> files;
  for (const Flag* f : file_flags(args, flags)) files.push_back(args.get(f->name));
  return files;
}

namespace {

// The directory entry `path` names: its directory resolved (symlinks, ..),
// its last component as given, since the commit renames over that entry
// and never writes into the file behind it (a hard link or symlink there
// to an input leaves the input alone).
std::filesystem::path entry_of(const std::filesystem::path& path) {
  std::error_code ec;
  const std::filesystem::path parent = path.has_parent_path() ? path.parent_path() : ".";
  return std::filesystem::weakly_canonical(parent, ec) / path.filename();
}

}  // namespace

void refuse_outputs_over_inputs(const Args& args, const std::vector<Flag>& flags,
                                const std::string& dir, const std::vector<std::string>& outputs) {
  for (const std::string& name : outputs)
    for (const Flag* f : file_flags(args, flags))
      if (entry_of(std::filesystem::path(dir) / name) == entry_of(args.get(f->name)))
        throw Failure{"--out " + dir + ": writing " + name + " there would replace the input --" +
                      f->name + " " + args.get(f->name) + " (give another --out)"};
}

std::string get_filter_eps(const Args& args, double* out) {
  if (!args.has("filter-eps")) return "";
  if (args.get("filter-eps") == "auto") {
    *out = kFilterEpsAuto;
    return "";
  }
  double eps = 0;
  if (auto e = args.get_double("filter-eps", &eps); !e.empty()) return e + " (or auto)";
  if (!(eps >= 0) || !std::isfinite(eps))
    return "--filter-eps: '" + args.get("filter-eps") +
           "' must be a finite number >= 0 (0 turns filtering off) or auto";
  *out = eps;
  return "";
}

Dtype storage_dtype(int index) {
  static const Dtype storages[] = {Dtype::f32, Dtype::bf16, Dtype::f16};
  return storages[index];
}

io::NpyArray make_array(Dtype dtype, std::vector<int64_t> shape) {
  io::NpyArray a;
  a.dtype = dtype;
  a.shape = std::move(shape);
  a.bytes.assign(size_t(a.numel()) * dtype_size(dtype), 0);
  return a;
}

io::NpyArray convert(const io::NpyArray& a, Dtype dtype) {
  io::NpyArray out = make_array(dtype, a.shape);
  const Tensor src = vector_view(a.bytes.data(), a.dtype, a.numel());
  const Tensor dst = vector_view(out.bytes.data(), dtype, a.numel());
  for (int64_t i = 0; i < a.numel(); ++i) store(dst, i, load(src, i));
  return out;
}

Tensor view_of(io::NpyArray& a) {
  Tensor t;
  t.data = a.bytes.data();
  t.dtype = a.dtype;
  t.ndim = int(a.shape.size());
  int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0 && d < 2; --d) {
    t.shape[d] = a.shape[d];
    t.stride[d] = stride;
    stride *= a.shape[d];
  }
  return t;
}

io::NpyArray load_npy(const Args& args, const char* flag) {
  io::NpyArray a;
  if (auto e = io::read_npy(args.get(flag), &a); !e.empty())
    throw Failure{std::string("--") + flag + ": " + e};
  if (a.shape.size() > 2)
    throw Failure{std::string("--") + flag + " " + args.get(flag) + ": " +
                  std::to_string(a.shape.size()) + "-D array; flce takes 0-D, 1-D or 2-D arrays"};
  return a;
}

io::NpyArray load_storage(const Args& args, const char* flag, int storage) {
  io::NpyArray a = load_npy(args, flag);
  if (!dtype_is_float(a.dtype)) throw Failure{not_float(args, flag, a.dtype)};
  if (storage < 0 || storage_dtype(storage) == a.dtype) return a;
  return convert(a, storage_dtype(storage));
}

io::NpyArray load_real(const Args& args, const char* flag) {
  io::NpyArray a = load_npy(args, flag);
  if (!dtype_is_float(a.dtype)) throw Failure{not_float(args, flag, a.dtype)};
  if (a.dtype == Dtype::f16) a = convert(a, Dtype::f32);
  return a;
}

io::NpyArray load_labels(const Args& args) {
  io::NpyArray a = load_npy(args, "labels");
  if (a.dtype != Dtype::i32 && a.dtype != Dtype::i64)
    throw Failure{"--labels " + args.get("labels") + ": dtype " + dtype_name(a.dtype) +
                  "; labels must be int32 or int64"};
  return a;
}

bool wants_device(const RunConfig& config) {
  std::string name = config.backend;
  if (name.empty()) {
    const char* env = std::getenv("FLCE_BACKEND");
    name = env ? env : "";
  }
  return name == "cuda";
}

namespace {

// `call` on device copies of `host`'s arrays (GPU 0), the outputs copied back
// after it. W and the bias come from `head` when it is given (already on the
// device), else are copied with the rest.
// Copies `host`'s present tensors to GPU 0; "" or the error, as the API
// would say it.
std::string upload(cuda::DeviceProblem& device, const Problem& host) {
  const std::string e = device.upload(host, 0);
  return e.empty() ? e : "backend = cuda: " + e;
}

template <class Call>
Status call_on_device_copies(const Problem& host, Call call, const cuda::DeviceProblem* head) {
  Problem rest = host;
  if (head != nullptr) rest.w = Tensor(), rest.bias = Tensor();
  cuda::DeviceProblem device;
  Status status;
  status.error = upload(device, rest);
  if (!status.ok()) return status;
  Problem p = device.problem();
  if (head != nullptr) p.w = head->problem().w, p.bias = head->problem().bias;
  status = call(p);
  if (status.ok()) status.error = device.download(rest);
  return status;
}

}  // namespace

Status call_on_host_arrays(const Problem& host, Pass pass, const RunConfig& config) {
  auto call = [&](const Problem& p) {
    switch (pass) {
      case Pass::forward: return forward(p, config);
      case Pass::backward: return backward(p, config);
      case Pass::loss_and_grad: return loss_and_grad(p, config);
    }
    Status unknown;
    unknown.error = "unknown pass";
    return unknown;
  };
  if (!wants_device(config)) return call(host);
  return call_on_device_copies(host, call, nullptr);
}

ForwardOnHostBlocks::ForwardOnHostBlocks() = default;
ForwardOnHostBlocks::~ForwardOnHostBlocks() = default;

Status ForwardOnHostBlocks::operator()(const Problem& host, const RunConfig& config) {
  auto call = [&](const Problem& p) { return forward(p, config); };
  if (!wants_device(config)) return call(host);
  if (head_ == nullptr) {
    Problem head;
    head.w_layout = host.w_layout;
    head.w = host.w, head.bias = host.bias;
    auto copy = std::make_unique<cuda::DeviceProblem>();
    Status status;
    status.error = upload(*copy, head);
    if (!status.ok()) return status;
    head_ = std::move(copy);
    head_w_ = host.w.data, head_bias_ = host.bias.data;
  } else if (host.w.data != head_w_ || host.bias.data != head_bias_) {
    Status status;  // a caller's mistake: the copies on the GPU are of other arrays
    status.error = "ForwardOnHostBlocks: w or bias is not the array of the first call";
    return status;
  }
  return call_on_device_copies(host, call, head_.get());
}

}  // namespace flce::cli
