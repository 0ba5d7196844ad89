// src/cuda/sm90/gemm_rows.cuh: the fused score kernel's main loop and its
// launch (internal; included by the sm90 .cu files, each of which compiles
// some of its epilogues, so that nvcc builds them in parallel).
//
// A block of 384 threads owns 128 rows and a run of classes (one score
// tile's in pass 1, kDlogitsChunk in pass 2), 128 at a time (a subtile):
//   warpgroup 0     the producer: one thread issues TMA loads of x's
//                   [128 x 64] and W's [128 x 64] slices into a ring of
//                   kStages shared-memory stages (128-byte swizzle), in
//                   subtile order. Blocks run in clusters of two with
//                   adjacent row blocks and the same classes: each loads
//                   half of W's slice and multicasts it to both, so W
//                   crosses from L2 once per pair (with 128 x 128 subtiles
//                   the loads would otherwise outrun L2's bandwidth);
//   warpgroups 1-2  the consumers, in ping-pong: consumer c takes subtiles
//                   c, c + 2, ..., all 128 rows of each, as two [64 x 128]
//                   f32 accumulators in registers (wgmma m64n128k16, 128
//                   floats a thread). The two take turns on the tensor
//                   cores (named barriers): while one multiplies its
//                   subtile, the other runs its epilogue (States, Dlogits
//                   or StoreF32) on the subtile before, so the epilogues
//                   hide under the products instead of stalling them.
// Stages are handed over with mbarriers: `full` (the TMA's bytes arrived,
// the peer's half of W among them) and `empty` (the consuming warpgroups'
// four warps in both blocks of the cluster are done reading, since the
// producers write into both). Each
// state is folded in a fixed order (a consumer's subtiles ascending, columns
// ascending within a thread, a fixed butterfly over the four threads of a
// row, then consumer 0's state merged with consumer 1's), so results are
// bitwise reproducible.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <string>

#include "cuda/softmax_state.cuh"
#include "cuda/sm90/score_gemms.h"
#include "cuda/sm90/wgmma.cuh"
#include "flce/flce.h"

namespace flce::cuda::sm90 {

constexpr int kRows = 128;   // rows of a block and of each consumer's subtile
constexpr int kCols = 128;   // classes per subtile (the wgmma's N)
static_assert(kCols == kStashRefCols, "one stash ref per subtile");
constexpr int kAcc = 64;     // accumulator floats a thread holds per 64-row half
constexpr int kDepth = 64;   // K per stage: one 128-byte swizzle row of 16-bit values
constexpr int kStages = 6;
constexpr int kThreads = 384;
constexpr int kConsumerThreads = 256;
constexpr int kWarpsPerConsumer = 4;
constexpr int kClusterBlocks = 2;  // blocks sharing W's slices (multicast)
constexpr uint32_t kStageBytesA = kRows * kDepth * 2;  // 16 KiB
constexpr uint32_t kStageBytesB = kCols * kDepth * 2;  // 16 KiB, half from each block
constexpr int kColsPerLoad = kCols / kClusterBlocks;
// Named barriers: consumer c may start its next subtile's products
// (kTurnBarrier + c), and consumer 1's states are in shared memory.
constexpr int kTurnBarrier = 1, kExchangeBarrier = 3;
constexpr size_t kSharedBytes = 1024 + kStages * size_t(kStageBytesA + kStageBytesB) +
                                2 * kStages * sizeof(uint64_t) + kRows * sizeof(State);

// Where the blocks work: row block b takes rows [row0 + 128 b, +128)
// clipped to row_end, chunk c classes [col0 + chunk c, +chunk) clipped to v.
// launch() sets row_blocks (rounded up to whole clusters: a block past
// row_end loads zeros and writes nothing), chunks and group_rows (even).
struct Grid {
  int64_t row0, row_end, col0, chunk, v;
  int k_tiles;
  int64_t row_blocks = 0, chunks = 0, group_rows = 0;
};

// Row block and chunk of block `id`. Blocks are numbered in groups of
// group_rows row blocks, row blocks fastest within a group, so the ~132
// blocks that run at once share a few row blocks' x and a few chunks' W:
// each block reads its x rows again for every subtile, and with all row
// blocks side by side (64 MiB of x at N = 8192, H = 4096) those reads
// missed L2.
struct Place {
  int64_t row_block, chunk;
};
inline __device__ Place place_of(const Grid& g, int64_t id) {
  const int64_t per_group = g.group_rows * g.chunks, group = id / per_group;
  const int64_t first = group * g.group_rows, local = id - group * per_group;
  const int64_t rows_here = g.row_blocks - first < g.group_rows ? g.row_blocks - first
                                                                : g.group_rows;
  return {first + local % rows_here, local / rows_here};
}

// ---- the kernel ----------------------------------------------------------------

// The products of one subtile: d_top (rows 0-63 of the block) and d_bottom
// (rows 64-127) = x[128 rows] . W[n0 .. n0 + 128]^T over the k_tiles stages
// that start at ring position it. Releases each stage once its products are
// done; hands the tensor cores to the other consumer (hand_over) as soon as
// the last products are issued.
template <bool kHalf>
__device__ __forceinline__ void multiply_subtile(float (&d_top)[kAcc], float (&d_bottom)[kAcc], int it,
                                 int k_tiles, const uint8_t* a_stages, const uint8_t* b_stages,
                                 uint64_t* full, uint64_t* empty, int hand_over, int lane) {
  // A stage is free again once this warp is done with it in both blocks.
  const auto release = [&](int stage) {
    if (lane == 0)
      for (uint32_t cta = 0; cta < kClusterBlocks; ++cta) barrier_arrive_in(&empty[stage], cta);
  };
#pragma unroll
  for (int r = 0; r < kAcc; ++r) d_top[r] = 0.0f, d_bottom[r] = 0.0f;
  int previous = -1;
  for (int kt = 0; kt < k_tiles; ++kt, ++it) {
    const int stage = it % kStages;
    barrier_wait(&full[stage], (it / kStages) & 1);
    const uint64_t desc_top = swizzled_k_major_desc(a_stages + stage * kStageBytesA);
    const uint64_t desc_bottom = swizzled_k_major_desc(a_stages + stage * kStageBytesA + 64 * 128);
    const uint64_t desc_b = swizzled_k_major_desc(b_stages + stage * kStageBytesB);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kDepth / 16; ++kk) {  // +32 bytes = +2 in the address field
      wgmma_m64n128k16<kHalf>(d_top, desc_top + 2 * kk, desc_b + 2 * kk, 1);
      wgmma_m64n128k16<kHalf>(d_bottom, desc_bottom + 2 * kk, desc_b + 2 * kk, 1);
    }
    wgmma_commit();
    wgmma_wait<1>();  // the previous stage's products are done: release it
    if (previous >= 0) release(previous);
    previous = stage;
  }
  if (hand_over >= 0) named_barrier_arrive(hand_over, kConsumerThreads);
  wgmma_wait<0>();
  if (previous >= 0) release(previous);
}

