// The score GEMMs of passes 1 and 2 fused with their epilogues on Hopper
// (score_gemms.h has the contract).
//
// A block of 384 threads owns 128 rows and a run of classes (one score
// tile's in pass 1, kDlogitsChunk in pass 2), 256 at a time:
//   warpgroup 0     the producer: one thread issues TMA loads of x's
//                   [128 x 64] and W's [256 x 64] slices into a ring of
//                   kStages shared-memory stages (128-byte swizzle);
//   warpgroups 1-2  the consumers: 64 rows each, a [64 x 256] f32
//                   accumulator in registers (wgmma m64n256k16, 128 floats
//                   a thread), then the epilogue (States, Dlogits or
//                   StoreF32) works on them, and the next 256 classes begin.
// Stages are handed over with mbarriers: `full` (the TMA's bytes arrived)
// and `empty` (every consumer warp is done reading). Each state is folded
// in a fixed order (columns ascending within a thread, a fixed butterfly
// over the four threads of a row), so results are bitwise reproducible.
#include "cuda/sm90/score_gemms.h"

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "cuda/softmax_state.cuh"
#include "cuda/sm90/wgmma.cuh"

namespace flce::cuda::sm90 {
namespace {

constexpr int kRows = 128;             // rows of a block: two consumer warpgroups
constexpr int kCols = 256;             // classes per accumulator (the wgmma's N)
static_assert(kCols == kStashRefCols, "one stash ref per subtile");
constexpr int kDepth = 64;             // K per stage: one 128-byte swizzle row of 16-bit values
constexpr int kStages = 4;
constexpr int kThreads = 384;
constexpr int kConsumerWarps = 8;
constexpr uint32_t kStageBytesA = kRows * kDepth * 2;  // 16 KiB
constexpr uint32_t kStageBytesB = kCols * kDepth * 2;  // 32 KiB
// Classes per block in gemm_dlogits. A gradient block is only a few score
// tiles wide (3 at the Gemma-2 head), so blocks of a whole tile's classes
// made 192 blocks there: one full wave of 132 SMs and one 45% full. 1024
// makes 768 (5.8 waves) there and 512 at H = 1024. Steps on an H100
// (bench/cuda_bench.py, shuffled rounds, ms at Gemma-2 / Llama-3 / H = 1024):
// 512: 67.2 / 50.2 / 32.3, 1024: 65.3 / 50.1 / 31.0, 2048: 65.3 / 50.7 /
// 29.7, 4096: 69.5 / 52.9 / 30.9.
constexpr int64_t kDlogitsChunk = 1024;
constexpr size_t kSharedBytes =
    1024 + kStages * size_t(kStageBytesA + kStageBytesB) + 2 * kStages * sizeof(uint64_t);

// Where a block works: rows [row0 + 128 blockIdx.x, +128) clipped to
// row_end, classes [col0 + chunk blockIdx.y, +chunk) clipped to v.
struct Grid {
  int64_t row0, row_end, col0, chunk, v;
  int k_tiles;
};

// ---- epilogues: what a consumer thread does with its accumulators -----------
//
// A consumer thread holds rows row_a = 16 warp + lane/4 and row_a + 8 of its
// warpgroup's 64, columns 8 j + 2 (lane % 4) + {0, 1} for j < 32 (wgmma.cuh).

__device__ int column_of(int r, int quad) { return 8 * (r / 4) + 2 * quad + (r & 1); }

// Two adjacent values of G in one 4- or 8-byte store (p aligned to it).
__device__ void store_pair(float* p, float a, float b) {
  *reinterpret_cast<float2*>(p) = make_float2(a, b);
}
__device__ void store_pair(__nv_bfloat16* p, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}
__device__ void store_pair(__half* p, float a, float b) {
  *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b);
}

// The plain product (gemm_f32).
struct StoreF32 {
  float* c;
  int64_t ldc;

  struct Thread {
    float* c;
    int64_t ldc, row_a, row_end;
    int quad;
    __device__ Thread(const StoreF32& e, const Grid& g, int64_t row_a, int64_t, int64_t)
        : c(e.c), ldc(e.ldc), row_a(row_a), row_end(g.row_end), quad(threadIdx.x % 4) {}
    __device__ void subtile(float (&d)[128], int64_t n0, int limit) {
#pragma unroll
      for (int r = 0; r < 128; ++r) {
        const int64_t i = row_a + ((r >> 1) & 1) * 8;
        const int col = column_of(r, quad);
        if (i < row_end && col < limit) c[i * ldc + n0 + col] = d[r];
      }
    }
    __device__ void end() {}
  };
};

// Softmax states (gemm_states). The flags compile out what a call does not
// need, as tile_states_kernel's do.
template <bool kSbar, bool kSumCs, bool kSoftcap, bool kRaw, bool kArgmax, bool kStash>
struct States {
  LossArgs g;
  TileState* states;
  int64_t state_r0, tiles, t0;
  StashOut stash;

