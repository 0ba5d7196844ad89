#!/usr/bin/python3
"""flce.torch's training step with its gradients computed in forward (one
flce.loss_and_grad, grads_in_forward=True, the default) against the same
step with them recomputed in backward (grads_in_forward=False), in one
process, alternated round by round so that drift on a shared machine hits
both; seconds per step (forward + backward) of each round.

    PYTHONPATH=build/python /usr/bin/python3 bench/torch_grads_in_forward.py \\
        [--n 4096 --h 1024 --v 32768] [--rounds 3]

Shapes: f32, bf16, and bf16 with grad_logits_dtype='storage' (bf16 dlogits);
the backend is flce's choice (cpu here; cuda for --device cuda).
"""

import argparse
import time

import torch

import flce.torch


def step_seconds(x, w, y, eager, grad_logits):
    xa, wa = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    if x.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    loss = flce.torch.linear_cross_entropy(xa, wa, y, grads_in_forward=eager,
                                           grad_logits_dtype=grad_logits)
    loss.backward()
    if x.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--h", type=int, default=1024)
    ap.add_argument("--v", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    for dtype, grad_logits in ((torch.float32, "f32"), (torch.bfloat16, "f32"),
                               (torch.bfloat16, "storage")):
        x = torch.randn(a.n, a.h, generator=g).to(dtype).to(a.device)
        w = (torch.randn(a.v, a.h, generator=g) / a.h ** 0.5).to(dtype).to(a.device)
        y = torch.randint(0, a.v, (a.n,), generator=g).to(a.device)
        for eager in (True, False):  # warm-up
            step_seconds(x, w, y, eager, grad_logits)
        times = {True: [], False: []}
        for _ in range(a.rounds):
            for eager in (False, True):
                times[eager].append(step_seconds(x, w, y, eager, grad_logits))
        fmt = lambda ts: ", ".join(f"{t:.3f}" for t in ts)  # noqa: E731
        print(f"N={a.n} H={a.h} V={a.v} {str(dtype)[6:]} dlogits {grad_logits}: "
              f"recomputed {fmt(times[False])} s; in forward {fmt(times[True])} s", flush=True)


if __name__ == "__main__":
    main()
