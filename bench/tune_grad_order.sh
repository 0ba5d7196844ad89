#!/usr/bin/env bash
# How the cpu backend's threshold between its two training-step orders
# (kVocabOuterBelowRows in src/cpu/plan.h) was chosen: `flce bench` steps
# with FLCE_CPU_GRAD_ORDER=rows and =vocab alternating, at shapes whose
# row-block order would have R = 256 (S3), 240 (S1), 96 (S2; N = 16384,
# H = 1024, V = 128256) and 48 (S4) rows, printing seconds, the ratio to
# three GEMMs and the peak extra memory.
#   bash bench/tune_grad_order.sh [ROUNDS]   (after building build/flce)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-1}
shapes=("--n 8192 --h 128 --v 32768" "--n 4096 --h 768 --v 50257" "--n 1024 --h 4096 --v 128256"
        "--n 16384 --h 1024 --v 128256 --warmup 0" "--n 1024 --h 2304 --v 256000 --softcap 30")
for round in $(seq "$rounds"); do
  for shape in "${shapes[@]}"; do
    for dtype in f32 bf16; do
      for order in rows vocab; do
        extra=(); [ "$dtype" = bf16 ] && extra=(--grad-logits storage)
        FLCE_CPU_GRAD_ORDER=$order build/flce bench $shape --dtype "$dtype" "${extra[@]}" --reps 1 --no-progress |
          /usr/bin/python3 -c "import json,sys; d=json.load(sys.stdin); print(f'round $round  {d[\"n\"]}x{d[\"h\"]}x{d[\"v\"]} {d[\"dtype\"]:4} $order: {d[\"seconds\"]:.3f} s, ratio {d[\"ratio_to_gemm\"] or float(\"nan\"):.3f}, peak extra {d[\"peak_extra_bytes\"]/2**20:.0f} MiB')"
      done
    done
  done
done
