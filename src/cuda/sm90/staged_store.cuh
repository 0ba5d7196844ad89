// src/cuda/sm90/staged_store.cuh: how an epilogue sends a consumer's
// [64 x 256] subtile of 16-bit values to global memory through shared
// memory and the TMA (internal; Dlogits' G, States' stash codes).
//
// Stored straight from the wgmma layout, each 4-byte store of a warp
// writes 16 bytes in each of 8 rows. Here the consumer writes [64 x 64]
// boxes (8 KiB) into shared memory in the TMA's 128-byte swizzle, so that
// the 16-byte rows a warp writes at once fall in different banks, and its
// thread 0 stores each box with one TMA store, two boxes in flight: at
// H = 1024 on an H200 the G kernel took 9.0 ms with direct stores, 7.0 ms
// with no store at all, and 8.2 ms (9.2 in the same run before) this way.
// A warp's 8 x 8 pieces of the accumulator are the mma fragment layout, so
// stmatrix writes four of them (16 classes of its 16 rows) in one
// instruction, where 4-byte stores took four, each with its own address.
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
  // One stmatrix_x4 writes the warp's rows 16 warp + {0..7, 8..15} (h = 0,
  // 1) at 16-byte chunks c and c + 1 of a box row (classes 8 c ..), c even:
  // lane L gives row 16 warp + 8 ((L / 8) % 2) + L % 8 of chunk c + L / 16,
  // which the swizzle puts at chunk (c + L / 16) ^ (row % 8). With c even
  // that is c ^ (L / 16) ^ (L % 8): the lane's offset below, XORed with
  // 16 c (a box is 1024-byte aligned and a row 128 bytes, so bits 4-6 of
  // box + 128 row are 0).
  const int lane = tid % 32;
  const int row = 16 * (tid / 32) + 8 * ((lane / 8) % 2) + lane % 8;
  const uint32_t lane_offset = uint32_t(row * 128 + (((lane / 16) ^ (lane % 8)) << 4));
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    uint8_t* box = staging + (b % 2) * kStagedBoxBytes;
    if (tid == 0) bulk_wait_read<1>();  // this buffer's previous store has read it
    named_barrier(barrier_id, 128);
    const uint32_t at = shared_address(box) + lane_offset;
#pragma unroll
    for (int c = 0; c < 8; c += 2) {
      const int j = 8 * b + c;
      stmatrix_x4(at ^ uint32_t(c << 4), pair(j, 0), pair(j, 1), pair(j + 1, 0), pair(j + 1, 1));
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
