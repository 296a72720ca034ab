"""The NCCL backend on machines without a GPU (runs in CI).

* Library discovery: the search order (PYDDP_NCCL_LIBRARY, the nvidia-nccl-cu13/cu12
  wheels, the system path; likewise the CUDA runtime) and the error that lists every
  path tried and why it was refused.
* The dtype and reduce-op tables against the values in nccl.h (the real nccl.h and
  libnccl.so.2 are tests/test_nccl_real.py's).
* backend=None falling back to the CPU backend with a debug log line; backend="nccl"
  failing at once with BackendUnavailableError.
* The whole NCCL path (loader, communicator set-up through the store, stream ordering,
  host staging, error and timeout handling) against test-double libraries built from
  tests/nccl_fake/*.c, in subprocesses since a loaded library stays loaded.
"""
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import pyddp
from pyddp import _C, _nccl_backend as nb

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from launch import ROOT, kill_group  # noqa: E402
from nccl_fake import build as fake_build  # noqa: E402

FAKE_SRC = os.path.join(HERE, "nccl_fake")
SCENARIOS = os.path.join(FAKE_SRC, "scenarios.py")

# nccl.h (NCCL 2.x): ncclDataType_t and ncclRedOp_t
NCCL_TYPES = {"int8": 0, "uint8": 1, "int32": 2, "int64": 4, "float16": 6, "float32": 7,
              "float64": 8, "bfloat16": 9}
NCCL_OPS = {"SUM": 0, "PRODUCT": 1, "MAX": 2, "MIN": 3, "AVG": 4}


@pytest.fixture(scope="module")
def fakes(tmp_path_factory):
    """Paths of the compiled test doubles: nccl, cudart, cudart_old (driver too old)."""
    if fake_build.compiler() is None:
        pytest.skip("no C compiler to build the fake NCCL/CUDA libraries")
    return fake_build.build(tmp_path_factory.mktemp("nccl_fake"))


def scenario(name, fakes, **env):
    """Run one scenario of tests/nccl_fake/scenarios.py with the fakes; its result dict."""
    return fake_build.scenario(SCENARIOS, name, fakes, timeout=90, **env)


def load(fakes, nccl, cudart, prefer_loaded=True, **env):
    cands = json.dumps({"nccl": nccl, "cudart": cudart, "prefer_loaded": prefer_loaded})
    return scenario("load_candidates", fakes, CANDIDATES=cands, **env)


# ---- discovery order (pure Python, no loading) ------------------------------------

def _fake_wheel(site_dir, dist, version, files):
    """An installed-looking distribution: dist-info with RECORD, and its files."""
    info = site_dir / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))
    for f in files:
        (site_dir / f).parent.mkdir(parents=True, exist_ok=True)
        (site_dir / f).write_bytes(b"")


def _only_site(sp, monkeypatch):
    """Make sp the only site-packages the search sees: the wheels really installed here
    (the test extra's nvidia-nccl-cu13 among them) are left out."""
    monkeypatch.syspath_prepend(str(sp))
    monkeypatch.setattr(nb, "site_dirs", lambda: [str(sp)])
    real = nb._wheel_files
    monkeypatch.setattr(nb, "_wheel_files", lambda dist, pattern: [
        f for f in real(dist, pattern) if f.startswith(str(sp) + os.sep)])


