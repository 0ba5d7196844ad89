// bf16_gemm_tn__avx512bf16: C[m, n] (+)= A^T B with A and B in bf16 and C in
// f32, for a short k: the cpu backend's grad_W update when G is bf16
// (grad_logits_dtype = storage): grad_W_tile [T, H] += G_tile^T [T, R]
// X_block [R, H], or grad_W_tile^T [H, T] += X_block^T G_tile for W stored
// [H, V]; k = R rows of the block. See isa_kernels.h for the contract.
//
// Why not the GEMM library: with k = 96 (the row block at V = 128256)
// oneDNN's bf16 GEMM ran this transposed-A product at 372-376 GFLOP/s
// against this kernel's 661-696 ([512, H] tiles, H = 1024 and 4096, 2
// threads on the 2-core Zen 5, bench/gemm_engines.cpp); inside the S2 bf16
// step, where the grad_W accumulator streams from memory, its thread time
// went from 4.76-4.81 s to 4.08-4.25 s. At k = 240-256 (S1, S3) the two
// measured level inside the step.
//
// vdpbf16ps adds to each f32 lane the products of one pair of bf16 values
// along k, so both packed operands hold k in pairs (rows 2p and 2p + 1
// side by side; an odd k's last row is paired with 0):
//   micro-tile   8 rows of C x 48 columns (3 vectors): 24 accumulators held
//                in registers for all of k, C loaded and stored once; per
//                pair of k, 3 vector loads of B and 8 broadcasts of A's pair
//                for 24 vdpbf16ps.
//   packing      A in strips of 8 columns, [k/2, 8, 2]; B in blocks of 48
//                columns, [k/2, 48, 2]; zero-padded at the edges. Packing
//                also takes A's columns and B's rows out of the power-of-two
//                strides they often have (V or H).
//   blocking     k in pieces of 2 kPackPairs, rows of C in pieces of
//                kPackRows whose A strips are packed once, panels of
//                kPanelCols columns of C: the packed B panel (240 KiB) stays
//                in L2 while every strip passes over it, each micro-tile's
//                part of it (24 KiB) in L1.
// Each element is C (or 0) plus, pair by pair in order of k, one vdpbf16ps
// step, so a result does not depend on how the caller splits m or n.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "simd/common.h"
#include "simd/isa_kernels.h"

