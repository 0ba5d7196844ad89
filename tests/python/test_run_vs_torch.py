"""Cross-checks `flce run --backend reference` against an independent float64
PyTorch autograd implementation of the fused linear cross-entropy semantics.

Run with Debian's interpreter:  /usr/bin/python3 -m pytest -q tests/python

Every case is generated deterministically (its own seed), so a failure can be
reproduced with `-k <case id>`.  On failure the exact flce command line and
its stdout/stderr are printed.

Tolerance (see `assert_close`): norm-wise relative,
    ||got - expected||_2 <= RTOL * ||expected||_2            if ||expected|| > 0
    ||got||_2            <= RTOL                              if ||expected|| == 0
i.e. the scale is max(||expected||, tiny) except that an exactly-zero reference
falls back to the absolute bound RTOL (1e-10): arrays that are zero by
definition (the loss gradients of an all-ignored mean, z-loss with l == 0,
logprob of ignored rows, ...) must come out zero up to 1e-10.

The reference is deliberately the straightforward one: materialized logits,
torch.log_softmax / logsumexp, autograd for every gradient.  To keep the
comparison a test of flce rather than of ill-conditioning, the generated data
avoid regimes where float64 itself cannot give 1e-10 relative accuracy:
  * softcap arguments |z/k| stay moderate except in the one case that tests
    exact tanh saturation (where the saturated derivatives are ~1e-26, far
    below the tolerance relative to the unsaturated entries);
  * the "big logits" cases (|z| ~ 50..100) put a large common offset on the
    logits with a modest spread, so rows are not so peaked that the entropy
    (a difference of ~100-sized quantities) loses its relative accuracy.
"""

import dataclasses
import math
import os
import random
import subprocess
from typing import Optional

import pytest

np = pytest.importorskip(
    "numpy",
    reason="numpy missing: run with /usr/bin/python3 (apt python3-numpy)")
torch = pytest.importorskip(
    "torch",
    reason="torch missing: run with /usr/bin/python3 (apt python3-torch)")

RTOL = 1e-10
RTOL_F32_OUT = 1e-6

BASE_OUTPUTS = ("loss", "lse", "logprob", "argmax", "entropy", "zloss")


# --------------------------------------------------------------------------
# Test-case description
# --------------------------------------------------------------------------

@dataclasses.dataclass
class Case:
    name: str
    seed: int
    N: int = 4
    H: int = 8
    V: int = 10
    layout: Optional[str] = None        # None (flag omitted, = vh), "vh", "hv"
    dtype: Optional[str] = None         # None, "f32", "bf16", "f16"
    file_dtype: str = "f32"             # storage of x/W/bias/logits files
    scale: Optional[float] = None       # --logit-scale (None: omitted, = 1)
    softcap: Optional[float] = None     # --softcap     (None: omitted, = 0)
    ignore_index: Optional[int] = None  # --ignore-index (None: omitted, = -100)
    ignore_mode: str = "none"           # "none", "some", "all"
    smoothing: Optional[float] = None   # --label-smoothing
    zloss: Optional[float] = None       # --z-loss
    reduction: Optional[str] = None     # None (omitted, = mean), none/sum/mean
    bias: bool = False
    token_weights: Optional[str] = None  # None, "pos", "mixed", "zero"
    class_weights: Optional[str] = None  # None, "pos", "mixed"
    weight_file_dtype: str = "f64"      # storage of token/class weights
    grad: bool = True
    grad_loss: bool = False
    grad_lse: bool = False
    grad_entropy: bool = False
    label_dtype: str = "int64"
    logits_entry: bool = False
    data: str = "normal"                # "normal", "big", "ties", "saturate"
    threads: Optional[int] = None

    @property
    def ii(self):
        return -100 if self.ignore_index is None else self.ignore_index

    @property
    def a(self):
        return 1.0 if self.scale is None else self.scale

    @property
    def k(self):
        return 0.0 if self.softcap is None else self.softcap

    @property
    def e(self):
        return 0.0 if self.smoothing is None else self.smoothing

    @property
    def l(self):
        return 0.0 if self.zloss is None else self.zloss

    @property
    def red(self):
        return "mean" if self.reduction is None else self.reduction


