// f32_gemm_tn__avx512: C[m, n] (+)= A^T B for a short k, the cpu backend's
// grad_W update (grad_W_tile [T, H] += G_tile^T [T, R] X_block [R, H], or
// for W stored [H, V] grad_W_tile^T [H, T] += X_block^T G_tile; k = R rows
// of the block). See isa_kernels.h for the contract.
//
// Why not the GEMM library: with k = 48..256 each element of C takes only
// k FMAs between its load and its store, and oneDNN ran these at half its
// large-GEMM rate (k = 48: 190-196 of about 376 GFLOP/s on the 2-core Zen 5,
// bench/gemm_engines.cpp).
//   micro-tile   6 rows of C x 64 columns (4 vectors): 24 accumulators held
//                in registers for all of k, C loaded and stored once; per k,
//                4 vector loads of B and 6 broadcasts of A for 24 FMAs.
//   packing      A's columns and B's rows lie a row of G or X apart (V or H
//                floats, often a power of two: every one in the same L1
//                set), so each 6-column strip of A and each 64-column panel
//                of B is first copied to a contiguous [k, 6] or [k, 64]
//                block, zero-padded at the edges.
//   blocking     k in pieces of kPackDepth and rows of C in pieces of
//                kPackRows, each piece's A strips packed once; panels of
//                kPanelCols columns of C: the packed B panel
//                ([k, kPanelCols], 256 KiB) stays in L2 while every strip
//                of the piece passes over it, and each micro-tile's
//                [k, 64] part of it (32 KiB) stays in L1 (48 KiB on Zen 5).
// Each element is C (or 0) + a_0 b_0 + a_1 b_1 + ... in order of k, as fused
// multiply-adds, so a result does not depend on how the caller splits m or n.
#include <immintrin.h>

#include <cstdint>

#include "simd/common.h"
#include "simd/isa_kernels.h"

