// src/cuda/sm90/epilogues.cuh: what gemm_rows_kernel's consumer threads do
// with their accumulators (internal): StoreF32 (the plain product), States
// (pass 1's softmax states and stash) and Dlogits (pass 2's G). Each has a
// Thread built once per consumer thread, whose subtile() takes each
// accumulator block and end() runs after the last.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "cuda/softmax_state.cuh"
#include "cuda/sm90/gemm_rows.cuh"
#include "cuda/sm90/score_gemms.h"
#include "cuda/sm90/staged_store.cuh"

namespace flce::cuda::sm90 {

// A consumer thread holds rows row_a = 16 warp + lane/4 and row_a + 8 of its
// warpgroup's 64, columns 8 j + 2 (lane % 4) + {0, 1} for j < 32 (wgmma.cuh).

inline __device__ int column_of(int r, int quad) { return 8 * (r / 4) + 2 * quad + (r & 1); }

// Two adjacent values of G as the bits of one 16-bit pair (rounded to
// nearest even), for one 4-byte store.
inline __device__ uint32_t pair_bits(const __nv_bfloat16*, float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}
inline __device__ uint32_t pair_bits(const __half*, float a, float b) {
  const __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// A thread's row of 32 packed 16-bit pairs to p[8 j + 2 quad] (4-byte
// aligned), after all are packed: packing each into one temporary right
// before its store made every pack wait until the previous store had read it.
template <typename T16>
inline __device__ void store_packed_pairs(T16* p, int quad, const uint32_t (&packed)[32]) {
  static_assert(sizeof(T16) == 2, "pairs of 16-bit values");
#pragma unroll
  for (int j = 0; j < 32; ++j) *reinterpret_cast<uint32_t*>(p + 8 * j + 2 * quad) = packed[j];
}

// s = k tanh(z / k), or with kTanh t = tanh(z / k) (pass 2's G needs no s:
// Dlogits), in place over a consumer warp's subtile: the polynomial
// (softcap_small.h) when every |z| of the warp is within its range (one vote,
// so the warp takes one path; a NaN z passes as NaN), else tanhf.
template <bool kTanh>
inline __device__ void softcap_subtile(float (&d)[128], const TileParams& q) {
  float m = 0.0f;
#pragma unroll
  for (int r = 0; r < 128; ++r) m = fmaxf(m, fabsf(d[r]));
  if (__all_sync(0xffffffffu, m <= q.poly.limit)) {
#pragma unroll
    for (int r = 0; r < 128; ++r)
      d[r] = kTanh ? tanh_small(d[r], q.poly) : softcap_small(d[r], q.poly);
  } else {
#pragma unroll
    for (int r = 0; r < 128; ++r) {
      const float t = tanhf(d[r] * q.poly.inv_k);
      d[r] = kTanh ? t : q.k * t;
    }
  }
}

// The plain product (gemm_f32).
struct StoreF32 {
  static constexpr uint32_t kStagingBytes = 0;
  float* c;
  int64_t ldc;

  struct Thread {
    float* c;
    int64_t ldc, row_a, row_end;
    int quad;
    __device__ Thread(const StoreF32& e, const Grid& g, int64_t row_a, int64_t, int64_t, uint8_t*)
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

// Under a softcap every s lies in [-k, k], so pass 1 may shift every exponent
// by k itself instead of a running max: no group max or rescale per subtile.
// e^(s - k) >= e^-2k stays normal for k <= kFixedShiftMaxK (2 k log2(e) <=
// 115.4 < 126), and the exponents' rounding grows by at most 2 u k, which
// the tolerance policy counts (tests/support/tolerance.h, section 2). An
// argmax needs the true max, so it keeps the running one; so do the
// entropy's sums of e^d d, whose d = s - k could be 2k where s - max is
// near 0, beyond the differences to the max the policy bounds.
constexpr float kFixedShiftMaxK = 40.0f;

// Softmax states (gemm_states). The flags compile out what a call does not
// need, as tile_states_kernel's do.
// With kStash and `stash_tma` set, the codes go out through shared memory
// and the TMA (staged_store.cuh) by stash_map: [blocks, rows, block_cols]
// over stash.codes, which needs whole blocks and whole 256-class subtiles.
template <bool kSbar, bool kSumCs, bool kSoftcap, bool kRaw, bool kArgmax, bool kStash>
struct States {
  static constexpr uint32_t kStagingBytes = kStash ? kStagingBytesPerConsumer : 0;
  LossArgs g;
  TileState* states;
  int64_t state_r0, tiles, t0;
  StashOut stash;
  bool stash_tma = false;
  CUtensorMap stash_map;  // 64-byte aligned, in the kernel's parameters

  // One row's running state over the chunk (columns relative to its start).
  struct Row {
    float max = -kInf, sum_exp = 0, sum_exp_d = 0, sum_cs = 0;
    int arg_c = -1, nan_c = -1;
    int64_t i = 0, y = -1;
  };

  struct Thread {
    const TileParams q;  // at class 0
    RowInfo* info;
    TileState* states;
    StashOut stash;
    int64_t state_r0, tiles, t, c_begin, row_end;
    int quad;
    bool stash_tma;
    bool fixed_shift;  // every row's max is k (kFixedShiftMaxK)
    const CUtensorMap* stash_map;
    uint8_t* staging;
    Row rows[2];

    __device__ Thread(const States& e, const Grid& grid, int64_t row_a, int64_t c_begin,
                      int64_t chunk, uint8_t* staging)
        : q(e.g, 0), info(e.g.rows), states(e.states), stash(e.stash), state_r0(e.state_r0),
          tiles(e.tiles), t(e.t0 + chunk), c_begin(c_begin), row_end(grid.row_end),
          quad(threadIdx.x % 4), stash_tma(kStash && e.stash_tma),
          fixed_shift(kSoftcap && !kArgmax && !kSbar && q.k <= kFixedShiftMaxK),
          stash_map(&e.stash_map),
          staging(staging) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t i = row_a + 8 * h;
        if (fixed_shift) rows[h].max = q.k;
        rows[h].i = i;
        if (i < row_end) rows[h].y = load_int(e.g.labels, i);
      }
    }

    // Scores in place of the raw logits; classes past the chunk are -inf.
    __device__ void subtile(float (&d)[128], int64_t n0, int limit) {
      if (!kRaw) {
#pragma unroll
        for (int r = 0; r < 128; ++r) d[r] = q.z(d[r], int(n0) + column_of(r, quad));
      }
      if (kSoftcap) softcap_subtile<false>(d, q);
      if (limit < kCols) {
#pragma unroll
        for (int r = 0; r < 128; ++r)
          if (column_of(r, quad) >= limit) d[r] = -kInf;
      }
      // Each row's max over this thread's 64 scores: the fold's group max,
      // and the stash's ref once the row's four threads have merged theirs.
      float maxima[2] = {-kInf, -kInf};
      if (kStash || !fixed_shift) thread_maxima(d, maxima);
      if (kStash) stash_subtile(d, n0, limit, maxima);
      fold(rows[0], d, 0, n0, limit, fixed_shift ? -kInf : maxima[0]);
      fold(rows[1], d, 1, n0, limit, fixed_shift ? -kInf : maxima[1]);
    }

    static __device__ void thread_maxima(const float (&d)[128], float (&maxima)[2]) {
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int j = 0; j < 32; ++j)
          maxima[h] = fmaxf(maxima[h], fmaxf(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]));
    }

    // The subtile's codes f16(ref - s), ref = shift_of(the row's max over
    // the subtile), as tile_states writes a tile's (kernels.h, Stash).
    __device__ void stash_subtile(const float (&d)[128], int64_t n0, int limit,
                                  const float (&maxima)[2]) {
      const int64_t b = n0 / stash.block_cols, block_j0 = b * stash.block_cols;
      const int64_t block_cols = cuda::stash_width(stash.end, stash.block_cols, block_j0);
      float refs[2];
      bool finite_maxima = true;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float m = maxima[h];
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));  // the row's four threads
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        refs[h] = shift_of(m);
        finite_maxima = finite_maxima && isfinite(m);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (quad == 0 && rows[h].i < row_end)
          stash.refs[rows[h].i * stash.refs_ld + t * stash.refs_per_tile +
                     (n0 - c_begin) / kCols] = refs[h];
      // Row h's codes of columns 8 j + 2 quad, +1 as one 4-byte pair.
      const auto code_pair = [&](int j, int h) {
        return uint32_t(stash_code(refs[h], d[4 * j + 2 * h])) |
               uint32_t(stash_code(refs[h], d[4 * j + 2 * h + 1])) << 16;
      };
      if (stash_tma) {
        const int col = int(n0 - block_j0), row = int(staged_first_row(rows[0].i));
        const int block = int(b - stash.first_block);
        // Where every row's max is finite (one vote), the refs are those
        // maxima and a pair's codes take one instruction (softmax_state.cuh).
        if (__all_sync(0xffffffffu, finite_maxima)) {
          store_subtile_staged<3>(staging, stash_map, col, row, block, [&](int j, int h) {
            return stash_code_pair_below_max(refs[h], d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
          });
        } else {
          store_subtile_staged<3>(staging, stash_map, col, row, block, code_pair);
        }
        return;
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t i = rows[h].i;
        if (i >= row_end) continue;
        uint16_t* codes = stash.codes + (b - stash.first_block) * stash.n * stash.block_cols +
                          i * block_cols + (n0 - block_j0);
        const bool pairs = limit >= kCols && reinterpret_cast<uintptr_t>(codes) % 4 == 0;
        if (pairs) {
          uint32_t packed[32];
#pragma unroll
          for (int j = 0; j < 32; ++j) packed[j] = code_pair(j, h);
          store_packed_pairs(codes, quad, packed);
        } else {
#pragma unroll
          for (int j = 0; j < 32; ++j) {
            const int col = 8 * j + 2 * quad;
            if (col < limit) codes[col] = stash_code(refs[h], d[4 * j + 2 * h]);
            if (col + 1 < limit) codes[col + 1] = stash_code(refs[h], d[4 * j + 2 * h + 1]);
          }
        }
      }
    }

