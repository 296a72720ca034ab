"""``python -m pyddp.doctor``: alone against a closed port and against live stores (pyddp's,
torch's, the doctor's own --listen), with --backend nccl, and under torchrun (both
forms) and across two network-namespace "hosts", where rank 0 prints one table.

The expected values come from outside the doctor: the port the test picked, the
versions the test process itself sees, the layout the test launched, and for the
measurement that its rows parse as positive times. Every process runs under
tests/launch.py (or a Popen killed in a finally) with a timeout.
"""
import os
import platform
import re
import subprocess
import time

import numpy as np
import pytest

import pyddp
from launch import PY, ROOT, free_port, kill_group, run, spawn_ranks, torchrun
from netns import NetnsUnavailable, exec_prefix, two_hosts
from test_nccl_nogpu import fakes  # noqa: F401  (the compiled fake NCCL/CUDA fixture)
from test_nccl_real import NO_CUDART, nccl_wheel  # noqa: F401  (the installed NCCL wheel)

DOCTOR = [PY, "-m", "pyddp.doctor"]
ALONE = {"RANK": "", "WORLD_SIZE": "", "MASTER_ADDR": "", "MASTER_PORT": ""}
FINDINGS_HEADER = re.compile(r"^  status  check {8}finding$", re.M)
TABLE_COLUMNS = ["rank", "host", "address", "iface", "pyddp", "torch", "numpy", "python",
                 "nccl", "/dev/shm", "single-copy"]


def torch_version():
    import importlib.metadata
    return importlib.metadata.version("torch")


def finding(out, level, check):
    """The text of the first finding with this level and check, its continuation lines
    (indented to the text's column) joined with newlines; None if there is none."""
    m = re.search(rf"^  {re.escape(level)}\s+{re.escape(check)}\s+(.*(?:\n {{23}}.*)*)$", out,
                  re.M)
    return re.sub(r"\n {23}", "\n", m.group(1)) if m else None


def table(out):
    """rank 0's table: {rank: {column: value}}, after checking the header line."""
    lines = out.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith("rank  host"))
    assert lines[i].split() == TABLE_COLUMNS, lines[i]
    rows = {}
    for line in lines[i + 1:]:
        if not line.strip() or line.startswith("("):
            break
        cells = line.split()
        rows[int(cells[0])] = dict(zip(TABLE_COLUMNS, cells))
    return rows


def measurements(out):
    """{link: (ranks, pairs, latency us, busbw GB/s)} from the all_reduce lines."""
    assert re.search(r"^  link  ranks  pairs  8 B latency\s+4\.0M time\s+4\.0M busbw$", out,
                     re.M), out
    rows = re.findall(r"^  (all|shm|tcp)\s+([\d,-]+)\s+(\d+)\s+([\d.]+) us\s+([\d.]+) ms\s+"
                      r"([\d.]+) GB/s$", out, re.M)
    return {r[0]: (r[1], int(r[2]), float(r[3]), float(r[5])) for r in rows}


# ---- alone --------------------------------------------------------------------------

def test_closed_port_fails_naming_the_port_and_rule():
    port = free_port()      # nobody listens on it
    t0 = time.monotonic()
    r = run(DOCTOR + ["--master", f"127.0.0.1:{port}", "--timeout", "1"], env=ALONE,
            timeout=30)
    assert r.returncode == 1, r.output
    assert time.monotonic() - t0 < 15, "the reachability check is bounded by --timeout"
    assert FINDINGS_HEADER.search(r.stdout), r.stdout
    text = finding(r.stdout, "FAIL", "master port")
    assert text, r.stdout
    assert f"127.0.0.1:{port} refused" in text and f"TCP port {port}" in text, text
    assert "security group" in text and f"ufw allow {port}/tcp" in text, text
    assert "from 127.0.0.1 (lo)" in text, text          # the local address routing there
    assert r.stdout.rstrip().splitlines()[-1].startswith("doctor: FAIL: 1 problem"), r.stdout


