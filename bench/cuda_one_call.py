"""One flce call on the GPU at a benchmark head, for a profiler to watch
(bench/cuda_ncu.sh): python3 bench/cuda_one_call.py gemma2|llama3|h1024 fwd|step"""
import os
import sys

import torch

import flce

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_bench import SHAPES  # noqa: E402  (the benchmark's heads)

if len(sys.argv) != 3 or sys.argv[1] not in SHAPES or sys.argv[2] not in ("fwd", "step"):
    raise SystemExit(f"usage: {sys.argv[0]} {'|'.join(SHAPES)} fwd|step")
n, h, v, k = SHAPES[sys.argv[1]]
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(n, h, device="cuda", generator=g).to(torch.bfloat16)
w = (torch.randn(v, h, device="cuda", generator=g) / h ** 0.5).to(torch.bfloat16)
y = torch.randint(0, v, (n,), device="cuda", generator=g)
if sys.argv[2] == "fwd":
    flce.forward(x, w, y, softcap=k, backend="cuda")
else:
    flce.loss_and_grad(x, w, y, softcap=k, grad_logits_dtype="storage", grad_dtype="input",
                       backend="cuda")
torch.cuda.synchronize()