def _targeted_cases():
    C = Case
    return [
        C("basic", 1),
        C("defaults_explicit", 2, layout="vh", scale=1.0, softcap=0.0,
          ignore_index=-100, smoothing=0.0, zloss=0.0, reduction="mean"),
        C("scale_0.5", 3, scale=0.5),
        C("scale_2.3", 4, scale=2.3, N=6, H=12, V=17),
        C("softcap_1.5", 5, softcap=1.5),
        C("softcap_30", 6, softcap=30.0, scale=2.3),
        C("smoothing_0.1", 7, smoothing=0.1),
        C("smoothing_0.7", 8, smoothing=0.7, V=23),
        C("zloss_1e-3", 9, zloss=1e-3),
        C("zloss_0.1", 10, zloss=0.1, N=7),
        C("ignore_some_default", 11, ignore_mode="some", N=9),
        C("ignore_custom_-1", 12, ignore_index=-1, ignore_mode="some", N=8),
        C("ignore_custom_7_in_range", 13, ignore_index=7, ignore_mode="some",
          N=12, V=9),
        C("token_weights", 14, token_weights="pos", N=7),
        C("class_weights", 15, class_weights="mixed", ignore_mode="some",
          N=10, V=12, weight_file_dtype="f32"),
        C("bias", 16, bias=True),
        C("reduction_none", 17, reduction="none", ignore_mode="some", N=6),
        C("reduction_sum", 18, reduction="sum", ignore_mode="some", N=6,
          token_weights="pos"),
        C("all_ignored_mean", 19, ignore_mode="all", N=5),
        C("all_ignored_mean_cotangents", 20, ignore_mode="all", N=5,
          grad_loss=True, grad_lse=True, grad_entropy=True, zloss=0.1,
          smoothing=0.1, bias=True),
        C("all_ignored_sum", 21, ignore_mode="all", reduction="sum",
          ignore_index=-1, grad_lse=True),
        C("zero_token_weights_mean", 22, token_weights="zero", N=4,
          grad_entropy=True),
        C("cotangents_none_reduction", 23, reduction="none", grad_loss=True,
          grad_lse=True, grad_entropy=True, ignore_mode="some", N=8),
        C("cotangents_mean", 24, grad_loss=True, grad_lse=True,
          grad_entropy=True, zloss=1e-3, class_weights="pos"),
        C("layout_hv", 25, layout="hv", bias=True, N=5, H=7, V=13),
        C("dtype_f32_from_f64", 26, dtype="f32", file_dtype="f64", bias=True),
        C("dtype_bf16", 27, dtype="bf16", bias=True, N=6, H=16, V=31),
        C("dtype_f16", 28, dtype="f16", bias=True, layout="hv"),
        C("labels_int32", 29, label_dtype="int32", ignore_mode="some", N=7),
        C("float64_files", 30, file_dtype="f64", bias=True, smoothing=0.1),
        C("float16_files", 31, file_dtype="f16", bias=True),
        C("float16_files_dtype_bf16", 32, file_dtype="f16", dtype="bf16"),
        C("logits_basic", 33, logits_entry=True, N=5, V=11),
        C("logits_all_options_bf16", 34, logits_entry=True, dtype="bf16",
          scale=0.5, softcap=1.5, smoothing=0.1, zloss=0.1,
          ignore_index=-1, ignore_mode="some", token_weights="mixed",
          class_weights="pos", reduction="sum", grad_loss=True, grad_lse=True,
          grad_entropy=True, label_dtype="int32", N=9, V=19),
        C("logits_all_ignored_mean", 35, logits_entry=True, ignore_mode="all",
          grad_entropy=True),
        C("V1", 36, V=1, zloss=0.1, smoothing=0.1, grad_lse=True,
          grad_entropy=True, bias=True),
        C("V1_plain", 37, V=1, N=3),
        C("N1", 38, N=1, H=5, V=7, bias=True, token_weights="pos"),
        C("H1", 39, H=1, V=6, N=5, layout="hv"),
        C("N1_H1_V1", 40, N=1, H=1, V=1, logits_entry=False, reduction="sum"),
        C("big_logits_bias", 41, data="big", bias=True, N=6, H=6, V=20,
          zloss=1e-3),
        C("big_logits_bf16_softcap30", 42, data="big", dtype="bf16",
          softcap=30.0, zloss=0.1, smoothing=0.1, grad_lse=True,
          grad_entropy=True, N=8, V=25, layout="hv"),
        C("big_logits_entry", 43, data="big", logits_entry=True, N=7, V=30,
          grad_lse=True, grad_entropy=True, reduction="none"),
        C("big_logits_negative_scale2.3", 44, data="big", scale=2.3,
          logits_entry=True, V=16),
        C("ties_logits", 45, data="ties", logits_entry=True, N=10, V=8,
          scale=2.3, dtype="bf16"),
        C("ties_x_zero_rows", 46, data="ties", N=6, H=4, V=9, softcap=1.5),
        C("softcap_saturated_ties", 47, data="saturate", logits_entry=True,
          softcap=1.5, N=6, V=12, grad_entropy=True),
        C("no_grad_threads2", 48, grad=False, threads=2, smoothing=0.1,
          zloss=1e-3, bias=True, ignore_mode="some", N=8),
        C("grad_threads2_hv", 49, threads=2, layout="hv", bias=True,
          class_weights="pos", token_weights="pos", N=12, H=16, V=40),
        C("kitchen_sink", 50, layout="hv", dtype="bf16", bias=True,
          scale=2.3, softcap=30.0, smoothing=0.7, zloss=0.1, ignore_index=7,
          ignore_mode="some", token_weights="mixed", class_weights="mixed",
          reduction="mean", grad_loss=True, grad_lse=True, grad_entropy=True,
          label_dtype="int32", N=12, H=16, V=40),
    ]


