"""flce.testing: the ported tolerance policy, assert_close's verdicts and
reports, and the adversarial input generators.

tests/policy_golden.txt holds bounds computed by the C++ policy itself
(tests/support/tolerance.cpp's error_bounds on its brute force, written by
tests/test_policy_golden.cpp) for the three problems of _golden_problems(); the
Python port must reproduce them to rounding.
"""

import os

import pytest

from test_package_reference import import_flce, np, peaky_bf16_head, torch

flce = import_flce()
ft = flce.testing


def _golden_problems():
    n, h, v = 3, 4, 5
    i, k, j = np.arange(n)[:, None], np.arange(h)[None, :], np.arange(v)[:, None]
    head = dict(x=np.sin(1.3 * i + 0.7 * k), w=np.cos(0.9 * j - 0.4 * k) / 2,
                bias=0.1 * np.arange(v) - 0.3, labels=np.array([2, -100, 4]),
                token_weights=np.array([1.0, 0.5, 2.0]),
                class_weights=np.array([1.0, 0.5, 2.0, 1.5, 0.25]),
                grad_lse=np.array([0.5, -1.0, 0.25]), grad_entropy=np.array([-0.3, 0.2, 0.7]),
                logit_scale=1.7, softcap=2.5, label_smoothing=0.1, z_loss=0.01,
                reduction="mean", accumulate="float32", storage="bfloat16",
                grad_cast="float16", saved_lse="float32", packed_scores="float16",
                out_dtype="float32")
    z = 3.0 * np.cos(np.arange(4)[:, None] * 1.1 + np.arange(6)[None, :] * 0.6)
    z[0, 1] = -np.inf
    logits = dict(logits=z, labels=np.array([1, 0, 5, -1]),
                  grad_loss=np.array([1.0, -2.0, 0.5, 3.0]),
                  grad_entropy=np.array([0.1, 0.2, -0.3, 0.4]), ignore_index=-1,
                  reduction="none", label_smoothing=0.2, accumulate="float32",
                  grad_cast="float16", out_dtype="float64")
    i, k, j = np.arange(4)[:, None], np.arange(3)[None, :], np.arange(6)[:, None]
    filtered = dict(x=2.0 * np.sin(0.8 * i - 1.1 * k), w=np.cos(1.7 * j + 0.5 * k),
                    bias=0.2 * (np.arange(6) % 3) - 0.1, labels=np.array([0, 3, 5, 1]),
                    class_weights=np.array([1.0, 2.0, 0.5, 1.0, 1.5, 0.75]),
                    grad_lse=np.array([0.0, 0.25, 0.0, -0.5]), label_smoothing=0.1,
                    z_loss=0.02, reduction="sum", accumulate="float32", storage="bfloat16",
                    grad_cast="bfloat16", filter_eps=2.0**-4, out_dtype="float32")
    return head, logits, filtered