namespace flce::simd {
namespace {

constexpr int kMR = 6;               // rows of C per micro-tile
constexpr int kNR = 64;              // columns of C per micro-tile
constexpr int64_t kPanelCols = 512;  // columns of C per B panel
// Rows of C per packing of A, and k per packing of A and B: the rows of a
// [512, H] grad_W tile go in one piece, k (a row block's rows, or the
// vocabulary-outer order's thousands) and the [H, V] layout's m = H in
// several, so the caller's scratch stays at 128 (516 + 512) floats, 514 KiB,
// whatever m and k (kGemmTnScratchFloats). k pieces of 256 put the
// micro-tile's B part (64 KiB) out of L1: GFLOP/s at 2 threads, [512, H]
// tiles (bench/gemm_engines.cpp --engines gemm_tn --kinds grad_W), 256 ->
// 128: H = 128, k = 384: 271 -> 308; k = 256: 278 -> 304; H = 768, k = 384:
// 365 -> 373 (64 and 96 measured within 1-3% of 128, 160 below it).
constexpr int64_t kPackRows = 86 * kMR;
constexpr int64_t kPackDepth = 128;
static_assert(kPackRows * kPackDepth + kPackDepth * kPanelCols <= kGemmTnScratchFloats,
              "the caller's scratch holds both packed pieces");
static_assert(kPackRows * kPackDepth % 16 == 0, "B's packed panel starts 64-byte aligned");

// 6 x 64 of C += Ap^T Bp: Ap is [k, 6], Bp is [k, 64], both packed. C rows
// are ldc apart; with !accumulate C is written, not read.
void micro_tile(int64_t k, const float* ap, const float* bp, float* c, int64_t ldc, bool accumulate,
                const float* c_next) {
  // The next micro-tile's C, 24 lines, is fetched while this one computes.
  if (accumulate && c_next)
    for (int i = 0; i < kMR; ++i)
      for (int j = 0; j < kNR; j += 16) _mm_prefetch(reinterpret_cast<const char*>(c_next + i * ldc + j), _MM_HINT_T0);
#define FLCE_ROW(i) __m512 c##i##0, c##i##1, c##i##2, c##i##3;
  FLCE_ROW(0) FLCE_ROW(1) FLCE_ROW(2) FLCE_ROW(3) FLCE_ROW(4) FLCE_ROW(5)
#undef FLCE_ROW
#define FLCE_INIT(i)                                                                 \
  c##i##0 = accumulate ? _mm512_loadu_ps(c + i * ldc) : _mm512_setzero_ps();       \
  c##i##1 = accumulate ? _mm512_loadu_ps(c + i * ldc + 16) : _mm512_setzero_ps();  \
  c##i##2 = accumulate ? _mm512_loadu_ps(c + i * ldc + 32) : _mm512_setzero_ps();  \
  c##i##3 = accumulate ? _mm512_loadu_ps(c + i * ldc + 48) : _mm512_setzero_ps();
  FLCE_INIT(0) FLCE_INIT(1) FLCE_INIT(2) FLCE_INIT(3) FLCE_INIT(4) FLCE_INIT(5)
#undef FLCE_INIT
  for (int64_t p = 0; p < k; ++p, ap += kMR, bp += kNR) {
    const __m512 b0 = _mm512_load_ps(bp), b1 = _mm512_load_ps(bp + 16);
    const __m512 b2 = _mm512_load_ps(bp + 32), b3 = _mm512_load_ps(bp + 48);
#define FLCE_FMA(i)                                 \
  {                                                 \
    const __m512 a = _mm512_set1_ps(ap[i]);         \
    c##i##0 = _mm512_fmadd_ps(a, b0, c##i##0);      \
    c##i##1 = _mm512_fmadd_ps(a, b1, c##i##1);      \
    c##i##2 = _mm512_fmadd_ps(a, b2, c##i##2);      \
    c##i##3 = _mm512_fmadd_ps(a, b3, c##i##3);      \
  }
    FLCE_FMA(0) FLCE_FMA(1) FLCE_FMA(2) FLCE_FMA(3) FLCE_FMA(4) FLCE_FMA(5)
#undef FLCE_FMA
  }
#define FLCE_STORE(i)                          \
  _mm512_storeu_ps(c + i * ldc, c##i##0);      \
  _mm512_storeu_ps(c + i * ldc + 16, c##i##1); \
  _mm512_storeu_ps(c + i * ldc + 32, c##i##2); \
  _mm512_storeu_ps(c + i * ldc + 48, c##i##3);
  FLCE_STORE(0) FLCE_STORE(1) FLCE_STORE(2) FLCE_STORE(3) FLCE_STORE(4) FLCE_STORE(5)
#undef FLCE_STORE
}

// An edge micro-tile (rows < 6 or cols < 64): through a full 6 x 64 copy.
void edge_tile(int64_t k, const float* ap, const float* bp, float* c, int64_t ldc, bool accumulate,
               int rows, int64_t cols) {
  alignas(64) float tile[kMR * kNR] = {};
  for (int i = 0; i < rows && accumulate; ++i) detail::copy_elements(c + i * ldc, cols, tile + i * kNR);
  micro_tile(k, ap, bp, tile, kNR, true, nullptr);
  for (int i = 0; i < rows; ++i) detail::copy_elements(tile + i * kNR, cols, c + i * ldc);
}

// Bp = B[0..k, j0 .. j0+cols) as ceil(cols / 64) blocks of [k, 64], zero-padded.
void pack_b(int64_t k, const float* b, int64_t ldb, int64_t cols, float* bp) {
  for (int64_t jb = 0; jb < cols; jb += kNR) {
    const int64_t w = detail::min_i64(kNR, cols - jb);
    for (int64_t p = 0; p < k; ++p, bp += kNR) {
      detail::copy_elements(b + p * ldb + jb, w, bp);
      detail::fill_elements(bp + w, bp + kNR, 0.0f);
    }
  }
}

// Ap = A[0..k, 0..m)^T as ceil(m / 6) strips of [k, 6], zero-padded: each
// row of A (contiguous) is read once.
void pack_a(int64_t k, int64_t m, const float* a, int64_t lda, float* ap) {
  const int64_t strips = (m + kMR - 1) / kMR;
  for (int64_t p = 0; p < k; ++p) {
    for (int64_t s = 0; s < strips; ++s) {
      float* dst = ap + (s * k + p) * kMR;
      const int64_t w = detail::min_i64(kMR, m - s * kMR);
      detail::copy_elements(a + p * lda + s * kMR, w, dst);
      detail::fill_elements(dst + w, dst + kMR, 0.0f);
    }
  }
}

// Rows [0, m) of C, m <= kPackRows: A's strips packed once, then B's panels.
void gemm_tn_rows(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                  int64_t ldb, float* c, int64_t ldc, bool accumulate, float* ap, float* bp) {
  const int64_t strips = (m + kMR - 1) / kMR;
  pack_a(k, m, a, lda, ap);
  for (int64_t n0 = 0; n0 < n; n0 += kPanelCols) {
    const int64_t panel = detail::min_i64(kPanelCols, n - n0);
    pack_b(k, b + n0, ldb, panel, bp);
    for (int64_t s = 0; s < strips; ++s) {
      const int rows = int(detail::min_i64(kMR, m - s * kMR));
      for (int64_t jb = 0; jb < panel; jb += kNR) {
        const int64_t cols = detail::min_i64(kNR, panel - jb);
        float* ct = c + s * kMR * ldc + n0 + jb;
        const float* bt = bp + jb * k;
        const bool last_col = jb + kNR >= panel;
        const float* next = last_col ? (s + 1 < strips ? c + (s + 1) * kMR * ldc + n0 : nullptr) : ct + kNR;
        if (rows == kMR && cols == kNR)
          micro_tile(k, ap + s * k * kMR, bt, ct, ldc, accumulate, next);
        else
          edge_tile(k, ap + s * k * kMR, bt, ct, ldc, accumulate, rows, cols);
      }
    }
  }
}

}  // namespace

void f32_gemm_tn__avx512(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                         const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate,
                         float* scratch) {
  float* ap = scratch;                           // [kPackRows / 6 strips, kPackDepth, 6]
  float* bp = scratch + kPackRows * kPackDepth;  // [kPackDepth, kPanelCols] in 64-column blocks
  // Pieces of k in order, C stored and reloaded in f32 between them: the
  // same bits as one pass. k = 0 still makes one pass (C = 0 or kept).
  int64_t k0 = 0;
  do {
    const int64_t kc = detail::min_i64(kPackDepth, k - k0);
    for (int64_t i0 = 0; i0 < m; i0 += kPackRows)
      gemm_tn_rows(detail::min_i64(kPackRows, m - i0), n, kc, a + k0 * lda + i0, lda, b + k0 * ldb, ldb,
                   c + i0 * ldc, ldc, accumulate || k0 > 0, ap, bp);
    k0 += kPackDepth;
  } while (k0 < k);
}

}  // namespace flce::simd