def _random_cases(count=14):
    cases = []
    for i in range(count):
        r = random.Random(7000 + i)
        logits_entry = r.random() < 0.25
        V = r.randint(1, 40)
        N = r.randint(1, 12)
        H = r.randint(1, 16)
        dtype = r.choice([None, "f32", "bf16", "f16"])
        ignore_index = r.choice([None, -1, 7, 3])
        ignore_mode = r.choice(["none", "some", "some", "all"])
        if ignore_mode == "all" and r.random() < 0.7:
            ignore_mode = "some"
        reduction = r.choice([None, "none", "sum", "mean"])
        grad = r.random() < 0.85
        cases.append(Case(
            name=f"random{i:02d}", seed=100 + i, N=N, H=H, V=V,
            layout=r.choice([None, "vh", "hv"]), dtype=dtype,
            scale=r.choice([None, 1.0, 0.5, 2.3]),
            softcap=r.choice([None, 0.0, 1.5, 30.0]),
            ignore_index=ignore_index, ignore_mode=ignore_mode,
            smoothing=r.choice([None, 0.0, 0.1, 0.7]),
            zloss=r.choice([None, 0.0, 1e-3, 0.1]),
            reduction=reduction,
            bias=(not logits_entry) and r.random() < 0.5,
            token_weights=r.choice([None, "pos", "mixed"]),
            class_weights=r.choice([None, "pos", "mixed"]),
            weight_file_dtype=r.choice(["f32", "f64"]),
            grad=grad,
            grad_loss=grad and r.random() < 0.5,
            grad_lse=grad and r.random() < 0.5,
            grad_entropy=grad and r.random() < 0.5,
            label_dtype=r.choice(["int32", "int64"]),
            logits_entry=logits_entry,
            threads=r.choice([None, None, 1, 2]),
        ))
    return cases


