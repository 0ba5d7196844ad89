"""flce.torch: fused linear cross-entropy as a PyTorch loss.

    loss_fn = flce.torch.LinearCrossEntropyLoss(label_smoothing=0.1)
    loss = loss_fn(hidden, model.lm_head.weight, targets)   # no [N, V] logits
    loss.backward()

A drop-in for F.cross_entropy(F.linear(x, W, b), y, weight=..., ignore_index=
..., reduction=..., label_smoothing=...), plus flce's z-loss, softcap, logit
scale and token weights. x is [..., H] and y [...] (flattened to rows);
reduction='none' returns y's shape. Forward saves only the lse (and the
inputs); backward recomputes the logits tile by tile through flce.backward.
In training (grad mode on, a mean or sum, the loss alone returned) forward
instead runs flce.loss_and_grad and backward hands over its gradients
(grads_in_forward=True, the default; linear_cross_entropy says more).

Dtypes: float32, bfloat16 and float16 parameters of one dtype run on
flce's cpu backend, or its cuda backend when they are CUDA tensors (float32
accumulation), and get gradients in their own dtype; the loss, lse and
entropy are float32 (more precise than a bf16 loss; cast if you need to).
For bf16/f16 training on the GPU pass grad_logits_dtype='storage': dlogits
rounded to the storage dtype, as eager PyTorch's bf16 step rounds them, feed
tensor-core GEMMs (the default f32 dlogits keep plain f32 GEMMs, several
times slower).
float64 runs on the `reference` backend, which the library picks by itself
because the cpu backend declines float64 storage; that is what
torch.autograd.gradcheck exercises. x, W and bias of different dtypes run
there too (the cpu and cuda backends store them in one dtype), with float32
gradients rounded once to each parameter's dtype. Under torch.autocast, x, W
and bias are first cast to autocast's dtype, as F.linear's are (float64
excepted): float32 weights and bfloat16 hidden states then run the bf16
path, and the weights' gradients come back in float32. Differences from PyTorch:
a mean over rows that are all ignored is 0 (PyTorch: NaN); no double
backward (create_graph=True raises); token and class weights get no
gradient (weights that require one raise). Works with PyTorch 1.13.
"""

import math
import numbers
import os
import warnings

import torch
from torch.autograd.function import once_differentiable

import flce

__all__ = ["LinearCrossEntropyLoss", "linear_cross_entropy", "LinearCrossEntropyFunction"]


class _Config:
    """The non-tensor arguments of one call (options and how to run).
    grads_in_forward: the loss alone is differentiated, by a scalar (mean or
    sum), with grad mode on: forward may compute the gradients as well."""

    __slots__ = ("options", "run", "want_entropy", "grads_in_forward")

    def __init__(self, options, run, want_entropy, grads_in_forward):
        self.options, self.run, self.want_entropy = options, run, want_entropy
        self.grads_in_forward = grads_in_forward


def _wanted_grads(ctx, x, w, bias):
    """The names of x, w and bias whose gradients autograd will ask for."""
    return [name for name, t, need in zip(("x", "w", "bias"), (x, w, bias),
                                          ctx.needs_input_grad[:3]) if need and t is not None]


def _grad_dtype(x, w, bias):
    """Gradients in the parameters' dtype where they share x's; else in
    float32 (float64 if one is), rounded once to each one's own after."""
    present = [p for p in (x, w, bias) if p is not None]
    if all(p.dtype == x.dtype for p in present):
        return "input"
    return "float64" if any(p.dtype == torch.float64 for p in present) else "float32"


def _in_param_dtypes(r, wanted, x, w, bias):
    out = []
    for name, param in (("x", x), ("w", w), ("bias", bias)):
        g = getattr(r, "grad_" + name) if name in wanted else None
        if g is not None and g.dtype != param.dtype:
            g = g.to(param.dtype)  # e.g. x in bfloat16, W in float32
        out.append(g)
    return out


def _is_batched(t):
    """Whether t is a vmap batch of cotangents (torch's BatchedTensor, legacy
    or functorch's), whose storage flce cannot read."""
    if t is None:
        return False
    try:
        return "Batched" in str(torch._C._dispatch_keys(t))
    except AttributeError:  # a torch without the call: let flce's own error speak
        return False


def _power_of_two(value):
    """Whether value is +-2^k: scaling by it is exact (where nothing over- or
    underflows), so g * value has the bits flce gives for that grad_loss."""
    return math.isfinite(value) and value != 0 and abs(math.frexp(value)[0]) == 0.5


