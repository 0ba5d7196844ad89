// src/cuda/softmax_state.cuh: the per-row softmax state that the `cuda`
// backend's score kernels fold, and the score formula they share
// (kernels.cu's tile_states, sm90/gemm_states.cu's fused epilogue). Device
// code only (internal).
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/kernels.h"

namespace flce::cuda {

constexpr float kInf = INFINITY;

// ---- the semantics shared by the kernels ------------------------------------

inline __device__ float shift_of(float m) { return isfinite(m) ? m : 0.0f; }

inline __device__ int64_t min_index(int64_t a, int64_t b) {
  if (a < 0) return b;
  if (b < 0) return a;
  return a < b ? a : b;
}

// The label's column inside a tile of `cols` starting at class j0, or -1.
inline __device__ int label_column(int64_t y, int64_t j0, int cols) {
  return y >= j0 && y < j0 + cols ? int(y - j0) : -1;
}

// What the per-element hot loops read, in f32 and relative to the tile's
// first column: no double arithmetic or 64-bit indexing per element.
struct TileParams {
  float a, k, inv_k;      // logit scale, softcap, 1 / softcap
  const float* bias;      // at the tile's column 0, or null
  const float* class_w;   // likewise

  __device__ TileParams(const LossArgs& g, int64_t j0)
      : a(g.a_f32), k(g.k_f32), inv_k(g.inv_k_f32),
        bias(g.bias_f32 ? g.bias_f32 + j0 : nullptr),
        class_w(g.class_w ? g.class_w + j0 : nullptr) {}

  // s = k tanh(a (u + b) / k) when k > 0, else a (u + b).
  __device__ float score(float u, int c) const {
    const float z = a * (bias ? u + bias[c] : u);
    return k > 0 ? k * tanhf(z * inv_k) : z;
  }
  __device__ float class_weight(int c) const { return class_w ? class_w[c] : 1.0f; }
  // ds/dz = 1 - (s/k)^2 when k > 0.
  __device__ float dsdz(float s) const { return k > 0 ? 1 - (s * inv_k) * (s * inv_k) : 1.0f; }
};

// A thread's (or a subtree's) running state, as TileState.
struct State {
  float max = -kInf, sum_exp = 0, sum_exp_s = 0, sum_cs = 0;
  int64_t argmax = -1, first_nan = -1;

  // Folds `o` in; ties in the max keep the lower index.
  __device__ void merge(const State& o) {
    const float m = o.max > max ? o.max : max;
    const float f = max == -kInf ? 0.0f : expf(shift_of(max) - shift_of(m));
    const float fo = o.max == -kInf ? 0.0f : expf(shift_of(o.max) - shift_of(m));
    sum_exp = sum_exp * f + o.sum_exp * fo;
    sum_exp_s = sum_exp_s * f + o.sum_exp_s * fo;
    sum_cs += o.sum_cs;
    if (o.max > max) argmax = o.argmax;
    else if (o.max == max) argmax = min_index(argmax, o.argmax);
    max = m;
    first_nan = min_index(first_nan, o.first_nan);
  }
};

// Fixed-shape butterfly over groups of `lanes` adjacent lanes of a warp (32:
// the whole warp; 4: the quads of a wgmma accumulator row): every lane ends
// with the merge of its group (lane order inside each pair is fixed, so the
// bits are too).
inline __device__ State warp_merge(State st, int lanes = 32) {
  for (int width = lanes / 2; width > 0; width /= 2) {
    State o;
    o.max = __shfl_xor_sync(0xffffffffu, st.max, width);
    o.sum_exp = __shfl_xor_sync(0xffffffffu, st.sum_exp, width);
    o.sum_exp_s = __shfl_xor_sync(0xffffffffu, st.sum_exp_s, width);
    o.sum_cs = __shfl_xor_sync(0xffffffffu, st.sum_cs, width);
    o.argmax = __shfl_xor_sync(0xffffffffu, st.argmax, width);
    o.first_nan = __shfl_xor_sync(0xffffffffu, st.first_nan, width);
    // The lower lane's state first, so both lanes compute the same bits
    // (field by field: a struct-valued select would go to local memory).
    const bool lower = (threadIdx.x & width) == 0;
    State a, b;
    a.max = lower ? st.max : o.max, b.max = lower ? o.max : st.max;
    a.sum_exp = lower ? st.sum_exp : o.sum_exp, b.sum_exp = lower ? o.sum_exp : st.sum_exp;
    a.sum_exp_s = lower ? st.sum_exp_s : o.sum_exp_s, b.sum_exp_s = lower ? o.sum_exp_s : st.sum_exp_s;
    a.sum_cs = lower ? st.sum_cs : o.sum_cs, b.sum_cs = lower ? o.sum_cs : st.sum_cs;
    a.argmax = lower ? st.argmax : o.argmax, b.argmax = lower ? o.argmax : st.argmax;
    a.first_nan = lower ? st.first_nan : o.first_nan;
    b.first_nan = lower ? o.first_nan : st.first_nan;
    a.merge(b);
    st = a;
  }
  return st;
}

}  // namespace flce::cuda