CASES = _targeted_cases() + _random_cases()


# --------------------------------------------------------------------------
# Data generation
# --------------------------------------------------------------------------

_NP_FILE_DTYPES = {"f32": "float32", "f64": "float64", "f16": "float16"}


def _make_data(case):
    """Returns the arrays to write (file values) as a dict of numpy arrays."""
    rng = np.random.default_rng(case.seed)
    N, H, V = case.N, case.H, case.V
    fdt = np.dtype(_NP_FILE_DTYPES[case.file_dtype])
    d = {}

    if case.logits_entry:
        if case.data == "big":
            logits = 75.0 + 8.0 * rng.standard_normal((N, V))
            if case.scale is not None and case.scale > 1:
                logits = -logits / case.scale * 1.0  # |z| ~ 60..90, negative
        elif case.data == "ties":
            logits = np.round(rng.standard_normal((N, V)) * 2.0) / 2.0
        elif case.data == "saturate":
            logits = rng.standard_normal((N, V))
            for i in range(N):
                pos = rng.choice(V, size=3, replace=False)
                logits[i, pos] = 40.0 + 20.0 * rng.random(3)
            # Row 0: a smaller saturated logit before a larger one, so the
            # argmax of s (tie -> lowest index) differs from the argmax of z.
            logits[0, :] = rng.standard_normal(V)
            logits[0, 2] = 45.0
            logits[0, 5] = 60.0
        else:
            logits = 1.5 * rng.standard_normal((N, V))
        d["logits"] = logits.astype(fdt)
    else:
        x = rng.standard_normal((N, H))
        w = rng.standard_normal((V, H)) / math.sqrt(H)
        b = 0.5 * rng.standard_normal(V)
        if case.data == "big":
            # Large common offset, modest spread: z ~ 64 +- a few.
            x[:, 0] = 8.0
            w[:, 0] = 8.0 + 0.15 * rng.standard_normal(V)
            b = 1.0 * rng.standard_normal(V)
        elif case.data == "ties":
            x[::2, :] = 0.0  # every logit of these rows is exactly b_j (or 0)
        d["x"] = x.astype(fdt)
        w = w.astype(fdt)
        d["w"] = np.ascontiguousarray(w.T) if case.layout == "hv" else w
        if case.bias:
            d["bias"] = b.astype(fdt)

    # Labels
    labels = rng.integers(0, V, size=N)
    if case.ignore_mode == "some":
        mask = rng.random(N) < 0.35
        if N >= 2:
            mask[0] = True   # at least one ignored row
            mask[-1] = False  # at least one row with a real label
            if V > 0 and labels[-1] == case.ii:
                labels[-1] = (case.ii + 1) % V if V > 1 else 0
        labels[mask] = case.ii
    elif case.ignore_mode == "all":
        labels[:] = case.ii
    d["labels"] = labels.astype(np.dtype(case.label_dtype))

    wdt = np.dtype(_NP_FILE_DTYPES[case.weight_file_dtype])
    if case.token_weights == "pos":
        d["token_weights"] = rng.uniform(0.25, 2.0, N).astype(wdt)
    elif case.token_weights == "mixed":
        t = rng.uniform(0.25, 2.0, N)
        t[rng.random(N) < 0.3] = 0.0
        d["token_weights"] = t.astype(wdt)
    elif case.token_weights == "zero":
        d["token_weights"] = np.zeros(N, dtype=wdt)
    if case.class_weights == "pos":
        d["class_weights"] = rng.uniform(0.2, 2.0, V).astype(wdt)
    elif case.class_weights == "mixed":
        c = rng.uniform(0.2, 2.0, V)
        c[rng.random(V) < 0.25] = 0.0
        d["class_weights"] = c.astype(wdt)

    if case.grad_loss:
        if case.red == "none":
            d["grad_loss"] = rng.standard_normal(N)
        else:
            d["grad_loss"] = np.array(rng.standard_normal())  # 0-d
    if case.grad_lse:
        d["grad_lse"] = rng.standard_normal(N)
    if case.grad_entropy:
        d["grad_entropy"] = rng.standard_normal(N)
    return d


