"""In-place elastic training whose coordination lives in etcd, so that no node is special:
three network-namespace hosts (tests/netns.py; root only), each running a real etcd
member (tests/etcd_cluster.py) and stock torchrun with the one line of docs/elastic.md,

    torchrun --rdzv-backend=pyddp --rdzv-endpoint=etcd://H0:2379,H1:2379,H2:2379
             --rdzv-id=job --nnodes=1:3 --nproc_per_node=1 --max-restarts=100 ...

running tests/workers/elastic_state.py (an ElasticSampler, a LambdaLR, per-rank random
streams, a counting model that shows how often each sample was applied), in one job:

1. the etcd leader killed while training runs at a fixed world: nothing happens to
   training (no change, the same processes), and the member comes back;
2. host 0 killed outright (the node of rank 0, and an etcd member): the survivors go on
   in place (the same processes) at world 2, rank 0 now on host 1; host 0 started again
   with its line (its etcd member too) is admitted;
3. a worker crashes and the etcd leader is killed at once: the change completes on the
   other members, and the worker its agent starts again is admitted;
4. host 1's torchrun sent SIGTERM (rank 0's node by then): its rank leaves at the next
   commit and the others go on.

Every epoch applies each sample once with identical state on every rank, and the
survivors of each change keep their process ids.
"""
import contextlib
import os
import time

import pytest

from etcd_cluster import EtcdCluster, etcd_binary
from netns import NetnsUnavailable, bridged_hosts
from test_elastic import WORKERS, Job, _worker_pid
from test_elastic_inplace import check_state_records

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")

STATE_JOB = os.path.join(WORKERS, "elastic_state.py")


def _pids(rec):
    return [r["pid"] for r in rec["ranks"]]


def _etcd_job(b, tmp):
    etcd = EtcdCluster(tmp, hosts=[(h.ns, h.addr) for h in b.hosts])
    job = Job(b, "inplace", tmp, "1:3", rdzv="pyddp", nproc=1, step_s=0.03,
              script=STATE_JOB, endpoint=etcd.endpoint(),
              env={"PYDDP_ETCD_TIMEOUT": "20"})
    try:
        etcd.start()
        etcd.wait_ready(60)
        for i in range(3):
            job.start(i)
        rec = job.wait_for(lambda r: r["world"] == 3 and r["epoch"] >= 1, 150,
                           "epoch at world 3")
        host_of = {_worker_pid(job, i): i for i in range(3)}
        ranks = [host_of[p] for p in _pids(rec)]       # the host of each rank, in order

        def now():
            return [_worker_pid(job, i) for i in ranks]

        assert _pids(rec) == now(), rec

        # 1. the etcd leader lost at a fixed world: training goes on untouched
        lead = etcd.leader()
        etcd.kill(lead)
        n = len(job.records)
        job.wait_for(lambda r: len(job.records) > n + 1, 60,
                     "two epochs after the etcd leader was killed")
        assert all(r["world"] == 3 and _pids(r) == now() for r in job.records[n:]), \
            job.records[n:]
        assert not any("world 3 ->" in ln for ln in job.lines), job.lines[-40:]
        etcd.start(lead)
        etcd.wait_ready(60)

        # 2. the node of rank 0 (and its etcd member) killed; then back with its line
        first = ranks.pop(0)
        job.kill(first)
        etcd.members[first]["proc"] = None
        rec = job.wait_for(lambda r: r["world"] == 2, 90, "epoch at world 2 without rank 0")
        assert _pids(rec) == now(), rec                # rank 0 is the next host's now
        etcd.start(first)
        job.start(first)
        ranks.append(first)                            # joiners come last
        rec = job.wait_for(lambda r: r["world"] == 3, 120,
                           "epoch at world 3 after the node ran its line again")
        assert _pids(rec) == now(), rec
        etcd.wait_ready(60)

        # 3. a crash and the etcd leader's loss together: the change completes
        lead = etcd.leader()
        crashed_host = ranks.pop(1)
        crashed = _worker_pid(job, crashed_host)
        os.kill(crashed, 9)
        etcd.kill(lead)
        rec = job.wait_for(lambda r: r["world"] == 2, 90,
                           "epoch at world 2 after a crash with the etcd leader lost")
        assert _pids(rec) == now(), rec
        etcd.start(lead)
        ranks.append(crashed_host)
        rec = job.wait_for(lambda r: r["world"] == 3, 120,
                           "epoch at world 3 after the crashed worker was started again")
        assert crashed not in _pids(rec) and _pids(rec) == now(), rec

        # 4. SIGTERM to rank 0's node: it leaves at the next commit
        leaving = ranks.pop(0)
        job.term(leaving)
        rec = job.wait_for(lambda r: r["world"] == 2, 60,
                           "epoch at world 2 after rank 0's torchrun got SIGTERM")
        assert _pids(rec) == now(), rec
        assert any("rank(s) leaving (SIGTERM)" in ln for ln in job.lines), job.lines[-40:]
        job.finish(ranks)
    finally:
        job.close()
        etcd.close()
    check_state_records(job.records)


