"""The lean CUDA-tensor path on machines without a GPU (runs in CI): torch's API over
backend "pyddp" and pyddp's own API on a CUDA tensor, in one C call each
(csrc/py/py_torch_cuda.c, pyddp/torch_backend/_cuda.py), against the test-double NCCL
and CUDA libraries of tests/nccl_fake and a CPU tensor that says it is on cuda:0
(tests/nccl_fake/torch_fakes.py). Scenarios run in subprocesses (a loaded NCCL stays
loaded), tests/nccl_fake/lean_scenarios.py.

* Every call makes the NCCL call its arguments ask for (kind, dtype, op, root, count,
  the tensor's own address) between the two stream orderings: after the caller's
  stream, and, for torch's blocking call, the caller's stream after it at once.
* torch's asynchronous call returns a torch Work whose future is made only when asked,
  completed, with the tensors as its value; wait() orders the stream without waiting.
* Failures: a hung collective returns at once and is aborted at the group's timeout by
  pyddp's completion thread, which the Work, its future and the next call report; an
  asynchronous NCCL error likewise; pyddp's own blocking call raises at the call.
* Nothing is kept: the tensor, the Works and the events are let go of or reused.
* The cost cannot grow back unnoticed: the Python functions and C calls one collective
  makes are counted (sys.setprofile), not timed: torch's API adds exactly two Python
  frames of pyddp's (the group's method and its ``_in_c``) and one C call to torch's
  own wrapper, the same as on a CPU tensor, with no future, DLPack capsule or stream
  object made; pyddp's own call stays within its few frames.
"""
import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from nccl_fake import build as fake_build  # noqa: E402

SCENARIOS = os.path.join(HERE, "nccl_fake", "lean_scenarios.py")
CALLER = hex(0x5150)      # torch_fakes.CALLER_STREAM
# nccl.h's ncclDataType_t and ncclRedOp_t
NC_TYPE = {"f32": 7, "f64": 8, "f16": 6, "bf16": 9, "i32": 2, "i64": 4, "u8": 1, "i8": 0,
           "bool": 1}
NC_OP = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def fakes(tmp_path_factory):
    if fake_build.compiler() is None:
        pytest.skip("no C compiler to build the fake NCCL/CUDA libraries")
    return fake_build.build(tmp_path_factory.mktemp("nccl_fake_lean"))


def scenario(name, fakes, **env):
    return fake_build.scenario(SCENARIOS, name, fakes, **env)


def _ordered(log, nccl_prefix, published):
    """The one launch in log: the caller's stream recorded, the communicator's stream
    waiting for it, the NCCL call (nccl_prefix), the completion event recorded on the
    communicator's stream and, when published, the caller's stream waiting for it."""
    i = next(k for k, x in enumerate(log) if x.startswith(nccl_prefix))
    rec_ready, wait_ready = log[i - 2], log[i - 1]
    ready = rec_ready.split()[1]
    comm = wait_ready.split()[1]
    assert rec_ready == f"cudaEventRecord {ready} stream={CALLER}", log
    assert wait_ready == f"cudaStreamWaitEvent {comm} {ready}", log
    assert log[i].endswith(comm), log
    rec_done = log[i + 1]
    assert rec_done.startswith("cudaEventRecord ") and rec_done.endswith(comm), log
    done = rec_done.split()[1]
    tail = log[i + 2:]
    assert tail == ([f"cudaStreamWaitEvent stream={CALLER} {done}"] if published else []), log
    return log[i]


def test_each_call_makes_its_nccl_call_between_the_stream_orderings(fakes):
    r = scenario("calls", fakes)
    for name, res in r.items():
        assert res["kept"], name       # world size 1: every collective is the identity
        async_ = name == "async"
        assert res["returned"] == ("CudaWork" if async_ else "NoneType"), name
        if name in ("broadcast", "reduce"):
            call = _ordered(res["log"], "ncclBroadcast" if name == "broadcast"
                            else "ncclReduce", True)
            assert "count=13 type=7" in call and "root=0" in call, call
            assert name == "broadcast" or " op=0 " in call, call
            continue
        call = _ordered(res["log"], "ncclAllReduce", not async_)
        dt, _, op = name.partition("_")
        op = "sum" if name == "async" else op
        dt = "f32" if name == "async" else dt
        want_op = NC_OP["max"] if dt == "bool" else NC_OP[op]   # bool SUM is logical or
        assert f"count=13 type={NC_TYPE[dt]} op={want_op} " in call, (name, call)
        send = call.split()[1]
        assert call.split()[2] == "recv=" + send[len("send="):], call   # in place


def test_the_tensor_is_passed_by_its_own_address(fakes):
    r = scenario("values", fakes)
    assert r == {"untouched": True, "send_is_view": True}


def test_async_work_and_its_future(fakes):
    r = scenario("async_work", fakes)
    assert r["type"] == "CudaWork" and r["is_work"]
    assert r["future_before"]                       # no future until asked for
    assert r["future_done"] and r["value_is_tensor"] and r["same_future"]
    assert r["then"] == [2.0 * v for v in range(8)]
    assert r["wait"] is True and r["completed"] and r["exception"] and r["success"]
    assert r["result"]


