#!/usr/bin/env bash
# Nsight Compute on the fused kernels at the benchmark's heads, for a GPU
# machine (the `device` tool's H100): builds with .ci/gpu, then profiles one
# launch of each kernel named below and prints the headline counters; the
# full reports go to $OUT (or build-gpu/logs).
#   bash bench/cuda_ncu.sh ["gemma2 fwd States" "gemma2 step Dlogits" ...]
# Each case is "<head> <fwd|step> <epilogue: States|Dlogits|StoreF32>". ncu
# locks the clocks at their base (about 1.5 GHz on an H100), so durations are
# longer than in bench/cuda_bench.py; compare counters, not times.
set -uo pipefail
cd "$(dirname "$0")/.."
bash .ci/gpu build > /dev/null 2>&1 || { echo "build failed: build-gpu/logs"; exit 1; }
out=${OUT:-build-gpu/logs}
cases=("$@")
failed=0
((${#cases[@]})) || cases=("gemma2 fwd States" "gemma2 step Dlogits" "llama3 fwd States" "llama3 step Dlogits")
secs="--section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis"
secs+=" --section MemoryWorkloadAnalysis --section SchedulerStats --section InstructionStats"
for c in "${cases[@]}"; do
  set -- $c
  report="$out/ncu_$1_$2_$3.txt"
  echo "=== $1 $2: the first gemm_rows_kernel launch with the $3 epilogue"
  PYTHONPATH=build-gpu/python timeout 200 ncu --kernel-name-base demangled \
    --kernel-name "regex:gemm_rows_kernel.*$3" --launch-count 1 $secs --print-details all \
    python3 bench/cuda_one_call.py "$1" "$2" > "$report" 2>&1 || { echo "ncu failed: $report"; failed=1; }
  grep -E "Duration|SM Frequency|L2 Cache Throughput|DRAM Throughput|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Pipe Tensor Cycles Active  |Inst Executed Pipe Xu|^ +Stall (Barrier|Wait|Long Scoreboard|MIO Throttle|GMMA)" "$report"
done
exit $failed
