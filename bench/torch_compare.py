#!/usr/bin/python3
"""flce's cpu backend against PyTorch eager on the CPU: one training step
(loss and the gradients of x and W) at a shape, both in the same process, at
the same thread count, on the same random data.

    PYTHONPATH=build/python /usr/bin/python3 bench/torch_compare.py \\
        [--n 4096 --h 768 --v 50257] [--threads 2] [--reps 3] [--dtypes f32,bf16]

PyTorch eager is F.cross_entropy(F.linear(x, W), y) then backward(), in the
storage dtype (it materializes the [N, V] logits). With --upcast, bf16 eager
is F.cross_entropy(F.linear(x, W).float(), y), the loss in f32 as Hugging
Face models compute it and as the CUDA benchmark's eager baseline does. flce is
flce.loss_and_grad(x, W, y) on the cpu backend with gradients in the storage
dtype; for bf16 with grad_logits_dtype='storage' (bf16 dlogits, as the eager
bf16 step has). Times are medians of --reps after one warm-up of each; the
two are timed alternately so that drift on a shared machine hits both.
With --isolate each timed step runs in a fresh process of its own (one
warm-up, then the timed call), still alternating: in one process the eager
step's freed gigabytes of logits slow the flce call after it (S1 f32: about
3.3-3.5 s after an eager step, 2.9 s after a flce one).
Prints one line per dtype and the speedup eager / flce. Needs Debian's
/usr/bin/python3 with python3-torch and flce's Python module.
"""
import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import flce

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def make_steps(args, name):
    """The problem of one dtype (the same seed in every process) and its
    two step functions, each returning the loss."""
    dt = DTYPES[name]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.n, args.h, generator=g).to(dt)
    w = (torch.randn(args.v, args.h, generator=g) / args.h ** 0.5).to(dt)
    y = torch.randint(0, args.v, (args.n,), generator=g)
    xe, we = x.clone().requires_grad_(True), w.clone().requires_grad_(True)

    def eager():
        xe.grad = we.grad = None
        logits = F.linear(xe, we)
        loss = F.cross_entropy(logits.float() if args.upcast else logits, y)
        loss.backward()
        return loss.item()

    def fused():
        r = flce.loss_and_grad(x, w, y, grad_dtype="input", backend="cpu", threads=args.threads,
                               grad_logits_dtype="storage" if name == "bf16" else "f32")
        return float(r.loss)

    return {"eager": eager, "flce": fused}


def timed(fn):
    start = time.perf_counter()
    loss = fn()
    return time.perf_counter() - start, loss


def run_worker(args):
    """--worker KIND: one warm-up and one timed step in this fresh process."""
    fn = make_steps(args, args.dtypes)[args.worker]
    fn()
    seconds, loss = timed(fn)
    print(json.dumps({"seconds": seconds, "loss": loss}), flush=True)


def in_subprocess(args, kind, name):
    cmd = [sys.executable, __file__, "--worker", kind, "--dtypes", name, "--n", str(args.n),
           "--h", str(args.h), "--v", str(args.v), "--threads", str(args.threads)]
    if args.upcast:
        cmd.append("--upcast")
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:  # the worker's own error, not only its exit status
        sys.exit(f"torch_compare.py --worker {kind} --dtypes {name} failed "
                 f"({done.returncode}):\n{done.stderr}")
    r = json.loads(done.stdout.strip().splitlines()[-1])
    return r["seconds"], r["loss"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--h", type=int, default=768)
    ap.add_argument("--v", type=int, default=50257)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtypes", default="f32,bf16")
    ap.add_argument("--upcast", action="store_true",
                    help="eager computes the loss on f32 logits (.float()) in bf16")
    ap.add_argument("--isolate", action="store_true",
                    help="time each step in a fresh process of its own (still alternating)")
    ap.add_argument("--worker", choices=["eager", "flce"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.worker:
        return run_worker(args)
    print(f"torch {torch.__version__} ({torch.get_num_threads()} threads), flce {flce.version()}, "
          f"N={args.n} H={args.h} V={args.v}" + (", one process per step" if args.isolate else ""),
          flush=True)
    for name in args.dtypes.split(","):
        times = {"eager": [], "flce": []}
        losses = {}
        if args.isolate:
            step = lambda kind: in_subprocess(args, kind, name)  # noqa: E731
        else:
            steps = make_steps(args, name)
            losses = {kind: fn() for kind, fn in steps.items()}  # warm-up
            step = lambda kind: timed(steps[kind])  # noqa: E731
        for _ in range(args.reps):
            for kind in ("eager", "flce"):
                seconds, losses[kind] = step(kind)
                times[kind].append(seconds)
        te, tf = statistics.median(times["eager"]), statistics.median(times["flce"])
        eager_form = "eager (f32 loss)" if args.upcast and name != "f32" else "eager"
        print(f"{name}: {eager_form} step {te:.3f} s, flce step {tf:.3f} s, eager / flce = {te / tf:.2f} "
              f"(loss eager {losses['eager']:.6f}, flce {losses['flce']:.6f})", flush=True)


if __name__ == "__main__":
    main()