template <bool kHalf, class Epilogue>
__global__ void __cluster_dims__(kClusterBlocks, 1, 1) __launch_bounds__(kThreads, 1)
    gemm_rows_kernel(const __grid_constant__ CUtensorMap x_map,
                     const __grid_constant__ CUtensorMap w_map, const Grid grid,
                     const __grid_constant__ Epilogue epi) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t shared_raw[];
  uint8_t* base = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(shared_raw) + 1023) / 1024 * 1024);  // the swizzle's alignment
  uint8_t* a_stages = base;
  uint8_t* b_stages = base + kStages * kStageBytesA;
  uint64_t* full = reinterpret_cast<uint64_t*>(b_stages + kStages * kStageBytesB);
  uint64_t* empty = full + kStages;
  State* exchange = reinterpret_cast<State*>(empty + kStages);  // [128 rows]
  const int warpgroup = threadIdx.x / 128, tid = threadIdx.x % 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      barrier_init(&full[s], 1);
      barrier_init(&empty[s], kClusterBlocks * kWarpsPerConsumer);
    }
    barrier_init_fence();
    prefetch_tensor_map(&x_map);
    prefetch_tensor_map(&w_map);
  }
  cluster_sync();  // the peer's barriers exist before anything signals them
  const uint32_t rank = cluster_rank();

  const Place place = place_of(grid, blockIdx.x);
  const int64_t m0 = grid.row0 + place.row_block * kRows;
  const int64_t c_begin = grid.col0 + place.chunk * grid.chunk;
  const int64_t c_end = c_begin + grid.chunk < grid.v ? c_begin + grid.chunk : grid.v;
  const int subtiles = int((c_end - c_begin + kCols - 1) / kCols);

  if (warpgroup == 0) {  // the producer
    registers_release<24>();
    if (tid != 0) return;
    int it = 0;
    for (int sub = 0; sub < subtiles; ++sub) {
      const int n0 = int(c_begin + int64_t(sub) * kCols) + int(rank) * kColsPerLoad;
      for (int kt = 0; kt < grid.k_tiles; ++kt, ++it) {
        const int stage = it % kStages;
        const uint32_t round = it / kStages;
        barrier_wait(&empty[stage], (round & 1) ^ 1);
        barrier_arrive_expect(&full[stage], kStageBytesA + kStageBytesB);
        tma_load_2d(a_stages + stage * kStageBytesA, &x_map, &full[stage], kt * kDepth, int(m0));
        tma_load_2d_multicast(b_stages + stage * kStageBytesB + rank * (kStageBytesB / 2), &w_map,
                              &full[stage], kt * kDepth, n0, (1u << kClusterBlocks) - 1);
      }
    }
    // Stay until both blocks' consumers have released every stage: until
    // then the peer may still multicast into this block or signal its
    // barriers.
    for (int k = 0; k < kStages; ++k, ++it)
      barrier_wait(&empty[it % kStages], ((it / kStages) & 1) ^ 1);
    return;
  }

  registers_claim<240>();
  const int consumer = warpgroup - 1, warp = tid / 32, lane = tid % 32;
  const int64_t row_a = m0 + 16 * warp + lane / 4;  // this thread's first row (wgmma.cuh)
  typename Epilogue::Thread top(epi, grid, row_a, c_begin, place.chunk);
  typename Epilogue::Thread bottom(epi, grid, row_a + 64, c_begin, place.chunk);
  for (int sub = consumer; sub < subtiles; sub += 2) {
    const int64_t n0 = c_begin + int64_t(sub) * kCols;
    if (sub > 0) named_barrier_sync(kTurnBarrier + consumer, kConsumerThreads);  // my turn
    float d_top[kAcc], d_bottom[kAcc];
    multiply_subtile<kHalf>(d_top, d_bottom, sub * grid.k_tiles, grid.k_tiles, a_stages, b_stages,
                            full, empty, sub + 1 < subtiles ? kTurnBarrier + 1 - consumer : -1,
                            lane);
    top.subtile(d_top, n0, int(c_end - n0));
    bottom.subtile(d_bottom, n0, int(c_end - n0));
  }
  if constexpr (Epilogue::kMergesConsumers) {  // consumer 0's state, then consumer 1's
    if (consumer == 1) top.publish(exchange, row_a - m0), bottom.publish(exchange, row_a - m0 + 64);
    named_barrier_sync(kExchangeBarrier, kConsumerThreads);
    if (consumer == 0) top.finish(exchange, row_a - m0), bottom.finish(exchange, row_a - m0 + 64);
  }