namespace flce::simd {
namespace {

constexpr int kMR = 8;               // rows of C per micro-tile
constexpr int kNR = 48;              // columns of C per micro-tile
constexpr int64_t kPanelCols = 480;  // columns of C per B panel (10 micro-tiles)
// Rows of C per packing of A (a [512, H] grad_W tile in one piece), and
// pairs of k per packing of A and B (a 240-row block in one piece).
constexpr int64_t kPackRows = 64 * kMR;
constexpr int64_t kPackPairs = 128;
// Packed A strips lie an odd number of cache lines (2 pairs each) apart:
// at k = 256 strips 4 KiB apart ran 355 against 500 GFLOP/s at k = 254
// (H = 128, 2 threads, bench/gemm_engines.cpp).
inline int64_t strip_stride(int64_t kp) { return ((kp + 1) / 2 | 1) * 2 * 2 * kMR; }
constexpr int64_t kPackedAFloats = kPackRows / kMR * ((kPackPairs + 1) / 2 | 1) * 2 * kMR;
// In floats (4 bytes: one pair of bf16) of the caller's scratch.
static_assert(kPackedAFloats + kPackPairs * kPanelCols <= kGemmTnScratchFloats,
              "the caller's scratch holds both packed pieces");
static_assert(kPackedAFloats % 16 == 0, "B's packed panel starts 64-byte aligned");

inline __m512 dot_pairs(__m512 c, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(c, (__m512bh)a, (__m512bh)b);
}

// 8 x 16 NV of C += Ap^T Bp over kp pairs of k: Ap is [kp, 8, 2], Bp
// [kp, 48, 2] (its first NV vectors read), both packed. C rows are ldc
// apart; with !accumulate C is written, not read. NV < 3 serves a panel's
// last 16 or 32 columns (H = 128 = 2 x 48 + 32) without an edge copy.
template <int NV>
void micro_tile(int64_t kp, const uint16_t* ap, const uint16_t* bp, float* c, int64_t ldc,
                bool accumulate, const float* c_next) {
  // The next micro-tile's C (up to 24 lines) is fetched while this one computes.
  if (accumulate && c_next)
    for (int i = 0; i < kMR; ++i)
      for (int j = 0; j < kNR; j += 16) _mm_prefetch(reinterpret_cast<const char*>(c_next + i * ldc + j), _MM_HINT_T0);
  __m512 acc[kMR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < kMR; ++i)
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) acc[i][v] = accumulate ? _mm512_loadu_ps(c + i * ldc + 16 * v) : _mm512_setzero_ps();
  for (int64_t p = 0; p < kp; ++p, ap += 2 * kMR, bp += 2 * kNR) {
    __m512i b[NV];
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) b[v] = _mm512_load_si512(bp + 32 * v);
#pragma GCC unroll 8
    for (int i = 0; i < kMR; ++i) {
      int32_t pair;  // row i's two bf16 of this k pair, copied: no int32_t view of uint16_t
      __builtin_memcpy(&pair, ap + 2 * i, sizeof pair);
      const __m512i a = _mm512_set1_epi32(pair);
#pragma GCC unroll 3
      for (int v = 0; v < NV; ++v) acc[i][v] = dot_pairs(acc[i][v], a, b[v]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < kMR; ++i)
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + i * ldc + 16 * v, acc[i][v]);
}

// An edge micro-tile (rows < 8, or cols not a multiple of 16): through a
// full 8 x 48 copy.
void edge_tile(int64_t kp, const uint16_t* ap, const uint16_t* bp, float* c, int64_t ldc,
               bool accumulate, int rows, int64_t cols) {
  alignas(64) float tile[kMR * kNR] = {};
  for (int i = 0; i < rows && accumulate; ++i) detail::copy_elements(c + i * ldc, cols, tile + i * kNR);
  micro_tile<3>(kp, ap, bp, tile, kNR, true, nullptr);
  for (int i = 0; i < rows; ++i) detail::copy_elements(tile + i * kNR, cols, c + i * ldc);
}

// Up to 32 bf16 from row[0 .. w), zeros after (and for a missing row).
inline __m512i load_bf16(const uint16_t* row, int64_t w) {
  if (!row || w <= 0) return _mm512_setzero_si512();
  const __mmask32 mask = w >= 32 ? ~__mmask32(0) : (__mmask32(1) << w) - 1;
  return _mm512_maskz_loadu_epi16(mask, row);
}

// The pairs (r0[j], r1[j]) for j = 0..15 (lo) and 16..31 (hi), as 32-bit
// lanes: vpermt2w with these indices (32 + j selects r1[j]).
inline __m512i pairs_lo(__m512i r0, __m512i r1) {
  const __m512i idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                       39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  return _mm512_permutex2var_epi16(r0, idx, r1);
}
inline __m512i pairs_hi(__m512i r0, __m512i r1) {
  const __m512i idx = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24,
                                       55, 23, 54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
  return _mm512_permutex2var_epi16(r0, idx, r1);
}

// Bp = B[0..k, 0..cols) as ceil(cols / 48) blocks of [kp, 48, 2], zero-padded.
void pack_b(int64_t k, const uint16_t* b, int64_t ldb, int64_t cols, uint16_t* bp) {
  const int64_t kp = (k + 1) / 2;
  for (int64_t jb = 0; jb < cols; jb += kNR) {
    const int64_t w = detail::min_i64(kNR, cols - jb);
    for (int64_t p = 0; p < kp; ++p, bp += 2 * kNR) {
      const uint16_t* r0 = b + 2 * p * ldb + jb;
      const uint16_t* r1 = 2 * p + 1 < k ? r0 + ldb : nullptr;
      const __m512i a0 = load_bf16(r0, w), a1 = load_bf16(r1, w);
      const __m512i b0 = load_bf16(w > 32 ? r0 + 32 : nullptr, w - 32);
      const __m512i b1 = load_bf16(w > 32 && r1 ? r1 + 32 : nullptr, w - 32);
      _mm512_store_si512(bp, pairs_lo(a0, a1));
      _mm512_store_si512(bp + 32, pairs_hi(a0, a1));
      _mm512_store_si512(bp + 64, pairs_lo(b0, b1));
    }
  }
}

// Ap = A[0..k, 0..m)^T as ceil(m / 8) strips of [kp, 8, 2], zero-padded,
// strip_stride(kp) apart: each row of A (contiguous) is read once, 32
// columns (four strips) at a time.
void pack_a(int64_t k, int64_t m, const uint16_t* a, int64_t lda, uint16_t* ap) {
  const int64_t kp = (k + 1) / 2, strips = (m + kMR - 1) / kMR;
  for (int64_t p = 0; p < kp; ++p) {
    const uint16_t* r0 = a + 2 * p * lda;
    const uint16_t* r1 = 2 * p + 1 < k ? r0 + lda : nullptr;
    for (int64_t s = 0; s < strips; s += 4) {
      const int64_t w = m - s * kMR;
      const __m512i a0 = load_bf16(r0 + s * kMR, w), a1 = load_bf16(r1 ? r1 + s * kMR : nullptr, w);
      // Strips s .. s+3, 8 pairs (32 bytes) each.
      alignas(64) uint16_t pairs[4 * 2 * kMR];
      _mm512_store_si512(pairs, pairs_lo(a0, a1));
      _mm512_store_si512(pairs + 2 * 16, pairs_hi(a0, a1));
      uint16_t* dst = ap + s * strip_stride(kp) + p * 2 * kMR;
      for (int64_t q = 0; q < 4 && s + q < strips; ++q)
        std::memcpy(dst + q * strip_stride(kp), pairs + q * 2 * kMR, 2 * kMR * sizeof(uint16_t));
    }
  }
}

// Rows [0, m) of C, m <= kPackRows, over k <= 2 kPackPairs: A's strips
// packed once, then B's panels.
void gemm_tn_rows(int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda,
                  const uint16_t* b, int64_t ldb, float* c, int64_t ldc, bool accumulate,
                  uint16_t* ap, uint16_t* bp) {
  const int64_t kp = (k + 1) / 2, strips = (m + kMR - 1) / kMR;
  pack_a(k, m, a, lda, ap);
  for (int64_t n0 = 0; n0 < n; n0 += kPanelCols) {
    const int64_t panel = detail::min_i64(kPanelCols, n - n0);
    pack_b(k, b + n0, ldb, panel, bp);
    for (int64_t s = 0; s < strips; ++s) {
      const int rows = int(detail::min_i64(kMR, m - s * kMR));
      const uint16_t* as = ap + s * strip_stride(kp);
      for (int64_t jb = 0; jb < panel; jb += kNR) {
        const int64_t cols = detail::min_i64(kNR, panel - jb);
        float* ct = c + s * kMR * ldc + n0 + jb;
        const uint16_t* bt = bp + jb * 2 * kp;
        const bool last_col = jb + kNR >= panel;
        const float* next = last_col ? (s + 1 < strips ? c + (s + 1) * kMR * ldc + n0 : nullptr) : ct + kNR;
        if (rows == kMR && cols == kNR)
          micro_tile<3>(kp, as, bt, ct, ldc, accumulate, next);
        else if (rows == kMR && cols == 32)
          micro_tile<2>(kp, as, bt, ct, ldc, accumulate, next);
        else if (rows == kMR && cols == 16)
          micro_tile<1>(kp, as, bt, ct, ldc, accumulate, next);
        else
          edge_tile(kp, as, bt, ct, ldc, accumulate, rows, cols);
      }
    }
  }
}

}  // namespace

void bf16_gemm_tn__avx512bf16(int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda,
                              const uint16_t* b, int64_t ldb, float* c, int64_t ldc,
                              bool accumulate, float* scratch) {
  uint16_t* ap = reinterpret_cast<uint16_t*>(scratch);  // kPackRows / 8 strips, strip_stride apart
  uint16_t* bp = ap + 2 * kPackedAFloats;               // [kPackPairs, kPanelCols, 2] in 48-column blocks
  // Pieces of k (even lengths, so the pairs are the same) in order, C
  // stored and reloaded in f32 between them: the same bits as one pass.
  // k = 0 still makes one pass (C = 0 or kept).
  constexpr int64_t kDepth = 2 * kPackPairs;
  int64_t k0 = 0;
  do {
    const int64_t kc = detail::min_i64(kDepth, k - k0);
    for (int64_t i0 = 0; i0 < m; i0 += kPackRows)
      gemm_tn_rows(detail::min_i64(kPackRows, m - i0), n, kc, a + k0 * lda + i0, lda, b + k0 * ldb, ldb,
                   c + i0 * ldc, ldc, accumulate || k0 > 0, ap, bp);
    k0 += kDepth;
  } while (k0 < k);
}

}  // namespace flce::simd
