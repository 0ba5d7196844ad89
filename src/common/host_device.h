// FLCE_HOST_DEVICE: a function that both the host compiler and nvcc's device
// pass compile (`__host__ __device__` under nvcc, nothing elsewhere), for the
// arithmetic the cpu and cuda backends share.
#pragma once

#if defined(__CUDACC__)
#define FLCE_HOST_DEVICE __host__ __device__
#else
#define FLCE_HOST_DEVICE
#endif