@pytest.mark.parametrize("server", ["pyddp", "torch"])
def test_alone_against_a_live_store(server):
    if server == "torch":
        import torch.distributed as tdist
        store = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    else:
        store = pyddp.TCPStore("127.0.0.1", 0, is_master=True)
    port = store.port
    try:
        r = run(DOCTOR, env=dict(ALONE, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                timeout=30)
    finally:
        if server == "pyddp":
            store.close()
        del store
    assert r.returncode == 0, r.output
    assert f"master 127.0.0.1:{port}," in r.stdout, r.stdout
    text = finding(r.stdout, "ok", "master port")
    assert text and "answers as a TCPStore" in text, r.stdout
    v = finding(r.stdout, "ok", "versions")
    assert v == (f"pyddp {pyddp.__version__}, torch {torch_version()}, NumPy "
                 f"{np.__version__}, Python {platform.python_version()}"), v
    assert finding(r.stdout, "ok", "advertise").startswith("127.0.0.1 on lo"), r.stdout
    assert r.stdout.rstrip().splitlines()[-1].startswith("doctor: OK"), r.stdout


def test_listen_on_the_master_sees_the_visitor():
    port = free_port()
    p = subprocess.Popen(DOCTOR + ["--master", f"127.0.0.1:{port}", "--listen", "4"],
                         env=dict(os.environ, **ALONE, PYTHONPATH=ROOT), cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        seen = ""
        while "listening on port" not in seen and time.monotonic() < deadline:
            seen += p.stdout.readline()
        r = run(DOCTOR + ["--master", f"127.0.0.1:{port}"], env=ALONE, timeout=30)
        out, _ = p.communicate(timeout=20)
    finally:
        kill_group(p.pid)
    assert r.returncode == 0 and "the doctor listening on" in r.stdout, r.output
    assert p.returncode == 0, seen + out
    assert "reached by" in out and "1 node reached it" in out, seen + out


def doctor_searching(nccl=None, cudart=None, args=()):
    """`python -m pyddp.doctor` alone; with pyddp's search for NCCL or the CUDA runtime
    replaced by these (path, origin) lists where given (what is installed here then
    stays unseen)."""
    env = dict(ALONE, PYDDP_NCCL_LIBRARY="", PYDDP_CUDART_LIBRARY="")
    if nccl is None and cudart is None:
        return run(DOCTOR + list(args), env=env, timeout=60)
    code = "import sys; import pyddp._nccl_backend as nb; "
    for what, cands in (("nccl", nccl), ("cudart", cudart)):
        if cands is not None:
            code += f"nb.{what}_candidates = lambda: {[tuple(c) for c in cands]!r}; "
    code += "import pyddp.doctor as d; sys.exit(d.main(sys.argv[1:]))"
    return run([PY, "-c", code, *args], env=env, timeout=60)


def test_backend_nccl_needs_nccl():
    none = [("/nonexistent/pyddp-test/libnccl.so.2", "test")]
    r = doctor_searching(nccl=none, args=["--backend", "nccl"])
    assert r.returncode == 1, r.output
    text = finding(r.stdout, "FAIL", "NCCL")
    assert text and "PYDDP_NCCL_LIBRARY" in text and "nvidia-nccl-cu12" in text, r.stdout
    assert "/nonexistent/pyddp-test/libnccl.so.2 (test)" in text, text
    r = doctor_searching(nccl=none)                    # backend cpu: only information
    assert r.returncode == 0, r.output
    assert finding(r.stdout, "info", "NCCL") == "not found (backend cpu does not need it)"


@pytest.mark.parametrize("hide_cudart", [False, True], ids=["as-installed", "no-cudart"])
def test_real_nccl_version_reported(nccl_wheel, hide_cudart):  # noqa: F811
    """The NCCL wheel's version and library, found by the default search, with or
    without a CUDA runtime (none: CI); --backend nccl fails without a GPU."""
    cudart = NO_CUDART if hide_cudart else None

    def reported(text, form):
        m = re.match(form, text or "")
        assert m, text
        assert m.group(1) == nccl_wheel["header_version"], text
        assert os.path.realpath(m.group(2)) == nccl_wheel["lib"], text
    r = doctor_searching(cudart=cudart)
    text = finding(r.stdout, "info", "NCCL")
    assert r.returncode == 0, r.output
    reported(text, r"NCCL (\S+) \((.+?)\), CUDA runtime ")
    if hide_cudart:
        assert text.endswith("CUDA runtime not found (backend cpu does not need them)"), text
    r = doctor_searching(cudart=cudart, args=["--backend", "nccl"])
    text = finding(r.stdout, "FAIL", "NCCL")
    if text is None and finding(r.stdout, "ok", "NCCL"):
        pytest.skip("a GPU is visible here: --backend nccl passes")
    assert r.returncode == 1 and text, r.output
    if "no GPU is usable" in text:
        assert not hide_cudart, text
        reported(text, r"NCCL (\S+) \((.+?)\), CUDA runtime ")
    else:
        reported(text, r"backend nccl needs NCCL and the CUDA runtime: NCCL (\S+) \((.+?)\) "
                       r"loads, but could not load the CUDA runtime \(")


def test_nccl_versions_reported(fakes):  # noqa: F811
    env = dict(ALONE, PYDDP_NCCL_LIBRARY=fakes["nccl"], PYDDP_CUDART_LIBRARY=fakes["cudart"])
    r = run(DOCTOR + ["--backend", "nccl"], env=env, timeout=30)
    text = finding(r.stdout, "ok", "NCCL")
    assert r.returncode == 0 and text, r.output
    # fake_nccl.c reports 2.20.5, fake_cudart.c CUDA 12.8 and one device
    assert text.startswith(f"NCCL 2.20.5 ({fakes['nccl']}), CUDA runtime 12.8 "
                           f"({fakes['cudart']}), 1 GPU(s)"), text


# ---- under torchrun ------------------------------------------------------------------

def test_two_ranks_under_torchrun_standalone():
    res = torchrun("doctor_rank.py", 2, timeout=90)
    assert res.returncode == 0, res.output[-4000:]
    rows = table(res.stdout)
    assert sorted(rows) == [0, 1], res.stdout
    for r in rows.values():
        assert (r["pyddp"], r["numpy"], r["python"], r["torch"]) == (
            pyddp.__version__, np.__version__, platform.python_version(), torch_version())
        assert (r["address"], r["iface"], r["host"]) == ("127.0.0.1", "lo", os.uname().nodename)
    assert FINDINGS_HEADER.search(res.stdout), res.stdout
    m = measurements(res.stdout)
    assert set(m) == {"all", "shm"}, res.stdout            # one host: shared memory
    assert m["all"][:2] == ("0-1", 1) and m["all"][2] > 0 and m["all"][3] > 0, m
    assert res.stdout.count("pyddp doctor:") == 1, "only rank 0 prints the report"
    assert "doctor: OK" in res.stdout


def test_version_difference_on_one_rank_fails():
    """Static torchrun form; rank 1 reports pyddp 9.9.9: its cell is marked, the
    versions finding names both, and every rank exits non-zero."""
    port = free_port()
    res = torchrun("doctor_rank.py", 2, standalone=False, timeout=90,
                   extra=["--nnodes=1", "--node_rank=0", "--master_addr=127.0.0.1",
                          f"--master_port={port}"],
                   env={"DOCTOR_FAKE_RANK": "1", "DOCTOR_FAKE": "pyddp=9.9.9"})
    assert res.returncode != 0, res.output[-4000:]
    rows = table(res.stdout)
    assert rows[0]["pyddp"] == pyddp.__version__ and rows[1]["pyddp"] == "9.9.9*", rows
    assert "(* differs from most ranks: pyddp)" in res.stdout
    text = finding(res.stdout, "FAIL", "versions")
    assert text and "pyddp differs between ranks" in text, res.stdout
    assert f"{pyddp.__version__} on rank 0" in text and "9.9.9 on rank 1" in text, text
    assert "doctor: FAIL" in res.stdout
    assert re.search(r"exitcode\s*:\s*1", res.output), "rank 1 exits non-zero too"


def test_two_hosts_through_network_namespaces():
    """Ranks 0, 1 in one namespace and 2 in another: three rows, the interfaces marked
    as differing, and an all_reduce row for each of shm and tcp."""
    layout = "AAB"
    try:
        with two_hosts() as hosts:
            host = {"A": hosts[0], "B": hosts[1]}
            res = spawn_ranks("doctor_rank.py", 3, master_addr=host["A"].addr, timeout=90,
                              prefix=lambda r: exec_prefix(host[layout[r]].ns))
    except NetnsUnavailable as e:
        pytest.skip(f"two hosts need network namespaces: {e}")
    assert all(r.returncode == 0 for r in res), [r.output[-3000:] for r in res]
    out = res[0].stdout
    assert "3 ranks on 2 hosts" in out, out
    rows = table(out)
    want = {r: hosts[0 if layout[r] == "A" else 1] for r in range(3)}
    for r, h in want.items():
        assert rows[r]["address"] == h.addr, rows
        assert rows[r]["iface"].rstrip("*") == h.ifname, rows
    assert rows[2]["iface"].endswith("*") and "iface" in out.split("differs from most")[1]
    m = measurements(out)
    assert m["shm"][:2] == ("0-1", 1) and m["tcp"][:2] == ("0,2", 2), m
    assert m["all"][:2] == ("0-2", 3), m


# ---- conclusions from made-up facts (no processes) -----------------------------------

def made_up(host, addr, iface="eth0", **over):
    """This process's facts, moved to another host and address."""
    from pyddp.doctor import _facts as _doctor_facts
    f = _doctor_facts.gather(None, 2.0)
    f.update(host=host, host_id=f"boot|{host}|net", primary=addr)
    f["advertise"] = {"addr": addr, "iface": iface, "how": "test", "fallback": False,
                      "error": ""}
    f["names"] = {"name": host, "fqdn": host, "addrs": {host: [addr]}}
    for k, v in over.items():
        f[k] = v
    return f


def test_c10d_hostname_on_loopback_across_hosts():
    """torchrun's c10d form: MASTER_ADDR is rank 0's host name, which maps to 127.0.1.1
    there, so rank 0 advertises loopback while rank 1 is on another host."""
    from pyddp.doctor import _checks as chk
    a = made_up("node-a", "127.0.0.1", "lo")
    a["names"]["addrs"]["node-a"] = ["127.0.1.1"]
    b = made_up("node-b", "10.0.0.2")
    fs = chk.world_findings([a, b], "cpu")
    text = finding(chk.findings_block(fs), "FAIL", "advertise")
    assert text and text.startswith("rank 0 (node-a) advertise loopback") and \
        "PYDDP_SOCKET_IFNAME" in text, fs
    warn = [t for lv, c, t in chk.node_findings(a, "cpu", 1, True, "node-a")
            if (lv, c) == ("warn", "host name")]
    assert warn and "127.0.1.1 (loopback)" in warn[0] and "--local-addr=127.0.0.1" in warn[0]
    # the same name on one host only, or a numeric MASTER_ADDR: no warning
    for multi, master in ((False, "node-a"), (True, "10.0.0.1")):
        assert not [f for f in chk.node_findings(a, "cpu", 1, multi, master)
                    if f[0] == "warn" and f[1] == "host name"]


def test_made_up_differences_between_hosts():
    from pyddp.doctor import _checks as chk
    a, b = made_up("node-a", "172.17.0.1"), made_up("node-b", "172.17.0.1")
    b["settings"] = dict(b["settings"], small_bytes=1024)
    b["nccl"] = {"version": "2.21.5", "path": "x", "cudart_path": "y", "cudart": "12.4",
                 "devices": 1, "device_error": ""}
    out = chk.findings_block(chk.world_findings([a, b], "cpu"))
    assert "all advertise 172.17.0.1" in finding(out, "FAIL", "advertise"), out
    assert "PYDDP_SMALL_BYTES differs" in finding(out, "FAIL", "settings"), out
    assert "NCCL differs" in finding(out, "warn", "versions"), out   # backend cpu
    out = chk.findings_block(chk.world_findings([a, b], "nccl"))
    assert "NCCL differs" in finding(out, "FAIL", "versions"), out


def test_made_up_slow_paths_are_warnings():
    from pyddp.doctor import _checks as chk
    f = made_up("node-a", "10.0.0.1", shm_free=16 << 20,
                cma={"ptrace_scope": 1, "enabled": True, "probe": "error: Operation not "
                     "permitted"})
    fs = chk.node_findings(f, "cpu", 8, None, "10.0.0.1")
    out = chk.findings_block(fs)
    assert "16.0M free, 8 ranks per host need about" in finding(out, "warn", "/dev/shm"), out
    text = finding(out, "warn", "single-copy")
    assert "ptrace_scope 1" in text and "kernel.yama.ptrace_scope=0" in text, out
    assert chk.verdict(fs)[0] == 0, out           # warnings only: exit status 0