def test_no_node_the_job_cannot_lose(tmp_path):
    etcd_binary()
    try:
        with bridged_hosts(3) as b:
            _etcd_job(b, tmp_path)
    except NetnsUnavailable as e:
        pytest.skip(str(e))


# ---- on one host, no root: the etcd store under ranks started with torchrun's variables

@contextlib.contextmanager
def _local_job(tmp, world, env=None):
    """(etcd, LocalJob): a 3-member etcd cluster, and world ranks of elastic_state.py
    whose store is that etcd (what a worker of the pyddp rendezvous on etcd gets from its
    agent: PYDDP_RDZV_STORE and the agent-store flag) at epoch 1; both stopped at the end."""
    from test_elastic_inplace import LocalJob
    etcd = EtcdCluster(tmp, 3)
    job = LocalJob(tmp, step_s=0.03, script=STATE_JOB, env=dict(
        {"PYDDP_RDZV_STORE": etcd.endpoint(), "TORCHELASTIC_USE_AGENT_STORE": "True",
         "TORCHELASTIC_RUN_ID": "local"}, **(env or {})))
    try:
        etcd.start()
        etcd.wait_ready()
        for r in range(world):
            job.start(f"r{r}", r, world)
        job.wait_for(lambda r: r["world"] == world and r["epoch"] >= 1, 90,
                     f"epoch at world {world}")
        yield etcd, job
    finally:
        job.close()
        etcd.close()


def test_without_an_etcd_majority_training_goes_on_and_a_change_names_etcd(tmp_path):
    """Two of three etcd members lost: the three ranks train on at a fixed world (the
    same processes); then a rank dies: the change cannot be agreed, and the others end
    with an error that names etcd and the majority it needs, well before the job's
    timeout (PYDDP_ETCD_TIMEOUT bounds each store request)."""
    with _local_job(tmp_path, 3, {"PYDDP_ETCD_TIMEOUT": "5"}) as (etcd, job):
        pids = _pids(job.records[-1])
        etcd.kill(0)
        etcd.kill(1)
        n = len(job.records)
        job.wait_for(lambda r: len(job.records) >= n + 2, 60,
                     "two epochs without an etcd majority")
        assert all(_pids(r) == pids for r in job.records[n:]), job.records[n:]
        t0 = time.monotonic()
        job.kill("r2")
        name, line = job.wait_line(lambda n, ln: "StoreLost" in ln, 60,
                                   "StoreLost on a survivor")
        assert time.monotonic() - t0 < 40
        assert "etcd" in line and "majority" in line, line
        for r in ("r0", "r1"):
            assert job.procs[r].wait(timeout=30) != 0
    check_state_records(job.records)


def test_joiners_with_another_token_or_version_are_refused_on_their_side(tmp_path):
    """On etcd as on pyddp's store: a process joining with another PYDDP_AUTH_TOKEN, or
    another pyddp version, is refused with an error saying so, and the job goes on."""
    from pyddp import EtcdStore
    from test_elastic_inplace import refuse_misconfigured_joiners
    with _local_job(tmp_path, 2, {"PYDDP_AUTH_TOKEN": "job-token"}) as (etcd, job):
        pids = _pids(job.records[-1])
        refuse_misconfigured_joiners(job, f"{etcd.endpoint()}/local",
                                     EtcdStore(etcd.endpoint(), "pyddp/local"))
        n = len(job.records)
        job.wait_for(lambda r: len(job.records) > n, 60, "an epoch after the refusals")
        assert all(_pids(r) == pids for r in job.records), job.records[-1]
        job.finish(["r0", "r1"])
    check_state_records(job.records)
