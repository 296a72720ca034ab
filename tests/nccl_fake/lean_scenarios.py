"""Scenarios of the lean CUDA-tensor path (csrc/py/py_torch_cuda.c,
pyddp/torch_backend/_cuda.py) against the test-double libraries, one per process:
torch's API over backend "pyddp" and pyddp's own API on a CUDA tensor
(torch_fakes.FakeCudaTensor: CPU memory that says it is on cuda:0).

Usage: python lean_scenarios.py NAME. The fakes are named by PYDDP_NCCL_LIBRARY and
PYDDP_CUDART_LIBRARY (FAKE_LOG: their call log); each scenario prints one JSON line of
observations (prefixed "RESULT ") that tests/test_nccl_lean.py checks.
"""
import collections
import gc
import json
import os
import sys
import time
import weakref
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from nccl_fake import torch_fakes as tf  # noqa: E402

import pyddp  # noqa: E402
import pyddp.torch_backend  # noqa: E402,F401 - registers the backend

PKG = os.path.dirname(os.path.abspath(pyddp.__file__))
TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def log_lines():
    path = os.environ.get("FAKE_LOG")
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        return f.read().splitlines()


def described(e):
    """(class name, message, the names of its classes) of exception e, or None."""
    if e is None:
        return None
    return [type(e).__name__, str(e), [c.__name__ for c in type(e).__mro__]]


def error(fn):
    """described() of what fn() raised, or None if it did not raise."""
    try:
        fn()
    except Exception as e:   # noqa: BLE001 - the test inspects whatever was raised
        return described(e)
    return None


def torch_init(timeout_s=30.0):
    tf.install()
    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    dist.init_process_group("pyddp", store=store, rank=0, world_size=1,
                            timeout=timedelta(seconds=timeout_s))
    return store


def pyddp_init(timeout_s=30.0):
    tf.install()
    store = pyddp.TCPStore("127.0.0.1", 0, is_master=True)
    pyddp.init_process_group("nccl", store=store, rank=0, world_size=1,
                             timeout=timedelta(seconds=timeout_s))
    return store