def _takes_grads_in_forward(config, wanted, x, w, bias):
    """Whether forward computes the gradients: asked for, and no float16
    among x, W and bias, whose gradients of grad_loss = 1 can under- or
    overflow where a loss scaler's grad_loss brings them into range."""
    return config.grads_in_forward and bool(wanted) and \
        all(t.dtype != torch.float16 for t in (x, w, bias) if t is not None)


def _warn_if_mixed_storage(x, W, bias, backend):
    """x, W and bias of two 16/32-bit dtypes on the CPU: the cpu backend
    declines them and, with no backend named (argument or FLCE_BACKEND),
    the float64 reference (plain loops, orders of magnitude slower) runs
    the call. Say so, at the caller's line, in the words of torch's dtypes;
    returns whether it did (the calls then name the reference, so flce's
    own note on the fallback is not given as well)."""
    dtypes = {t.dtype for t in (x, W, bias) if t is not None}
    if backend is None and not os.environ.get("FLCE_BACKEND") and x.device.type == "cpu" and \
            x.shape[0] > 0 and len(dtypes) > 1 and torch.float64 not in dtypes:
        names = ", ".join(f"{n} {t.dtype}" for n, t in (("x", x), ("W", W), ("bias", bias))
                          if t is not None)
        warnings.warn(f"flce.torch: {names}: the cpu backend takes one storage dtype, so the "
                      f"float64 reference backend (much slower) computes this; convert them to "
                      f"one dtype (or run under torch.autocast)", stacklevel=flce._user_stacklevel())
        return True
    return False


def _any_float64(*tensors):
    """Whether the loss and lse are float64: when any of x, W and bias is
    (a float32 lse would round what a recomputed float64 backward reads)."""
    return any(t is not None and t.dtype == torch.float64 for t in tensors)


class LinearCrossEntropyFunction(torch.autograd.Function):
    """apply(x [N,H], w, bias or None, labels [N], token_weights or None,
    class_weights or None, config) -> (loss, lse[, entropy]). Use
    linear_cross_entropy() rather than this directly."""

    @staticmethod
    def forward(ctx, x, w, bias, labels, token_weights, class_weights, config):
        ctx.set_materialize_grads(False)  # unused outputs: None, not zeros
        outputs = ("loss", "lse", "entropy") if config.want_entropy else ("loss", "lse")
        out_dtype = "float64" if _any_float64(x, w, bias) else "float32"
        args = dict(bias=bias, token_weights=token_weights, class_weights=class_weights,
                    outputs=outputs, out_dtype=out_dtype, **config.options, **config.run)
        wanted = _wanted_grads(ctx, x, w, bias)
        ctx.unit_grads = None
        if _takes_grads_in_forward(config, wanted, x, w, bias):
            # One training step (where the backend stashes scores, one logits
            # GEMM fewer than forward + backward); backward scales the
            # gradients of grad_loss = 1 by the grad_loss it gets.
            r = flce.loss_and_grad(x, w, labels, grads=wanted, grad_dtype=_grad_dtype(x, w, bias),
                                   **args)
            ctx.unit_grads = _in_param_dtypes(r, wanted, x, w, bias)
        else:
            r = flce.forward(x, w, labels, **args)
        ctx.save_for_backward(x, w, bias, labels, token_weights, class_weights, r.lse)
        ctx.config = config
        # Where the reference ran this with no backend named (the cpu backend
        # declined it, and flce warned), backward names it: the same backend,
        # and the note on the fallback once, not again at loss.backward().
        ctx.run = config.run
        if r.backend == "reference" and config.run["backend"] is None and config.run["gemm"] is None:
            ctx.run = dict(config.run, backend="reference")
        ctx.loss_shape = tuple(r.loss.shape)
        return (r.loss, r.lse, r.entropy) if config.want_entropy else (r.loss, r.lse)

    @staticmethod
    def backward(ctx, grad_loss, grad_lse, grad_entropy=None):
        # Autograd runs a backward with grad mode on only for create_graph=True,
        # whose second derivatives flce does not compute: fail rather than give
        # gradients that silently lack flce's terms.
        if torch.is_grad_enabled():
            raise RuntimeError("flce.torch: no double backward (create_graph=True): flce's "
                               "gradients are not differentiable")
        if any(_is_batched(g) for g in (grad_loss, grad_lse, grad_entropy)):
            raise RuntimeError("flce.torch: no batched backward (is_grads_batched=True, vmap, "
                               "jacobian(vectorize=True)): flce takes one cotangent per call; "
                               "loop over them (vectorize=False)")
        return LinearCrossEntropyFunction._gradients(ctx, grad_loss, grad_lse, grad_entropy)

    @staticmethod
    @once_differentiable
    def _gradients(ctx, grad_loss, grad_lse, grad_entropy):
        x, w, bias, labels, token_weights, class_weights, lse = ctx.saved_tensors
        wanted = _wanted_grads(ctx, x, w, bias)
        nothing = (None,) * 7
        if not wanted or (grad_loss is None and grad_lse is None and grad_entropy is None):
            return nothing
        # The forward's gradients, handed over (not kept: autograd can then
        # take them as .grad without a copy); a second backward recomputes.
        unit, ctx.unit_grads = ctx.unit_grads, None
        if unit is not None and grad_lse is None and grad_entropy is None:
            scale = float(grad_loss)  # 0-d: mean or sum
            # A power of two scales exactly; float32 and float64 gradients
            # take any other finite scale at one more rounding of their own.
            # 0, inf and NaN recompute: times a unit gradient of inf (or 0)
            # they give NaN where flce's gradient for that grad_loss, as
            # PyTorch's, is 0 (an ignored row's).
            wide = all(g is None or g.dtype in (torch.float32, torch.float64) for g in unit)
            if scale != 0 and math.isfinite(scale):
                if _power_of_two(scale) or wide:
                    grads = [g if g is None or scale == 1.0 else g.mul_(scale) for g in unit]
                    return tuple(grads) + (None,) * 4
                warnings.warn(f"flce.torch: the loss was differentiated by {scale:g}, not a "
                              "power of two, so the 16-bit gradients computed in forward would "
                              "be rounded twice and backward computes them again; scale the "
                              "loss by a power of two, or pass grads_in_forward=False",
                              stacklevel=1)  # no user frame runs a backward
        if grad_loss is None:  # flce reads an absent grad_loss as ones
            grad_loss = torch.zeros(ctx.loss_shape, dtype=lse.dtype, device=lse.device)
        r = flce.backward(x, w, labels, lse, bias=bias, token_weights=token_weights,
                          class_weights=class_weights, grad_loss=grad_loss, grad_lse=grad_lse,
                          grad_entropy=grad_entropy, grads=wanted,
                          grad_dtype=_grad_dtype(x, w, bias), **ctx.config.options, **ctx.run)
        return tuple(_in_param_dtypes(r, wanted, x, w, bias)) + (None,) * 4


