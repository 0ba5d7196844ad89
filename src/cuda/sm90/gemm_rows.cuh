// src/cuda/sm90/gemm_rows.cuh: the fused score kernel's main loop and its
// launch (internal; included by the sm90 .cu files, each of which compiles
// some of its epilogues, so that nvcc builds them in parallel).
//
// A block of 384 threads owns 128 rows and a run of classes (one score
// tile's in pass 1, score_gemms.cu's kDlogitsChunk in pass 2), 128 at a time:
//   warpgroup 0     the producer: one thread issues TMA loads of x's
//                   [64 x 64] and W's [64 x 64] quarter of a stage into a
//                   ring of kStages shared-memory stages (128-byte swizzle),
//                   multicast to the blocks of its 2 x 2 cluster that share
//                   the rows or the classes;
//   warpgroups 1-2  the consumers: 64 rows each, two [64 x 128] f32
//                   accumulators in registers (wgmma m64n128k16, 64 floats
//                   a thread each), taking turns: while one subtile's
//                   products run into one, the epilogue (States, Dlogits or
//                   StoreF32) works on a copy of the other's, and issues
//                   the products stage by stage (tick). An epilogue may ask
//                   for Epilogue::kStagingBytes of shared memory per
//                   consumer (Dlogits stages G there for TMA stores).
// Stages are handed over with mbarriers: `full` (the TMA's bytes arrived)
// and `empty` (every consumer warp of the cluster is done reading). Each
// state is folded in a fixed order (columns ascending within a thread, a
// fixed butterfly over the four threads of a row), so results are bitwise
// reproducible.
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
constexpr int kCols = 128;             // classes per accumulator (the wgmma's N)
constexpr int kValues = kCols / 2;     // a consumer thread's accumulator: 2 rows x kCols / 4
static_assert(kCols == kStashRefCols, "one stash ref per subtile");
constexpr int kDepth = 64;             // K per stage: one 128-byte swizzle row of 16-bit values
constexpr int kStages = 6;
constexpr int kThreads = 384;
constexpr int kConsumerWarps = 8;
// A cluster is 2 x 2 blocks: two row blocks times two chunks of classes.
// The two blocks of a row block each load half of x's slice (32 of its
// rows) and multicast it to both; the two of a chunk, half of W's. So a
// block reads a quarter of a stage's bytes from L2 and is sent the rest.
constexpr int kClusterRows = 2, kClusterChunks = 2;
constexpr int kClusterBlocks = kClusterRows * kClusterChunks;
constexpr int kRowsPerLoad = kRows / kClusterChunks;
constexpr int kColsPerLoad = kCols / kClusterRows;
constexpr uint32_t kStageBytesA = kRows * kDepth * 2;  // 16 KiB
constexpr uint32_t kStageBytesB = kCols * kDepth * 2;  // 16 KiB
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
// Clusters are placed so (in units of row-block pairs and chunk pairs, a
// cluster's place in it from blockIdx; group_rows is even).
inline __device__ void place_block(const Grid& grid, int64_t* row_block, int64_t* chunk) {
  const int64_t pairs_x = gridDim.x / kClusterRows, pairs_y = gridDim.y / kClusterChunks;
  const int64_t group = grid.group_rows / kClusterRows;
  const int64_t id = blockIdx.x / kClusterRows + pairs_x * (blockIdx.y / kClusterChunks);
  const int64_t per_group = group * pairs_y;
  const int64_t first = id / per_group * group;
  const int64_t rows = pairs_x - first < group ? pairs_x - first : group;
  *row_block = (first + id % per_group % rows) * kClusterRows + blockIdx.x % kClusterRows;
  *chunk = id % per_group / rows * kClusterChunks + blockIdx.y % kClusterChunks;
}

// ---- the kernel ----------------------------------------------------------------