def test_nccl_search_order(tmp_path, monkeypatch):
    sp = tmp_path / "site-packages"
    _fake_wheel(sp, "nvidia-nccl-cu12", "2.21.5", ["nvidia/nccl/lib/libnccl.so.2"])
    _only_site(sp, monkeypatch)
    monkeypatch.setenv("PYDDP_NCCL_LIBRARY", str(tmp_path / "mine"))   # a folder...
    (tmp_path / "mine").mkdir()                                         # ...holding the lib
    cands = nb.nccl_candidates()
    assert cands[0] == (str(tmp_path / "mine" / "libnccl.so.2"), "PYDDP_NCCL_LIBRARY")
    assert cands[1] == (str(sp / "nvidia/nccl/lib/libnccl.so.2"), "nvidia-nccl-cu12 wheel")
    assert cands[-1] == ("libnccl.so.2", nb.SYSTEM)
    assert len(cands) == 3      # the wheel folder is not listed twice
    monkeypatch.setenv("PYDDP_NCCL_LIBRARY", "/opt/x/libnccl.so.2.19.3")   # a file
    assert nb.nccl_candidates()[0] == ("/opt/x/libnccl.so.2.19.3", "PYDDP_NCCL_LIBRARY")
    monkeypatch.delenv("PYDDP_NCCL_LIBRARY")
    assert nb.nccl_candidates()[0][1] == "nvidia-nccl-cu12 wheel"


def test_nccl_search_without_wheel_metadata(tmp_path, monkeypatch):
    monkeypatch.delenv("PYDDP_NCCL_LIBRARY", raising=False)
    monkeypatch.setattr(nb, "site_dirs", lambda: [str(tmp_path / "a"), str(tmp_path / "b")])
    monkeypatch.setattr(nb, "_wheel_files", lambda dist, pattern: [])
    assert nb.nccl_candidates() == [
        (str(tmp_path / "a/nvidia/nccl/lib/libnccl.so.2"), "nvidia-nccl-cu13/cu12 wheel folder"),
        (str(tmp_path / "b/nvidia/nccl/lib/libnccl.so.2"), "nvidia-nccl-cu13/cu12 wheel folder"),
        ("libnccl.so.2", nb.SYSTEM)]


def test_cudart_search_order(tmp_path, monkeypatch):
    sp = tmp_path / "site-packages"
    _fake_wheel(sp, "nvidia-cuda-runtime-cu12", "12.8.90",
                ["nvidia/cuda_runtime/lib/libcudart.so.12"])
    torch_lib = tmp_path / "torch" / "lib"
    torch_lib.mkdir(parents=True)
    (torch_lib / "libcudart-abc123.so.12").write_bytes(b"")
    _only_site(sp, monkeypatch)
    monkeypatch.setattr(nb, "_torch_lib_dir", lambda: str(torch_lib))
    monkeypatch.delenv("PYDDP_CUDART_LIBRARY", raising=False)
    monkeypatch.setenv("CUDA_HOME", "/opt/cuda")
    origins = [o for _, o in nb.cudart_candidates()]
    paths = [p for p, _ in nb.cudart_candidates()]
    assert paths[0] == str(sp / "nvidia/cuda_runtime/lib/libcudart.so.12")
    assert origins[0] == "nvidia-cuda-runtime-cu12 wheel"
    # the CUDA 13 wheel folder comes before CUDA 12's, then torch, system, toolkit
    assert paths[1] == str(sp / "nvidia/cu13/lib/libcudart.so.13")
    assert paths[2] == str(torch_lib / "libcudart-abc123.so.12")
    assert paths[3:5] == ["libcudart.so.13", "libcudart.so.12"]
    assert paths[5:7] == ["/opt/cuda/lib64/libcudart.so.13", "/opt/cuda/lib64/libcudart.so.12"]
    monkeypatch.setenv("PYDDP_CUDART_LIBRARY", "/x/libcudart.so.12")
    assert nb.cudart_candidates()[0] == ("/x/libcudart.so.12", "PYDDP_CUDART_LIBRARY")


# ---- the loader and its messages -------------------------------------------------

def test_error_lists_every_path_tried(fakes):
    nccl = [["/nonexistent/libnccl.so.2", "PYDDP_NCCL_LIBRARY"],
            [fakes["cudart"], "nvidia-nccl-cu12 wheel"],
            ["libnccl-pyddp-test-absent.so.2", nb.SYSTEM]]
    r = load(fakes, nccl, [[fakes["cudart"], "test"]])
    cls, msg = r["error"]
    assert cls == "BackendUnavailableError"
    assert "could not load NCCL (libnccl.so.2)" in msg
    lines = msg.splitlines()
    assert lines[1].startswith("  1. /nonexistent/libnccl.so.2 (PYDDP_NCCL_LIBRARY): ")
    assert "No such file" in lines[1]
    assert lines[2] == (f"  2. {fakes['cudart']} (nvidia-nccl-cu12 wheel): loaded, but it is "
                        f"not NCCL (no symbol ncclGetVersion)")
    assert lines[3].startswith(f"  3. libnccl-pyddp-test-absent.so.2 ({nb.SYSTEM}): ")
    assert "pip install nvidia-nccl-cu12" in msg and "PYDDP_NCCL_LIBRARY" in lines[-1]