    // Folds row h's 64 scores of this subtile, whose max is group_max (-inf
    // with the fixed shift): at most one rescale, then the sums in column
    // order.
    __device__ void fold(Row& row, const float (&d)[128], int h, int64_t n0, int limit,
                         float group_max) {
      if (group_max > row.max) {
        const float delta = shift_of(row.max) - shift_of(group_max);
        const float f = row.max == -kInf ? 0.0f : exp_of(delta);
        if (kSbar) row.sum_exp_d = moved_sum_exp_d(row.sum_exp_d, row.sum_exp, f, delta);
        row.sum_exp *= f;
        row.max = group_max;
        row.arg_c = -1;
      }
      const float shift = shift_of(row.max);
      const ExpOffset offset = exp_offset(shift);
#pragma unroll
      for (int r = 2 * h; r < 128; r += 4) {
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const float s = d[r + k];
          const float e_s = exp_at(s, offset);
          row.sum_exp += e_s;
          if (kSbar) row.sum_exp_d += e_s == 0 ? 0.0f : e_s * (s - shift);
          if (kSumCs) {
            const int col = column_of(r + k, quad);
            if (col < limit) {
              const float cw = q.class_weight(int(n0) + col);
              row.sum_cs += cw * s;  // 0 * inf is NaN, as c_j logp_j
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
        st.max = row.max, st.sum_exp = row.sum_exp, st.sum_exp_d = row.sum_exp_d;
        st.sum_cs = row.sum_cs;
        st.argmax = row.arg_c < 0 ? -1 : c_begin + row.arg_c;
        st.first_nan = row.nan_c < 0 ? -1 : c_begin + row.nan_c;
        st = warp_merge(st, 4);
        if (quad == 0 && row.i < row_end)
          states[(row.i - state_r0) * tiles + t] =
              TileState{st.max, st.sum_exp, st.sum_exp_d, st.sum_cs, st.argmax, st.first_nan};
      }
      if (stash_tma) finish_staged_stores();
    }
  };
};

// G (gemm_dlogits): each thread's two rows' G, per DlogitsRow (the formula
// of kernels.cu's dlogits), stored as T at out[(i - r0) * ld + j - j0]:
// 16-bit G with `tma` set through shared memory and the TMA
// (staged_store.cuh), else adjacent column pairs in one store where aligned.
template <typename T, int kRound, DlogitsForm kForm>
struct Dlogits {
  static constexpr bool kStaged = sizeof(T) == 2;
  static constexpr uint32_t kStagingBytes = kStaged ? kStagingBytesPerConsumer : 0;
  LossArgs g;
  T* out;
  int64_t ld, r0, j0;
  bool tma = false;   // g_map describes out: [rows, cols], staged boxes, 128-byte swizzle
  CUtensorMap g_map;  // 64-byte aligned, in the kernel's parameters

