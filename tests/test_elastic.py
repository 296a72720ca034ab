"""Elastic jobs on network-namespace hosts (tests/netns.py; root only, skipped without):
stock torchrun ``--nnodes=1:N`` with the c10d rendezvous, each host's agent and workers
in its own namespace, running tests/workers/elastic_job.py.

* restart-based: a host killed mid-training, then started again with the same line;
  torchrun restarts the workers on every change and they resume from the newest
  checkpoint on any node (each host has a directory of its own), with
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (down and up; with the agent's shared store up
  is torchrun's own defect, see docs/elastic.md).
* in place (pyddp.elastic, the agent's shared store): in the first launch form a host
  killed and started again with its own line; on 3 hosts (c10d form) one vanishing (its
  switch port down), then one worker of another dying (its agent, with
  --max-restarts=0, takes that host out), which then comes back with the joining line
  (PYDDP_ELASTIC_JOIN, torchrun --standalone); on --rdzv-backend=pyddp's line, a host
  killed and back, a worker killed, a SIGTERM. The survivors' process ids must stay
  the same across every change.

Every epoch printed must use each sample exactly once at its world size, with the same
parameters and optimizer state on every rank, and the job must finish on every host.
Every process is started in its own session and killed by id at the end.
"""
import json
import os
import queue
import subprocess
import sys
import threading
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from launch import PY, ROOT, WORKERS, free_port, kill_group  # noqa: E402
from netns import NetnsUnavailable, bridged_hosts, exec_prefix  # noqa: E402

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")

N = 192
JOB = os.path.join(WORKERS, "elastic_job.py")