def test_nccl_too_old_is_refused(fakes):
    r = load(fakes, [[fakes["nccl"], "test"]], [[fakes["cudart"], "test"]],
             FAKE_NCCL_VERSION=21100)
    assert "NCCL 2.11.0 is too old; pyddp needs NCCL 2.14 or newer" in r["error"][1]


def test_first_working_candidate_wins(fakes):
    r = load(fakes, [["/nonexistent/libnccl.so.2", "a"], [fakes["cudart"], "b"],
                     [fakes["nccl"], "c"]],
             [[fakes["cudart_old"], "old"], [fakes["cudart"], "good"]])
    info = r["info"]
    assert info["nccl_path"] == fakes["nccl"] and info["nccl_version"] == "2.20.5"
    assert info["cudart_path"] == fakes["cudart"]      # the too-new runtime was skipped
    assert info["device_count"] == 1 and info["device_error"] == ""


def test_runtime_too_new_for_driver(fakes):
    r = load(fakes, [[fakes["nccl"], "c"]], [[fakes["cudart_old"], "nvidia-cuda-runtime wheel"]])
    cls, msg = r["error"]
    assert cls == "BackendUnavailableError"
    assert f"1. {fakes['cudart_old']} (nvidia-cuda-runtime wheel): CUDA runtime 12.8 needs a " \
           f"newer driver (this driver supports CUDA 11.8)" in msg


def test_broken_env_library_falls_through_with_warning(fakes):
    r = scenario("fallback_warning", fakes, PYDDP_NCCL_LIBRARY="/nonexistent/libnccl.so.2",
                 GOOD_NCCL=fakes["nccl"])
    assert r["path"] == fakes["nccl"]
    assert any("PYDDP_NCCL_LIBRARY=/nonexistent/libnccl.so.2 could not be loaded" in w
               for w in r["warnings"])


def test_no_device_fails_before_rendezvous(fakes):
    r = scenario("no_device", fakes, FAKE_CUDA_DEVICES=0)
    assert r["usable"] is False and "error 100" in r["why"]
    cls, msg = r["init"]
    # BackendUnavailableError, not the missing-RANK error the rendezvous would raise
    assert cls == "BackendUnavailableError" and "needs a GPU" in msg and fakes["nccl"] in msg
    assert r["auto"] == "cpu"


@pytest.mark.parametrize("n,local_rank,expect", [(4, 2, 2), (1, 3, 0), (2, None, 0),
                                                 (4, 5, "LOCAL_RANK=5, but only 4")])
def test_cuda_device_for_local_rank(fakes, n, local_rank, expect):
    env = {"FAKE_CUDA_DEVICES": n}
    if local_rank is not None:
        env["LOCAL_RANK"] = local_rank
    else:
        env["LOCAL_RANK"] = ""
    r = scenario("devices", fakes, **env)
    if isinstance(expect, int):
        assert r == {"device": expect}
    else:
        assert expect in r["error"]


# ---- tables ----------------------------------------------------------------------

def test_dtype_and_op_tables_match_nccl_h():
    t = _C.nccl_tables()
    assert t["dtypes"] == dict(NCCL_TYPES, bool=NCCL_TYPES["uint8"])
    for (dt, op), code in t["ops"].items():
        if dt == "bool":
            # 0/1 bytes: SUM is logical or (MAX), PRODUCT logical and (MIN); no AVG
            assert code == {"SUM": 2, "PRODUCT": 3, "MIN": 3, "MAX": 2, "AVG": None}[op]
        else:
            assert code == NCCL_OPS[op], (dt, op)
    assert len(t["ops"]) == len(t["dtypes"]) * len(NCCL_OPS)