def test_hung_collective_returns_then_fails_at_the_timeout(fakes):
    r = scenario("hang", fakes, FAKE_CUDA_HANG=1)
    assert r["returned_s"] < 0.5            # torch's calls return once queued
    assert r["wait"] is True and not r["completed_before"]
    # wait() orders the caller's stream after the collective and nothing more
    assert len(r["wait_log"]) == 1 and r["wait_log"][0].startswith(
        f"cudaStreamWaitEvent stream={CALLER} ")
    assert 0.9 < r["completed_s"] < 15 and r["completed"]
    assert r["aborts"] == 1
    for key in ("exception", "wait_after", "next_call", "future"):
        cls, msg, mro = r[key]
        assert cls == "DistTimeoutError", key
        assert "DistBackendError" in mro and "TimeoutError" in mro, (key, mro)   # torch's
        assert ("NCCL all_reduce #1 (4 x float32) on rank 0 (cuda:0) did not complete "
                "within its timeout of 1.0 s") in msg, (key, msg)
    assert r["next_call"][1].startswith("NCCL all_reduce #3 ")


def test_asynchronous_nccl_error_reaches_the_next_call(fakes):
    r = scenario("async_error", fakes, FAKE_NCCL_ASYNC_ERROR_AT=2)
    cls, msg, mro = r["third"]
    assert cls == "DistNetworkError" and "DistNetworkError" in mro
    assert msg.startswith("NCCL all_reduce #3 ") and "remote process exited" in msg
    assert r["aborts"] == 1


def test_nothing_is_kept_and_events_are_reused(fakes):
    r = scenario("release", fakes)
    assert r["tensor_freed"] and r["works_alive"] == 0
    # one event per call without the pool; with it, about one per call in flight at once
    assert r["events_made"] <= 40 < r["calls"], r


def test_pyddp_own_call_waits_then_publishes(fakes):
    r = scenario("pyddp_api", fakes)
    assert r["error"] is None and r["kept"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    call = _ordered([x for x in r["log"] if not x.startswith("cudaEventCreate")],
                    "ncclAllReduce", True)
    assert "count=6 type=7 op=2 " in call
    assert r["async_work"] == "Work"
    call = _ordered([x for x in r["async_log"] if not x.startswith("cudaEventCreate")],
                    "ncclAllReduce", True)
    assert "count=6 type=7 op=2 " in call
    assert r["view_error"] is None and r["view"] == [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]


def test_pyddp_own_call_raises_its_timeout_at_the_call(fakes):
    r = scenario("pyddp_api", fakes, FAKE_CUDA_HANG=1, SCEN_TIMEOUT=1)
    cls, msg, _ = r["error"]
    assert cls == "DistTimeoutError" and "did not complete within its timeout of 1.0 s" in msg
    assert 0.9 < r["seconds"] < 15 and "ncclCommAbort" in r["log"]


def _frames(r, case):
    return r[case]["pyddp"], r[case]["c_from_pyddp"]


def test_python_calls_per_collective(fakes):
    """The regression guard of the lean path: what one collective costs in Python."""
    r = scenario("counts", fakes)
    for case in ("torch_sync", "torch_async"):
        py, c = _frames(r, case)
        assert py == {"torch_backend._pg:allreduce": 1, "torch_backend._pg:_in_c": 1}, \
            (case, py)
        assert c == {"ProcessGroup.torch_run": 1}, (case, c)
        # torch's own part is its wrapper's, the same as for a CPU tensor: no future,
        # stream or device object made, no DLPack capsule
        assert r[case]["torch"] == r["cpu_sync"]["torch"], (case, r[case]["torch"])
        assert r[case]["other"] == r["cpu_sync"]["other"]
    py, c = _frames(r, "torch_broadcast")
    assert py == {"torch_backend._pg:broadcast": 1, "torch_backend._pg:_in_c": 1} and \
        c == {"ProcessGroup.torch_run": 1}, (py, c)
    # the CPU tensor's asynchronous call still makes its future at once (the reference)
    assert any(k.startswith("futures") for k in r["cpu_async"]["torch"]), r["cpu_async"]
    py, c = _frames(r, "pyddp_sync")
    assert sum(py.values()) <= 6 and not any("Work" in k or "Staged" in k or
                                             "caller_stream" in k for k in py), py
    assert c == {"torch_cuda_type": 1, "ProcessGroup.run": 1}, c
    assert r["pyddp_sync"]["torch"] == {}, r["pyddp_sync"]
    py, c = _frames(r, "pyddp_async")     # submitted in C, one pyddp Work made
    assert sum(py.values()) <= 6 and not any("Staged" in k or "caller_stream" in k
                                             for k in py), py
    assert c == {"torch_cuda_type": 1, "ProcessGroup.run_async": 1}, c
    assert r["pyddp_async"]["torch"] == {}, r["pyddp_async"]
