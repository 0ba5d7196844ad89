"""flce.testing: check a candidate implementation against flce's oracle.

    import flce.testing as ft
    inputs = ft.adversarial_inputs("large_1000", like="torch")
    out = my_kernel(**inputs)                    # loss, lse, grads, ...
    ft.assert_close({"loss": out.loss, "grad_x": out.gx}, **inputs)

The expected values come from flce's `reference` backend (float64 outputs).
The allowed error of each element is the tolerance policy of
tests/support/tolerance.h (README, "Tolerance policy"): a first-order
rounding-error bound from N, H, V, the data and the unit roundoffs, checked
as |actual - expected| <= C * bound with C = 1, NaN/Inf positions matching
exactly. The bounds need the logits: they are recomputed in float64 one
block of rows at a time (flce.testing.CHUNK_ELEMENTS logits per block), so
memory stays bounded for any N; time is O(N V H).
"""

import math

import numpy as np

from . import _arrays, _bounds
from . import forward as _forward
from . import loss_and_grad as _loss_and_grad

CHUNK_ELEMENTS = 1 << 18
TILE_VOCABS = (511, 512, 513)  # around the cpu backend's 512-class tile
C = 1.0  # |actual - expected| <= C * bound (tolerance.h, section 9)

_OUTPUTS = ("loss", "lse", "logprob", "argmax", "entropy", "zloss")
_GRADS = ("grad_x", "grad_w", "grad_bias", "grad_logits")
_DTYPE_NAMES = {"f64": "float64", "f32": "float32", "bf16": "bfloat16", "f16": "float16"}
_U = {"float64": "f64", "f64": "f64", "float32": "f32", "f32": "f32", "bfloat16": "bf16",
      "bf16": "bf16", "float16": "f16", "f16": "f16"}


def _unit(spec, what):
    if spec is None:
        return 0.0
    key = spec if isinstance(spec, str) else str(spec).replace("torch.", "")
    if key not in _U:
        try:
            key = np.dtype(spec).name
        except TypeError:
            pass
    if key not in _U:
        raise ValueError(f"{what}: {spec!r} is not float64, float32, bfloat16 or float16")
    return _bounds.UNIT_ROUNDOFF[_U[key]]


def _index(at, shape):
    return "[" + ", ".join(str(int(i)) for i in np.unravel_index(at, shape)) + "]" if shape \
        else "[]"


def compare(name, actual, expected, bound, c=C):
    """(ok, line, worst_ratio): |actual - expected| <= c * bound elementwise,
    NaN/+Inf/-Inf positions equal. The line reads like torch.testing's."""
    if actual.shape != expected.shape:
        return False, f"{name}: shape {actual.shape}, expected {expected.shape}", math.inf
    a, e, b = actual.ravel(), expected.ravel(), c * np.broadcast_to(bound, expected.shape).ravel()
    nonfinite = ~np.isfinite(a) | ~np.isfinite(e)
    same = (np.isnan(a) & np.isnan(e)) | (a == e)
    mismatch = nonfinite & ~same
    finite = ~nonfinite
    bad_bound = finite & ~np.isfinite(b)  # NaN, or inf (e.g. gamma_V once V u_a >= 1)
    checked = finite & np.isfinite(b)
    with np.errstate(all="ignore"):
        err = np.where(checked, np.abs(a - e), 0.0)
        ratio = np.where(checked, np.where(b > 0, err / b, np.where(err > 0, np.inf, 0.0)), -1.0)
    violations = int(np.count_nonzero(checked & (err > b)))
    worst = int(np.argmax(ratio)) if ratio.size else 0
    worst_ratio = float(ratio[worst]) if ratio.size else 0.0
    ok = violations == 0 and not mismatch.any() and not bad_bound.any()
    where = _index(worst, expected.shape)
    if not e.size:
        line = f"{name}: empty"
    elif not checked.any():  # no worst element to show (its ratio would read -1)
        line = f"{name}: none of {e.size} elements is finite on both sides, with a finite bound"
    else:
        of = f"{e.size}" if checked.all() else f"{int(checked.sum())} finite (of {e.size})"
        line = (f"{name}: {violations} of {of} elements exceed C * bound; worst at {where}: "
                f"actual {a[worst]!r}, expected {e[worst]!r}, |err| {abs(a[worst] - e[worst]):.3e} "
                f"vs bound {b[worst]:.3e} (ratio {worst_ratio:.3g})")
    if mismatch.any():
        first = int(np.argmax(mismatch))
        line += (f"; {int(mismatch.sum())} NaN/Inf position mismatches, first at "
                 f"{_index(first, expected.shape)}: actual {a[first]!r}, expected {e[first]!r}")
    if bad_bound.any():
        line += (f"; {int(bad_bound.sum())} finite values have a NaN or infinite bound (test "
                 f"construction error), first at {_index(int(np.argmax(bad_bound)), expected.shape)}")
    return ok, line, worst_ratio