  // One row's running state over the chunk (columns relative to its start).
  struct Row {
    float max = -kInf, sum_exp = 0, sum_exp_s = 0, sum_cs = 0;
    int arg_c = -1, nan_c = -1;
    int64_t i = 0, y = -1;
  };

  struct Thread {
    const TileParams q;  // at class 0
    RowInfo* info;
    TileState* states;
    StashOut stash;
    int64_t state_r0, tiles, t, c_begin, row_end, v;
    int quad;
    Row rows[2];

    __device__ Thread(const States& e, const Grid& grid, int64_t row_a, int64_t c_begin,
                      int64_t chunk)
        : q(e.g, 0), info(e.g.rows), states(e.states), stash(e.stash), state_r0(e.state_r0),
          tiles(e.tiles), t(e.t0 + chunk), c_begin(c_begin), row_end(grid.row_end), v(e.g.v),
          quad(threadIdx.x % 4) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t i = row_a + 8 * h;
        rows[h].i = i;
        if (i < row_end) rows[h].y = load_int(e.g.labels, i);
      }
    }

    // Scores in place of the raw logits; classes past the chunk are -inf.
    __device__ void subtile(float (&d)[128], int64_t n0, int limit) {
#pragma unroll
      for (int r = 0; r < 128; ++r) {
        const int col = column_of(r, quad);
        const float z = kRaw ? d[r] : q.a * (q.bias ? d[r] + q.bias[n0 + col] : d[r]);
        d[r] = kSoftcap ? q.k * tanhf(z * q.inv_k) : z;
      }
      if (limit < kCols) {
#pragma unroll
        for (int r = 0; r < 128; ++r)
          if (column_of(r, quad) >= limit) d[r] = -kInf;
      }
      if (kStash) stash_subtile(d, n0, limit);
      fold(rows[0], d, 0, n0, limit);
      fold(rows[1], d, 1, n0, limit);
    }

    // The subtile's codes f16(ref - s), ref = shift_of(the row's max over
    // the subtile), as tile_states writes a tile's (kernels.h, Stash).
    __device__ void stash_subtile(const float (&d)[128], int64_t n0, int limit) {
      const int64_t b = n0 / stash.block_cols, block_j0 = b * stash.block_cols;
      const int64_t block_cols = v - block_j0 < stash.block_cols ? v - block_j0 : stash.block_cols;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float m = -kInf;
#pragma unroll
        for (int j = 0; j < 32; ++j) m = fmaxf(m, fmaxf(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));  // the row's four threads
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        const float ref = shift_of(m);
        const int64_t i = rows[h].i;
        if (i >= row_end) continue;
        uint16_t* codes = stash.codes + b * stash.n * stash.block_cols + i * block_cols +
                          (n0 - block_j0);
        const bool pairs = limit >= kCols && reinterpret_cast<uintptr_t>(codes) % 4 == 0;
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          const int col = 8 * j + 2 * quad;
          const uint16_t c0 = stash_code(ref, d[4 * j + 2 * h]);
          const uint16_t c1 = stash_code(ref, d[4 * j + 2 * h + 1]);
          if (pairs) {
            *reinterpret_cast<uint32_t*>(codes + col) = uint32_t(c0) | uint32_t(c1) << 16;
          } else {
            if (col < limit) codes[col] = c0;
            if (col + 1 < limit) codes[col + 1] = c1;
          }
        }
        if (quad == 0)
          stash.refs[i * stash.refs_ld + t * stash.refs_per_tile + (n0 - c_begin) / kCols] = ref;
      }
    }

    // Folds row h's 64 scores of this subtile: one group max and at most one
    // rescale, then the sums in column order.
    __device__ void fold(Row& row, const float (&d)[128], int h, int64_t n0, int limit) {
      float group_max = -kInf;
#pragma unroll
      for (int j = 0; j < 32; ++j)
        group_max = fmaxf(group_max, fmaxf(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]));
      if (group_max > row.max) {
        const float f = row.max == -kInf ? 0.0f : expf(shift_of(row.max) - shift_of(group_max));
        row.sum_exp *= f;
        if (kSbar) row.sum_exp_s *= f;
        row.max = group_max;
        row.arg_c = -1;
      }
      const float shift = shift_of(row.max);