def _storage_round(arr, dtype):
    """float64 tensor of the values flce must compute from (--dtype rounding)."""
    t = torch.from_numpy(np.ascontiguousarray(arr))
    if dtype is None:
        return t.double()
    if dtype == "f32":
        return t.float().double()
    # bf16/f16 only from float32/float16 files (no double rounding): torch
    # converts float32 -> bfloat16/half with round-to-nearest-even.
    assert arr.dtype in (np.float32, np.float16), arr.dtype
    if dtype == "bf16":
        return t.float().to(torch.bfloat16).double()
    if dtype == "f16":
        return t.float().to(torch.float16).double()
    raise ValueError(dtype)


# --------------------------------------------------------------------------
# Independent float64 reference
# --------------------------------------------------------------------------

def reference(case, d):
    """Float64 autograd implementation of the spec.  Returns numpy outputs."""
    f64 = torch.float64
    a, k, e, l, ii = case.a, case.k, case.e, case.l, case.ii
    labels = torch.from_numpy(d["labels"].astype(np.int64))
    N = labels.shape[0]
    V = case.V

    leaves = {}
    if case.logits_entry:
        lg = _storage_round(d["logits"], case.dtype).requires_grad_(True)
        leaves["grad_logits"] = lg
        z = a * lg
    else:
        x = _storage_round(d["x"], case.dtype).requires_grad_(True)
        w = _storage_round(d["w"], case.dtype).requires_grad_(True)
        leaves["grad_x"] = x
        leaves["grad_w"] = w
        w_vh = w.t() if case.layout == "hv" else w
        u = x @ w_vh.t()
        if case.bias:
            b = _storage_round(d["bias"], case.dtype).requires_grad_(True)
            leaves["grad_bias"] = b
            u = u + b
        z = a * u

    s = k * torch.tanh(z / k) if k > 0 else z
    lse = torch.logsumexp(s, dim=1)
    logp = torch.log_softmax(s, dim=1)
    p = torch.exp(logp)
    entropy = -(p * logp).sum(dim=1)  # == lse - sum_j p_j s_j

    t = (torch.from_numpy(d["token_weights"].astype(np.float64))
         if "token_weights" in d else torch.ones(N, dtype=f64))
    c = (torch.from_numpy(d["class_weights"].astype(np.float64))
         if "class_weights" in d else torch.ones(V, dtype=f64))

    valid = labels != ii
    yc = torch.where(valid, labels, torch.zeros_like(labels))
    assert bool(((yc >= 0) & (yc < V)).all()), "bad labels generated"
    logp_y = logp.gather(1, yc[:, None]).squeeze(1)
    c_y = c[yc]
    ce = -(1.0 - e) * c_y * logp_y - (e / V) * (logp * c).sum(dim=1)
    zl = l * lse * lse
    zero = torch.zeros((), dtype=f64)
    loss_rows = torch.where(valid, t * (ce + zl), zero)
    logprob = torch.where(valid, logp_y, zero)

    if case.red == "none":
        loss = loss_rows
    elif case.red == "sum":
        loss = loss_rows.sum()
    else:
        D = float(torch.where(valid, t * c_y, zero).sum())
        loss = loss_rows.sum() / D if D != 0.0 else loss_rows.sum() * 0.0

    out = {
        "loss": loss.detach().numpy().copy(),
        "lse": lse.detach().numpy().copy(),
        "logprob": logprob.detach().numpy().copy(),
        "argmax": np.argmax(s.detach().numpy(), axis=1).astype(np.int64),
        "entropy": entropy.detach().numpy().copy(),
        "zloss": zl.detach().numpy().copy(),
    }

    if case.grad:
        if "grad_loss" in d:
            g_loss = torch.from_numpy(np.asarray(d["grad_loss"], np.float64))
        else:
            g_loss = torch.ones_like(loss)
        objective = (g_loss * loss).sum()
        if "grad_lse" in d:
            objective = objective + (
                torch.from_numpy(d["grad_lse"].astype(np.float64)) * lse).sum()
        if "grad_entropy" in d:
            objective = objective + (
                torch.from_numpy(d["grad_entropy"].astype(np.float64))
                * entropy).sum()
        names = list(leaves)
        grads = torch.autograd.grad(objective, [leaves[n] for n in names],
                                    allow_unused=True)
        for n, g in zip(names, grads):
            if g is None:
                g = torch.zeros_like(leaves[n])
            out[n] = g.detach().numpy().copy()
    return out


