"""``python -m pyddp.doctor``: what would stop or slow a job on this node, checked
before training.

Alone, on each node (the master's address from --master or MASTER_ADDR/MASTER_PORT)::

    python -m pyddp.doctor --master 10.0.0.1:23456

it checks that the master's port answers (and if not, which rule to open, for which
port and source address), the address and interface pyddp would advertise, whether the
host name resolves to loopback, /dev/shm space, whether the shared-memory single-copy
path is allowed, NCCL and the CUDA runtime (required with --backend nccl), the PYDDP_*
settings, and the pyddp, torch, NumPy and Python versions. Before the job runs nothing
listens on the master's port; ``python -m pyddp.doctor --listen 300`` on the master
holds it open meanwhile and prints every node that reaches it.

Under the job's own torchrun line (either form), ``torchrun ... -m pyddp.doctor``, rank
0 prints one table with a row per rank, marks what differs, and times a short
all_reduce over all ranks and over each kind of link (see ``_job``).

Exit status 1 when something would stop a job (each FAIL line says what to do), else
0; what would only slow a job is a warning. PYDDP_DOCTOR_FAKE_VERSION="pkg=version"
overrides a reported version, for tests.

The package (the doctor) may import anything below it: the core and ``bench``; nothing
imports it.
"""
import argparse
import os
import sys
import time
from datetime import timedelta

from .. import _C, bench
from . import _checks as chk
from ._etcd_check import findings as etcd_findings
from ._facts import gather
from ..store import TCPStore


def parse_master(text):
    """'host:port' or '[v6]:port' -> (host, port); raises ValueError."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--master {text!r} must look like host:port (port 1-65535)")
    return host.strip("[]"), int(port)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m pyddp.doctor",
                                description=__doc__.split("\n\n")[0].strip("`"),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--master", metavar="HOST:PORT",
                   help="the master's store (default: MASTER_ADDR and MASTER_PORT); ignored "
                        "under torchrun, which sets them")
    p.add_argument("--backend", choices=("cpu", "gloo", "nccl"), default="cpu",
                   help="the backend the job will use; nccl makes NCCL, the CUDA runtime "
                        "and a GPU required (cpu)")
    p.add_argument("--timeout", type=float, default=5.0,
                   help="seconds for the master port, each name lookup and the "
                        "single-copy probe (5)")
    p.add_argument("--join-timeout", type=float, default=60.0,
                   help="under torchrun: seconds the ranks wait for each other (60)")
    p.add_argument("--bytes", type=bench.parse_size, default=4 << 20,
                   help="under torchrun: the all_reduce size timed for bandwidth (4M)")
    p.add_argument("--round-ms", type=float, default=10.0,
                   help="under torchrun: length of each timed round (10); 3 rounds per "
                        "size and link")
    p.add_argument("--nproc-per-node", type=int, default=8,
                   help="alone: ranks that will share this host, to size /dev/shm (8)")
    p.add_argument("--etcd", metavar="etcd://HOST:PORT,...",
                   help="the etcd members of an in-place elastic job's --rdzv-endpoint: "
                        "checks which answer and that a majority does (default: the "
                        "endpoint of pyddp's rendezvous, under torchrun)")
    p.add_argument("--listen", type=float, metavar="SECONDS",
                   help="alone, on the master: hold the master's port open this long so "
                        "the other nodes' doctors can reach it; prints each visitor")
    a = p.parse_args(argv)
    if a.timeout <= 0 or a.join_timeout <= 0 or a.bytes < 8 or a.round_ms <= 0:
        p.error("--timeout, --join-timeout and --round-ms must be positive, --bytes >= 8")
    a.host, a.port = None, None
    try:
        if a.master:
            a.host, a.port = parse_master(a.master)
        elif os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
            a.host, a.port = parse_master(f"{os.environ['MASTER_ADDR']}:"
                                          f"{os.environ['MASTER_PORT']}")
    except ValueError as e:
        p.error(str(e))
    a.etcd = a.etcd or _C.setting_text("PYDDP_RDZV_STORE")
    if a.etcd and not a.etcd.startswith(("etcd://", "http://", "https://")):
        a.etcd = None                          # "pyddp": the endpoint's agent store
    if a.listen is not None and (a.listen <= 0 or not a.port):
        p.error("--listen needs a positive number of seconds and the port (--master "
                "host:port or MASTER_PORT)")
    return a


def _listen(args, facts):
    """Host a store on the master port for args.listen seconds and print each node
    whose doctor reaches it. Returns the finding about the port."""
    try:
        store = TCPStore("localhost", args.port, is_master=True,
                         timeout=timedelta(seconds=args.timeout))
    except _C.DistNetworkError as e:
        return ("FAIL", "master port", f"cannot listen on port {args.port} here ({e}): "
                f"another process (a running job's store?) holds it; pick a free "
                f"MASTER_PORT or stop that process")
    addr = facts["primary"]
    try:
        store.set(chk.LISTENER_KEY, f"{facts['host']} ({addr}) port {args.port}")
        print(f"listening on port {args.port} for {args.listen:.0f} s (Ctrl-C stops); on "
              f"each other node run: python -m pyddp.doctor --master {addr}:{args.port}",
              flush=True)
        seen, deadline = 0, time.monotonic() + args.listen
        try:
            while time.monotonic() < deadline:
                if store.check([chk.VISITS_KEY]):
                    lines = store.get(chk.VISITS_KEY).decode().splitlines()
                    for line in lines[seen:]:
                        print(f"  reached by {line}", flush=True)
                    seen = len(lines)
                time.sleep(0.2)
        except KeyboardInterrupt:
            pass
    finally:
        store.close()
    return ("ok", "master port", f"port {args.port} could be held open here; "
            f"{seen} node{'s' if seen != 1 else ''} reached it")


def alone(args):
    """The doctor on this node alone; returns the exit status."""
    facts = gather(args.host, args.timeout)
    where = f"master {args.host}:{args.port}" if args.port else "no master given"
    print(f"pyddp doctor: host {facts['host']}, alone, {where}, backend {args.backend}",
          flush=True)
    found = chk.node_findings(facts, args.backend, args.nproc_per_node, None, args.host)
    if args.listen:
        print(chk.findings_block(found), flush=True)
        port = _listen(args, facts)
        print(chk.findings_block([port]).split("\n", 1)[1])
        found.append(port)
    else:
        found[1:1] = chk.reach(args.host, args.port, args.timeout)
        if args.etcd:
            found[1:1] = etcd_findings(args.etcd, args.timeout)
        print(chk.findings_block(found))
    code, line = chk.verdict(found)
    print(line, flush=True)
    return code


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if os.environ.get("RANK") and os.environ.get("WORLD_SIZE") and args.listen is None:
        from . import _job
        return _job.run(args)
    return alone(args)

