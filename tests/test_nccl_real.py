"""The real NCCL library, host side, on machines without a GPU (runs in CI): the
nvidia-nccl-cu13 wheel of the test extra carries nccl.h and libnccl.so.2.

* pyddp's own declarations (csrc/cuda/ddp_cuda_lib.h) against the real headers, in two
  halves: every NCCL prototype, constant and struct layout against nccl.h alone (with a
  stand-in for the two CUDA handle types that nccl.h takes from the CUDA runtime's
  headers), and the CUDA runtime's, the stand-in's included, against cuda_runtime_api.h
  where the CUDA toolkit is installed.
* The loader against the real libnccl.so.2, in subprocesses (a loaded library stays
  loaded): found by the default search, every symbol pyddp uses resolved, ncclGetVersion
  reported as the wheel's version; without a GPU, with or without a CUDA runtime,
  backend="nccl" still fails at once with the BackendUnavailableError of a machine
  without a GPU, and backend=None falls back to the CPU backend.

Without the wheel, nccl.h or a C compiler these tests skip, saying why; under CI (CI=true)
they fail instead, so that CI cannot pass without running them. The CUDA runtime half
skips wherever cuda_runtime_api.h is missing (CI has no CUDA toolkit).
"""
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from pyddp import _nccl_backend as nb

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from launch import ROOT, run  # noqa: E402

WHEEL = "nvidia-nccl-cu13"
LIB_H = os.path.join(ROOT, "csrc", "cuda", "ddp_cuda_lib.h")
NO_CUDART = [("/nonexistent/pyddp-test/libcudart.so.13", "test")]

# What nccl.h needs from the CUDA runtime's headers (it includes cuda_runtime.h,
# cuda_fp16.h and cuda_bf16.h): the stream and event handles of its prototypes, as
# driver_types.h declares them. test_cuda_declarations_match_cuda_runtime_api_h checks
# these two lines against the real header.
CUDA_STAND_IN = """#ifndef CUDART_VERSION
#define CUDART_VERSION 13000
#endif
typedef struct CUstream_st *cudaStream_t;
typedef struct CUevent_st *cudaEvent_t;
"""

# pyddp's type names -> the headers'
TYPES = {"ddp_cu_err": "cudaError_t", "ddp_cu_stream": "cudaStream_t",
         "ddp_cu_event": "cudaEvent_t", "ddp_cu_ptr_attr": "struct cudaPointerAttributes",
         "ddp_nc_result": "ncclResult_t", "ddp_nc_comm": "ncclComm_t",
         "ddp_nc_uid": "ncclUniqueId", "ddp_nc_config": "ncclConfig_t"}
# parameters that pyddp passes as int where the header has an enum (same ABI)
ENUMS = {"cudaMemcpyAsync": {3: "enum cudaMemcpyKind"},
         "ncclAllReduce": {3: "ncclDataType_t", 4: "ncclRedOp_t"},
         "ncclReduce": {3: "ncclDataType_t", 4: "ncclRedOp_t"},
         "ncclReduceScatter": {3: "ncclDataType_t", 4: "ncclRedOp_t"},
         "ncclBroadcast": {3: "ncclDataType_t"}, "ncclAllGather": {3: "ncclDataType_t"},
         "ncclSend": {2: "ncclDataType_t"}, "ncclRecv": {2: "ncclDataType_t"}}


def required(reason):
    """Skip with reason; under CI (CI=true), which must run these tests, fail."""
    if os.environ.get("CI", "").lower() in ("1", "true"):
        pytest.fail(f"{reason}: CI must run this test (scripts/test.sh installs the test "
                    f"extra, {WHEEL} included)")
    pytest.skip(reason)


def find_header(name, env_var, dirs):
    """The first of $env_var and dirs that holds name, or None."""
    for d in filter(None, [os.environ.get(env_var)] + dirs):
        if os.path.isfile(os.path.join(d, name)):
            return d
    return None


