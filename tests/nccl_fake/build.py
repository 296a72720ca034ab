"""Building the test-double NCCL and CUDA runtime libraries (fake_nccl.c, fake_cudart.c)
into a folder, and running a scenario script against them in a subprocess, for the
tests (tests/test_nccl_nogpu.py, tests/test_nccl_lean.py) and the no-GPU benchmark
(benchmarks/gpu.py --fake). Never shipped.
"""
import json
import os
import shutil
import subprocess
import sys

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


def env_of(fakes, log=True):
    """The environment variables that make pyddp load the test doubles (and, with log,
    log every call to fakes["log"])."""
    e = {"PYDDP_NCCL_LIBRARY": fakes["nccl"], "PYDDP_CUDART_LIBRARY": fakes["cudart"]}
    if log:
        e["FAKE_LOG"] = fakes["log"]
    return e


def scenario(script, name, fakes, timeout=120, **env):
    """Run scenario name of script (scenarios.py, lean_scenarios.py) in a subprocess with
    the fakes (a fresh call log), killed at timeout; the dict it printed last as its
    "RESULT " line. Asserts that it exited cleanly."""
    from launch import run      # tests/ is on the path of whoever imports this module
    if os.path.exists(fakes["log"]):
        os.unlink(fakes["log"])
    base = env_of(fakes)
    base.update({k: str(v) for k, v in env.items()})
    r = run([sys.executable, script, name], env=base, timeout=timeout)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.output[-6000:]
    return json.loads(lines[-1][len("RESULT "):])
