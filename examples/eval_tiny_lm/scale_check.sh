#!/usr/bin/env bash
# The scale check of `flce eval`: over 2 million rows with H = 256 (a 2 GB
# float32 hidden-state file) and V = 32000 (W is 32 MB), eval keeps its peak
# resident memory under 512 MiB and matches `flce run` on the same data.
#
#   bash examples/eval_tiny_lm/scale_check.sh [path/to/flce]
#
# Environment (defaults in brackets): N [2000000], H [256], V [32000],
# SLICE [50000] rows compared with `flce run`, WORK [/tmp/flce_scale_check]
# where a fresh folder for the data (about 2.1 GB) is made, BLOCK [4096] for
# --block-rows, KEEP=1 to keep that folder afterwards (only it is ever
# removed, never WORK), RSS_LIMIT_MIB [512].
#
# The data is made with Debian's /usr/bin/python3 and numpy through
# np.lib.format.open_memmap, in chunks, so making it does not need 2 GB of
# memory either: a tiny "language model" whose hidden state points at its
# next token (x_i = 8 W[t_i] + noise, labels t_i; 10% of the labels
# replaced by a random token, 2% set to -100), so loss and accuracy are
# neither trivial nor hopeless.
#
# What it checks:
#   1. eval over all N rows under /usr/bin/time -v: peak RSS < RSS_LIMIT_MIB;
#   2. `flce run --reduction none` on the first SLICE rows (written to their
#      own files), against eval's per-token outputs for those rows: logprob,
#      entropy and argmax must be bit-identical (same backend, same per-row
#      code; exact by design, see tests/test_eval.cpp);
#   3. eval on the slice against run's per-row losses: the same mean loss,
#      accuracy and mean entropy (float64 sums in row order).
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
flce="${1:-$here/../../build/flce}"
py=/usr/bin/python3
N="${N:-2000000}" H="${H:-256}" V="${V:-32000}" SLICE="${SLICE:-50000}"
WORK="${WORK:-/tmp/flce_scale_check}" BLOCK="${BLOCK:-4096}"
RSS_LIMIT_MIB="${RSS_LIMIT_MIB:-512}"

[ -x "$flce" ] || { echo "no flce binary at $flce (build it, or pass its path)" >&2; exit 2; }
[ -x /usr/bin/time ] || { echo "needs /usr/bin/time (apt-get install time)" >&2; exit 2; }
"$py" -c 'import numpy' || { echo "needs $py with numpy" >&2; exit 2; }

mkdir -p "$WORK"
WORK=$(mktemp -d "$WORK/data.XXXXXX")  # this run's own: the only folder removed
cleanup() { [ "${KEEP:-0}" = 1 ] || rm -rf "$WORK"; }
trap cleanup EXIT
echo "== data: N=$N H=$H V=$V in $WORK ($(df -h --output=avail "$WORK" | tail -1 | tr -d ' ') free)"

"$py" - "$WORK" "$N" "$H" "$V" "$SLICE" <<'EOF'
import sys, time
import numpy as np
work, n, h, v, sl = sys.argv[1], *map(int, sys.argv[2:])
t0 = time.time()
rng = np.random.default_rng(20240601)
w = (rng.standard_normal((v, h), dtype=np.float32) / np.float32(np.sqrt(h)))
np.save(f"{work}/w.npy", w)
x = np.lib.format.open_memmap(f"{work}/x.npy", mode="w+", dtype=np.float32, shape=(n, h))
y = np.lib.format.open_memmap(f"{work}/y.npy", mode="w+", dtype=np.int64, shape=(n,))
chunk = 65536
for r0 in range(0, n, chunk):
    r1 = min(n, r0 + chunk)
    t = rng.integers(0, v, r1 - r0)
    x[r0:r1] = 8.0 * w[t] + rng.standard_normal((r1 - r0, h), dtype=np.float32) / np.float32(np.sqrt(h))
    lab = t.copy()
    u = rng.random(r1 - r0)
    lab[u < 0.10] = rng.integers(0, v, int((u < 0.10).sum()))
    lab[u > 0.98] = -100
    y[r0:r1] = lab
    x.flush(); y.flush()
