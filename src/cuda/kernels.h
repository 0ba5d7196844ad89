// src/cuda/kernels.h: the CUDA kernels of the `cuda` backend and the plain
// structs they share with the host code (internal).
//
// The backend computes raw logits u = x . W_j for a [rows x vocab tile]
// score tile with a cuBLAS GEMM, then runs these kernels over the tile:
//   tile_states    one softmax state per (row, tile), as simd/kernels.h
//   merge_rows     the states of a row (a warp each, fixed order) -> lse, outputs, RowInfo
//   dlogits        G = d objective / d u from u and the row's RowInfo
// plus the small ones around them (prepare, reduce_loss, column_sums and
// dtype conversions). The README's "Semantics" defines every quantity; the
// formulas are the cpu backend's (src/cpu/steps.cpp), in the same order,
// except that merge_rows adds a row's tiles in a fixed tree over 32 lanes.
//
// Determinism: every output element has one owner thread and every sum runs
// in a fixed order (a fixed-shape tree inside a block, tiles and row blocks
// in sequence); no floating-point atomics anywhere.
#pragma once

#include <cstdint>
#include <string>

#include "common/host_device.h"
#include "cuda/softcap_small.h"
#include "flce/flce.h"

typedef struct CUstream_st* cudaStream_t;

namespace flce::cuda {

// A tensor view for the kernels: flce::Tensor without shapes (the kernels
// get their extents from the problem). A 0-D tensor has s0 = 0.
struct DView {
  void* data = nullptr;
  int dtype = 0;  // flce::Dtype as int
  int64_t s0 = 0, s1 = 0;
  FLCE_HOST_DEVICE bool present() const { return data != nullptr; }
};
DView dview(const Tensor& t);

// One row's softmax statistics over one vocabulary tile; sums are relative
// to shift(max) (max if finite, else 0), as simd::SoftmaxState.
struct TileState {
  float max, sum_exp, sum_exp_d, sum_cs;  // sum_exp_d: sum e^(s - shift) (s - shift)
  int64_t argmax;     // lowest index of the max; -1 if none
  int64_t first_nan;  // lowest index of a NaN score; -1 if none
};

// What the dlogits kernel needs of a row (README, backward):
//   d_j = coef_p p_j + coef_c c_j - coef_h p_j ((s_j - shift) - sbar_d), plus
//   the label term -label_coef at j = y; g_j = a (1 - (s_j/k)^2) d_j. coef_p and
//   coef_h hold the factor p_scale too (row_terms.h, lse_parts): the
//   kernels form p_j as e^(s_j - lse32), lse32 the float32 of lse.
struct RowInfo {
  double lse, s_y;
  double shift, sbar_d;  // the row's max (where finite), sum_j p_j (s_j - shift)
  double coef_p, coef_c, coef_h, label_coef;
  int64_t y;  // label, or -1 when ignored
};

// Problem-wide scalars computed on the device; the bad_* fields are the
// lowest offending index or INT64_MAX (validation of device-resident data).
struct Scalars {
  double class_sum;  // C = sum_j c_j
  double denom;      // D = sum over non-ignored rows of t_i c_{y_i}
  int64_t bad_label, bad_token_weight, bad_class_weight;
};

// Everything the kernels read of the problem, by value.
struct LossArgs {
  int64_t n = 0, v = 0;
  double a = 1, k = 0, e = 0, l = 0;  // logit scale, softcap, smoothing, z-loss
  float a_f32 = 1, k_f32 = 0;  // a and k for the tile kernels
  SoftcapPoly softcap;         // 1/k, k log2(e) (0 when k = 0), the fused epilogues' polynomials
  int64_t ignore_index = -100;
  int reduction = 0;  // flce::Reduction
  bool backward = false;  // the lse is an input (Pass::backward)
  bool need_sbar = false;  // sum_j p_j s_j is used (entropy output or grad_entropy)
  DView labels, token_weights, class_weights, bias;
  DView grad_loss, grad_lse, grad_entropy, lse_in;
  DView loss, lse, logprob, argmax, entropy, zloss;  // forward outputs
  const float* class_w = nullptr;  // f32 copies [V], null when absent
  const float* bias_f32 = nullptr;
  Scalars* scalars = nullptr;  // device
  RowInfo* rows = nullptr;     // [N]
  double* row_loss = nullptr;  // [N]
};

// Where a stashed tile's scores live (plan.h): the f16 bits of ref - s at
// codes[r * codes_ld + c], with the ref of row r and tile column c at
// refs[r * refs_ld + c / ref_cols] (one ref per tile from tile_states,
// ref_cols >= the tile's width; one per 256 classes from the fused kernel).
struct Stash {
  uint16_t* codes = nullptr;
  float* refs = nullptr;
  int64_t codes_ld = 0, refs_ld = 0, ref_cols = 0;
  FLCE_HOST_DEVICE bool present() const { return codes != nullptr; }
};

// How many classes of the gradient block starting at class j0 are stashed,
// where classes [0, stash_cols) are, in blocks of block_cols (plan.h): the
// width of that block's codes, row-major for all rows. The plan asks it on
// the host (Plan::stash_width), the fused kernel on the device.
FLCE_HOST_DEVICE inline int64_t stash_width(int64_t stash_cols, int64_t block_cols, int64_t j0) {
  const int64_t w = stash_cols - j0;
  return w < 0 ? 0 : w < block_cols ? w : block_cols;
}

// A [rows x cols] tile of scores whose row 0 is problem row r0 and column 0
// is class j0: raw logits u in f32 with leading dimension ld, or (u null,
// pass 2 of a stashed tile) the stash's codes. tile_states also writes the
// stash when it is present.
struct ScoreTile {
  float* u;
  int64_t ld, rows, cols, r0, j0;
  Stash stash;
};

// class_w/bias f32 copies, C, D and the checks of labels and weights.
// The copies hold padded_classes(V) floats, zero past V: the fused kernels
// read them for all 256 classes of a subtile that starts below V (at any
// class, with FLCE_CUDA_TILE's narrow tiles), so up to V + 254 (a bias read
// there from other memory changed a softcap's vote, so bits).
void prepare(const LossArgs& args, float* class_w, float* bias, cudaStream_t stream);
inline int64_t padded_classes(int64_t v) { return v + 255; }

// states[r * tiles + t] for the tile's rows (r relative to state_r0); with
// tile.stash, also each row's ref (its max in the tile, or 0 if that is not
// finite) and codes f16(ref - s) as stash_code does (softmax_state.cuh).
void tile_states(const LossArgs& args, const ScoreTile& tile, int64_t t, int64_t tiles,
                 int64_t state_r0, TileState* states, cudaStream_t stream);

// Rows r0 .. r0+rows: forward outputs, row_loss and RowInfo.
void merge_rows(const LossArgs& args, const TileState* states, int64_t tiles, int64_t r0,
                int64_t rows, bool have_states, cudaStream_t stream);

// The reduced loss (0-D output) from row_loss and D.
void reduce_loss(const LossArgs& args, cudaStream_t stream);

// G over the tile (from u, or from the stash: s = ref - f32(code)), written
// as `g_dtype` (f32, bf16 or f16) at g (leading
// dimension g_ld), and into grad_logits (a [N, V] view) when present. g may
// be the tile's own storage (f32, in place). When round_to is not f32, G is
// rounded to that dtype first (grad_logits_dtype = storage).
void dlogits(const LossArgs& args, const ScoreTile& tile, void* g, Dtype g_dtype, int64_t g_ld,
             DView grad_logits, Dtype round_to, cudaStream_t stream);

// acc[j] += sum over r of G[r, j] (rows in order), j < cols.
void column_sums(const void* g, Dtype g_dtype, int64_t g_ld, int64_t rows, int64_t cols,
                 double* acc, cudaStream_t stream);

// dst(dr0 + r, dc0 + c) = src(sr0 + r, sc0 + c) for a [rows x cols] region,
// rounded to dst's dtype (a 1-D view is a row: s0 = 0, s1 = its stride).
void convert(DView src, int64_t sr0, int64_t sc0, DView dst, int64_t dr0, int64_t dc0,
             int64_t rows, int64_t cols, cudaStream_t stream);

// dst(j) = src[j] for a vector view, rounded to its dtype.
void store_f64_vector(const double* src, int64_t n, DView dst, cudaStream_t stream);

// The last launch's error as a message, or "".
std::string last_launch_error(const char* what);

}  // namespace flce::cuda