def header_version(include_dir):
    """(NCCL_MAJOR.NCCL_MINOR.NCCL_PATCH, NCCL_VERSION_CODE) of include_dir/nccl.h."""
    text = open(os.path.join(include_dir, "nccl.h")).read()
    v = {k: re.search(rf"^#define NCCL_{k}\s+(\d+)", text, re.M).group(1)
         for k in ("MAJOR", "MINOR", "PATCH", "VERSION_CODE")}
    return f"{v['MAJOR']}.{v['MINOR']}.{v['PATCH']}", int(v["VERSION_CODE"])


@pytest.fixture(scope="module")
def nccl_wheel():
    """The installed nvidia-nccl-cu13 wheel: dict version (its metadata's), lib (the real
    path of its libnccl.so.2), include (the folder of its nccl.h) and header_version,
    header_code (nccl.h's NCCL_MAJOR.MINOR.PATCH and NCCL_VERSION_CODE)."""
    try:
        dist = importlib.metadata.distribution(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        required(f"the {WHEEL} wheel is not installed (pip install -e '.[test]' brings it)")
    files = {f.name: os.path.realpath(dist.locate_file(f)) for f in dist.files or []}
    if "libnccl.so.2" not in files or "nccl.h" not in files:
        required(f"the {WHEEL} wheel's files list has no libnccl.so.2 or nccl.h")
    out = {"version": dist.version, "lib": files["libnccl.so.2"],
           "include": os.path.dirname(files["nccl.h"])}
    out["header_version"], out["header_code"] = header_version(out["include"])
    return out


# ---- pyddp's own declarations against the real headers ----------------------------

def declared():
    """{name: (return type, [parameter types])} of every function pyddp resolves, in
    the headers' type names, from the X(...) tables of ddp_cuda_lib.h."""
    src = open(LIB_H).read().replace("\\\n", " ")

    def real(t):
        for k, v in TYPES.items():
            t = re.sub(rf"\b{k}\b", v, t)
        return t
    out = {}
    for ret, name, params in re.findall(r"X\(([^,]+),\s*(\w+),\s*\(([^()]*)\)\)", src):
        args = [real(a.strip()) for a in params.split(",")]
        for i, t in ENUMS.get(name, {}).items():
            assert args[i] == "int", (name, i)
            args[i] = t
        out[name] = (real(ret), args)
    return out


def prototype_asserts(prefix):
    """One _Static_assert per declared function whose name starts with prefix: its
    type in the header equals pyddp's."""
    funcs = {n: f for n, f in declared().items() if n.startswith(prefix)}
    assert funcs, prefix
    return [f"_Static_assert(__builtin_types_compatible_p(__typeof__(&{name}), "
            f"{ret} (*)({', '.join(args)})), \"{name}\");" for name, (ret, args) in funcs.items()]


def compile_checks(tmp_path, lines, include_dirs):
    """Compile lines (C with _Static_asserts) with -fsyntax-only; fail with the
    compiler's messages."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        required("no C compiler for the declaration check")
    (tmp_path / "abi.c").write_text("\n".join(lines) + "\n")
    r = subprocess.run([cc, "-std=gnu11", "-fsyntax-only", *[f"-I{d}" for d in include_dirs],
                        str(tmp_path / "abi.c")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_nccl_declarations_match_nccl_h(tmp_path):
    """Every NCCL function pyddp resolves has, with pyddp's types mapped to NCCL's, the
    prototype of nccl.h; the result, data type and op codes, ncclUniqueId's size and
    ncclConfig_t's head agree. nccl.h alone: NCCL_INCLUDE_DIR, the nvidia-nccl wheel,
    /usr/include."""
    inc = find_header("nccl.h", "NCCL_INCLUDE_DIR",
                      [os.path.join(d, "nvidia", "nccl", "include") for d in nb.site_dirs()]
                      + ["/usr/include"])
    if inc is None:
        required(f"nccl.h not found (NCCL_INCLUDE_DIR, the {WHEEL} wheel, /usr/include)")
    stand_in = tmp_path / "cuda"
    stand_in.mkdir()
    (stand_in / "cuda_runtime.h").write_text(CUDA_STAND_IN)
    (stand_in / "cuda_fp16.h").write_text("")
    (stand_in / "cuda_bf16.h").write_text("")
    lines = ["#include <stddef.h>", "#include <nccl.h>"] + prototype_asserts("nccl") + [
        "_Static_assert(ncclSuccess == 0 && ncclInProgress == 7, \"results\");",
        "_Static_assert(ncclSum == 0 && ncclProd == 1 && ncclMax == 2 && ncclMin == 3 && "
        "ncclAvg == 4, \"ops\");",
        "_Static_assert(ncclInt8 == 0 && ncclUint8 == 1 && ncclInt32 == 2 && ncclUint32 == 3 && "
        "ncclInt64 == 4 && ncclUint64 == 5 && ncclFloat16 == 6 && ncclFloat32 == 7 && "
        "ncclFloat64 == 8 && ncclBfloat16 == 9, \"types\");",
        "_Static_assert(sizeof(ncclUniqueId) == 128 && offsetof(ncclConfig_t, size) == 0 && "
        "offsetof(ncclConfig_t, magic) == 8 && offsetof(ncclConfig_t, version) == 12 && "
        "offsetof(ncclConfig_t, blocking) == 16 && NCCL_API_MAGIC == 0xcafebeef, \"config\");",
        "_Static_assert(NCCL_VERSION_CODE >= 21400, \"pyddp needs NCCL 2.14 or newer\");",
    ]
    compile_checks(tmp_path, lines, [str(stand_in), inc])


def test_cuda_declarations_match_cuda_runtime_api_h(tmp_path):
    """Every CUDA runtime function pyddp resolves has the prototype of
    cuda_runtime_api.h; the constants and cudaPointerAttributes' layout agree, and so do
    the stream and event types of the stand-in that the NCCL half compiles nccl.h with.
    Where the CUDA toolkit is installed (CUDA_INCLUDE_DIR, CUDA_HOME, /usr/local/cuda)."""
    inc = find_header("cuda_runtime_api.h", "CUDA_INCLUDE_DIR",
                      [os.path.join(h, "include") for h in filter(None, (
                          os.environ.get("CUDA_HOME"), "/usr/local/cuda"))])
    if inc is None:
        pytest.skip("cuda_runtime_api.h not found (CUDA_INCLUDE_DIR, $CUDA_HOME/include, "
                    "/usr/local/cuda/include): no CUDA toolkit here; the NCCL half of the "
                    "check runs without it")
    lines = ["#include <stddef.h>", "#include <cuda_runtime_api.h>",
             CUDA_STAND_IN] + prototype_asserts("cuda") + [
        "_Static_assert(cudaSuccess == 0 && cudaErrorNotReady == 600 && cudaErrorNoDevice == 100 "
        "&& cudaErrorInsufficientDriver == 35 && cudaStreamNonBlocking == 1 && "
        "cudaEventDisableTiming == 2 && cudaMemcpyDefault == 4 && cudaMemoryTypeDevice == 2 && "
        "cudaMemoryTypeManaged == 3, \"cuda\");",
        "_Static_assert(offsetof(struct cudaPointerAttributes, type) == 0 && "
        "offsetof(struct cudaPointerAttributes, device) == 4 && "
        "offsetof(struct cudaPointerAttributes, devicePointer) == 8 && "
        "offsetof(struct cudaPointerAttributes, hostPointer) == 16 && "
        "sizeof(struct cudaPointerAttributes) <= 16 + 8 * 34, \"attributes\");",
    ]
    compile_checks(tmp_path, lines, [inc])


def test_both_tables_are_checked():
    """The two halves together cover every function of ddp_cuda_lib.h's tables."""
    names = declared()
    assert all(n.startswith(("nccl", "cuda")) for n in names), names
    assert len(names) >= 37


# ---- the loader against the real libnccl.so.2 -------------------------------------

# In a fresh process: the NCCL search and probe, the full load, require(), backend=None
# and backend="nccl", then (last: ctypes keeps the library loaded) the symbols of
# argv[1:] looked up in the NCCL that was found. HIDE_CUDART: no CUDA runtime anywhere.
SCRIPT = r"""
import ctypes, json, os, sys
import pyddp
import pyddp._nccl_backend as nb
if os.environ.get("HIDE_CUDART"):
    nb.cudart_candidates = lambda: [tuple(c) for c in json.loads(os.environ["HIDE_CUDART"])]

def attempt(fn):
    try:
        return {"ok": fn()}
    except Exception as e:
        return {"error": [type(e).__name__, str(e)]}

out = {"candidates": nb.nccl_candidates(), "probe": attempt(nb.probe_nccl),
       "load": attempt(nb.load), "require": attempt(nb.require)}
store = pyddp.TCPStore("127.0.0.1", 0, is_master=True)
pyddp.init_process_group(None, store=store, rank=0, world_size=1)
out["auto"] = pyddp.get_backend()
pyddp.destroy_process_group()
store.close()
out["init"] = attempt(lambda: pyddp.init_process_group("nccl"))
if "ok" in out["probe"]:
    lib = ctypes.CDLL(out["probe"]["ok"]["nccl_path"])
    out["missing"] = [n for n in sys.argv[1:] if not hasattr(lib, n)]
print("RESULT " + json.dumps(out))
"""


def in_fresh_process(hide_cudart):
    env = {"PYDDP_NCCL_LIBRARY": "", "PYDDP_CUDART_LIBRARY": "", "RANK": "", "WORLD_SIZE": "",
           "MASTER_ADDR": "", "MASTER_PORT": "", "LOCAL_RANK": ""}
    if hide_cudart:
        env["HIDE_CUDART"] = json.dumps(NO_CUDART)
    names = [n for n in declared() if n.startswith("nccl")]
    r = run([sys.executable, "-c", SCRIPT, *names], env=env, timeout=90)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.output
    return json.loads(lines[-1][len("RESULT "):])


def test_wheel_version_is_its_headers(nccl_wheel):
    assert nccl_wheel["version"].startswith(nccl_wheel["header_version"]), nccl_wheel


@pytest.mark.parametrize("hide_cudart", [False, True], ids=["as-installed", "no-cudart"])
def test_real_nccl_loads_and_no_gpu_error_is_unchanged(nccl_wheel, hide_cudart):
    """The default search finds the wheel's libnccl.so.2 first, it loads without a GPU,
    every NCCL symbol pyddp uses resolves and ncclGetVersion gives the wheel's version.
    The CUDA runtime is the missing piece: either it loads and sees no GPU, or (always
    with no-cudart) it is not found; both fail backend="nccl" with the message of a
    machine without a GPU, and backend=None falls back to the CPU backend."""
    r = in_fresh_process(hide_cudart)
    path, ver = nccl_wheel["lib"], nccl_wheel["header_version"]
    first, origin = r["candidates"][0]
    assert os.path.realpath(first) == path and origin == f"{WHEEL} wheel", r["candidates"]
    probe = r["probe"].get("ok")
    assert probe, r["probe"]
    assert os.path.realpath(probe["nccl_path"]) == path
    assert probe["nccl_version"] == ver and probe["nccl_version_code"] == nccl_wheel["header_code"]
    assert r["missing"] == []
    assert r["auto"] == "cpu"
    if "ok" in r["load"]:
        info = r["load"]["ok"]
        assert not hide_cudart
        if info["device_count"] > 0:
            pytest.skip("a GPU is visible here: this test is for machines without one")
        assert os.path.realpath(info["nccl_path"]) == path and info["nccl_version"] == ver
        want = (f"backend='nccl' needs a GPU, but {info['device_error']} (NCCL {ver} from "
                f"{info['nccl_path']}, CUDA runtime from {info['cudart_path']}). Use "
                f"backend='cpu' on machines without GPUs.")
    else:
        cls, msg = r["load"]["error"]
        assert cls == "BackendUnavailableError"
        assert msg.startswith("could not load the CUDA runtime (libcudart.so.13 or .12); "
                              "tried, in order:\n  1. "), msg
        if hide_cudart:
            assert f"1. {NO_CUDART[0][0]} (test): " in msg
        want = f"backend='nccl' is unavailable: {msg}"
    assert r["require"]["error"] == ["BackendUnavailableError", want]
    assert r["init"]["error"] == ["BackendUnavailableError", want]
