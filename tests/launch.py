"""Starting and reaping multi-process test runs.

Every launch gets a timeout; on expiry (or any exception) the whole process group the
launch started is killed by id (SIGKILL to the session leader's group), so a hang fails
the test instead of stalling CI and no worker outlives its test. together() starts
several launches at once, for test cases whose launches mostly wait.
"""
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A suite started in the background by a non-interactive shell inherits SIGINT ignored,
# and an ignored signal stays ignored across exec: every rank the tests start would then
# ignore the Ctrl-C the interrupt tests send. A handler of our own is reset to the
# default in the children, where Python installs its KeyboardInterrupt again.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
WORKERS = os.path.join(ROOT, "tests", "workers")
PY = sys.executable


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self):
        return self.stdout + self.stderr


def reference_exit_abort(res, finished) -> bool:
    """True if a reference run under torch's gloo (no pyddp code in it) failed only by
    aborting as its processes exited ("terminate called without an active exception",
    SIGABRT, from a C++ thread's destructor in torch) after every line in `finished` was
    printed: a defect of the reference, not of what is tested, whose output is complete."""
    return (res.returncode != 0
            and "terminate called without an active exception" in res.output
            and all(line in res.output for line in finished))


def run(cmd, env=None, timeout=120, cwd=ROOT) -> Result:
    """Run cmd in a new session; kill its whole process group at the timeout."""
    full_env = dict(os.environ)
    full_env.setdefault("PYTHONPATH", ROOT)
    full_env["PYTHONUNBUFFERED"] = "1"
    if env:
        full_env.update(env)
    p = subprocess.Popen(cmd, env=full_env, cwd=cwd, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(p.pid)
        out, err = p.communicate()
        raise AssertionError(f"timed out after {timeout} s: {' '.join(cmd)}\n--- stdout\n{out}"
                             f"\n--- stderr\n{err}")
    finally:
        kill_group(p.pid)
    return Result(p.returncode, out, err)


def assert_cases_passed(res, ws, cases):
    """A multi-rank worker run (Result) exited cleanly and printed "PASS <case> rank=<r>"
    for every case and every rank 0..ws-1."""
    out = res.output
    assert res.returncode == 0, out[-8000:]
    for case in cases:
        ranks = sorted(int(r) for r in re.findall(rf"PASS {case} rank=(\d+)", out))
        assert ranks == list(range(ws)), f"{case}: passed on ranks {ranks}\n{out[-4000:]}"


STORE_SERVER = """
import sys
from datetime import timedelta
import pyddp
s = pyddp.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
print(s.port, flush=True)
sys.stdin.read()
"""


def store_server(env=None):
    """pyddp's TCPStore server alone in its own process (so its memory can be read and
    its log seen), in a new session: (Popen, port). The server runs until its stdin
    closes; the caller kills it with kill_group(p.pid) in a finally and reads its
    stderr (the server's log) with p.communicate()."""
    e = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    p = subprocess.Popen([PY, "-c", STORE_SERVER], env=e, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        return p, int(p.stdout.readline())
    except BaseException:
        kill_group(p.pid)
        p.communicate()
        raise


def proc_status_mib(pid, field="VmRSS"):
    """A memory line of /proc/<pid>/status (VmRSS: resident now, VmHWM: the peak), MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} for pid {pid}")


@contextlib.contextmanager
def together(jobs):
    """Start every job of jobs ({key: callable}, each a launch bounded by its own timeout
    that kills what it started) at once, each in a thread; yields {key: Future}. Launches
    that mostly wait (a timeout or a grace period waited out on purpose, little CPU)
    then overlap instead of adding up. A launch's exception is raised by its own
    future's result(), in the test case that reads it; on exit every launch has ended."""
    with ThreadPoolExecutor(len(jobs)) as pool:
        yield {key: pool.submit(fn) for key, fn in jobs.items()}


def kill_group(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def torchrun(script, nproc, args=(), env=None, timeout=120, standalone=True, extra=()):
    """Launch tests/workers/<script> (or a path) under stock torchrun."""
    path = script if os.path.isabs(script) else os.path.join(WORKERS, script)
    cmd = [PY, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    if standalone:
        cmd.append("--standalone")
    cmd += list(extra) + [path] + list(args)
    return run(cmd, env=env, timeout=timeout)


def spawn_ranks(script, world_size, args=(), env=None, timeout=120, master_addr="127.0.0.1",
                prefix=None):
    """Start world_size plain processes with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set
    (no torchrun: rank 0 hosts the store). prefix(rank), if given, is a command prefix
    for that rank (e.g. ``ip netns exec NS``). Returns one Result per rank."""
    port = free_port()
    path = script if os.path.isabs(script) else os.path.join(WORKERS, script)
    procs = []
    base = dict(os.environ)
    base.setdefault("PYTHONPATH", ROOT)
    base["PYTHONUNBUFFERED"] = "1"
    base.update(env or {})
    for r in range(world_size):
        e = dict(base, RANK=str(r), WORLD_SIZE=str(world_size), LOCAL_RANK=str(r),
                 LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR=master_addr,
                 MASTER_PORT=str(port))
        e.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        cmd = (list(prefix(r)) if prefix else []) + [PY, path] + list(args)
        procs.append(subprocess.Popen(cmd, env=e, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True))
    results = []
    try:
        for p in procs:
            try:
                out, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                for q in procs:
                    kill_group(q.pid)
                outs = []
                for r, q in enumerate(procs):     # every rank's output, to see who hung
                    o, e = q.communicate()
                    outs.append(f"--- rank {r}\n{o}\n{e}")
                raise AssertionError(f"rank timed out after {timeout} s\n" + "\n".join(outs))
            results.append(Result(p.returncode, out, err))
    finally:
        for p in procs:
            kill_group(p.pid)
    return results


def interrupt_rank0(script, args=(), world_size=2, env=None, timeout=60, delay=1.0):
    """Start world_size plain ranks of tests/workers/<script>; once rank 0 prints READY,
    wait delay seconds and send it SIGINT (Ctrl-C). Returns every rank's combined
    output (stdout and stderr). Every process is killed by id at the end."""
    port = free_port()
    path = script if os.path.isabs(script) else os.path.join(WORKERS, script)
    procs = []
    try:
        for r in range(world_size):
            e = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world_size),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=ROOT,
                     PYTHONUNBUFFERED="1", PYDDP_TIMEOUT="60")
            e.pop("TORCHELASTIC_USE_AGENT_STORE", None)
            e.update(env or {})
            procs.append(subprocess.Popen([PY, path] + list(args), env=e,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True, start_new_session=True))
        line = procs[0].stdout.readline()
        while line and "READY" not in line:
            line = procs[0].stdout.readline()
        import time
        time.sleep(delay)
        procs[0].send_signal(signal.SIGINT)
        return [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            kill_group(p.pid)