class _NoRows(torch.autograd.Function):
    """A batch of no rows, which the library (every size >= 1) does not
    take: flce's semantics with D = 0, i.e. a loss of 0 (an empty one with
    reduction='none'), empty per-row outputs and zero gradients."""

    @staticmethod
    def forward(ctx, x, w, bias, loss_shape, rows):
        ctx.save_for_backward(x, w, bias)
        dtype = torch.float64 if _any_float64(x, w, bias) else torch.float32
        zeros = [torch.zeros(shape, dtype=dtype, device=x.device)
                 for shape in (loss_shape, rows, rows)]
        return tuple(zeros)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        return tuple(None if t is None else torch.zeros_like(t) for t in ctx.saved_tensors) + \
            (None, None)


def _tensor(name, value):
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    return value


def _number(name, value, kind):
    """value (a number, or a 0-d tensor) as kind (int or float); a TypeError
    naming it otherwise (bools included: True is not a softcap)."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype != torch.bool:
        value = value.item()
    integral = isinstance(value, numbers.Integral)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or (kind is int and
                                                                          not integral):
        raise TypeError(f"{name}: expected {'an int' if kind is int else 'a number'}, got "
                        f"{type(value).__name__}")
    return kind(value)


def _autocast_dtype(device_type):
    """The dtype torch.autocast runs F.linear in on `device_type`, or None
    where autocast is off there."""
    try:
        if not torch.is_autocast_enabled(device_type):  # torch >= 2.4
            return None
        return torch.get_autocast_dtype(device_type)
    except (TypeError, AttributeError, RuntimeError):
        # Older torch (one call per device type), or a device type autocast
        # does not know (meta): read as off below.
        if device_type == "cuda" and torch.is_autocast_enabled():
            return torch.get_autocast_gpu_dtype()
        if device_type == "cpu" and torch.is_autocast_cpu_enabled():
            return torch.get_autocast_cpu_dtype()
        return None


def _as_autocast_would(x, W, bias):
    """x, W and bias as F.linear sees them under torch.autocast: in its dtype
    (float64 left alone, as autocast leaves it). The casts are autograd's
    own, so float32 parameters get float32 gradients."""
    dtype = _autocast_dtype(x.device.type)
    if dtype is None:
        return x, W, bias
    cast = [t if t is None or not t.is_floating_point() or t.dtype == torch.float64
            else t.to(dtype) for t in (x, W, bias)]
    return tuple(cast)


def linear_cross_entropy(x, W, y, bias=None, *, class_weights=None, token_weights=None,
                         ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=0.0,
                         logit_scale=1.0, reduction="mean", w_layout="vh",
                         grad_logits_dtype="f32", filter_eps=0.0, backend=None, gemm=None,
                         threads=0, return_lse=False, return_entropy=False,
                         grads_in_forward=True):
    """The loss of F.cross_entropy(F.linear(x, W, bias), y, ...) without the
    logits. x [..., H]; W [V, H] (w_layout='vh', nn.Linear's weight) or
    [H, V] ('hv'); y [...] int64/int32; class_weights [V] (F.cross_entropy's
    `weight`); token_weights [...] like y (or flattened). Returns the loss, or a tuple
    (loss, lse[, entropy]) / (loss, entropy) with return_lse/return_entropy:
    per-row lse and entropy shaped like y, differentiable (their gradients
    flow into flce's grad_lse and grad_entropy). grads_in_forward: with grad
    mode on, a mean or sum and neither lse nor entropy returned, compute the
    gradients in this call (one flce.loss_and_grad, which saves the backward
    a logits GEMM where the backend stashes scores; not with float16 x, W
    or bias) and hand them to backward, scaled by its grad_loss: exactly by
    a power of two, as loss scalers use; float32 gradients by any other at
    one more rounding; 16-bit ones are then recomputed, with a warning, and
    forward's work is wasted. They are loss_and_grad's bits, which may
    differ in the last place from a separate backward's. They take the
    gradients' memory from this call on (outside saved-tensor hooks such as
    save_on_cpu), and are wasted if no backward runs: pass False (or run
    under torch.no_grad()) for a loss only looked at."""
    x, W, y = _tensor("x", x), _tensor("W", W), _tensor("y", y)
    if bias is not None:
        bias = _tensor("bias", bias)
    x, W, bias = _as_autocast_would(x, W, bias)
    if x.dim() < 1:
        raise ValueError(f"x: expected [..., H], got a {x.dim()}-D tensor")
    rows = tuple(x.shape[:-1])
    if tuple(y.shape) != rows:
        raise ValueError(f"y: shape {tuple(y.shape)} does not match x's leading dimensions "
                         f"{rows} (x is {tuple(x.shape)})")
    x2 = x.reshape(math.prod(rows), x.shape[-1]).contiguous()
    y1 = y.reshape(-1).contiguous()
    tw = None if token_weights is None else _tensor("token_weights", token_weights)
    if tw is not None and tuple(tw.shape) != rows and tuple(tw.shape) != (math.prod(rows),):
        raise ValueError(f"token_weights: shape {tuple(tw.shape)} is neither y's {rows} nor "
                         f"y's flattened ({math.prod(rows)},)")
    tw = None if tw is None else tw.reshape(-1)
    cw = None if class_weights is None else _tensor("class_weights", class_weights)
    weights = {"token_weights": tw, "class_weights": cw}
    for name, t in weights.items():
        if t is None:
            continue
        if t.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{name}: requires grad, but flce computes no gradient for "
                             f"weights (pass {name}.detach())")
        # Detached under no_grad (an evaluation loop over a learned weight);
        # 16-bit ones made float32 (a bf16 model's mask, a module buffer that
        # .bfloat16() converted): flce takes weights in float32 or float64,
        # and names any other dtype.
        t = t.detach()
        weights[name] = t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
    tw, cw = weights["token_weights"], weights["class_weights"]
    if w_layout == "hv" and W.dim() == 2 and W.t().is_contiguous():
        # W given as [H, V] over a row-major [V, H] (lm_head.weight.t()): that
        # [V, H] itself, without a copy (and on an H100 the fused kernels, which
        # take W as [V, H]); autograd carries its gradient back through .t().
        W, w_layout = W.t(), "vh"
    if not (isinstance(filter_eps, str) and filter_eps == "auto"):
        if isinstance(filter_eps, str):
            raise ValueError(f"filter_eps: {filter_eps!r} is not a number or 'auto'")
        filter_eps = _number("filter_eps", filter_eps, float)
    options = dict(ignore_index=_number("ignore_index", ignore_index, int),
                   label_smoothing=_number("label_smoothing", label_smoothing, float),
                   z_loss=_number("z_loss", z_loss, float), softcap=_number("softcap", softcap, float),
                   logit_scale=_number("logit_scale", logit_scale, float), reduction=reduction,
                   w_layout=w_layout, grad_logits_dtype=grad_logits_dtype, filter_eps=filter_eps)
    run = dict(backend=backend, gemm=gemm, threads=threads)
    if _warn_if_mixed_storage(x2, W, bias, backend) and gemm is None:
        run["backend"] = "reference"  # (with a gemm, let every backend's reason show)
    eager = bool(grads_in_forward) and torch.is_grad_enabled() and reduction != "none" and \
        not return_lse and not return_entropy
    config = _Config(options, run, bool(return_entropy), eager)
    if x2.shape[0] == 0:
        # Shapes, dtypes and options checked as the library would for one
        # (ignored) row, then flce's semantics for no rows.
        one = dict(token_weights=None if tw is None else tw.new_ones(1), class_weights=cw)
        ignore = options["ignore_index"]
        fits = y1.dtype.is_floating_point or y1.dtype == torch.bool or \
            (torch.iinfo(y1.dtype).min <= ignore <= torch.iinfo(y1.dtype).max)
        try:
            flce.workspace_size("forward", x2.new_zeros(1, x2.shape[1]), W,
                                y1.new_full((1,), ignore if fits else 0), bias=bias, **one,
                                **options, **run)
        except ValueError as e:  # name x's own shape, not the one-row stand-in's
            stand_in = f"x [1, {x2.shape[1]}]"
            raise ValueError(str(e).replace(stand_in, f"x [0, {x2.shape[1]}]")) from None
        out = _NoRows.apply(x2, W, bias, rows if reduction == "none" else (), rows)
    else:
        out = LinearCrossEntropyFunction.apply(
            x2, W.contiguous(), None if bias is None else bias.contiguous(), y1,
            None if tw is None else tw.contiguous(),
            None if cw is None else cw.contiguous(), config)
    loss, lse = out[0], out[1]
    if reduction == "none":
        loss = loss.reshape(rows)
    extras = ([lse.reshape(rows)] if return_lse else []) + \
        ([out[2].reshape(rows)] if return_entropy else [])
    return (loss, *extras) if extras else loss


class LinearCrossEntropyLoss(torch.nn.Module):
    """nn.Module form of linear_cross_entropy: loss_fn(x, W, y, bias=None,
    token_weights=None). `class_weights` is F.cross_entropy's `weight`
    (kept as a buffer); the rest are linear_cross_entropy's options."""

    def __init__(self, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=0.0,
                 logit_scale=1.0, reduction="mean", w_layout="vh", backend=None,
                 class_weights=None, gemm=None, threads=0, grad_logits_dtype="f32",
                 filter_eps=0.0, return_lse=False, return_entropy=False,
                 grads_in_forward=True):
        super().__init__()
        self.ignore_index, self.label_smoothing, self.z_loss = ignore_index, label_smoothing, z_loss
        self.softcap, self.logit_scale, self.reduction = softcap, logit_scale, reduction
        self.w_layout, self.backend, self.gemm, self.threads = w_layout, backend, gemm, threads
        self.grad_logits_dtype, self.filter_eps = grad_logits_dtype, filter_eps
        self.return_lse, self.return_entropy = return_lse, return_entropy
        self.grads_in_forward = grads_in_forward
        self.register_buffer("class_weights", class_weights)

    def forward(self, x, W, y, bias=None, token_weights=None):
        return linear_cross_entropy(
            x, W, y, bias, class_weights=self.class_weights, token_weights=token_weights,
            ignore_index=self.ignore_index, label_smoothing=self.label_smoothing,
            z_loss=self.z_loss, softcap=self.softcap, logit_scale=self.logit_scale,
            reduction=self.reduction, w_layout=self.w_layout,
            grad_logits_dtype=self.grad_logits_dtype, filter_eps=self.filter_eps,
            backend=self.backend, gemm=self.gemm,
            threads=self.threads, return_lse=self.return_lse,
            return_entropy=self.return_entropy, grads_in_forward=self.grads_in_forward)

    def extra_repr(self):
        shown = (f"ignore_index={self.ignore_index}, label_smoothing={self.label_smoothing}, "
                 f"z_loss={self.z_loss}, softcap={self.softcap}, logit_scale={self.logit_scale}, "
                 f"reduction={self.reduction!r}, w_layout={self.w_layout!r}, "
                 f"backend={self.backend!r}")
        # The rest where they differ from their defaults.
        defaults = dict(gemm=None, threads=0, grad_logits_dtype="f32", filter_eps=0.0,
                        return_lse=False, return_entropy=False, grads_in_forward=True)
        for name, default in defaults.items():
            value = getattr(self, name)
            if value != default:
                shown += f", {name}={value!r}"
        return shown