#endif
}

// ---- host side ------------------------------------------------------------

// The TMA map of a [rows, H] matrix of 16-bit values with unit column stride,
// read in [box_rows x 64] boxes (score_gemms.cu).
std::string tensor_map(const Tensor& t, int64_t rows, uint32_t box_rows, CUtensorMap* map);

// Row blocks per group of place_of: FLCE_CUDA_GROUP_ROWS, else 8 (score_gemms.cu).
int64_t group_rows();

template <bool kHalf, class Epilogue>
std::string launch(const Tensor& x, const Tensor& w, Grid grid, const Epilogue& epi,
                   cudaStream_t stream) {
  CUtensorMap x_map, w_map;
  if (auto e = tensor_map(x, x.shape[0], kRows, &x_map); !e.empty()) return e;
  if (auto e = tensor_map(w, w.shape[0], kColsPerLoad, &w_map); !e.empty()) return e;
  auto kernel = gemm_rows_kernel<kHalf, Epilogue>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           int(kSharedBytes)) != cudaSuccess)
    return std::string("gemm_rows_kernel: ") + cudaGetErrorString(cudaGetLastError());
  const int64_t row_blocks = (grid.row_end - grid.row0 + kRows - 1) / kRows;
  grid.row_blocks = (row_blocks + kClusterBlocks - 1) / kClusterBlocks * kClusterBlocks;
  grid.chunks = (grid.v - grid.col0 + grid.chunk - 1) / grid.chunk;
  grid.group_rows = (group_rows() + kClusterBlocks - 1) / kClusterBlocks * kClusterBlocks;
  if (grid.group_rows <= 0) return "gemm_rows_kernel: FLCE_CUDA_GROUP_ROWS is malformed";
  if (row_blocks <= 0 || grid.chunks <= 0) return "";
  if (grid.row_blocks * grid.chunks > INT32_MAX) return "gemm_rows_kernel: more than 2^31 blocks";
  kernel<<<unsigned(grid.row_blocks * grid.chunks), kThreads, kSharedBytes, stream>>>(
      x_map, w_map, grid, epi);
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
