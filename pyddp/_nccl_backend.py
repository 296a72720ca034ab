"""The NCCL side of pyddp: finding libnccl and the CUDA runtime, choosing this process's
GPU, and finding the caller's CUDA stream (for a torch tensor, torch's raw lookup of the
current stream, also handed to the C lean path of CUDA tensors: torch_cuda_setup). A
group's NCCL communicator itself is set up
by pyddp._group (through ``_C.ProcessGroup.attach_nccl``) and driven by the same
``_C.ProcessGroup`` as the CPU transport.

pyddp is built without CUDA or NCCL; both are loaded with dlopen the first time they are
needed. This module builds the list of places to look, in order:

* NCCL: ``PYDDP_NCCL_LIBRARY`` (a file, or a folder holding libnccl.so.2), then the lib
  folders of the ``nvidia-nccl-cu13`` and ``nvidia-nccl-cu12`` wheels in site-packages,
  then the system's library path (LD_LIBRARY_PATH, ldconfig).
* CUDA runtime: ``PYDDP_CUDART_LIBRARY``, then the ``nvidia-cuda-runtime`` wheels
  (libcudart.so.13, then .12), then torch's lib folder, then the system's library path
  and the CUDA toolkit's lib64 folder.

A library that this process already loaded (torch's NCCL, say) is preferred unless
``PYDDP_NCCL_LIBRARY`` is set. When nothing works, the error lists every path tried and
why it was refused. probe_nccl() runs the NCCL half of the search alone (NCCL loads
without a driver or a CUDA runtime), for the doctor on machines without either. torch and CuPy are never imported here unless the caller's arrays
already come from them.
"""
import fnmatch
import glob
import importlib.metadata
import importlib.util
import os
import site
import sys
import warnings

from . import _C, _env
from . import _arrays
from ._version import __version__

NCCL_WHEELS = ("nvidia-nccl-cu13", "nvidia-nccl-cu12")
CUDART_WHEELS = (("nvidia-cuda-runtime", "libcudart.so.13*"),
                 ("nvidia-cuda-runtime-cu13", "libcudart.so.13*"),
                 ("nvidia-cuda-runtime-cu12", "libcudart.so.12*"))
# Where those wheels put their libraries, relative to site-packages (used when the
# wheel's metadata is not readable, e.g. a copied environment).
NCCL_WHEEL_DIRS = ("nvidia/nccl/lib",)
CUDART_WHEEL_FILES = ("nvidia/cu13/lib/libcudart.so.13", "nvidia/cuda_runtime/lib/libcudart.so.12")
SYSTEM = "system library path (LD_LIBRARY_PATH, ldconfig)"

_info = None        # nccl_load's answer once loading succeeded (it is then final)


def site_dirs():
    """site-packages folders of this interpreter, in search order, without duplicates."""
    dirs = []
    try:
        dirs += site.getsitepackages()
    except AttributeError:       # some virtualenv flavours lack it
        pass
    try:
        dirs.append(site.getusersitepackages())
    except AttributeError:
        pass
    dirs += [p for p in sys.path if os.path.basename(p.rstrip("/")) in
             ("site-packages", "dist-packages")]
    out, seen = [], set()
    for d in dirs:
        key = os.path.realpath(d)
        if d and key not in seen and os.path.isdir(d):
            seen.add(key)
            out.append(d)
    return out


def _wheel_files(dist_name, pattern):
    """Files of the installed distribution dist_name whose name matches pattern."""
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return []
    return [os.fspath(dist.locate_file(f)) for f in (dist.files or [])
            if fnmatch.fnmatch(f.name, pattern)]


def _dedupe(cands):
    out, seen = [], set()
    for path, origin in cands:
        key = os.path.realpath(path) if os.sep in path else path
        if key not in seen:
            seen.add(key)
            out.append((path, origin))
    return out


def _env_library(var, soname):
    """The candidate named by environment variable var (a file or a folder), or []."""
    v = _C.setting_text(var)
    if not v:
        return []
    return [(os.path.join(v, soname) if os.path.isdir(v) else v, var)]


