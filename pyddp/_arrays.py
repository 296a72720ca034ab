"""Array glue between the public API and the C core, for NumPy, torch and CuPy.

The C core takes any contiguous array (NumPy C API, DLPack, the buffer protocol,
``__cuda_array_interface__``). This module handles what only the array's own library
can: detaching torch tensors that require grad (the data is shared, so the result still
lands in the caller's tensor), staging non-contiguous arrays through a contiguous copy,
and allocating and copying the flat buffers that list-based collectives need. torch and
CuPy are never imported here; they are recognised by their module names.
"""
import sys

import numpy as np

from . import _C
from ._C import DistTypeError, DistValueError


def _lib(x):
    mod = type(x).__module__ or ""
    if mod.startswith("torch"):
        return "torch"
    if mod.startswith("cupy"):
        return "cupy"
    return "numpy" if isinstance(x, np.ndarray) else "other"


def for_core(x):
    """The object to hand to the C core for x: torch tensors are detached (a view of
    the same memory) so that tensors requiring grad work without the user detaching."""
    if _lib(x) == "torch" and x.requires_grad:
        return x.detach()
    return x


_TORCH_NP = {}   # torch dtype -> whether the C core takes its NumPy view (lazily filled)
_NP_OK = ("float16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool")


def host_view(x):
    """for_core(x), but a NumPy view of the same memory for a CPU torch tensor that does
    not require grad and has a dtype the core takes: the C core then imports it through
    NumPy's C API instead of a fresh DLPack capsule (a few microseconds less per call,
    which DDP pays once per gradient). The view keeps the tensor's memory alive."""
    if type(x).__module__.startswith("torch") and x.is_cpu and not x.requires_grad:
        ok = _TORCH_NP.get(x.dtype)
        if ok is None:
            ok = _TORCH_NP[x.dtype] = str(x.dtype).rsplit(".", 1)[-1] in _NP_OK
        if ok and not x.is_sparse:
            return x.numpy()
    return for_core(x)


# ---- the one test for a contiguous CPU torch tensor --------------------------------------
# Such a tensor goes to the C core by address (data_ptr, numel, dtype code): no DLPack
# capsule or NumPy view per call. The collectives' lean path, the DDP reducer's C path
# and (through torch_hook_config, in C) DDP's gradient hooks all ask this test.

_torch_tensor = None        # torch.Tensor once seen (recognised by name, never imported)
_torch_strided = None
_torch_dt = {}              # torch dtype -> DT_* code, or None if the core has none


def _seen_torch(t):
    """True if t is exactly a torch.Tensor, remembering the class the first time."""
    global _torch_tensor, _torch_strided
    tp = type(t)
    if _torch_tensor is None:
        if tp.__name__ != "Tensor" or not tp.__module__.startswith("torch"):
            return False
        _torch_strided = sys.modules["torch"].strided
        _torch_tensor = tp
    return tp is _torch_tensor


def _dt_code(dtype):
    code = _torch_dt.get(dtype, False)
    if code is False:
        name = str(dtype).rsplit(".", 1)[-1]
        code = _torch_dt[dtype] = getattr(_C, "DT_" + name.upper(), None)
    return code


def torch_cpu_code(t):
    """The DT_* code of t if t is a torch.Tensor (not a subclass) in CPU memory, strided
    and contiguous, of a dtype the C core takes; else None (anything else, None
    included). The caller then passes t.data_ptr(), t.numel() and the code."""
    if type(t) is not _torch_tensor and not _seen_torch(t):
        return None
    code = _dt_code(t.dtype)
    if code is None or not t.is_cpu or t.layout is not _torch_strided or \
            not t.is_contiguous():
        return None
    return code


def torch_hook_config(torch):
    """(torch.Tensor, torch.strided, {torch dtype: DT_* code}) for C code that applies
    torch_cpu_code's test itself (DDP's gradient hooks, GradHooks)."""
    codes = {}
    for name in ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32",
                 "int64", "bool"):
        dt = getattr(torch, name, None)
        if dt is not None and _dt_code(dt) is not None:
            codes[dt] = _dt_code(dt)
    return torch.Tensor, torch.strided, codes


def numel(x):
    if _lib(x) == "torch":
        return x.numel()
    return int(np.prod(x.shape)) if hasattr(x, "shape") else len(x)


def is_contiguous(x):
    lib = _lib(x)
    if lib == "torch":
        return x.is_contiguous()
    if lib in ("numpy", "cupy"):
        return x.flags.c_contiguous
    return True


class Staged:
    """A contiguous stand-in for x. ``array`` goes to the core; ``finish()`` copies the
    result back into x when x itself was not contiguous (for outputs)."""

    def __init__(self, x, copy_in=True):
        self.orig = x
        lib = _lib(x)
        if is_contiguous(x):
            self.array = for_core(x)
            self.copy_back = False
            return
        if lib == "torch":
            self.array = for_core(x).contiguous()
        elif lib == "cupy":
            import cupy  # only reached for CuPy inputs
            self.array = cupy.ascontiguousarray(x)
        else:
            self.array = np.ascontiguousarray(x)
        self.copy_back = True

    def finish(self):
        if self.copy_back:
            copy_into(self.orig, self.array)


