"""numpy arrays and torch tensors as flce descriptors, and outputs like them.

A descriptor is what flce._flce reads: (data pointer, dtype name, shape,
strides in elements, device, device index). Describing an array never copies
it when flce can read it as it is: flce takes any element strides >= 1, so
only arrays it cannot address are copied (numpy byte strides that are not a
multiple of the item size, negative or zero strides, misaligned or
non-native-byte-order data; torch tensors with zero strides). Copies are
returned to the caller, who keeps them alive for the duration of the call.

torch is never imported here: a torch tensor can only reach us if the caller
imported torch already, so sys.modules tells us whether to look for one.
"""

import sys

import numpy as np

# numpy has no bfloat16: uint16 arrays are read as bfloat16 bit patterns
# (what torch's `t.view(torch.int16)` or ml_dtypes' `.view(np.uint16)` give).
_NUMPY_DTYPES = {
    np.dtype(np.float32): "f32",
    np.dtype(np.float64): "f64",
    np.dtype(np.float16): "f16",
    np.dtype(np.uint16): "bf16",
    np.dtype(np.int32): "i32",
    np.dtype(np.int64): "i64",
}
_NUMPY_OF = {name: dt for dt, name in _NUMPY_DTYPES.items()}


def _torch():
    return sys.modules.get("torch")


def is_torch(obj):
    torch = _torch()
    return torch is not None and isinstance(obj, torch.Tensor)


def _torch_dtypes():
    torch = _torch()
    return {
        torch.float32: "f32",
        torch.float64: "f64",
        torch.float16: "f16",
        torch.bfloat16: "bf16",
        torch.int32: "i32",
        torch.int64: "i64",
    }


def torch_bool():
    return _torch().bool


def torch_narrow_ints():
    """torch's integer dtypes that int64 holds exactly, but for int32 and
    int64 themselves (uint16 and uint32 exist from torch 2.3)."""
    torch = _torch()
    names = ("uint8", "int8", "int16", "uint16", "uint32")
    return {getattr(torch, n) for n in names if hasattr(torch, n)}


def type_name(obj):
    t = type(obj)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__name__}"


def dtype_of(obj):
    """The flce dtype name ('f32', 'bf16', ...) of an array, or None."""
    if is_torch(obj):
        return _torch_dtypes().get(obj.dtype)
    if isinstance(obj, np.ndarray):
        return _NUMPY_DTYPES.get(obj.dtype.newbyteorder("="))
    return None


