"""Shared pieces of the flce Python package tests (test_package_*.py), and
checks of the independent reference they compare against.

* import_flce(): imports the package from the build tree ($FLCE_PYTHONPATH,
  default build/python in this checkout) or skips the calling module with a clear
  message when it is not built.
* reference(): the README's semantics written directly in float64 PyTorch,
  gradients by autograd. It shares no code with flce (its storage decoding
  included), so a mistake in flce cannot hide behind the same mistake here.
* norm_close(): the norm-wise relative comparison of tests/python:
  ||got - want|| <= rtol ||want||, or ||got|| <= rtol when want is all zero.

Run: /usr/bin/python3 -m pytest -q tests/python/test_package_*.py
"""

import os
import sys

import pytest

np = pytest.importorskip("numpy", reason="needs numpy: run with /usr/bin/python3")
torch = pytest.importorskip("torch", reason="needs torch: run with /usr/bin/python3")
F = torch.nn.functional

DEFAULT_PYTHONPATH = os.path.normpath(
    os.path.join(os.path.dirname(__file__), "..", "..", "build", "python"))


def import_flce():
    """flce, imported from the build tree; a module-level skip where no path
    was named and build/python has no module, but a failure where
    $FLCE_PYTHONPATH names the build (ctest does): a module that was built
    and does not load (an undefined symbol, another Python) must not read as
    a passing run."""
    path = os.environ.get("FLCE_PYTHONPATH", DEFAULT_PYTHONPATH)
    if path not in sys.path:
        sys.path.insert(0, path)
    try:
        import flce
        import flce.testing  # noqa: F401
        import flce.torch  # noqa: F401
    except ImportError as exc:
        if "FLCE_PYTHONPATH" in os.environ:
            raise ImportError(f"FLCE_PYTHONPATH={path}: flce's Python module does not import "
                              f"from there ({exc})") from exc
        pytest.skip(f"flce's Python module is not importable from {path!r} ({exc}); build it "
                    f"(cmake -S . -B build -DPython3_EXECUTABLE=/usr/bin/python3 && cmake "
                    f"--build build) or set FLCE_PYTHONPATH", allow_module_level=True)
    return flce


def to_f64(a):
    """Exact float64 values of an input, decoded here (not by flce)."""
    if isinstance(a, torch.Tensor):
        return a.detach().to(torch.float32 if a.dtype in (torch.bfloat16, torch.float16)
                             else a.dtype).double().cpu()
    a = np.asarray(a)
    if a.dtype == np.uint16:  # bfloat16 bit patterns
        a = (a.astype(np.uint32) << 16).view(np.float32)
    return torch.from_numpy(np.ascontiguousarray(a).astype(np.float64))


def reference(*, labels, x=None, w=None, bias=None, logits=None, token_weights=None,
              class_weights=None, grad_loss=None, grad_lse=None, grad_entropy=None,
              logit_scale=1.0, softcap=0.0, ignore_index=-100, label_smoothing=0.0,
              z_loss=0.0, reduction="mean", w_layout="vh", **_):
    """Every output and gradient of the README's semantics, float64 numpy."""
    leaves = {}

    def leaf(name, value):
        leaves[name] = to_f64(value).requires_grad_(True)
        return leaves[name]

    if logits is not None:
        u = leaf("grad_logits", logits)
    else:
        xt, wt = leaf("grad_x", x), leaf("grad_w", w)
        u = xt @ (wt if w_layout == "vh" else wt.T).T
        if bias is not None:
            u = u + leaf("grad_bias", bias)
    n, v = u.shape
    a, k, e, l = logit_scale, softcap, label_smoothing, z_loss
    z = a * u
    s = k * torch.tanh(z / k) if k > 0 else z
    lse = torch.logsumexp(s, dim=1)
    logp = s - lse[:, None]
    p = torch.exp(logp)
    entropy = lse - (p * s).sum(dim=1)
    y = torch.as_tensor(to_f64(labels)).long()
    kept = y != ignore_index
    yc = torch.where(kept, y, torch.zeros_like(y))
    t = torch.ones(n, dtype=torch.float64) if token_weights is None else to_f64(token_weights)
    c = torch.ones(v, dtype=torch.float64) if class_weights is None else to_f64(class_weights)
    logp_y = logp.gather(1, yc[:, None]).squeeze(1)
    ce = -(1 - e) * c[yc] * logp_y - (e / v) * (c * logp).sum(dim=1)
    zl = l * lse * lse
    zero = torch.zeros((), dtype=torch.float64)
    rows = torch.where(kept, t * (ce + zl), zero)
    denominator = torch.where(kept, t * c[yc], zero).sum()
    if reduction == "none":
        loss = rows
    elif reduction == "sum":
        loss = rows.sum()
    else:
        loss = rows.sum() / denominator if denominator > 0 else rows.sum() * 0.0
    g_loss = torch.ones_like(loss) if grad_loss is None else to_f64(grad_loss).reshape(loss.shape)
    objective = (g_loss * loss).sum()
    if grad_lse is not None:
        objective = objective + (to_f64(grad_lse) * lse).sum()
    if grad_entropy is not None:
        objective = objective + (to_f64(grad_entropy) * entropy).sum()
    names = list(leaves)
    grads = torch.autograd.grad(objective, [leaves[k] for k in names], allow_unused=True)
    out = {"loss": loss, "lse": lse, "logprob": torch.where(kept, logp_y, zero),
           "argmax": torch.argmax(s, dim=1), "entropy": entropy, "zloss": zl}
    out.update({name: g for name, g in zip(names, grads)})
    return {k: v.detach().numpy() for k, v in out.items()}


