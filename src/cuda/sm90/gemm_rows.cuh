// src/cuda/sm90/gemm_rows.cuh: the fused score kernel's main loop and its
// launch (internal; included by the sm90 .cu files, each of which compiles
// some of its epilogues, so that nvcc builds them in parallel).
//
// A block of 384 threads owns 128 rows and a run of classes (one score
// tile's in pass 1, score_gemms.cu's kDlogitsChunk in pass 2), 256 at a time:
//   warpgroup 0     the producer: one thread issues TMA loads of x's
//                   [128 x 64] and W's [256 x 64] slices into a ring of
//                   kStages shared-memory stages (128-byte swizzle);
//   warpgroups 1-2  the consumers: 64 rows each, a [64 x 256] f32
//                   accumulator in registers (wgmma m64n256k16, 128 floats
//                   a thread), then the epilogue (States, Dlogits or
//                   StoreF32) works on them, and the next 256 classes begin.
//                   An epilogue may ask for Epilogue::kStagingBytes of
//                   shared memory per consumer (Dlogits stages G there for
//                   TMA stores).
// Stages are handed over with mbarriers: `full` (the TMA's bytes arrived)
// and `empty` (every consumer warp is done reading). Each state is folded
// in a fixed order (columns ascending within a thread, a fixed butterfly
// over the four threads of a row), so results are bitwise reproducible.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <string>

#include "cuda/sm90/score_gemms.h"
#include "cuda/sm90/wgmma.cuh"
#include "flce/flce.h"

