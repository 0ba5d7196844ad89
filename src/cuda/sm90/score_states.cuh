// src/cuda/sm90/score_states.cuh: gemm_states' launches by epilogue flags
// (internal). The 16 flag sets x raw/scaled x dtype x stash are 96 kernels;
// score_states_<g>.cu compiles flag sets 4g .. 4g+3, so nvcc builds four
// files in parallel instead of one for minutes.
#pragma once

#include "cuda/sm90/epilogues.cuh"

namespace flce::cuda::sm90 {

// Flag bits: 8 sbar (entropy), 4 sum of c_j s_j (smoothing), 2 softcap, 1 argmax.
template <bool kRaw, int F>
std::string launch_states(const LossArgs& args, const Tensor& x, const Tensor& w, const Grid& grid,
                          TileState* states, int64_t state_r0, int64_t tiles, int64_t t0,
                          const StashOut& stash, cudaStream_t stream) {
  constexpr bool kSbar = F & 8, kSumCs = F & 4, kSoftcap = F & 2, kArgmax = F & 1;
  if (stash.codes == nullptr) {
    const States<kSbar, kSumCs, kSoftcap, kRaw, kArgmax, false> epi{args,     states, state_r0,
                                                                    tiles,    t0,     stash};
    return launch_for(x, w, grid, epi, stream);
  }
  if (x.dtype != Dtype::bf16) return "gemm_states: a stash needs bf16 storage";
  States<kSbar, kSumCs, kSoftcap, kRaw, kArgmax, true> epi{args, states, state_r0,
                                                           tiles, t0,     stash};
  if (auto e = stash_codes_map(grid, stash, &epi.stash_tma, &epi.stash_map); !e.empty()) return e;
  return launch<false>(x, w, grid, epi, stream);
}

template <int F>
std::string launch_states(const LossArgs& args, const Tensor& x, const Tensor& w, const Grid& grid,
                          TileState* states, int64_t state_r0, int64_t tiles, int64_t t0,
                          const StashOut& stash, cudaStream_t stream) {
  if (args.a == 1 && args.bias_f32 == nullptr)
    return launch_states<true, F>(args, x, w, grid, states, state_r0, tiles, t0, stash, stream);
  return launch_states<false, F>(args, x, w, grid, states, state_r0, tiles, t0, stash, stream);
}

// gemm_states for flag sets 4 kGroup .. 4 kGroup + 3 (score_states_<kGroup>.cu).
template <int kGroup>
std::string launch_states_group(int flags, const LossArgs& args, const Tensor& x, const Tensor& w,
                                const Grid& grid, TileState* states, int64_t state_r0,
                                int64_t tiles, int64_t t0, const StashOut& stash,
                                cudaStream_t stream) {
  switch (flags - 4 * kGroup) {
#define FLCE_STATES(F)                                                                      \
  case F:                                                                                   \
    return launch_states<4 * kGroup + F>(args, x, w, grid, states, state_r0, tiles, t0, stash, \
                                         stream);
    FLCE_STATES(0) FLCE_STATES(1) FLCE_STATES(2) FLCE_STATES(3)
#undef FLCE_STATES
  }
  return "gemm_states: flag set " + std::to_string(flags) + " is not in group " +
         std::to_string(kGroup);
}

#define FLCE_STATES_GROUP_DECL(G)                                                           \
  extern template std::string launch_states_group<G>(                                      \
      int, const LossArgs&, const Tensor&, const Tensor&, const Grid&, TileState*, int64_t, \
      int64_t, int64_t, const StashOut&, cudaStream_t);
FLCE_STATES_GROUP_DECL(0)
FLCE_STATES_GROUP_DECL(1)
FLCE_STATES_GROUP_DECL(2)
FLCE_STATES_GROUP_DECL(3)
#undef FLCE_STATES_GROUP_DECL

}  // namespace flce::cuda::sm90
