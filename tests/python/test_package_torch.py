"""flce.torch: the autograd Function, linear_cross_entropy and the
LinearCrossEntropyLoss module, against the float64 PyTorch reference of the
semantics (test_package_reference.py) and against F.cross_entropy itself.

Tolerances: float64 (the reference backend) within 1e-10 norm-wise; float32
within 1e-4 norm-wise and the tolerance policy (flce.testing.assert_close);
bfloat16 parameters get bfloat16 gradients, whose own rounding (2^-8
relative) dominates: within 1e-2 norm-wise and the policy with u_o = bf16.
"""

import warnings

import pytest

from test_package_reference import F, import_flce, norm_close, np, reference, torch

flce = import_flce()
LinearCrossEntropyLoss = flce.torch.LinearCrossEntropyLoss
linear_cross_entropy = flce.torch.linear_cross_entropy

N, H, V = 9, 6, 13
OPTIONS = {
    "defaults": {},
    "logit_scale": {"logit_scale": 1.7},
    "softcap": {"softcap": 2.0},
    "label_smoothing": {"label_smoothing": 0.15},
    "z_loss": {"z_loss": 0.02},
    "ignore_index": {"ignore_index": 5},
    "reduction_none": {"reduction": "none"},
    "reduction_sum": {"reduction": "sum"},
    "w_layout_hv": {"w_layout": "hv"},
    "class_weights": {"class_weights": True},
    "everything": {"logit_scale": 0.8, "softcap": 4.0, "label_smoothing": 0.1, "z_loss": 1e-3,
                   "ignore_index": 5, "reduction": "none", "w_layout": "hv",
                   "class_weights": True},
}
RTOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 1e-2}


def make(dtype, opts, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(V, H, generator=g, dtype=torch.float64) / H ** 0.5).to(dtype)
    if opts.get("w_layout") == "hv":
        w = w.T.contiguous()
    b = (0.3 * torch.randn(V, generator=g, dtype=torch.float64)).to(dtype) if bias else None
    y = torch.randint(0, V, (N,), generator=g)
    y[[1, 6]] = opts.get("ignore_index", -100)
    cw = torch.rand(V, generator=g, dtype=torch.float64) + 0.5 if opts.get("class_weights") \
        else None
    kw = {k: v for k, v in opts.items() if k != "class_weights"}
    return x, w, b, y, cw, kw


def leaves(*ts):
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in ts]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16],
                         ids=["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("case", list(OPTIONS))
def test_module_matches_reference(case, dtype):
    x, w, b, y, cw, kw = make(dtype, OPTIONS[case])
    xl, wl, bl = leaves(x, w, b)
    loss_fn = LinearCrossEntropyLoss(class_weights=cw, **kw)
    loss = loss_fn(xl, wl, y, bias=bl)
    g_out = torch.linspace(-1, 1, N, dtype=loss.dtype) if loss.dim() else None
    loss.backward(g_out)
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert xl.grad.dtype == dtype and wl.grad.dtype == dtype and bl.grad.dtype == dtype
    ref = reference(x=x, w=w, bias=b, labels=y, class_weights=cw, grad_loss=g_out, **kw)
    rtol = RTOL[dtype]
    norm_close("loss", loss, ref["loss"], rtol if dtype == torch.float64 else 1e-5)
    for name, t in (("grad_x", xl), ("grad_w", wl), ("grad_bias", bl)):
        norm_close(name, t.grad, ref[name], rtol)
    if dtype != torch.float64:
        got = {"loss": loss, "grad_x": xl.grad, "grad_w": wl.grad, "grad_bias": bl.grad}
        flce.testing.assert_close(got, x, w, y, bias=b, class_weights=cw, grad_loss=g_out,
                                  saved_lse="float32", **kw)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.25])