namespace flce::cuda::sm90 {

constexpr int kRows = 128;             // rows of a block: two consumer warpgroups
static_assert(kRows == kKernelRows, "score_gemms.h counts blocks of these rows");
constexpr int kCols = 256;             // classes per accumulator (the wgmma's N)
static_assert(kCols == kStashRefCols, "one stash ref per subtile");
constexpr int kDepth = 64;             // K per stage: one 128-byte swizzle row of 16-bit values
constexpr int kStages = 4;
constexpr int kThreads = 384;
constexpr int kConsumerWarps = 8;
constexpr uint32_t kStageBytesA = kRows * kDepth * 2;  // 16 KiB
constexpr uint32_t kStageBytesB = kCols * kDepth * 2;  // 32 KiB
constexpr size_t kStagesBytes = kStages * size_t(kStageBytesA + kStageBytesB);
constexpr size_t kSharedLimit = 227 * 1024;  // the most dynamic shared memory of a block (sm_90)

// The stages, then each consumer's staging (1024-byte aligned), then the
// barriers; 1024 for aligning the start.
template <class Epilogue>
constexpr size_t shared_bytes() {
  static_assert(Epilogue::kStagingBytes % 1024 == 0, "staging keeps the 1024-byte alignment");
  constexpr size_t bytes =
      1024 + kStagesBytes + 2 * size_t(Epilogue::kStagingBytes) + 2 * kStages * sizeof(uint64_t);
  static_assert(bytes <= kSharedLimit, "the stages and the staging fit one block");
  return bytes;
}

// Where a block works (place_block gives its row block r and chunk c):
// rows [row0 + 128 r, +128) clipped to row_end, classes
// [col0 + chunk c, +chunk) clipped to v.
struct Grid {
  int64_t row0, row_end, col0, chunk, v;
  int k_tiles;
  int group_rows = 1;  // row blocks per group (place_block); launch() sets it
};

// x's bytes that a group of row blocks reads, at most (place_block).
constexpr int64_t kGroupBytes = int64_t(16) << 20;

// Which row block and chunk the block of blockIdx works on. The blocks run
// in groups of grid.group_rows row blocks, all chunks of a group before the
// next: the blocks in flight read one group's rows of x (kGroupBytes, so
// that they stay in L2) and the chunks of W they share. Row blocks fastest
// over the whole grid instead (x up to 38 MB at the Gemma-2 head, beside
// W's tiles) read 20.6 GB from DRAM for a 1.2 GB W in a Gemma-2 forward
// under Nsight Compute (grouped: 6.3; cuBLAS: 7.5) in the same time at its
// locked clocks, but pass 1 took 2-4% longer at the two large heads without
// them (H200, torch.profiler, two rounds): fewer DRAM bytes buy clock.
inline __device__ void place_block(const Grid& grid, int64_t* row_block, int64_t* chunk) {
  const int64_t id = blockIdx.x + int64_t(gridDim.x) * blockIdx.y;
  const int64_t per_group = int64_t(grid.group_rows) * gridDim.y;
  const int64_t first = id / per_group * grid.group_rows;
  const int64_t rows = gridDim.x - first < grid.group_rows ? gridDim.x - first : grid.group_rows;
  *row_block = first + id % per_group % rows;
  *chunk = id % per_group / rows;
}

// ---- the kernel ----------------------------------------------------------------

template <bool kHalf, class Epilogue>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_rows_kernel(const __grid_constant__ CUtensorMap x_map,
                     const __grid_constant__ CUtensorMap w_map, const Grid grid,
                     const __grid_constant__ Epilogue epi) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t shared_raw[];
  uint8_t* base = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(shared_raw) + 1023) / 1024 * 1024);  // the swizzle's alignment
  uint8_t* a_stages = base;
  uint8_t* b_stages = base + kStages * kStageBytesA;
  uint8_t* staging = base + kStagesBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(staging + 2 * Epilogue::kStagingBytes);
  uint64_t* empty = full + kStages;
  const int warpgroup = threadIdx.x / 128, tid = threadIdx.x % 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      barrier_init(&full[s], 1);
      barrier_init(&empty[s], kConsumerWarps);
    }
    barrier_init_fence();
    prefetch_tensor_map(&x_map);
    prefetch_tensor_map(&w_map);
  }
  __syncthreads();

  int64_t row_block, chunk;
  place_block(grid, &row_block, &chunk);
  const int64_t m0 = grid.row0 + row_block * kRows;
  const int64_t c_begin = grid.col0 + chunk * grid.chunk;
  const int64_t c_end = c_begin + grid.chunk < grid.v ? c_begin + grid.chunk : grid.v;
  const int subtiles = int((c_end - c_begin + kCols - 1) / kCols);

  if (warpgroup == 0) {  // the producer
    registers_release<24>();
    if (tid != 0) return;
    int it = 0;
    for (int sub = 0; sub < subtiles; ++sub) {
      const int n0 = int(c_begin + int64_t(sub) * kCols);
      for (int kt = 0; kt < grid.k_tiles; ++kt, ++it) {
        const int stage = it % kStages;
        const uint32_t round = it / kStages;
        barrier_wait(&empty[stage], (round & 1) ^ 1);
        barrier_arrive_expect(&full[stage], kStageBytesA + kStageBytesB);
        tma_load_2d(a_stages + stage * kStageBytesA, &x_map, &full[stage], kt * kDepth, int(m0));
        tma_load_2d(b_stages + stage * kStageBytesB, &w_map, &full[stage], kt * kDepth, n0);
      }
    }
    return;
  }

  registers_claim<240>();
  const int consumer = warpgroup - 1, warp = tid / 32, lane = tid % 32;
  typename Epilogue::Thread out(epi, grid, m0 + 64 * consumer + 16 * warp + lane / 4, c_begin,
                                chunk, staging + consumer * Epilogue::kStagingBytes);
  int it = 0;
  for (int sub = 0; sub < subtiles; ++sub) {
    const int64_t n0 = c_begin + int64_t(sub) * kCols;
    float d[128];
#pragma unroll
    for (int r = 0; r < 128; ++r) d[r] = 0.0f;
    int previous = -1;
    for (int kt = 0; kt < grid.k_tiles; ++kt, ++it) {
      const int stage = it % kStages;
      barrier_wait(&full[stage], (it / kStages) & 1);
      const uint64_t desc_a =
          swizzled_k_major_desc(a_stages + stage * kStageBytesA + consumer * 64 * 128);
      const uint64_t desc_b = swizzled_k_major_desc(b_stages + stage * kStageBytesB);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kDepth / 16; ++kk)  // +32 bytes = +2 in the address field
        wgmma_m64n256k16<kHalf>(d, desc_a + 2 * kk, desc_b + 2 * kk, 1);
      wgmma_commit();
      wgmma_wait<1>();  // the previous stage's products are done: release it
      if (previous >= 0 && lane == 0) barrier_arrive(&empty[previous]);
      previous = stage;
    }
    wgmma_wait<0>();
    if (previous >= 0 && lane == 0) barrier_arrive(&empty[previous]);
    out.subtile(d, n0, int(c_end - n0));
  }
  out.end();
