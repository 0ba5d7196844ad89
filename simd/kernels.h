// simd/kernels.h: the vector kernels of the cpu backend, one set per ISA.
//
// The cpu backend computes a [rows x vocab tile] block of raw logits
// u = x . W_j with a GEMM, then runs three kernels over each row's piece of
// the tile while it is in cache:
//   scores          s_j = softcap(a * (u_j + b_j))            (in place)
//   online_softmax  folds s_0..s_{n-1} into the row's running state
//   dlogits         g_j = d objective / d u_j from s_j and the row's lse
// plus exp, used by both and tested on its own, and (where an ISA has one)
// gemm_tn (and gemm_tn_bf16), the grad_W product G^T X of a tile, whose k
// is short, and pack_scores / unpack_scores, the 16-bit store of the scores
// between a training step's two passes. The
// README's "Semantics" defines every quantity; names follow XNNPACK's habit:
// f32_<job>__<isa>, one file per ISA under simd/<isa>/.
//
// Every kernel handles any n >= 1 and any alignment (tails included), reads
// and writes f32, and accumulates in f32 within the call. The caller merges
// per-tile states in a fixed order (in double), so results do not depend on
// the thread count.
#pragma once

#include <cstdint>

namespace flce::simd {

// Running state of one row over the tiles seen so far; the exponential sums
// are relative to shift = max where finite, else 0 (common.h, shift_of): with
// d_j = s_j - shift, sum_exp = sum_j exp(d_j). sum_exp_d takes the scores as
// d_j too, as the oracle does: the entropy lse - sum_j p_j s_j is then formed
// from differences to the max, never from two large numbers whose rounding
// cancels (logits near 1e4 lost 3 of float32's digits that way). A fresh
// state has max = -inf and zero sums.
struct SoftmaxState {
  float max;            // max_j s_j over non-NaN s (-inf if none yet)
  float sum_exp;        // sum_j exp(d_j)
  float sum_exp_d;      // sum_j exp(d_j) * d_j   (for the entropy)
  float sum_cs;         // sum_j c_j * s_j        (for label smoothing)
  int64_t argmax;       // lowest index of max; -1 if none yet
  int64_t first_nan;    // lowest index of a NaN s_j; -1 if none
};

void softmax_state_init(SoftmaxState* state);

// What online_softmax computes besides max, sum_exp and first_nan. A tile
// called without kSoftmaxMoments adds 0 to sum_exp_d and sum_cs, one
// without kSoftmaxArgmax leaves argmax alone (the state's sums are still
// rescaled): the sums and the search cost a quarter of the kernel's time,
// and most calls need neither (no entropy, smoothing or argmax output).
enum SoftmaxExtras : unsigned {
  kSoftmaxMoments = 1,  // sum_exp_d and sum_cs
  kSoftmaxArgmax = 2,   // argmax
  kSoftmaxAll = 3,
};

// Per-row coefficients of the dlogits kernel (README, backward):
//   p_j = exp(s_j - lse)
//   d_j = coef_p * p_j + coef_c * c_j - coef_h * p_j * ((s_j - shift) - sbar_d)
//   g_j = a * (1 - (s_j/k)^2) * d_j   (k > 0)   or   a * d_j   (k == 0)
// The label term -(1-e) c_y t_i g_i at j = y is added by the caller. The
// caller folds the factor that turns exp(s_j - lse) with lse in float32
// into the row's p (src/common/row_terms.h, lse_parts' p_scale) into
// coef_p and coef_h.
struct DlogitsParams {
  float lse;
  float coef_p;   // (g_loss t_i ((1-e) c_y + (e/V) C + 2 l lse) + g_lse) p_scale
  float coef_c;   // -g_loss t_i e / V
  float coef_h;   // g_entropy p_scale
  // The entropy's s_j - sum_k p_k s_k, from differences to the row's max:
  // s_j - shift is exact near the max, so a common offset of the logits
  // costs it nothing (s_j - sbar in float32 lost u |s_j| to it).
  float shift;    // the row's max (where finite)
  float sbar_d;   // sum_k p_k (s_k - shift)
  float scale;    // a
  float softcap;  // k (0 = off)
};

// gemm_tn's packing scratch, whatever m, n and k: A's strips for 516 rows of
// C and B's panel of 512 columns, both 128 deep (f32_gemm_tn__avx512.cpp);
// gemm_tn_bf16's smaller pieces fit in it too (bf16_gemm_tn__avx512bf16.cpp).
constexpr int64_t kGemmTnScratchFloats = 128 * (516 + 512);

struct KernelSet {
  const char* isa;  // "scalar", "avx2", "avx512", "neon"
  int width;        // f32 lanes per vector
  // y[i] = exp(x[i]); x and y may be the same array.
  void (*exp)(const float* x, float* y, int64_t n);
  // s[i] = k * tanh(a * (s[i] + bias[i]) / k) if k > 0, else a * (s[i] + bias[i]);
  // bias may be null (treated as 0).
  void (*scores)(float* s, const float* bias, int64_t n, float scale, float softcap);
  // Folds s[0..n) (global column indices j0 .. j0+n-1) into *state;
  // class_w may be null (every c_j = 1); sum_cs is then sum_j s_j. extras:
  // SoftmaxExtras bits.
  void (*online_softmax)(const float* s, const float* class_w, int64_t n, int64_t j0,
                         unsigned extras, SoftmaxState* state);
  // g[i] from s[i] per DlogitsParams; g may equal s (in place); class_w may be null.
  void (*dlogits)(const float* s, const float* class_w, int64_t n, const DlogitsParams* params,
                  float* g);
  // C[m, n] = (accumulate ? C : 0) + A^T B, A stored [k, m] (row stride
  // lda), B [k, n] (ldb), C [m, n] (ldc): the grad_W update, whose k (the
  // rows of a block) is short. scratch: kGemmTnScratchFloats floats,
  // 64-byte aligned, the caller's (one per thread), for the packed A and B.
  // Null where the set has none: the GEMM engine does it then.
  void (*gemm_tn)(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                  int64_t ldb, float* c, int64_t ldc, bool accumulate, float* scratch);
  // The same product with A and B in bf16 (uint16_t bits) and C in f32, for
  // the grad_W update from bf16 G; same scratch. Null where the set or this
  // CPU has none (AVX-512 without AVX512-BF16): the GEMM engine does it then.
  void (*gemm_tn_bf16)(int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda,
                       const uint16_t* b, int64_t ldb, float* c, int64_t ldc, bool accumulate,
                       float* scratch);
  // The 16-bit store of a bf16 training step's scores (cpu::Plan::
  // packed_scores): d[i] = the f16 bits of ref - s[i] (nearest even; a
  // finite difference below -65504 raised to it, one of 65520 or more
  // turned to +inf, read back as -inf; an infinite or NaN one kept), and
  // back, s[i] = ref - d[i]. With ref a finite max over s (or 0, when no
  // finite max exists) that is s within u_f16 (ref - s[i]) plus the f32
  // roundings. Null where the set has none: the scores stay f32 then.
  void (*pack_scores)(const float* s, int64_t n, float ref, uint16_t* d);
  void (*unpack_scores)(const uint16_t* d, int64_t n, float ref, float* s);
};

// The sets compiled into this binary, best first, and the one chosen once
// from CPUID, capped by FLCE_MAX_ISA=scalar|avx2|avx512 (or |neon on arm).
const KernelSet& scalar_kernels();
const KernelSet* avx2_kernels();    // null when not compiled in or not supported by this CPU
const KernelSet* avx512_kernels();  // likewise
const KernelSet* neon_kernels();    // likewise
const KernelSet& best_kernels();

}  // namespace flce::simd