def as_numpy(a):
    if isinstance(a, torch.Tensor):
        return a.detach().to(torch.float64 if a.is_floating_point() else torch.int64).cpu().numpy()
    a = np.asarray(a)
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a


def norm_close(name, got, want, rtol):
    got, want = as_numpy(got).astype(np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{name}: shape {got.shape}, expected {want.shape}"
    scale = np.linalg.norm(want)
    err = np.linalg.norm(got - want)
    assert err <= rtol * (scale if scale > 0 else 1.0), (
        f"{name}: ||got - want|| = {err:.3e} > {rtol:g} * ||want|| = {rtol * scale:.3e}")


def peaky_bf16_head(n=64, h=16, v=4096, seed=3):
    """x [n, h] and W [v, h] as bf16 torch tensors, and int64 labels, of a
    head shaped like a trained LM's (as flce bench --data peaky): x_0 = 1 and
    W_j0 = -2 ln(j + 1) put most probability on the first classes, labels
    drawn Zipf-like, so bf16's auto filter eps (2^-12) lets the cpu backend's
    gradient filter skip the far vocabulary tiles."""
    rng = np.random.default_rng(seed)
    x = np.concatenate([np.ones((n, 1)), rng.standard_normal((n, h - 1))], axis=1)
    w = np.concatenate([-2 * np.log(np.arange(1, v + 1))[:, None],
                        rng.standard_normal((v, h - 1)) / np.sqrt(h - 1)], axis=1)
    y = np.minimum(rng.zipf(2.0, n) - 1, v - 1)
    return torch.tensor(x, dtype=torch.bfloat16), torch.tensor(w, dtype=torch.bfloat16), y


# --- the reference against PyTorch's own cross-entropy -------------------------

@pytest.mark.parametrize("smoothing", [0.0, 0.3])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reference_matches_torch_cross_entropy(smoothing, reduction):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 6, generator=g, dtype=torch.float64)
    w = torch.randn(13, 6, generator=g, dtype=torch.float64)
    b = torch.randn(13, generator=g, dtype=torch.float64)
    cw = torch.rand(13, generator=g, dtype=torch.float64) + 0.5
    y = torch.randint(0, 13, (9,), generator=g)
    y[2] = -100
    ref = reference(x=x, w=w, bias=b, labels=y, class_weights=cw, label_smoothing=smoothing,
                    reduction=reduction)
    xt, wt, bt = (t.clone().requires_grad_(True) for t in (x, w, b))
    loss = F.cross_entropy(F.linear(xt, wt, bt), y, weight=cw, label_smoothing=smoothing,
                           reduction=reduction)
    loss.sum().backward()
    norm_close("loss", ref["loss"], loss.detach().numpy(), 1e-13)
    for name, t in (("grad_x", xt), ("grad_w", wt), ("grad_bias", bt)):
        norm_close(name, ref[name], t.grad.numpy(), 1e-12)
