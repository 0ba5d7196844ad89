// How the cpu backend cuts a problem: tile sizes, GEMM operand dtypes and
// the workspace layout. The tile grid depends on the problem only, never on
// the thread count, so every result bit is the same for any thread count.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "cpu/gemm/gemm.h"
#include "flce/flce.h"
#include "simd/kernels.h"
#include "validate.h"

namespace flce::cpu {

// The scores of one row block across the whole vocabulary stay in memory, so
// a training step needs one logits GEMM per tile; this budget bounds them.
// The row block R is also the K of the grad_W GEMMs, whose f32 output tile
// is read and written once per row block: small R makes them memory-bound
// (S2, V = 128256: 2.4x three GEMMs at R = 32, 1.35x at R = 160). 48 MiB
// keeps the whole workspace under 64 MiB. FLCE_CPU_SCORE_MIB overrides it,
// for tuning (bench/tune_row_block.sh).
constexpr int64_t kScoreBudgetBytes = int64_t(48) << 20;
constexpr int64_t kMaxRowBlock = 256;
constexpr int64_t kVocabTile = 512;    // columns per tile: a GEMM's n, a kernel call's length
// grad_x = G W splits into kGradXTasks pieces of [R, H]: hidden chunks of at
// least kMinHiddenChunk columns, then row groups. Each task streams the whole
// of its rows' G (K = V), so fewer, wider tasks move less memory: on 2 cores
// 4 tasks took 0.67 s -> 0.52 s of grad_x at S1 bf16 (16 tasks before), and
// 2.3 -> 1.9 s at S2. More cores would want more tasks; not tuned there.
constexpr int64_t kGradXTasks = 4;
constexpr int64_t kMinHiddenChunk = 64;

struct Plan {
  Dims d;
  Pass pass;
  int64_t row_block = 0;  // R: rows per block
  // A forward pass folds each tile as soon as its GEMM is done, so its
  // scores are one [R, kVocabTile] tile per thread, not an [R, V] block, and
  // R is kMaxRowBlock whatever V or N (each W tile then serves more rows:
  // S2 bf16 forward 2.0 s -> 1.5 s). Every logits GEMM then has R rows, a
  // short block padded with zero rows, because the GEMM engines round a
  // row differently by the call's row count (oneDNN's one-row calls): so a
  // row's forward outputs do not depend on the rows around it (flce eval's
  // blocks give flce run's bits).
  bool tile_scores = false;
  int64_t tiles = 0;      // ceil(V / kVocabTile)
  int64_t h_chunk = 0;    // grad_x task width (columns of H)
  int64_t h_chunks = 0;   // ceil(H / h_chunk)
  int64_t row_groups = 0; // grad_x tasks per hidden chunk
  int threads = 1;
  Dtype storage = Dtype::f32;      // dtype of x, W (or logits)
  Dtype logits_gemm = Dtype::f32;  // f32 or bf16: X and W in U = X W^T
  Dtype grad_gemm = Dtype::f32;    // f32 or bf16: G, X and W in the gradient GEMMs
  bool round_grad_logits = false;  // grad_logits_dtype = storage with a non-f32 storage
  bool grad_w_in_place = false;    // grad_w is f32 with unit inner stride
  // Gradient filtering (README): on for the head entry's gradient passes
  // when filter_eps > 0, except with a softcap and label smoothing together
  // (there the smoothing's uniform term of G is not rank one, see below).
  bool filter = false;
  double filter_eps = 0;
  // With label smoothing the filter applies to G' = G - u c^T, where
  // u_i = -a g_i e / V is the smoothing's uniform term; u c^T is added back
  // exactly as rank-one updates of grad_x, grad_W and grad_bias.
  bool filter_uniform = false;
  const GemmEngine* gemm = nullptr;
  const simd::KernelSet* kernels = nullptr;
};

// "" or an error naming a malformed FLCE_CPU_SCORE_MIB.
std::string check_tuning_env();

// The plan for a problem already validated and accepted.
Plan make_plan(const Problem& p, Pass pass, const RunConfig& config);

// The GEMM engine to use: config.gemm if named, else the default for the
// storage dtype. Returns "" or an error naming the engine.
std::string pick_gemm(const RunConfig& config, Dtype storage, const GemmEngine** engine);

// Per-row scalars of the current row block (README, Semantics).
struct RowInfo {
  double lse = 0, sbar = 0;  // sbar = sum_j p_ij s_ij
  double s_y = 0;            // the label's score (0 if ignored)
  double filter_tau = 0;     // gradient filter: |G'_ij| <= filter_tau may be left out
  double uniform = 0;        // u_i, the smoothing's uniform term, when filter_uniform
  double g_loss = 0;         // d objective / d loss_i times t_i (0 if ignored)
  double g_lse = 0, g_ent = 0;
  double coef_p = 0, coef_c = 0;  // G's coefficients of p_ij and c_j (simd::DlogitsParams)
  int64_t y = 0;
  bool ignored = false;
};

// Scratch carved from one workspace, each piece 64-byte aligned.
struct Workspace {
  // [R, V]: s, then G in place. For bf16 gradient GEMMs each tile's G is
  // then converted in place to bf16, at the start of its own f32 span: as a
  // bf16 matrix, columns j0 .. j0+n of tile t sit at 2 j0 .. 2 j0+n of rows
  // 2V apart (g_bf16_tile()). Once every tile's grad_W GEMM has read it,
  // each row's tiles move left to lie contiguous, columns 0 .. V at 0 .. V
  // (g_bf16_rows()), so that grad_x takes one GEMM over many tiles.
  // With Plan::tile_scores: [threads, R, kVocabTile], one tile per thread.
  float* scores = nullptr;
  float* label_score = nullptr;       // [R]: s_{i y_i}, with Plan::tile_scores
  void* x_block = nullptr;            // [R, H] in logits_gemm dtype
  void* x_block_grad = nullptr;       // [R, H] in grad_gemm dtype, when it differs
  void* w_scratch = nullptr;          // [threads, T, H] converted W pieces
  float* grad_x_block = nullptr;      // [R, H]
  simd::SoftmaxState* states = nullptr;  // [R, tiles]
  RowInfo* rows = nullptr;            // [R]
  double* row_loss = nullptr;         // [N]
  float* grad_w_acc = nullptr;        // [V, H] when grad_w is not accumulated in place
  double* grad_b_acc = nullptr;       // [V]
  float* class_w = nullptr;           // [V] (null: all ones)
  float* bias = nullptr;              // [V] (null: no bias)
  uint8_t* kept = nullptr;            // [tiles]: the gradient filter's verdict for this row block
  uint8_t* w_written = nullptr;       // [tiles]: grad_W rows of the tile written yet (then +=)
  double* uniform_w = nullptr;        // [H]: sum_j c_j W_j, when filter_uniform and grad_x
  double* uniform_x = nullptr;        // [H + 1]: sum_i u_i x_i, then sum_i u_i
};

// Tile t's bf16 G (see Workspace::scores) for rows from r0: row stride 2V.
inline const uint16_t* g_bf16_tile(const Workspace& ws, const Plan& plan, int64_t r0, int64_t j0) {
  return reinterpret_cast<const uint16_t*>(ws.scores + r0 * plan.d.v) + 2 * j0;
}

// Compacted bf16 G (see Workspace::scores) from row r0 and column j0: row
// stride 2V.
inline const uint16_t* g_bf16_rows(const Workspace& ws, const Plan& plan, int64_t r0, int64_t j0) {
  return reinterpret_cast<const uint16_t*>(ws.scores + r0 * plan.d.v) + j0;
}

size_t workspace_bytes(const Plan& plan, const Problem& p);
Workspace carve_workspace(const Plan& plan, const Problem& p, void* base);

}  // namespace flce::cpu
