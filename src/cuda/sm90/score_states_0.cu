// gemm_states' kernels for flag sets 0 .. 3 (score_states.cuh).
#include "cuda/sm90/score_states.cuh"

namespace flce::cuda::sm90 {
template std::string launch_states_group<0>(int, const LossArgs&, const Tensor&, const Tensor&,
                                            const Grid&, TileState*, int64_t, int64_t, int64_t,
                                            const StashOut&, cudaStream_t);
}  // namespace flce::cuda::sm90
