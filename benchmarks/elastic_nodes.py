"""The loopback "nodes" of benchmarks/elastic.py: each a stock torchrun agent
(``--nnodes=1:2 --nproc_per_node=2``) running benchmarks/elastic_worker.py, started with
one of three launch lines, killed by process id; rank 0's steps read from their output.

Lines:

* ``restart``: ``--rdzv-backend=c10d`` with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and
  ``--max-restarts=6``; the rendezvous in node 0's agent; the script checkpoints.
* ``agent`` (today's in-place line): ``--rdzv-backend=pyddp
  --rdzv-endpoint=127.0.0.1:PORT --max-restarts=100``; node 0's agent hosts the job's
  store (``is_host=1`` there: both nodes share the address), so node 0 is the node the
  job cannot lose.
* ``etcd``: ``--rdzv-backend=pyddp --rdzv-endpoint=etcd://M0,M1,M2 --max-restarts=100``
  over three etcd members on loopback (tests/etcd_cluster.py's ``EtcdCluster``, each with
  its own ports and data directory): member i belongs to node i (i = 0, 1): a node that
  is killed takes its member with it and starts it again, with the same data directory,
  when it comes back; member 2 stands for a third machine that runs no training.
"""
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "elastic_worker.py")
LINES = ("restart", "agent", "etcd")
START_S = 180          # every wait for a step


