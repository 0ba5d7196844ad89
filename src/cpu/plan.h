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
constexpr int64_t kScoreBudgetBytes = int64_t(32) << 20;
constexpr int64_t kMaxRowBlock = 256;
constexpr int64_t kVocabTile = 512;    // columns per tile: a GEMM's n, a kernel call's length
constexpr int64_t kHiddenChunk = 256;  // columns of grad_x per task
constexpr int64_t kGradXRows = 16;     // fewest rows of grad_x per task
constexpr int64_t kGradXTasks = 16;    // grad_x tasks to aim for per row block

struct Plan {
  Dims d;
  Pass pass;
  int64_t row_block = 0;  // R: rows per block
  int64_t tiles = 0;      // ceil(V / kVocabTile)
  int64_t h_chunks = 0;   // ceil(H / kHiddenChunk)
  int threads = 1;
  Dtype storage = Dtype::f32;      // dtype of x, W (or logits)
  Dtype logits_gemm = Dtype::f32;  // f32 or bf16: X and W in U = X W^T
  Dtype grad_gemm = Dtype::f32;    // f32 or bf16: G, X and W in the gradient GEMMs
  bool round_grad_logits = false;  // grad_logits_dtype = storage with a non-f32 storage
  bool grad_w_in_place = false;    // grad_w is f32 with unit inner stride
  const GemmEngine* gemm = nullptr;
  const simd::KernelSet* kernels = nullptr;
};

// The plan for a problem already validated and accepted.
Plan make_plan(const Problem& p, Pass pass, const RunConfig& config);

// The GEMM engine to use: config.gemm if named, else the default for the
// storage dtype. Returns "" or an error naming the engine.
std::string pick_gemm(const RunConfig& config, Dtype storage, const GemmEngine** engine);

// Per-row scalars of the current row block (README, Semantics).
struct RowInfo {
  double lse = 0, sbar = 0;  // sbar = sum_j p_ij s_ij
  double s_y = 0;            // the label's score (0 if ignored)
  double g_loss = 0;         // d objective / d loss_i times t_i (0 if ignored)
  double g_lse = 0, g_ent = 0;
  int64_t y = 0;
  bool ignored = false;
};

// Scratch carved from one workspace, each piece 64-byte aligned.
struct Workspace {
  float* scores = nullptr;            // [R, V]: s, then G in place
  uint16_t* g_bf16 = nullptr;         // [R, V]: G in bf16 for bf16 gradient GEMMs
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
};

size_t workspace_bytes(const Plan& plan, const Problem& p);
Workspace carve_workspace(const Plan& plan, const Problem& p, void* base);

}  // namespace flce::cpu
