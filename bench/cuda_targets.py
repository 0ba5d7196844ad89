"""Issue #7's "Done when" figures as checks on one run of bench/cuda_bench.py:
which targets that run met, shape by shape. No torch or flce here, so that
tests/python/test_cuda_targets.py checks it on any machine.

The targets, in bf16 at each benchmark shape:
  step      loss_and_grad at most 1.25x the three cuBLAS GEMMs at H >= 2304,
            1.5x at H = 1024;
  forward   at most 1.15x one GEMM at H >= 2304, 1.3x at H = 1024;
  memory    the step's extra device memory at most the gradients' size
            + 512 MiB;
  eager     the step faster than PyTorch eager.
A fast but wrong kernel would meet them all, so a run also counts its
flce outputs at eight rows against the float64 oracle under the tolerance
policy (cuda_bench.py's oracle_check; rows of runs from before it have
none, and skip it), and oracle_failures() names the shapes where they
failed, which fail the run.
The issue names no limits between H = 1024 and 2304; below 2304 the
H = 1024 ones apply here (the benchmark's shapes have H = 1024, 2304, 4096).
"""

MIB = 1 << 20


def ratio_limits(h):
    """(step, forward) ratio limits at hidden size h."""
    return (1.25, 1.15) if h >= 2304 else (1.5, 1.3)


def memory_limit_mib(row):
    """The step's extra-memory bound: the gradients' size + 512 MiB, in MiB."""
    return (row["grads_bytes"] + 512 * MIB) / MIB


def back_to_back_ratios(round_ms, key):
    """(step / 3 GEMMs, forward / GEMM) of one back-to-back round's medians
    ({call name: ms}) for the flce variant named `key` in cuda_bench.py's
    calls."""
    gemm3 = round_ms["gemm1"] + round_ms["gemm_x"] + round_ms["gemm_w"]
    return round_ms["step " + key] / gemm3, round_ms["fwd " + key] / round_ms["gemm1"]


def checks(row, variant=0):
    """[(what, measured, limit, met)] for cuda_bench.py's `row` (one shape),
    its `variant`-th flce entry (0: the first --variants entry, the table's):
    the ratios of the shuffled rounds and of each back-to-back round, the
    step's peak extra memory in MiB, and eager's step time over flce's
    (met when above 1)."""
    step_max, fwd_max = ratio_limits(row["h"])
    t = row["flce"][variant]
    out = [("step / 3 GEMMs, shuffled", t["step_ratio"], step_max),
           ("forward / GEMM, shuffled", t["fwd_ratio"], fwd_max)]
    for k, b in enumerate(row.get("back_to_back", [])):
        step, fwd = back_to_back_ratios(b, t["key"])
        out.append((f"step / 3 GEMMs, back to back {k + 1}", step, step_max))
        out.append((f"forward / GEMM, back to back {k + 1}", fwd, fwd_max))
    checked = [(what, value, limit, value <= limit) for what, value, limit in out]
    memory_limit = memory_limit_mib(row)
    memory = t["step_peak_extra_bytes"] / MIB
    checked.append(("step extra memory, MiB", memory, memory_limit, memory <= memory_limit))
    speedup = row["eager_ms"] / t["step_ms"]
    checked.append(("eager step / flce step", speedup, 1.0, speedup > 1.0))
    if "oracle" in row and variant == 0:  # the first variant's outputs, checked
        oracle = row["oracle"]
        used = float("inf") if "error" in oracle else max(oracle.values())
        checked.append(("outputs at 8 rows, fraction of the policy's bound", used, 1.0,
                        used <= 1.0))
    return checked


def oracle_failures(rows):
    """'shape: why' for each row whose outputs failed the oracle check (the
    first variant's; rows from before the check have none)."""
    out = []
    for row in rows:
        oracle = row.get("oracle", {})
        if "error" in oracle:
            out.append(f"{row['shape']}: {oracle['error']}")
        elif oracle and max(oracle.values()) > 1.0:
            out.append(f"{row['shape']}: {max(oracle.values()):.3f} of a bound")
    return out


def report(rows, variant=0):
    """The checks of every row as printable lines, then a count."""
    lines, met, total = [], 0, 0
    for row in rows:
        label = row["flce"][variant]["variant"]
        lines.append(f"{row['shape']} ({row['n']} x {row['h']} x {row['v']}, {label}):")
        for what, value, limit, ok in checks(row, variant):
            bound = "above" if what.startswith("eager") else "at most"
            digits = 0 if what.endswith("MiB") else 3
            lines.append(f"  {what}: {value:.{digits}f} ({bound} {limit:.{digits}f}): "
                         f"{'met' if ok else 'NOT met'}")
            met, total = met + ok, total + 1
    lines.append(f"{met} of {total} checks met")
    return lines