def _numpy_descriptor(name, arr, output):
    if arr.dtype.newbyteorder("=") not in _NUMPY_DTYPES:
        raise TypeError(
            f"{name}: numpy dtype {arr.dtype} is not supported (float32, float64, float16, "
            f"uint16 as bfloat16 bits, int32, int64)")
    item = arr.dtype.itemsize
    # An empty array addresses nothing, whatever its strides (numpy gives
    # some of them 0): flce's own size check names the empty input instead.
    sizes_ok = arr.size == 0 or all(
        n <= 1 or (s > 0 and s % item == 0) for n, s in zip(arr.shape, arr.strides))
    readable = sizes_ok and arr.dtype.isnative and arr.flags.aligned
    if not readable:
        if output:
            raise ValueError(
                f"{name}: this output array cannot be written in place by flce (strides "
                f"{arr.strides} bytes, dtype {arr.dtype}, aligned={arr.flags.aligned}); flce "
                f"needs native byte order, alignment and positive strides that are multiples "
                f"of the item size")
        # A fresh C-order copy: aligned (ascontiguousarray kept a misaligned
        # but contiguous array as it was) and of the same rank (it made 0-D 1-D).
        arr = np.array(arr, dtype=arr.dtype.newbyteorder("="), order="C", copy=True)
    if output and not arr.flags.writeable:
        raise ValueError(f"{name}: the output array is read-only")
    # Size-1 (and size-0) dimensions are never stepped over; any stride will do.
    strides = tuple(s // item if n > 1 else 1 for n, s in zip(arr.shape, arr.strides))
    desc = (arr.__array_interface__["data"][0], _NUMPY_DTYPES[arr.dtype], tuple(arr.shape),
            strides, "cpu", 0)
    return desc, arr


def _torch_descriptor(name, t, output):
    dtypes = _torch_dtypes()
    if t.dtype not in dtypes:
        raise TypeError(
            f"{name}: torch dtype {t.dtype} is not supported (float32, float64, float16, "
            f"bfloat16, int32, int64)")
    if t.layout != _torch().strided:
        raise TypeError(f"{name}: torch layout {t.layout} is not supported (strided only)")
    if t.device.type not in ("cpu", "cuda"):
        raise TypeError(f"{name}: device {t.device} is not supported (cpu or cuda)")
    if any(n > 1 and s < 1 for n, s in zip(t.shape, t.stride())):
        if output:
            raise ValueError(f"{name}: output strides {t.stride()} must be >= 1")
        t = t.contiguous()
    # A view with the negative bit (a conj's .imag, torch._neg_view) stores
    # the negated values: read those resolved; never write through one.
    if t.is_neg():
        if output:
            raise ValueError(f"{name}: the output is a negated view (is_neg()); pass a tensor "
                             f"that stores its values")
        t = t.resolve_neg()
    strides = tuple(s if n > 1 else 1 for n, s in zip(t.shape, t.stride()))
    desc = (t.data_ptr(), dtypes[t.dtype], tuple(t.shape), strides, t.device.type,
            t.device.index or 0)
    return desc, t


def describe(name, obj, output=False):
    """(descriptor, owner): owner is obj itself or the copy described."""
    if is_torch(obj):
        return _torch_descriptor(name, obj, output)
    if isinstance(obj, np.ma.MaskedArray):  # flce would read the masked values too
        fill = " (with ignore_index)" if name == "labels" else ""
        raise TypeError(f"{name}: a numpy masked array; flce reads every value, so pass "
                        f"arr.filled(...){fill}")
    if isinstance(obj, np.ndarray):
        return _numpy_descriptor(name, obj, output)
    raise TypeError(f"{name}: expected a numpy.ndarray or torch.Tensor, got {type_name(obj)}")


def check_writable(name, obj):
    """Refuses, with grad mode on, a tensor that requires grad: a leaf or a
    view of one, which torch refuses to write in place too (its .grad would
    no longer match it), and any other, whose graph would not see flce's
    write (a torch in-place op is recorded; flce's is not, so the gradient
    through it would be silently wrong). Also an inference tensor outside
    inference mode."""
    if not is_torch(obj):
        return
    torch = _torch()
    base = obj._base if obj._base is not None else obj
    if obj.requires_grad and torch.is_grad_enabled():
        what = "a leaf tensor" if base is obj and obj.is_leaf else \
            "a view of a leaf tensor" if base.is_leaf else "a tensor in an autograd graph"
        raise ValueError(f"{name}: {what} that requires grad cannot be written in place "
                         f"(pass .detach(), or call under torch.no_grad())")
    inference = getattr(obj, "is_inference", lambda: False)()
    if inference and not torch.is_inference_mode_enabled():
        raise ValueError(f"{name}: an inference tensor cannot be written in place outside "
                         f"torch.inference_mode() (pass .clone())")


def mark_written(objs):
    """Bumps the autograd version counter of each torch tensor that flce
    wrote in place, as torch's own in-place ops do, so a graph that saved one
    of them raises at backward instead of reading the new values (torch
    2.1 and later; older versions have no public way to do it)."""
    torch = _torch()  # None: no torch tensor can be among objs
    bump = getattr(torch.autograd.graph, "increment_version", None) if torch else None
    for obj in objs:
        # An inference-mode tensor has no version counter (torch before 2.5
        # raised on it).
        if bump is not None and is_torch(obj) and not obj.is_inference():
            bump(obj)


def empty_like_kind(ref, shape, dtype):
    """An uninitialized array of flce dtype `dtype`, of ref's kind and device."""
    if is_torch(ref):
        torch = _torch()
        torch_dtype = {v: k for k, v in _torch_dtypes().items()}[dtype]
        return torch.empty(shape, dtype=torch_dtype, device=ref.device)
    return np.empty(shape, dtype=_NUMPY_OF[dtype])


def scalar_like_kind(ref, value):
    """A 0-D float64 array holding value, of ref's kind and device."""
    if is_torch(ref):
        return _torch().tensor(value, dtype=_torch().float64, device=ref.device)
    return np.array(value)


def is_cuda(obj):
    return is_torch(obj) and obj.device.type == "cuda"


def current_stream(t):
    """torch's current CUDA stream on t's device, as the int handle flce takes."""
    return _torch().cuda.current_stream(t.device).cuda_stream


def scratch_like(ref, nbytes):
    """nbytes of uninitialized device memory from torch's allocator."""
    return _torch().empty(nbytes, dtype=_torch().uint8, device=ref.device)


def numpy_dtype(dtype):
    """The numpy dtype that holds flce dtype `dtype` (uint16 for bf16)."""
    return _NUMPY_OF[dtype]


def to_float64(obj):
    """An array's values as a float64 numpy array (uint16 read as bfloat16)."""
    if is_torch(obj):
        t = obj.detach()
        if t.dtype == _torch().bfloat16:
            t = t.float()
        return t.cpu().double().numpy()
    arr = np.asarray(obj)
    if arr.dtype == np.uint16:
        return bf16_bits_to_float32(arr).astype(np.float64)
    return arr.astype(np.float64)


def bf16_bits_to_float32(bits):
    """uint16 bfloat16 bit patterns -> float32 values (exact). Integers in
    [0, 65535] of another dtype are taken as bit patterns too; anything else
    (floats: values, not bits) is a TypeError or ValueError."""
    arr = np.asarray(bits)
    if arr.dtype != np.uint16:
        if arr.dtype.kind not in "iu":
            raise TypeError(f"bits: dtype {arr.dtype} holds values, not bfloat16 bit patterns "
                            f"(uint16); for values use float32_to_bf16_bits")
        if arr.size and (arr.min() < 0 or arr.max() > 0xFFFF):
            raise ValueError(f"bits: {arr.min()} .. {arr.max()} is outside the 16-bit patterns "
                             f"[0, 65535]")
    bits = arr.astype(np.uint16)
    wide = np.asarray(bits.astype(np.uint32) << 16, dtype=np.uint32)  # 0-D stays an array
    return wide.reshape(-1).view(np.float32).reshape(bits.shape)


def float32_to_bf16_bits(values):
    """float32 values -> uint16 bfloat16 bits, rounded to nearest even (as
    torch's float32 -> bfloat16 conversion; NaN stays NaN)."""
    shape = np.shape(values)  # ascontiguousarray makes a 0-D array 1-D
    f = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    u = f.view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    out = rounded.astype(np.uint16)
    nan = np.isnan(f)
    out[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)  # keep sign, force a quiet NaN
    return out.reshape(shape)
