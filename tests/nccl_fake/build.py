"""Building the test-double NCCL and CUDA runtime libraries (fake_nccl.c, fake_cudart.c)
into a folder, for the tests (tests/test_nccl_nogpu.py, tests/test_nccl_lean.py) and the
no-GPU benchmark (benchmarks/gpu.py --fake). Never shipped.
"""
import os
import shutil
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))

# file -> (source, library name, extra compiler flags)
BUILDS = {"nccl": ("fake_nccl.c", "libnccl.so.2", []),
          "cudart": ("fake_cudart.c", "libcudart.so.12", []),
          "cudart_old": ("fake_cudart.c", "libcudart_old.so", ["-DFAKE_OLD_DRIVER"])}


def compiler():
    """The C compiler to build with, or None when there is none."""
    return shutil.which("cc") or shutil.which("gcc")


def build(dest):
    """Compile every test double into folder dest; {"nccl", "cudart", "cudart_old": path,
    "log": where FAKE_LOG should point}. Raises when there is no C compiler."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler to build the fake NCCL/CUDA libraries")
    out = {}
    for key, (src, name, extra) in BUILDS.items():
        out[key] = os.path.join(str(dest), name)
        subprocess.run([cc, "-shared", "-fPIC", "-O1", *extra, "-o", out[key],
                        os.path.join(HERE, src)], check=True, timeout=120)
    out["log"] = os.path.join(str(dest), "calls.log")
    return out


def env(fakes, log=True):
    """The environment variables that make pyddp load the test doubles (and, with log,
    log every call to fakes["log"])."""
    e = {"PYDDP_NCCL_LIBRARY": fakes["nccl"], "PYDDP_CUDART_LIBRARY": fakes["cudart"]}
    if log:
        e["FAKE_LOG"] = fakes["log"]
    return e
