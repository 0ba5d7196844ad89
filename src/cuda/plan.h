// src/cuda/plan.h: how the `cuda` backend cuts a problem into tiles, and
// the device workspace that follows from it (internal).
//
// Two levels of tiling, both over [rows x vocabulary]:
//   score tile      [tile_rows x tile_cols] f32: one GEMM writes the raw
//                   logits, one kernel reads them (64 MiB by default).
//   gradient block  [block_rows x block_cols] of G (dlogits) in the
//                   gradient GEMMs' dtype, assembled from score tiles, then
//                   fed to grad_x += G W_block and grad_W_block (+)= G^T X.
//                   Large, so both GEMMs have a long K (192 MiB, or up to
//                   480 MiB of workspace in all where a wider block stashes
//                   more: plan.cpp, widen_stashing_block).
// The pass over the vocabulary for lse (pass 1) keeps one TileState per
// (row, score tile) for state_rows rows at a time.
//
// Fused score GEMMs (sm90/score_gemms.h): on an H100 with bf16 or f16
// storage, the score tiles of both passes never exist: pass 1's kernel
// multiplies and folds the states, pass 2's multiplies and writes G.
//
// Stashed scores: pass 2 recomputes every score tile (a fourth GEMM), except
// in the first stash_cols classes, whose scores pass 1 keeps as the f16 bits
// of ref - s (ref = the row's max in that tile; per 256 classes when pass 1
// is fused) in memory that is free until pass 2 writes it: grad_W's own,
// and with stash_in_g the gradient block. Gradient block b's codes are its
// stashed classes for all N rows, row-major, 2 N block_cols bytes apart:
//   - stash_in_g: block 0's codes are the gradient block (where pass 2
//     decodes them in place), block b >= 1's start at byte
//     stash_base + 2 N block_cols (b - 1) of grad_W, stash_base being
//     block 0's grad_W rows (block_cols H |grad_W dtype|);
//   - otherwise block b's start at byte 2 N block_cols b of grad_W.
// Either way the grad_W rows of the blocks before b end at or before b's
// codes when H |dtype| <= 2 N, so pass 2 never overwrites codes it has yet
// to read. The last stashed block may be stashed in part (whole tiles).
// Only where G is rounded to bf16 anyway: the codes' error is the tolerance
// policy's u_q term, as for the cpu backend's packed scores.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "cuda/kernels.h"
#include "cuda/sm90/score_gemms.h"
#include "flce/flce.h"
#include "validate.h"

namespace flce::cuda {

struct Plan {
  Dims d;
  Pass pass = Pass::forward;
  Dtype storage = Dtype::f32;    // x, W and bias, or the logits
  Dtype grad_gemm = Dtype::f32;  // G, X and W in the gradient GEMMs
  Dtype round_to = Dtype::f32;   // G is rounded to this (grad_logits_dtype = storage)
  bool states_pass = false;      // pass 1 (lse, outputs, sbar) runs
  bool grads = false;            // pass 2 (dlogits and the gradients) runs
  int64_t tile_rows = 0, tile_cols = 0, tiles = 0;
  int64_t state_rows = 0;
  int64_t block_rows = 0, block_cols = 0;
  bool grad_x_in_place = false;  // grad_x is f32 with unit column stride
  bool grad_w_in_place = false;  // grad_w is f32 with unit column stride
  bool grad_w_direct = false;    // one row block: the GEMM writes grad_w as is
  bool fused = false;            // sm90 kernels multiply and fold the tiles not stashed
  int64_t stash_cols = 0;        // classes [0, stash_cols) are stashed (whole tiles, or V)
  bool stash_in_g = false;       // block 0's codes are in the gradient block
  int64_t stash_base = 0;        // byte of grad_W where the first codes there start
  int64_t stash_tiles = 0;       // the score tiles they span
  int64_t stash_ref_cols = 0;    // classes per ref (a tile's, or sm90::kStashRefCols when fused)
  int64_t stash_refs_per_tile = 0, stash_refs = 0;  // refs per (row, tile) and per row

  bool stashed(int64_t j0) const { return j0 < stash_cols; }
  // The stashed classes of the gradient block starting at class j0.
  int64_t stash_width(int64_t j0) const { return cuda::stash_width(stash_cols, block_cols, j0); }
};

// The device a plan is for: whether the fused sm90 kernels serve the
// problem (sm90::fused_declines) and the device's SMs, which weigh the
// gradient block's width (plan.cpp). make_plan asks the problem's device;
// tests pass one to plan for an H100 without a GPU.
struct PlanTarget {
  bool fused = false;
  int sms = sm90::kAssumedSms;
};

Plan make_plan(const Problem& p, Pass pass);
Plan make_plan(const Problem& p, Pass pass, const PlanTarget& target);

// The plan's environment overrides: FLCE_CUDA_STASH "0" (recompute every
// tile), "1" or unset (stash where it applies); FLCE_CUDA_TILE and
// FLCE_CUDA_BLOCK "RxC" or unset. "" or a message naming a malformed value.
std::string check_plan_env();

// Device scratch, carved from one allocation (null where not needed).
struct Workspace {
  Scalars* scalars = nullptr;
  RowInfo* rows = nullptr;        // [N]
  double* row_loss = nullptr;     // [N]
  float* class_w = nullptr;       // [V]
  float* bias = nullptr;          // [V]
  TileState* states = nullptr;    // [state_rows, tiles]
  float* scores = nullptr;        // [tile_rows, tile_cols]
  void* g = nullptr;              // [block_rows, block_cols] in grad_gemm
  float* grad_x_acc = nullptr;    // [N, H]
  float* grad_w_acc = nullptr;    // [block_cols, H]
  double* grad_b_acc = nullptr;   // [V]
  float* stash_refs = nullptr;    // [N, stash_tiles]: ref of each stashed (row, tile)
  void* x_grad = nullptr;         // [block_rows, H] X in grad_gemm, when it is not x's dtype
  void* w_grad = nullptr;         // [block_cols, H] W's block likewise (as [V, H])
};

size_t workspace_bytes(const Plan& plan, const Problem& p);
Workspace carve_workspace(const Plan& plan, const Problem& p, void* base);

// The codes of gradient block b (above): in the gradient block or grad_W.
uint16_t* stash_codes(const Plan& plan, const Problem& p, const Workspace& ws, int64_t b);

}  // namespace flce::cuda
