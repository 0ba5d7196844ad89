"""flce: fused linear cross-entropy from Python.

    import flce
    r = flce.forward(x, W, y, outputs=("loss", "lse", "entropy"))
    g = flce.backward(x, W, y, r.lse)                  # r.grad_x, r.grad_w
    r = flce.loss_and_grad(x, W, y, label_smoothing=0.1)
    r = flce.loss_and_grad(logits=z, labels=y, inplace=True)   # grad into z

Arrays are numpy arrays or torch tensors; outputs are of the same kind as
the inputs (x, or logits) and on the same device. Nothing is copied when flce
can read an array as it is (any element strides >= 1). numpy has no
bfloat16, so numpy.uint16 arrays are read as bfloat16 bit patterns
(flce.float32_to_bf16_bits / flce.bf16_bits_to_float32 convert); numpy
float16 is IEEE half. The semantics of every number are the README's.

Errors: ValueError for bad values, shapes, options and dtypes an argument
does not take (the C++ library's message, verbatim; for float labels this
layer's, which names the narrower integers it also takes), TypeError for
arguments that are not arrays, or of a dtype flce has none of (bool,
complex). A call the float64 reference ran because the cpu backend
declined it (no float64 input, no backend named) warns, with the reason.
The GIL is released while flce computes.
"""

import inspect
import numbers
import sys
import warnings

import numpy as np

from . import _arrays
from ._arrays import bf16_bits_to_float32, float32_to_bf16_bits
from ._flce import backends as _backends
from ._flce import run as _run
from ._flce import version as _version
from ._flce import workspace_size as _workspace_size

__all__ = [
    "forward", "backward", "loss_and_grad", "workspace_size", "backends", "version",
    "Result", "FORWARD_OUTPUTS", "GRADIENTS", "bf16_bits_to_float32", "float32_to_bf16_bits",
]

FORWARD_OUTPUTS = ("loss", "lse", "logprob", "argmax", "entropy", "zloss")
GRADIENTS = ("grad_x", "grad_w", "grad_bias", "grad_logits")


class Result:
    """What a call wrote: each output (None where not computed), `backend`,
    the name of the backend that ran, and `stats`, what it reports of its
    work ({'grad_blocks', 'grad_blocks_skipped'}: gradient filtering's block
    counts, 0 where it did not filter). `r["lse"]` works as well as `r.lse`."""

    __slots__ = FORWARD_OUTPUTS + GRADIENTS + ("backend", "stats")

    def __init__(self, backend, arrays, stats=(0, 0)):
        self.backend = backend
        self.stats = {"grad_blocks": int(stats[0]), "grad_blocks_skipped": int(stats[1])}
        for name in FORWARD_OUTPUTS + GRADIENTS:
            setattr(self, name, arrays.get(name))

    def __getitem__(self, name):
        if name not in FORWARD_OUTPUTS + GRADIENTS:
            raise KeyError(name)
        return getattr(self, name)

    def as_dict(self):
        """The computed outputs by name (absent ones left out)."""
        return {n: getattr(self, n) for n in FORWARD_OUTPUTS + GRADIENTS
                if getattr(self, n) is not None}

    def __repr__(self):
        names = ", ".join(self.as_dict())
        return f"flce.Result(backend={self.backend!r}, outputs=[{names}])"


def backends():
    """[(name, description)] in the order flce tries them."""
    return list(_backends())


def version():
    return _version()


_FLOAT_NAMES = {"float32": "f32", "f32": "f32", "float64": "f64", "f64": "f64"}


def _dtype_name(spec):
    """The name of a dtype given as a name ('float32', 'f4'), a numpy dtype
    or type, or a torch dtype; None for anything else (None included)."""
    if spec is None:
        return None
    if str(spec).startswith("torch."):
        return str(spec)[len("torch."):]
    try:
        return _arrays.np.dtype(spec).name
    except (TypeError, ValueError):
        return spec if isinstance(spec, str) else None