def nccl_candidates():
    """(path, origin) pairs where NCCL is looked for, in order."""
    cands = _env_library("PYDDP_NCCL_LIBRARY", "libnccl.so.2")
    for wheel in NCCL_WHEELS:
        cands += [(p, f"{wheel} wheel") for p in sorted(_wheel_files(wheel, "libnccl.so*"))]
    for d in site_dirs():
        cands += [(os.path.join(d, sub, "libnccl.so.2"), "nvidia-nccl-cu13/cu12 wheel folder")
                  for sub in NCCL_WHEEL_DIRS]
    cands.append(("libnccl.so.2", SYSTEM))
    return _dedupe(cands)


def _torch_lib_dir():
    """torch's lib folder, found without importing torch (or None)."""
    mod = sys.modules.get("torch")
    locs = getattr(mod, "__path__", None) if mod is not None else None
    if locs is None:
        try:
            spec = importlib.util.find_spec("torch")
        except (ImportError, ValueError):
            spec = None
        locs = spec.submodule_search_locations if spec else None
    return os.path.join(list(locs)[0], "lib") if locs else None


def cudart_candidates():
    """(path, origin) pairs where the CUDA runtime is looked for, in order."""
    cands = _env_library("PYDDP_CUDART_LIBRARY", "libcudart.so.13")
    for wheel, pattern in CUDART_WHEELS:
        cands += [(p, f"{wheel} wheel") for p in sorted(_wheel_files(wheel, pattern))]
    for d in site_dirs():
        cands += [(os.path.join(d, f), "nvidia-cuda-runtime wheel folder")
                  for f in CUDART_WHEEL_FILES]
    tl = _torch_lib_dir()
    if tl:
        cands += [(p, "torch's lib folder") for p in sorted(glob.glob(os.path.join(
            tl, "libcudart*.so*")), reverse=True)]
    cands += [("libcudart.so.13", SYSTEM), ("libcudart.so.12", SYSTEM)]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            cands += [(os.path.join(home, "lib64", f"libcudart.so.{v}"), "CUDA toolkit")
                      for v in (13, 12)]
    return _dedupe(cands)


def _prefer_loaded():
    """Whether an NCCL this process already loaded beats the search order: unless
    PYDDP_NCCL_LIBRARY names one."""
    return not _C.setting_text("PYDDP_NCCL_LIBRARY")


def load():
    """Load NCCL and the CUDA runtime (once per process) and describe them: a dict with
    nccl_path, nccl_version, cudart_path, cudart_version, driver_version, device_count and
    device_error. Raises BackendUnavailableError listing every path tried."""
    global _info
    if _info is not None:
        return _info
    env = _C.setting_text("PYDDP_NCCL_LIBRARY")
    info = _C.nccl_load(nccl_candidates(), cudart_candidates(), _prefer_loaded())
    want = _env_library("PYDDP_NCCL_LIBRARY", "libnccl.so.2")
    if want and os.path.realpath(want[0][0]) != os.path.realpath(info["nccl_path"]):
        warnings.warn(f"pyddp: PYDDP_NCCL_LIBRARY={env} could not be loaded; using "
                      f"{info['nccl_path']} (NCCL {info['nccl_version']}) instead",
                      RuntimeWarning, stacklevel=2)
    _info = info
    return info


def probe_nccl():
    """The NCCL that load() takes, found the same way and checked (every symbol pyddp
    uses, ncclGetVersion, 2.14 or newer) without the CUDA runtime, and not kept loaded:
    a dict with nccl_path, nccl_version ("2.32.3") and nccl_version_code. Raises
    BackendUnavailableError listing every path tried, as load() does."""
    if _info is not None:
        return {k: _info[k] for k in ("nccl_path", "nccl_version", "nccl_version_code")}
    return _C.nccl_probe(nccl_candidates(), _prefer_loaded())


def usable():
    """True when NCCL and the CUDA runtime load and at least one GPU is visible."""
    try:
        return load()["device_count"] > 0
    except _C.BackendUnavailableError:
        return False


def why_unusable():
    """Why usable() is False ("" when it is True)."""
    try:
        info = load()
    except _C.BackendUnavailableError as e:
        return str(e)
    return "" if info["device_count"] > 0 else info["device_error"]