#pragma unroll
      for (int r = 2 * h; r < 128; r += 4) {
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const float s = d[r + k];
          const float e_s = expf(s - shift);
          row.sum_exp += e_s;
          if (kSbar) row.sum_exp_s += e_s == 0 ? 0.0f : e_s * s;
          if (kSumCs) {
            const int col = column_of(r + k, quad);
            if (col < limit) {
              const float cw = q.class_weight(int(n0) + col);
              row.sum_cs += cw == 0 ? 0.0f : cw * s;
            }
          }
        }
      }
      const int base = int(n0 - c_begin);
      if (kArgmax && group_max == row.max && row.arg_c < 0) {  // the first column wins
#pragma unroll
        for (int r = 127 - (1 - h) * 2; r >= 0; r -= 4) {
          if (d[r] == row.max && column_of(r, quad) < limit)
            row.arg_c = base + column_of(r, quad);
          if (d[r - 1] == row.max && column_of(r - 1, quad) < limit)
            row.arg_c = base + column_of(r - 1, quad);
        }
      }
      // The label is in this subtile and this chunk (a subtile may reach
      // into the next chunk, whose block owns those classes).
      if (row.y >= n0 && row.y - n0 < limit && row.y - n0 < kCols) {
        const int y_col = int(row.y - n0);
#pragma unroll
        for (int r = 2 * h; r < 128; r += 4)
#pragma unroll
          for (int k = 0; k < 2; ++k)
            if (column_of(r + k, quad) == y_col) info[row.i].s_y = d[r + k];
      }
      if (row.nan_c < 0 && isnan(row.sum_exp)) {  // a NaN score: its first column
        for (int r = 2 * h; r < 128 && row.nan_c < 0; r += 4)
          for (int k = 0; k < 2 && row.nan_c < 0; ++k)
            if (isnan(d[r + k])) row.nan_c = base + column_of(r + k, quad);
      }
    }

    // The four threads of each row merge; the first writes the state.
    __device__ void end() {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const Row& row = rows[h];
        State st;
        st.max = row.max, st.sum_exp = row.sum_exp, st.sum_exp_s = row.sum_exp_s;
        st.sum_cs = row.sum_cs;
        st.argmax = row.arg_c < 0 ? -1 : c_begin + row.arg_c;
        st.first_nan = row.nan_c < 0 ? -1 : c_begin + row.nan_c;
        st = warp_merge(st, 4);
        if (quad == 0 && row.i < row_end)
          states[(row.i - state_r0) * tiles + t] =
              TileState{st.max, st.sum_exp, st.sum_exp_s, st.sum_cs, st.argmax, st.first_nan};
      }
    }
  };
};

// G (gemm_dlogits): each thread's two rows' G, per DlogitsRow (the formula
// of kernels.cu's dlogits), stored as T at out[(i - r0) * ld + j - j0],
// adjacent column pairs in one store where aligned.
template <typename T, int kRound, DlogitsForm kForm>
struct Dlogits {
  LossArgs g;
  T* out;
  int64_t ld, r0, j0;

  struct Thread {
    using Row = DlogitsRow<kRound, kForm>;
    Row rows[2];
    T* out;
    int64_t ld, r0, j0, row_a, row_end;
    int quad;

    static __device__ RowInfo info_of(const LossArgs& g, int64_t i, int64_t row_end) {
      return i < row_end ? g.rows[i] : RowInfo{};
    }
    __device__ Thread(const Dlogits& e, const Grid& grid, int64_t row_a, int64_t, int64_t)
        : rows{Row(e.g, info_of(e.g, row_a, grid.row_end), 0, int(e.g.v)),
               Row(e.g, info_of(e.g, row_a + 8, grid.row_end), 0, int(e.g.v))},
          out(e.out), ld(e.ld), r0(e.r0), j0(e.j0), row_a(row_a), row_end(grid.row_end),
          quad(threadIdx.x % 4) {}

