"""How a fused LM-head + cross-entropy kernel is tested against flce.

`candidate` below stands in for a GPU kernel (Triton, CUDA, ...): a plain
PyTorch implementation that walks the tokens in chunks, never holding more
than [chunk, V] logits, and computes the loss, the lse and the gradients by
hand. The test feeds it flce.testing's adversarial inputs and judges every
output with flce.testing.assert_close: expected values from flce's float64
`reference` backend, allowed errors from the tolerance policy (a rounding
error bound derived from the problem and the candidate's precisions, C = 1).

To test a real kernel, replace `candidate` (and `like="torch"` inputs go to
the GPU with `.cuda()`; assert_close takes CUDA tensors and copies them to
the host for the comparison). Runs on CPU here:

    FLCE_PYTHONPATH=build/python /usr/bin/python3 -m pytest -q examples/gpu_kernel_test
"""

import os
import sys

import pytest

torch = pytest.importorskip("torch", reason="needs torch (apt python3-torch)")

# The build tree's package unless FLCE_PYTHONPATH names another one.
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.environ.get("FLCE_PYTHONPATH", os.path.join(_REPO, "build", "python")))
if "FLCE_PYTHONPATH" in os.environ:  # named: a module that does not import is an error
    import flce.testing as flce_testing
else:
    flce_testing = pytest.importorskip(
        "flce.testing", reason="flce's Python module is not built: cmake --build build, or set "
                               "FLCE_PYTHONPATH to the build's python/ directory")


def candidate(x, W, y, bias=None, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
              chunk=32, dlogits_dtype=None, grad_dtype=torch.float32, shift=True):
    """Mean cross-entropy (flce's semantics) of x @ W.T + bias, chunk by chunk,
    in float32 whatever the storage dtype. dlogits_dtype: cast the gradient of
    the logits to it before the two gradient GEMMs (what bf16 kernels do).
    shift=False drops the max shift of the softmax (a bug, for the demo)."""
    xf, wf = x.float(), W.float()
    bf = None if bias is None else bias.float()
    n, v = x.shape[0], W.shape[0]
    e, l = label_smoothing, z_loss
    valid = y != ignore_index
    d = valid.sum().float()
    scale = 1.0 / d if d > 0 else 0.0  # a mean over no rows is 0 (flce), not NaN
    loss = torch.zeros((), dtype=torch.float32)
    lse = torch.empty(n, dtype=torch.float32)
    gx, gw = torch.empty_like(xf), torch.zeros_like(wf)
    gb = None if bias is None else torch.zeros_like(bf)
    for i0 in range(0, n, chunk):
        rows = slice(i0, min(n, i0 + chunk))
        z = xf[rows] @ wf.T + (0.0 if bf is None else bf)
        m = z.max(dim=1, keepdim=True).values if shift else torch.zeros_like(z[:, :1])
        lse_c = (m + torch.log(torch.exp(z - m).sum(dim=1, keepdim=True))).squeeze(1)
        lse[rows] = lse_c
        logp = z - lse_c[:, None]
        keep = valid[rows]
        yc = torch.where(keep, y[rows], torch.zeros_like(y[rows]))
        at = torch.arange(yc.shape[0])
        ce = -(1 - e) * logp[at, yc] - e / v * logp.sum(dim=1)
        loss = loss + torch.where(keep, ce + l * lse_c * lse_c, torch.zeros_like(ce)).sum()
        # d mean / d z = (p (1 + 2 l lse) - (1-e) onehot(y) - e/V) / D on kept rows.
        g = torch.exp(logp) * (1 + 2 * l * lse_c)[:, None] - e / v
        g[at, yc] -= 1 - e
        g = g * (keep.float() * scale)[:, None]
        if dlogits_dtype is not None:
            g = g.to(dlogits_dtype).float()
        gx[rows] = g @ wf
        gw += g.T @ xf[rows]
        if gb is not None:
            gb += g.sum(dim=0)
    grads = {"grad_x": gx, "grad_w": gw} | ({} if gb is None else {"grad_bias": gb})
    return {"loss": loss * scale, "lse": lse} | {k: t.to(grad_dtype) for k, t in grads.items()}


CASES = sorted(flce_testing.ADVERSARIAL_CASES)


@pytest.mark.parametrize("case", CASES)
def test_float32_candidate(case):
    inputs = flce_testing.adversarial_inputs(case, n=96, h=32, like="torch", bias=True)
    out = candidate(inputs["x"], inputs["w"], inputs["labels"], inputs.get("bias"),
                    ignore_index=inputs["ignore_index"])
    # float32 accumulation, logits held in float32, outputs in float32.
    flce_testing.assert_close(out, **inputs, accumulate="float32")


@pytest.mark.parametrize("case", ["normal", "large_100", "peaky_zipf_2", "vocab_513"])
def test_bfloat16_candidate_with_smoothing_and_zloss(case):
    # bf16 storage, f32 accumulation, dlogits cast to bf16 before the
    # gradient GEMMs, gradients returned in bf16: the usual GPU recipe.
    inputs = flce_testing.adversarial_inputs(case, n=64, h=32, like="torch",
                                             dtype="bfloat16", bias=True)
    opts = dict(label_smoothing=0.1, z_loss=1e-4)
    out = candidate(inputs["x"], inputs["w"], inputs["labels"], inputs.get("bias"),
                    ignore_index=inputs["ignore_index"], **opts,
                    dlogits_dtype=torch.bfloat16, grad_dtype=torch.bfloat16)
    flce_testing.assert_close(out, **inputs, **opts, accumulate="float32",
                              grad_cast="bfloat16")


def test_policy_catches_a_missing_max_shift():
    inputs = flce_testing.adversarial_inputs("large_1000", n=32, h=16, like="torch")
    out = candidate(inputs["x"], inputs["w"], inputs["labels"], shift=False)
    with pytest.raises(AssertionError, match="NaN/Inf position mismatches"):
        flce_testing.assert_close(out, **inputs)


def test_policy_catches_wrong_mean_over_ignored_rows():
    inputs = flce_testing.adversarial_inputs("ignored_rows", n=64, h=16, like="torch")
    out = candidate(inputs["x"], inputs["w"], inputs["labels"], ignore_index=-100)
    kept = (inputs["labels"] != -100).sum()
    out["loss"] = out["loss"] * kept / inputs["labels"].numel()  # divides by N, not D
    with pytest.raises(AssertionError, match="loss: 1 of 1 elements exceed"):
        flce_testing.assert_close({"loss": out["loss"]}, **inputs)
