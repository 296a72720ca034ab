"""What ``python -m pyddp.doctor`` finds out about this process's node, and what it
concludes from it.

Facts (a JSON-able dict, the same on every rank so that rank 0 can put them side by
side): versions, the address pyddp would advertise and its interface, how the host name
resolves, /dev/shm space, whether the shared-memory single-copy path may be used, NCCL
and the CUDA runtime, and the PYDDP_* settings in effect. Findings are
``(level, check, text)`` with level "ok", "info", "warn" (would only slow a job) or
"FAIL" (would stop one, and the text says what to do).

Every probe is bounded: name lookups run on a daemon thread the caller walks away from
at the timeout, the single-copy probe is a child process with a timeout, and the master
port is tried through pyddp's own TCPStore client with its connect deadline. Nothing
here starts a process group.
"""
import importlib.metadata
import ipaddress
import os
import platform
import socket
import subprocess
import sys
import threading

import numpy as np

from .. import _C, _env, _nccl_backend, _rendezvous
from .._version import __version__

YAMA = "/proc/sys/kernel/yama/ptrace_scope"


# ---- small helpers --------------------------------------------------------------------

def human_bytes(n):
    """1536 -> '1.5K'; None -> '-'."""
    if n is None:
        return "-"
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            return f"{n:.0f}" if unit == "" else f"{n:.1f}{unit}"
        n /= 1024.0


def bounded(fn, timeout, *args):
    """fn(*args) on a daemon thread; its result, or raises TimeoutError at the timeout
    (the thread is left to finish alone: a hung resolver cannot hold the doctor)."""
    box = {}

    def body():
        try:
            box["v"] = fn(*args)
        except BaseException as e:   # handed to the caller
            box["e"] = e
    t = threading.Thread(target=body, daemon=True, name="pyddp-doctor-probe")
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"no answer within {timeout:.1f} s")
    if "e" in box:
        raise box["e"]
    return box["v"]


def resolve(name, timeout):
    """The addresses name resolves to (numeric strings, in resolver order, unique).
    Raises OSError (socket.gaierror) or TimeoutError."""
    infos = bounded(socket.getaddrinfo, timeout, name, None, 0, socket.SOCK_STREAM)
    out = []
    for info in infos:
        a = info[4][0]
        if a not in out:
            out.append(a)
    return out


def is_loopback(addr):
    try:
        return ipaddress.ip_address(addr.split("%")[0]).is_loopback
    except ValueError:
        return False


def iface_of(addr):
    """The name of the interface that holds addr ('' when none does), as
    PYDDP_SOCKET_IFNAME would name it (pyddp._env's lookup)."""
    return _env.interface_of(addr)


# ---- facts ----------------------------------------------------------------------------

def versions():
    """pyddp, torch (from its metadata: torch is never imported), NumPy and Python.
    PYDDP_DOCTOR_FAKE_VERSION overrides entries, for tests ("9.9" alone means pyddp)."""
    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = "-"
    v = {"pyddp": __version__, "torch": torch, "numpy": np.__version__,
         "python": platform.python_version()}
    for part in filter(None, (_C.setting("PYDDP_DOCTOR_FAKE_VERSION") or "").split(",")):
        pkg, _, ver = part.rpartition("=")
        v[pkg.strip() or "pyddp"] = ver.strip()
    return v


def advertise(master, timeout):
    """What this rank would advertise: dict addr, iface, how (in words), fallback
    (loopback only because the master has no route or does not resolve), error (set
    when init_process_group would fail: a bad PYDDP_SOCKET_IFNAME). master: the
    master's host, resolved here with a bound and handed to _env.advertise_address as
    a number, so that the C route lookup never waits on DNS."""
    ifname = _env.socket_ifname()
    out = {"addr": "", "iface": "", "how": "", "fallback": False, "error": ""}
    target, why = None, "no master known"
    if master and not ifname:
        try:
            target = resolve(master, timeout)[0]
        except (OSError, TimeoutError) as e:
            why, out["fallback"] = f"{master} does not resolve ({e})", True
    try:
        out["addr"] = _env.advertise_address(target)
    except _C.DistError as e:
        out["error"] = f"PYDDP_SOCKET_IFNAME={ifname}: {e}"
        return out
    out["iface"] = ifname or iface_of(out["addr"])
    if ifname:
        out["how"] = f"PYDDP_SOCKET_IFNAME={ifname}"
    elif not target:
        out["how"] = f"{why}: loopback"
    elif is_loopback(out["addr"]) and not is_loopback(target):
        out["how"], out["fallback"] = f"no route to {master}: loopback", True
    else:
        out["how"] = f"the local address that routes to {master}"
    return out