  struct Thread {
    using Row = DlogitsRow<kRound, kForm>;
    Row rows[2];
    T* out;
    int64_t ld, r0, j0, row_a, row_end;
    int quad;
    bool tma;
    const CUtensorMap* map;
    uint8_t* staging;

    static __device__ RowInfo info_of(const LossArgs& g, int64_t i, int64_t row_end) {
      return i < row_end ? g.rows[i] : RowInfo{};
    }
    __device__ Thread(const Dlogits& e, const Grid& grid, int64_t row_a, int64_t, int64_t,
                      uint8_t* staging)
        : rows{Row(e.g, info_of(e.g, row_a, grid.row_end), 0, int(e.g.v)),
               Row(e.g, info_of(e.g, row_a + 8, grid.row_end), 0, int(e.g.v))},
          out(e.out), ld(e.ld), r0(e.r0), j0(e.j0), row_a(row_a), row_end(grid.row_end),
          quad(threadIdx.x % 4), tma(kStaged && e.tma), map(&e.g_map), staging(staging) {}

    __device__ void subtile(float (&d)[128], int64_t n0, int limit) {
      // The scores in place (Row::score's formula, a warp's subtile at once).
      const TileParams& q = rows[0].q;
      if (kForm == kGeneral) {
#pragma unroll
        for (int r = 0; r < 128; ++r) d[r] = q.z(d[r], int(n0) + column_of(r, quad));
      }
      // kPlainSoftcap: t = tanh(z / k) rather than s (DlogitsRow::unrounded_from_t).
      if (kForm == kPlainSoftcap) softcap_subtile<true>(d, q);
      if (kForm == kGeneral && q.k > 0) softcap_subtile<false>(d, q);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t i = row_a + 8 * h;
        if (i >= row_end) continue;
        const Row& row = rows[h];
        // The label's column, when this thread holds it (its s, or t): once per row, so
        // the branch is rarely taken and the loop below has no label test.
        const int y = row.y_col < 0 ? -1 : int(row.y_col - n0);  // Row's classes start at 0
        const bool label_here = y >= 0 && y < kCols && (y & 7) >> 1 == quad;
        float s_label = 0;
        if (label_here) {
#pragma unroll
          for (int r = 2 * h; r < 128; r += 4)
#pragma unroll
            for (int k = 0; k < 2; ++k)
              if (column_of(r + k, quad) == y) s_label = d[r + k];
        }
#pragma unroll
        for (int r = 2 * h; r < 128; r += 4)
#pragma unroll
          for (int k = 0; k < 2; ++k)
            d[r + k] = rounded(unrounded(row, d[r + k], int(n0) + column_of(r + k, quad), false));
        if (label_here) {
          const float g_label = rounded(unrounded(row, s_label, int(n0) + y, true));
#pragma unroll
          for (int r = 2 * h; r < 128; r += 4)
#pragma unroll
            for (int k = 0; k < 2; ++k)
              if (column_of(r + k, quad) == y) d[r + k] = g_label;
        }
        if (!tma) store_row(d, h, out + (i - r0) * ld + (n0 - j0), limit);
      }
      if (tma) store_staged(d, n0);
    }

