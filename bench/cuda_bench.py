#!/usr/bin/env python3
"""The cuda backend's benchmark: bf16 training steps and forward passes at
three LM-head shapes, each timed in the same run against the three cuBLAS
GEMMs a step cannot avoid (one for a forward pass) and against PyTorch eager.

  PYTHONPATH=build-gpu/python python3 bench/cuda_bench.py [--json FILE]
      [--shapes gemma2,llama3,h1024] [--variants FLCE_CUDA_STASH=0,...] [--reps 10]
      [--baseline OTHER_BUILD/python] [--back-to-back ROUNDS] [--steady SECONDS]

Shapes (N x H x V): gemma2 8192 x 2304 x 256000 with softcap 30, llama3
8192 x 4096 x 128256, h1024 16384 x 1024 x 128256. Every time is the median
of --reps CUDA-event timings after 3 warm-ups, on random data (never zeros),
taken in rounds: each round times every call below once, in an order
shuffled per round (fixed seed), so that neither the GPU's clocks under
sustained load nor what ran just before weigh on one call more than on
another (the first flce call after the GEMMs measured 5-10% slower).
  gemm3     logits = x W^T, grad_x = G W, grad_W = G^T x as torch.mm in bf16
            (cuBLAS), G a random bf16 [N, V] array; gemm1 is the first alone.
  flce      flce.loss_and_grad / flce.forward on the torch CUDA tensors,
            backend cuda, grad_logits_dtype 'storage' (bf16 dlogits, as every
            GPU kernel compared here), bf16 gradients; once per --variants
            entry (environment settings joined by '+', e.g.
            FLCE_CUDA_TILE=2048x2048+FLCE_CUDA_STASH=0; the first entry,
            default: none, is the table's). --baseline adds a variant
            'baseline': the flce package of another build (e.g. of an older
            commit, `.ci/gpu` with FLCE_BENCH_BASELINE), loaded into the
            same process as flce_baseline, so that two versions of the code
            are compared in the same rounds rather than across runs, whose
            ratios move by a few percent.
  eager     F.cross_entropy((x @ W.T).float(), y) (softcap applied as
            k tanh(z / k) for gemma2), loss.backward().
--back-to-back ROUNDS also times each call but eager in runs of --reps
calls back to back (3 warm-ups, events around each, median), the calls in
turn, ROUNDS times: steps that follow one another as in training, and no
eager step churning the allocator in between. --steady SECONDS runs the
GEMM and each forward alone in a loop for that long and reports the time
it settles at, with nvidia-smi's clock and power over the same span.
Memory: the peak of torch.cuda.max_memory_allocated during the call minus
what was allocated before it: gradients, outputs and (for flce) the
workspace, which flce's Python layer takes from torch's allocator.
Correctness: after the timings, the first --variants entry's step and
forward at each shape are judged at eight rows against the float64 oracle
under the tolerance policy, and a step with all other rows ignored too,
with its whole grad_W at the --grad-w-check shapes (oracle_check); outputs
outside the policy make the run exit 1, so a fast but wrong kernel fails.
The run ends with the table, then which of #7's targets this run met, for
the first --variants entry (bench/cuda_targets.py).
"""

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import flce
from cuda_targets import back_to_back_ratios, memory_limit_mib, oracle_failures
from cuda_targets import report as targets_report

SHAPES = {
    "gemma2": (8192, 2304, 256000, 30.0),
    "llama3": (8192, 4096, 128256, 0.0),
    "h1024": (16384, 1024, 128256, 0.0),
}
MIB = 1 << 20


def event_ms(fn):
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop)


def time_all_ms(calls, reps):
    """{name: median ms} of each zero-argument call in `calls`, timed in
    rounds (each call once per round, in a shuffled order) after 3 warm-ups
    each."""
    for fn in calls.values():
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    times = {name: [] for name in calls}
    order = list(calls)
    shuffle = random.Random(0).shuffle
    for _ in range(reps):
        shuffle(order)
        for name in order:
            times[name].append(event_ms(calls[name]))
    return {name: statistics.median(t) for name, t in times.items()}


def time_back_to_back_ms(calls, reps, rounds):
    """[{name: median ms}] per round: in each round every call in turn runs
    3 warm-ups, then `reps` calls back to back with CUDA events around
    each, so that a call runs under its own clocks and allocator state
    rather than after whatever the shuffle put before it."""
    results = []
    for _ in range(rounds):
        ms = {}
        for name, fn in calls.items():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            ms[name] = statistics.median(event_ms(fn) for _ in range(reps))
        results.append(ms)
    return results