@pytest.mark.parametrize("weighted", [False, True])
def test_drop_in_for_torch_cross_entropy(reduction, smoothing, weighted):
    x, w, b, y, cw, _ = make(torch.float64, {"class_weights": weighted}, seed=3)
    xa, wa, ba = leaves(x, w, b)
    xb, wb, bb = leaves(x, w, b)
    kw = dict(weight=cw, reduction=reduction, label_smoothing=smoothing)
    mine = LinearCrossEntropyLoss(class_weights=cw, reduction=reduction,
                                  label_smoothing=smoothing)(xa, wa, y, bias=ba)
    theirs = F.cross_entropy(F.linear(xb, wb, bb), y, **kw)
    norm_close("loss", mine, theirs.detach().numpy(), 1e-12)
    mine.sum().backward()
    theirs.sum().backward()
    for a, t in ((xa, xb), (wa, wb), (ba, bb)):
        norm_close("grad", a.grad, t.grad.numpy(), 1e-12)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_gradcheck_float64_with_lse_and_entropy(reduction):
    x, w, b, y, cw, _ = make(torch.float64, {"class_weights": True}, seed=5)
    tw = torch.rand(N, dtype=torch.float64) + 0.5
    opts = dict(class_weights=cw, token_weights=tw, softcap=3.0, z_loss=0.05,
                label_smoothing=0.1, logit_scale=1.3, reduction=reduction)

    def fn(x, w, b):
        return linear_cross_entropy(x, w, y, b, return_lse=True, return_entropy=True, **opts)

    assert torch.autograd.gradcheck(fn, tuple(leaves(x, w, b)), eps=1e-6, atol=1e-7, rtol=1e-6)


def test_lse_and_entropy_cotangents_flow_to_flce():
    x, w, b, y, _, _ = make(torch.float64, {}, seed=7)
    xl, wl, bl = leaves(x, w, b)
    loss, lse, ent = linear_cross_entropy(xl, wl, y, bl, z_loss=0.01, return_lse=True,
                                          return_entropy=True)
    g_lse, g_ent = torch.randn(N, dtype=torch.float64), torch.randn(N, dtype=torch.float64)
    (2.0 * loss + (g_lse * lse).sum() + (g_ent * ent).sum()).backward()
    ref = reference(x=x, w=w, bias=b, labels=y, z_loss=0.01, grad_loss=np.array(2.0),
                    grad_lse=g_lse, grad_entropy=g_ent)
    norm_close("lse", lse, ref["lse"], 1e-12)
    norm_close("entropy", ent, ref["entropy"], 1e-10)
    for name, t in (("grad_x", xl), ("grad_w", wl), ("grad_bias", bl)):
        norm_close(name, t.grad, ref[name], 1e-10)
    # Only the lse used: the loss's cotangent must be zero, not flce's default of one.
    xl, wl = leaves(x, w)
    _, lse = linear_cross_entropy(xl, wl, y, return_lse=True)
    lse.sum().backward()
    ref = reference(x=x, w=w, labels=y, grad_loss=np.array(0.0), grad_lse=np.ones(N))
    norm_close("grad_x", xl.grad, ref["grad_x"], 1e-10)


def test_batched_and_non_contiguous_inputs():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(H, 2, 5, generator=g).permute(1, 2, 0)  # [2, 5, H], non-contiguous
    w = torch.randn(H, V, generator=g).T  # [V, H] view of an [H, V] tensor
    y = torch.randint(0, V, (2, 5), generator=g)
    xl, wl = leaves(x, w)
    per_token = linear_cross_entropy(xl, wl, y, reduction="none")
    assert per_token.shape == (2, 5)
    per_token.sum().backward()
    xr, wr = leaves(x, w)
    F.cross_entropy(F.linear(xr, wr).reshape(-1, V), y.reshape(-1), reduction="sum").backward()
    norm_close("loss", per_token.sum(), float(F.cross_entropy(
        F.linear(x, w).reshape(-1, V), y.reshape(-1), reduction="sum")), 1e-5)
    norm_close("grad_x", xl.grad, xr.grad.double().numpy(), 1e-4)
    norm_close("grad_w", wl.grad, wr.grad.double().numpy(), 1e-4)
    assert xl.grad.shape == x.shape