template <bool kHalf, class Epilogue>
__global__ void __cluster_dims__(kClusterRows, kClusterChunks, 1) __launch_bounds__(kThreads, 1)
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
      barrier_init(&empty[s], kClusterBlocks * kConsumerWarps);
    }
    barrier_init_fence();
    prefetch_tensor_map(&x_map);
    prefetch_tensor_map(&w_map);
  }
  cluster_sync();  // the peers' barriers exist before anything signals them
  // This block's place in its cluster: rank = at_row + kClusterRows at_chunk.
  const uint32_t at_row = blockIdx.x % kClusterRows, at_chunk = blockIdx.y % kClusterChunks;
  const uint16_t row_peers = uint16_t((1u | 1u << kClusterRows) << at_row);  // same row block
  const uint16_t chunk_peers = uint16_t(3u << (kClusterRows * at_chunk));     // same chunk

  int64_t row_block, chunk;
  place_block(grid, &row_block, &chunk);
  const int64_t m0 = grid.row0 + row_block * kRows;
  const int64_t c_begin = grid.col0 + chunk * grid.chunk;
  const int64_t c_end = c_begin + grid.chunk < grid.v ? c_begin + grid.chunk : grid.v;
  // This block's subtiles (none past v), and the steps of the whole
  // cluster: its first chunk's subtiles, which no chunk of it exceeds.
  const int subtiles = c_begin < grid.v ? int((c_end - c_begin + kCols - 1) / kCols) : 0;
  const int64_t first_begin = c_begin - int64_t(at_chunk) * grid.chunk;
  const int64_t first_end = first_begin + grid.chunk < grid.v ? first_begin + grid.chunk : grid.v;
  const int steps = int((first_end - first_begin + kCols - 1) / kCols);

  if (warpgroup == 0) {  // the producer
    registers_release<24>();
    if (tid != 0) return;
    int it = 0;
    const int x_row = int(m0) + int(at_chunk) * kRowsPerLoad;
    for (int sub = 0; sub < steps; ++sub) {
      const int n0 = int(c_begin + int64_t(sub) * kCols) + int(at_row) * kColsPerLoad;
      for (int kt = 0; kt < grid.k_tiles; ++kt, ++it) {
        const int stage = it % kStages;
        const uint32_t round = it / kStages;
        barrier_wait(&empty[stage], (round & 1) ^ 1);  // free in every block of the cluster
        barrier_arrive_expect(&full[stage], kStageBytesA + kStageBytesB);
        tma_load_2d_multicast(a_stages + stage * kStageBytesA + at_chunk * (kStageBytesA / 2),
                              &x_map, &full[stage], kt * kDepth, x_row, row_peers);
        tma_load_2d_multicast(b_stages + stage * kStageBytesB + at_row * (kStageBytesB / 2),
                              &w_map, &full[stage], kt * kDepth, n0, chunk_peers);
      }
    }
    // Stay until every block's consumers have released every stage: until
    // then a peer may still multicast into this block or signal its
    // barriers.
    for (int k = 0; k < kStages; ++k, ++it)
      barrier_wait(&empty[it % kStages], ((it / kStages) & 1) ^ 1);
    return;
  }

  registers_claim<240>();
  const int consumer = warpgroup - 1, warp = tid / 32, lane = tid % 32;
  typename Epilogue::Thread out(epi, grid, m0 + 64 * consumer + 16 * warp + lane / 4, c_begin,
                                chunk, staging + consumer * Epilogue::kStagingBytes);
  int it = 0;         // stages whose products this consumer has issued
  int previous = -1;  // the stage of the newest products, released after the next issue
  // A stage is free again once each consumer warp of the cluster is done
  // with it (two peers' producers write into it).
  const auto release = [&](int stage) {
    if (lane == 0)
      for (uint32_t cta = 0; cta < kClusterBlocks; ++cta) barrier_arrive_in(&empty[stage], cta);
  };
  // Issues stage `it`'s products into acc (the subtile's first stage
  // overwrites it), then releases the stage before it once its products are
  // done: at most two stages' products in flight.
  const auto issue = [&](float(&acc)[kValues], bool first) {
    const int stage = it % kStages;
    barrier_wait(&full[stage], (it / kStages) & 1);
    const uint64_t desc_a =
        swizzled_k_major_desc(a_stages + stage * kStageBytesA + consumer * 64 * 128);
    const uint64_t desc_b = swizzled_k_major_desc(b_stages + stage * kStageBytesB);
    wgmma_fence();
    if (first) wgmma_m64n128k16_first<kHalf>(acc, desc_a, desc_b);
    else wgmma_m64n128k16<kHalf>(acc, desc_a, desc_b, 1);
#pragma unroll
    for (int kk = 1; kk < kDepth / 16; ++kk)  // +32 bytes = +2 in the address field
      wgmma_m64n128k16<kHalf>(acc, desc_a + 2 * kk, desc_b + 2 * kk, 1);
    wgmma_commit();
    wgmma_wait<1>();
    if (previous >= 0) release(previous);
    previous = stage;
    ++it;
  };
  // Step s: subtile s's products into acc while the epilogue works on the
  // previous subtile's, in prev. The epilogue calls tick() at points every
  // thread of the warpgroup reaches, and each tick issues one more stage of
  // acc's products, so the tensor cores keep working under it. Step
  // `subtiles` only finishes the last epilogue. Each step ends with no
  // products in flight: ptxas waits for products in flight wherever paths
  // with different products in flight meet (C7517), as at the loop's head.
  const auto step = [&](float(&acc)[kValues], float(&prev)[kValues], int s) {
    int kt = 0;
    if (s < steps) {
      issue(acc, true);
      kt = 1;
    }
    const auto tick = [&] {
      if (s < steps && kt < grid.k_tiles) {
        issue(acc, false);
        ++kt;
      }
    };
    if (s > 0 && s <= subtiles) {
      // The epilogue works on a copy (opaque to the compiler, so that no
      // value it writes shares a register with the products; ptxas
      // serializes the products where one does, C7515).
      float scores[kValues];
#pragma unroll
      for (int r = 0; r < kValues; ++r) scores[r] = opaque_copy(prev[r]);
      const int64_t n0 = c_begin + int64_t(s - 1) * kCols;
      out.subtile(scores, n0, int(c_end - n0), tick);
    }
    while (s < steps && kt < grid.k_tiles) {
      issue(acc, false);
      ++kt;
    }
    wgmma_wait<0>();
    if (previous >= 0) release(previous);
    previous = -1;
  };
  // Two accumulators, taking turns (unrolled by two so that each is a fixed
  // set of registers).
  float acc0[kValues], acc1[kValues];
  for (int s = 0; s <= steps; s += 2) {
    step(acc0, acc1, s);
    if (s + 1 <= steps) step(acc1, acc0, s + 1);
  }
  if (subtiles > 0) out.end();
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
  if (auto e = tensor_map(x, x.shape[0], kRowsPerLoad, &x_map); !e.empty()) return e;
  if (auto e = tensor_map(w, w.shape[0], kColsPerLoad, &w_map); !e.empty()) return e;
  auto kernel = gemm_rows_kernel<kHalf, Epilogue>;
  constexpr size_t kSharedBytes = shared_bytes<Epilogue>();
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           int(kSharedBytes)) != cudaSuccess)
    return std::string("gemm_rows_kernel: ") + cudaGetErrorString(cudaGetLastError());
  // Whole clusters: a block past row_end or v loads zeros, writes nothing,
  // and loads its share of x and W for its peers.
  const int64_t rows = (grid.row_end - grid.row0 + kRows - 1) / kRows;
  const int64_t row_blocks = (rows + kClusterRows - 1) / kClusterRows * kClusterRows;
  const int64_t used_chunks = (grid.v - grid.col0 + grid.chunk - 1) / grid.chunk;
  const int64_t chunks = (used_chunks + kClusterChunks - 1) / kClusterChunks * kClusterChunks;
  if (rows <= 0 || used_chunks <= 0) return "";
  Grid placed = grid;
  const int64_t group = kGroupBytes / (kRows * x.shape[1] * 2) / kClusterRows * kClusterRows;
  placed.group_rows = int(group < kClusterRows ? kClusterRows : group < row_blocks ? group : row_blocks);
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