    __device__ void subtile(float (&d)[128], int64_t n0, int limit) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t i = row_a + 8 * h;
        if (i >= row_end) continue;
        const Row& row = rows[h];
        T* row_out = out + (i - r0) * ld + (n0 - j0);
        const bool pairs =
            limit >= kCols && reinterpret_cast<uintptr_t>(row_out) % (2 * sizeof(T)) == 0;
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          const int col = 8 * j + 2 * quad, c = int(n0) + col;
          const float g0 = row(row.score(d[4 * j + 2 * h], c), c);
          const float g1 = row(row.score(d[4 * j + 2 * h + 1], c + 1), c + 1);
          if (pairs) {
            store_pair(row_out + col, g0, g1);
          } else {
            if (col < limit) row_out[col] = T(g0);
            if (col + 1 < limit) row_out[col + 1] = T(g1);
          }
        }
      }
    }
    __device__ void end() {}
  };
};

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
  uint64_t* full = reinterpret_cast<uint64_t*>(b_stages + kStages * kStageBytesB);
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

  const int64_t m0 = grid.row0 + int64_t(blockIdx.x) * kRows;
  const int64_t c_begin = grid.col0 + int64_t(blockIdx.y) * grid.chunk;
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
                                blockIdx.y);
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

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const auto fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      p = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// The TMA map of a [rows, H] matrix of 16-bit values with unit column stride,
// read in [box_rows x 64] boxes.
std::string tensor_map(const Tensor& t, int64_t rows, uint32_t box_rows, CUtensorMap* map) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return "the CUDA driver has no cuTensorMapEncodeTiled";
  const cuuint64_t dims[2] = {cuuint64_t(t.shape[1]), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(t.stride[0]) * 2};
  const cuuint32_t box[2] = {kDepth, box_rows};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = encode(
      map,
      t.dtype == Dtype::f16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
      2, t.data, dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return "cuTensorMapEncodeTiled failed (CUresult " + std::to_string(r) + ")";
  return "";
}

template <bool kHalf, class Epilogue>
std::string launch(const Tensor& x, const Tensor& w, const Grid& grid, const Epilogue& epi,
                   cudaStream_t stream) {
  CUtensorMap x_map, w_map;
  if (auto e = tensor_map(x, x.shape[0], kRows, &x_map); !e.empty()) return e;
  if (auto e = tensor_map(w, w.shape[0], kCols, &w_map); !e.empty()) return e;
  auto kernel = gemm_rows_kernel<kHalf, Epilogue>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           int(kSharedBytes)) != cudaSuccess)
    return std::string("gemm_rows_kernel: ") + cudaGetErrorString(cudaGetLastError());
  const int64_t row_blocks = (grid.row_end - grid.row0 + kRows - 1) / kRows;
  const int64_t chunks = (grid.v - grid.col0 + grid.chunk - 1) / grid.chunk;
  if (row_blocks <= 0 || chunks <= 0) return "";
  kernel<<<dim3(unsigned(row_blocks), unsigned(chunks)), kThreads, kSharedBytes, stream>>>(
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

int k_tiles(const Tensor& x) { return int((x.shape[1] + kDepth - 1) / kDepth); }

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
  const States<kSbar, kSumCs, kSoftcap, kRaw, kArgmax, true> epi{args, states, state_r0,
                                                                 tiles, t0,     stash};
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

template <typename T, int kRound>
std::string launch_dlogits(const LossArgs& args, const Tensor& x, const Tensor& w,
                           const Grid& grid, void* g, int64_t g_ld, int64_t r0, int64_t j0,
                           cudaStream_t stream) {
  T* out = static_cast<T*>(g);
  switch (dlogits_form(args)) {
    case kPlain:
      return launch_for(x, w, grid, Dlogits<T, kRound, kPlain>{args, out, g_ld, r0, j0}, stream);
    case kPlainSoftcap:
      return launch_for(x, w, grid, Dlogits<T, kRound, kPlainSoftcap>{args, out, g_ld, r0, j0},
                        stream);
    default:
      return launch_for(x, w, grid, Dlogits<T, kRound, kGeneral>{args, out, g_ld, r0, j0}, stream);
  }
}

constexpr int kF32 = int(Dtype::f32), kBf16 = int(Dtype::bf16), kF16 = int(Dtype::f16);

const char* fused_env() { return std::getenv("FLCE_CUDA_FUSED"); }

bool rows_fit_tma(const Tensor& t) {
  return t.stride[1] == 1 && t.stride[0] % 8 == 0 && reinterpret_cast<uintptr_t>(t.data) % 16 == 0;
}

}  // namespace

