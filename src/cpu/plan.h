// How the cpu backend cuts a problem: tile sizes, GEMM operand dtypes and
// the workspace layout. The tile grid depends on the problem only, never on
// the thread count, so every result bit is the same for any thread count.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "cpu/gemm/gemm.h"
#include "flce/flce.h"
#include "simd/kernels.h"
#include "validate.h"

namespace flce::cpu {

// The scores of one row block across the whole vocabulary stay in memory, so
// a training step needs one logits GEMM per tile; this budget bounds them.
// The row block R is also the K of the grad_W GEMMs, whose f32 output tile
// is read and written once per row block: small R makes them memory-bound
// (S2, V = 128256: 2.4x three GEMMs at R = 32, 1.35x at R = 160). The rest
// of the workspace grows with H, not N or V ([R, H] rows of x and grad_x, a
// converted [512, H] W tile per thread; README "Memory").
// FLCE_CPU_SCORE_MIB overrides the budget, for tuning
// (bench/tune_row_block.sh).
constexpr int64_t kScoreBudgetBytes = int64_t(48) << 20;
constexpr int64_t kMaxRowBlock = 256;
// With Plan::packed_scores a score takes 2 bytes, so the same budget holds
// twice the rows, up to this many (each thread's f32 tile is then
// [512, kVocabTile], 1 MiB).
constexpr int64_t kMaxPackedRowBlock = 512;
constexpr int64_t kVocabTile = 512;    // columns per tile: a GEMM's n, a kernel call's length
// grad_x = G W splits into kGradXTasks pieces of [R, H]: hidden chunks of at
// least kMinHiddenChunk columns, then row groups. Each task streams the whole
// of its rows' G (K = V), so fewer, wider tasks move less memory: on 2 cores
// 4 tasks took 0.67 s -> 0.52 s of grad_x at S1 bf16 (16 tasks before), and
// 2.3 -> 1.9 s at S2. More cores would want more tasks; not tuned there.
constexpr int64_t kGradXTasks = 4;
constexpr int64_t kMinHiddenChunk = 64;
// Where H is small each G element feeds only 2H flops of grad_x, and
// reading G once per hidden chunk shows: up to this H (rows outer) the
// kGradXTasks tasks split the vocabulary instead, each writing its own
// [R, H] partial product, summed in task order (Plan::grad_x_vocab_split).
// Side by side on the 2-core Zen 5 (flce bench, f32 step, N = 8192,
// V = 32768, two alternations): H = 128 0.78 -> 0.72 s, H = 256 1.37 ->
// 1.30 s; H = 512 and S1 (H = 768) within the noise. Four more
// alternations at H = 128 on a busier machine: medians 0.87 -> 0.84 s; S3
// bf16 with storage G, three: 0.52-0.53 -> 0.48 s.
constexpr int64_t kVocabSplitMaxHidden = 256;
// A training step goes vocab outer (Plan) when the rows-outer block would
// have fewer rows than this. The grad_W traffic it saves grows as 1 / R
// against one more GEMM; measured side by side on the 2-core Zen 5 (flce
// bench, FLCE_CPU_GRAD_ORDER alternating): at R = 48 (S4) vocab outer took
// the step from 1.55-1.62 to 1.34-1.40 of three GEMMs in f32 and from
// 1.92-2.10 to 1.36-1.49 in bf16; at R = 96 (S2; N = 16384, H = 1024,
// V = 128256) the two were within the noise; at R = 240 (S1) and 256 (S3)
// rows outer was 3-40% faster. A backward from the saved lse goes vocab outer
// wherever there is more than one block (Plan::stats_from_inputs).
// FLCE_CPU_GRAD_ORDER = rows, vocab or vocab:RxT forces an order (and a
// cut), for tuning and tests.
constexpr int64_t kVocabOuterBelowRows = 96;
// With Plan::stash_scores a chunk's scores are only copied into the
// workspace, not computed there, so it need not fill the budget: chunks of
// at most this many bytes (8 tiles at R = 1024) keep the workspace and the
// GEMM libraries' scratch under 64 MiB, and the grad_x accumulator they
// cost (8 R H bytes a chunk) stays a few percent of a step's memory traffic.
constexpr int64_t kStashChunkBytes = int64_t(8) << 20;

// A training step's two orders. Rows outer: each block of R rows gets its
// scores for the whole vocabulary, then G, then its share of grad_W and
// grad_x: three GEMMs, but the grad_W GEMMs have K = R, and grad_W's f32
// rows are read and written once per block, 8 V H N / R bytes in all; with
// V large the budget leaves R small (S4: 48 rows, 100 GB at N = 1024).
// Vocab outer: a super-block of R rows first gets its row statistics (a
// forward over kMaxRowBlock pieces), then for each chunk of vocab tiles the
// logits are computed again and turned into G at once, each tile's grad_W
// (K = R) and the rows' f32 grad_x (K = the chunk) accumulating across
// chunks: four GEMMs, with far less memory traffic when R would be small.
// The order and the cut depend on the problem only (make_plan's cost model).
struct Plan {
  Dims d;
  Pass pass;
  int64_t row_block = 0;  // R: rows per block (vocab outer: per super-block)
  bool vocab_outer = false;
  int64_t chunk_tiles = 0;  // vocab outer: tiles per chunk of the vocabulary
  // Floats from one row of Workspace::scores to the next (rows outer: V,
  // vocab outer: a chunk), padded to an odd number of 64-byte lines, so
  // that the rows of a [R, 512] tile do not all fall in the same cache sets
  // when V is a power of two. Side by side (flce bench, three alternations):
  // S3 bf16 step 0.43-0.44 -> 0.39-0.40 s; S3 f32, S1 and S2 bf16 within
  // the noise.
  int64_t scores_ld = 0;
  // Vocab outer for a backward without an entropy cotangent: G needs only
  // the saved lse, so the rows' statistics come from the inputs, no forward
  // GEMM, and the pass is three GEMMs like rows outer, with less traffic.
  bool stats_from_inputs = false;
  // A forward pass folds each tile as soon as its GEMM is done, so its
  // scores are one [R, kVocabTile] tile per thread, not an [R, V] block, and
  // R is kMaxRowBlock whatever V or N (each W tile then serves more rows:
  // S2 bf16 forward 2.0 s -> 1.5 s). Every logits GEMM then has R rows, a
  // short block padded with zero rows, because the GEMM engines round a
  // row differently by the call's row count (oneDNN's one-row calls): so a
  // row's forward outputs do not depend on the rows around it (flce eval's
  // blocks give flce run's bits).
  bool tile_scores = false;
  // simd::SoftmaxExtras the rows need: sum_exp_d for the entropy (output or
  // cotangent), sum_cs for label smoothing, argmax for its output.
  unsigned softmax_extras = simd::kSoftmaxAll;
  int64_t tiles = 0;      // ceil(V / kVocabTile)
  int64_t h_chunk = 0;    // grad_x task width (columns of H)
  int64_t h_chunks = 0;   // ceil(H / h_chunk)
  int64_t row_groups = 0; // grad_x tasks per hidden chunk
  // grad_x's tasks split the vocabulary (kVocabSplitMaxHidden), each into its
  // own [R, H] part of Workspace::grad_x_parts; else hidden chunks x row groups.
  bool grad_x_vocab_split = false;
  // grad_x = G W tile by tile, where bf16 products run on a matrix unit
  // (GemmEngine::bf16_on_matrix_unit), rows outer: tile t's G_t [R, n]
  // W_t [n, H] runs right after its grad_W product, from the same compact
  // copy (Workspace::g16_tiles), into the part of Workspace::grad_x_parts
  // that owns t (kGradXTasks parts, one task each, tiles dealt round: part
  // t mod kGradXTasks); grad_hidden then adds parts 1.. to part 0 in task
  // order. Every
  // operand is dense, which oneDNN 2.6 needs to run AMX on it (the one
  // long-K GEMM per hidden chunk ran oneDNN's gemm:jit), and G is read once,
  // while in cache. On the 2-core Xeon with AMX: 2220 GFLOP/s a tile
  // product at R = 496, H = 768 (bench/gemm_engines.cpp); flce bench with
  // FLCE_CPU_GRAD_X_SPLIT=hidden against =tile, alternating: S1 bf16 step
  // 0.89-0.93 -> 0.80-0.85 s (1.21-1.22 -> 1.08-1.10 of three GEMMs, three
  // runs), S3 bf16 step (against the vocabulary split) 0.29 -> 0.28 s (two).
  bool grad_x_by_tile = false;
  // bf16 G for grad_x: each row's tiles moved together after the grad_W
  // GEMMs (Workspace::scores), so that one GEMM spans many tiles; not with
  // the vocabulary split, where one GEMM per tile (K = kVocabTile) read in
  // place ran as fast and the move is saved (S3 bf16 step 0.47-0.48 ->
  // 0.44-0.45 s, three alternations; at S1 the moved rows stay ahead, 1.55
  // against 1.59-1.63 s).
  bool compact_bf16_g = false;
  // A bf16 training step whose G goes to the GEMMs in bf16 (grad_logits_dtype
  // = storage), rows outer: the [R, V] block holds each score as the f16
  // bits of ref - s, ref being the row's max within the score's tile
  // (Workspace::score_refs), instead of an f32 score, so R doubles within
  // the budget and grad_W's accumulator and W are streamed half as often
  // (S2 bf16 step: R = 96 -> 192). The gradient pass reads s back within
  // u_f16 (ref - s) <= u_f16 (max_j s_j - s) (README, tolerance policy: u_q),
  // a relative error of p = exp(s - lse) of at most bf16's u (2^-8) where
  // p >= e^-8 max_j p_j, the size of G's own bf16 rounding; its G is
  // written as bf16 over the codes, columns 0 .. V of each row contiguous
  // (like compact_bf16_g, with no move). Off where the kernel set has no
  // pack_scores, or with FLCE_CPU_PACK_SCORES=0 (for side-by-side timing).
  bool packed_scores = false;
  // Vocab outer with a forward pass first: the forward pieces also keep the
  // super-block's f32 scores, and each chunk copies its scores back instead
  // of a second logits GEMM, so the step costs three GEMMs, not four. They
  // are kept in grad_W's own memory (stash_at), which is free until the
  // gradient GEMMs write it: entirely free where grad_W accumulates in the
  // workspace; written chunk by chunk where it is f32 in place, with one
  // super-block ([V, H] only). The super-block's R x V floats fit in grad_W's
  // V x H elements when 4 R <= H |grad_W dtype|, and then, packed against
  // grad_W's end chunk by chunk, every chunk's scores lie above the grad_W
  // rows of the chunks before it. Off with FLCE_CPU_STASH=0.
  bool stash_scores = false;
  int64_t stash_rows = 0;  // the super-block's R, for stash_at (a forward piece's plan has its own row_block)
  int threads = 1;
  Dtype storage = Dtype::f32;      // dtype of x, W (or logits)
  Dtype logits_gemm = Dtype::f32;  // f32 or bf16: X and W in U = X W^T
  Dtype grad_gemm = Dtype::f32;    // f32 or bf16: G, X and W in the gradient GEMMs
  // G rounded to the storage dtype in f32 (grad_logits_dtype = storage with a
  // non-f32 storage), unless only the bf16 conversion for the GEMMs reads it.
  bool round_grad_logits = false;
  // G's entries below f32's normal range set to 0 before the f32 gradient
  // GEMMs, which subnormal operands slow some 20x (oneDNN, OpenBLAS and
  // gemm_tn alike: a step of N = 512, H = 512, V = 8000 with logits of
  // std 22 took 3.8 s against 0.17 s at std 1, the logits entry 0.12 s).
  // The tolerance policy allows it (section 7). bf16 G needs none: its dot
  // products read subnormals as 0.
  bool flush_subnormal_g = false;
  bool grad_w_in_place = false;    // grad_w is f32 with unit inner stride
  // Vocab outer with an f32 grad_x whose rows lie end to end: each
  // super-block's rows accumulate in grad_x itself, not in a [R, H]
  // Workspace::grad_x_block (R can be N there: 16 MiB at S2).
  bool grad_x_in_place = false;
  // grad_W's products run through the kernel set's gemm_tn (f32) or
  // gemm_tn_bf16 (bf16 G) where it has one, each thread with its own packing
  // scratch in the workspace; bf16 G not where the engine's bf16 runs on a
  // matrix unit (GemmEngine::bf16_on_matrix_unit), which is faster.
  bool grad_w_gemm_tn = false;
  // Otherwise, with bf16 G in the [V, H] form: each full row block's x rows
  // are packed once for the engine (GemmEngine::pack_b, into
  // Workspace::x_packed) and every whole tile's grad_W product reads them so
  // (grad_w_tile_args), where the engine packs for that shape (oneDNN on
  // AMX). The bits are the same: packing only reorders B.
  bool grad_w_packed_x = false;
  // Gradient filtering (README): on for the head entry's gradient passes
  // when filter_eps > 0, except with a softcap and label smoothing together
  // (there the smoothing's uniform term of G is not rank one, see below).
  bool filter = false;
  double filter_eps = 0;
  // With label smoothing the filter applies to G' = G - u c^T, where
  // u_i = -a g_i e / V is the smoothing's uniform term; u c^T is added back
  // exactly as rank-one updates of grad_x, grad_W and grad_bias.
  bool filter_uniform = false;
  const GemmEngine* gemm = nullptr;
  const simd::KernelSet* kernels = nullptr;