    // The consumer's [64 x 256] subtile of G (rows past row_end hold
    // garbage; the TMA stores only g_map's [rows, cols]).
    __device__ void store_staged(const float (&d)[128], int64_t n0) {
      if constexpr (kStaged) {
        store_subtile_staged<2>(staging, map, int(n0 - j0), int(staged_first_row(row_a) - r0), 0,
                                [&](int j, int h) {
                                  return pair_bits(out, d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
                                });
      }
    }

    // G of the value subtile() left in place: s, or t for kPlainSoftcap.
    static __device__ float unrounded(const Row& row, float v, int c, bool at_label) {
      if (kForm == kPlainSoftcap) return row.unrounded_from_t(v, at_label);
      return row.unrounded(v, c, at_label);
    }

    // G rounded to kRound, unless the store to T rounds it the same way.
    static constexpr bool kStoreRounds =
        (Dtype(kRound) == Dtype::bf16 && std::is_same_v<T, __nv_bfloat16>) ||
        (Dtype(kRound) == Dtype::f16 && std::is_same_v<T, __half>);
    static __device__ float rounded(float g) { return kStoreRounds ? g : round_as<kRound>(g); }

    // Row h's 64 values of G to row_out (class n0 of the row), adjacent
    // pairs in one store where aligned (16-bit ones: store_packed_pairs).
    __device__ void store_row(const float (&d)[128], int h, T* row_out, int limit) {
      const bool pairs =
          limit >= kCols && reinterpret_cast<uintptr_t>(row_out) % (2 * sizeof(T)) == 0;
      if (pairs) {
        if constexpr (sizeof(T) == 4) {
#pragma unroll
          for (int j = 0; j < 32; ++j)
            *reinterpret_cast<float2*>(row_out + 8 * j + 2 * quad) =
                make_float2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
        } else {
          uint32_t packed[32];
#pragma unroll
          for (int j = 0; j < 32; ++j)
            packed[j] = pair_bits(row_out, d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
          store_packed_pairs(row_out, quad, packed);
        }
      } else {
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          const int col = 8 * j + 2 * quad;
          if (col < limit) row_out[col] = T(d[4 * j + 2 * h]);
          if (col + 1 < limit) row_out[col + 1] = T(d[4 * j + 2 * h + 1]);
        }
      }
    }
    __device__ void end() {
      if (tma) finish_staged_stores();
    }
  };
};

}  // namespace flce::cuda::sm90