# ---- choosing the backend without a usable NCCL ------------------------------------

@pytest.fixture
def no_nccl(monkeypatch):
    if nb._info is not None:
        pytest.skip("a real NCCL is loaded in this process")
    monkeypatch.setattr(nb, "nccl_candidates",
                        lambda: [("/nonexistent/pyddp-test/libnccl.so.2", "PYDDP_NCCL_LIBRARY")])


def test_backend_none_falls_back_to_cpu_with_debug_log(no_nccl, caplog):
    caplog.set_level(logging.DEBUG, logger="pyddp")
    store = pyddp.TCPStore("127.0.0.1", 0, is_master=True)
    try:
        pyddp.init_process_group(None, store=store, rank=0, world_size=1)
        try:
            assert pyddp.get_backend() == "cpu"
        finally:
            pyddp.destroy_process_group()
    finally:
        store.close()
    recs = [r for r in caplog.records if "using the CPU backend" in r.getMessage()]
    assert recs and recs[0].levelno == logging.DEBUG
    assert "/nonexistent/pyddp-test/libnccl.so.2" in recs[0].getMessage()
    assert pyddp.is_nccl_available() is False


def test_backend_nccl_fails_at_once_naming_the_library(no_nccl, monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(pyddp.BackendUnavailableError) as ei:
        pyddp.init_process_group("nccl")     # no rendezvous settings: must not get there
    msg = str(ei.value)
    assert "backend='nccl' is unavailable" in msg and "libnccl.so.2" in msg
    assert "/nonexistent/pyddp-test/libnccl.so.2 (PYDDP_NCCL_LIBRARY)" in msg
    assert not pyddp.is_initialized()


# ---- the NCCL path end to end, against the test doubles ---------------------------

def test_collectives_through_fakes(fakes):
    r = scenario("collectives", fakes)
    for dt in ("float16", "float32", "float64", "int8", "uint8", "int32", "int64"):
        assert r[f"all_reduce_{dt}"], dt
    assert r["all_reduce_bool"] == [True, False, True]
    x = list(map(float, range(6)))
    assert r["all_gather"] == x and r["reduce_scatter"] == [2 * v for v in x]
    assert r["gather_host"] == [v + 1 for v in x] and r["scatter_host"] == [v + 2 for v in x]
    assert r["all_reduce_host"] == [0, 1, 2, 3, 4]
    assert r["all_gather_object"] == [{"rank": 0, "v": [1, 2]}]
    assert r["async"] == [True, True, True]
    assert r["bool_avg"][0] == "DistTypeError" and "AVG" in r["bool_avg"][1]
    assert r["mixed"][0] == "DistValueError"
    assert "must both be GPU arrays or both host arrays" in r["mixed"][1]
    assert r["device"] == 0
    log = r["log"]
    init = next(x for x in log if x.startswith("ncclCommInitRankConfig"))
    assert "nranks=1 rank=0 size=24 magic=cafebeef version=21400 blocking=0" in init
    comm = next(x for x in log if x.startswith("cudaStreamCreateWithFlags")).split()[1][7:]
    # float32 AVG: NCCL's own ncclAvg (4) on ncclFloat32 (7), on the comm stream
    assert any(x.startswith("ncclAllReduce") and "count=7 type=7 op=4" in x and
               x.endswith(f"stream={comm}") for x in log)
    assert any("ncclAllReduce" in x and "count=3 type=1 op=2" in x for x in log)  # bool SUM
    assert "ncclCommFinalize" in log and "ncclCommDestroy" in log
    assert "ncclCommAbort" not in log


def test_stream_ordering(fakes):
    """Producer's stream -> event -> comm stream waits -> NCCL -> done event -> the
    caller's stream waits for it at wait()."""
    log = scenario("collectives", fakes)["log"]
    caller = hex(0x5150)
    comm = next(x for x in log if x.startswith("cudaStreamCreateWithFlags")).split()[1][7:]
    i = log.index(next(x for x in log if x.startswith("ncclAllReduce")))
    rec_ready, wait_ready, call, rec_done, caller_wait = log[i - 2:i + 3]
    ready = rec_ready.split()[1]
    done = rec_done.split()[1]
    assert rec_ready == f"cudaEventRecord {ready} stream={caller}"
    assert wait_ready == f"cudaStreamWaitEvent stream={comm} {ready}"
    assert call.endswith(f"stream={comm}")
    assert rec_done == f"cudaEventRecord {done} stream={comm}"
    assert caller_wait == f"cudaStreamWaitEvent stream={caller} {done}"


def test_launches_in_progress_still_complete(fakes):
    r = scenario("collectives", fakes, FAKE_NCCL_INPROGRESS=1)
    assert r["all_reduce_float32"] and r["all_gather"] == list(map(float, range(6)))


def test_array_on_another_device_is_refused(fakes):
    r = scenario("wrong_device", fakes, FAKE_CUDA_DEVICES=2)
    for key in ("error", "a2a", "batch"):
        cls, msg = r[key]
        assert cls == "DistValueError", key
        assert "is on cuda:1, but this rank's NCCL process group uses cuda:0" in msg, key
    assert not any(x.startswith(("ncclGroupStart", "ncclSend", "ncclRecv")) for x in r["log"])


def _launch(log, rank_stream):
    """The calls of each grouped launch on the communicator stream rank_stream: a list
    of (what came before ncclGroupStart, the calls inside the group)."""
    out = []
    for i, x in enumerate(log):
        if x == "ncclGroupStart":
            j = log.index("ncclGroupEnd", i)
            inside = log[i + 1:j]
            if all(y.endswith(f"stream={rank_stream}") for y in inside) and (
                    inside or log[i - 1].endswith(f"stream={rank_stream}")):
                out.append((log[:i], inside))
    return out


def test_grouped_collectives_public_api(fakes):
    """all_to_all_single and batch_isend_irecv on GPU arrays at world size 1: results
    against NumPy (one rank: its own block comes back), the own block as a device copy
    between the producer-stream event and the completion event, and validation errors
    that enqueue nothing (a receive from any source among them)."""
    r = scenario("grouped_public", fakes)
    for dt in ("float16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool"):
        assert r[f"single_{dt}"], dt
    assert r["async"] == [True, list(range(10))]
    assert r["in_place"] == [float(v) for v in range(8)]
    cls, msg = r["own_split_mismatch"]
    assert cls == "CollectiveMismatchError"
    assert ("rank 0: all_to_all: rank 0 sends 3 elements to itself but expects 2 elements "
            "from itself") in msg
    cls, msg = r["overlap"]
    assert cls == "DistValueError" and "cannot run in place" in msg
    assert r["batch_self_send"] == ["DistValueError", "rank 0: batch_isend_irecv: op 0: rank 0 "
                                    "cannot send to itself"]
    assert r["batch_self_recv"][1].endswith("rank 0 cannot receive from itself")
    assert r["recv_any"][0] == "DistValueError" and \
        "NCCL can only receive from a named peer" in r["recv_any"][1]
    assert r["batch_peer_range"][0] == "DistValueError"
    assert r["enqueued_by_errors"] == 0 and r["after_errors"] == [0, 1, 2, 3]
    log = r["log"]
    comm = next(x for x in log if x.startswith("cudaStreamCreateWithFlags")).split()[1][7:]
    caller = hex(0x5150)
    # float16 6 x 3 first: ready event on the caller's stream, the comm stream waits, the
    # own block (36 bytes) is copied there, an (empty) NCCL group, the completion event,
    # and at wait() the caller's stream waits for it
    i = log.index("ncclGroupStart")
    rec_ready, wait_ready, copy, start, end, rec_done, caller_wait = log[i - 3:i + 4]
    ready, done = rec_ready.split()[1], rec_done.split()[1]
    assert rec_ready == f"cudaEventRecord {ready} stream={caller}"
    assert wait_ready == f"cudaStreamWaitEvent stream={comm} {ready}"
    assert copy == f"cudaMemcpyAsync bytes=36 stream={comm}"
    assert (start, end) == ("ncclGroupStart", "ncclGroupEnd")
    assert rec_done == f"cudaEventRecord {done} stream={comm}"
    assert caller_wait == f"cudaStreamWaitEvent stream={caller} {done}"
    # nothing goes through NCCL to oneself; 12 all_to_alls, the empty one copies nothing
    assert not any(x.startswith(("ncclSend", "ncclRecv")) for x in log)
    assert log.count("ncclGroupStart") == 12 == log.count("ncclGroupEnd")
    assert sum(x.startswith("cudaMemcpyAsync") for x in log) == 11
    assert "ncclCommAbort" not in log


@pytest.mark.parametrize("env", [{}, {"FAKE_NCCL_INPROGRESS": 1}])
def test_grouped_send_recv_between_two_ranks(fakes, env):
    """Two ranks' NCCL communicators in one process (the fake moves ncclSend/ncclRecv
    data between them): all_to_all with uneven splits and displacements, a batch with
    mixed dtypes, against NumPy; each launch is one group of sends and receives on the
    communicator's stream, after the producer stream; errors enqueue nothing."""
    r = scenario("grouped_pair", fakes, **env)
    assert r["a2a_wait"] == [True, True] and r["a2a"] == [True, True]
    assert r["batch_wait"] == [True, True] and r["batch"] == [True, True, True]
    log = r["a2a_log"]
    s0, s1 = [x.split()[2][7:] for x in log if x.startswith("cudaMemcpyAsync")]
    (before0, in0), = _launch(log, s0)
    (before1, in1), = _launch(log, s1)
    # S = [[2, 3], [4, 1]]: rank 0 keeps 2 (8 bytes), sends 3, receives 4; rank 1 keeps 1
    assert in0 == [f"ncclSend count=3 type=7 peer=1 rank=0 stream={s0}",
                   f"ncclRecv count=4 type=7 peer=1 rank=0 stream={s0}"]
    assert in1 == [f"ncclSend count=4 type=7 peer=0 rank=1 stream={s1}",
                   f"ncclRecv count=3 type=7 peer=0 rank=1 stream={s1}"]
    rec, wait, copy = before0[-3:]
    assert rec.startswith("cudaEventRecord") and rec.endswith(f"stream={hex(0x5150)}")
    assert wait == f"cudaStreamWaitEvent stream={s0} {rec.split()[1]}"
    assert copy == f"cudaMemcpyAsync bytes=8 stream={s0}"
    assert before1[-1] == f"cudaMemcpyAsync bytes=4 stream={s1}"
    log = r["batch_log"]
    (before0, in0), = _launch(log, s0)
    (_, in1), = _launch(log, s1)
    # batch order kept, one call per op with its own dtype (float32 7, int64 4, int8 0),
    # the empty op skipped on both sides
    assert in0 == [f"ncclSend count=5 type=7 peer=1 rank=0 stream={s0}",
                   f"ncclRecv count=4 type=4 peer=1 rank=0 stream={s0}",
                   f"ncclSend count=3 type=0 peer=1 rank=0 stream={s0}"]
    assert in1 == [f"ncclRecv count=5 type=7 peer=0 rank=1 stream={s1}",
                   f"ncclSend count=4 type=4 peer=0 rank=1 stream={s1}",
                   f"ncclRecv count=3 type=0 peer=0 rank=1 stream={s1}"]
    assert before0[-2].endswith(f"stream={hex(0x5150)}")   # rank 0 passed a stream
    assert not any("size mismatch" in x for x in r["a2a_log"] + log)
    e = r["errors"]
    assert e["peer_range"] == ["DistValueError", "rank 0: batch_isend_irecv: op 0: peer 2 is "
                               "out of range for a group of 2 ranks (valid: 0..1)"]
    assert e["peer_negative"][0] == "DistValueError" and "peer -1 is out of range" in \
        e["peer_negative"][1]
    assert e["self"] == ["DistValueError", "rank 0: batch_isend_irecv: op 1: rank 0 cannot "
                         "receive from itself"]
    assert e["own_block"][0] == "CollectiveMismatchError"
    assert "rank 0 sends 1 elements to itself but expects 2" in e["own_block"][1]
    assert e["overlap"][0] == "DistValueError" and "overlap" in e["overlap"][1]
    assert r["enqueued_by_errors"] == 0


@pytest.mark.parametrize("where", ["FAKE_CUDA_HANG", "FAKE_NCCL_LAUNCH_HANG"])
def test_grouped_timeout_aborts_and_says_what_must_agree(fakes, where):
    r = scenario("a2a_hang", fakes, **{where: 1})
    cls, msg = r["error"]
    assert cls == "DistTimeoutError"
    assert "NCCL all_to_all #1 (6 x float32 sent, 6 received) on rank 0 (cuda:0)" in msg
    if where == "FAKE_CUDA_HANG":
        assert "did not complete within its timeout of 1.0 s" in msg
        assert "rank p's input split for rank q must equal rank q's output split" in msg
    else:
        assert "NCCL did not finish launching it before the timeout" in msg
    assert 0.9 < r["seconds"] < 30 and "ncclCommAbort" in r["log"]


def test_async_error_aborts_and_names_rank_and_op(fakes):
    r = scenario("async_error", fakes, FAKE_NCCL_ASYNC_ERROR_AT=2)
    cls, msg = r["second"]
    assert cls == "DistNetworkError"
    assert "NCCL all_reduce #2 (4 x float32) on rank 0 (cuda:0)" in msg
    assert "remote process exited" in msg and "Another rank probably failed" in msg
    assert r["log"].count("ncclCommAbort") == 1
    assert r["third"][0] == "DistNetworkError" and "#2" in r["third"][1]   # broken for good
    assert r["third_s"] < 5


def test_timeout_aborts_and_raises(fakes):
    r = scenario("hang", fakes, FAKE_CUDA_HANG=1)
    cls, msg = r["error"]
    assert cls == "DistTimeoutError"
    assert ("NCCL all_reduce #1 (4 x float32) on rank 0 (cuda:0) did not complete within its "
            "timeout of 1.0 s") in msg
    assert "same collectives in the same order" in msg
    assert 0.9 < r["seconds"] < 30
    assert "ncclCommAbort" in r["log"]
    assert r["after"][0] == "DistTimeoutError"


def test_launch_that_never_finishes_times_out(fakes):
    r = scenario("hang", fakes, FAKE_NCCL_LAUNCH_HANG=1)
    cls, msg = r["error"]
    assert cls == "DistTimeoutError"
    assert "NCCL all_reduce #1 (4 x float32) on rank 0 (cuda:0): NCCL did not finish " \
           "launching it before the timeout" in msg
    assert 0.9 < r["seconds"] < 30 and "ncclCommAbort" in r["log"]


def test_setup_timeout_aborts(fakes):
    r = scenario("init_hang", fakes, FAKE_NCCL_INIT_HANG=1)
    cls, msg = r["error"]
    assert cls == "DistTimeoutError"
    assert "rank 0: NCCL communicator set-up on cuda:0 did not finish" in msg
    assert "NCCL_SOCKET_IFNAME" in msg
    assert r["seconds"] < 30 and "ncclCommAbort" in r["log"]


def test_unique_id_failure(fakes):
    cls, msg = scenario("uid_fail", fakes, FAKE_NCCL_UID_FAIL=1)["error"]
    assert "ncclGetUniqueId failed" in msg and "NCCL_SOCKET_IFNAME" in msg


def test_version_mismatch_between_ranks(fakes):
    r = scenario("versions", fakes)
    cls, msg = r["nccl"]
    assert cls == "VersionMismatchError"
    assert "rank 1 uses NCCL 2.21.5 but rank 0 uses NCCL 2.20.5" in msg
    cls, msg = r["pyddp"]
    assert cls == "VersionMismatchError" and "rank 1 runs pyddp 0.0.1" in msg


def test_wait_after_clean_destroy(fakes):
    r = scenario("wait_after_destroy", fakes)
    assert r["wait"] is None
    assert r["after"][0] == "DistError" and "not initialized" in r["after"][1]


@pytest.mark.parametrize("where,op", [("FAKE_CUDA_HANG", "all_reduce"),
                                      ("FAKE_NCCL_LAUNCH_HANG", "all_reduce"),
                                      ("FAKE_CUDA_HANG", "all_to_all"),
                                      ("FAKE_NCCL_LAUNCH_HANG", "all_to_all")])
def test_ctrl_c_aborts_a_hung_collective(fakes, where, op):
    """Ctrl-C while waiting for the GPU, or while NCCL is still launching (for
    all_to_all: a grouped send/recv launch, with the GIL released)."""
    if os.path.exists(fakes["log"]):
        os.unlink(fakes["log"])
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1",
               PYDDP_NCCL_LIBRARY=fakes["nccl"], PYDDP_CUDART_LIBRARY=fakes["cudart"],
               FAKE_LOG=fakes["log"], SCEN_OP=op)
    env[where] = "1"
    p = subprocess.Popen([sys.executable, SCENARIOS, "interrupt"], env=env, cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        ready, _, _ = select.select([p.stdout], [], [], 60)
        assert ready and p.stdout.readline().strip() == "READY"
        time.sleep(0.5)
        os.kill(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        kill_group(p.pid)
    lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and lines, out + err
    r = json.loads(lines[-1][len("RESULT "):])
    assert r["got"] == "KeyboardInterrupt" and r["seconds"] < 30
    assert "ncclCommAbort" in r["log"]
    assert r["after"][0] == "DistBackendError" and "interrupted" in r["after"][1]


def test_elastic_in_place_rebuilds_the_nccl_communicator(fakes, tmp_path):
    """pyddp.elastic on the NCCL path: rank 2 of 3 dies; the survivors abort their
    communicator, set up one of 2 ranks through the new group's store keys, roll back to
    their last commit and finish with identical parameters (the host gradients' sum
    over the 2 survivors from then on, checked against NumPy)."""
    from launch import free_port
    port = free_port()
    procs = []
    for r in range(3):
        env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1",
                   PYDDP_NCCL_LIBRARY=fakes["nccl"], PYDDP_CUDART_LIBRARY=fakes["cudart"],
                   FAKE_LOG=str(tmp_path / f"log{r}"), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE="3", LOCAL_RANK="0",
                   PYDDP_ELASTIC_SETTLE_S="0.5")
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "workers",
                                                                    "elastic_nccl.py")],
                                      env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    try:
        outs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            kill_group(p.pid)
    assert procs[2].returncode == 1
    results = []
    for r in (0, 1):
        assert procs[r].returncode == 0, outs[r][-3000:]
        line = [x for x in outs[r].splitlines() if x.startswith("RESULT ")][-1]
        results.append(json.loads(line[len("RESULT "):]))
    # reference: steps 0..5 at world 3 (step 5 is cut short and rolled back to the
    # commit after step 3, so 3..5 run again at world 2), then to 12 at world 2
    w = np.zeros(16)
    for step in range(12):
        world = 3 if step < 3 else 2
        g = np.arange(16, dtype=np.float64) * (step + 1)
        w -= 0.01 * (g * world) / world            # the sum over ranks / world size
    for res in results:
        assert res["world"] == 2 and res["step"] == 12
        assert len(set(res["digests"])) == 1, res
        assert np.array_equal(np.array(res["w"]), w), (res["w"], w.tolist())
        assert [x.split()[1] for x in res["inits"]] == ["nranks=3", "nranks=2"], res["inits"]
        assert res["aborts"] >= 1
