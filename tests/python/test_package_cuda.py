"""flce's Python package on torch CUDA tensors (the cuda backend): the
tensors are used in place (no copies), outputs come back on the same device,
the results agree with the oracle under the tolerance policy
(flce.testing.assert_close, float32 accumulation; with
grad_logits_dtype='storage', dlogits cast to the storage dtype), the bytes are
the same on every run, and flce.torch's autograd runs on the GPU. Skipped,
with the reason, where torch sees no CUDA device or flce has no usable cuda
backend (CI has no GPU: .ci/gpu runs this file on one).
"""

import pytest

from test_package_reference import import_flce, norm_close, torch

flce = import_flce()
if not torch.cuda.is_available():
    pytest.skip("torch sees no CUDA device", allow_module_level=True)
_CUDA = dict(flce.backends()).get("cuda", "not listed")
if _CUDA == "not listed" or _CUDA.startswith("declines every problem here"):
    pytest.skip(f"flce's cuda backend cannot run here: {_CUDA}", allow_module_level=True)

DEV = torch.device("cuda", 0)
OPTIONS = {
    "defaults": {},
    "everything": {"logit_scale": 0.8, "softcap": 4.0, "label_smoothing": 0.1, "z_loss": 1e-3,
                   "ignore_index": 5, "reduction": "none"},
    "hv_sum": {"w_layout": "hv", "reduction": "sum"},
}