def hostnames(timeout):
    """This host's name and fully qualified name (what torchrun's c10d form tells the
    workers) and what each resolves to here."""
    out = {"name": socket.gethostname(), "fqdn": "", "addrs": {}}
    try:
        out["fqdn"] = bounded(socket.getfqdn, timeout)
    except TimeoutError:
        out["fqdn"] = ""
    for n in dict.fromkeys(filter(None, (out["name"], out["fqdn"]))):
        try:
            out["addrs"][n] = resolve(n, timeout)
        except (OSError, TimeoutError) as e:
            out["addrs"][n] = [f"error: {e}"]
    return out


def shm_free():
    """Bytes free in /dev/shm for this user, or None when it is missing."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


# A child reads 8 bytes of its parent's memory with process_vm_readv: the same check
# the shared-memory link makes between two ranks (a parent is no ancestor of its child,
# so Yama's scope 1 refuses this as it refuses two sibling ranks).
_CMA_PROBE = r"""
import ctypes, os, sys
class iov(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
libc = ctypes.CDLL(None, use_errno=True)
buf = ctypes.create_string_buffer(8)
lo, re = iov(ctypes.addressof(buf), 8), iov(int(sys.argv[2]), 8)
n = libc.process_vm_readv(int(sys.argv[1]), ctypes.byref(lo), 1, ctypes.byref(re), 1, 0)
e = ctypes.get_errno()
print(buf.raw.hex() if n == 8 else "error: " + os.strerror(e))
"""
_CMA_WORD = b"pyddpCMA"


def single_copy(timeout):
    """dict ptrace_scope (int, or None without Yama), setting (PYDDP_SHM_CMA), probe
    ('allowed', or why not)."""
    import ctypes
    out = {"ptrace_scope": None, "enabled": bool(_C.setting("PYDDP_SHM_CMA")), "probe": ""}
    try:
        with open(YAMA) as f:
            out["ptrace_scope"] = int(f.read().strip())
    except (OSError, ValueError):
        pass
    word = ctypes.create_string_buffer(_CMA_WORD, 8)
    try:
        r = subprocess.run([sys.executable, "-I", "-S", "-c", _CMA_PROBE, str(os.getpid()),
                            str(ctypes.addressof(word))], capture_output=True, text=True,
                           timeout=timeout)
        got = r.stdout.strip()
        out["probe"] = "allowed" if got == _CMA_WORD.hex() else (got or r.stderr.strip()[-200:]
                                                                or f"exit {r.returncode}")
    except (OSError, subprocess.TimeoutExpired) as e:
        out["probe"] = f"probe failed: {e}"
    return out


def nccl():
    """NCCL and the CUDA runtime as _nccl_backend.load() finds them. When they do not
    load, error says why, and version and path are still there if NCCL alone loads (the
    CUDA runtime is what is missing)."""
    try:
        i = _nccl_backend.load()
    except _C.BackendUnavailableError as e:
        out = {"error": str(e)}
        try:
            p = _nccl_backend.probe_nccl()
        except _C.BackendUnavailableError:
            return out
        return dict(out, version=p["nccl_version"], path=p["nccl_path"])
    cv = i["cudart_version"]
    return {"version": i["nccl_version"], "path": i["nccl_path"], "cudart_path": i["cudart_path"],
            "cudart": f"{cv // 1000}.{cv % 1000 // 10}" if cv else "?",
            "devices": i["device_count"], "device_error": i["device_error"]}


def settings():
    """The PYDDP_* environment as this process's pyddp reads it: dict set (the
    settings given), unknown (PYDDP_* names that are no setting), errors (values that
    init_process_group would refuse), and the effective values that other ranks'
    findings need (small_bytes, which every rank must share; shm_disable; ring_bytes)."""
    known = {s["name"] for s in _C.settings()}
    errors = []
    for check in (_env.port_range, lambda: _env.timeout_seconds(None)):
        try:
            check()
        except _C.DistValueError as e:
            errors.append(str(e))
    # the token never leaves the process (facts travel through the store, which under
    # torchrun anyone can read): only that it is set
    return {"set": {k: "(set, hidden)" if k == "PYDDP_AUTH_TOKEN" else v
                    for k, v in os.environ.items() if k in known and v != ""},
            "unknown": sorted(k for k in os.environ if k.startswith("PYDDP_")
                              and k not in known),
            "errors": errors, "small_bytes": _C.setting("PYDDP_SMALL_BYTES"),
            "shm_disable": bool(_C.setting("PYDDP_SHM_DISABLE")),
            "ring_bytes": _C.setting("PYDDP_SHM_RING_BYTES")}


def gather(master, timeout):
    """Every fact about this process's node (a JSON-able dict). master: MASTER_ADDR (or
    None); timeout: the bound of each name lookup and of the single-copy probe."""
    return {"host": socket.gethostname(), "host_id": _env.host_identity(),
            "versions": versions(), "advertise": advertise(master, timeout),
            "names": hostnames(timeout), "primary": _rendezvous._primary_address(),
            "shm_free": shm_free(),
            "cma": single_copy(max(timeout, 2.0)), "nccl": nccl(), "settings": settings()}
