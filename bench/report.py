#!/usr/bin/python3
"""Turns flce_benchmarks' JSON into a Markdown table and a PNG chart.

    build/bench/flce_benchmarks --benchmark_format=json > bench.json
    /usr/bin/python3 bench/report.py bench.json --markdown bench.md --png bench.png

The table has one row per flce benchmark (shape, dtype, pass, threads):
time per pass (the median of its timed passes), tokens/s, GFLOP/s (2NHV
forward, 6NHV backward and step),
the ratio to the GEMMs the pass cannot avoid (timed in the same run), and
the peak extra memory. A second table gives the speedup of the largest
thread count over 1 thread for each shape, dtype and pass. The chart shows the fraction of the GEMM roofline
each pass reaches (1 / ratio_to_gemm) per shape, at the largest thread
count in the file. Needs Debian's python3-matplotlib for the chart only.
"""
import argparse
import json
import re
import sys

NAME = re.compile(r"^flce/(?P<shape>S\d)/(?P<dtype>\w+)/(?P<pass_>\w+)/threads:(?P<threads>\d+)")


def rows_of(report):
    rows = []
    for b in report["benchmarks"]:
        m = NAME.match(b["name"])
        # --benchmark_repetitions adds _mean, _median, ... rows: not runs.
        if not m or b.get("error_occurred") or b.get("run_type") == "aggregate":
            continue
        to_ms = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[b["time_unit"]]
        mean_ms = b["real_time"] * to_ms
        # The median pass where the binary reports it (the rates scaled to
        # it), else Google Benchmark's mean.
        ms = b["median_seconds"] * 1e3 if "median_seconds" in b else mean_ms
        rows.append({
            "shape": m["shape"], "dtype": m["dtype"], "pass": m["pass_"],
            "threads": int(m["threads"]), "ms": ms,
            "tokens_per_s": b["items_per_second"] * mean_ms / ms,
            "gflops": b["FLOPS"] * 1e-9 * mean_ms / ms,
            # No ratio where the engine has no native GEMM in the dtype.
            "ratio": b.get("ratio_to_gemm"), "extra_mb": b["peak_extra_bytes"] / 2**20,
            "paired_speedup": b.get("speedup_vs_1_thread"),
        })
    return rows


# The error a gemm/ row reports where the engine has no native GEMM in its
# dtype (bf16 without oneDNN's): a skip, as the README says, not a failure.
# (Google Benchmark 1.7 has only SkipWithError.)
NO_NATIVE_GEMM = re.compile(r"has no native \w+ GEMM")


def is_skip(b):
    return b["name"].startswith("gemm/") and bool(NO_NATIVE_GEMM.search(b.get("error_message", "")))


def failures(report):
    """(name, message) of every benchmark that reported an error (out of
    memory, say): they have no row, so the report names them."""
    return [(b["name"], b.get("error_message", "")) for b in report["benchmarks"]
            if b.get("error_occurred") and not is_skip(b)]


def skipped(report):
    """(name, message) of the gemm/ rows skipped for want of a native GEMM."""
    return [(b["name"], b["error_message"]) for b in report["benchmarks"]
            if b.get("error_occurred") and is_skip(b)]


def markdown(rows, context, failed=(), skips=()):
    out = [f"Machine: {context.get('num_cpus')} CPUs, {context.get('host_name')}, "
           f"load average {context.get('load_avg')}, {context.get('date')}.", "",
           "| shape | dtype | pass | threads | ms | tokens/s | GFLOP/s | ratio to GEMM | peak extra MiB |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['shape']} | {r['dtype']} | {r['pass']} | {r['threads']} | {r['ms']:.1f} | "
                   f"{r['tokens_per_s']:.0f} | {r['gflops']:.1f} | "
                   f"{'-' if r['ratio'] is None else format(r['ratio'], '.3f')} | "
                   f"{r['extra_mb']:.1f} |")
    if skips:
        out += ["", "Skipped:"] + [f"- {name}: {msg}" for name, msg in skips]
    if failed:
        out += ["", "Failed, so not in the table:"] + [f"- {name}: {msg}" for name, msg in failed]
    return "\n".join(out) + "\n" + scaling(rows)


def scaling(rows):
    """Speedup of the most threads over 1 thread, per shape, dtype and pass:
    the rows' ratio, and the paired one (speedup_vs_1_thread: a 1-thread
    pass timed right after each timed pass) where the binary reports it."""
    most = max(r["threads"] for r in rows)
    if most == 1:
        return ""
    by = {(r["shape"], r["dtype"], r["pass"], r["threads"]): r for r in rows}
    out = ["", f"| shape | dtype | pass | 1 thread ms | {most} threads ms | speedup | "
               "paired speedup |", "|---|---|---|---|---|---|---|"]
    for (shape, dtype, pass_, threads), r in by.items():
        one = by.get((shape, dtype, pass_, 1))
        if threads == most and one:
            paired = f"{r['paired_speedup']:.2f}x" if r["paired_speedup"] else "-"
            out.append(f"| {shape} | {dtype} | {pass_} | {one['ms']:.1f} | {r['ms']:.1f} | "
                       f"{one['ms'] / r['ms']:.2f}x | {paired} |")
    return "\n".join(out) + "\n"


def chart(rows, path):
    try:
        import matplotlib
    except ImportError:
        sys.exit(f"report.py: --png {path} needs matplotlib (Debian's python3-matplotlib; "
                 "bash .ci/deps bench installs it)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    threads = max(r["threads"] for r in rows)
    series = sorted({(r["dtype"], r["pass"]) for r in rows if r["threads"] == threads})
    shapes = sorted({r["shape"] for r in rows})
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(8, 4))
    for k, (dtype, pass_) in enumerate(series):
        values = []
        for s in shapes:
            hit = [r for r in rows if (r["shape"], r["dtype"], r["pass"], r["threads"]) ==
                   (s, dtype, pass_, threads)]
            values.append(1.0 / hit[0]["ratio"] if hit and hit[0]["ratio"] else 0.0)
        ax.bar([i + k * width for i in range(len(shapes))], values, width, label=f"{dtype} {pass_}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(shapes))], shapes)
    ax.set_ylabel("fraction of the GEMM roofline")
    ax.set_title(f"flce cpu backend, {threads} thread(s): GEMM time / flce time")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", help="output of flce_benchmarks --benchmark_format=json")
    parser.add_argument("--markdown", help="write the table here (default: stdout)")
    parser.add_argument("--png", help="write the chart here")
    args = parser.parse_args()
    with open(args.json) as f:
        text = f.read()
    try:
        report = json.loads(text)
    except json.JSONDecodeError as e:
        sys.exit(f"report.py: {args.json} is not flce_benchmarks' JSON"
                 + (" (it is empty: did the filter match no benchmark?)" if not text.strip()
                    else f" ({e})"))
    rows, failed = rows_of(report), failures(report)
    if not rows:
        sys.exit(f"report.py: {args.json} holds no flce/... benchmarks"
                 + "".join(f"\n  failed: {name}: {msg}" for name, msg in failed))
    table = markdown(rows, report.get("context", {}), failed, skipped(report))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    else:
        sys.stdout.write(table)
    if args.png:
        chart(rows, args.png)
    if failed:
        sys.exit(f"report.py: {len(failed)} benchmark(s) failed (listed under the table)")


if __name__ == "__main__":
    main()
