"""Build script for pyddp's C extension, pyddp._C.

One extension compiled from csrc/core (C11 + POSIX), csrc/cuda (NCCL and the CUDA
runtime, loaded at run time with dlopen, so no CUDA headers or libraries are needed
to build) and csrc/py (the CPython/NumPy bindings).
"""
import glob
import os

import numpy
from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def sources():
    files = []
    for sub in ("core", "cuda", "py"):
        files += sorted(glob.glob(os.path.join("csrc", sub, "*.c")))
    return files


ext = Extension(
    "pyddp._C",
    sources=sources(),
    include_dirs=["csrc/core", "csrc/cuda", "csrc/py", numpy.get_include()],
    define_macros=[("_GNU_SOURCE", None), ("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    # -Wno-format-truncation: error messages are cut to fixed-size buffers on purpose.
    extra_compile_args=["-std=c11", "-O3", "-Wall", "-Wno-unused-parameter", "-Wno-format-truncation",
                        "-fvisibility=hidden", "-fno-strict-aliasing"],
    libraries=["dl", "pthread", "m"],
)

# The sources compile in parallel, one job per CPU (pip's builds too).
setup(ext_modules=[ext], options={"build_ext": {"parallel": os.cpu_count() or 1}})