# --------------------------------------------------------------------------
# Running flce
# --------------------------------------------------------------------------

def _fmt(v):
    return repr(float(v))


def flce_command(flce_bin, case, files, out_dir, out_dtype, backend="reference", extra=()):
    """The `flce run` command line of `case`, its inputs in `files`."""
    cmd = [flce_bin, "run"]
    if case.logits_entry:
        cmd += ["--logits", files["logits"]]
    else:
        cmd += ["--x", files["x"], "--w", files["w"]]
        if "bias" in files:
            cmd += ["--bias", files["bias"]]
        if case.layout is not None:
            cmd += ["--w-layout", case.layout]
    cmd += ["--labels", files["labels"]]
    if "token_weights" in files:
        cmd += ["--token-weights", files["token_weights"]]
    if "class_weights" in files:
        cmd += ["--class-weights", files["class_weights"]]
    if case.dtype is not None:
        cmd += ["--dtype", case.dtype]
    if case.scale is not None:
        cmd += ["--logit-scale", _fmt(case.scale)]
    if case.softcap is not None:
        cmd += ["--softcap", _fmt(case.softcap)]
    if case.ignore_index is not None:
        cmd += ["--ignore-index", str(case.ignore_index)]
    if case.smoothing is not None:
        cmd += ["--label-smoothing", _fmt(case.smoothing)]
    if case.zloss is not None:
        cmd += ["--z-loss", _fmt(case.zloss)]
    if case.reduction is not None:
        cmd += ["--reduction", case.reduction]
    if case.grad:
        cmd += ["--grad"]
        for key, flag in (("grad_loss", "--grad-loss"),
                          ("grad_lse", "--grad-lse"),
                          ("grad_entropy", "--grad-entropy")):
            if key in files:
                cmd += [flag, files[key]]
    cmd += ["--backend", backend, *extra]
    if case.threads is not None:
        cmd += ["--threads", str(case.threads)]
    if out_dtype is not None:
        cmd += ["--out-dtype", out_dtype]
    cmd += ["--out", str(out_dir)]
    return cmd


