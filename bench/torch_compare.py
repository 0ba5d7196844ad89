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
Prints one line per dtype and the speedup eager / flce. Needs Debian's
/usr/bin/python3 with python3-torch and flce's Python module.
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import flce

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


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
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__} ({torch.get_num_threads()} threads), flce {flce.version()}, "
          f"N={args.n} H={args.h} V={args.v}", flush=True)
    for name in args.dtypes.split(","):
        dt = DTYPES[name]
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
            r = flce.loss_and_grad(x, w, y, grad_dtype="input", backend="cpu",
                                   threads=args.threads,
                                   grad_logits_dtype="storage" if name == "bf16" else "f32")
            return float(r.loss)

        times = {"eager": [], "flce": []}
        losses = {"eager": eager(), "flce": fused()}  # warm-up
        for _ in range(args.reps):
            for label, fn in (("eager", eager), ("flce", fused)):
                start = time.perf_counter()
                fn()
                times[label].append(time.perf_counter() - start)
        te, tf = statistics.median(times["eager"]), statistics.median(times["flce"])
        eager_form = "eager (f32 loss)" if args.upcast and name != "f32" else "eager"
        print(f"{name}: {eager_form} step {te:.3f} s, flce step {tf:.3f} s, eager / flce = {te / tf:.2f} "
              f"(loss eager {losses['eager']:.6f}, flce {losses['flce']:.6f})", flush=True)


if __name__ == "__main__":
    main()