def test_hv_view_of_a_vh_weight_runs_as_that_weight():
    # W.t() with w_layout='hv' is run as the row-major [V, H] it views: the
    # same bits as passing W itself, the gradient shaped like the view.
    x, w, b, y, _, _ = make(torch.float32, {}, seed=14)
    xa, wa = leaves(x, w)
    linear_cross_entropy(xa, wa, y, b).backward()
    xb, wb = leaves(x, w)
    wt = wb.t()
    wt.retain_grad()
    linear_cross_entropy(xb, wt, y, b, w_layout="hv").backward()
    assert torch.equal(xb.grad, xa.grad) and torch.equal(wb.grad, wa.grad)
    assert wt.grad.shape == (H, V) and torch.equal(wt.grad, wa.grad.t())


def test_only_needed_gradients_and_mixed_dtypes():
    x, w, b, y, _, _ = make(torch.float32, {}, seed=11)
    wl = w.clone().requires_grad_(True)
    LinearCrossEntropyLoss()(x, wl, y).backward()  # x needs no gradient
    assert wl.grad is not None
    xl, wb = x.clone().requires_grad_(True), w.bfloat16().requires_grad_(True)
    LinearCrossEntropyLoss(backend="reference")(xl, wb, y).backward()
    assert xl.grad.dtype == torch.float32 and wb.grad.dtype == torch.bfloat16


def test_mixed_dtypes_get_float32_gradients_rounded_once():
    # x in float16, W in float32: W's gradient was computed in float16 and
    # overflowed (4096 rows of 20: -71680 per class-0 entry, past f16's 65504).
    x = torch.full((4096, 4), 20.0).half().requires_grad_(True)
    w = torch.zeros(8, 4, requires_grad=True)
    y = torch.zeros(4096, dtype=torch.long)
    with pytest.warns(UserWarning, match="reference"):  # the cpu backend declines
        linear_cross_entropy(x, w, y, reduction="sum").backward()
    xr, wr = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    F.cross_entropy(xr @ wr.T, y, reduction="sum").backward()
    assert w.grad.dtype == torch.float32 and x.grad.dtype == torch.float16
    assert torch.isfinite(w.grad).all()
    norm_close("grad_w", w.grad, wr.grad, RTOL[torch.float32])
    norm_close("grad_x", x.grad.float(), xr.grad, 1e-3)  # float16's rounding, 2^-11


def test_mixed_storage_on_the_cpu_warns_that_the_reference_runs():
    # bf16 x and float32 W: the cpu backend declines, so the float64
    # reference computed it, silently.
    x, w, _, y, _, _ = make(torch.float32, {}, seed=17)
    with pytest.warns(UserWarning, match=r"x torch.bfloat16, W torch.float32: .*reference") as got:
        linear_cross_entropy(x.bfloat16(), w, y)
        LinearCrossEntropyLoss()(x.bfloat16(), w, y)
    assert [r.filename for r in got] == [__file__] * 2  # the caller's line, past nn.Module
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        linear_cross_entropy(x.bfloat16(), w, y, backend="reference")  # asked for
        linear_cross_entropy(x[:0].bfloat16(), w, y[:0])  # no rows: nothing runs
        linear_cross_entropy(x, w.double(), y)  # float64: the reference, as documented
        linear_cross_entropy(x.bfloat16(), w.bfloat16(), y)
    # Bool labels: flce's message, with rows or without (torch.iinfo raised).
    for rows in (len(y), 0):
        with pytest.raises(TypeError, match="^labels: dtype bool is not a class index"):
            linear_cross_entropy(x[:rows], w, y[:rows] > 3)
    # Declined for another reason: flce's own note, at the caller's line too.
    with pytest.warns(UserWarning, match=r"reference backend .* cpu: softcap = 1e-39") as got:
        linear_cross_entropy(x, w, y, softcap=1e-39)
    assert [r.filename for r in got] == [__file__]
    # Once per step, also where backward computes the gradients (it warned
    # again at loss.backward()).
    xg = x.detach().clone().requires_grad_(True)
    with pytest.warns(UserWarning, match=r"reference backend .* cpu: softcap = 1e-39") as got:
        linear_cross_entropy(xg, w, y, softcap=1e-39, grads_in_forward=False).backward()
    assert len(got) == 1 and xg.grad is not None