_PROBLEM_DOC = """
    The problem: the inputs exactly as the candidate read them (x, w, bias or
    logits in their storage dtype, labels, weights, cotangents, options), as
    for flce.loss_and_grad. How the candidate computes, as the policy's unit
    roundoffs:
      accumulate  its dot products, sums, exp/log (u_a; default float32);
      storage     the logits between the GEMM and the softmax (u_s; default
                  = accumulate);
      grad_cast   dlogits cast before the gradient GEMMs (u_g; None = none);
      saved_lse   the lse its backward read from its forward (u_l; None when
                  computed in the same call);
      packed_scores  the dtype its gradient pass read the scores back in,
                  stored as differences from a running max (u_q; the cpu
                  backend's bf16 steps: "float16"; None = the scores
                  themselves);
      filter_eps  the gradient filter's eps (README, "Gradient filtering"),
                  a number or "auto" (the epsilon / 32 of x's dtype, or the
                  logits', as flce and Cut Cross-Entropy set it; not of
                  `storage`); grad_x and grad_w then also allow every dlogits
                  entry the filter may skip. 0: off."""


def bounds(x=None, w=None, labels=None, *, logits=None, bias=None, token_weights=None,
           class_weights=None, grad_loss=None, grad_lse=None, grad_entropy=None,
           logit_scale=1.0, softcap=0.0, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
           reduction="mean", w_layout="vh", outputs=None, out_dtype="float32",
           accumulate="float32", storage=None, grad_cast=None, saved_lse=None,
           packed_scores=None, filter_eps=0.0, chunk_elements=None):
    """(expected, bound): dicts of float64 numpy arrays, the oracle's values
    and the policy's absolute error bound of every output in `outputs`
    (default: every forward output and the gradients the problem has;
    argmax has no numeric bound). out_dtype: each output's storage (u_o), one
    dtype or a dict by output name.
    """
    if outputs is None:
        outputs = [o for o in _OUTPUTS if o != "argmax"] + (
            ["grad_logits"] if logits is not None
            else ["grad_x", "grad_w"] + (["grad_bias"] if bias is not None else []))
    dts = out_dtype if isinstance(out_dtype, dict) else {o: out_dtype for o in outputs}
    u_out = {o: _unit(dts.get(o, "float32"), o) for o in outputs if o != "argmax"}
    expected, bnd, _ = _evaluate(locals(), outputs, u_out, None)
    return expected, bnd


