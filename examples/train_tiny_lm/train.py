#!/usr/bin/python3
"""Trains a tiny language model on CPU with flce's loss instead of logits.

The text is the GNU GPL version 3 as Debian ships it
(/usr/share/common-licenses/GPL-3). Tokens are byte pairs: the text is cut
into 2-byte pieces at both offsets (0 and 1), which gives about 1000
distinct tokens, so the LM head (hidden -> vocabulary) is the largest matmul
in the model. The model: an embedding of the previous --context tokens, one
MLP block (Linear, GELU, Linear, LayerNorm) and the LM head, trained with
Adam on random batches. The loss is flce.torch.LinearCrossEntropyLoss: the
[batch, V] logits are never materialized.

Then the same training step is run with materialized logits
(F.cross_entropy(head(h), y)) and both steps' peak memory is measured; see
measure_step() for how. Finally the validation set's hidden states and the
head weight are saved for `flce eval`.

    /usr/bin/python3 examples/train_tiny_lm/train.py [--steps 200] [--threads 1] [--out DIR]

flce's Python package is imported from $FLCE_PYTHONPATH, else from the
build tree (build/python next to this repository's examples/). The `flce
eval` command printed at the end names $FLCE_BIN, else build/flce.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.environ.get("FLCE_PYTHONPATH", os.path.join(REPO, "build", "python")))
import flce  # noqa: E402
import flce.torch  # noqa: E402


def tokenize(path):
    """Byte pairs at offsets 0 and 1: two token streams and the vocabulary."""
    data = open(path, "rb").read()
    streams = [[data[i:i + 2] for i in range(off, len(data) - 1, 2)] for off in (0, 1)]
    vocab = sorted({p for s in streams for p in s})
    index = {p: i for i, p in enumerate(vocab)}
    return [np.array([index[p] for p in s], dtype=np.int64) for s in streams], vocab


def windows(stream, context):
    """(contexts [T, context], targets [T]) of every position."""
    idx = np.arange(context, len(stream))
    ctx = np.stack([stream[idx - context + k] for k in range(context)], axis=1)
    return ctx, stream[idx]


class TinyLM(torch.nn.Module):
    def __init__(self, vocab, context, embed, hidden):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, embed)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(context * embed, hidden), torch.nn.GELU(),
                                       torch.nn.Linear(hidden, hidden), torch.nn.LayerNorm(hidden))
        self.head = torch.nn.Linear(hidden, vocab, bias=False)  # W [V, hidden]

    def hidden(self, ctx):
        return self.mlp(self.embed(ctx).flatten(1))


def build(args):
    torch.manual_seed(args.seed)
    streams, vocab = tokenize(args.text)
    train, val = [], []
    for s in streams:  # the last 10% of each stream is held out
        cut = int(len(s) * 0.9)
        train.append(windows(s[:cut], args.context))
        val.append(windows(s[cut - args.context:], args.context))
    cat = lambda parts, k: torch.from_numpy(np.concatenate([p[k] for p in parts]))  # noqa: E731
    data = {"train_x": cat(train, 0), "train_y": cat(train, 1),
            "val_x": cat(val, 0), "val_y": cat(val, 1)}
    model = TinyLM(len(vocab), args.context, args.embed, args.hidden)
    return model, data, len(vocab)


def make_step(model, opt, loss_kind, threads):
    """One training step with flce's loss or with materialized logits."""
    flce_loss = flce.torch.LinearCrossEntropyLoss(threads=threads)

    def step(ctx, y):
        h = model.hidden(ctx)
        if loss_kind == "flce":
            loss = flce_loss(h, model.head.weight, y)
        else:
            loss = F.cross_entropy(model.head(h), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return float(loss)
    return step


def rss_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure_step(args):
    """Runs in a fresh subprocess (see compare_memory): the peak resident
    memory of a training step above the steady state between steps.

    torch 1.13 has no CPU allocator statistics and tracemalloc does not see
    torch's allocations, so this reads the kernel's counters: after two
    warm-up steps (optimizer state allocated, thread pools started), VmRSS is
    the steady state; writing 5 to /proc/self/clear_refs resets the
    high-water mark VmHWM, and after --measure-steps more steps VmHWM - VmRSS
    (before) is what the step needed at its peak. The parent sets
    MALLOC_MMAP_THRESHOLD_ so that glibc returns every large block to the
    kernel when it is freed (otherwise freed logits stay resident and inflate
    the steady state of the materialized run)."""
    torch.set_num_threads(args.threads)
    model, data, _ = build(args)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    step = make_step(model, opt, args.measure, args.threads)
    g = torch.Generator().manual_seed(args.seed)
    batches = [torch.randint(0, len(data["train_y"]), (args.batch,), generator=g)
               for _ in range(2 + args.measure_steps)]
    for b in batches[:2]:
        step(data["train_x"][b], data["train_y"][b])
    base = rss_kib("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as exc:  # not Linux, or a sandbox that forbids it
        print(json.dumps({"peak_kib": None, "why": f"cannot reset VmHWM: {exc}"}))
        return
    t0 = time.perf_counter()
    for b in batches[2:]:
        step(data["train_x"][b], data["train_y"][b])
    seconds = (time.perf_counter() - t0) / args.measure_steps
    print(json.dumps({"peak_kib": rss_kib("VmHWM") - base, "ms_per_step": 1e3 * seconds}))


def compare_memory(args, vocab):
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    results = {}
    for kind in ("flce", "materialized"):
        cmd = [sys.executable, os.path.abspath(__file__), "--measure", kind] + [
            f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
            ("text", "batch", "context", "embed", "hidden", "lr", "seed", "threads",
             "measure_steps")]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode != 0:  # the child's own error, not only its exit status
            sys.exit(f"train.py --measure {kind} failed ({out.returncode}):\n{out.stderr}")
        results[kind] = json.loads(out.stdout.strip().splitlines()[-1])
    logits_mib = args.batch * vocab * 4 / 2**20
    print(f"peak memory of a training step above the steady state (batch {args.batch}, "
          f"V {vocab}; one [batch, V] float32 logits array is {logits_mib:.1f} MiB):")
    for kind, r in results.items():
        if r["peak_kib"] is None:
            print(f"  {kind:>12}: unavailable ({r['why']})")
        else:
            print(f"  {kind:>12}: {r['peak_kib'] / 1024:7.1f} MiB   "
                  f"{r['ms_per_step']:6.1f} ms/step")
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--context", type=int, default=4)
    p.add_argument("--embed", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    # One thread by default: OpenMP workers spin-wait, and on cores shared
    # with other jobs two threads ran 10-30x slower than one. On an idle
    # machine pass --threads $(nproc).
    p.add_argument("--threads", type=int, default=1, help="torch and flce threads")
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "flce_tiny_lm"),
                   help="where H.npy, W.npy, Y.npy go")
    p.add_argument("--no-memory", action="store_true", help="skip the memory comparison")
    p.add_argument("--measure-steps", type=int, default=2)
    p.add_argument("--measure", choices=("flce", "materialized"), help=argparse.SUPPRESS)
    args = p.parse_args()
    for name in ("steps", "batch", "context", "embed", "hidden", "threads", "measure_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} = {getattr(args, name)}: must be at least 1")
    if args.measure:
        return measure_step(args)

    torch.set_num_threads(args.threads)
    model, data, vocab = build(args)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    step = make_step(model, opt, "flce", args.threads)

    def val_loss():
        with torch.no_grad():
            h = model.hidden(data["val_x"])
            r = flce.forward(h, model.head.weight, data["val_y"], threads=args.threads)
            return float(r.loss), h, r.backend

    g = torch.Generator().manual_seed(args.seed)
    start_val, _, backend = val_loss()
    print(f"text {args.text}: {len(data['train_y'])} training and {len(data['val_y'])} "
          f"validation tokens, vocabulary {vocab} byte pairs; flce backend {backend} (the "
          f"one that ran), {args.threads} threads")
    print(f"step {0:5d}  validation loss {start_val:.4f} (a uniform guess: ln V = "
          f"{math.log(vocab):.4f})")
    t0, first = time.perf_counter(), None
    every = max(1, args.steps // 10)
    for i in range(1, args.steps + 1):
        b = torch.randint(0, len(data["train_y"]), (args.batch,), generator=g)
        loss = step(data["train_x"][b], data["train_y"][b])
        first = loss if first is None else first
        if i % every == 0 or i == args.steps:
            print(f"step {i:5d}  training loss {loss:.4f}  validation loss {val_loss()[0]:.4f}")
    seconds = time.perf_counter() - t0
    end_val, h, _ = val_loss()
    print(f"trained {args.steps} steps in {seconds:.1f} s; validation loss {start_val:.4f} -> "
          f"{end_val:.4f}")
    print(f"RESULT first_train_loss={first:.4f} last_train_loss={loss:.4f} "
          f"val_start={start_val:.4f} val_end={end_val:.4f}")

    if not args.no_memory:
        compare_memory(args, vocab)

    os.makedirs(args.out, exist_ok=True)
    np.save(os.path.join(args.out, "H.npy"), h.numpy().astype(np.float32))
    np.save(os.path.join(args.out, "W.npy"), model.head.weight.detach().numpy().astype(np.float32))
    np.save(os.path.join(args.out, "Y.npy"), data["val_y"].numpy())
    flce_bin = os.environ.get("FLCE_BIN", os.path.join(REPO, "build", "flce"))
    out = os.path.abspath(args.out)
    print(f"saved the validation hidden states and the head; evaluate them with\n  {flce_bin} eval "
          f"--x {out}/H.npy --w {out}/W.npy --labels {out}/Y.npy")


if __name__ == "__main__":
    main()