class Job:
    """The hosts' torchrun processes of one job; every output line, tagged with its
    host, goes to one queue; the JSON epoch records are kept in order."""

    def __init__(self, bridged, mode, tmp, nnodes, env=None, step_s=0.05, static=False,
                 rdzv=None, nproc=2, script=None, endpoint=None):
        self.b, self.mode, self.tmp, self.nnodes = bridged, mode, tmp, nnodes
        self.static = static     # the first launch form (--node_rank, --master_addr)
        self.rdzv = rdzv         # "pyddp": docs/elastic.md's line (--rdzv-backend=pyddp)
        self.nproc = nproc
        self.script = script     # another worker (its arguments: STEP_S STOP_FILE)
        self.endpoint = endpoint  # --rdzv-endpoint instead of host 0's (etcd://...)
        self.env, self.step_s = env or {}, step_s
        self.port = free_port()
        self.stop_file = str(tmp / "stop")
        self.q = queue.Queue()
        self.procs = {}          # host index -> Popen (the latest start)
        self.all = []
        self.records = []
        self.lines = []

    def start(self, i, join=False):
        """Host i runs the job's launch line; join: the line that joins a running
        in-place job (PYDDP_ELASTIC_JOIN=<endpoint> torchrun --standalone ...)."""
        h = self.b.hosts[i]
        ckpt = self.tmp / f"ckpt{i}"
        env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", CKPT_DIR=str(ckpt),
                   OMP_NUM_THREADS="1", **self.env)
        for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                  "TORCHELASTIC_USE_AGENT_STORE", "PYDDP_ELASTIC_JOIN"):
            env.pop(k, None)
        endpoint = self.endpoint or f"{self.b.hosts[0].addr}:{self.port}"
        if join:
            env["PYDDP_ELASTIC_JOIN"] = endpoint if self.static else f"{endpoint}/job"
            launch = ["--standalone", "--nproc_per_node=2"]
        elif self.rdzv == "pyddp":
            launch = [f"--nnodes={self.nnodes}", f"--nproc_per_node={self.nproc}",
                      "--rdzv-backend=pyddp",
                      f"--rdzv-endpoint={endpoint}", "--rdzv-id=job", "--max-restarts=100",
                      "--monitor-interval=0.5", f"--local-addr={h.addr}",
                      "--rdzv-conf=last_call_timeout=2"]
        elif self.static:
            launch = [f"--nnodes={self.nnodes}", "--nproc_per_node=2", f"--node_rank={i}",
                      f"--master_addr={self.b.hosts[0].addr}", f"--master_port={self.port}",
                      "--max-restarts=0", "--monitor-interval=0.5", f"--local-addr={h.addr}"]
        else:
            launch = [f"--nnodes={self.nnodes}", "--nproc_per_node=2", "--rdzv-backend=c10d",
                      f"--rdzv-endpoint={endpoint}", "--rdzv-id=job",
                      f"--max-restarts={0 if self.mode == 'inplace' else 6}",
                      "--monitor-interval=0.5", f"--local-addr={h.addr}",
                      "--rdzv-conf=last_call_timeout=2,keep_alive_interval=1,"
                      f"keep_alive_max_attempt=3,is_host={int(i == 0)}"]
        worker = [self.script] if self.script else [JOB, self.mode]
        cmd = exec_prefix(h.ns) + [PY, "-m", "torch.distributed.run", *launch,
                                   *worker, str(self.step_s), self.stop_file]
        p = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.procs[i] = p
        self.all.append(p)
        threading.Thread(target=self._pump, args=(i, p), daemon=True).start()

    def _pump(self, i, p):
        for line in p.stdout:
            self.q.put((i, line.rstrip("\n")))

    def kill(self, i):
        """Host i dies: every process in its namespace (torchrun's workers run in
        sessions of their own) is killed at once."""
        r = subprocess.run(["ip", "netns", "pids", self.b.hosts[i].ns], capture_output=True,
                           text=True, timeout=20)
        for pid in r.stdout.split():
            try:
                os.kill(int(pid), 9)
            except ProcessLookupError:
                pass

    def kill_worker(self, i):
        """One worker process of host i dies (its agent, with --max-restarts=0, then
        stops the host's other workers and exits)."""
        r = subprocess.run(["ip", "netns", "pids", self.b.hosts[i].ns], capture_output=True,
                           text=True, timeout=20)
        for pid in r.stdout.split():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if argv[1:2] != [b"-m"] and any(a.endswith((b"elastic_job.py", b"elastic_state.py"))
                                            for a in argv):
                os.kill(int(pid), 9)
                return
        raise AssertionError(f"no worker of host {i} found")

    def term(self, i):
        """Host i's torchrun is sent SIGTERM (a spot VM's notice, a pod deleted)."""
        os.kill(self.procs[i].pid, 15)

    def vanish(self, i):
        """Host i drops off the network (its switch port goes down): no FIN, no RST,
        its processes go on running."""
        subprocess.run(["ip", "-n", self.b.switch, "link", "set", self.b.ports[i], "down"],
                       check=True, capture_output=True, timeout=20)

    def wait_for(self, pred, timeout, what):
        """Read lines until pred(record) holds for a new JSON record; return it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                i, line = self.q.get(timeout=0.5)
            except queue.Empty:
                continue
            self.lines.append(f"[{i}] {line}")
            rec = _record(line)
            if rec is not None:
                self.records.append(rec)
                if pred(rec):
                    return rec
        raise AssertionError(f"no {what} within {timeout} s\n" + "\n".join(self.lines[-80:]))

    def finish(self, hosts, timeout=90):
        open(self.stop_file, "w").close()
        deadline = time.monotonic() + timeout
        for i in hosts:
            p = self.procs[i]
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                raise AssertionError("a host did not finish\n" + "\n".join(self.lines[-80:]))
        time.sleep(0.5)
        while not self.q.empty():
            i, line = self.q.get()
            self.lines.append(f"[{i}] {line}")
            rec = _record(line)
            if rec is not None:
                self.records.append(rec)
        for i in hosts:
            assert self.procs[i].returncode == 0, "\n".join(self.lines[-80:])

    def close(self):
        for i in range(len(self.b.hosts)):
            self.kill(i)
        for p in self.all:
            kill_group(p.pid)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def check_epochs(self, contiguous=False):
        """Every epoch record covers the data once with identical state on all ranks;
        contiguous: and the epochs run 0, 1, 2, ... (resumed, never restarted at 0)."""
        assert self.records
        for rec in self.records:
            assert rec["covered"] and rec["used"] == N, rec
            assert len(set(rec["digests"])) == 1, rec
            assert len(rec["digests"]) == rec["world"]
        if contiguous:
            epochs = sorted({r["epoch"] for r in self.records})
            assert epochs == list(range(epochs[-1] + 1)), epochs


def _record(line):
    """The JSON record a line holds, or None (not one, or the cut-off line of a process
    killed while it printed)."""
    if not line.startswith("{"):
        return None
    try:
        return json.loads(line)
    except ValueError:
        return None


def _run(fn, hosts, *args):
    try:
        with bridged_hosts(hosts) as b:
            fn(b, *args)
    except NetnsUnavailable as e:
        pytest.skip(str(e))


def _restart_down_and_back(b, tmp, env):
    """Host 1 killed mid-training, then started again with the same line."""
    job = Job(b, "restart", tmp, "1:2", env)
    try:
        job.start(0)
        job.start(1)
        job.wait_for(lambda r: r["world"] == 4, 120, "epoch at world 4")
        job.kill(1)
        job.wait_for(lambda r: r["world"] == 2, 120, "epoch at world 2 after host 1 was killed")
        job.start(1)
        job.wait_for(lambda r: r["world"] == 4, 150, "epoch at world 4 after host 1 returned")
        job.finish([0, 1])
    finally:
        job.close()
    job.check_epochs(contiguous=True)


def test_restart_based_host_lost_and_back(tmp_path):
    """The issue's row: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, host B killed, started
    again: the job shrinks to 2 ranks, grows back to 4, and finishes on both hosts."""
    _run(_restart_down_and_back, 2, tmp_path, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})


def _same_processes(rec, pids, job=None):
    assert rec["pids"] == pids, (rec, pids, "\n".join(job.lines[-120:]) if job else "")


def _inplace_static_lost_and_back(b, tmp):
    """In place, the first launch form (the agent's store on host 0): host 1 killed; its
    survivors go on in the same processes; host 1 started again with its own line is
    admitted (its workers find the job running in the store)."""
    job = Job(b, "inplace", tmp, "2", static=True)
    try:
        job.start(0)
        job.start(1)
        pids = job.wait_for(lambda r: r["world"] == 4 and r["epoch"] >= 1, 120,
                            "epoch at world 4")["pids"]
        job.kill(1)
        _same_processes(job.wait_for(lambda r: r["world"] == 2, 60,
                                     "epoch at world 2 after host 1 was killed"), pids[:2], job)
        job.start(1)
        rec = job.wait_for(lambda r: r["world"] == 4, 90, "epoch at world 4 after host 1 joined")
        assert rec["pids"][:2] == pids[:2]
        job.finish([0, 1])
    finally:
        job.close()
    job.check_epochs(contiguous=True)


def test_inplace_static_form_host_lost_and_back(tmp_path):
    """The first seed's line (--nnodes=2 --node_rank=i --master_addr --master_port) in
    place: its world size is fixed for torchrun, but pyddp's survivors go on without the
    lost host and admit it again when it runs the same line again."""
    _run(_inplace_static_lost_and_back, 2, tmp_path)


def _inplace_three_hosts(b, tmp):
    """3 hosts x 2 ranks in place on the c10d form: host 2 vanishes (noticed within
    PYDDP_PEER_DEAD_S), then one worker of host 1 dies (its agent takes the host out);
    the job goes on at 4, then 2 ranks, in the same processes; host 1 then runs the
    joining line (PYDDP_ELASTIC_JOIN, torchrun --standalone: the c10d form's stock
    agents would restart for a node in their rendezvous) and is admitted in place; the
    job finishes on hosts 0 and 1."""
    job = Job(b, "inplace", tmp, "1:3", {"PYDDP_PEER_DEAD_S": "3"})
    try:
        for i in range(3):
            job.start(i)
        pids = job.wait_for(lambda r: r["world"] == 6 and r["epoch"] >= 1, 150,
                            "epoch at world 6")["pids"]
        job.vanish(2)
        _same_processes(job.wait_for(lambda r: r["world"] == 4, 60,
                                     "epoch at world 4 after host 2 vanished"), pids[:4])
        job.kill_worker(1)
        _same_processes(job.wait_for(lambda r: r["world"] == 2, 60,
                                     "epoch at world 2 after a worker of host 1 died"),
                        pids[:2])
        job.procs[1].wait(timeout=60)           # host 1's agent took the host out
        job.start(1, join=True)
        rec = job.wait_for(lambda r: r["world"] == 4, 90,
                           "epoch at world 4 after host 1 ran the joining line")
        assert rec["pids"][:2] == pids[:2], rec
        job.finish([0, 1])
    finally:
        job.close()
    job.check_epochs()


def test_inplace_three_hosts_one_vanished_one_worker_killed(tmp_path):
    _run(_inplace_three_hosts, 3, tmp_path)


def _one_line(b, tmp):
    """docs/elastic.md's line (--rdzv-backend=pyddp) on every node, running the first
    seed's script with torch's own DDP and sampler (tests/workers/elastic_job.py
    torchddp), PYDDP_AUTH_TOKEN set on every node (torch's default group is made over
    pyddp's authenticated client of the job's store, and torch's own client without the
    token is refused). The endpoint's node is 10.215.x.5 and the other 10.215.x.12,
    which sorts first as a string (torch's c10d would keep the workers' store there):
    the other host killed (the store lives with the endpoint: the job goes on in the
    same processes) and started again with the same line (admitted in place); a worker
    of the endpoint's node killed (its agent starts that node's workers again, which
    join in place; the other host's ranks go on); the other host's torchrun sent SIGTERM
    (its ranks leave at the next commit: no settle wait, no rollback). pyddp's own DDP
    on this line runs in _paused_and_stateful below and in tests/test_elastic_etcd.py."""
    job = Job(b, "torchddp", tmp, "1:2", rdzv="pyddp",
              env={"PYDDP_ELASTIC_SETTLE_S": "20", "PYDDP_AUTH_TOKEN": "torch-ddp-in-place"})
    try:
        job.start(0)
        job.start(1)
        pids = job.wait_for(lambda r: r["world"] == 4 and r["epoch"] >= 1, 120,
                            "epoch at world 4")["pids"]
        _an_unauthenticated_client_is_refused(job)
        job.kill(1)
        _same_processes(job.wait_for(lambda r: r["world"] == 2, 60,
                                     "epoch at world 2 after host 1 was killed"), pids[:2])
        job.start(1)
        rec = job.wait_for(lambda r: r["world"] == 4, 90,
                           "epoch at world 4 after host 1 ran its line again")
        assert rec["pids"][:2] == pids[:2], rec
        host1 = rec["pids"][2:]
        job.kill_worker(0)
        _same_processes(job.wait_for(lambda r: r["world"] == 2, 60,
                                     "epoch at world 2 after a worker of host 0 died"), host1)
        rec = job.wait_for(lambda r: r["world"] == 4, 90,
                           "epoch at world 4 after host 0's agent started its workers again")
        assert rec["pids"][:2] == host1, rec
        host0 = rec["pids"][2:]
        t0 = time.monotonic()
        job.term(1)
        _same_processes(job.wait_for(lambda r: r["world"] == 2, 60,
                                     "epoch at world 2 after host 1's torchrun got SIGTERM"),
                        host0)
        # PYDDP_ELASTIC_SETTLE_S is 20 s here: a leave that waited for it would show
        assert time.monotonic() - t0 < 15, time.monotonic() - t0
        assert any("rank(s) leaving (SIGTERM)" in ln for ln in job.lines), job.lines[-40:]
        job.finish([0])
    finally:
        job.close()
    job.check_epochs(contiguous=True)


def test_inplace_one_line_store_with_the_endpoint(tmp_path):
    try:
        with bridged_hosts(2, last=[5, 12]) as b:
            _one_line(b, tmp_path)
    except NetnsUnavailable as e:
        pytest.skip(str(e))


def _worker_pid(job, i):
    """The process id of host i's (only) worker."""
    r = subprocess.run(["ip", "netns", "pids", job.b.hosts[i].ns], capture_output=True,
                       text=True, timeout=20)
    for pid in r.stdout.split():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv[1:2] != [b"-m"] and any(a.endswith(b"elastic_state.py") for a in argv):
            return int(pid)
    raise AssertionError(f"no worker on host {i}")


def _paused_and_stateful(b, tmp):
    """Three single-rank nodes on docs/elastic.md's line running
    tests/workers/elastic_state.py (a LambdaLR with a lambda, an ElasticSampler and
    per-rank random streams in the state, commits every 2 steps): host 1's worker is
    stopped for 3 s (SIGSTOP: a long GC) while host 2 is killed; host 1 stays in the job
    (the same process), host 2 comes back with the same line; every epoch applies each
    sample once and the ranks agree on everything but their random draws."""
    from test_elastic_inplace import check_state_records
    job = Job(b, "inplace", tmp, "1:3", rdzv="pyddp", nproc=1, step_s=0.03,
              script=os.path.join(WORKERS, "elastic_state.py"))
    try:
        for i in range(3):
            job.start(i)
        rec = job.wait_for(lambda r: r["world"] == 3 and r["epoch"] >= 1, 150,
                           "epoch at world 3")
        survivors = {_worker_pid(job, 0), _worker_pid(job, 1)}
        assert survivors < {r["pid"] for r in rec["ranks"]}, rec
        stopped = _worker_pid(job, 1)
        os.kill(stopped, 19)                    # SIGSTOP
        job.kill(2)
        time.sleep(3)
        os.kill(stopped, 18)                    # SIGCONT
        rec = job.wait_for(lambda r: r["world"] == 2, 60, "epoch at world 2")
        assert {r["pid"] for r in rec["ranks"]} == survivors, rec
        job.start(2)
        job.wait_for(lambda r: r["world"] == 3, 90, "epoch at world 3 after host 2 returned")
        job.finish([0, 1, 2])
    finally:
        job.close()
    check_state_records(job.records)


def test_inplace_paused_rank_kept_state_and_samples(tmp_path):
    _run(_paused_and_stateful, 3, tmp_path)


UNAUTHENTICATED = """
import sys
from datetime import timedelta
import torch.distributed as dist
try:
    s = dist.TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False,
                      timeout=timedelta(seconds=5))
    s.set("intruder", "1")
    print("SERVED")
except Exception as e:
    print("REFUSED", type(e).__name__)
"""


def _an_unauthenticated_client_is_refused(job):
    """torch's own TCPStore client (no token) from host 1 to the job's store."""
    r = subprocess.run(exec_prefix(job.b.hosts[1].ns) + [
        PY, "-c", UNAUTHENTICATED, job.b.hosts[0].addr, str(job.port)],
        capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.stdout.startswith("REFUSED"), r.stdout + r.stderr[-2000:]
