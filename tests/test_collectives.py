"""Every collective, dtype and op against NumPy, at world sizes 1 to 4, under stock
torchrun (c10d/standalone and static forms, single- and multi-node) and under plain
environment variables. The checking happens in tests/workers/collectives.py."""
import os
import re

import pytest

from launch import PY, ROOT, WORKERS, free_port, run, spawn_ranks, torchrun


def assert_pass(res, ws):
    out = res.output
    assert res.returncode == 0, out[-6000:]
    passed = re.findall(r"rank (\d+): PASS (\d+) checks", out)
    assert sorted(int(r) for r, _ in passed) == list(range(ws)), out[-4000:]
    assert all(int(n) > 100 for _, n in passed), passed


@pytest.mark.parametrize("ws", [1, 2, 3, 4])
def test_torchrun_standalone(ws):
    """torchrun --standalone: the c10d form on a free port; workers use the agent's store."""
    assert_pass(torchrun("collectives.py", ws, timeout=240), ws)


def test_torchrun_static_form():
    """--nnodes --node_rank --master_addr --master_port: the agent of node 0 hosts the
    store at exactly MASTER_ADDR:MASTER_PORT; workers must connect, never bind it."""
    port = free_port()
    res = torchrun("collectives.py", 2, standalone=False, timeout=180,
                   extra=["--nnodes=1", "--node_rank=0", "--master_addr=127.0.0.1",
                          f"--master_port={port}"])
    assert_pass(res, 2)


def _two_nodes(extra_for_node, nproc=1, timeout=180):
    """Two torchrun agents on this host acting as two nodes."""
    import subprocess
    procs = []
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    try:
        for node in (0, 1):
            cmd = [PY, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"] + \
                extra_for_node(node) + [os.path.join(WORKERS, "collectives.py")]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True))
        outs = []
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append((p.returncode, out))
        return outs
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, 9)
            except ProcessLookupError:
                pass


def test_two_nodes_static_form():
    port = free_port()
    outs = _two_nodes(lambda n: ["--nnodes=2", f"--node_rank={n}", "--master_addr=127.0.0.1",
                                 f"--master_port={port}"])
    for rc, out in outs:
        assert rc == 0, out[-4000:]
    text = "".join(o for _, o in outs)
    assert len(re.findall(r"PASS \d+ checks", text)) == 2, text[-3000:]


def test_two_nodes_c10d_rendezvous():
    """--rdzv-backend=c10d --rdzv-endpoint: the second launch form of the docs."""
    port = free_port()
    outs = _two_nodes(lambda n: ["--nnodes=2", "--rdzv-backend=c10d",
                                 f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=job7"],
                      nproc=2, timeout=240)
    for rc, out in outs:
        assert rc == 0, out[-4000:]
    text = "".join(o for _, o in outs)
    assert len(re.findall(r"PASS \d+ checks", text)) == 4, text[-3000:]


def test_torchrun_without_shared_agent_store():
    """TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: USE_AGENT_STORE=False, rank 0 hosts."""
    res = torchrun("collectives.py", 2, env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
                   timeout=180)
    assert_pass(res, 2)


def test_plain_env_vars_without_torch():
    """No torchrun: RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT only, rank 0 hosts the
    store; the worker never imports torch (pyddp must not either)."""
    results = spawn_ranks("collectives.py", 3, args=["--no-torch"], timeout=240)
    for r in results:
        assert r.returncode == 0, r.output[-4000:]
    assert len(re.findall(r"PASS \d+ checks", "".join(r.output for r in results))) == 3


def test_deprecated_launch_passes_local_rank():
    """python -m torch.distributed.launch appends --local-rank=N to the arguments."""
    port = free_port()
    res = run([PY, "-m", "torch.distributed.launch", "--nproc_per_node=2",
               f"--master_port={port}", os.path.join(WORKERS, "collectives.py"),
               "--no-torch"], timeout=240)
    assert_pass(res, 2)
