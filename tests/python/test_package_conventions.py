"""Other implementations' conventions, reproduced by the reference oracle with
the settings README.md's "Matching other implementations" gives.

Each test writes the other project's loss from its own definition (in float64
PyTorch, gradients by autograd; no code of theirs), then checks that flce's
`reference` backend, given the mapped settings, returns the same loss and
gradients, and where the README says the plain settings differ, that they do.
A kernel author checking a Liger- or Megatron-style kernel against flce relies
on these recipes: a wrong one reads as a bug in their kernel.

Run: /usr/bin/python3 -m pytest -q tests/python/test_package_conventions.py
"""

import pytest

from test_package_reference import F, import_flce, norm_close, np, torch

flce = import_flce()

N, H, V = 12, 8, 11
IGNORE = -100
RTOL = 1e-12  # float64 on both sides: only the order of the sums differs


def head(seed=0, ignored=(1, 5, 6)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    b = torch.randn(V, generator=g, dtype=torch.float64)
    y = torch.randint(0, V, (N,), generator=g)
    y[list(ignored)] = IGNORE
    cw = torch.rand(V, generator=g, dtype=torch.float64) + 0.3
    return x, w, b, y, cw


def leaves(*tensors):
    return [t.clone().requires_grad_(True) for t in tensors]


def oracle_step(x, w, b, y, **options):
    """The reference's loss and grad_x, grad_w, grad_bias for `options`."""
    r = flce.loss_and_grad(x.numpy(), w.numpy(), y.numpy(), bias=b.numpy(),
                           backend="reference", out_dtype="float64", **options)
    return r


def expect_same_step(r, loss, grads):
    norm_close("loss", r.loss, loss.detach().numpy(), RTOL)
    for name, g in zip(("grad_x", "grad_w", "grad_bias"), grads):
        norm_close(name, getattr(r, name), g.numpy(), RTOL)


def softcapped(u, k):
    return k * torch.tanh(u / k) if k > 0 else u


@pytest.mark.parametrize("softcap", [0.0, 3.0])
def test_liger_z_loss_mean_with_class_weights(softcap):
    """Liger's fused linear cross-entropy with `ce_weight`, `label_smoothing`
    and `lse_square_scale` l, reduction mean: the cross-entropy divided by
    the labels' class-weight sum D, the z-loss l lse^2 by the count n of
    non-ignored rows. flce divides both by D, so `z_loss = l D / n`."""
    x, w, b, y, cw = head()
    l, e = 0.01, 0.1
    kept = y != IGNORE
    xt, wt, bt = leaves(x, w, b)
    s = softcapped(F.linear(xt, wt, bt), softcap)
    lse = torch.logsumexp(s, dim=1)
    liger = (F.cross_entropy(s, y, weight=cw, label_smoothing=e, ignore_index=IGNORE)
             + l * (lse[kept] ** 2).sum() / kept.sum())
    grads = torch.autograd.grad(liger, [xt, wt, bt])
    D, n = cw[y[kept]].sum().item(), kept.sum().item()
    options = dict(class_weights=cw.numpy(), label_smoothing=e, softcap=softcap)
    expect_same_step(oracle_step(x, w, b, y, z_loss=l * D / n, **options), liger, grads)
    # The same l gives another loss (the README says they differ by n / D).
    same_l = float(oracle_step(x, w, b, y, z_loss=l, **options).loss)
    assert abs(same_l - float(liger)) > 1e-6, (same_l, float(liger))


def test_megatron_label_smoothing():
    """Megatron-LM's and NeMo's smoothing puts 1 - eps on the label and
    eps / (V - 1) on every other class (mean over non-ignored rows); PyTorch's
    and flce's put eps / V on every class, label included, so the same target
    is flce's `label_smoothing = eps V / (V - 1)`."""
    x, w, b, y, _ = head(seed=1)
    eps = 0.1
    kept = y != IGNORE
    xt, wt, bt = leaves(x, w, b)
    logp = torch.log_softmax(F.linear(xt, wt, bt), dim=1)
    q = torch.full((N, V), eps / (V - 1), dtype=torch.float64)
    q[torch.arange(N), y.clamp(min=0)] = 1 - eps
    megatron = (-(q * logp).sum(dim=1))[kept].mean()
    grads = torch.autograd.grad(megatron, [xt, wt, bt])
    expect_same_step(oracle_step(x, w, b, y, label_smoothing=eps * V / (V - 1)), megatron, grads)
    plain = float(oracle_step(x, w, b, y, label_smoothing=eps).loss)
    assert abs(plain - float(megatron)) > 1e-6, (plain, float(megatron))


def test_per_token_scaling_divided_by_the_row_count():
    """Per-token loss scaling that keeps the plain mean's divisor (Liger's
    `use_token_scaling`, TRL's DFT loss: each row's loss times its detached
    p_y, divided by the count n of non-ignored rows). flce's token weights
    also enter the mean's denominator D = sum t_i, so the recipe is token
    weights with reduction sum, divided by n outside."""
    x, w, b, y, _ = head(seed=2)
    kept = y != IGNORE
    xt, wt, bt = leaves(x, w, b)
    rows = F.cross_entropy(F.linear(xt, wt, bt), y, reduction="none", ignore_index=IGNORE)
    p_y = torch.exp(-rows).detach()
    scaled = (p_y * rows)[kept].sum() / kept.sum()
    grads = torch.autograd.grad(scaled, [xt, wt, bt])
    n = kept.sum().item()
    r = oracle_step(x, w, b, y, token_weights=p_y.numpy(), reduction="sum",
                    grad_loss=np.array(1.0 / n))
    expect_same_step(r, scaled * n, grads)  # r.loss is the sum; its gradients carry 1/n
    weighted_mean = float(oracle_step(x, w, b, y, token_weights=p_y.numpy()).loss)
    assert abs(weighted_mean - float(scaled)) > 1e-6, (weighted_mean, float(scaled))


def test_gemma2_softcap_after_the_bias():
    """Gemma-2's final logit softcapping, as Liger and Cut Cross-Entropy
    apply it: k tanh(logits / k) on the logits with their bias, then the
    cross-entropy. flce's `softcap = k` with `logit_scale = 1`."""
    x, w, b, y, _ = head(seed=5)
    k = 2.5
    xt, wt, bt = leaves(x, w, b)
    loss = F.cross_entropy(k * torch.tanh(F.linear(xt, wt, bt) / k), y, ignore_index=IGNORE)
    grads = torch.autograd.grad(loss, [xt, wt, bt])
    expect_same_step(oracle_step(x, w, b, y, softcap=k), loss, grads)


def test_a_bias_added_after_the_logit_scale():
    """flce scales the bias with the logits, z = a (x . W + b); a head that
    adds its bias after the scale, a (x . W) + b, is flce's bias b / a."""
    x, w, b, y, _ = head(seed=3)
    a = 0.25
    xt, wt, bt = leaves(x, w, b)
    loss = F.cross_entropy(a * F.linear(xt, wt) + bt, y, ignore_index=IGNORE)
    gx, gw, gb = torch.autograd.grad(loss, [xt, wt, bt])
    r = flce.loss_and_grad(x.numpy(), w.numpy(), y.numpy(), bias=(b / a).numpy(),
                           logit_scale=a, backend="reference", out_dtype="float64")
    # flce's grad_bias is d loss / d (b / a): the chain rule's factor a is the
    # only difference from the bias the head adds.
    expect_same_step(r, loss, (gx, gw, gb * a))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_torch_ignore_index_inside_the_vocabulary(reduction):
    """PyTorch with an ignore_index that is a class (4 of 11): its weight
    still counts in the smoothing term's sum over classes, and rows labelled
    4 drop out of the loss and of the mean's denominator."""
    x, w, b, y, cw = head(seed=4, ignored=())
    y[[0, 3, 7]] = 4
    cw[2] = 0.0  # a zero class weight beside it
    xt, wt, bt = leaves(x, w, b)
    loss = F.cross_entropy(F.linear(xt, wt, bt), y, weight=cw, label_smoothing=0.3,
                           ignore_index=4, reduction=reduction)
    grads = torch.autograd.grad(loss.sum(), [xt, wt, bt])
    r = oracle_step(x, w, b, y, class_weights=cw.numpy(), label_smoothing=0.3,
                    ignore_index=4, reduction=reduction)
    expect_same_step(r, loss, grads)