def require():
    """Raise BackendUnavailableError at once unless backend="nccl" can work here."""
    try:
        info = load()
    except _C.BackendUnavailableError as e:
        raise _C.BackendUnavailableError(f"backend='nccl' is unavailable: {e}") from None
    if info["device_count"] == 0:
        raise _C.BackendUnavailableError(
            f"backend='nccl' needs a GPU, but {info['device_error']} (NCCL "
            f"{info['nccl_version']} from {info['nccl_path']}, CUDA runtime from "
            f"{info['cudart_path']}). Use backend='cpu' on machines without GPUs.")
    return info


def cuda_device_for_local_rank():
    """The CUDA device this process should use: its LOCAL_RANK (0 when unset), or device
    0 when the process sees a single GPU (CUDA_VISIBLE_DEVICES set per process).

    Call ``torch.cuda.set_device(pyddp.cuda_device_for_local_rank())`` before creating
    tensors; init_process_group(backend="nccl") uses the same device."""
    n = require()["device_count"]
    lr = _env.local_rank()
    if 0 <= lr < n:
        return lr
    if n == 1:
        return 0
    raise _C.DistValueError(f"LOCAL_RANK={lr}, but only {n} CUDA devices are visible to this "
                            f"process; start at most {n} processes per node "
                            f"(torchrun --nproc-per-node={n}) or check CUDA_VISIBLE_DEVICES")


def _device_index(device_id):
    """The ordinal from device_id: an int, "cuda:N", or a torch.device("cuda", N)."""
    if device_id is None:
        return cuda_device_for_local_rank()
    if isinstance(device_id, bool):
        raise _C.DistTypeError("device_id must be an int or a CUDA device, not a bool")
    if isinstance(device_id, int):
        idx = device_id
    else:
        kind = getattr(device_id, "type", None)
        idx = getattr(device_id, "index", None)
        if kind is None and isinstance(device_id, str):
            kind, _, num = device_id.partition(":")
            idx = int(num) if num.isdigit() else None
        if kind != "cuda":
            raise _C.DistValueError(f"device_id={device_id!r} is not a CUDA device")
        if idx is None:
            return cuda_device_for_local_rank()
    n = require()["device_count"]
    if not 0 <= idx < n:
        raise _C.DistValueError(f"device_id={device_id!r} is out of range: {n} CUDA devices "
                                f"are visible")
    return idx


def torch_stream_of(torch):
    """torch's lookup of the current CUDA stream of a device (an int ordinal) as an int
    cudaStream_t: its raw C call where it has one (no Stream object made), else the
    public API."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda device: torch.cuda.current_stream(device).cuda_stream


def torch_cuda_setup(torch, tensor_type=None, stream_of=None):
    """Hand the C lean path of CUDA tensors (``_C.torch_cuda_config``) the class it
    takes (exactly ``torch.Tensor``), torch's dtype codes and the current-stream lookup
    (``torch_stream_of``). tensor_type and stream_of replace the last two: the test
    doubles of tests/nccl_fake, where torch has no CUDA, pass their own. Touches no
    GPU."""
    tt, strided, codes = _arrays.torch_hook_config(torch)
    _C.torch_cuda_config(tt if tensor_type is None else tensor_type, strided, codes,
                         torch_stream_of(torch) if stream_of is None else stream_of)


def caller_stream(x):
    """The CUDA stream (an int cudaStream_t) on which x's producer works and its consumer
    will read the result, or None when no ordering is needed (host arrays, a
    ``__cuda_array_interface__`` without a stream)."""
    if x is None:
        return None
    mod = type(x).__module__ or ""
    if mod.startswith("torch"):
        if not x.is_cuda:
            return None
        import torch  # x is a torch tensor, so torch is already imported
        return torch_stream_of(torch)(x.get_device())
    if mod.startswith("cupy"):
        import cupy
        with x.device:
            return cupy.cuda.get_current_stream().ptr
    cai = getattr(x, "__cuda_array_interface__", None)
    s = cai.get("stream") if isinstance(cai, dict) else None
    return s if isinstance(s, int) and not isinstance(s, bool) else None