def test_the_module_shows_its_settings():
    text = repr(LinearCrossEntropyLoss(softcap=30.0, threads=2, filter_eps="auto"))
    assert "softcap=30.0" in text and "threads=2" in text and "filter_eps='auto'" in text
    assert "gemm" not in text  # defaults beyond the first eight are left out


def test_a_float64_weight_makes_the_loss_and_lse_float64():
    # x float32, W float64: the lse was float32, and a recomputed backward
    # (grads_in_forward=False, or a second backward) read it rounded: W's
    # float64 gradient was off by 2.6e-7 relative, 6.9e-16 with x float64.
    torch.manual_seed(3)
    x = torch.randn(16, 8) * 3
    w = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 11, (16,))
    loss, lse = linear_cross_entropy(x, w, y, return_lse=True, grads_in_forward=False)
    assert loss.dtype == lse.dtype == torch.float64
    loss.backward()
    wr = w.detach().clone().requires_grad_(True)
    F.cross_entropy(x.double() @ wr.T, y).backward()
    norm_close("grad_w", w.grad, wr.grad, 1e-12)


def _autocast_cpu_or_skip():
    if not hasattr(torch, "autocast") or not hasattr(torch, "is_autocast_cpu_enabled"):
        pytest.skip(f"torch {torch.__version__} has no CPU autocast")
    return torch.autocast("cpu", dtype=torch.bfloat16)


def test_autocast_runs_in_its_dtype_as_f_linear_would():
    # Under torch.autocast, float32 W and bias with float32 or bfloat16 x run
    # as their bfloat16 casts (F.linear's inputs there), on the cpu backend
    # (which declines mixed dtypes), and the float32 parameters get the
    # bfloat16 run's gradients as float32: the bytes of casting by hand.
    x, w, b, y, _, _ = make(torch.float32, {}, seed=16)
    for x_dtype in (torch.float32, torch.bfloat16):
        xa, wa, ba = (t.detach().clone().requires_grad_(True) for t in (x.to(x_dtype), w, b))
        with _autocast_cpu_or_skip():
            loss = linear_cross_entropy(xa, wa, y, ba, backend="cpu", return_lse=True)
        sum(part.float().sum() for part in loss).backward()
        xh, wh, bh = (t.detach().bfloat16().requires_grad_(True) for t in (xa, wa, ba))
        want = linear_cross_entropy(xh, wh, y, bh, backend="cpu", return_lse=True)
        sum(part.float().sum() for part in want).backward()
        assert all(torch.equal(g, e) for g, e in zip(loss, want))
        assert wa.grad.dtype == torch.float32 and xa.grad.dtype == x_dtype
        for got, by_hand in ((xa.grad, xh.grad), (wa.grad, wh.grad), (ba.grad, bh.grad)):
            assert torch.equal(got, by_hand.to(got.dtype))
    # float64 is left alone, as autocast leaves it (the reference backend).
    xd, wd = x.double().requires_grad_(True), w.double()
    with _autocast_cpu_or_skip():
        loss = linear_cross_entropy(xd, wd, y)
    assert loss.dtype == torch.float64
    loss.backward()
    assert xd.grad.dtype == torch.float64


