// The `cpu` backend. For each block of R rows (in order): one GEMM per vocab
// tile gives the block's scores, SIMD kernels fold them into per-tile softmax
// states that merge in tile order; for gradients the scores become dlogits in
// place and feed the grad_W GEMM (one owner per vocab tile) and the grad_x
// GEMM (one owner per task of Plan::h_chunk columns). Where V is large a
// training step goes vocab outer instead (cpu::Plan): the rows' statistics
// first, then the logits again, chunk by chunk. Memory: the [R, V] scores
// (R chosen from a 48 MiB budget; a forward pass keeps one tile per thread
// instead; vocab outer, [R, chunk]), per-thread W tiles, O(N) row losses,
// and an f32 grad_W accumulator only when grad_w is not f32.
#include "cpu/cpu_backend.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/float32_options.h"
#include "common/loss_terms.h"
#include "common/parallel.h"
#include "common/tensor_access.h"
#include "cpu/operands.h"
#include "cpu/plan.h"
#include "cpu/steps.h"

namespace flce {
namespace {

using cpu::Plan;
using cpu::Workspace;

std::string dtype_str(Dtype d) { return dtype_name(d); }

// sum_j c_j W_j in double, for the filter's rank-one smoothing term of grad_x.
void uniform_weight_sum(const Problem& p, const Plan& plan, const Workspace& ws) {
  const int64_t H = plan.d.h;
  const Tensor w = w_as_vh(p.w, p.w_layout);
  std::vector<double> row(static_cast<size_t>(H));
  std::fill_n(ws.uniform_w, H, 0.0);
  for (int64_t j = 0; j < plan.d.v; ++j) {
    load_row(w, j, row.data());
    const double c_j = ws.class_w ? ws.class_w[j] : 1.0;
    for (int64_t h = 0; h < H; ++h) ws.uniform_w[h] += c_j * row[h];
  }
}

// Copies of the class weights and bias in f32, C and D (README, Semantics).
cpu::Context prepare(const Problem& p, const Plan& plan, const Workspace& ws, RunStats* stats) {
  const int64_t V = plan.d.v;
  double class_sum = 0;
  for (int64_t j = 0; j < V; ++j) {
    const double c_j = p.class_weights.present() ? load(p.class_weights, j) : 1.0;
    if (ws.class_w) ws.class_w[j] = float(c_j);
    if (ws.bias) ws.bias[j] = float(load(p.bias, j));
    class_sum += c_j;
  }
  const double denom = mean_denominator(p, plan.d.n);
  if (ws.w_written) std::fill_n(ws.w_written, plan.tiles, uint8_t(0));
  if (ws.grad_b_acc) std::fill_n(ws.grad_b_acc, V, 0.0);
  if (ws.uniform_x) std::fill_n(ws.uniform_x, plan.d.h + 1, 0.0);
  if (ws.uniform_w) uniform_weight_sum(p, plan, ws);
  return {p, plan, ws, class_sum, denom, stats};
}

// The filter's rank-one smoothing term for the weights: grad_W_j += c_j
// sum_i u_i x_i and grad_b_j += c_j sum_i u_i (grad_x got u_i sum_j c_j W_j
// row by row).
void add_uniform_term(const cpu::Context& c) {
  const Problem& p = c.p;
  const int64_t H = c.plan.d.h, V = c.plan.d.v;
  const double* ux = c.ws.uniform_x;
  const Tensor g = w_as_vh(p.grad_w, p.w_layout);  // f32 when accumulated in place
  for (int64_t j = 0; j < V && p.grad_w.present(); ++j) {
    const double c_j = c.ws.class_w ? c.ws.class_w[j] : 1.0;
    float* acc = c.ws.grad_w_acc ? c.ws.grad_w_acc + j * H : nullptr;
    for (int64_t h = 0; h < H; ++h) {
      float& v = acc ? acc[h] : static_cast<float*>(g.data)[j * g.stride[0] + h * g.stride[1]];
      v = float(v + c_j * ux[h]);
    }
  }
  if (c.ws.grad_b_acc)
    for (int64_t j = 0; j < V; ++j) c.ws.grad_b_acc[j] += (c.ws.class_w ? c.ws.class_w[j] : 1.0) * ux[H];
}

// Zeros the grad_W rows of the tiles no GEMM wrote (every block of the tile
// filtered out), in grad_w itself or in the f32 accumulator.
void zero_unwritten_tiles(const cpu::Context& c) {
  const Plan& plan = c.plan;
  const int64_t H = plan.d.h;
  const Tensor g = c.p.grad_w;  // f32 when accumulated in place; [V, H] or [H, V]
  const bool hv = c.p.w_layout == WeightLayout::hv;
  for (int64_t t = 0; t < plan.tiles; ++t) {
    if (c.ws.w_written[t]) continue;
    const int64_t j0 = t * cpu::kVocabTile, n = std::min(cpu::kVocabTile, plan.d.v - j0);
    if (c.ws.grad_w_acc) {
      std::fill_n(c.ws.grad_w_acc + j0 * H, n * H, 0.0f);
    } else if (hv) {  // columns j0 .. j0+n of [H, V]
      for (int64_t h = 0; h < H; ++h)
        std::fill_n(static_cast<float*>(g.data) + h * g.stride[0] + j0, n, 0.0f);
    } else {
      for (int64_t j = j0; j < j0 + n; ++j)
        std::fill_n(static_cast<float*>(g.data) + j * g.stride[0], H, 0.0f);
    }
  }
}

// The reduced loss (rows summed in order, in double) and the accumulated
// weight and bias gradients in their output dtypes.
void finish(const cpu::Context& c) {
  const Problem& p = c.p;
  const Plan& plan = c.plan;
  if (plan.pass != Pass::backward && p.options.reduction != Reduction::none) {
    store(p.loss, 0, reduce_loss(p, c.ws.row_loss, plan.d.n, c.denom));
  }
  if (c.ws.w_written) zero_unwritten_tiles(c);  // there is a grad_w
  if (plan.filter_uniform) add_uniform_term(c);
  if (c.ws.grad_w_acc) {  // row by row: each row's bits depend on that row only
    const Tensor g = w_as_vh(p.grad_w, p.w_layout);
    parallel_for(plan.threads, 0, plan.d.v, [&](int64_t j) {
      cpu::store_row(g, j, c.ws.grad_w_acc + j * plan.d.h, plan.d.h);
    });
  }
  if (c.ws.grad_b_acc)
    for (int64_t j = 0; j < plan.d.v; ++j) store(p.grad_bias, j, c.ws.grad_b_acc[j]);
}

// Rows outer (cpu::Plan): each row block's scores over the whole
// vocabulary, then its gradients.
void run_rows_outer(const cpu::Context& c) {
  const Plan& plan = c.plan;
  for (int64_t i0 = 0; i0 < plan.d.n; i0 += plan.row_block) {
    const int64_t rows = std::min(plan.row_block, plan.d.n - i0);
    cpu::scores_and_states(c, i0, rows);
    cpu::merge_rows(c, i0, rows);
    if (plan.pass == Pass::forward) continue;
    cpu::grad_logits_and_weights(c, i0, rows);
    if (c.p.grad_x.present()) cpu::grad_hidden(c, i0, rows);
  }
}

// The statistics of a super-block's rows by the one-tile forward, in pieces
// of kMaxRowBlock rows (a forward's bits), loading x_block on the way.
void forward_pieces(const cpu::Context& c, int64_t i0, int64_t rows) {
  Plan piece_plan = c.plan;
  piece_plan.tile_scores = true;
  piece_plan.row_block = cpu::kMaxRowBlock;
  const size_t x_row_bytes = size_t(c.plan.d.h) * dtype_size(c.plan.logits_gemm);
  for (int64_t r0 = 0; r0 < rows; r0 += cpu::kMaxRowBlock) {
    Workspace piece_ws = c.ws;  // the piece's rows of x_block and RowInfo
    piece_ws.x_block = static_cast<char*>(c.ws.x_block) + size_t(r0) * x_row_bytes;
    piece_ws.rows = c.ws.rows + r0;
    const cpu::Context piece{c.p, piece_plan, piece_ws, c.class_sum, c.denom, c.stats, r0};
    const int64_t m = std::min(cpu::kMaxRowBlock, rows - r0);
    cpu::scores_and_states(piece, i0 + r0, m);
    cpu::merge_rows(piece, i0 + r0, m);
  }
}

// Vocab outer (cpu::Plan): per super-block, its rows' statistics (by the
// forward, or from the saved lse alone), then its gradients chunk by chunk.
void run_vocab_outer(const cpu::Context& c) {
  const Plan& plan = c.plan;
  for (int64_t i0 = 0; i0 < plan.d.n; i0 += plan.row_block) {
    const int64_t rows = std::min(plan.row_block, plan.d.n - i0);
    if (plan.stats_from_inputs)
      cpu::rows_from_inputs(c, i0, rows);
    else
      forward_pieces(c, i0, rows);
    Workspace block_ws = c.ws;  // Plan::grad_x_in_place: the rows' grad_x accumulates in grad_x
    if (plan.grad_x_in_place) block_ws.grad_x_block = static_cast<float*>(c.p.grad_x.data) + i0 * plan.d.h;
    const cpu::Context block{c.p, plan, block_ws, c.class_sum, c.denom, c.stats};
    for (int64_t t0 = 0; t0 < plan.tiles; t0 += plan.chunk_tiles)
      cpu::grad_vocab_chunk(block, i0, rows, t0, std::min(t0 + plan.chunk_tiles, plan.tiles));
    if (c.p.grad_x.present() && !plan.grad_x_in_place) cpu::store_grad_x(c, i0, rows);
  }
}

class CpuBackend final : public Backend {
 public:
  const char* name() const override { return "cpu"; }