del x, y
xs = np.load(f"{work}/x.npy", mmap_mode="r")
ys = np.load(f"{work}/y.npy", mmap_mode="r")
np.save(f"{work}/x_slice.npy", np.ascontiguousarray(xs[:sl]))
np.save(f"{work}/y_slice.npy", np.ascontiguousarray(ys[:sl]))
print(f"generated in {time.time() - t0:.1f} s")
EOF
ls -l "$WORK"/*.npy

echo "== flce eval over all $N rows (peak RSS by /usr/bin/time -v)"
/usr/bin/time -v -o "$WORK/time_full.txt" "$flce" eval --x "$WORK/x.npy" --w "$WORK/w.npy" \
  --labels "$WORK/y.npy" --block-rows "$BLOCK" --out "$WORK/eval_full" --json --no-progress \
  > "$WORK/eval_full.json"
cat "$WORK/eval_full.json"
rss_kib=$(awk -F': ' '/Maximum resident set size/ {print $2}' "$WORK/time_full.txt")
wall=$(awk -F': ' '/Elapsed \(wall clock\)/ {print $2}' "$WORK/time_full.txt")
echo "peak RSS: $((rss_kib / 1024)) MiB ($rss_kib KiB); wall: $wall"

echo "== flce run --reduction none on the first $SLICE rows, and flce eval on the same slice"
/usr/bin/time -v -o "$WORK/time_run.txt" "$flce" run --x "$WORK/x_slice.npy" --w "$WORK/w.npy" \
  --labels "$WORK/y_slice.npy" --reduction none --out "$WORK/run_slice" > /dev/null
/usr/bin/time -v -o "$WORK/time_run64.txt" "$flce" run --x "$WORK/x_slice.npy" --w "$WORK/w.npy" \
  --labels "$WORK/y_slice.npy" --reduction none --out-dtype f64 --out "$WORK/run_slice64" > /dev/null
"$flce" eval --x "$WORK/x_slice.npy" --w "$WORK/w.npy" --labels "$WORK/y_slice.npy" \
  --block-rows "$BLOCK" --json --no-progress > "$WORK/eval_slice.json"
echo "flce run on the slice: peak RSS $(awk -F': ' '/Maximum resident/ {print int($2/1024)}' "$WORK/time_run.txt") MiB"

"$py" - "$WORK" "$SLICE" "$rss_kib" "$RSS_LIMIT_MIB" <<'EOF'
import json, sys
import numpy as np
work, sl, rss_kib, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
ok = True
for f in ["logprob", "entropy", "argmax"]:
    e = np.load(f"{work}/eval_full/{f}.npy", mmap_mode="r")[:sl]
    r = np.load(f"{work}/run_slice/{f}.npy")
    same = e.dtype == r.dtype and np.array_equal(e, r)
    diff = float(np.max(np.abs(e.astype(np.float64) - r.astype(np.float64))))
    print(f"{f}: eval rows [0, {sl}) vs flce run: bit-identical={same} max|diff|={diff:g}")
    ok &= same
y = np.load(f"{work}/y_slice.npy")
loss = np.load(f"{work}/run_slice64/loss.npy")
ent = np.load(f"{work}/run_slice64/entropy.npy")
arg = np.load(f"{work}/run_slice64/argmax.npy")
m = y != -100
s_loss = s_ent = 0.0
for a, b in zip(loss[m].tolist(), ent[m].tolist()):  # float64, row order, as eval sums
    s_loss += a; s_ent += b
want = {"scored": int(m.sum()), "correct": int((arg[m] == y[m]).sum()),
        "mean_loss": s_loss / m.sum(), "mean_entropy": s_ent / m.sum()}
got = json.load(open(f"{work}/eval_slice.json"))
for k, v in want.items():
    same = got[k] == v
    print(f"slice {k}: eval {got[k]!r} flce run {v!r} equal={same}")
    ok &= same
full = json.load(open(f"{work}/eval_full.json"))
print(f"full run: {full['rows']} rows, {full['ignored']} ignored, mean loss {full['mean_loss']:.6f}, "
      f"perplexity {full['perplexity']:.3f}, accuracy {full['accuracy']:.6f}, "
      f"mean entropy {full['mean_entropy']:.6f}, {full['seconds']:.1f} s, "
      f"{full['tokens_per_second']:.0f} tokens/s, backend {full['backend']}")
under = rss_kib < limit * 1024
print(f"peak RSS {rss_kib / 1024:.1f} MiB < {limit} MiB: {under}")
ok &= under
print("SCALE CHECK", "PASSED" if ok else "FAILED")
sys.exit(0 if ok else 1)
EOF
