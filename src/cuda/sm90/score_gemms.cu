// The score GEMMs of passes 1 and 2 fused with their epilogues on Hopper: the
// host side (score_gemms.h has the contract; gemm_rows.cuh the kernel,
// epilogues.cuh what it does with the scores, score_states_*.cu pass 1's
// kernels).
#include "cuda/sm90/score_gemms.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "cuda/driver_entry.h"
#include "cuda/sm90/epilogues.cuh"
#include "cuda/sm90/score_states.cuh"

namespace flce::cuda::sm90 {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const auto fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(
      driver_entry_point("cuTensorMapEncodeTiled", 12000));
  return fn;
}

// A TMA map of 16-bit elements (`rank` <= 3 dimensions, innermost first; byte
// strides of the outer ones) in boxes of `box`, with the 128-byte swizzle.
std::string encode_map(CUtensorMapDataType type, void* data, cuuint32_t rank,
                       const cuuint64_t* dims, const cuuint64_t* byte_strides,
                       const cuuint32_t* box, CUtensorMapL2promotion promotion, CUtensorMap* map) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return "the CUDA driver has no cuTensorMapEncodeTiled";
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult r = encode(map, type, rank, data, dims, byte_strides, box, element_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, promotion,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return "cuTensorMapEncodeTiled failed (CUresult " + std::to_string(r) + ")";
  return "";
}

// The TMA map of a row-major [rows, cols] matrix of bf16 or f16 values (row
// stride ld elements) in [box_rows x box_cols] boxes (box_cols = 64: one
// swizzle row).
std::string map_16bit(void* data, Dtype dtype, int64_t rows, int64_t cols, int64_t ld,
                      uint32_t box_rows, uint32_t box_cols, CUtensorMapL2promotion promotion,
                      CUtensorMap* map) {
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(ld) * 2};
  const cuuint32_t box[2] = {box_cols, box_rows};
  return encode_map(
      dtype == Dtype::f16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
      data, 2, dims, strides, box, promotion, map);
}

}  // namespace

std::string tensor_map(const Tensor& t, int64_t rows, uint32_t box_rows, CUtensorMap* map) {
  return map_16bit(t.data, t.dtype, rows, t.shape[1], t.stride[0], box_rows, kDepth,
                   CU_TENSOR_MAP_L2_PROMOTION_L2_256B, map);
}

std::string stash_codes_map(const Grid& grid, const StashOut& stash, bool* fits, CUtensorMap* map) {
  const int64_t C = stash.block_cols;
  // Whole blocks from first_block (the launch's classes [col0, v) are blocks
  // [col0 / C, v / C)), whole subtiles in every tile, 16-byte rows.
  *fits = C % 8 == 0 && grid.col0 == stash.first_block * C && grid.v % C == 0 &&
          grid.v <= stash.end && grid.chunk % kCols == 0 &&
          reinterpret_cast<uintptr_t>(stash.codes) % 16 == 0;
  if (!*fits) return "";
  const cuuint64_t dims[3] = {cuuint64_t(C), cuuint64_t(grid.row_end),
                              cuuint64_t(grid.v / C - stash.first_block)};
  const cuuint64_t strides[2] = {cuuint64_t(C) * 2, cuuint64_t(stash.n * C) * 2};
  const cuuint32_t box[3] = {kStagedBox, kStagedBox, 1};
  if (auto e = encode_map(CU_TENSOR_MAP_DATA_TYPE_UINT16, stash.codes, 3, dims, strides, box,
                          CU_TENSOR_MAP_L2_PROMOTION_NONE, map);
      !e.empty())
    return "the stash codes' TMA map: " + e;
  return "";
}