def make(n, h, v, dtype, opts, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    w = torch.randn(h, v, generator=g, dtype=torch.float64) if opts.get("w_layout") == "hv" else \
        torch.randn(v, h, generator=g, dtype=torch.float64)
    y = torch.randint(0, v, (n,), generator=g)
    y[::7] = opts.get("ignore_index", -100)
    b = torch.randn(v, generator=g, dtype=torch.float64)
    return (x.to(dtype), (w / h ** 0.5).to(dtype), y, b.to(dtype))


def cpu(result):
    return {k: v.cpu() for k, v in result.as_dict().items()}


@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad_logits", ["f32", "storage"])
def test_loss_and_grad_agrees_with_the_oracle(name, dtype, grad_logits):
    opts = OPTIONS[name]
    x, w, y, b = make(300, 48, 5000, dtype, opts)
    xd, wd, yd, bd = x.to(DEV), w.to(DEV), y.to(DEV), b.to(DEV)
    r = flce.loss_and_grad(xd, wd, yd, bias=bd, outputs="all", grad_dtype="input",
                           grad_logits_dtype=grad_logits, backend="cuda", **opts)
    assert r.backend == "cuda"
    for k, v in r.as_dict().items():
        assert v.device == DEV, k
    cast = None if grad_logits == "f32" or dtype == torch.float32 else \
        {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    flce.testing.assert_close(cpu(r), x, w, y, bias=b, grad_cast=cast, **opts)


def test_assert_close_takes_cuda_inputs_and_outputs_as_they_are():
    # The example's pattern (examples/gpu_kernel_test): inputs and the
    # candidate's outputs on the GPU, handed over as they are; the reference
    # reads host memory, so flce.testing copies them (it declined before).
    inputs = flce.testing.adversarial_inputs("ignored_rows_index_0", bias=True, like="torch")
    on_gpu = {k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    r = flce.loss_and_grad(**on_gpu, outputs="all", backend="cuda")
    assert r.backend == "cuda"
    report = flce.testing.assert_close(r, **on_gpu)
    assert set(report) >= {"loss", "lse", "grad_x", "grad_w", "grad_bias"}


@pytest.mark.parametrize("name", ["everything", "defaults"])
def test_stashed_scores_agree_with_the_oracle(name, monkeypatch):
    # Tiles of 300 x 64 and blocks of 300 x 128 (one row block): block 0's
    # f16 codes are the gradient block, and grad_W's 480,000 bytes (5000 x
    # 48 bf16) past block 0's own rows (12,288 bytes) hold six blocks' more
    # (76,800 bytes each), so pass 2 reads classes 0-895 back (cuda/plan.h;
    # make_plan's figure) and recomputes the rest; judged with u_q = 2^-11
    # (packed_scores).
    monkeypatch.setenv("FLCE_CUDA_TILE", "300x64")
    monkeypatch.setenv("FLCE_CUDA_BLOCK", "300x128")
    opts = OPTIONS[name]
    x, w, y, b = make(300, 48, 5000, torch.bfloat16, opts)
    xd, wd, yd, bd = x.to(DEV), w.to(DEV), y.to(DEV), b.to(DEV)
    r = flce.loss_and_grad(xd, wd, yd, bias=bd, outputs="all", grad_dtype="input",
                           grad_logits_dtype="storage", backend="cuda", **opts)
    flce.testing.assert_close(cpu(r), x, w, y, bias=b, grad_cast="bfloat16",
                              packed_scores="float16", **opts)


def test_forward_then_backward_from_the_saved_lse():
    x, w, y, _ = make(257, 40, 3001, torch.bfloat16, {})
    xd, wd, yd = x.to(DEV), w.to(DEV), y.to(DEV)
    f = flce.forward(xd, wd, yd, outputs=("entropy",), backend="cuda")
    g_ent = torch.linspace(-1, 1, 257, dtype=torch.float32)
    bwd = flce.backward(xd, wd, yd, f.lse, grad_entropy=g_ent.to(DEV), grad_dtype="input",
                        backend="cuda")
    flce.testing.assert_close(cpu(f), x, w, y)
    flce.testing.assert_close(cpu(bwd), x, w, y, grad_entropy=g_ent, saved_lse="float32")


def test_torch_backward_of_the_lse_alone():
    # The loss unused: autograd passes no grad_loss, and flce.torch makes zeros
    # for it, on the GPU.
    x, w, y, _ = make(64, 40, 300, torch.float32, {})
    y = y.clamp(min=0)  # no ignored rows
    xd = x.to(DEV).requires_grad_(True)
    _, lse = flce.torch.linear_cross_entropy(xd, w.to(DEV), y.to(DEV), return_lse=True)
    lse.sum().backward()
    xr = x.double().requires_grad_(True)
    torch.logsumexp(xr @ w.double().T, dim=1).sum().backward()
    norm_close("grad_x", xd.grad.cpu(), xr.grad, 1e-4)


def test_outputs_are_written_in_place_and_inputs_are_not_copied():
    x, w, y, _ = make(64, 32, 700, torch.bfloat16, {})
    xd, wd, yd = x.to(DEV), w.to(DEV), y.to(DEV)
    gx = torch.full((64, 32), float("nan"), dtype=torch.float32, device=DEV)
    before = (xd.data_ptr(), wd.data_ptr(), xd.clone(), wd.clone())
    r = flce.loss_and_grad(xd, wd, yd, out={"grad_x": gx}, backend="cuda")
    assert r.grad_x.data_ptr() == gx.data_ptr() and not torch.isnan(gx).any()
    assert (xd.data_ptr(), wd.data_ptr()) == before[:2]
    assert torch.equal(xd, before[2]) and torch.equal(wd, before[3])


def test_logits_entry_in_place():
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(50, 999, generator=g) * 3).to(torch.bfloat16)
    y = torch.randint(0, 999, (50,), generator=g)
    ld = logits.to(DEV)
    ptr = ld.data_ptr()
    r = flce.loss_and_grad(logits=ld, labels=y.to(DEV), inplace=True, grad_dtype="input",
                           backend="cuda")
    assert r.grad_logits.data_ptr() == ptr
    flce.testing.assert_close({"loss": r.loss.cpu(), "grad_logits": ld.cpu()}, logits=logits,
                              labels=y)


def test_in_place_writes_bump_the_autograd_version():
    # As after torch's own in-place ops, a graph that saved the tensor flce
    # wrote refuses to run backward (torch >= 2.1; the device's is 2.11).
    if not hasattr(torch.autograd.graph, "increment_version"):
        pytest.skip(f"torch {torch.__version__} has no autograd.graph.increment_version")
    a = torch.randn(50, 999, device=DEV, requires_grad=True)
    z = a * 1.0
    saved = z * z  # saves z
    gx = torch.zeros(50, 999, device=DEV)
    version = (z._version, gx._version)
    y = torch.randint(0, 999, (50,), device=DEV)
    flce.loss_and_grad(logits=z.detach(), labels=y, inplace=True, backend="cuda")
    flce.loss_and_grad(logits=a.detach(), labels=y, out={"grad_logits": gx}, backend="cuda")
    assert z._version > version[0] and gx._version > version[1]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.sum().backward()


def test_torch_hv_view_of_a_vh_weight_runs_as_that_weight():
    # lm_head.weight.t() with w_layout='hv' runs as the [V, H] it views (the
    # fused kernels' layout): the same bytes as passing the weight itself.
    x, w, y, _ = make(64, 32, 700, torch.bfloat16, {})
    grads = []
    for transposed in (False, True):
        xd = x.to(DEV).requires_grad_(True)
        wd = w.to(DEV).requires_grad_(True)
        arg = wd.t() if transposed else wd
        loss = flce.torch.linear_cross_entropy(xd, arg, y.to(DEV), backend="cuda",
                                               w_layout="hv" if transposed else "vh")
        loss.backward()
        grads.append((loss.detach(), xd.grad, wd.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def _same_bytes(a, b):
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k].cpu(), b[k].cpu()
        assert torch.equal(x.view(torch.uint8) if x.dim() else x,
                           y.view(torch.uint8) if y.dim() else y), k


def test_same_bytes_on_every_run():
    x, w, y, b = make(1000, 64, 9000, torch.bfloat16, OPTIONS["everything"])
    xd, wd, yd, bd = x.to(DEV), w.to(DEV), y.to(DEV), b.to(DEV)
    runs = [flce.loss_and_grad(xd, wd, yd, bias=bd, outputs="all", grad_logits_dtype="storage",
                               backend="cuda", **OPTIONS["everything"]).as_dict()
            for _ in range(3)]
    for later in runs[1:]:
        _same_bytes(later, runs[0])


def test_torch_module_trains_on_the_gpu():
    torch.manual_seed(0)
    x = torch.randn(128, 32, device=DEV, requires_grad=True)
    head = torch.nn.Linear(32, 500, bias=False, device=DEV)
    y = torch.randint(0, 500, (128,), device=DEV)
    loss = flce.torch.LinearCrossEntropyLoss()(x, head.weight, y)
    loss.backward()
    ref_x = x.detach().clone().requires_grad_(True)
    ref_w = head.weight.detach().clone().requires_grad_(True)
    ref = torch.nn.functional.cross_entropy(ref_x.double() @ ref_w.double().T, y)
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-5 * abs(ref.item())
    assert torch.allclose(x.grad.double(), ref_x.grad.double(), rtol=0, atol=1e-6)
    assert torch.allclose(head.weight.grad.double(), ref_w.grad.double(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad_logits", ["f32", "storage"])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_flce_torch_training_step_agrees_with_the_oracle(dtype, grad_logits, softcap):
    # What a training loop runs: flce.torch's loss on 16-bit CUDA tensors,
    # then backward, asking for no per-row output (the backend keeps no sum
    # of p s, and without a bias G takes its plain forms). Judged by the
    # policy, as flce.loss_and_grad's outputs are above; without u_q, since
    # no plan stashes here: grad_W's 9000 x 64 bf16 hold 960 classes of
    # codes for 600 rows, less than one 2048-class tile, and one gradient
    # block spans V (cuda/plan.cpp, stash_layout).
    x, w, y, _ = make(600, 64, 9000, dtype, {}, seed=3)
    xd, wd = (t.to(DEV).requires_grad_(True) for t in (x, w))
    loss = flce.torch.linear_cross_entropy(xd, wd, y.to(DEV), softcap=softcap,
                                           grad_logits_dtype=grad_logits, backend="cuda")
    loss.backward()
    got = {"loss": loss.detach().cpu(), "grad_x": xd.grad.cpu(), "grad_w": wd.grad.cpu()}
    cast = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    flce.testing.assert_close(got, x, w, y, softcap=softcap,
                              grad_cast=cast if grad_logits == "storage" else None)


def test_autocast_runs_in_its_dtype_as_f_linear_would():
    # A float32 head under torch.autocast(bfloat16) runs as its bfloat16 cast
    # (the fused path on an H100), with float32 gradients: the bytes of
    # casting by hand.
    x, w, y, b = make(300, 64, 5000, torch.float32, {})
    xa, wa, ba = (t.to(DEV).requires_grad_(True) for t in (x, w, b))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = flce.torch.linear_cross_entropy(xa, wa, y.to(DEV), ba, backend="cuda")
    loss.backward()
    xh, wh, bh = (t.detach().bfloat16().requires_grad_(True) for t in (xa, wa, ba))
    want = flce.torch.linear_cross_entropy(xh, wh, y.to(DEV), bh, backend="cuda")
    want.backward()
    assert torch.equal(loss, want)
    for got, by_hand in ((xa.grad, xh.grad), (wa.grad, wh.grad), (ba.grad, bh.grad)):
        assert got.dtype == torch.float32 and torch.equal(got, by_hand.float())


def _two_like_gpus_missing():
    if torch.cuda.device_count() < 2:
        return f"{torch.cuda.device_count()} CUDA device(s) visible, and the test needs 2"
    a, b = torch.cuda.get_device_properties(0), torch.cuda.get_device_properties(1)
    if (a.name, a.multi_processor_count) != (b.name, b.multi_processor_count):
        return f"cuda:0 ({a.name}) and cuda:1 ({b.name}) differ"
    return ""


@pytest.mark.skipif(bool(_two_like_gpus_missing()),
                    reason=f"needs two like GPUs: {_two_like_gpus_missing()}")
def test_tensors_on_another_device_than_the_current_one():
    # A data-parallel rank's tensors on cuda:1 while cuda:0 is current: the
    # outputs come back on cuda:1 with cuda:0's bytes (torch's stream and
    # scratch of cuda:1), cuda:0 stays current, and autograd runs there too.
    opts = OPTIONS["everything"]
    x, w, y, b = make(1000, 64, 9000, torch.bfloat16, opts)
    on = {}
    for d in (0, 1):
        dev = torch.device("cuda", d)
        with torch.cuda.device(0):
            r = flce.loss_and_grad(x.to(dev), w.to(dev), y.to(dev), bias=b.to(dev),
                                   outputs="all", grad_logits_dtype="storage", backend="cuda",
                                   **opts)
            assert torch.cuda.current_device() == 0
        assert all(v.device == dev for v in r.as_dict().values())
        on[d] = r.as_dict()
    _same_bytes(on[1], on[0])

    grads = {}
    for d in (0, 1):
        dev = torch.device("cuda", d)
        xd = x.to(dev).requires_grad_(True)
        wd = w.to(dev).requires_grad_(True)
        with torch.cuda.device(0):
            loss = flce.torch.LinearCrossEntropyLoss()(xd, wd, y.to(dev))
            loss.backward()
        assert loss.device == xd.grad.device == wd.grad.device == dev
        grads[d] = {"loss": loss.detach(), "grad_x": xd.grad, "grad_w": wd.grad}
    _same_bytes(grads[1], grads[0])


# N x V above 2^31 elements: row 16383 holds element 2^31 (16383 x 131073 <
# 2^31 < 16384 x 131073), and the last row the highest offsets.
BIG_N, BIG_V = 16400, 131073
BIG_ROWS = [0, 16382, 16383, BIG_N - 1]


def _big_or_skip(gib):
    free = torch.cuda.mem_get_info(DEV)[0]
    if free < gib << 30:
        pytest.skip(f"needs {gib} GiB free on {DEV}, {free >> 30} GiB free")


def test_logits_entry_beyond_2_31_elements():
    # 4.3 GB of bf16 logits, dlogits written in place: rows are independent
    # under reduction 'none', so the rows at and past offset 2^31 are judged
    # against the oracle run on those rows alone.
    _big_or_skip(10)
    g = torch.Generator(device=DEV).manual_seed(7)
    logits = torch.randn(BIG_N, BIG_V, generator=g, device=DEV, dtype=torch.bfloat16) * 3
    y = torch.randint(0, BIG_V, (BIG_N,), generator=g, device=DEV)
    y[-1] = BIG_V - 1  # the very last element is a label
    idx = torch.tensor(BIG_ROWS, device=DEV)
    kept = logits[idx].cpu()
    r = flce.loss_and_grad(logits=logits, labels=y, inplace=True, reduction="none",
                           grad_dtype="input", backend="cuda")
    got = {"loss": r.loss[idx].cpu(), "lse": r.lse[idx].cpu(), "grad_logits": logits[idx].cpu()}
    del logits, r
    flce.testing.assert_close(got, logits=kept, labels=y[idx].cpu(), reduction="none")


def test_head_beyond_2_31_scores():
    # A head with N x V above 2^31 (its scores are never held): every row
    # but BIG_ROWS ignored, so grad_W and grad_bias are those of BIG_ROWS
    # alone and the whole step is judged against the oracle on those rows
    # (with u_q: bf16 dlogits may stash scores, as in the stash test above).
    _big_or_skip(4)
    x, w, y, b = make(BIG_N, 64, BIG_V, torch.bfloat16, {}, seed=8)
    y[:] = -100
    y[BIG_ROWS] = torch.tensor([5, BIG_V - 1, 77, BIG_V - 2])
    r = flce.loss_and_grad(x.to(DEV), w.to(DEV), y.to(DEV), bias=b.to(DEV), outputs="all",
                           grad_logits_dtype="storage", grad_dtype="input", backend="cuda")
    got = {k: v.cpu() for k, v in r.as_dict().items()}
    rows = {k: got[k][BIG_ROWS] for k in ("lse", "logprob", "argmax", "entropy", "zloss",
                                          "grad_x")}
    assert not got["grad_x"][1:16382].any()  # ignored rows
    flce.testing.assert_close({**got, **rows}, x[BIG_ROWS], w, y[BIG_ROWS], bias=b,
                              grad_cast="bfloat16", packed_scores="float16")