def on_gpu(x):
    """Whether x lives in GPU memory: it offers ``__cuda_array_interface__`` (CUDA torch
    tensors, CuPy, Numba) or says so through DLPack (device CUDA or CUDA managed)."""
    if hasattr(x, "__cuda_array_interface__"):
        return True
    dev = getattr(x, "__dlpack_device__", None)
    return dev is not None and dev()[0] in (2, 13)     # kDLCUDA, kDLCUDAManaged


def empty_flat(like, n, dtype=None):
    """A new 1-D array of n elements with like's library and device, and like's dtype
    or dtype (one of that library's dtypes, see dtype_in)."""
    lib = _lib(like)
    dtype = like.dtype if dtype is None else dtype
    if lib == "torch":
        import torch  # like is a torch tensor, so torch is already imported
        return torch.empty(n, dtype=dtype, device=like.device)
    if lib == "cupy":
        import cupy
        return cupy.empty(n, dtype=dtype)
    return np.empty(n, dtype=dtype)


def dtype_in(like, name):
    """The dtype called name ('float16', 'bfloat16', 'float32', ...) of like's array
    library, or None where that library has none (bfloat16: NumPy without ml_dtypes,
    CuPy)."""
    lib = _lib(like)
    if lib == "torch":
        import torch
        return getattr(torch, name, None)
    if name == "bfloat16":
        if lib == "cupy":
            return None
        try:
            import ml_dtypes
        except ImportError:
            return None
        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(name)
    except TypeError:
        return None


def divide_into(dst, src, divisor):
    """dst[...] = src / divisor (same element count), computed in src's dtype and
    rounded once to dst's, in one pass, without autograd."""
    if _lib(dst) == "torch":
        import torch
        with torch.no_grad():
            torch.div(src.reshape(dst.shape), divisor, out=dst)
        return
    xp = np
    if _lib(dst) == "cupy":
        import cupy as xp
    try:
        xp.divide(src.reshape(dst.shape), divisor, out=dst, casting="same_kind")
    except TypeError:       # a dtype (ml_dtypes') whose cast is registered as unsafe only
        dst[...] = src.reshape(dst.shape) / divisor


def copy_as(src, like):
    """A new array holding src's values in like's dtype (src's library and device)."""
    if _lib(src) == "torch":
        return src.detach().to(dtype=like.dtype, copy=True)
    return src.astype(like.dtype)


def flat(x):
    """A 1-D view of contiguous x (same memory)."""
    return for_core(x).reshape(-1)


def copy_into(dst, src):
    """dst[...] = src (same element count), in dst's library, without autograd."""
    if _lib(dst) == "torch":
        import torch
        with torch.no_grad():
            dst.copy_(src.reshape(dst.shape))
    else:
        dst[...] = src.reshape(dst.shape)


def pack(lst, like):
    """A new flat array (like's dtype, library and device) holding lst's arrays one
    after another; each has like's element count."""
    n = numel(like)
    out = empty_flat(for_core(like), len(lst) * n)
    for r, t in enumerate(lst):
        copy_into(out[r * n:(r + 1) * n], flat(Staged(t).array))
    return out


def unpack_into(lst, src):
    """lst[r][...] = block r of flat array src (the inverse of pack)."""
    n = numel(src) // len(lst) if lst else 0
    for r, t in enumerate(lst):
        copy_into(t, src[r * n:(r + 1) * n])


def check_list(lst, name, length, like):
    """Validate a list of output/input arrays: a list of `length` arrays, each with
    the element count and dtype of `like`."""
    if not isinstance(lst, (list, tuple)):
        raise DistTypeError(f"{name} must be a list of arrays, not {type(lst).__name__}")
    if len(lst) != length:
        raise DistValueError(f"{name} has {len(lst)} entries but the world size is {length}")
    n = numel(like)
    for i, t in enumerate(lst):
        if numel(t) != n:
            raise DistValueError(f"{name}[{i}] has {numel(t)} elements but the tensor has {n}")
        if getattr(t, "dtype", None) != getattr(like, "dtype", None):
            raise DistTypeError(f"{name}[{i}] has dtype {t.dtype} but the tensor has {like.dtype}")


def pack_ragged(lst):
    """A new flat array holding lst's arrays one after another (any sizes; dtype,
    library and device of lst[0])."""
    total = sum(numel(t) for t in lst)
    out = empty_flat(for_core(lst[0]), total)
    off = 0
    for t in lst:
        n = numel(t)
        copy_into(out[off:off + n], flat(Staged(t).array))
        off += n
    return out


def unpack_ragged(lst, src):
    """lst[i][...] = the i-th run of src (the inverse of pack_ragged)."""
    off = 0
    for t in lst:
        n = numel(t)
        copy_into(t, src[off:off + n])
        off += n