namespace {

// Classes per block in gemm_dlogits. A gradient block is only a few score
// tiles wide (it was 3 tiles of 4096 at the Gemma-2 head), so blocks of a
// whole tile's classes made 192 blocks there: one full wave of 132 SMs and one 45% full. 2048
// makes 384 (2.9 waves) there and 384 at H = 1024. Steps on an H100
// (bench/cuda_bench.py, shuffled rounds, ms at Gemma-2 / Llama-3 / H = 1024):
// 512: 67.2 / 50.2 / 32.3, 1024: 65.3 / 50.1 / 31.0, 2048: 65.3 / 50.7 /
// 29.7, 4096: 69.5 / 52.9 / 30.9. This kernel alone (torch.profiler, two
// rounds on an H200, with the TMA stores of G): 1024: 12.98 / 7.22 / 7.86,
// 2048: 12.77 / 7.19 / 7.60, 1536: 12.92 / 7.16 / 7.73, 4096: 16.26 / 9.35
// / 7.60 ms.
static_assert(kDlogitsChunk == 2048, "score_gemms.h's chunk is the one measured here");
static_assert(kDlogitsChunk % kCols == 0, "a subtile ends only at a chunk's end or at G's last class");

// Dlogits' epilogue for G at g, with the TMA map of its staged stores where
// G is 16-bit and its rows are 16-byte aligned (the TMA's rule).
template <typename T, int kRound, DlogitsForm kForm>
std::string launch_dlogits_form(const LossArgs& args, const Tensor& x, const Tensor& w,
                                const Grid& grid, void* g, Dtype g_dtype, int64_t g_ld,
                                int64_t r0, int64_t j0, cudaStream_t stream) {
  Dlogits<T, kRound, kForm> e{args, static_cast<T*>(g), g_ld, r0, j0};
  e.tma = e.kStaged && reinterpret_cast<uintptr_t>(g) % 16 == 0 && g_ld % 8 == 0;
  if (e.tma) {
    if (auto err = map_16bit(g, g_dtype, grid.row_end - r0, grid.v - j0, g_ld, kStagedBox, kStagedBox,
                             CU_TENSOR_MAP_L2_PROMOTION_NONE, &e.g_map);
        !err.empty())
      return "G's TMA map: " + err;
  }
  return launch_for(x, w, grid, e, stream);
}

template <typename T, int kRound>
std::string launch_dlogits(const LossArgs& args, const Tensor& x, const Tensor& w,
                           const Grid& grid, void* g, Dtype g_dtype, int64_t g_ld, int64_t r0,
                           int64_t j0, cudaStream_t stream) {
  switch (dlogits_form(args)) {
    case kPlain:
      return launch_dlogits_form<T, kRound, kPlain>(args, x, w, grid, g, g_dtype, g_ld, r0, j0,
                                                    stream);
    case kPlainSoftcap:
      return launch_dlogits_form<T, kRound, kPlainSoftcap>(args, x, w, grid, g, g_dtype, g_ld, r0,
                                                           j0, stream);
    default:
      return launch_dlogits_form<T, kRound, kGeneral>(args, x, w, grid, g, g_dtype, g_ld, r0, j0,
                                                      stream);
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

int sm_count(const Problem& p) {
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, p.x.device_index) !=
          cudaSuccess ||
      sms <= 0) {
    cudaGetLastError();
    return kAssumedSms;
  }
  return sms;
}

std::string gemm_states(const LossArgs& args, const Tensor& x, const Tensor& w, int64_t r0,
                        int64_t rows, int64_t t0, int64_t t1, int64_t tile_cols, int64_t tiles,
                        int64_t state_r0, TileState* states, const StashOut& stash,
                        cudaStream_t stream) {
  const Grid grid{r0, r0 + rows, t0 * tile_cols, tile_cols, std::min(args.v, t1 * tile_cols),
                  k_tiles(x)};
  const int flags = (args.need_sbar ? 8 : 0) | (args.e > 0 ? 4 : 0) | (args.k > 0 ? 2 : 0) |
                    (args.argmax.present() ? 1 : 0);
  switch (flags / 4) {  // score_states_<group>.cu
#define FLCE_STATES_GROUP(G)                                                                 \
  case G:                                                                                    \
    return launch_states_group<G>(flags, args, x, w, grid, states, state_r0, tiles, t0, stash, \
                                  stream);
    FLCE_STATES_GROUP(0) FLCE_STATES_GROUP(1) FLCE_STATES_GROUP(2) FLCE_STATES_GROUP(3)
#undef FLCE_STATES_GROUP
  }
  return "";
}

std::string gemm_dlogits(const LossArgs& args, const Tensor& x, const Tensor& w, int64_t r0,
                         int64_t rows, int64_t j0, int64_t cols, void* g, Dtype g_dtype,
                         int64_t g_ld, Dtype round_to, cudaStream_t stream) {
  const Grid grid{r0, r0 + rows, j0, kDlogitsChunk, j0 + cols, k_tiles(x)};
  if (g_dtype == Dtype::bf16)
    return launch_dlogits<__nv_bfloat16, kBf16>(args, x, w, grid, g, g_dtype, g_ld, r0, j0, stream);
  if (g_dtype == Dtype::f16)
    return launch_dlogits<__half, kF16>(args, x, w, grid, g, g_dtype, g_ld, r0, j0, stream);
  if (round_to == Dtype::bf16)
    return launch_dlogits<float, kBf16>(args, x, w, grid, g, g_dtype, g_ld, r0, j0, stream);
  if (round_to == Dtype::f16)
    return launch_dlogits<float, kF16>(args, x, w, grid, g, g_dtype, g_ld, r0, j0, stream);
  return launch_dlogits<float, kF32>(args, x, w, grid, g, g_dtype, g_ld, r0, j0, stream);
}

std::string gemm_f32(const Tensor& x, const Tensor& w, float* c, int64_t ldc, cudaStream_t stream) {
  const Grid grid{0, x.shape[0], 0, 2048, w.shape[0], k_tiles(x)};
  return launch_for(x, w, grid, StoreF32{c, ldc}, stream);
}

}  // namespace flce::cuda::sm90