  // bf16 G lies row by row, columns 0 .. V contiguous (ScoreBlock::bf16_rows),
  // rather than tile by tile (ScoreBlock::bf16_tile).
  bool g16_by_rows() const { return compact_bf16_g || packed_scores; }
  // s_{i y_i} is kept aside in Workspace::label_score: the scores themselves
  // are gone (tile_scores) or packed by the time merge_rows reads it.
  bool label_scores_aside() const { return tile_scores || packed_scores; }
};

// The grad_W product of a tile of n classes and a block of `rows` rows in
// the [V, H] form, grad_W [n, H] (+)= G_t^T [n, rows] X_block [rows, H],
// with G_t's rows kVocabTile apart (Workspace::g16_tiles) and without its
// pointers and beta. Where the plan packs x (Plan::grad_w_packed_x), a full
// block's whole tiles read it packed.
GemmArgs grad_w_tile_args(const Plan& plan, const Problem& p, int64_t rows, int64_t n);

// "" or an error naming a malformed FLCE_CPU_SCORE_MIB.
std::string check_tuning_env();

// The plan for a problem already validated and accepted.
Plan make_plan(const Problem& p, Pass pass, const RunConfig& config);

// The GEMM engine to use: config.gemm if named, else the default for the
// storage dtype. Returns "" or an error naming the engine.
std::string pick_gemm(const RunConfig& config, Dtype storage, const GemmEngine** engine);

// Per-row scalars of the current row block (README, Semantics).
struct RowInfo {
  double lse = 0;
  // The lse as p, logp and the entropy take it (row_terms.h, lse_parts):
  // shift + lse_d, and p_scale, the dlogits kernel's p's factor. Where
  // the max is finite, shift is the max.
  double shift = 0, lse_d = 0, p_scale = 1;
  double sbar_d = 0;         // sum_j p_ij (s_ij - shift), the entropy's mean score
  double s_y = 0;            // the label's score, for the forward outputs (0 if ignored)
  double filter_tau = 0;     // gradient filter: |G'_ij| <= filter_tau may be left out
  double uniform = 0;        // u_i, the smoothing's uniform term, when filter_uniform
  double g_loss = 0;         // d objective / d loss_i times t_i (0 if ignored)
  double g_lse = 0, g_ent = 0;
  double coef_p = 0, coef_c = 0;  // G's coefficients of p_ij and c_j (simd::DlogitsParams)
  int64_t y = 0;
  bool ignored = false;
};

// Scratch carved from one workspace, each piece 64-byte aligned.
struct Workspace {
  // [R, V], rows Plan::scores_ld floats apart: s, then G in place
  // (ScoreBlock). For bf16 gradient GEMMs each tile's G is then converted in
  // place to bf16, at the start of its own f32 span: as a bf16 matrix,
  // columns j0 .. j0+n of tile t sit at 2 j0 .. 2 j0+n of rows 2 scores_ld
  // apart (ScoreBlock::bf16_tile). With Plan::compact_bf16_g, once every
  // tile's grad_W GEMM has read it, each row's tiles move left to lie
  // contiguous, columns 0 .. V at 0 .. V (ScoreBlock::bf16_rows), so that
  // grad_x takes one GEMM over many tiles. Vocab outer: [R, chunk] the same way, and
  // before that the forward pieces' tiles. With Plan::tile_scores:
  // [threads, kMaxRowBlock, kVocabTile], one tile per thread.
  // With Plan::packed_scores: [R, 2 scores_ld] uint16 codes (the f16 bits
  // of ref - s), then bf16 G over them.
  float* scores = nullptr;
  float* label_score = nullptr;       // [max(R, kMaxRowBlock)]: s_{i y_i} (Plan::label_scores_aside)
  float* packed_tiles = nullptr;      // [threads, R, kVocabTile]: a tile's f32 scores (Plan::packed_scores)
  float* score_refs = nullptr;        // [R, tiles]: ref of each (row, tile)'s codes (Plan::packed_scores)
  // [threads, R, kVocabTile]: a copy of the tile's bf16 G, rows kVocabTile
  // apart, for its grad_W GEMM and with Plan::grad_x_by_tile its grad_x one
  // (bf16 gradient GEMMs; steps.cpp, tile_grads). With Plan::packed_scores,
  // in packed_tiles, whose f32 tiles are done with by the gradient pass.
  uint16_t* g16_tiles = nullptr;
  void* x_packed = nullptr;           // x_block_grad packed for the engine (Plan::grad_w_packed_x)
  void* x_block = nullptr;            // [R, H] in logits_gemm dtype (vocab outer: R up to whole pieces)
  void* x_block_grad = nullptr;       // [R, H] in grad_gemm dtype, when it differs
  void* w_scratch = nullptr;          // [threads, T, H] converted W pieces (null: W read in place)
  float* grad_x_block = nullptr;      // [R, H] (Plan::grad_x_by_tile: part 0)
  float* grad_x_parts = nullptr;      // [kGradXTasks, R, H] (Plan::grad_x_vocab_split, grad_x_by_tile)
  simd::SoftmaxState* states = nullptr;  // [R, tiles] (vocab outer: [kMaxRowBlock, tiles])
  RowInfo* rows = nullptr;            // [R]
  double* row_loss = nullptr;         // [N]
  float* grad_w_acc = nullptr;        // [V, H] when grad_w is not accumulated in place
  double* grad_b_acc = nullptr;       // [V]
  float* class_w = nullptr;           // [V] (null: all ones)
  float* bias = nullptr;              // [V] (null: no bias)
  uint8_t* kept = nullptr;            // [tiles]: the gradient filter's verdict for this row block
  uint8_t* w_written = nullptr;       // [tiles]: grad_W rows of the tile written yet (then +=)
  float* gemm_tn_scratch = nullptr;   // [threads, simd::kGemmTnScratchFloats] (Plan::grad_w_gemm_tn)
  double* uniform_w = nullptr;        // [H]: sum_j c_j W_j, when filter_uniform and grad_x
  double* uniform_x = nullptr;        // [H + 1]: sum_i u_i x_i, then sum_i u_i
};

// Where a block of scores (then G) lies: column j of row r at
// base[r * ld + j - j_begin]. Rows outer: the [R, V] block (ld = V);
// vocab outer: one chunk of tiles (ld = chunk_tiles * kVocabTile).
struct ScoreBlock {
  float* base = nullptr;
  int64_t ld = 0, j_begin = 0;
  float* at(int64_t r, int64_t j) const { return base + r * ld + (j - j_begin); }
  // The bf16 G of the tile starting at j0, converted in place at the start
  // of the tile's own f32 span (Workspace::scores): row stride 2 ld.
  const uint16_t* bf16_tile(int64_t r, int64_t j0) const {
    return reinterpret_cast<const uint16_t*>(base + r * ld) + 2 * (j0 - j_begin);
  }
  // The compacted bf16 G (Workspace::scores) from column j: row stride 2 ld.
  const uint16_t* bf16_rows(int64_t r, int64_t j) const {
    return reinterpret_cast<const uint16_t*>(base + r * ld) + (j - j_begin);
  }
  // The packed scores' codes (Plan::packed_scores) from column j, and the
  // bf16 G that replaces them: the same places as bf16_rows.
  uint16_t* codes(int64_t r, int64_t j) const {
    return reinterpret_cast<uint16_t*>(base + r * ld) + (j - j_begin);
  }
};

size_t workspace_bytes(const Plan& plan, const Problem& p);
Workspace carve_workspace(const Plan& plan, const Problem& p, void* base);

// Plan::stash_scores: where the score of super-block row r, column j lies in
// grad_W's memory, for the chunk [j0, j1) that holds j: the chunk's [R, j1 -
// j0] rows end (V - j1) R floats before grad_W's last whole float. Byte
// addresses (a bf16 grad_W may be only 2-byte aligned): read and write them
// with memcpy.
char* stash_at(const Plan& plan, const Problem& p, int64_t r, int64_t j, int64_t j0, int64_t j1);

}  // namespace flce::cpu