def sample(dtype, n=13, seed=0):
    """A CPU tensor of dtype with varied values (the reference is its copy: at world size 1
    every reduction is the identity)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g) * 8).to(dtype)
    return torch.randint(0, 100, (n,), generator=g).to(dtype)


def group_call(method, t):
    """torch's blocking broadcast / reduce (root 0) of t, as torch's wrappers call the
    group (their own wrappers ask torch.cuda about a CUDA tensor's device first, which a
    torch without CUDA cannot answer)."""
    opts = dist.BroadcastOptions() if method == "broadcast" else dist.ReduceOptions()
    opts.rootRank = 0
    opts.asyncOp = False
    if method == "reduce":
        opts.reduceOp = dist.ReduceOp.SUM
    return getattr(dist.distributed_c10d._get_default_group(), method)([t], opts)


def calls():
    """Each call of the lean path on a CUDA tensor, one at a time: the CUDA/NCCL calls it
    made (the log lines it added) and whether the tensor kept its values."""
    torch_init()
    out = {}
    R = dist.ReduceOp
    cases = [("f32_sum", torch.float32, lambda t: dist.all_reduce(t)),
             ("f32_avg", torch.float32, lambda t: dist.all_reduce(t, op=R.AVG)),
             ("f64_max", torch.float64, lambda t: dist.all_reduce(t, op=R.MAX)),
             ("i32_min", torch.int32, lambda t: dist.all_reduce(t, op=R.MIN)),
             ("i64_prod", torch.int64, lambda t: dist.all_reduce(t, op=R.PRODUCT)),
             ("f16_sum", torch.float16, lambda t: dist.all_reduce(t)),
             ("bf16_sum", torch.bfloat16, lambda t: dist.all_reduce(t)),
             ("u8_sum", torch.uint8, lambda t: dist.all_reduce(t)),
             ("i8_sum", torch.int8, lambda t: dist.all_reduce(t)),
             ("bool_sum", torch.bool, lambda t: dist.all_reduce(t)),
             ("broadcast", torch.float32, lambda t: group_call("broadcast", t)),
             ("reduce", torch.float32, lambda t: group_call("reduce", t)),
             ("async", torch.float32, lambda t: dist.all_reduce(t, async_op=True))]
    for name, dtype, fn in cases:
        x = sample(dtype)
        ref = x.clone()
        n0 = len(log_lines())
        r = fn(tf.cuda(x))
        out[name] = {"log": log_lines()[n0:], "kept": bool(torch.equal(x, ref)),
                     "returned": type(r).__name__}
    dist.destroy_process_group()
    return out


def async_work():
    """torch's asynchronous call: the CudaWork, its future (made when asked, completed,
    value the tensors), then() on it, and wait()."""
    torch_init()
    x = tf.cuda(torch.arange(8.0))
    w = dist.all_reduce(x, async_op=True)
    out = {"type": type(w).__name__, "is_work": isinstance(w, dist.Work),
           "future_before": w._fut is None}
    fut = w.get_future()
    chained = fut.then(lambda f: [t * 2 for t in f.value()])
    out.update(future_done=fut.done(), value_is_tensor=fut.value()[0] is x,
               same_future=w.get_future() is fut, then=chained.wait()[0].tolist(),
               wait=w.wait(), completed=w.is_completed(), exception=w.exception() is None,
               success=w.is_success(), result=w.result()[0] is x)
    dist.destroy_process_group()
    return out


def python_calls(fn):
    """What one call of fn() costs in Python: {"pyddp": {module:function: calls} of the
    Python functions of pyddp's package (a method by its own name), "torch":
    {module:function: calls} of torch's,
    "other": calls of any other Python function, "c_from_pyddp": {name: calls} of the C
    functions pyddp's own frames called}."""
    out = {"pyddp": collections.Counter(), "torch": collections.Counter(), "other": 0,
           "c_from_pyddp": collections.Counter()}

    def prof(frame, event, arg):
        code = frame.f_code
        path = code.co_filename
        if event == "call":
            if path.startswith(PKG):
                mod = os.path.relpath(path, PKG)[:-3].replace(os.sep, ".")
                out["pyddp"][f"{mod}:{code.co_name}"] += 1
            elif path.startswith(TORCH):
                mod = os.path.relpath(path, TORCH)[:-3].replace(os.sep, ".")
                out["torch"][f"{mod}:{code.co_name}"] += 1
            else:
                out["other"] += 1
        elif event == "c_call" and path.startswith(PKG):
            name = getattr(arg, "__qualname__", None) or getattr(arg, "__name__", repr(arg))
            out["c_from_pyddp"][name] += 1
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return {k: dict(v) if isinstance(v, collections.Counter) else v for k, v in out.items()}


def counts():
    """Python-level calls per collective on a CUDA tensor: torch's API over "pyddp"
    (blocking, asynchronous), pyddp's own blocking call, and for reference the same torch
    calls on a CPU tensor (the thin path). The first calls (set-up) are not counted."""
    torch_init()
    x = tf.cuda(torch.ones(1024))
    h = torch.ones(1024)
    keep = []
    cases = {"torch_sync": lambda: dist.all_reduce(x),
             "torch_async": lambda: keep.append(dist.all_reduce(x, async_op=True)),
             "torch_broadcast": lambda: group_call("broadcast", x),
             "cpu_sync": lambda: dist.all_reduce(h),
             "cpu_async": lambda: keep.append(dist.all_reduce(h, async_op=True))}
    out = {}
    for name, fn in cases.items():
        fn()
        out[name] = python_calls(fn)
    for w in keep:
        w.wait()
    dist.destroy_process_group()
    pyddp_init()
    fn = lambda: pyddp.all_reduce(x)   # noqa: E731
    fn()
    out["pyddp_sync"] = python_calls(fn)
    fn = lambda: keep.append(pyddp.all_reduce(x, async_op=True))   # noqa: E731
    fn()
    out["pyddp_async"] = python_calls(fn)
    for w in keep:
        w.wait()
    pyddp.destroy_process_group()
    return out


def hang():
    """The collective never completes (FAKE_CUDA_HANG): torch's calls return at once;
    at the group's timeout pyddp's completion thread aborts the communicator, and then
    the Work and the next call say why."""
    torch_init(timeout_s=1.0)
    x = tf.cuda(torch.ones(4))
    t0 = time.monotonic()
    dist.all_reduce(x)                              # queued: returns at once
    w = dist.all_reduce(x, async_op=True)
    n0 = len(log_lines())
    out = {"returned_s": time.monotonic() - t0, "wait": w.wait(),
           "wait_log": log_lines()[n0:], "completed_before": w.is_completed()}
    deadline = time.monotonic() + 20
    while not w.is_completed() and time.monotonic() < deadline:
        time.sleep(0.05)
    out.update(completed_s=time.monotonic() - t0, completed=w.is_completed(),
               exception=described(w.exception()),
               wait_after=error(w.wait), next_call=error(lambda: dist.all_reduce(x)),
               aborts=log_lines().count("ncclCommAbort"))
    fut = w.get_future()
    out["future"] = error(fut.wait)
    return out


def async_error():
    """NCCL reports an asynchronous error from the second collective on
    (FAKE_NCCL_ASYNC_ERROR_AT=2): the completion thread finds it and aborts; the next
    call raises it."""
    torch_init()
    x = tf.cuda(torch.ones(4))
    dist.all_reduce(x)
    dist.all_reduce(x)                  # queued; fails on the device
    time.sleep(0.5)                     # the completion thread polls every millisecond
    return {"third": error(lambda: dist.all_reduce(x)),
            "aborts": log_lines().count("ncclCommAbort")}


def release():
    """A collective that returned before it finished lets go of its tensor once it has
    (the completion thread finishes it): no tensor, Work or group kept alive; events
    are reused rather than made per call."""
    torch_init()
    x = tf.cuda(torch.ones(1 << 16))
    ref = weakref.ref(x)
    for _ in range(10):
        for _ in range(20):
            dist.all_reduce(x)
        time.sleep(0.02)                # the completion thread finishes them meanwhile
    w = dist.all_reduce(x, async_op=True)
    del x, w
    deadline = time.monotonic() + 10
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    gc.collect()
    works = sum(type(o).__name__ in ("Work", "CudaWork") and
                type(o).__module__.startswith("pyddp") for o in gc.get_objects())
    events = sum(x.startswith("cudaEventCreateWithFlags") for x in log_lines())
    dist.destroy_process_group()
    return {"tensor_freed": ref() is None, "works_alive": works, "events_made": events,
            "calls": 201}


def pyddp_api():
    """pyddp's own blocking call on a CUDA tensor: waited for on the host, then published
    on the caller's stream (the log), its errors raised at the call (a hang: the timeout)."""
    pyddp_init(timeout_s=float(os.environ.get("SCEN_TIMEOUT", "30")))
    x = tf.cuda(torch.arange(6.0))
    n0 = len(log_lines())
    t0 = time.monotonic()
    err = error(lambda: pyddp.all_reduce(x, op=pyddp.ReduceOp.MAX))
    out = {"log": log_lines()[n0:], "error": err, "seconds": time.monotonic() - t0,
           "kept": x.tolist()}
    if err is None:
        # the asynchronous call: submitted in C, its Work orders the caller's stream
        # after the collective when waited for
        n0 = len(log_lines())
        w = pyddp.all_reduce(x, op=pyddp.ReduceOp.MAX, async_op=True)
        out["async_work"] = type(w).__name__
        w.wait()
        out["async_log"] = log_lines()[n0:]
        # a CUDA tensor the lean path does not take (a non-contiguous view) goes to
        # the general path, which stages it and copies the result back
        view = tf.cuda(torch.arange(6.0).reshape(2, 3)).t()
        out["view_error"] = error(lambda: pyddp.all_reduce(view))
        out["view"] = view.tolist()
    return out


def values():
    """The lean path's results against NumPy on the arrays the fake writes (at world size
    1 the fake's all-reduce copies the input into the output buffer): a CUDA tensor that
    is a view into a larger buffer (offset, contiguous) is reduced in place, and only
    its own elements are touched."""
    torch_init()
    base = torch.arange(20, dtype=torch.float32)
    ref = base.numpy().copy()
    view = base[5:12]                          # contiguous, at an offset
    dist.all_reduce(tf.cuda(view))
    out = {"untouched": bool(np.array_equal(base.numpy(), ref))}
    n0 = len(log_lines())
    dist.all_reduce(tf.cuda(view))
    line = next(x for x in log_lines()[n0:] if x.startswith("ncclAllReduce"))
    out["send_is_view"] = f"send={hex(view.data_ptr())}" in line and "count=7" in line
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(globals()[sys.argv[1]]()), flush=True)