def _float_dtype(spec, what, input_dtype=None):
    """'float32'/'float64' (or numpy/torch float32/float64, or 'input')."""
    if spec == "input" and input_dtype is not None:
        return input_dtype
    key = spec if isinstance(spec, str) and spec in _FLOAT_NAMES else _dtype_name(spec)
    if key in _FLOAT_NAMES:
        return _FLOAT_NAMES[key]
    allowed = "'float32' or 'float64'" + (" or 'input'" if input_dtype else "")
    raise ValueError(f"{what}: {spec!r} is not {allowed}")


def _dims(tensors, w_layout):
    """(N, H, V) from the inputs, or None when they are missing or malformed
    (the library then reports what is wrong with them)."""
    try:
        if tensors.get("logits") is not None:
            n, v = tensors["logits"][2]
            return n, 0, v
        n, h = tensors["x"][2]
        w = tensors["w"][2]
        return n, h, (w[0] if w_layout != "hv" else w[1])
    except (KeyError, TypeError, ValueError):
        return None


def _names(value, what):
    """A name or a sequence of names, as a tuple; anything else a TypeError
    that names the argument."""
    if isinstance(value, str):
        return (value,)
    try:
        return tuple(value)
    except TypeError:
        raise TypeError(f"{what}: expected a name or a sequence of names, got "
                        f"{type(value).__name__}") from None


def _gradient_names(grads, logits_entry, has_bias):
    if grads is None:
        if logits_entry:
            return ["grad_logits"]
        return ["grad_x", "grad_w"] + (["grad_bias"] if has_bias else [])
    grads = _names(grads, "grads")
    out = []
    for g in grads:
        name = g if str(g).startswith("grad_") else f"grad_{g}"
        if name not in GRADIENTS:
            raise ValueError(f"grads: {g!r} is not one of x, w, bias, logits")
        if logits_entry != (name == "grad_logits"):
            raise ValueError(f"grads: {g!r}: the " + ("logits-level entry (logits=...) writes "
                             "grad_logits only" if logits_entry else "head entry (x, w) has no "
                             "grad_logits; ask for x, w or bias"))
        out.append(name)
    return out


_OPTION_NAMES = ("logit_scale", "softcap", "ignore_index", "label_smoothing", "z_loss",
                 "reduction", "w_layout", "grad_logits_dtype", "filter_eps")
_INPUT_NAMES = ("x", "w", "bias", "logits", "labels", "token_weights", "class_weights",
                "grad_loss", "grad_lse", "grad_entropy", "lse")


_LABEL_DTYPES = "labels are integers (int64, int32, or a narrower integer type, copied to int64)"


def _as_class_indices(labels):
    """Labels of an integer dtype other than int32 and int64 (numpy's uint16
    would otherwise read as bfloat16 bits; int8, uint8, ...) as an int64
    copy; bool and floating-point labels refused here (those of a dtype
    flce has: longdouble gets the TypeError of any such input), naming the
    integer dtypes this layer takes (the library's message named int64 and
    int32 only, or listed the float dtypes for bool); other labels as they
    are, for the library to judge."""
    if (isinstance(labels, np.ndarray) and labels.dtype == np.bool_) or \
            (_arrays.is_torch(labels) and labels.dtype == _arrays.torch_bool()):
        raise TypeError(f"labels: dtype bool is not a class index; {_LABEL_DTYPES}")
    if (isinstance(labels, np.ndarray) and labels.dtype.kind == "f" and
            labels.dtype.itemsize <= 8) or \
            (_arrays.is_torch(labels) and labels.is_floating_point()):
        name = labels.dtype.name if isinstance(labels, np.ndarray) else str(labels.dtype)
        raise ValueError(f"labels: dtype {name} is not accepted; {_LABEL_DTYPES}")
    if isinstance(labels, np.ndarray) and labels.dtype.kind in "iu" and \
            labels.dtype.newbyteorder("=") not in (np.dtype(np.int32), np.dtype(np.int64)):
        if labels.size and labels.dtype.kind == "u" and labels.max() > np.iinfo(np.int64).max:
            raise ValueError(f"labels: {labels.max()} does not fit in int64")
        return labels.astype(np.int64)
    if _arrays.is_torch(labels) and labels.dtype in _arrays.torch_narrow_ints():
        return labels.long()
    return labels


