"""In-place elastic jobs on one host (no root needed): tests/workers/elastic_job.py in
``inplace`` mode (pyddp.elastic), each rank a process of its own started with plain
env:// variables (rank 0 hosts the store), killed by id to lose it, and processes
started with PYDDP_ELASTIC_JOIN to grow the job again.

Each epoch printed must use each sample exactly once at its world size, with
bit-identical parameters and optimizer state on every rank; the survivors of a change
go on in the same processes (their pids are in the next records); epochs are never
skipped; the job finishes in every process still alive. The netns cases (a host of
torchrun's launch line killed, vanished, returning) are in tests/test_elastic.py.
"""
import json
import os
import queue
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from launch import PY, ROOT, WORKERS, free_port, kill_group, store_server  # noqa: E402

N = 192
JOB = os.path.join(WORKERS, "elastic_job.py")


class LocalJob:
    """The processes of one job on loopback; their output lines go to one queue."""

    def __init__(self, tmp, step_s=0.05, mode="inplace", env=None, script=JOB):
        self.port = free_port()
        self.script = script
        self.stop_file = str(tmp / "stop")
        self.step_s, self.mode, self.env = step_s, mode, env or {}
        self.q = queue.Queue()
        self.procs = {}              # name -> Popen
        self.records, self.lines = [], []

    def start(self, name, rank=0, world=1, join=False, env=None):
        """Start process name as rank of world (env://), or with join a process that
        joins the running job (PYDDP_ELASTIC_JOIN: the job's store, or join itself when
        it is a str); env: more variables for this process."""
        extra = env
        env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port), RANK=str(rank),
                   WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
        env.update(self.env)
        env.update(extra or {})
        if join:
            env["PYDDP_ELASTIC_JOIN"] = join if isinstance(join, str) else \
                f"127.0.0.1:{self.port}"
        args = [self.mode] if self.script == JOB else []
        p = subprocess.Popen([PY, self.script, *args, str(self.step_s), self.stop_file], env=env,
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
        self.procs[name] = p
        threading.Thread(target=self._pump, args=(name, p), daemon=True).start()

    def _pump(self, name, p):
        for line in p.stdout:
            self.q.put((name, line.rstrip("\n")))

    def kill(self, *names):
        for n in names:
            kill_group(self.procs[n].pid)

    def signal(self, name, sig):
        os.kill(self.procs[name].pid, sig)

    def wait_for(self, pred, timeout, what):
        """Read lines until pred(record) holds for a new JSON epoch record; return it."""
        _, line = self.wait_line(lambda n, ln: ln.startswith("{") and pred(json.loads(ln)),
                                 timeout, what)
        return json.loads(line)

    def wait_line(self, pred, timeout, what):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                name, line = self.q.get(timeout=0.2)
            except queue.Empty:
                continue
            self.lines.append(f"[{name}] {line}")
            if line.startswith("{"):
                self.records.append(json.loads(line))
            if pred(name, line):
                return name, line
        raise AssertionError(f"no {what} within {timeout} s\n" + "\n".join(self.lines[-60:]))

    def finish(self, names, timeout=60):
        open(self.stop_file, "w").close()
        deadline = time.monotonic() + timeout
        for n in names:
            try:
                self.procs[n].wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{n} did not finish\n" + "\n".join(self.lines[-60:]))
        time.sleep(0.3)
        while not self.q.empty():
            name, line = self.q.get()
            self.lines.append(f"[{name}] {line}")
            if line.startswith("{"):
                self.records.append(json.loads(line))
        for n in names:
            assert self.procs[n].returncode == 0, (n, "\n".join(self.lines[-60:]))
            assert any(ln.startswith(f"[{n}] done") for ln in self.lines), n

    def close(self):
        for p in self.procs.values():
            kill_group(p.pid)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def check_records(records):
    """Every epoch covers the data once with identical state on every rank, and the
    epochs run 0, 1, 2, ... without a gap (an epoch cut short by a change is run again)."""
    assert records
    for rec in records:
        assert rec["covered"] and rec["used"] == N, rec
        assert len(rec["digests"]) == rec["world"] and len(set(rec["digests"])) == 1, rec
    epochs = [r["epoch"] for r in records]
    assert sorted(set(epochs)) == list(range(max(epochs) + 1)), epochs
    for a, b in zip(epochs, epochs[1:]):
        assert b in (a, a + 1) or b < a, epochs    # a repeat only after a change


def test_inplace_ranks_lost_and_joined(tmp_path):
    """4 ranks; rank 3 killed -> 3 go on in the same processes; ranks 1 and 2 killed
    together -> rank 0 alone; two processes started with PYDDP_ELASTIC_JOIN -> 3 again,
    the joiners holding the job's model and optimizer state; the job finishes."""
    job = LocalJob(tmp_path)
    try:
        for r in range(4):
            job.start(f"r{r}", r, 4)
        first = job.wait_for(lambda r: r["world"] == 4 and r["epoch"] >= 1, 90, "epoch at world 4")
        pids = first["pids"]
        job.kill("r3")
        rec = job.wait_for(lambda r: r["world"] == 3, 30, "epoch at world 3 after rank 3 died")
        assert rec["pids"] == pids[:3], (rec, pids)        # the same processes went on
        job.kill("r1", "r2")
        rec = job.wait_for(lambda r: r["world"] == 1, 30, "epoch at world 1")
        assert rec["pids"] == pids[:1]
        job.start("j1", join=True)
        job.start("j2", join=True)
        rec = job.wait_for(lambda r: r["world"] == 3, 60, "epoch at world 3 after two joined")
        assert rec["pids"][0] == pids[0] and set(rec["pids"][1:]).isdisjoint(pids)
        job.finish(["r0", "j1", "j2"])
    finally:
        job.close()
    check_records(job.records)
    assert job.records[-1]["world"] == 3


def test_inplace_store_host_lost(tmp_path):
    """Rank 0 hosts the store: when it dies the others fail with a clear error that names
    the store, quickly, and do not hang."""
    job = LocalJob(tmp_path)
    try:
        for r in range(3):
            job.start(f"r{r}", r, 3)
        job.wait_for(lambda r: r["epoch"] >= 1, 90, "epoch 1")
        t0 = time.monotonic()
        job.kill("r0")
        for n in ("r1", "r2"):
            job.procs[n].wait(timeout=30)
        took = time.monotonic() - t0
        out = "\n".join(job.lines)
        for n in ("r1", "r2"):
            assert job.procs[n].returncode != 0
        job.wait_line(lambda n, ln: "store at 127.0.0.1" in ln and "stopped answering" in ln,
                      5, "the store-lost error")
        assert took < 20, (took, out[-3000:])
    finally:
        job.close()


def test_inplace_joiner_without_a_job():
    """PYDDP_ELASTIC_JOIN naming a store that holds no in-place job: a clear error."""
    srv, port = store_server()
    try:
        env = dict(os.environ, PYTHONPATH=ROOT, PYDDP_ELASTIC_JOIN=f"127.0.0.1:{port}",
                   PYDDP_TIMEOUT="3")
        r = subprocess.run([PY, "-c", "import pyddp, pyddp.elastic; pyddp.init_process_group('cpu')"],
                           env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode != 0
        assert "holds no running in-place elastic job" in r.stderr, r.stderr[-2000:]
    finally:
        kill_group(srv.pid)
        srv.communicate()


def refuse_misconfigured_joiners(job, join, st):
    """Start a joiner with another PYDDP_AUTH_TOKEN, then one whose job runs another
    pyddp version (its live record rewritten through st, a client of the job's store,
    closed at the end); each must fail on its own side saying why. join: the joiners'
    PYDDP_ELASTIC_JOIN (LocalJob.start's join)."""
    job.start("tok", join=join, env={"PYDDP_AUTH_TOKEN": "another-token"})
    job.wait_line(lambda n, ln: n == "tok" and "another PYDDP_AUTH_TOKEN" in ln, 60,
                  "the joiner's token error")
    assert job.procs["tok"].wait(timeout=30) != 0
    key = "/pyddp/elastic/live"
    rec = json.loads(st.get(key))
    st.set(key, json.dumps(dict(rec, version="0.0.0-other")))
    job.start("ver", join=join)
    job.wait_line(lambda n, ln: n == "ver" and "runs pyddp 0.0.0-other" in ln, 60,
                  "the joiner's version error")
    assert job.procs["ver"].wait(timeout=30) != 0
    st.set(key, json.dumps(rec))
    st.close()


def test_inplace_misconfigured_joiners_refused(tmp_path):
    """A joiner holding another PYDDP_AUTH_TOKEN, and one whose job runs another pyddp
    version (the live record rewritten to say so), are refused on their own side with
    an error that says why; the job goes on in the same processes and finishes."""
    from pyddp import TCPStore
    job = LocalJob(tmp_path)
    try:
        for r in range(2):
            job.start(f"r{r}", r, 2)
        pids = job.wait_for(lambda r: r["world"] == 2 and r["epoch"] >= 1, 90,
                            "epoch at world 2")["pids"]
        refuse_misconfigured_joiners(job, True, TCPStore("127.0.0.1", job.port,
                                                         is_master=False, auth=False))
        last = job.records[-1]["epoch"]
        rec = job.wait_for(lambda r: r["epoch"] >= last + 2, 60, "epochs after the refusals")
        assert rec["world"] == 2 and rec["pids"] == pids, rec
        job.finish(["r0", "r1"])
    finally:
        job.close()
    check_records(job.records)


def test_inplace_commits_on_disk_resume_a_new_start(tmp_path):
    """PYDDP_ELASTIC_CHECKPOINT_DIR: every rank of a job killed at once (the store's host
    gone, say); the job started again with the same script resumes from the newest
    commit on disk instead of epoch 0, every rank holding the same state."""
    env = {"PYDDP_ELASTIC_CHECKPOINT_DIR": str(tmp_path / "ckpt")}
    job = LocalJob(tmp_path, env=env)
    try:
        for r in range(2):
            job.start(f"r{r}", r, 2)
        job.wait_for(lambda r: r["epoch"] >= 3, 90, "epoch 3")
        job.kill("r0", "r1")
    finally:
        job.close()
    before = {r["epoch"]: r["digests"][0] for r in job.records}
    again = LocalJob(tmp_path, env=env)
    try:
        for r in range(2):
            again.start(f"s{r}", r, 2)
        first = again.wait_for(lambda r: True, 90, "an epoch after the new start")
        again.finish(["s0", "s1"])
    finally:
        again.close()
    assert first["epoch"] >= 3, first                   # resumed, not started at 0
    assert first["epoch"] <= max(before) + 1, (first, sorted(before))
    for rec in again.records:
        assert rec["covered"] and rec["used"] == N and len(set(rec["digests"])) == 1, rec
    epochs = [r["epoch"] for r in again.records]
    assert epochs == list(range(epochs[0], epochs[0] + len(epochs))), epochs


STATE_JOB = os.path.join(WORKERS, "elastic_state.py")


def check_state_records(records):
    """elastic_state.py's records: every sample of every epoch applied once (the
    padding a re-shard adds aside), and after every change the same learning rate, step
    counts and state digest on every rank, the scheduler having counted exactly the
    steps applied, and per-rank random streams."""
    assert records
    for rec in records:
        ranks = rec["ranks"]
        assert rec["min"] == 1, rec              # no sample missed, none rolled away
        assert rec["max"] <= 2 and rec["twice"] <= 2 * 3, rec    # padding: < W per shard
        assert len({r["digest"] for r in ranks}) == 1, rec
        assert len({(r["lr"], r["sched"], r["step"]) for r in ranks}) == 1, rec
        assert ranks[0]["sched"] == ranks[0]["step"], rec    # it drives its optimizer
        if len(ranks) > 1:
            assert len({r["draw"] for r in ranks}) == len(ranks), rec   # streams per rank


def test_inplace_state_objects_sampler_and_rng(tmp_path):
    """A LambdaLR scheduler with a lambda, an ElasticSampler and per-rank RNG in the
    state, commits every 2 steps: rank 2 of 3 killed mid-epoch, then a joiner; every
    epoch applies each sample once, and the ranks agree on everything but their random
    draws."""
    job = LocalJob(tmp_path, step_s=0.03, script=STATE_JOB)
    try:
        for r in range(3):
            job.start(f"r{r}", r, 3)
        pids = [r["pid"] for r in job.wait_for(
            lambda r: r["world"] == 3 and r["epoch"] >= 1, 90, "epoch at world 3")["ranks"]]
        time.sleep(0.2)
        job.kill("r2")
        rec = job.wait_for(lambda r: r["world"] == 2, 60, "epoch at world 2")
        assert [r["pid"] for r in rec["ranks"]] == pids[:2], rec
        job.start("j1", join=True)
        job.wait_for(lambda r: r["world"] == 3, 60, "epoch at world 3 after a join")
        job.finish(["r0", "r1", "j1"])
    finally:
        job.close()
    check_state_records(job.records)


def test_inplace_paused_rank_is_kept_and_one_paused_too_long_leaves(tmp_path):
    """4 ranks, PYDDP_PEER_DEAD_S=3. Rank 1 stopped for 2 s (SIGSTOP: a long GC) while
    rank 3 dies: it is waited for (its liveness port still takes connections) and stays
    in the job. Then rank 1 stopped for 8 s while rank 2 dies: if rank 0 noticed the
    death meanwhile (it does unless it was waiting on rank 1 alone), the job goes on
    without rank 1, and rank 1, once it runs again, exits non-zero within seconds saying
    it was left out; otherwise the two go on together. It never loops."""
    import signal as sg
    job = LocalJob(tmp_path, env={"PYDDP_PEER_DEAD_S": "3"})
    try:
        for r in range(4):
            job.start(f"r{r}", r, 4)
        pids = job.wait_for(lambda r: r["world"] == 4 and r["epoch"] >= 1, 90,
                            "epoch at world 4")["pids"]
        job.signal("r1", sg.SIGSTOP)
        job.kill("r3")
        time.sleep(2)
        job.signal("r1", sg.SIGCONT)
        rec = job.wait_for(lambda r: r["world"] == 3, 60, "epoch at world 3")
        assert rec["pids"] == pids[:3], rec                 # the paused rank stayed
        job.signal("r1", sg.SIGSTOP)
        job.kill("r2")
        time.sleep(8)
        t0 = time.monotonic()
        job.signal("r1", sg.SIGCONT)
        rec = job.wait_for(lambda r: r["world"] < 3, 60, "epoch after rank 2 died")
        if rec["world"] == 1:
            assert rec["pids"] == pids[:1], rec
            assert job.procs["r1"].wait(timeout=30) != 0
            assert time.monotonic() - t0 < 20
            job.wait_line(lambda n, ln: n == "r1" and "left out" in ln, 10, "r1's error")
            job.finish(["r0"])
        else:
            assert rec["pids"] == pids[:2], rec
            job.finish(["r0", "r1"])
    finally:
        job.close()
    check_records(job.records)


def test_inplace_torch_ddp(tmp_path):
    """The first seed's script kept as it is (torch.distributed.init_process_group
    ("pyddp"), torch's DDP and DistributedSampler) with pyddp.elastic's wrapper and
    state added: rank 2 of 3 killed, the others go on in the same processes at world 2
    (torch's get_world_size() says so); a process started again with the job's own
    variables (RANK=1 of 2, torch's store client) finds the job running and joins it
    (world 3); every epoch covers the data once with identical state."""
    job = LocalJob(tmp_path, mode="torchddp")
    try:
        for r in range(3):
            job.start(f"r{r}", r, 3)
        pids = job.wait_for(lambda r: r["world"] == 3 and r["epoch"] >= 1, 90,
                            "epoch at world 3")["pids"]
        job.kill("r2")
        rec = job.wait_for(lambda r: r["world"] == 2, 60, "epoch at world 2")
        assert rec["pids"] == pids[:2], rec
        job.env = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}    # a node of one rank
        job.start("j1", 1, 2)
        rec = job.wait_for(lambda r: r["world"] == 3, 60, "epoch at world 3 after a join")
        assert rec["pids"][:2] == pids[:2], rec
        job.finish(["r0", "r1", "j1"])
    finally:
        job.close()
    check_records(job.records)


def test_inplace_joiner_that_cannot_take_part_is_left_out(tmp_path):
    """A joiner whose data port cannot be opened (its PYDDP_PORT_RANGE is one port that
    something else holds; a node whose ports the others cannot reach fails the same
    rebuild): the rebuild that admits it fails once, the joiner exits non-zero with an
    error about its data port, and the job goes on in the same processes (the next
    change leaves out what the failed epoch admitted)."""
    import socket
    holder = socket.socket()
    holder.bind(("", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    job = LocalJob(tmp_path, env={"PYDDP_TIMEOUT": "5"})
    try:
        for r in range(2):
            job.start(f"r{r}", r, 2)
        pids = job.wait_for(lambda r: r["world"] == 2 and r["epoch"] >= 1, 90,
                            "epoch at world 2")["pids"]
        job.env = {"PYDDP_TIMEOUT": "5", "PYDDP_PORT_RANGE": f"{port}-{port}"}
        job.start("bad", join=True)
        job.wait_line(lambda n, ln: n == "bad" and "data port" in ln, 90, "the joiner's error")
        assert job.procs["bad"].wait(timeout=30) != 0
        last = job.records[-1]["epoch"] if job.records else 0
        rec = job.wait_for(lambda r: r["epoch"] >= last + 2, 60, "epochs after the refusal")
        assert rec["world"] == 2 and rec["pids"] == pids, rec
        job.finish(["r0", "r1"])
    finally:
        job.close()
        holder.close()
    check_records(job.records)


def test_half_written_join_and_answer_records_are_skipped():
    """A process that dies between taking its ticket and writing its record leaves a
    hole: the readers skip it (after a short wait) instead of failing as if the store
    were lost."""
    from pyddp import TCPStore
    from pyddp.elastic import _membership
    st = TCPStore("127.0.0.1", 0, is_master=True)
    try:
        base = "/pyddp/test/elastic"
        st.add(f"{base}/join", 2)                      # tickets 0 and 1 taken
        st.set(f"{base}/join/1", json.dumps({"id": "b", "node": "n1", "local_rank": 0,
                                             "local_size": 1, "version": "x"}))
        t0 = time.monotonic()
        ready = _membership.ready_joiners(st, base, set())
        assert [i for i, _ in ready] == [1], ready      # ticket 0's hole skipped
        assert time.monotonic() - t0 < 5
        assert _membership.get_optional(st, f"{base}/0/reg/1", 0.2) is None
    finally:
        st.close()