std::string check_fused_env() {
  const char* env = fused_env();
  if (env != nullptr && std::strcmp(env, "0") != 0 && std::strcmp(env, "1") != 0)
    return "FLCE_CUDA_FUSED = '" + std::string(env) +
           "': must be 0 (cuBLAS GEMM, then tile_states) or 1 (the fused kernel where it "
           "applies; unset: the same)";
  return "";
}

std::string fused_declines(const Problem& p) {
  const char* env = fused_env();
  if (env != nullptr && std::strcmp(env, "0") == 0) return "FLCE_CUDA_FUSED=0";
  if (p.logits.present()) return "the logits entry has no GEMM to fuse";
  if (p.x.dtype != Dtype::bf16 && p.x.dtype != Dtype::f16)
    return std::string("storage ") + dtype_name(p.x.dtype) + ": the kernel multiplies bf16 or f16";
  if (p.w_layout != WeightLayout::vh) return "W is stored [H, V]";
  if (!rows_fit_tma(p.x) || !rows_fit_tma(p.w))
    return "x or W rows are not contiguous and 16-byte aligned";
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, p.x.device_index) !=
          cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, p.x.device_index) !=
          cudaSuccess) {
    cudaGetLastError();
    return "no CUDA device " + std::to_string(p.x.device_index);
  }
  if (major != 9 || minor != 0)
    return "compute capability " + std::to_string(major) + "." + std::to_string(minor) +
           ": the kernel is built for sm_90a";
  if (tensor_map_encoder() == nullptr) return "the CUDA driver has no cuTensorMapEncodeTiled";
  return "";
}

std::string gemm_states(const LossArgs& args, const Tensor& x, const Tensor& w, int64_t r0,
                        int64_t rows, int64_t t0, int64_t t1, int64_t tile_cols, int64_t tiles,
                        int64_t state_r0, TileState* states, const StashOut& stash,
                        cudaStream_t stream) {
  const Grid grid{r0, r0 + rows, t0 * tile_cols, tile_cols, std::min(args.v, t1 * tile_cols),
                  k_tiles(x)};
  const int flags = (args.need_sbar ? 8 : 0) | (args.e > 0 ? 4 : 0) | (args.k > 0 ? 2 : 0) |
                    (args.argmax.present() ? 1 : 0);
  switch (flags) {
#define FLCE_STATES(F) \
  case F: return launch_states<F>(args, x, w, grid, states, state_r0, tiles, t0, stash, stream);
    FLCE_STATES(0) FLCE_STATES(1) FLCE_STATES(2) FLCE_STATES(3)
    FLCE_STATES(4) FLCE_STATES(5) FLCE_STATES(6) FLCE_STATES(7)
    FLCE_STATES(8) FLCE_STATES(9) FLCE_STATES(10) FLCE_STATES(11)
    FLCE_STATES(12) FLCE_STATES(13) FLCE_STATES(14) FLCE_STATES(15)
#undef FLCE_STATES
  }
  return "";
}

std::string gemm_dlogits(const LossArgs& args, const Tensor& x, const Tensor& w, int64_t r0,
                         int64_t rows, int64_t j0, int64_t cols, void* g, Dtype g_dtype,
                         int64_t g_ld, Dtype round_to, cudaStream_t stream) {
  const Grid grid{r0, r0 + rows, j0, kDlogitsChunk, j0 + cols, k_tiles(x)};
  if (g_dtype == Dtype::bf16)
    return launch_dlogits<__nv_bfloat16, kBf16>(args, x, w, grid, g, g_ld, r0, j0, stream);
  if (g_dtype == Dtype::f16)
    return launch_dlogits<__half, kF16>(args, x, w, grid, g, g_ld, r0, j0, stream);
  if (round_to == Dtype::bf16)
    return launch_dlogits<float, kBf16>(args, x, w, grid, g, g_ld, r0, j0, stream);
  if (round_to == Dtype::f16)
    return launch_dlogits<float, kF16>(args, x, w, grid, g, g_ld, r0, j0, stream);
  return launch_dlogits<float, kF32>(args, x, w, grid, g, g_ld, r0, j0, stream);
}

std::string gemm_f32(const Tensor& x, const Tensor& w, float* c, int64_t ldc, cudaStream_t stream) {
  const Grid grid{0, x.shape[0], 0, 2048, w.shape[0], k_tiles(x)};
  return launch_for(x, w, grid, StoreF32{c, ldc}, stream);
}

}  // namespace flce::cuda::sm90