def _golden(index):
    """{output: bounds} of problem `index` in tests/policy_golden.txt, which
    tests/test_policy_golden.cpp writes from the C++ policy and checks."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "policy_golden.txt")
    golden = {}
    with open(path) as f:
        for line in f:
            fields = line.split()
            if fields and not fields[0].startswith("#") and int(fields[0]) == index:
                golden[fields[1]] = [float(v) for v in fields[2:]]
    assert golden, f"{path} has no bounds of problem {index}"
    return golden


@pytest.mark.parametrize("index", [0, 1, 2])
@pytest.mark.parametrize("chunk", [1, 7, None])
def test_bounds_reproduce_the_cpp_policy(index, chunk):
    problem = _golden_problems()[index]
    golden = _golden(index)
    _, bounds = ft.bounds(**problem, chunk_elements=chunk)
    for name, want in golden.items():
        got, want = np.ravel(bounds[name]), np.array(want)
        assert got.shape == want.shape, f"{name}: {got.shape} bounds vs C++ {want.shape}"
        with np.errstate(invalid="ignore"):  # inf - inf where both are inf
            same = (got == want) | (np.abs(got - want) <= 1e-12 * np.abs(want))
        assert same.all(), f"{name}: {got} vs C++ {want}"


def _problem(**kw):
    return ft.make_inputs(n=24, h=8, v=40, bias=True, seed=1, **kw)


def test_assert_close_accepts_flce_outputs_and_reports_fractions():
    for dtype, backend in (("float32", "cpu"), ("bfloat16", "cpu"), ("float64", "reference")):
        inp = _problem(dtype=dtype)
        out = "float64" if dtype == "float64" else "float32"
        r = flce.loss_and_grad(**inp, outputs="all", out_dtype=out, backend=backend)
        acc = "float64" if dtype == "float64" else "float32"
        report = ft.assert_close(r, **inp, accumulate=acc)
        assert set(report) == {"loss", "lse", "logprob", "entropy", "zloss", "grad_x", "grad_w",
                               "grad_bias"}
        assert all(0 <= v <= 1 for v in report.values()), report


def test_report_names_count_worst_index_and_bound():
    inp = _problem()
    r = flce.loss_and_grad(**inp, outputs="all")
    gw = r.grad_w.copy()
    gw[7, 3] += 1e-3
    lse = r.lse.copy()
    lse[5] = np.nan
    with pytest.raises(AssertionError) as info:
        ft.assert_close({"loss": r.loss * (1 + 1e-4), "lse": lse, "grad_w": gw}, **inp,
                        msg="my kernel")
    text = str(info.value)
    assert text.startswith("my kernel\n  flce.testing.assert_close: 3 output(s)")
    assert "loss: 1 of 1 elements exceed C * bound; worst at []" in text
    assert "grad_w: 1 of 320 elements exceed C * bound; worst at [7, 3]" in text
    assert "lse: 0 of 23 finite (of 24) elements exceed C * bound" in text
    assert "1 NaN/Inf position mismatches, first at [5]: actual nan" in text
    assert "vs bound" in text and "ratio" in text
    # A NaN loss: no finite pair to show as the worst (it read "0 of 1
    # elements exceed C * bound ... (ratio -1)", as if it had passed).
    with pytest.raises(AssertionError) as info:
        ft.assert_close({"loss": np.float32(np.nan)}, **inp)
    text = str(info.value)
    assert "loss: none of 1 elements is finite on both sides, with a finite bound; 1 NaN/Inf " \
        "position mismatches, first at []: actual nan" in text
    assert "ratio" not in text and "exceed" not in text


def test_argmax_check_allows_ties_within_the_logit_bounds_only():
    z = np.array([[1.0, 1.0 + 1e-9, -2.0], [0.0, 5.0, 1.0], [np.nan, 1.0, 2.0]])
    y = np.array([0, 1, 2])
    ft.assert_close({"argmax": np.array([0, 1, 0])}, logits=z, labels=y,
                    accumulate="float32")  # row 0: a gap far below the f32 logit bound
    with pytest.raises(AssertionError, match=r"argmax\[0\] = 0 .* exceeds"):
        ft.assert_close({"argmax": np.array([0, 1, 0])}, logits=z, labels=y,
                        accumulate="float64")  # ... but not below the f64 one
    with pytest.raises(AssertionError, match=r"argmax\[1\] = 2 .* exceeds the logit bounds"):
        ft.assert_close({"argmax": np.array([1, 2, 0])}, logits=z, labels=y)
    with pytest.raises(AssertionError, match=r"argmax\[2\] = 2, expected 0 \(the first NaN"):
        ft.assert_close({"argmax": np.array([1, 1, 2])}, logits=z, labels=y)


def test_argmax_of_another_length_fails():
    z = np.array([[1.0, 3.0, -2.0], [0.0, 5.0, 1.0], [4.0, 1.0, 2.0]])
    y = np.array([0, 1, 2])
    ft.assert_close({"argmax": np.array([1, 1, 0])}, logits=z, labels=y)
    for wrong in (np.array([1]), np.array([1, 1, 0, 7])):  # rows missing, or junk past N
        with pytest.raises(AssertionError, match=r"argmax: shape \(\d,\), expected \(3,\)"):
            ft.assert_close({"argmax": wrong}, logits=z, labels=y)


def test_an_infinite_bound_is_a_construction_error_not_a_pass():
    # gamma_V is infinite once V u_a >= 1: with f16 accumulation and V =
    # 4096 every lse bound is +inf, so any lse would be "within" it.
    inp = ft.make_inputs(n=4, h=8, v=4096, seed=2)
    r = flce.forward(**inp)
    _, bound = ft.bounds(**inp, outputs=["lse"], accumulate="float16")
    assert np.isinf(bound["lse"]).all()
    with pytest.raises(AssertionError, match="NaN or infinite bound"):
        ft.assert_close({"lse": r.lse * 3}, **inp, accumulate="float16")


def _f32_logits_candidate(logits, labels, **_):
    z = torch.tensor(logits, dtype=torch.float32, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(z, torch.as_tensor(labels))
    loss.backward()
    return {"loss": loss.detach().numpy(), "lse": torch.logsumexp(z, 1).detach().numpy(),
            "grad_logits": z.grad.numpy()}


@pytest.mark.parametrize("mask", [-1e6, float(np.finfo(np.float32).min)])
def test_a_masked_class_leaves_its_rows_bounds_tight(mask):
    # A padding class masked by a huge negative logit has p = 0 but a logit
    # bound as large as the logit; the lse bound (Delta_i) once took the
    # row's largest, 6e31 here, and a loss off by 0.5 passed.
    inp = ft.make_inputs(n=32, h=16, v=128, entry="logits", seed=3)
    inp["logits"][:, -1] = mask
    good = _f32_logits_candidate(**inp)
    ft.assert_close(good, **inp)
    _, bound = ft.bounds(**inp, outputs=["lse"])
    assert bound["lse"].max() < 1e-3
    for wrong in ({"loss": good["loss"] + 0.5}, {"lse": good["lse"] - 0.5},
                  {"grad_logits": good["grad_logits"] * 1.01}):
        with pytest.raises(AssertionError, match="exceed C"):
            ft.assert_close(wrong, **inp)


@pytest.mark.parametrize("case", ["large_100", "large_1000"])
def test_logits_stored_in_bf16_pass_with_large_logits(case):
    # A candidate exact but for rounding its logits to bf16 (storage): with
    # |s| in the hundreds the logit errors reach O(1), where p's relative
    # error is e^relP - 1, not relP (grad_w failed at 1.78 and 247 times
    # its bound before).
    inp = ft.adversarial_inputs(case, dtype="bfloat16", like="torch", n=48)
    x, w = inp["x"].double(), inp["w"].double()
    z = (x @ w.T).to(torch.bfloat16).double()
    y = inp["labels"]
    g = torch.softmax(z, 1)
    g[torch.arange(len(y)), y] -= 1
    g /= len(y)
    lse = torch.logsumexp(z, 1)
    candidate = {"loss": (lse - z[torch.arange(len(y)), y]).mean().numpy(),
                 "lse": lse.numpy(), "grad_x": (g @ w).numpy(), "grad_w": (g.T @ x).numpy()}
    ft.assert_close(candidate, **inp, storage="bfloat16")


def test_p_bounds_hold_where_logit_errors_pass_p_itself():
    # A saved lse rounded to bf16 below both logits: the backward's p is
    # e^1.2 = 3.32 against 0.5, within the bound only if p's error is not
    # capped at 1 (a cap the first fix had).
    s = float(np.float32(997.2))
    logits, y = np.array([[s, s]]), np.array([0])
    lse_saved = float(torch.tensor(s + np.log(2)).to(torch.bfloat16))
    p = float(np.exp(np.float32(s - lse_saved)))
    ft.assert_close({"grad_logits": np.array([[p - 1, p]])}, logits=logits, labels=y,
                    reduction="sum", saved_lse="bfloat16")
    # Logits 2^20 + 4095 and 2^20 - 2047 both stored as 2^20 in bf16: the
    # exact p = (1, 0) in float64, the candidate's (0.5, 0.5). The second
    # class's p underflows, yet its logit bound (4088) allows any p.
    x, w = np.array([[1.0]]), np.array([[2.0**20 + 4095], [2.0**20 - 2047]])
    ft.assert_close({"grad_w": np.array([[-0.5], [0.5]])}, x, w, y, reduction="sum",
                    storage="bfloat16", accumulate="float32")


def test_entropy_cotangent_bound_holds_from_a_bf16_saved_lse():
    # A backward from a bf16-saved lse forms p' = e^{s - lse'} and sbar' =
    # sum_j p'_j s_j, as flce's backends do: p' = 1.97 and 2.98 here, far
    # from p, so the term p (ds + dmu) missed p' - p (43 times the bound).
    for row in ([1027.2, 1027.2], [1027.5, 1020.0]):
        s = np.array([row], dtype=np.float32).astype(np.float64)
        lse = float(np.logaddexp.reduce(s[0]))
        lse_saved = float(torch.tensor(lse, dtype=torch.float32).to(torch.bfloat16))
        p = np.exp((s - lse_saved).astype(np.float32)).astype(np.float64)
        g = -(p * (s - (p * s).sum()))
        ft.assert_close({"grad_logits": g}, logits=s, labels=np.array([0]), reduction="none",
                        grad_loss=np.array([0.0]), grad_entropy=np.array([1.0]),
                        saved_lse="bfloat16")


def test_float32_candidate_fails_a_float64_claim():
    inp = _problem(dtype="float64")
    r32 = flce.loss_and_grad(**{**inp, "x": inp["x"].astype(np.float32),
                                "w": inp["w"].astype(np.float32),
                                "bias": inp["bias"].astype(np.float32)}, outputs="all",
                             out_dtype="float64", grad_dtype="float64")
    ft.assert_close(r32, **{**inp, "x": inp["x"].astype(np.float32),
                            "w": inp["w"].astype(np.float32),
                            "bias": inp["bias"].astype(np.float32)})
    with pytest.raises(AssertionError, match="exceed C \\* bound"):
        ft.assert_close(r32, **inp, accumulate="float64")  # a float64 claim


def test_torch_outputs_and_unknown_names():
    inp = _problem(like="torch", dtype="bfloat16")
    r = flce.loss_and_grad(**inp, grad_dtype="input")
    assert r.grad_x.dtype == torch.bfloat16
    ft.assert_close(r, **inp)
    with pytest.raises(ValueError, match="not outputs of flce"):
        ft.assert_close({"logits": r.loss}, **inp)


def test_a_check_of_nothing_or_of_none_is_an_error():
    # {} passed, checking nothing; a candidate's None output was not checked.
    inp = _problem()
    r = flce.loss_and_grad(**inp)
    with pytest.raises(ValueError, match="no outputs to check"):
        ft.assert_close({}, **inp)
    with pytest.raises(ValueError, match=r"\['grad_x'\] are None"):
        ft.assert_close({"loss": r.loss, "grad_x": None}, **inp)


def test_each_failure_says_which_dtype_the_output_was_checked_as():
    # A numpy float32 scalar is a float32 output (it was read as float64,
    # with a 2^29 times tighter output rounding); a Python number (.item())
    # is a float64 one, and the line says so.
    inp = _problem()
    r = flce.forward(**inp)
    loss32 = np.float32(r.loss)
    report = ft.assert_close({"loss": loss32}, **inp)
    assert 0 <= report["loss"] <= 1
    assert ft.assert_close({"loss": loss32}, **inp) == ft.assert_close({"loss": r.loss}, **inp)
    with pytest.raises(AssertionError, match=r"worst at \[\].*\(checked as a float64 output\)"):
        ft.assert_close({"loss": float(r.loss) * (1 + 1e-3)}, **inp)
    with pytest.raises(AssertionError, match=r"\(checked as a float32 output\)"):
        ft.assert_close({"loss": np.float32(float(r.loss) * (1 + 1e-3))}, **inp)


def test_bounds_default_to_float32_outputs_where_a_dict_is_silent():
    inp = _problem()
    one = ft.bounds(**inp, out_dtype="float32")[1]
    some = ft.bounds(**inp, out_dtype={"loss": "float32"})[1]
    for name in ("lse", "entropy", "grad_x"):
        np.testing.assert_array_equal(some[name], one[name], err_msg=name)


@pytest.mark.parametrize("magnitude", [100.0, 1000.0])
def test_large_logits_have_the_asked_magnitude(magnitude):
    inp = ft.make_inputs(n=64, h=32, v=256, kind="large", magnitude=magnitude, dtype="float64")
    z = inp["x"] @ inp["w"].T
    assert 0.3 * magnitude < np.median(np.abs(z)) < 3 * magnitude


def test_generators():
    peaky = ft.make_inputs(n=400, h=8, v=500, kind="peaky", zipf=2.0, dtype="float64")
    p = np.exp(peaky["bias"] - np.logaddexp.reduce(peaky["bias"]))
    assert p.max() > 0.5 and np.mean(peaky["labels"] == np.argmax(p)) > 0.3
    for v in ft.TILE_VOCABS:
        assert ft.adversarial_inputs(f"vocab_{v}", n=4, h=4)["w"].shape == (v, 4)
    ign = ft.make_inputs(n=100, h=4, v=10, ignore_fraction=0.3, ignore_index=-7)
    frac = np.mean(ign["labels"] == -7)
    assert 0.1 < frac < 0.5 and ign["labels"][-1] != -7 and ign["ignore_index"] == -7
    assert (ft.adversarial_inputs("all_ignored", n=5, h=4)["labels"] == -100).all()
    exact = ft.make_inputs(n=8, h=8, v=16, bf16_values=True, bias=True)
    for name in ("x", "w", "bias"):
        a = exact[name]
        assert np.array_equal(ft.bf16_exact(a), a)
        assert np.array_equal(flce.bf16_bits_to_float32(flce.float32_to_bf16_bits(a)), a)
    bits = ft.make_inputs(n=4, h=4, v=8, dtype="bfloat16")
    assert bits["x"].dtype == np.uint16
    t = ft.make_inputs(n=4, h=4, v=8, dtype="bfloat16", like="torch", entry="logits")
    assert t["logits"].dtype == torch.bfloat16 and t["labels"].dtype == torch.int64
    hv = ft.make_inputs(n=4, h=3, v=8, w_layout="hv")
    assert hv["w"].shape == (3, 8) and hv["w_layout"] == "hv"
    with pytest.raises(ValueError, match="kind"):
        ft.make_inputs(kind="spiky")


# With |z| ~ 100 the exact gradients of W include subnormal float32 values
# (p_ij ~ e^-90), where the policy allows an absolute error of the smallest
# normal float32 (so an exp that flushes them to zero passes too).
@pytest.mark.parametrize("name", sorted(ft.ADVERSARIAL_CASES))
def test_cpu_backend_passes_every_adversarial_case(name):
    inp = ft.adversarial_inputs(name, n=48, h=16)
    ft.assert_close(flce.loss_and_grad(**inp, outputs="all"), **inp)


def test_filtered_gradients_pass_with_the_filter_allowance_only():
    # A peaky head, whose far tiles the cpu backend's filter skips at bf16's
    # auto eps: elementwise within
    # the policy once filter_eps says so, and outside it otherwise.
    xt, wt, y = peaky_bf16_head()
    kept = flce.loss_and_grad(xt, wt, y, grad_logits_dtype="storage", grad_dtype="float32",
                              filter_eps="auto", backend="cpu")
    assert kept.stats["grad_blocks_skipped"] > 0
    grads = {"grad_x": kept.grad_x, "grad_w": kept.grad_w}
    # The cpu backend's bf16 step with storage dlogits: G cast to bf16, the
    # scores kept as f16 differences (where its kernel set packs them).
    how = dict(x=xt, w=wt, labels=y, grad_cast="bfloat16", packed_scores="float16")
    report = ft.assert_close(grads, **how, filter_eps="auto")
    assert max(report.values()) <= 1
    with pytest.raises(AssertionError, match="grad_w"):
        ft.assert_close(grads, **how)
    with pytest.raises(ValueError, match="filter_eps"):
        ft.assert_close(grads, **how, filter_eps="often")


def test_gemm_inputs_may_read_subnormal_dlogits_as_zero():
    # Section 7's n(u_a) (the cpu backend flushes f32 G below the normal
    # range before its GEMMs): too small to move the golden bounds, so
    # checked here on its own.
    from flce import _bounds
    pr = _bounds.Precision(2.0**-24, 2.0**-24)
    zero = np.zeros(1)
    assert _bounds.gemm_input_error(pr, zero, zero)[0] == 2.0**-126
    assert _bounds.cast_error(pr, zero, zero)[0] == 0.0  # grad_logits: no GEMM
