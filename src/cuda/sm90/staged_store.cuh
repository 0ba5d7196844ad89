// src/cuda/sm90/staged_store.cuh: how an epilogue sends a consumer's
// [64 x 256] subtile of 16-bit values to global memory through shared
// memory and the TMA (internal; Dlogits' G, States' stash codes).
//
// Stored straight from the wgmma layout, each 4-byte store of a warp
// writes 16 bytes in each of 8 rows. Here the consumer writes [64 x 64]
// boxes (8 KiB) into shared memory in the TMA's 128-byte swizzle, so that a
// warp's 4-byte writes hit 32 different banks, and its thread 0 stores each
// box with one TMA store, two boxes in flight: at H = 1024 on an H200 the
// G kernel took 9.0 ms with direct stores, 7.0 ms with no store at all, and
// 8.2 ms (9.2 in the same run before) this way.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "cuda/sm90/wgmma.cuh"

namespace flce::cuda::sm90 {

constexpr int kStagedBox = 64;                                    // rows and classes of a box
constexpr uint32_t kStagedBoxBytes = kStagedBox * kStagedBox * 2;  // 8 KiB
// Two box buffers a consumer. All four boxes of a subtile (with a ring
// stage less to make room) measured slower, waiting or not; so did one
// barrier a box instead of two (the same) and a subtile's boxes between two
// barriers (slower).
constexpr uint32_t kStagingBytesPerConsumer = 2 * kStagedBoxBytes;

// A consumer thread's first row among its warpgroup's 64 (wgmma's layout).
inline __device__ int consumer_row() {
  const int tid = threadIdx.x % 128;
  return 16 * (tid / 32) + (tid % 32) / 4;
}

// The consumer's subtile: pair(j, h) is this thread's 32-bit pair of its
// row h at columns 8 j + 2 (lane % 4), +1 (the accumulator layout,
// epilogues.cuh), for j < 32. Box b (columns 64 b ..) goes to coordinates
// (col0 + 64 b, row0) of a 2D map, or (col0 + 64 b, row0, plane) of a 3D
// one; the TMA writes nothing outside the map's dimensions, so rows past
// the problem's may hold anything. Every thread of the consumer calls it.
template <int kDims, class Pair>
__device__ void store_subtile_staged(uint8_t* staging, const CUtensorMap* map, int col0, int row0,
                                     int plane, const Pair& pair) {
  static_assert(kDims == 2 || kDims == 3, "2D or 3D maps");
  const int tid = threadIdx.x % 128, barrier_id = threadIdx.x / 128;  // consumers: 1, 2
  const int quad = tid % 4, r = consumer_row();
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    uint8_t* box = staging + (b % 2) * kStagedBoxBytes;
    if (tid == 0) bulk_wait_read<1>();  // this buffer's previous store has read it
    named_barrier(barrier_id, 128);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint8_t* row = box + (r + 8 * h) * 128;
#pragma unroll
      for (int c = 0; c < 8; ++c)  // 16-byte chunk c of the row, swizzled by row % 8
        *reinterpret_cast<uint32_t*>(row + ((c ^ (r & 7)) << 4) + 4 * quad) = pair(8 * b + c, h);
    }
    fence_shared_for_tma();
    named_barrier(barrier_id, 128);
    if (tid == 0) {
      if constexpr (kDims == 2) tma_store_2d(map, box, col0 + kStagedBox * b, row0);
      else tma_store_3d(map, box, col0 + kStagedBox * b, row0, plane);
      bulk_commit();
    }
  }
}

// The consumer's first row in its subtile's boxes, from a thread's first row.
inline __device__ int64_t staged_first_row(int64_t thread_row) {
  return thread_row - consumer_row();
}

// Before the block ends: every box written.
inline __device__ void finish_staged_stores() {
  if (threadIdx.x % 128 == 0) bulk_wait_all();
}

}  // namespace flce::cuda::sm90
