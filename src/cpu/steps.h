// The steps of the cpu backend for one row block, in the order they run
// (for the vocab-outer order: a super-block's forward pieces, then its
// chunks).
// Each is one OpenMP loop over a fixed grid of tasks (vocab tiles, rows or
// hidden chunks); every output element has one owner and sums run in a fixed
// order, so results are bitwise identical for any thread count.
#pragma once

#include "cpu/plan.h"

namespace flce::cpu {

// What every step reads: the problem, its plan and the scratch.
struct Context {
  const Problem& p;
  const Plan& plan;
  const Workspace& ws;
  double class_sum;  // C = sum_j c_j
  double denom;      // D = sum over non-ignored i of t_i c_{y_i}
  RunStats* stats;   // the gradient filter's block counts
  int64_t piece_row0 = 0;  // a forward piece's first row in its super-block (Plan::stash_scores)
};

// Loads the block's x rows; scores s = softcap(a (x W^T + b)) into ws.scores
// (one GEMM per vocab tile) and each (row, tile)'s softmax state; a forward
// piece of a stashing plan also copies them to the stash (Plan::stash_scores).
void scores_and_states(const Context& c, int64_t i0, int64_t rows);

// Merges each row's tile states in tile order into RowInfo and, for the
// forward passes, writes the row's outputs.
void merge_rows(const Context& c, int64_t i0, int64_t rows);

// For a backward without an entropy cotangent (Plan::stats_from_inputs):
// loads the block's x rows and sets each row's RowInfo from its saved lse,
// with no GEMM (G needs no other statistic of the row).
void rows_from_inputs(const Context& c, int64_t i0, int64_t rows);

// Turns the scores into G = d objective / d(x W^T + b) in place, writes
// grad_logits, and adds the block's share of grad_W and grad_bias (with
// Plan::grad_x_by_tile also each tile's grad_x product, into its part).
// With the gradient filter on, marks which vocab tiles the GEMMs keep
// (ws.kept).
void grad_logits_and_weights(const Context& c, int64_t i0, int64_t rows);

// grad_x for the block's rows: G W, one owner per (row group, hidden chunk)
// task of the Plan, or the per-tile parts added (Plan::grad_x_by_tile);
// then stored.
void grad_hidden(const Context& c, int64_t i0, int64_t rows);

// Vocab outer (Plan): for the super-block's rows, whose RowInfo merge_rows
// has set, the logits of tiles t0 .. t1 computed again (or copied back from
// the stash) and turned into G,
// each tile's grad_W and grad_bias added, and G W of the chunk added to
// ws.grad_x_block (written by the first chunk).
void grad_vocab_chunk(const Context& c, int64_t i0, int64_t rows, int64_t t0, int64_t t1);

// ws.grad_x_block's rows (plus the filter's smoothing term) into grad_x.
void store_grad_x(const Context& c, int64_t i0, int64_t rows);

}  // namespace flce::cpu