def run_flce(flce_bin, case, d, tmp_path, out_dtype="f64"):
    files = {}
    for key, arr in d.items():
        path = tmp_path / f"{key}.npy"
        np.save(path, arr)
        files[key] = str(path)
    out_dir = tmp_path / "out"
    cmd = flce_command(flce_bin, case, files, out_dir, out_dtype)

    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    report = (f"command: {' '.join(cmd)}\nexit code: {proc.returncode}\n"
              f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    if proc.returncode != 0:
        pytest.fail(f"flce failed\n{report}")
    return out_dir, report


# --------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------

def assert_close(name, got, expected, rtol, context):
    got = np.asarray(got, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert np.all(np.isfinite(got)), f"{name}: non-finite values {got}\n{context}"
    ref = float(np.linalg.norm(expected.ravel()))
    diff = float(np.linalg.norm((got - expected).ravel()))
    # Scale = ||expected||; an exactly-zero reference means an absolute bound.
    scale = ref if ref > 0.0 else 1.0
    if not diff <= rtol * scale:
        worst = int(np.argmax(np.abs(got - expected))) if got.size else 0
        pytest.fail(
            f"{name}: ||got-exp|| = {diff:.3e}, ||exp|| = {ref:.3e}, "
            f"rel = {diff / scale:.3e} > {rtol:g}\n"
            f"worst flat index {worst}: got {got.ravel()[worst]!r} "
            f"expected {expected.ravel()[worst]!r}\n"
            f"got      = {np.array2string(got, precision=17)}\n"
            f"expected = {np.array2string(expected, precision=17)}\n"
            f"{context}")


def _expected_shapes(case, d):
    N, H, V = case.N, case.H, case.V
    shapes = {
        "loss": (N,) if case.red == "none" else (),
        "lse": (N,), "logprob": (N,), "argmax": (N,),
        "entropy": (N,), "zloss": (N,),
    }
    if case.grad:
        if case.logits_entry:
            shapes["grad_logits"] = (N, V)
        else:
            shapes["grad_x"] = (N, H)
            shapes["grad_w"] = d["w"].shape
            if case.bias:
                shapes["grad_bias"] = (V,)
    return shapes


def check_outputs(case, d, out_dir, report, rtol, float_dtype):
    expected = reference(case, d)
    shapes = _expected_shapes(case, d)
    assert set(shapes) == set(expected)
    for name in ("grad_x", "grad_w", "grad_bias", "grad_logits"):
        if name not in shapes:
            assert not (out_dir / f"{name}.npy").exists(), (
                f"unexpected {name}.npy written\n{report}")
    for name, shape in shapes.items():
        path = out_dir / f"{name}.npy"
        assert path.exists(), f"missing output {name}.npy\n{report}"
        got = np.load(path)
        assert got.shape == tuple(shape), (
            f"{name}: shape {got.shape} != expected {tuple(shape)}\n{report}")
        if name == "argmax":
            assert got.dtype == np.int64, f"argmax dtype {got.dtype}\n{report}"
            if not np.array_equal(got, expected["argmax"]):
                pytest.fail(f"argmax: got {got}, expected {expected['argmax']}"
                            f"\n{report}")
            continue
        assert got.dtype == float_dtype, (
            f"{name}: dtype {got.dtype} != {np.dtype(float_dtype)}\n{report}")
        assert_close(name, got, expected[name], rtol, report)


# --------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_run_matches_torch_f64(flce_bin, case, tmp_path):
    d = _make_data(case)
    out_dir, report = run_flce(flce_bin, case, d, tmp_path, out_dtype="f64")
    check_outputs(case, d, out_dir, report, RTOL, np.float64)


F32_CASES = [
    Case("f32out_basic", 901, bias=True, smoothing=0.1, zloss=1e-3,
         ignore_mode="some", N=8, grad_lse=True, grad_entropy=True),
    Case("f32out_logits_none", 902, logits_entry=True, reduction="none",
         dtype="bf16", grad_loss=True, N=6, V=15),
]


@pytest.mark.parametrize("case", F32_CASES, ids=[c.name for c in F32_CASES])
def test_run_default_out_dtype_is_f32(flce_bin, case, tmp_path):
    d = _make_data(case)
    out_dir, report = run_flce(flce_bin, case, d, tmp_path, out_dtype=None)
    check_outputs(case, d, out_dir, report, RTOL_F32_OUT, np.float32)


# Sanity checks of the reference itself (no binary needed).

@pytest.mark.parametrize("seed", range(6))
def test_reference_matches_torch_cross_entropy(python_deps, seed):
    """Mean CE with class weights, label smoothing and ignored rows, no token
    weights / z-loss / softcap, equals F.cross_entropy; the gradients agree."""
    import torch.nn.functional as F
    r = random.Random(seed)
    case = Case("sanity", 500 + seed, N=r.randint(2, 12), H=r.randint(1, 16),
                V=r.randint(2, 40), logits_entry=(seed % 2 == 0),
                class_weights=r.choice([None, "pos", "mixed"]),
                smoothing=r.choice([0.0, 0.1, 0.7]), ignore_mode="some",
                ignore_index=r.choice([None, -1]), bias=(seed % 2 == 1),
                scale=r.choice([1.0, 0.5, 2.3]), layout=r.choice(["vh", "hv"]))
    d = _make_data(case)
    ours = reference(case, d)

    if case.logits_entry:
        inp = torch.from_numpy(d["logits"].astype(np.float64)).requires_grad_()
        z = case.a * inp
    else:
        x = torch.from_numpy(d["x"].astype(np.float64)).requires_grad_()
        w = torch.from_numpy(d["w"].astype(np.float64)).requires_grad_()
        b = torch.from_numpy(d["bias"].astype(np.float64)).requires_grad_()
        w_vh = w.t() if case.layout == "hv" else w
        z = case.a * (x @ w_vh.t() + b)
    c = (torch.from_numpy(d["class_weights"].astype(np.float64))
         if "class_weights" in d else None)
    y = torch.from_numpy(d["labels"].astype(np.int64))
    loss = F.cross_entropy(z, y, weight=c, ignore_index=case.ii,
                           label_smoothing=case.e, reduction="mean")
    loss.backward()
    ctx = f"case {case}"
    assert_close("loss", ours["loss"], loss.detach().numpy(), 1e-13, ctx)
    if case.logits_entry:
        assert_close("grad_logits", ours["grad_logits"], inp.grad.numpy(),
                     1e-13, ctx)
    else:
        assert_close("grad_x", ours["grad_x"], x.grad.numpy(), 1e-13, ctx)
        assert_close("grad_w", ours["grad_w"], w.grad.numpy(), 1e-13, ctx)
        assert_close("grad_bias", ours["grad_bias"], b.grad.numpy(), 1e-13,
                     ctx)
    # Per-row quantities against direct formulas.
    s = z.detach()
    lse = torch.logsumexp(s, 1)
    p = torch.softmax(s, 1)
    assert_close("lse", ours["lse"], lse.numpy(), 1e-14, ctx)
    assert_close("entropy", ours["entropy"],
                 (lse - (p * s).sum(1)).numpy(), 1e-12, ctx)
    assert np.array_equal(ours["argmax"], s.argmax(1).numpy())


def test_reference_token_weights_and_zloss(python_deps):
    """Token weights / z-loss / softcap against an explicit per-row loop."""
    case = Case("sanity_tw", 777, N=7, H=5, V=9, bias=True, softcap=1.5,
                scale=2.3, zloss=0.1, smoothing=0.1, token_weights="mixed",
                class_weights="pos", ignore_mode="some", reduction="mean")
    d = _make_data(case)
    ours = reference(case, d)
    x = d["x"].astype(np.float64)
    w = d["w"].astype(np.float64)
    b = d["bias"].astype(np.float64)
    t = d["token_weights"].astype(np.float64)
    c = d["class_weights"].astype(np.float64)
    total, D = 0.0, 0.0
    for i in range(case.N):
        z = case.a * (w @ x[i] + b)
        s = case.k * np.tanh(z / case.k)
        m = s.max()
        lse = m + math.log(np.exp(s - m).sum())
        logp = s - lse
        yi = int(d["labels"][i])
        assert abs(ours["lse"][i] - lse) <= 1e-13 * abs(lse) + 1e-15
        assert abs(ours["zloss"][i] - case.l * lse * lse) <= 1e-13
        if yi == case.ii:
            assert ours["logprob"][i] == 0.0
            continue
        ce = (-(1 - case.e) * c[yi] * logp[yi]
              - case.e / case.V * (c * logp).sum())
        total += t[i] * (ce + case.l * lse * lse)
        D += t[i] * c[yi]
    assert abs(float(ours["loss"]) - total / D) <= 1e-12 * abs(total / D)
