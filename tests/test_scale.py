"""Links on first use at the Python level: a 12-rank job (ranks forked from this process,
every pair on TCP) trains examples/numpy_mlp.py's model with pyddp's DDP for a few
steps and must end with the weights of one process training on the full batch; its
collectives (all_reduce, broadcast, reduce, all_gather, barrier) match arithmetic; and
each rank holds at most 16 sockets (store connections, its data port, its links) with
links to fewer than all of its 11 peers. The store serves O(N) requests for the
rendezvous (benchmarks/scale.py measures the same up to 1,024 ranks)."""
import json
import multiprocessing as mp
import os
import sys
import time
from argparse import Namespace

import numpy as np

import pyddp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 12


def _sockets():
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


def _rank(rank, port, wfd):
    """One rank (a forked child): report a JSON line on wfd, exit 0."""
    out = {"rank": rank}
    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(N), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                          TORCHELASTIC_USE_AGENT_STORE="True", PYDDP_SHM_DISABLE="1")
        sys.path.insert(0, os.path.join(ROOT, "examples"))
        import numpy_mlp as m
        base = _sockets()
        pyddp.init_process_group("cpu")
        from pyddp import _group
        pg = _group.default_pg()
        x, y = m.make_data(1024, 20, 5, seed=1)
        model = m.MLP(20, 64, 5, seed=100 + rank)
        ddp = m.DDP(model, bucket_cap_mb=0.01)
        args = Namespace(steps=3, batch=96, accum=1, lr=0.5, bucket_cap_mb=0.01)
        m.train(model, ddp, x, y, args, rank, N)
        if rank == 0:
            ref = m.MLP(20, 64, 5, seed=100)
            m.train(ref, None, x, y, args, 0, 1)
            out["diff"] = max(float(np.abs(a.data - b.data).max()) for (_, a), (_, b) in
                              zip(model.named_parameters(), ref.named_parameters()))
        a = np.array([float(rank), 1.0])
        pyddp.all_reduce(a)
        b = np.full(3, float(rank))
        pyddp.broadcast(b, src=5)
        r = np.array([rank], dtype=np.int64)
        pyddp.reduce(r, dst=7)
        g = [np.zeros(2) for _ in range(N)]
        pyddp.all_gather(g, np.array([rank, rank * rank], dtype=np.float64))
        pyddp.barrier()
        out["ok"] = (a.tolist() == [N * (N - 1) / 2, N] and b.tolist() == [5.0] * 3 and
                     (rank != 7 or int(r[0]) == N * (N - 1) // 2) and
                     all(g[q].tolist() == [q, q * q] for q in range(N)))
        out["sockets"] = _sockets() - base
        out["links"] = sum(pg.transport(q) != "none" for q in range(N) if q != rank)
        pyddp.destroy_process_group()
    except BaseException as e:   # reported, never raised into the forked pytest
        out["error"] = f"{type(e).__name__}: {e}"
    os.write(wfd, (json.dumps(out) + "\n").encode())
    os.close(wfd)
    os._exit(0)


def test_twelve_ranks_hold_few_links_and_train_like_one_process():
    store = pyddp.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    rfd, wfd = os.pipe()
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_rank, args=(r, store.port, wfd)) for r in range(N)]
    try:
        for p in procs:
            p.start()
        os.close(wfd)
        deadline, buf = time.monotonic() + 150, b""
        while buf.count(b"\n") < N and time.monotonic() < deadline:
            os.set_blocking(rfd, False)
            try:
                chunk = os.read(rfd, 65536)
            except BlockingIOError:
                time.sleep(0.05)
                continue
            if not chunk:
                break
            buf += chunk
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs:          # by pid, whatever happened
            if p.is_alive():
                os.kill(p.pid, 9)
                p.join(5)
        os.close(rfd)
        store.close()
    res = {d["rank"]: d for d in map(json.loads, buf.decode().splitlines())}
    assert sorted(res) == list(range(N)), buf.decode()[-3000:]
    for r, d in res.items():
        assert "error" not in d, d
        assert d["ok"], d
        assert d["sockets"] <= 16, d
        assert 2 <= d["links"] < N - 1, d
    assert res[0]["diff"] < 1e-9, res[0]