  std::string describe() const override {
    const cpu::GemmEngine* f32 = cpu::default_gemm_engine(Dtype::f32);
    const cpu::GemmEngine* bf16 = cpu::default_gemm_engine(Dtype::bf16);
    return std::string("vocab-tiled GEMM + SIMD online softmax; isa ") +
           simd::best_kernels().isa + "; gemm f32: " + f32->describe() + "; gemm bf16: " +
           (bf16 ? bf16->describe() : std::string("none native, converted to f32"));
  }

  // An unknown GEMM engine name is an error (config_error), not a reason to
  // decline: declining would hand the problem to the reference silently.
  Support supports(const Problem& p, Pass, const RunConfig&) const override {
    const Tensor& first = p.logits.present() ? p.logits : p.x;
    if (first.device != Device::cpu)
      return Support::decline("the cpu backend reads host memory; the tensors are on a CUDA device");
    const Dtype storage = first.dtype;
    if (storage != Dtype::f32 && storage != Dtype::bf16 && storage != Dtype::f16)
      return Support::decline("the cpu backend stores x and W (or the logits) in f32, bf16 or f16; " +
                              std::string(p.logits.present() ? "logits" : "x") + " is " +
                              dtype_str(storage) + " (the reference backend takes f64)");
    for (auto [name, t] : {std::pair{"w", &p.w}, std::pair{"bias", &p.bias}}) {
      if (t->present() && t->dtype != storage)
        return Support::decline(std::string("the cpu backend needs x, w and bias in one storage dtype; x is ") +
                                dtype_str(storage) + ", " + name + " is " + dtype_str(t->dtype));
    }
    if (auto why = float32_options_problem(p.options, "cpu"); !why.empty())
      return Support::decline(why);
    return Support::accept();
  }

  std::string config_error(const Problem& p, Pass, const RunConfig& config) const override {
    if (auto e = cpu::check_tuning_env(); !e.empty()) return e;
    const cpu::GemmEngine* engine = nullptr;
    return cpu::pick_gemm(config, p.logits.present() ? p.logits.dtype : p.x.dtype, &engine);
  }

  size_t workspace_bytes(const Problem& p, Pass pass, const RunConfig& config) const override {
    return cpu::workspace_bytes(cpu::make_plan(p, pass, config), p);
  }

  std::string run(const Problem& p, Pass pass, const RunConfig& config, void* workspace,
                  RunStats* stats) const override {  // config_error() was "" (api.cpp)
    const Plan plan = cpu::make_plan(p, pass, config);
    const std::shared_ptr<void> engine_state = plan.gemm->hold_for_calls();
    const Workspace ws = cpu::carve_workspace(plan, p, workspace);
    const cpu::Context c = prepare(p, plan, ws, stats);
    if (plan.vocab_outer)
      run_vocab_outer(c);
    else
      run_rows_outer(c);
    finish(c);
    return "";
  }
};

}  // namespace

const Backend& cpu_backend() {
  static const CpuBackend backend;
  return backend;
}

}  // namespace flce