def _plain(value):
    """numpy/Python numbers as Python int/float (the binding takes those only;
    anything else goes through and gets its TypeError there)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return value


def _user_stacklevel():
    """warnings.warn's stacklevel, for the function that calls it with this,
    that names the first frame outside flce and torch (whose autograd and
    nn.Module.__call__ stand between flce.torch and its user)."""
    def ours(frame):
        name = frame.f_globals.get("__name__", "")
        return name == "flce" or name.startswith(("flce.", "torch."))
    level, frame = 1, sys._getframe(1)
    while frame is not None and ours(frame):
        level, frame = level + 1, frame.f_back
    return level


def _call(pass_, args, measure=False):
    """One pass of the library on the arguments of the public call `args`
    (its locals()). measure=True asks for the workspace size instead."""
    options = {k: _plain(args[k]) for k in _OPTION_NAMES}
    logits, x, bias = args["logits"], args["x"], args["bias"]
    inputs = {k: args.get(k) for k in _INPUT_NAMES}
    if pass_ != "backward":
        inputs["lse"] = None  # an output there
    ref = logits if logits is not None else x
    grad_loss = inputs["grad_loss"]
    if isinstance(grad_loss, numbers.Real) and not isinstance(grad_loss, bool):
        try:
            value = float(grad_loss)
        except OverflowError:
            raise ValueError(f"grad_loss: {grad_loss} is beyond float64") from None
        inputs["grad_loss"] = _arrays.scalar_like_kind(ref, value)
    inputs["labels"] = _as_class_indices(inputs["labels"])

    keep = []  # owners (inputs, copies, outputs) alive until the call returns
    tensors = {}
    for name, obj in inputs.items():
        if obj is not None:
            tensors[name], owner = _arrays.describe(name, obj)
            keep.append(owner)

    dims = _dims(tensors, options["w_layout"])
    in_dtype = tensors["logits" if logits is not None else "x"][1] if ref is not None else None
    out_dtype = args.get("out_dtype")
    out_dt = _float_dtype("float32" if out_dtype is None else out_dtype, "out_dtype")
    grad_dtype = args.get("grad_dtype")
    grad_dt = out_dt if grad_dtype is None else _float_dtype(grad_dtype, "grad_dtype",
                                                             in_dtype or "f32")
    argmax_dtype = args.get("argmax_dtype")
    argmax_dtype = "int64" if argmax_dtype is None else _dtype_name(argmax_dtype) or argmax_dtype
    if argmax_dtype not in ("int64", "int32"):
        raise ValueError(f"argmax_dtype: {args.get('argmax_dtype')!r} is not 'int64' or 'int32'")

    wanted = []
    if pass_ != "backward":
        outputs = args["outputs"]
        outputs = FORWARD_OUTPUTS if outputs == "all" else _names(outputs, "outputs")
        for o in outputs:
            if o not in FORWARD_OUTPUTS:
                raise ValueError(f"outputs: {o!r} is not one of {', '.join(FORWARD_OUTPUTS)}")
        wanted += ["loss", "lse"] + [o for o in FORWARD_OUTPUTS[2:] if o in outputs]
    if pass_ != "forward":
        wanted += _gradient_names(args["grads"], logits is not None, bias is not None)

    out = args.get("out")
    if out is not None and not isinstance(out, dict):
        raise TypeError(f"out: expected a dict of output name -> array, got {type(out).__name__}")
    given = dict(out or {})
    for name in given:
        if name not in FORWARD_OUTPUTS + GRADIENTS:
            raise ValueError(f"out: {name!r} is not an output of flce")
        if pass_ == "backward" and name == "lse":  # read as the input, not written
            raise ValueError(f"out: {name!r} is an input of {pass_} (its {name} argument), "
                             f"not an output")
        _arrays.check_writable(f"out[{name!r}]", given[name])
    if args.get("inplace"):
        if logits is None:
            raise ValueError("inplace: only the logits-level entry (logits=...) has an "
                             "in-place gradient")
        if "grad_logits" in given:
            raise ValueError("inplace: writes grad_logits over the logits, so out['grad_logits'] "
                             "cannot be given too")
        _arrays.check_writable("logits (inplace=True)", logits)
        if grad_dtype is not None and grad_dt != in_dtype:
            raise ValueError(f"grad_dtype: {grad_dtype!r}, but inplace=True writes grad_logits "
                             f"over the logits, which are {in_dtype}")
        given["grad_logits"] = logits  # the same view: written over the input
        if "grad_logits" not in wanted:
            wanted.append("grad_logits")

    results = {}
    for name in wanted + [n for n in given if n not in wanted]:
        if name in given:
            owner = given[name]
        elif dims is None or ref is None:
            continue  # the inputs are wrong; the library says how
        else:
            n, h, v = dims
            shape, dtype = {
                "loss": ((n,) if options["reduction"] == "none" else (), out_dt),
                "lse": ((n,), out_dt), "logprob": ((n,), out_dt), "entropy": ((n,), out_dt),
                "zloss": ((n,), out_dt),
                "argmax": ((n,), "i64" if argmax_dtype == "int64" else "i32"),
                "grad_x": ((n, h), grad_dt),
                "grad_w": (tuple(tensors["w"][2]) if "w" in tensors else (v, h), grad_dt),
                "grad_bias": ((v,), grad_dt), "grad_logits": ((n, v), grad_dt),
            }[name]
            owner = _arrays.empty_like_kind(ref, shape, dtype)
        # Named as the caller gave it: out['lse'], or the logits for inplace=True.
        if name not in given:
            label = name
        elif args.get("inplace") and name == "grad_logits":
            label = "logits (inplace=True)"
        else:
            label = f"out[{name!r}]"
        tensors[name], owner = _arrays.describe(label, owner, output=True)
        keep.append(owner)
        results[name] = owner

    threads = args["threads"]
    if threads is not None and (isinstance(threads, bool) or
                                not isinstance(threads, numbers.Integral)):
        raise TypeError(f"threads: expected an int, got {type(threads).__name__}")
    for name in ("backend", "gemm"):
        if args[name] == "":
            raise ValueError(f"{name}: '' names none; None leaves the choice to the library")
    config = {"backend": args["backend"], "gemm": args["gemm"], "threads": int(threads or 0)}
    if measure:
        error, ran, nbytes = _workspace_size(pass_, tensors, options, config)
        if error:
            raise ValueError(error)
        return ran, nbytes
    if _arrays.is_cuda(ref):
        # CUDA tensors: run on torch's current stream, with scratch from
        # torch's allocator (so torch.cuda memory statistics count it).
        config["stream"] = _arrays.current_stream(ref)
        error, _, nbytes = _workspace_size(pass_, tensors, options, config)
        if not error and nbytes:
            scratch = _arrays.scratch_like(ref, nbytes)
            keep.append(scratch)
            config["workspace"] = (scratch.data_ptr(), nbytes)
    error, ran, stats, declined = _run(pass_, tensors, options, config)
    _arrays.mark_written(given.values())  # on failure too: they may be partly written
    del keep
    if error:
        raise ValueError(error)
    if ran == "reference" and declined and \
            not any(tensors[k][1] == "f64" for k in ("x", "w", "bias", "logits") if k in tensors):
        # The cpu backend declined a problem it was not asked to skip (x, W
        # and bias of different dtypes, a scale its f32 arithmetic cannot
        # hold): the float64 reference, many times slower, ran it. float64
        # inputs run there as documented, without a word.
        warnings.warn(f"flce: the float64 reference backend (much slower) ran this call: "
                      f"{declined}", stacklevel=_user_stacklevel())
    return Result(ran, results, stats)


def forward(x=None, w=None, labels=None, *, logits=None, bias=None, token_weights=None,
            class_weights=None, logit_scale=1.0, softcap=0.0, ignore_index=-100,
            label_smoothing=0.0, z_loss=0.0, reduction="mean", w_layout="vh",
            grad_logits_dtype="f32", filter_eps=0.0, outputs=("loss", "lse"),
            out_dtype="float32", argmax_dtype="int64", out=None, backend=None, gemm=None,
            threads=0):
    """The loss and per-row outputs. Give the head (x [N,H], w [V,H] or
    [H,V] with w_layout='hv', optional bias [V]) or logits [N,V]; labels [N]
    int32/int64. `outputs` names what to compute besides loss and lse (always
    computed): any of 'logprob', 'argmax', 'entropy', 'zloss', or 'all'.
    Outputs are float32 or float64 (out_dtype), argmax int64 or int32.
    `out={'lse': arr, ...}` writes into caller arrays. backend/gemm/threads
    choose how to run (None: the library's choice). Returns a Result."""
    return _call("forward", locals())


def backward(x=None, w=None, labels=None, lse=None, *, logits=None, bias=None,
             token_weights=None, class_weights=None, grad_loss=None, grad_lse=None,
             grad_entropy=None, logit_scale=1.0, softcap=0.0, ignore_index=-100,
             label_smoothing=0.0, z_loss=0.0, reduction="mean", w_layout="vh",
             grad_logits_dtype="f32", filter_eps=0.0, grads=None, grad_dtype=None,
             inplace=False, out=None, backend=None, gemm=None, threads=0):
    """Gradients from the lse that forward() returned. Cotangents: grad_loss
    (a number or 0-D array for sum/mean, [N] for none; default 1), grad_lse
    and grad_entropy ([N]; default 0). `grads` picks among 'x', 'w', 'bias'
    (default: all the problem has) or 'logits' (the logits entry); they are
    float32 (default), float64 or 'input' (x's or the logits' dtype) by
    grad_dtype. inplace=True writes grad_logits over the logits, in their
    dtype (a grad_dtype that differs is an error). filter_eps (a number >= 0 or 'auto',
    the storage dtype's epsilon / 32) turns on gradient filtering (README);
    Result.stats counts the blocks it skipped. Returns a Result."""
    return _call("backward", locals())


def loss_and_grad(x=None, w=None, labels=None, *, logits=None, bias=None, token_weights=None,
                  class_weights=None, grad_loss=None, grad_lse=None, grad_entropy=None,
                  logit_scale=1.0, softcap=0.0, ignore_index=-100, label_smoothing=0.0,
                  z_loss=0.0, reduction="mean", w_layout="vh", grad_logits_dtype="f32",
                  filter_eps=0.0, outputs=("loss", "lse"), grads=None, out_dtype="float32", grad_dtype=None,
                  argmax_dtype="int64", inplace=False, out=None, backend=None, gemm=None,
                  threads=0):
    """forward() and backward() in one pass: a training step. Arguments as
    there; grad_dtype defaults to out_dtype. Returns a Result."""
    return _call("loss_and_grad", locals())


_PASSES = {"forward": forward, "backward": backward, "loss_and_grad": loss_and_grad}


def workspace_size(pass_, *args, **kwargs):
    """(backend, bytes): the scratch that pass_ ('forward', 'backward',
    'loss_and_grad') would allocate beyond its outputs, for the arguments
    that call would take. The library checks the outputs too, so the ones
    not given in `out=` are allocated as the call would (on the inputs'
    device) and freed before it returns."""
    if pass_ not in _PASSES:
        raise ValueError(f"pass_: {pass_!r} is not one of {', '.join(_PASSES)}")
    bound = inspect.signature(_PASSES[pass_]).bind(*args, **kwargs)
    bound.apply_defaults()
    return _call(pass_, bound.arguments, measure=True)