#endif
}

// ---- host side ------------------------------------------------------------

// The TMA map of a [rows, H] matrix of 16-bit values with unit column stride,
// read in [box_rows x 64] boxes (score_gemms.cu).
std::string tensor_map(const Tensor& t, int64_t rows, uint32_t box_rows, CUtensorMap* map);

// The TMA map of the stash codes a gemm_states launch writes, [blocks, rows
// up to grid.row_end, block_cols] in staged boxes, and *fits = true; or
// *fits = false where the staged stores cannot serve it (a narrower last
// block, tiles that are not whole 256-class subtiles, unaligned codes).
std::string stash_codes_map(const Grid& grid, const StashOut& stash, bool* fits, CUtensorMap* map);

template <bool kHalf, class Epilogue>
std::string launch(const Tensor& x, const Tensor& w, const Grid& grid, const Epilogue& epi,
                   cudaStream_t stream) {
  CUtensorMap x_map, w_map;
  if (auto e = tensor_map(x, x.shape[0], kRows, &x_map); !e.empty()) return e;
  if (auto e = tensor_map(w, w.shape[0], kCols, &w_map); !e.empty()) return e;
  auto kernel = gemm_rows_kernel<kHalf, Epilogue>;
  constexpr size_t kSharedBytes = shared_bytes<Epilogue>();
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           int(kSharedBytes)) != cudaSuccess)
    return std::string("gemm_rows_kernel: ") + cudaGetErrorString(cudaGetLastError());
  const int64_t row_blocks = (grid.row_end - grid.row0 + kRows - 1) / kRows;
  const int64_t chunks = (grid.v - grid.col0 + grid.chunk - 1) / grid.chunk;
  if (row_blocks <= 0 || chunks <= 0) return "";
  if (chunks > 65535)  // the grid's y limit; only a very narrow FLCE_CUDA_TILE reaches it
    return "gemm_rows_kernel: " + std::to_string(chunks) + " chunks of " +
           std::to_string(grid.chunk) + " classes, more than a grid's 65535 (a wider tile)";
  Grid placed = grid;
  const int64_t group = kGroupBytes / (kRows * x.shape[1] * 2);
  placed.group_rows = int(group < 1 ? 1 : group < row_blocks ? group : row_blocks);
  kernel<<<dim3(unsigned(row_blocks), unsigned(chunks)), kThreads, kSharedBytes, stream>>>(
      x_map, w_map, placed, epi);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? "" : std::string("gemm_rows_kernel: ") + cudaGetErrorString(e);
}

template <class Epilogue>
std::string launch_for(const Tensor& x, const Tensor& w, const Grid& grid, const Epilogue& epi,
                       cudaStream_t stream) {
  return x.dtype == Dtype::f16 ? launch<true>(x, w, grid, epi, stream)
                               : launch<false>(x, w, grid, epi, stream);
}

inline int k_tiles(const Tensor& x) { return int((x.shape[1] + kDepth - 1) / kDepth); }

}  // namespace flce::cuda::sm90