def descendants(pid):
    """pid and every process below it (torchrun starts its workers in sessions of their
    own, so a process group kill would leave them running)."""
    children = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def kill_tree(pid):
    """A node dies: its launcher and all its workers at once (SIGKILL, by pid)."""
    for p in descendants(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def etcd_cluster(tmp, n=3):
    """A started EtcdCluster of n members on loopback under tmp, its leader elected;
    SystemExit with the install hint where etcd is missing."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from etcd_cluster import EtcdCluster
    if not (os.path.exists("/usr/bin/etcd") or
            any(os.access(os.path.join(d, "etcd"), os.X_OK)
                for d in os.environ.get("PATH", "").split(os.pathsep))):
        raise SystemExit("the etcd line needs the etcd binary (Debian: apt-get install "
                         "etcd-server); leave it out with --lines restart,agent")
    etcd = EtcdCluster(Path(tmp), n)
    etcd.start()
    try:
        etcd.wait_ready(60)
    except BaseException:
        etcd.close()
        raise
    return etcd


class Nodes:
    """Two loopback nodes of one job on one launch line (LINES), with their output: rank
    0's STEP lines as (time, world, global step, node) on ``q``, every line kept per
    node with its arrival time. ``close()`` kills every process started, by pid."""

    def __init__(self, line, args, tmp):
        if line not in LINES:
            raise ValueError(f"line must be one of {LINES}, got {line!r}")
        self.line, self.args, self.tmp = line, args, tmp
        self.port = free_port()
        self.run_id = f"bench-{os.getpid()}-{time.time_ns()}"
        self.stop_file = os.path.join(tmp, "stop")
        self.q = queue.Queue()
        self.procs, self.node_proc = [], {}
        self.lines = {0: [], 1: []}      # node -> [(time, text)]
        self.eof = {}                    # node -> time its output ended
        self.exited = {}                 # node -> (time its launcher exited, status)
        self.rank0 = None                # the node of the last step read
        self.last_t = None               # the time of the last step read
        self.events = []                 # (time, what the driver did), for --logs
        self.etcd = etcd_cluster(tmp) if line == "etcd" else None

    def _launch_args(self, node):
        common = ["--nnodes=1:2", "--nproc_per_node=2", f"--rdzv-id={self.run_id}",
                  "--monitor-interval=0.5"]
        if self.line == "restart":
            return common + ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}",
                             "--max-restarts=6",
                             "--rdzv-conf=last_call_timeout=2,keep_alive_interval=1,"
                             f"keep_alive_max_attempt=3,is_host={int(node == 0)}"]
        if self.line == "agent":
            return common + ["--rdzv-backend=pyddp", f"--rdzv-endpoint=127.0.0.1:{self.port}",
                             "--max-restarts=100",
                             f"--rdzv-conf=last_call_timeout=2,is_host={int(node == 0)}"]
        return common + ["--rdzv-backend=pyddp", f"--rdzv-endpoint={self.etcd.endpoint()}",
                         "--max-restarts=100", "--rdzv-conf=last_call_timeout=2"]

    def start(self, node):
        """Start node's torchrun with its line (on etcd, first its member if it is down,
        as a returning machine would); the launcher's Popen."""
        self.mark(f"start node {node}")
        if self.etcd is not None and node not in self.etcd.alive():
            self.etcd.start(node)
        env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                   CKPT_DIR=os.path.join(self.tmp, f"ckpt{node}"),
                   PYDDP_ELASTIC_SETTLE_S=str(self.args.settle))
        for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "PYDDP_ELASTIC_JOIN",
                  "PYDDP_RDZV_STORE"):
            env.pop(k, None)
        if self.line == "restart":
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        mode = "restart" if self.line == "restart" else "inplace"
        cmd = [sys.executable, "-m", "torch.distributed.run", *self._launch_args(node),
               WORKER, mode, str(self.args.steps_per_epoch), str(self.args.hidden),
               self.stop_file]
        p = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.procs.append(p)
        self.node_proc[node] = p
        self.eof.pop(node, None)
        self.exited.pop(node, None)
        threading.Thread(target=self._pump, args=(p, node), daemon=True).start()
        threading.Thread(target=self._reap, args=(p, node), daemon=True).start()
        return p

    def _reap(self, p, node):
        rc = p.wait()
        if self.node_proc.get(node) is p:
            self.exited[node] = (time.time(), rc)

    def kill(self, node):
        """node's machine dies: its torchrun and workers (and on etcd its member)."""
        self.mark(f"kill node {node}")
        kill_tree(self.node_proc[node].pid)
        if self.etcd is not None:
            self.etcd.kill(node)

    def worker_of(self, node):
        """One worker process of node (a python running elastic_worker.py)."""
        for p in descendants(self.node_proc[node].pid)[1:]:
            try:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    if b"elastic_worker.py" in f.read():
                        return p
            except OSError:
                continue
        raise RuntimeError(f"no worker found on node {node}")

    def mark(self, what):
        """Note what the driver does now (written with the nodes' output by --logs)."""
        self.events.append((time.time(), what))

    def _pump(self, p, node):
        for line in p.stdout:
            now = time.time()
            self.lines[node].append((now, line.rstrip()))
            if line.startswith("STEP "):
                _, t, w, g = line.split()
                self.q.put((float(t), int(w), int(g), node))
        self.eof[node] = time.time()

    def tail(self, n=60):
        """The nodes' last n lines other than steps, and the last 3 steps, in time order,
        for an error message."""
        both = sorted((t, node, s) for node in self.lines for t, s in self.lines[node])
        other = [x for x in both if not x[2].startswith("STEP ")][-n:]
        steps = [x for x in both if x[2].startswith("STEP ")][-3:]
        return "\n".join(f"{t:.2f} node{node} {s}" for t, node, s in sorted(other + steps))

    def drain(self):
        """Forget the steps so far; the last one, (time, world, global step), waiting for
        one if none came since the last drain."""
        last = None
        while not self.q.empty() or last is None:
            try:
                t, w, g, self.rank0 = self.q.get(timeout=START_S if last is None else 0)
            except queue.Empty:
                if last is None:
                    raise RuntimeError(f"{self.line}: no step within {START_S} s\n"
                                       + self.tail()) from None
                break
            last = (t, w, g)
        self.last_t = last[0]
        return last

    def steps(self, timeout):
        """Yield steps (time, world, global step) until timeout seconds have passed
        (RuntimeError then, with the nodes' last lines)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                t, w, g, self.rank0 = self.q.get(timeout=0.5)
            except queue.Empty:
                continue
            self.last_t = t
            yield t, w, g
        raise RuntimeError(f"{self.line}: nothing expected within {timeout} s\n"
                           + self.tail())

    def first_step(self, world, timeout, after=0.0):
        """Steps until one at this world size done after time `after` (world None: the
        first one after the change took effect: at another size than 4, or after a
        pause of a second): (its time, the longest gap seen since the last step read
        before, its global step number)."""
        last, gap = self.last_t, 0.0
        for t, w, g in self.steps(timeout):
            pause = t - last if last is not None else 0.0
            gap = max(gap, pause)
            last = t
            if world is None:
                if t > after and (w != 4 or pause >= 1.0):
                    return t, gap, g
            elif w == world and t > after:
                return t, gap, g
        raise AssertionError("unreachable")

    def window(self, seconds):
        """The steps done within the next `seconds`: [(time, world, global step)]."""
        out, end = [], time.time() + seconds
        try:
            for step in self.steps(seconds + 5):
                out.append(step)
                if step[0] >= end:
                    return out
        except RuntimeError:
            if out:
                return out
            raise
        return out

    def wait_line(self, node, text, timeout, after):
        """The time of node's first output line containing text printed after `after`,
        or None if none came within timeout (or the node's output ended without it)."""
        deadline, seen = time.monotonic() + timeout, 0
        while time.monotonic() < deadline:
            lines = self.lines[node]
            for t, s in lines[seen:]:
                if t >= after and text in s:
                    return t
            seen = len(lines)
            if node in self.eof and seen == len(self.lines[node]):
                return None
            time.sleep(0.05)
        return None

    def wait_exit(self, node, timeout):
        """(time node's launcher exited, its exit status), or (None, None) if it still
        runs after timeout seconds."""
        deadline = time.monotonic() + timeout
        while node not in self.exited and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.exited.get(node, (None, None))

    def stop(self):
        """Ask the job to end after its current epoch."""
        open(self.stop_file, "w").close()

    def close(self):
        """Kill every process started (by pid), stop the etcd members, and with
        ``--logs DIR`` write each node's output there (``LINE-nodeN.log``)."""
        for p in self.procs:
            kill_tree(p.pid)
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        if self.etcd is not None:
            self.etcd.close()
        if self.args.logs:
            os.makedirs(self.args.logs, exist_ok=True)
            for node, lines in self.lines.items():
                with open(os.path.join(self.args.logs, f"{self.line}-node{node}.log"),
                          "w") as f:
                    f.writelines(f"{t:.3f} {s}\n" for t, s in lines)
            with open(os.path.join(self.args.logs, f"{self.line}-driver.log"), "w") as f:
                f.writelines(f"{t:.3f} {s}\n" for t, s in self.events)