def smi_samples(period_ms):
    """A running `nvidia-smi` sampling GPU 0's SM clock (MHz), power (W) and
    clock event reasons every period_ms, or None where there is none."""
    try:
        return subprocess.Popen(
            ["nvidia-smi", "-i", "0", "--format=csv,noheader,nounits", "-lms", str(period_ms),
             "--query-gpu=clocks.sm,power.draw,clocks_event_reasons.active"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError:
        return None


def time_steady_ms(calls, seconds):
    """{name: (mean ms, clock MHz, watts, power-capped share)} of each call
    run alone in a loop for `seconds` after a 1 s idle: the calls of the
    last third, and nvidia-smi's samples over it (None without nvidia-smi).
    What the GPU ran just before moves a call's time; this is the time it
    settles at."""
    out = {}
    for name, fn in calls.items():
        torch.cuda.synchronize()
        time.sleep(1.0)
        smi = smi_samples(50)
        start, times = time.time(), []
        while time.time() - start < seconds:
            times.append((time.time() - start, event_ms(fn)))
        last = [ms for t, ms in times if t >= seconds * 2 / 3]
        clock = watts = capped = None
        if smi is not None:
            smi.terminate()
            rows = [r.split(",") for r in smi.communicate()[0].split("\n") if r.count(",") == 2]
            rows = rows[len(rows) * 2 // 3:]
            if rows:
                clock = statistics.mean(float(r[0]) for r in rows)
                watts = statistics.mean(float(r[1]) for r in rows)
                capped = sum(1 for r in rows if int(r[2], 16) & 0x4) / len(rows)  # SW power cap
        out[name] = (statistics.mean(last), clock, watts, capped)
    return out


# The cuda backend's settings (README: the cuda backend); a misspelt one
# would time the defaults under another name.
VARIANT_SETTINGS = ("FLCE_CUDA_TILE", "FLCE_CUDA_BLOCK", "FLCE_CUDA_STASH", "FLCE_CUDA_FUSED")


def parse_variant(text):
    """{env name: value} of a --variants entry ('' for none)."""
    env = {}
    for item in filter(None, text.split("+")):
        name, eq, value = item.partition("=")
        if not eq or name not in VARIANT_SETTINGS:
            raise SystemExit(f"--variants: {item!r} is not NAME=VALUE with NAME one of "
                             f"{', '.join(VARIANT_SETTINGS)}")
        env[name] = value
    return env


def with_env(variant, fn):
    """fn run with the variant's environment settings, then with the
    environment as it was (a setting the caller exported stays)."""
    env = parse_variant(variant)

    def run():
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            return fn()
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    return run


def peak_extra_bytes(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


def load_baseline(path):
    """The flce package in `path` (another build's python directory),
    imported as flce_baseline beside flce."""
    package = os.path.join(path, "flce")
    if not os.path.isfile(os.path.join(package, "__init__.py")):
        raise SystemExit(f"--baseline: no flce package in {path!r}")
    if os.path.realpath(package) == os.path.realpath(os.path.dirname(flce.__file__)):
        raise SystemExit(f"--baseline: {path!r} holds the flce being measured; give another "
                         "build's python directory")
    spec = importlib.util.spec_from_file_location(
        "flce_baseline", os.path.join(package, "__init__.py"),
        submodule_search_locations=[package])
    module = importlib.util.module_from_spec(spec)
    sys.modules["flce_baseline"] = module
    spec.loader.exec_module(module)
    return module


BASELINE = None  # the --baseline package, timed as the variant 'baseline'


def module_and_env(variant):
    """(package, environment variant) of a --variants entry."""
    return (BASELINE, "") if variant == "baseline" else (flce, variant)


def oracle_check(x, w, y, softcap, step, fwd, masked_step, grad_w=False, rows=8):
    """The timed calls' outputs at `rows` rows spread over N, judged against
    flce's float64 oracle under the tolerance policy (flce.testing, run on
    the host): the step's lse and grad_x rows, with the stash's u_q, and the
    forward's lse. A row's lse and grad_x depend on that row alone, so the
    oracle runs on those rows (the mean's 1/N becomes grad_loss under
    reduction 'sum'). Then a step at the same plan with every other row's
    label ignore_index (`masked_step(labels)`): its loss and grad_x rows
    against the oracle of those rows alone (the mean over the same rows),
    its other grad_x rows exactly 0, and with `grad_w` its whole grad_W,
    which then sums over those rows only (minutes of host time at the large
    heads, so one shape by default). {output: fraction of its bound used},
    or {"error": the failure}."""
    import flce.testing
    n, v = x.shape[0], w.shape[0]
    idx = torch.linspace(0, n - 1, rows, device=x.device).long()
    xs, ws, ys = x[idx].cpu(), w.cpu(), y[idx].cpu()
    opts = dict(softcap=softcap, chunk_elements=rows * v)
    policy = dict(grad_cast="bfloat16", packed_scores="float16")
    masked = torch.full_like(y, -100)
    masked[idx] = y[idx]
    try:
        used = flce.testing.assert_close(
            {"lse": step.lse[idx].cpu(), "grad_x": step.grad_x[idx].cpu()}, xs, ws, ys,
            reduction="sum", grad_loss=torch.tensor(1.0 / n, dtype=torch.float64),
            **policy, **opts)
        fwd_used = flce.testing.assert_close({"lse": fwd.lse[idx].cpu()}, xs, ws, ys, **opts)
        m = masked_step(masked)
        others = torch.ones(n, dtype=torch.bool, device=x.device)
        others[idx] = False
        nonzero = int(torch.count_nonzero(m.grad_x[others]))
        if nonzero:
            raise AssertionError(f"masked step: {nonzero} grad_x entries of ignored rows are not 0")
        got = {"loss": m.loss.cpu(), "grad_x": m.grad_x[idx].cpu()}
        if grad_w:
            got["grad_w"] = m.grad_w.cpu()
        del m
        masked_used = flce.testing.assert_close(got, xs, ws, ys, **policy, **opts)
    except AssertionError as e:
        return {"error": str(e)}
    return ({"step " + k: r for k, r in used.items()} | {"fwd lse": fwd_used["lse"]} |
            {"masked step " + k: r for k, r in masked_used.items()})


def bench_shape(name, reps, variants, back_to_back=0, steady=0.0, grad_w_shapes=()):
    n, h, v, softcap = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, h, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(v, h, device="cuda", generator=g) / h ** 0.5).to(torch.bfloat16)
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    row = {"shape": name, "n": n, "h": h, "v": v, "softcap": softcap,
           "grads_bytes": (n * h + v * h) * 2}

    # The three GEMMs of a step, on random data.
    logits = torch.empty(n, v, device="cuda", dtype=torch.bfloat16)
    dl = torch.randn(n, v, device="cuda", generator=g, dtype=torch.float32).to(torch.bfloat16)
    gx, gw = torch.empty_like(x), torch.empty_like(w)

    # flce, per variant.
    def step(m=flce, labels=y):
        return m.loss_and_grad(x, w, labels, softcap=softcap, grad_logits_dtype="storage",
                               grad_dtype="input", backend="cuda")

    def fwd(m=flce):
        return m.forward(x, w, y, softcap=softcap, backend="cuda")

    def run(variant, fn):
        """fn of the variant's package, under its environment settings."""
        m, env = module_and_env(variant)
        return with_env(env, lambda: fn(m))

    # PyTorch eager.
    xe, we = x.clone().requires_grad_(True), w.clone().requires_grad_(True)

    def eager():
        xe.grad = we.grad = None
        z = (xe @ we.T).float()
        if softcap:
            z = softcap * torch.tanh(z / softcap)
        loss = F.cross_entropy(z, y)
        loss.backward()
        return loss, xe.grad, we.grad

    calls = {"gemm1": lambda: torch.mm(x, w.t(), out=logits),
             "gemm_x": lambda: torch.mm(dl, w, out=gx),
             "gemm_w": lambda: torch.mm(dl.t(), x, out=gw)}
    for var in variants:
        calls["step " + var] = run(var, step)
        calls["fwd " + var] = run(var, fwd)
    if back_to_back:  # eager left out: its 15-39 GB steps are what this avoids
        row["back_to_back"] = time_back_to_back_ms(calls, reps, back_to_back)
        for k, b in enumerate(row["back_to_back"]):
            ratios = {var: back_to_back_ratios(b, var) for var in variants}
            print(f"  {name} back to back, round {k + 1}: " + ", ".join(
                f"{var or 'default'} step {ratios[var][0]:.3f}x fwd {ratios[var][1]:.3f}x"
                for var in variants), flush=True)
    if steady:
        alone = {"gemm1": calls["gemm1"], **{"fwd " + var: calls["fwd " + var] for var in variants}}
        row["steady"] = time_steady_ms(alone, steady)
        for call, (ms_, clock, watts, capped) in row["steady"].items():
            smi = (f", SM clock {clock:.0f} MHz, {watts:.0f} W, power-capped {100 * capped:.0f}%"
                   if clock is not None else "")
            ratio = ms_ / row["steady"]["gemm1"][0]
            print(f"  {name} {call.strip()} alone for {steady:g} s: {ms_:.2f} ms ({ratio:.3f}x gemm1){smi}",
                  flush=True)
    calls["eager"] = eager
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    ms = time_all_ms(calls, reps)
    # A retry frees torch's cached blocks and synchronizes inside a timed
    # call (eager's 15-39 GB steps beside flce's): its time then is not its own.
    row["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries
    if row["alloc_retries"]:
        print(f"  {name}: warning: torch's allocator retried {row['alloc_retries']} times "
              f"(freeing its cache) during the timed rounds", flush=True)
    del logits, dl, gx, gw
    torch.cuda.empty_cache()
    row["gemm1_ms"] = ms["gemm1"]
    row["gemm3_ms"] = ms["gemm1"] + ms["gemm_x"] + ms["gemm_w"]
    row["flce"] = []
    for var in variants:
        t = {"variant": var or "default", "key": var,  # key: the variant's name in `calls`
             "step_ms": ms["step " + var], "fwd_ms": ms["fwd " + var],
             "step_peak_extra_bytes": peak_extra_bytes(run(var, step)),
             "fwd_peak_extra_bytes": peak_extra_bytes(run(var, fwd))}
        t["step_ratio"] = t["step_ms"] / row["gemm3_ms"]
        t["fwd_ratio"] = t["fwd_ms"] / row["gemm1_ms"]
        row["flce"].append(t)
        print(f"  {name} {t['variant']}: step {t['step_ms']:.2f} ms ({t['step_ratio']:.3f}x), "
              f"fwd {t['fwd_ms']:.2f} ms ({t['fwd_ratio']:.3f}x), "
              f"step extra {t['step_peak_extra_bytes'] / MIB:.0f} MiB", flush=True)
    row["eager_ms"] = ms["eager"]
    # The last timed call's gradients freed first: the measured call makes
    # its own, as flce's calls do (kept, they were counted in the baseline
    # and the figure lacked the gradients' size).
    xe.grad = we.grad = None
    row["eager_peak_extra_bytes"] = peak_extra_bytes(eager)
    first = variants[0]  # the table's, as cuda_targets judges
    step_result = run(first, step)()
    row["eager_loss"], row["flce_loss"] = eager()[0].item(), float(step_result.loss)
    started = time.time()
    row["oracle"] = oracle_check(x, w, y, softcap, step_result, run(first, fwd)(),
                                 lambda labels: run(first, lambda m: step(m, labels))(),
                                 grad_w=name in grad_w_shapes)
    print(f"  {name} {first or 'default'} against the oracle at 8 rows"
          f"{' (and grad_W)' if name in grad_w_shapes else ''}, {time.time() - started:.0f} s: "
          f"{row['oracle']}", flush=True)
    del step_result
    del xe, we
    torch.cuda.empty_cache()
    return row


def profile(name, calls_per_profile=5):
    """GPU time per call of each kernel of an flce step and forward at the
    shape: torch.profiler over calls_per_profile calls back to back, after
    two warm-ups (one cold call runs at other clocks)."""
    n, h, v, softcap = SHAPES[name]
    x = torch.randn(n, h, device="cuda").to(torch.bfloat16)
    w = (torch.randn(v, h, device="cuda") / h ** 0.5).to(torch.bfloat16)
    y = torch.randint(0, v, (n,), device="cuda")
    calls = {
        "step": lambda: flce.loss_and_grad(x, w, y, softcap=softcap, grad_logits_dtype="storage",
                                           grad_dtype="input", backend="cuda"),
        "fwd": lambda: flce.forward(x, w, y, softcap=softcap, backend="cuda"),
    }
    for what, fn in calls.items():
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(calls_per_profile):
                fn()
            torch.cuda.synchronize()
        rows = sorted(((e.self_device_time_total / calls_per_profile / 1e3, e.count, e.key)
                       for e in prof.key_averages() if e.self_device_time_total > 0), reverse=True)
        print(f"\n{name} {what}: GPU ms per call by kernel ({calls_per_profile} calls back to "
              f"back), {sum(r[0] for r in rows):.2f} ms in all")
        for ms, count, key in rows[:12]:
            print(f"  {ms:8.3f} ms  {count // calls_per_profile:4d} launches  {key[:90]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--variants", default="",
                    help="environment settings to compare, e.g. FLCE_CUDA_STASH=0,"
                         "FLCE_CUDA_TILE=2048x2048+FLCE_CUDA_STASH=0 (an empty entry: the "
                         "defaults); the table shows the first")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--profile", metavar="SHAPE",
                    help="also print torch.profiler's per-kernel GPU times of flce steps "
                         "and forwards at SHAPE, five of each back to back (where the time "
                         "over the GEMMs goes)")
    ap.add_argument("--back-to-back", type=int, default=0, metavar="ROUNDS",
                    help="also time each call (but eager) --reps times back to back, the "
                         "calls in turn, ROUNDS times, and print those ratios too")
    ap.add_argument("--steady", type=float, default=0.0, metavar="SECONDS",
                    help="also run the GEMM and each variant's forward alone in a loop for "
                         "SECONDS and print the time they settle at (last third), with "
                         "nvidia-smi's SM clock, power and power-cap share")
    ap.add_argument("--grad-w-check", default="h1024", metavar="SHAPES",
                    help="shapes whose oracle check also judges a whole grad_W (a step "
                         "with all but 8 rows ignored; minutes of host time at the large "
                         "heads; '' for none)")
    ap.add_argument("--baseline", metavar="DIR",
                    help="also time the flce package in DIR (another build's python "
                         "directory) as the variant 'baseline', in the same rounds")
    args = ap.parse_args()
    variants = args.variants.split(",")
    for var in variants:
        parse_variant(var)
    if args.baseline:
        global BASELINE
        BASELINE = load_baseline(args.baseline)
        variants.append("baseline")
        print(f"baseline: flce {BASELINE.version()} from {args.baseline}", flush=True)
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, torch {torch.__version__}, flce {flce.version()}", flush=True)
    shapes = args.shapes.split(",")
    grad_w_shapes = [s for s in args.grad_w_check.split(",") if s]
    for flag, names in (("--shapes", shapes), ("--grad-w-check", grad_w_shapes)):
        for name in names:
            if name not in SHAPES:
                raise SystemExit(f"{flag}: {name!r} is not one of {', '.join(SHAPES)}")
    rows = []
    for name in shapes:
        rows.append(bench_shape(name, args.reps, variants, args.back_to_back, args.steady,
                                grad_w_shapes))
        if args.json:  # after each shape: a later failure keeps the finished ones
            with open(args.json, "w") as f:
                json.dump({"device": props.name, "torch": torch.__version__, "rows": rows}, f,
                          indent=1)
    if args.profile:
        profile(args.profile)
    print("\n| shape (N x H x V) | 3 GEMMs | flce step | ratio | 1 GEMM | flce fwd | ratio "
          "| eager step | eager / flce | flce step extra | grads + 512 MiB | eager extra |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        best = r["flce"][0]  # the first --variants entry
        print(f"| {r['n']} x {r['h']} x {r['v']}{' softcap 30' if r['softcap'] else ''} "
              f"| {r['gemm3_ms']:.1f} ms | {best['step_ms']:.1f} ms | {best['step_ratio']:.2f} "
              f"| {r['gemm1_ms']:.1f} ms | {best['fwd_ms']:.1f} ms | {best['fwd_ratio']:.2f} "
              f"| {r['eager_ms']:.1f} ms | {r['eager_ms'] / best['step_ms']:.2f}x "
              f"| {best['step_peak_extra_bytes'] / MIB:.0f} MiB "
              f"| {memory_limit_mib(r):.0f} MiB "
              f"| {r['eager_peak_extra_bytes'] / MIB:.0f} MiB |")
    for r in rows:
        print(f"{r['shape']}: loss flce {r['flce_loss']:.6f}, eager {r['eager_loss']:.6f}")
    print("\nAgainst #7's targets (bench/cuda_targets.py), this run:")
    for line in targets_report(rows):
        print("  " + line)
    wrong = oracle_failures(rows)
    if wrong:  # a speed figure of wrong outputs means nothing: the run fails
        print("\nOutputs outside the tolerance policy: " + "; ".join(wrong))
        sys.exit(1)


if __name__ == "__main__":
    main()
