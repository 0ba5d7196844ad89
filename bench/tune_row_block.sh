#!/usr/bin/env bash
# How the cpu backend's score budget (and so its row block R) was chosen:
# `flce bench` steps at S1 and S2 for each budget in FLCE_CPU_SCORE_MIB,
# in rounds that alternate the budgets (the machine is shared and noisy),
# printing seconds, the ratio to three GEMMs and the peak extra memory.
# The row-block order throughout (FLCE_CPU_GRAD_ORDER=rows: a small budget
# would otherwise send S2 vocab outer; bench/tune_grad_order.sh compares).
#   bash bench/tune_row_block.sh [ROUNDS]   (after building build/flce)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-1}
shapes=("--n 4096 --h 768 --v 50257" "--n 1024 --h 4096 --v 128256")
for round in $(seq "$rounds"); do
  for shape in "${shapes[@]}"; do
    for dtype in f32 bf16; do
      for mib in 16 32 48 96 192; do
        extra=(); [ "$dtype" = bf16 ] && extra=(--grad-logits storage)
        FLCE_CPU_GRAD_ORDER=rows FLCE_CPU_SCORE_MIB=$mib build/flce bench $shape --dtype "$dtype" "${extra[@]}" --reps 1 --no-progress |
          /usr/bin/python3 -c "import json,sys; d=json.load(sys.stdin); print(f'round $round  {d[\"n\"]}x{d[\"h\"]}x{d[\"v\"]} {d[\"dtype\"]:4} budget ${mib} MiB: {d[\"seconds\"]:.3f} s, ratio {d[\"ratio_to_gemm\"] or float(\"nan\"):.3f}, peak extra {d[\"peak_extra_bytes\"]/2**20:.0f} MiB')"
      done
    done
  done
done
