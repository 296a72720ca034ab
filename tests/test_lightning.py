"""PyTorch Lightning on the pyddp backend: Trainer(strategy="ddp_pyddp") fits, validates,
tests and checkpoints exactly as Lightning's stock "ddp" (gloo on CPU) does, under
torchrun and under Lightning's own launcher (plain `python train.py`, devices=2): same
final weights, same logged metrics (sync_dist means, an integer mean, a max), the same
injected DistributedSampler, and a checkpoint that restores the trained weights. The
runs happen in tests/workers/lightning_fit.py, both strategies in the same processes;
the integer AVG that Lightning sends to non-gloo backends must have reached pyddp.
`import pyddp.lightning` registers "ddp_pyddp" in every installed Lightning package."""
import json
import os
import re

import pytest

from launch import PY, WORKERS, run, torchrun

pytest.importorskip("pytorch_lightning")


def _results(res):
    assert res.returncode == 0, res.output[-6000:]
    rows = [json.loads(m) for m in re.findall(r"^RESULT (.*)$", res.stdout, re.M)]
    assert [r["strategy"] for r in rows] == ["ddp", "ddp_pyddp"], res.output[-4000:]
    return rows


def _same_run(gloo, ours):
    assert gloo["backend"] == "gloo" and ours["backend"] == "pyddp"
    assert gloo["world"] == ours["world"] == 2
    assert ours["weights"] == gloo["weights"]          # two ranks: sums are order-free
    assert ours["metrics"] == gloo["metrics"] and set(ours["metrics"]) >= {
        "train_loss_epoch", "val_loss", "rank_code"}
    assert ours["test"] == gloo["test"] and set(ours["test"]) == {"test_loss", "test_abs"}
    assert ours["sampler"] == gloo["sampler"] == "DistributedSampler"
    assert ours["checkpoint_round_trip"] and gloo["checkpoint_round_trip"]
    # the registered name builds Lightning's own DDPStrategy, in every Lightning installed
    assert ours["strategy_class"] == gloo["strategy_class"] == "DDPStrategy"
    assert "pytorch_lightning" in ours["registered_in"], ours["registered_in"]
    # Lightning averages its int64 batch-size counter with ReduceOp.AVG on non-gloo
    kinds = {tuple(k) for k in ours["allreduce_kinds"]}
    assert ("torch.int64", "RedOpType.AVG") in kinds, kinds
    assert ("torch.float32", "RedOpType.AVG") in kinds, kinds


def test_lightning_under_torchrun(tmp_path):
    res = torchrun("lightning_fit.py", 2, args=["--out", str(tmp_path)], timeout=240)
    gloo, ours = _results(res)
    _same_run(gloo, ours)
    assert (tmp_path / "ddp_pyddp" / "last.ckpt").exists()


def test_lightning_own_launcher(tmp_path):
    env = {"PYTHONPATH": os.pathsep.join([WORKERS, os.environ.get("PYTHONPATH", "")])}
    res = run([PY, os.path.join(WORKERS, "lightning_fit.py"), "--devices", "2", "--out",
               str(tmp_path)], env=env, timeout=240)
    gloo, ours = _results(res)
    _same_run(gloo, ours)


def test_lightning_example_under_torchrun(tmp_path):
    """examples/lightning_train.py under the README's torchrun line."""
    from launch import ROOT
    res = torchrun(f"{ROOT}/examples/lightning_train.py", 2,
                   args=["--epochs", "2", "--checkpoint-dir", str(tmp_path)], timeout=240)
    assert res.returncode == 0, res.output[-4000:]
    m = re.search(r"strategy ddp_pyddp on 2 ranks: train_loss (\S+), val_acc (\S+), "
                  r"test_acc (\S+), checkpoint (\S+), global step \d+", res.stdout)
    assert m, res.output[-3000:]
    assert float(m.group(3)) > 0.9 and os.path.exists(m.group(4)), m.group(0)


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_lightning_example_across_two_hosts(tmp_path):
    """examples/lightning_train.py on two "hosts" (network namespaces), one torchrun per
    node in the static multi-node form: Lightning accepts the world size (num_nodes
    from torchrun's variables), trains on both, and rank 0 writes the checkpoint into
    its own node's directory (no shared storage)."""
    import subprocess
    import sys
    from launch import ROOT, free_port, kill_group
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from netns import NetnsUnavailable, exec_prefix, two_hosts
    def job(hosts, *args):
        port, procs = free_port(), []
        try:
            for i, h in enumerate(hosts):
                # node 1 cannot see node 0's directory (an empty tmpfs over it, in a mount
                # namespace of its own), as without shared storage
                hide = [] if i == 0 else [
                    "unshare", "-m", "sh", "-c",
                    f'mount -t tmpfs none {tmp_path / "node0"} && exec "$0" "$@"']
                cmd = exec_prefix(h.ns) + hide + [
                    PY, "-m", "torch.distributed.run", "--nproc_per_node=1", "--nnodes=2",
                    f"--node_rank={i}", f"--master_addr={hosts[0].addr}",
                    f"--master_port={port}", f"{ROOT}/examples/lightning_train.py",
                    "--checkpoint-dir", str(tmp_path / f"node{i}"), *args]
                env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
                procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, text=True,
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                              start_new_session=True))
            outs = [p.communicate(timeout=240)[0] for p in procs]
        finally:
            for p in procs:
                kill_group(p.pid)
        for p, out in zip(procs, outs):
            assert p.returncode == 0, out[-4000:]
        m = re.search(r"strategy ddp_pyddp on 2 ranks: train_loss (\S+), val_acc (\S+), "
                      r"test_acc (\S+), checkpoint (\S+), global step (\d+)", outs[0])
        assert m, outs[0][-3000:]
        return m

    for i in range(2):
        (tmp_path / f"node{i}").mkdir()
    try:
        with two_hosts() as hosts:
            first = job(hosts, "--epochs", "1")
            ckpt = first.group(4)
            assert ckpt.startswith(str(tmp_path / "node0")) and os.path.exists(ckpt)
            assert not list((tmp_path / "node1").iterdir())
            # resume from a file that only node 0 has: rank 0 reads it, the others get it
            second = job(hosts, "--epochs", "2", "--resume", ckpt)
    except NetnsUnavailable as e:
        pytest.skip(str(e))
    assert float(first.group(3)) > 0.8, first.group(0)
    steps = int(first.group(5))
    assert steps == 4096 // 2 // 64 and int(second.group(5)) == 2 * steps, second.group(0)
    assert not list((tmp_path / "node1").iterdir())
