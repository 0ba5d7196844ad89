// src/cuda/sm90/score_gemms.h: the score GEMMs of passes 1 and 2 fused with
// what reads their scores, on Hopper (sm_90a; internal).
//
// One kernel (gemm_states) computes the raw logits u = x . W_j of a [128 x 256
// class] block on the tensor cores (TMA loads, wgmma) and folds them
// into the rows' softmax states while they are still in registers: the
// score tile never goes to memory. Each block of 128 rows walks one score
// tile's classes (plan.tile_cols) 256 at a time and writes one TileState
// per (row, tile), the same states tile_states writes, so merge_rows and
// everything after it are unchanged. It also writes RowInfo::s_y. Pass 2's
// kernel (gemm_dlogits) runs the same loop and writes G straight into the
// gradient block in the gradient GEMMs' dtype.
//
// The kernels are compiled for sm_90a only; elsewhere fused_declines says
// why they are not used and the backend keeps its cuBLAS GEMMs + tile_states
// and dlogits.
#pragma once

#include <cstdint>
#include <string>

#include "cuda/kernels.h"
#include "flce/flce.h"

namespace flce::cuda::sm90 {

// "" when the fused kernels can serve `p` on its device, else why not: not
// an sm_90 GPU, f32 storage (the kernel multiplies bf16 or f16),
// the logits entry, W stored [H, V], rows not contiguous or not 16-byte
// aligned, or FLCE_CUDA_FUSED=0 (the cuBLAS path, for comparisons).
std::string fused_declines(const Problem& p);

// "" or a message naming a malformed FLCE_CUDA_FUSED.
std::string check_fused_env();

// Classes per stash ref in gemm_states' codes (one per 256-class subtile).
constexpr int64_t kStashRefCols = 256;

// A kernel block's rows, and the classes of a gemm_dlogits block: a launch
// over rows x cols runs ceil(rows / 128) ceil(cols / 2048) blocks, one per
// SM at a time (plan.cpp weighs a gradient block's width by them).
constexpr int64_t kKernelRows = 128;
constexpr int64_t kDlogitsChunk = 2048;

// The SMs of the device `p.x` is on (kAssumedSms, an H100's, where it
// cannot be asked; plan.h's PlanTarget assumes the same).
constexpr int kAssumedSms = 132;
int sm_count(const Problem& p);

// Where gemm_states stashes the tiles' scores (plan.h; codes null: it does
// not): the codes of class block b >= first_block (its classes below end,
// at most block_cols, for all n rows, row-major) from
// codes + (b - first_block) n block_cols; the ref of row i and class j of
// tile t at refs[i * refs_ld + t * refs_per_tile + (j - t tile_cols) / 256].
// Only for bf16 storage (the stash needs G rounded to bf16).
struct StashOut {
  uint16_t* codes = nullptr;
  float* refs = nullptr;
  int64_t n = 0, block_cols = 0, first_block = 0, end = 0, refs_ld = 0, refs_per_tile = 0;
};

// states[(i - state_r0) * tiles + t] for rows i in [r0, r0 + rows) and score
// tiles t in [t0, t1) of tile_cols classes each, RowInfo::s_y of those rows
// whose label falls in those tiles, and their stash when stash.codes is set.
std::string gemm_states(const LossArgs& args, const Tensor& x, const Tensor& w, int64_t r0,
                        int64_t rows, int64_t t0, int64_t t1, int64_t tile_cols, int64_t tiles,
                        int64_t state_r0, TileState* states, const StashOut& stash,
                        cudaStream_t stream);

// G = d objective / d u (pass 2, from the rows' RowInfo) for rows
// [r0, r0 + rows) and classes [j0, j0 + cols), at g[(i - r0) * g_ld + j - j0]
// as g_dtype, rounded to round_to first (kernels.h, dlogits).
std::string gemm_dlogits(const LossArgs& args, const Tensor& x, const Tensor& w, int64_t r0,
                         int64_t rows, int64_t j0, int64_t cols, void* g, Dtype g_dtype,
                         int64_t g_ld, Dtype round_to, cudaStream_t stream);

// c[i, j] = x_i . W_j in f32 for i < x's rows, j < W's rows (c row-major with
// leading dimension ldc): the same tensor-core loop with a plain store, so
// tests can check the loop on its own against cuBLAS.
std::string gemm_f32(const Tensor& x, const Tensor& w, float* c, int64_t ldc, cudaStream_t stream);

}  // namespace flce::cuda::sm90
