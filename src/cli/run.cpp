// `flce run`: reads .npy inputs, validates everything, computes, and only
// then writes the outputs, each to a temporary name renamed into place, so
// a bad input or a failure leaves no partial files in --out.
#include "cli/run.h"

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "cli/args.h"
#include "cli/inputs.h"
#include "cli/out_dir.h"
#include "common/tensor_access.h"
#include "flce/flce.h"
#include "io/npy.h"
#include "validate.h"

namespace flce::cli {
namespace {

const std::vector<Flag>& run_flags() {
  static const std::vector<Flag> flags = {
      {"x", "X.npy", "hidden states [N, H]"},
      {"w", "W.npy", "head weight [V, H] (or [H, V] with --w-layout hv)"},
      {"labels", "Y.npy", "labels [N], int32 or int64"},
      {"logits", "Z.npy", "logits [N, V]: the logits-level entry, instead of --x/--w/--bias"},
      {"bias", "B.npy", "bias [V]"},
      {"token-weights", "T.npy", "token weights [N] (default 1)"},
      {"class-weights", "C.npy", "class weights [V] (default 1)"},
      {"w-layout", "vh|hv", "how W is stored (default vh, PyTorch's lm_head.weight)"},
      {"dtype", "f32|bf16|f16", "round x, W, bias (or logits) to this storage first "
                                "(default: as stored in the files)"},
      {"logit-scale", "A", "logit scale a > 0 (default 1)"},
      {"softcap", "K", "softcap k >= 0, 0 = off (default 0)"},
      {"ignore-index", "I", "label of rows that carry no loss (default -100)"},
      {"label-smoothing", "E", "label smoothing in [0, 1] (default 0)"},
      {"z-loss", "L", "z-loss weight >= 0 (default 0)"},
      {"reduction", "none|sum|mean", "how per-row losses combine (default mean)"},
      {"grad", nullptr, "also compute gradients"},
      {"grad-loss", "G.npy", "cotangent of the loss: 0-d for sum/mean, [N] for none"},
      {"grad-lse", "G.npy", "cotangent of lse [N]"},
      {"grad-entropy", "G.npy", "cotangent of the entropy [N]"},
      {"grad-logits", "f32|storage", "dtype of dlogits before the gradient GEMMs (default f32)"},
      {"filter-eps", "E|auto", "gradient filtering (cpu, with --grad): skip dlogits blocks with all |G| <= E kappa_i; auto = storage epsilon / 32 (default 0, off)"},
      {"backend", "NAME", "force a backend (see `flce backends`)"},
      {"gemm", "NAME", "the GEMM engine: openblas|onednn|eigen for cpu, cublas for cuda"},
      {"threads", "T", "CPU threads, 0 to 4096 (default 0: all)"},
      {"out-dtype", "f32|f64", "dtype of the output arrays (default f32)"},
      {"out", "DIR", "directory for the output .npy files (created if missing)"},
      {"help", nullptr, "show this help"},
  };
  return flags;
}

// Everything `flce run` holds: inputs as read, outputs to be written.
struct RunState {
  std::vector<std::pair<std::string, io::NpyArray*>> outputs;  // file name, array
  io::NpyArray x, w, bias, logits, labels, token_w, class_w, g_loss, g_lse, g_ent;
  io::NpyArray loss, lse, logprob, argmax, entropy, zloss, grad_x, grad_w, grad_bias,
      grad_logits;
};

Options read_options(const Args& args) {
  Options o;
  check(args.get_double("logit-scale", &o.logit_scale));
  check(args.get_double("softcap", &o.softcap));
  check(args.get_int("ignore-index", &o.ignore_index));
  check(args.get_double("label-smoothing", &o.label_smoothing));
  check(args.get_double("z-loss", &o.z_loss));
  int reduction = int(Reduction::mean);
  check(args.get_choice("reduction", {"none", "sum", "mean"}, &reduction));
  o.reduction = Reduction(reduction);
  int grad_logits = int(GradLogitsDtype::f32);
  check(args.get_choice("grad-logits", {"f32", "storage"}, &grad_logits));
  o.grad_logits_dtype = GradLogitsDtype(grad_logits);
  check(get_filter_eps(args, &o.filter_eps));
  return o;
}

void check_flag_combinations(const Args& args) {
  const bool head = args.has("x") || args.has("w") || args.has("bias");
  if (args.has("logits") && head)
    throw Failure{"--logits: cannot be combined with --x, --w or --bias (give one entry)"};
  if (!args.has("logits") && !(args.has("x") && args.has("w")))
    throw Failure{args.has("x") ? "--w: missing (--x needs --w)"
                                : "--x: missing (give --x and --w, or --logits)"};
  if (args.has("logits") && args.has("w-layout"))
    throw Failure{"--w-layout: only applies with --w"};
  if (!args.has("labels")) throw Failure{"--labels: missing"};
  if (!args.has("out")) throw Failure{"--out: missing (the directory for the outputs)"};
  for (const char* g : {"grad-loss", "grad-lse", "grad-entropy"})
    if (args.has(g) && !args.has("grad"))
      throw Failure{std::string("--") + g + ": a cotangent needs --grad"};
  if (args.has("filter-eps") && !args.has("grad"))
    throw Failure{"--filter-eps: filters gradients, so needs --grad"};
  if (args.has("grad-logits") && !args.has("grad"))
    throw Failure{"--grad-logits: the dtype of dlogits, which only --grad computes"};
}

// Reads the inputs and fills the problem's input fields.
void load_inputs(const Args& args, RunState& s, Problem& p) {
  int storage = -1, layout = 0;
  check(args.get_choice("dtype", {"f32", "bf16", "f16"}, &storage));
  check(args.get_choice("w-layout", {"vh", "hv"}, &layout));
  p.w_layout = WeightLayout(layout);
  if (args.has("logits")) {
    s.logits = load_storage(args, "logits", storage);
    p.logits = view_of(s.logits);
  } else {
    s.x = load_storage(args, "x", storage);
    s.w = load_storage(args, "w", storage);
    p.x = view_of(s.x);
    p.w = view_of(s.w);
    if (args.has("bias")) s.bias = load_storage(args, "bias", storage), p.bias = view_of(s.bias);
  }
  s.labels = load_labels(args);
  p.labels = view_of(s.labels);
  auto optional = [&](const char* flag, io::NpyArray& a, Tensor& t, bool scalar_ok) {
    if (!args.has(flag)) return;
    a = load_real(args, flag);
    if (scalar_ok && a.shape == std::vector<int64_t>{1}) a.shape.clear();  // [1] as 0-D
    t = view_of(a);
  };
  optional("token-weights", s.token_w, p.token_weights, false);
  optional("class-weights", s.class_w, p.class_weights, false);
  const bool scalar_loss = p.options.reduction != Reduction::none;
  optional("grad-loss", s.g_loss, p.grad_loss, scalar_loss);
  optional("grad-lse", s.g_lse, p.grad_lse, false);
  optional("grad-entropy", s.g_ent, p.grad_entropy, false);
}

// Shapes of the inputs as the API would read them (the API re-validates).
struct Sizes {
  int64_t n = 0, v = 0;
};
Sizes sizes_of(const Problem& p) {
  if (p.logits.present()) return {p.logits.shape[0], p.logits.shape[1]};
  return {p.x.shape[0], p.w.shape[p.w_layout == WeightLayout::vh ? 0 : 1]};
}

// Allocates every output and points the problem at it.
void allocate_outputs(RunState& s, Problem& p, Dtype out, bool grad) {
  const Sizes z = sizes_of(p);
  auto add = [&](const char* file, io::NpyArray& a, Tensor& t, Dtype dtype,
                 std::vector<int64_t> shape) {
    a = make_array(dtype, std::move(shape));
    t = view_of(a);
    s.outputs.push_back({file, &a});
  };
  const bool scalar = p.options.reduction != Reduction::none;
  add("loss.npy", s.loss, p.loss, out, scalar ? std::vector<int64_t>{} : std::vector{z.n});
  add("lse.npy", s.lse, p.lse, out, {z.n});
  add("logprob.npy", s.logprob, p.logprob, out, {z.n});
  add("argmax.npy", s.argmax, p.argmax, Dtype::i64, {z.n});
  add("entropy.npy", s.entropy, p.entropy, out, {z.n});
  add("zloss.npy", s.zloss, p.zloss, out, {z.n});
  if (!grad) return;
  if (p.logits.present()) {
    add("grad_logits.npy", s.grad_logits, p.grad_logits, out, {z.n, z.v});
    return;
  }
  add("grad_x.npy", s.grad_x, p.grad_x, out, {p.x.shape[0], p.x.shape[1]});
  add("grad_w.npy", s.grad_w, p.grad_w, out, {p.w.shape[0], p.w.shape[1]});
  if (p.bias.present()) add("grad_bias.npy", s.grad_bias, p.grad_bias, out, {z.v});
}

// Writes every output under a temporary name, then commit_outputs() renames
// them all into place (or none) and removes outputs of an earlier command
// that this run does not write (a grad_w.npy after a run without --grad), so
// DIR holds one run's outputs; on a failed write it removes what it wrote.
void write_outputs(const RunState& s, const std::string& dir,
                   const std::vector<std::string>& inputs) {
  namespace fs = std::filesystem;
  make_out_dir(dir, "flce run");
  Renames written;  // temporary, final
  for (auto& [file, array] : s.outputs) {
    const fs::path tmp = temporary_path(dir, file);
    written.push_back({tmp, fs::path(dir) / file});
    if (auto e = io::write_npy(tmp.string(), *array); !e.empty()) {
      std::error_code ignored;
      for (auto& entry : written) fs::remove(entry.first, ignored);
      throw Failure{"--out: " + e};
    }
  }
  std::vector<std::string> not_removed;
  const std::vector<std::string> removed = commit_outputs(dir, written, inputs,
                                                         /*remove_others=*/true, &not_removed);
  // They may be the user's own files of those names, not an earlier run's.
  if (!removed.empty())
    std::fprintf(stderr, "flce run: note: removed %s from --out %s (output names this run "
                 "does not write)\n", name_list(removed).c_str(), dir.c_str());
  for (const std::string& why : not_removed)  // this run's outputs are in place regardless
    std::fprintf(stderr, "flce run: warning: --out %s keeps %s (not this run's output)\n",
                 dir.c_str(), why.c_str());
}

// A problem the cpu backend declined (x, W and bias of different dtypes, a
// scale its f32 arithmetic cannot hold), run on the float64 reference
// without being asked: many times slower, so say why. Not for float64
// inputs, which run there as documented.
void note_fallback(const Status& status, const Problem& p) {
  if (status.backend != "reference" || status.declined.empty()) return;
  for (const Tensor* t : {&p.x, &p.w, &p.bias, &p.logits})
    if (t->present() && t->dtype == Dtype::f64) return;
  std::fprintf(stderr, "flce run: note: ran on the float64 reference backend (much slower): %s\n",
               status.declined.c_str());
}

void print_summary(const RunState& s, const Status& status, const Problem& p,
                   const std::string& dir) {
  const Tensor loss = vector_view(s.loss.bytes.data(), s.loss.dtype, s.loss.numel());
  const Tensor lse = vector_view(s.lse.bytes.data(), s.lse.dtype, s.lse.numel());
  static const char* names[] = {"none", "sum", "mean"};
  std::printf("backend: %s\n", status.backend.c_str());
  if (p.options.reduction == Reduction::none) {
    std::printf("loss (none): [");
    for (int64_t i = 0; i < loss.shape[0] && i < 4; ++i) std::printf("%s%.9g", i ? ", " : "", load(loss, i));
    std::printf("%s]\n", loss.shape[0] > 4 ? ", ..." : "");
  } else {
    std::printf("loss (%s): %.9g\n", names[int(p.options.reduction)], load(loss, 0));
  }
  std::printf("lse: [");
  for (int64_t i = 0; i < lse.shape[0] && i < 4; ++i) std::printf("%s%.9g", i ? ", " : "", load(lse, i));
  std::printf("%s]\n", lse.shape[0] > 4 ? ", ..." : "");
  std::printf("wrote %zu files to %s\n", s.outputs.size(), dir.c_str());
}

int run(const Args& args) {
  check_flag_combinations(args);
  RunState s;
  Problem p;
  p.options = read_options(args);
  load_inputs(args, s, p);
  int out = 0;
  check(args.get_choice("out-dtype", {"f32", "f64"}, &out));
  RunConfig config;
  config.backend = args.get("backend");
  config.gemm = args.get("gemm");
  int64_t threads = 0;
  check(args.get_int("threads", &threads));
  // 0: the backend's default (all cores), as for flce bench and Python's threads=0.
  if (threads < 0 || threads > 4096)
    throw Failure{"--threads: " + std::to_string(threads) + " is not in [0, 4096] (0: all cores)"};
  config.threads = int(threads);
  const bool grad = args.has("grad");
  // Named before the outputs are sized from the inputs: an x of shape
  // (2^50, 0) would otherwise end in "out of memory".
  Dims dims;
  if (auto e = validate_inputs(p, &dims); !e.empty()) throw Failure{explain_api_error(e, args)};
  allocate_outputs(s, p, out == 0 ? Dtype::f32 : Dtype::f64, grad);
  std::vector<std::string> names;
  for (const auto& [file, array] : s.outputs) names.push_back(file);
  refuse_outputs_over_inputs(args, run_flags(), args.get("out"), names);
  const Status status = call_on_host_arrays(p, grad ? Pass::loss_and_grad : Pass::forward, config);
  if (!status.ok()) throw Failure{explain_api_error(status.error, args)};
  write_outputs(s, args.get("out"), input_files(args, run_flags()));
  print_summary(s, status, p, args.get("out"));
  note_fallback(status, p);
  return 0;
}

}  // namespace

const char* run_usage() {
  static const std::string text =
      "usage: flce run --x X.npy --w W.npy --labels Y.npy [options] --out DIR\n"
      "       flce run --logits Z.npy --labels Y.npy [options] --out DIR\n\n"
      "Computes the fused linear cross-entropy (README: Semantics) and writes\n"
      "DIR/loss.npy (0-d for sum and mean), lse.npy, logprob.npy, argmax.npy (int64),\n"
      "entropy.npy, zloss.npy; with --grad also grad_x.npy, grad_w.npy (in W's layout)\n"
      "and grad_bias.npy (with --bias), or grad_logits.npy for --logits.\n"
      "Outputs are float32, or float64 with --out-dtype f64. Nothing is written\n"
      "unless every input is valid and the computation succeeded.\n\noptions:\n" +
      describe_flags(run_flags());
  return text.c_str();
}

int run_command(int argc, char** argv, int first) {
  Args args;
  try {
    check(args.parse(argc, argv, first, run_flags()));
    if (args.has("help")) {
      std::fputs(run_usage(), stdout);
      return 0;
    }
    return run(args);
  } catch (const Failure& f) {
    std::fprintf(stderr, "flce run: error: %s\n", f.message.c_str());
    return 2;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "flce run: error: out of memory\n");
    return 2;
  }
}

}  // namespace flce::cli