def assert_close(actual, x=None, w=None, labels=None, *, logits=None, bias=None,
                 token_weights=None, class_weights=None, grad_loss=None, grad_lse=None,
                 grad_entropy=None, logit_scale=1.0, softcap=0.0, ignore_index=-100,
                 label_smoothing=0.0, z_loss=0.0, reduction="mean", w_layout="vh",
                 accumulate="float32", storage=None, grad_cast=None, saved_lse=None,
                 packed_scores=None, filter_eps=0.0, chunk_elements=None, msg=None):
    """Checks a candidate's outputs against flce's oracle and the policy.

    actual: a dict (or flce.Result) of any of loss, lse, logprob, argmax,
      entropy, zloss, grad_x, grad_w (in w's layout), grad_bias, grad_logits;
      numpy arrays or torch tensors of any float dtype (uint16 = bf16 bits).
      Each output's own rounding (u_o) is taken from its dtype.
    Raises AssertionError listing every output that fails: how many elements
    exceed their bound, the worst one (index, values, error vs bound) and any
    NaN/Inf position mismatch; argmax rows that no logit error can explain.
    Returns {output: worst |err| / bound} (the fraction of the bound used).
    """
    got = actual.as_dict() if hasattr(actual, "as_dict") else dict(actual)
    unknown = [k for k in got if k not in _OUTPUTS + _GRADS]
    if unknown:
        raise ValueError(f"actual: {unknown} are not outputs of flce")
    missing = [k for k, v in got.items() if v is None]
    if missing:
        raise ValueError(f"actual: {missing} are None (a candidate's missing outputs?)")
    if not got:
        raise ValueError("actual: no outputs to check (a check of nothing cannot fail)")
    # Each output's u_o from its dtype; a Python number is a float64 output
    # (one that went through .item() has lost its own dtype: the failure
    # line says which dtype each output was checked as).
    out_dt = {k: _arrays.dtype_of(np.asarray(v) if isinstance(v, np.generic) else v) or "f64"
              for k, v in got.items() if k != "argmax"}
    u_out = {k: _unit(dt, k) for k, dt in out_dt.items()}
    argmax = _int_array(got["argmax"]) if "argmax" in got else None
    expected, bnd, failures = _evaluate(locals(), list(got), u_out, argmax)
    report = {}
    for name in _OUTPUTS + _GRADS:
        if name not in got or name == "argmax":
            continue
        ok, line, ratio = compare(name, _arrays.to_float64(got[name]), expected[name], bnd[name])
        line += f" (checked as a {_DTYPE_NAMES[out_dt[name]]} output)"
        report[name] = ratio
        if not ok:
            failures.append(line)
    if failures:
        n, v = expected["lse"].shape[0], _vocab(logits, w, w_layout)
        head = (f"flce.testing.assert_close: {len(failures)} output(s) outside the tolerance "
                f"policy (C = {C:g}, accumulate {accumulate}, N={n} V={v}; expected values "
                f"from flce's reference backend)")
        raise AssertionError("\n  ".join(([msg] if msg else []) + [head] + failures))
    return report


bounds.__doc__ += _PROBLEM_DOC
assert_close.__doc__ += _PROBLEM_DOC


def _vocab(logits, w, w_layout):
    return (logits if logits is not None else w).shape[1 if logits is not None or
                                                          w_layout == "hv" else 0]


def _on_host(obj):
    """A torch tensor on a GPU copied to the host (the reference backend
    reads host memory); anything else as it is."""
    if _arrays.is_torch(obj) and obj.device.type != "cpu":
        return obj.detach().cpu()
    return obj


def _evaluate(args, names, u_out, argmax):
    """The oracle's values, the bounds of `names`, and argmax failures."""
    grads = [g for g in _GRADS if g in names]
    problem = {k: _on_host(args[k]) for k in (
        "x", "w", "labels", "logits", "bias", "token_weights", "class_weights", "logit_scale",
        "softcap", "ignore_index", "label_smoothing", "z_loss", "reduction", "w_layout")}
    cot = {k: _on_host(args[k]) for k in ("grad_loss", "grad_lse", "grad_entropy")}
    if grads:
        oracle = _loss_and_grad(**problem, **cot, outputs="all", grads=grads,
                                out_dtype="float64", grad_dtype="float64", backend="reference")
    else:
        oracle = _forward(**problem, outputs="all", out_dtype="float64", backend="reference")
    expected = {k: _arrays.to_float64(v) for k, v in oracle.as_dict().items()}

    f64 = lambda a: None if a is None else _arrays.to_float64(a)  # noqa: E731
    w, layout = args["w"], args["w_layout"]
    d = _bounds.Problem(
        x=f64(args["x"]), w_vh=None if w is None else (f64(w) if layout == "vh" else f64(w).T),
        bias=f64(args["bias"]), logits=f64(args["logits"]), labels=_int_array(args["labels"]),
        token_weights=f64(args["token_weights"]), class_weights=f64(args["class_weights"]),
        grad_loss=f64(cot["grad_loss"]), grad_lse=f64(cot["grad_lse"]),
        grad_entropy=f64(cot["grad_entropy"]), logit_scale=args["logit_scale"],
        softcap=args["softcap"], ignore_index=args["ignore_index"],
        label_smoothing=args["label_smoothing"], z_loss=args["z_loss"],
        reduction=args["reduction"])
    d.w_layout = layout
    u_a = _unit(args["accumulate"], "accumulate")
    storage = args["storage"]
    pr = _bounds.Precision(u_a, u_a if storage is None else _unit(storage, "storage"),
                           _unit(args["grad_cast"], "grad_cast"),
                           _unit(args["saved_lse"], "saved_lse"), u_out,
                           _unit(args["packed_scores"], "packed_scores"),
                           _filter_eps(args["filter_eps"],
                                       args["x"] if w is not None else args["logits"]))
    got = {k: None for k in names}
    if argmax is not None:
        got["argmax"] = argmax
    bnd, argmax_lines = _all_bounds(d, pr, got, expected, grads,
                                    args["chunk_elements"] or CHUNK_ELEMENTS)
    return expected, bnd, argmax_lines