def _step(x, w, b, y, scale=1.0, retain=False, **kw):
    xa, wa, ba = leaves(x, w, b)
    loss = linear_cross_entropy(xa, wa, y, ba, backend="cpu", **kw)
    (loss * scale).backward(retain_graph=retain)
    return loss, xa, wa, ba


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_gradients_computed_in_forward(dtype, monkeypatch):
    # grads_in_forward (the default): forward runs loss_and_grad and backward
    # only hands its gradients over (flce.backward is never called), scaled
    # by a power of two into the bytes loss_and_grad gives for that
    # grad_loss; float32 ones take any scale, 16-bit ones recompute.
    x, w, b, y, _, _ = make(dtype, {}, seed=17)
    recompute = flce.backward

    def no_backward(*args, **kw):
        raise AssertionError("flce.backward was called")
    monkeypatch.setattr(flce, "backward", no_backward)
    loss, xa, wa, ba = _step(x, w, b, y)
    flce.testing.assert_close({"loss": loss.detach(), "grad_x": xa.grad, "grad_w": wa.grad,
                               "grad_bias": ba.grad}, x, w, y, bias=b)
    for scale in (1.0, 4.0, -0.5, 2.0 ** -20, 2.0 ** 16):
        _, xs, ws, bs = _step(x, w, b, y, scale)
        want = flce.loss_and_grad(x, w, y, bias=b, grad_loss=scale, grad_dtype="input",
                                  backend="cpu")
        for got, name in ((xs, "grad_x"), (ws, "grad_w"), (bs, "grad_bias")):
            assert torch.equal(got.grad, getattr(want, name)), (scale, name)
    calls = []
    monkeypatch.setattr(flce, "backward", lambda *a, **k: calls.append(1) or recompute(*a, **k))
    for scale in (3.0, 0.1):
        if dtype == torch.float32:
            _, xs, ws, bs = _step(x, w, b, y, scale)
        else:
            with pytest.warns(UserWarning, match=f"differentiated by {scale:g}, not a power"):
                _, xs, ws, bs = _step(x, w, b, y, scale)
        flce.testing.assert_close({"grad_x": xs.grad, "grad_w": ws.grad, "grad_bias": bs.grad},
                                  x, w, y, bias=b, grad_loss=scale)
    assert len(calls) == (0 if dtype == torch.float32 else 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_zero_or_non_finite_grad_loss_recomputes(dtype):
    # 0, inf and NaN times the unit gradients gave NaN where the gradient for
    # that grad_loss is 0 (the ignored rows 1 and 6 of grad_x); they are
    # recomputed, with no warning: the bits of grads_in_forward=False.
    x, w, b, y, _, _ = make(dtype, {}, seed=23)
    for scale in (0.0, float("inf"), float("nan")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = _step(x, w, b, y, scale)
        want = _step(x, w, b, y, scale, grads_in_forward=False)
        for g, e in zip(got[1:], want[1:]):
            torch.testing.assert_close(g.grad, e.grad, rtol=0, atol=0, equal_nan=True,
                                       msg=lambda m: f"grad_loss {scale}: {m}")
        assert torch.equal(got[1].grad[[1, 6]], torch.zeros(2, H, dtype=dtype)), scale


def test_float16_gradients_are_not_computed_in_forward(monkeypatch):
    # A loss scaler's 2^16 times float16 gradients of grad_loss = 1 overflows
    # (and small ones underflow before the scaling): float16 recomputes, so
    # the bytes are those of grads_in_forward=False.
    x, w, b, y, _, _ = make(torch.float16, {}, seed=19)
    calls = []
    step = flce.loss_and_grad
    monkeypatch.setattr(flce, "loss_and_grad", lambda *a, **k: calls.append(1) or step(*a, **k))
    got = _step(x, w, b, y, 2.0 ** 16)
    want = _step(x, w, b, y, 2.0 ** 16, grads_in_forward=False)
    assert not calls
    for g, e in zip(got[1:], want[1:]):
        assert torch.isfinite(g.grad).all() and torch.equal(g.grad, e.grad)


def test_gradients_in_forward_only_where_backward_takes_them(monkeypatch):
    # A second backward (retain_graph) recomputes: the first one handed its
    # gradients over. No gradients in forward under no_grad, with
    # grads_in_forward=False, for reduction='none', or with the lse returned.
    x, w, b, y, _, _ = make(torch.float32, {}, seed=18)
    loss, xa, wa, ba = _step(x, w, b, y, retain=True)
    first = xa.grad.clone()
    recomputed = []
    recompute = flce.backward
    monkeypatch.setattr(flce, "backward",
                        lambda *a, **k: recomputed.append(1) or recompute(*a, **k))
    loss.backward()  # accumulates the recomputed gradient into the first
    assert recomputed == [1]
    flce.testing.assert_close({"grad_x": xa.grad - first}, x, w, y, bias=b)

    calls = []
    step = flce.loss_and_grad
    monkeypatch.setattr(flce, "loss_and_grad", lambda *a, **k: calls.append(1) or step(*a, **k))
    xa, wa, ba = leaves(x, w, b)
    with torch.no_grad():
        linear_cross_entropy(xa, wa, y, ba)
    for kw in ({"grads_in_forward": False}, {"reduction": "none"}, {"return_lse": True}):
        out = linear_cross_entropy(xa, wa, y, ba, **kw)
        (out[0] if isinstance(out, tuple) else out).sum().backward()
    assert not calls
    _step(x, w, b, y)
    assert calls == [1]


def test_no_double_backward_and_no_weight_gradients():
    x, w, b, y, _, _ = make(torch.float64, {}, seed=13)
    xl = x.clone().requires_grad_(True)
    loss = linear_cross_entropy(xl, w, y)
    with pytest.raises(RuntimeError, match="no double backward"):
        torch.autograd.grad(loss, xl, create_graph=True)
    for name in ("token_weights", "class_weights"):
        weights = torch.ones(N if name == "token_weights" else V, dtype=torch.float64,
                             requires_grad=True)
        with pytest.raises(ValueError, match=f"^{name}: requires grad"):
            linear_cross_entropy(xl, w, y, **{name: weights})
        with torch.no_grad():  # an evaluation loop over a learned weight: no gradient asked
            got = linear_cross_entropy(xl, w, y, **{name: weights})
        assert torch.equal(got, linear_cross_entropy(x, w, y, **{name: weights.detach()}))


def test_no_batched_backward():
    # is_grads_batched (jacobian(vectorize=True)) hands backward a batch of
    # cotangents flce cannot read: a clear error, not torch's internal one.
    x, w, b, y, _, _ = make(torch.float64, {}, seed=24)
    xl = x.clone().requires_grad_(True)
    loss = linear_cross_entropy(xl, w, y, reduction="none")
    with pytest.raises(RuntimeError, match="no batched backward"):
        torch.autograd.grad(loss, xl, torch.eye(N, dtype=torch.float64), is_grads_batched=True)


def test_16_bit_weights_are_taken_as_float32():
    # As a bf16 model gives them: token weights (a mask) and class weights
    # in bfloat16 or float16 are converted, not refused.
    x, w, b, y, _, _ = make(torch.float32, {}, seed=25)
    tw, cw = torch.rand(N) + 0.5, torch.rand(V) + 0.5
    for dtype in (torch.bfloat16, torch.float16):
        tw16, cw16 = tw.to(dtype), cw.to(dtype)
        got = linear_cross_entropy(x, w, y, b, token_weights=tw16, class_weights=cw16)
        want = linear_cross_entropy(x, w, y, b, token_weights=tw16.float(),
                                    class_weights=cw16.float())
        assert torch.equal(got, want), dtype
    # Only 16-bit ones: an integer mask is named, as flce names it.
    with pytest.raises(ValueError, match=r"^token_weights: dtype i64 is not accepted"):
        linear_cross_entropy(x, w, y, b, token_weights=torch.ones(N, dtype=torch.int64))


def test_module_cast_to_bfloat16_keeps_float_class_weights():
    x, w, b, y, _, _ = make(torch.float32, {"class_weights": True}, seed=14)
    cw = torch.rand(V) + 0.5
    m = LinearCrossEntropyLoss(class_weights=cw).bfloat16()  # the buffer becomes bfloat16
    got = m(x.bfloat16(), w.bfloat16(), y)
    want = F.cross_entropy(x.bfloat16().double() @ w.bfloat16().double().T, y,
                           weight=cw.bfloat16().double())
    assert abs(got.item() - want.item()) <= 1e-5 * abs(want.item())


def test_module_state_and_errors():
    cw = torch.ones(V)
    m = LinearCrossEntropyLoss(class_weights=cw, label_smoothing=0.1, backend="cpu")
    assert "class_weights" in dict(m.named_buffers()) and "label_smoothing=0.1" in repr(m)
    x, w, b, y, _, _ = make(torch.float32, {}, seed=12)
    with pytest.raises(ValueError, match="does not match x's leading dimensions"):
        m(x, w, y[:3])
    with pytest.raises(TypeError, match="^x: expected a torch.Tensor"):
        m(x.numpy(), w, y)
    with pytest.raises(ValueError, match=r"^labels\[0\] = 99 is outside"):
        m(x, w, torch.full((N,), 99))
    with pytest.raises(ValueError, match="cpu"):
        LinearCrossEntropyLoss(backend="cpu")(x.double(), w.double(), y)
    # Options and weights named when wrong, not coerced by float() or reshape.
    for kwargs, error, message in (
            ({"label_smoothing": None}, TypeError, "^label_smoothing: expected a number"),
            ({"ignore_index": 1.5}, TypeError, "^ignore_index: expected an int, got float"),
            ({"softcap": True}, TypeError, "^softcap: expected a number, got bool"),
            ({"filter_eps": "AUTO"}, ValueError, "^filter_eps: 'AUTO' is not a number or 'auto'"),
            ({"token_weights": torch.ones(N + 1)}, ValueError,
             r"^token_weights: shape \(%d,\) is neither y's \(%d,\)" % (N + 1, N))):
        with pytest.raises(error, match=message):
            linear_cross_entropy(x, w, y, **kwargs)
    # A 0-d tensor is a number (it went through float() before).
    want = linear_cross_entropy(x, w, y, label_smoothing=0.1, ignore_index=-100)
    got = linear_cross_entropy(x, w, y, label_smoothing=torch.tensor(0.1),
                               ignore_index=torch.tensor(-100))
    assert torch.equal(got, want)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_a_batch_of_no_rows(reduction):
    # flce's semantics with D = 0, which the library gives for a batch whose
    # rows are all ignored: a loss of 0, zero gradients (PyTorch's mean is NaN).
    _, w, b, _, _, _ = make(torch.float32, {}, seed=13)
    w, b = (t.detach().requires_grad_(True) for t in (w, b))
    x = torch.zeros(2, 0, H, requires_grad=True)
    loss, lse, ent = linear_cross_entropy(x, w, torch.zeros(2, 0, dtype=torch.long), b,
                                          reduction=reduction, return_lse=True,
                                          return_entropy=True)
    assert loss.shape == ((2, 0) if reduction == "none" else ()) and loss.sum().item() == 0
    assert lse.shape == ent.shape == (2, 0)
    loss.sum().backward()
    assert x.grad.shape == x.shape
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))
    ignored = flce.loss_and_grad(torch.zeros(1, H), w.detach(), torch.tensor([-100]),
                                 bias=b.detach(), reduction=reduction)
    assert ignored.loss.sum().item() == 0 and not ignored.grad_w.any()
    # Shapes and options are still checked, as for one row, and the message
    # names x's rows (it named a one-row stand-in's).
    with pytest.raises(ValueError, match=rf"^w: shape \[13, 5\] does not match x \[0, {H}\]"):
        linear_cross_entropy(x, w[:, :5], torch.zeros(2, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="^reduction: 'avg'"):
        linear_cross_entropy(x, w, torch.zeros(2, 0, dtype=torch.long), reduction="avg")
    # An ignore_index beyond int32 labels: as with rows (it used to overflow).
    empty32 = torch.zeros(2, 0, dtype=torch.int32)
    assert linear_cross_entropy(x, w, empty32, ignore_index=2 ** 40).sum().item() == 0
