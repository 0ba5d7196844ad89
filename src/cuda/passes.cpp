#include "cuda/passes.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/gemm.h"
#include "cuda/sm90/score_gemms.h"

namespace flce::cuda {
namespace {

#define FLCE_TRY(expr)                    \
  do {                                    \
    if (auto e_ = (expr); !e_.empty()) return e_; \
  } while (0)

const char* at_elements(const void* base, int64_t offset, Dtype dtype) {
  return static_cast<const char*>(base) + offset * int64_t(dtype_size(dtype));
}

// The raw logits u of rows r0 .. r0+rows, classes j0 .. j0+cols, into the
// score tile: a GEMM X W^T, or the logits converted to f32.
std::string load_scores(const Context& c, int64_t r0, int64_t rows, int64_t j0, int64_t cols,
                        ScoreTile* tile) {
  const Plan& plan = c.plan;
  float* scores = c.ws.scores;
  *tile = ScoreTile{scores, cols, rows, cols, r0, j0, Stash{}};
  if (plan.d.logits_entry) {
    const DView dst{scores, int(Dtype::f32), cols, 1};
    convert(dview(c.p.logits), r0, j0, dst, 0, 0, rows, cols, c.stream);
    return last_launch_error("loading logits");
  }
  const Tensor& x = c.p.x;
  const Tensor& w = c.p.w;
  const bool vh = c.p.w_layout == WeightLayout::vh;
  Gemm g;  // U [rows, cols] = X [rows, H] W_t^T
  g.m = rows, g.n = cols, g.k = plan.d.h;
  g.a = at_elements(x.data, r0 * x.stride[0], x.dtype), g.lda = x.stride[0];
  g.b = at_elements(w.data, vh ? j0 * w.stride[0] : j0, w.dtype), g.ldb = w.stride[0];
  g.trans_b = vh;  // vh: W_t stored [cols, H]; hv: [H, cols]
  g.c = scores, g.ldc = cols;
  g.ab = plan.storage, g.c_dtype = Dtype::f32;
  return run_gemm(g, c.stream);
}

// The stash of the score tile at rows r0.., classes j0.. (plan.h): codes in
// the gradient block or grad_W, block by block, and one ref per (row,
// stashed tile).
Stash stash_at(const Context& c, int64_t r0, int64_t j0) {
  const Plan& plan = c.plan;
  const int64_t b = j0 / plan.block_cols, block_j0 = b * plan.block_cols;
  const int64_t width = plan.stash_width(block_j0);
  Stash st;
  st.codes = stash_codes(plan, c.p, c.ws, b) + r0 * width + (j0 - block_j0);
  st.codes_ld = width;
  st.refs = c.ws.stash_refs + r0 * plan.stash_refs +
            j0 / plan.tile_cols * plan.stash_refs_per_tile;
  st.refs_ld = plan.stash_refs;
  st.ref_cols = plan.stash_ref_cols;
  return st;
}

// Pass 1 for rows s0 .. s0+srows on the sm90 kernel: the stashed tiles
// (writing their codes), then the rest. The stashed tiles go in one launch
// per run of blocks whose codes are one array (plan.h): block 0 when it is
// in the gradient block, the whole blocks in grad_W, a block stashed in part.
std::string fused_states(const Context& c, int64_t s0, int64_t srows) {
  const Plan& plan = c.plan;
  const int64_t C = plan.block_cols, T = plan.tile_cols;
  for (int64_t b = 0; b * C < plan.stash_cols;) {
    int64_t end = b + 1;  // blocks [b, end) in this launch
    if (!(plan.stash_in_g && b == 0))
      while (end * C < plan.stash_cols && plan.stash_width(end * C) == plan.stash_width(b * C))
        ++end;
    sm90::StashOut stash;
    stash.codes = stash_codes(plan, c.p, c.ws, b);
    stash.refs = c.ws.stash_refs;
    stash.n = plan.d.n, stash.block_cols = C, stash.first_block = b, stash.end = plan.stash_cols;
    stash.refs_ld = plan.stash_refs, stash.refs_per_tile = plan.stash_refs_per_tile;
    const int64_t t0 = b * C / T, t1 = std::min(plan.stash_tiles, end * C / T);
    FLCE_TRY(sm90::gemm_states(c.args, c.p.x, c.p.w, s0, srows, t0, t1, T, plan.tiles, s0,
                               c.ws.states, stash, c.stream));
    b = end;
  }
  if (plan.stash_tiles < plan.tiles)
    FLCE_TRY(sm90::gemm_states(c.args, c.p.x, c.p.w, s0, srows, plan.stash_tiles, plan.tiles,
                               plan.tile_cols, plan.tiles, s0, c.ws.states, sm90::StashOut{},
                               c.stream));
  return "";
}

}  // namespace

std::string statistics_pass(const Context& c) {
  const Plan& plan = c.plan;
  const int64_t N = plan.d.n, V = plan.d.v;
  if (!plan.states_pass) {
    merge_rows(c.args, nullptr, 0, 0, N, false, c.stream);
    return last_launch_error("merge_rows");
  }
  for (int64_t s0 = 0; s0 < N; s0 += plan.state_rows) {
    const int64_t srows = std::min(plan.state_rows, N - s0);
    if (plan.fused) {
      FLCE_TRY(fused_states(c, s0, srows));
    } else {
      for (int64_t t = 0; t < plan.tiles; ++t) {  // W's tile stays in L2 across row tiles
        const int64_t j0 = t * plan.tile_cols, cols = std::min(plan.tile_cols, V - j0);
        for (int64_t r0 = s0; r0 < s0 + srows; r0 += plan.tile_rows) {
          ScoreTile tile;
          FLCE_TRY(load_scores(c, r0, std::min(plan.tile_rows, s0 + srows - r0), j0, cols, &tile));
          if (plan.stashed(j0)) tile.stash = stash_at(c, r0, j0);
          tile_states(c.args, tile, t, plan.tiles, s0, c.ws.states, c.stream);
          FLCE_TRY(last_launch_error("tile_states"));
        }
      }
    }
    merge_rows(c.args, c.ws.states, plan.tiles, s0, srows, true, c.stream);
    FLCE_TRY(last_launch_error("merge_rows"));
  }
  if (plan.pass != Pass::backward && c.p.options.reduction != Reduction::none) {
    reduce_loss(c.args, c.stream);
    FLCE_TRY(last_launch_error("reduce_loss"));
  }
  return "";
}

namespace {

// The logits entry: dlogits straight into grad_logits, tile by tile.
std::string logits_gradient_pass(const Context& c) {
  const Plan& plan = c.plan;
  const int64_t N = plan.d.n, V = plan.d.v;
  for (int64_t r0 = 0; r0 < N; r0 += plan.tile_rows) {
    for (int64_t j0 = 0; j0 < V; j0 += plan.tile_cols) {
      ScoreTile tile;
      FLCE_TRY(load_scores(c, r0, std::min(plan.tile_rows, N - r0), j0,
                           std::min(plan.tile_cols, V - j0), &tile));
      dlogits(c.args, tile, nullptr, Dtype::f32, 0, dview(c.p.grad_logits), plan.round_to,
              c.stream);
      FLCE_TRY(last_launch_error("dlogits"));
    }
  }
  return "";
}

// A matrix view of a workspace buffer.
DView buffer(void* data, Dtype dtype, int64_t ld) { return DView{data, int(dtype), ld, 1}; }

// X rows b0 .. b0+brows as the gradient GEMMs read them: x itself, or a copy
// in grad_gemm's dtype.
std::string x_for_grads(const Context& c, int64_t b0, int64_t brows, const void** x, int64_t* ld) {
  const Plan& plan = c.plan;
  const Tensor& xt = c.p.x;
  if (plan.grad_gemm == plan.storage) {
    *x = at_elements(xt.data, b0 * xt.stride[0], xt.dtype), *ld = xt.stride[0];
    return "";
  }
  const int64_t H = plan.d.h;
  convert(dview(xt), b0, 0, buffer(c.ws.x_grad, plan.grad_gemm, H), 0, 0, brows, H, c.stream);
  *x = c.ws.x_grad, *ld = H;
  return last_launch_error("converting x");
}

// W's rows j0 .. j0+cols (as [V, H]) likewise; *vocab_major says whether
// the result is stored [cols, H] (else [H, cols], W's hv layout in place).
std::string w_for_grads(const Context& c, int64_t j0, int64_t cols, const void** w, int64_t* ld,
                        bool* vocab_major) {
  const Plan& plan = c.plan;
  const Tensor& wt = c.p.w;
  const bool vh = c.p.w_layout == WeightLayout::vh;
  if (plan.grad_gemm == plan.storage) {
    *w = at_elements(wt.data, vh ? j0 * wt.stride[0] : j0, wt.dtype), *ld = wt.stride[0];
    *vocab_major = vh;
    return "";
  }
  const int64_t H = plan.d.h;
  const DView dst = buffer(c.ws.w_grad, plan.grad_gemm, H);
  DView src = dview(wt);
  if (!vh) std::swap(src.s0, src.s1);  // read W^T: [V, H] whatever the layout
  convert(src, j0, 0, dst, 0, 0, cols, H, c.stream);
  *w = c.ws.w_grad, *ld = H, *vocab_major = true;
  return last_launch_error("converting w");
}

// grad_x rows b0.. (+)= G [brows, cols] W_block [cols, H].
std::string grad_x_gemm(const Context& c, int64_t b0, int64_t brows, int64_t j0, int64_t cols) {
  const Plan& plan = c.plan;
  const int64_t H = plan.d.h;
  Gemm g;
  g.m = brows, g.n = H, g.k = cols;
  g.a = c.ws.g, g.lda = plan.block_cols;
  bool vocab_major = true;
  FLCE_TRY(w_for_grads(c, j0, cols, &g.b, &g.ldb, &vocab_major));
  g.trans_b = !vocab_major;
  if (plan.grad_x_in_place) {
    g.c = const_cast<char*>(at_elements(c.p.grad_x.data, b0 * c.p.grad_x.stride[0], Dtype::f32));
    g.ldc = c.p.grad_x.stride[0];
  } else {
    g.c = c.ws.grad_x_acc + b0 * H, g.ldc = H;
  }
  g.ab = plan.grad_gemm, g.c_dtype = Dtype::f32;
  g.beta = j0 == 0 ? 0.0f : 1.0f;
  return run_gemm(g, c.stream);
}

// grad_W rows j0 .. j0+cols (+)= G^T [cols, brows] X [brows, H], into
// grad_w itself (f32 in place, or the only row block) or the f32 block
// accumulator.
std::string grad_w_gemm(const Context& c, int64_t b0, int64_t brows, int64_t j0, int64_t cols) {
  const Plan& plan = c.plan;
  const Tensor& gw = c.p.grad_w;
  const int64_t H = plan.d.h;
  const bool vh = c.p.w_layout == WeightLayout::vh;
  const void* x = nullptr;
  int64_t ldx = 0;
  FLCE_TRY(x_for_grads(c, b0, brows, &x, &ldx));
  Gemm g;
  g.ab = plan.grad_gemm;
  g.beta = b0 == 0 ? 0.0f : 1.0f;
  const bool into_output = plan.grad_w_in_place || plan.grad_w_direct;
  if (into_output && !vh) {  // grad_W^T [H, cols] (+)= X^T [H, brows] G [brows, cols]
    g.m = H, g.n = cols, g.k = brows;
    g.a = x, g.lda = ldx, g.trans_a = true;
    g.b = c.ws.g, g.ldb = plan.block_cols;
    g.c = const_cast<char*>(at_elements(gw.data, j0, gw.dtype)), g.ldc = gw.stride[0];
    g.c_dtype = gw.dtype;
    return run_gemm(g, c.stream);
  }
  g.m = cols, g.n = H, g.k = brows;
  g.a = c.ws.g, g.lda = plan.block_cols, g.trans_a = true;
  g.b = x, g.ldb = ldx;
  if (into_output) {
    g.c = const_cast<char*>(at_elements(gw.data, j0 * gw.stride[0], gw.dtype));
    g.ldc = gw.stride[0], g.c_dtype = gw.dtype;
  } else {
    g.c = c.ws.grad_w_acc, g.ldc = H, g.c_dtype = Dtype::f32;
  }
  return run_gemm(g, c.stream);
}

// A stashed block's codes can be decoded as one [brows x cols] tile: they
// are one row-major array (plan.h), and so are each row's refs when every
// tile holds whole ref groups; decode_stashed_row takes 8 classes under one
// ref. One launch a block instead of one a tile: 5 instead of 60 at the
// Llama-3 head, where each tile's launch moved only 34 MB; the decode went
// from 0.97 to 0.73 ms a step there (H100, torch.profiler, two rounds),
// about 2.7 TB/s.
bool stash_decodes_by_block(const Plan& plan) {
  return plan.tile_cols % plan.stash_ref_cols == 0 && plan.stash_ref_cols % 8 == 0;
}

// G into the gradient block (whose column 0 is class block_j0) for rows
// b0 .. b0+brows, classes j0 .. j1, tile by tile: decoded where stashed,
// else from a score tile.
std::string gradient_tiles(const Context& c, int64_t b0, int64_t brows, int64_t block_j0,
                           int64_t j0, int64_t j1) {
  const Plan& plan = c.plan;
  const size_t g_size = dtype_size(plan.grad_gemm);
  for (int64_t tj = j0; tj < j1; tj += plan.tile_cols) {
    const int64_t tcols = std::min(plan.tile_cols, j1 - tj);
    for (int64_t r0 = b0; r0 < b0 + brows; r0 += plan.tile_rows) {
      const int64_t trows = std::min(plan.tile_rows, b0 + brows - r0);
      ScoreTile tile;
      if (plan.stashed(tj))  // pass 1 kept the scores: no GEMM
        tile = ScoreTile{nullptr, 0, trows, tcols, r0, tj, stash_at(c, r0, tj)};
      else
        FLCE_TRY(load_scores(c, r0, trows, tj, tcols, &tile));
      char* g = static_cast<char*>(c.ws.g) +
                ((r0 - b0) * plan.block_cols + (tj - block_j0)) * int64_t(g_size);
      dlogits(c.args, tile, g, plan.grad_gemm, plan.block_cols, DView{}, plan.round_to, c.stream);
      FLCE_TRY(last_launch_error("dlogits"));
    }
  }
  return "";
}

// G for rows b0 .. b0+brows, classes j0 .. j0+cols, into the gradient
// block: the stashed classes (decoded; in place where the codes are the
// gradient block), in one launch where the block's tiles hold whole ref
// groups, then the rest, by the fused kernel's one launch or tile by tile.
std::string gradient_block(const Context& c, int64_t b0, int64_t brows, int64_t j0, int64_t cols) {
  const Plan& plan = c.plan;
  const size_t g_size = dtype_size(plan.grad_gemm);
  const int64_t stashed = plan.stash_width(j0);
  if (stashed > 0 && stash_decodes_by_block(plan)) {
    const ScoreTile tile{nullptr, 0, brows, stashed, b0, j0, stash_at(c, b0, j0)};
    dlogits(c.args, tile, c.ws.g, plan.grad_gemm, plan.block_cols, DView{}, plan.round_to,
            c.stream);
    FLCE_TRY(last_launch_error("dlogits"));
  } else if (stashed > 0) {
    FLCE_TRY(gradient_tiles(c, b0, brows, j0, j0, j0 + stashed));
  }
  if (stashed < cols && plan.fused) {  // one kernel, no score tiles
    void* g = static_cast<char*>(c.ws.g) + stashed * int64_t(g_size);
    FLCE_TRY(sm90::gemm_dlogits(c.args, c.p.x, c.p.w, b0, brows, j0 + stashed, cols - stashed, g,
                                plan.grad_gemm, plan.block_cols, plan.round_to, c.stream));
  } else if (stashed < cols) {
    FLCE_TRY(gradient_tiles(c, b0, brows, j0, j0 + stashed, j0 + cols));
  }
  if (c.ws.grad_b_acc) {
    column_sums(c.ws.g, plan.grad_gemm, plan.block_cols, brows, cols, c.ws.grad_b_acc + j0,
                c.stream);
    FLCE_TRY(last_launch_error("column_sums"));
  }
  return "";
}

}  // namespace

std::string gradient_pass(const Context& c) {
  const Plan& plan = c.plan;
  if (plan.d.logits_entry) return logits_gradient_pass(c);
  const Problem& p = c.p;
  const int64_t N = plan.d.n, V = plan.d.v, H = plan.d.h;
  const bool vh = p.w_layout == WeightLayout::vh;
  if (c.ws.grad_b_acc) {
    const cudaError_t e = cudaMemsetAsync(c.ws.grad_b_acc, 0, size_t(V) * 8, c.stream);
    if (e != cudaSuccess)
      return std::string("zeroing grad_bias's accumulator: ") + cudaGetErrorString(e);
  }
  for (int64_t j0 = 0; j0 < V; j0 += plan.block_cols) {  // vocabulary blocks, in order
    const int64_t cols = std::min(plan.block_cols, V - j0);
    for (int64_t b0 = 0; b0 < N; b0 += plan.block_rows) {  // row blocks, in order
      const int64_t brows = std::min(plan.block_rows, N - b0);
      FLCE_TRY(gradient_block(c, b0, brows, j0, cols));
      if (p.grad_x.present()) FLCE_TRY(grad_x_gemm(c, b0, brows, j0, cols));
      if (p.grad_w.present()) FLCE_TRY(grad_w_gemm(c, b0, brows, j0, cols));
    }
    if (c.ws.grad_w_acc) {  // the block's rows of grad_W, in its dtype and layout
      DView dst = dview(p.grad_w);
      if (!vh) std::swap(dst.s0, dst.s1);
      convert(buffer(c.ws.grad_w_acc, Dtype::f32, H), 0, 0, dst, j0, 0, cols, H, c.stream);
      FLCE_TRY(last_launch_error("storing grad_w"));
    }
  }
  if (c.ws.grad_x_acc) {
    convert(buffer(c.ws.grad_x_acc, Dtype::f32, H), 0, 0, dview(p.grad_x), 0, 0, N, H, c.stream);
    FLCE_TRY(last_launch_error("storing grad_x"));
  }
  if (c.ws.grad_b_acc) {
    store_f64_vector(c.ws.grad_b_acc, V, dview(p.grad_bias), c.stream);
    FLCE_TRY(last_launch_error("storing grad_bias"));
  }
  return "";
}

}  // namespace flce::cuda