def _filter_eps(spec, stored):
    """filter_eps as a number: "auto" is the epsilon (2u) of `stored`'s dtype
    / 32, as flce resolves it (2^-12 for bf16, 2^-15 f16, 2^-28 f32)."""
    if isinstance(spec, str):
        if spec != "auto":
            raise ValueError(f"filter_eps: {spec!r} is not a number or 'auto'")
        return 2 * _unit(_arrays.dtype_of(stored) or "float64", "filter_eps") / 32
    eps = float(spec)
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"filter_eps = {eps!r}: must be finite and >= 0 (0: off), or 'auto'")
    return eps


def _all_bounds(d, pr, got, expected, grads, chunk_elements):
    """Every requested output's bound, block of rows by block of rows."""
    ua = pr.u_accum
    n, v, h = d.n, d.v, d.h
    want_grads = bool(grads)
    floor_a = (n + v + h + 8) * _bounds.tiny(ua)

    def out(name):  # the output rounding u_o |value| + tiny(u_o), and the floor
        u = pr.u_out.get(name, 2.0**-53)
        return u * np.abs(expected[name]) + _bounds.tiny(u) + floor_a

    rows_b = {k: np.zeros(n) for k in ("lse", "entropy", "logprob", "zloss", "dloss")}
    loss_rows = np.zeros(n)
    gx = np.zeros((n, h)) if "grad_x" in grads else None
    gw = np.zeros((v, h)) if "grad_w" in grads else None
    gb = np.zeros(v) if "grad_bias" in grads else None
    gl = np.zeros((n, v)) if "grad_logits" in grads else None
    argmax_lines, argmax_bad = [], 0
    if got.get("argmax") is not None and got["argmax"].shape != (n,):
        argmax_lines.append(f"argmax: shape {got['argmax'].shape}, expected ({n},)")
        got = {**got, "argmax": None}
    step = max(1, chunk_elements // max(v, 1))
    abs_w = None if d.w is None else np.abs(d.w)
    with np.errstate(all="ignore"):
        for i0 in range(0, n, step):
            rows = slice(i0, min(n, i0 + step))
            blk = _bounds.block_bounds(d, pr, rows, want_grads)
            for k in rows_b:
                rows_b[k][rows] = blk[k]
            loss_rows[rows] = blk["loss_rows_exact"]
            if got.get("argmax") is not None:
                bad = _check_argmax(blk, got["argmax"], rows, v)
                argmax_bad += len(bad)
                argmax_lines += bad[: max(0, 3 - len(argmax_lines))]
            if not want_grads:
                continue
            if gl is not None:
                gl[rows] = _bounds.cast_error(pr, blk["G"], blk["dG"])
            if gx is not None or gw is not None or gb is not None:
                for_x, for_w = _bounds.gradient_parts(d, pr, blk["G"], blk["dG"])
                if gb is not None:  # grad_bias sums every entry of G', filtered or not
                    gb += for_w.sum(axis=0)
                if pr.filter_eps > 0:
                    dropped = _bounds.filter_allowance(d, pr, rows, blk, pr.filter_eps)
                    for_x, for_w = for_x + dropped, for_w + dropped
                if gx is not None:
                    gx[rows] = for_x @ abs_w
                if gw is not None:
                    gw += for_w.T @ np.abs(d.x[rows])
        if argmax_bad > 3:
            argmax_lines.append(f"argmax: {argmax_bad} rows in all")
        b = {}
        ignored = d.ignored
        b["lse"] = rows_b["lse"] + out("lse")
        b["entropy"] = rows_b["entropy"] + out("entropy")
        b["logprob"] = np.where(ignored, 0.0, rows_b["logprob"] + out("logprob"))
        b["zloss"] = rows_b["zloss"] + out("zloss")
        if "loss" in got:
            if d.reduction == "none":
                b["loss"] = np.where(ignored, 0.0, rows_b["dloss"] + out("loss"))
            else:
                b["loss"] = np.asarray(_bounds.reduction_bound(
                    d, pr, float(rows_b["dloss"].sum()), float(np.abs(loss_rows).sum()),
                    float(expected["loss"]), pr.u_out.get("loss", 2.0**-53)))
        if gx is not None:
            b["grad_x"] = gx + out("grad_x")
        if gw is not None:
            b["grad_w"] = (gw if d.w_layout == "vh" else gw.T) + out("grad_w")
        if gb is not None:
            b["grad_bias"] = gb + out("grad_bias")
        if gl is not None:
            b["grad_logits"] = gl + out("grad_logits")
    return b, argmax_lines


def _int_array(obj):
    if _arrays.is_torch(obj):
        return obj.detach().cpu().numpy().astype(np.int64)
    return np.asarray(obj).astype(np.int64)


def _check_argmax(blk, got_all, rows, v):
    """Section 8 for a block: a class within the logit bounds of the max."""
    lines = []
    s, ds, want = blk["s"], blk["ds"], blk["argmax"]
    got = got_all[rows].astype(np.int64)
    for r in np.nonzero(got != want)[0]:
        i, g, wnt = rows.start + int(r), int(got[r]), int(want[r])
        if g < 0 or g >= v:
            lines.append(f"argmax[{i}] = {g} is outside [0, {v})")
        elif math.isnan(s[r, wnt]):
            lines.append(f"argmax[{i}] = {g}, expected {wnt} (the first NaN logit of the row)")
        elif not (s[r, wnt] - s[r, g] <= ds[r, wnt] + ds[r, g]):
            lines.append(f"argmax[{i}] = {g} (s = {s[r, g]!r}), expected {wnt} (s = "
                         f"{s[r, wnt]!r}); the gap {s[r, wnt] - s[r, g]:.3e} exceeds the logit "
                         f"bounds {ds[r, wnt] + ds[r, g]:.3e}")
    return lines


# ---------------------------------------------------------------------------
# Adversarial inputs
# ---------------------------------------------------------------------------

def bf16_exact(values):
    """The nearest bfloat16-representable values (round to nearest even), in
    the same dtype: float32 data a bf16 kernel and a float32 kernel read
    identically."""
    if _arrays.is_torch(values):
        return values.to(_arrays._torch().bfloat16).to(values.dtype)
    arr = np.asarray(values)
    return _arrays.bf16_bits_to_float32(_arrays.float32_to_bf16_bits(arr)).astype(arr.dtype)


def _convert(arr, dtype, like):
    """float64 numpy -> `dtype` ('float32', 'float64', 'bfloat16', 'float16')
    as numpy (bfloat16 as uint16 bits) or torch."""
    if like == "torch":
        import torch
        t = torch.from_numpy(np.ascontiguousarray(arr))
        # float64 -> float32 -> bf16/f16: the rounding PyTorch users get.
        return t.to(getattr(torch, dtype)) if dtype == "float64" else \
            t.float().to(getattr(torch, dtype))
    if like != "numpy":
        raise ValueError(f"like: {like!r} is not 'numpy' or 'torch'")
    if dtype == "bfloat16":
        return _arrays.float32_to_bf16_bits(arr.astype(np.float32))
    return arr.astype(np.dtype(dtype))


def make_inputs(n=64, h=32, v=512, *, seed=0, kind="normal", magnitude=100.0, zipf=1.1,
                ignore_fraction=0.0, ignore_index=-100, bias=False, entry="head",
                w_layout="vh", dtype="float32", bf16_values=False, like="numpy"):
    """Inputs for flce.loss_and_grad / assert_close / a candidate, as a dict
    (x, w, labels[, bias], w_layout, ignore_index; or logits, labels, ...).

    kind: 'normal' (logits ~ N(0, 1)); 'large' (|z| ~ magnitude, e.g. 100 or
      1000: tests the max shift and rows whose softmax is one-hot); 'peaky'
      (a Zipf-like distribution p_j ~ rank_j^-zipf over a random ranking of
      the classes, through the bias, with labels drawn from it).
    ignore_fraction: that fraction of rows gets ignore_index (1.0: all).
    entry: 'head' (x, w, bias) or 'logits' (the logits x.W^T + b, in float64
      then cast). dtype: 'float32', 'float64', 'bfloat16', 'float16' storage;
      bf16_values=True rounds the values to bfloat16 first (so every dtype
      holds the same numbers). like: 'numpy' (bfloat16 as uint16 bits) or
      'torch'. Labels are int64.
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, h))
    w_vh = rng.standard_normal((v, h)) / math.sqrt(h)
    b = 0.1 * rng.standard_normal(v)
    labels = rng.integers(0, v, n)
    if kind == "large":
        w_vh *= magnitude
        b *= magnitude
    elif kind == "peaky":
        ranks = rng.permutation(v) + 1.0
        probs = ranks ** -zipf
        probs /= probs.sum()
        b = np.log(probs)
        w_vh *= 0.5
        labels = rng.choice(v, size=n, p=probs)
        bias = True
    elif kind != "normal":
        raise ValueError(f"kind: {kind!r} is not 'normal', 'large' or 'peaky'")
    if bf16_values:
        x, w_vh, b = (bf16_exact(a.astype(np.float32)).astype(np.float64) for a in (x, w_vh, b))
    if ignore_fraction >= 1.0:
        labels[:] = ignore_index
    elif ignore_fraction > 0:
        mask = rng.random(n) < ignore_fraction
        mask[-1] = False  # at least one row keeps its label
        labels[mask] = ignore_index
    out = {"labels": labels.astype(np.int64), "ignore_index": ignore_index}
    if like == "torch":
        import torch
        out["labels"] = torch.from_numpy(out["labels"])
    if entry == "logits":
        z = x @ w_vh.T + (b if bias else 0.0)
        if bf16_values:
            z = bf16_exact(z.astype(np.float32)).astype(np.float64)
        out["logits"] = _convert(z, dtype, like)
        return out
    if entry != "head":
        raise ValueError(f"entry: {entry!r} is not 'head' or 'logits'")
    out["x"] = _convert(x, dtype, like)
    out["w"] = _convert(w_vh if w_layout == "vh" else np.ascontiguousarray(w_vh.T), dtype, like)
    out["w_layout"] = w_layout
    if bias:
        out["bias"] = _convert(b, dtype, like)
    return out


# name -> make_inputs arguments: the cases a kernel's test should pass.
ADVERSARIAL_CASES = {
    "normal": {},
    "large_100": {"kind": "large", "magnitude": 100.0},
    "large_1000": {"kind": "large", "magnitude": 1000.0},
    "peaky_zipf_1.1": {"kind": "peaky", "zipf": 1.1},
    "peaky_zipf_2": {"kind": "peaky", "zipf": 2.0},
    "ignored_rows": {"ignore_fraction": 0.3},
    "ignored_rows_index_0": {"ignore_fraction": 0.3, "ignore_index": 0},  # not -100 hard-coded
    "all_ignored": {"ignore_fraction": 1.0},
    "vocab_511": {"v": 511},
    "vocab_512": {"v": 512},
    "vocab_513": {"v": 513},
    "bf16_values": {"bf16_values": True, "bias": True},
}


def adversarial_inputs(name, **overrides):
    """make_inputs(**ADVERSARIAL_CASES[name], **overrides)."""
    if name not in ADVERSARIAL_CASES:
        raise ValueError(f"{name!r} is not one of {', '.join(ADVERSARIAL_CASES)}")
    return make_inputs(**{**ADVERSARIAL_CASES[name], **overrides})
