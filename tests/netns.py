"""Two "hosts" on one machine: network namespaces joined by a veth pair.

Ranks started with ``ip netns exec <ns>`` in different namespaces publish different
host identities (the namespace is part of it), so pyddp connects them over TCP through
the veth link, while ranks in the same namespace use shared memory. Used by
tests/test_transport.py (mixed layouts) and benchmarks/ (the two-host comparison).

Needs root and iproute2. Addresses come from 10.213.0.0/16, one /30 per pair of
namespaces, chosen from the process id so that concurrent runs do not collide; the
namespaces (and with them the veth pair) are deleted on exit, also after errors.
"""
import collections
import contextlib
import os
import shutil
import subprocess

Host = collections.namedtuple("Host", "ns addr ifname")


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not root, no iproute2, ...)."""


def _ip(*args):
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if r.returncode != 0:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {r.stderr.strip()}")


def _cap_each_flow(ns, dev, rate, by):
    """Cap every TCP flow leaving dev at rate, as clouds cap a single flow: an htb class
    per bucket of a u32 hash on the low byte of the flow's `by` port ("sport" or
    "dport": the side of the flow that is not a listening port, so that the flows of
    one peer pair land in different buckets; two flows may share one, rarely, with
    256 buckets). Traffic that is not TCP is not capped."""
    mask = "0x000000ff" if by == "dport" else "0x00ff0000"
    cmds = [f"qdisc add dev {dev} root handle 1: htb default 1",
            f"class add dev {dev} parent 1: classid 1:1 htb rate 100gbit quantum 60000",
            f"filter add dev {dev} parent 1: prio 1 handle 2: protocol ip u32 divisor 256"]
    for i in range(256):
        cmds.append(f"class add dev {dev} parent 1: classid 1:{0x100 + i:x} htb rate {rate} "
                    f"ceil {rate} burst 256k cburst 256k quantum 60000")
        cmds.append(f"filter add dev {dev} parent 1: prio 1 protocol ip u32 ht 2:{i:x}: "
                    f"match u32 0 0 flowid 1:{0x100 + i:x}")
    cmds.append(f"filter add dev {dev} parent 1: prio 1 protocol ip u32 ht 800:: match ip "
                f"protocol 6 0xff hashkey mask {mask} at 20 link 2:")
    r = subprocess.run(["tc", "-n", ns, "-batch", "-"], input="\n".join(cmds) + "\n",
                       capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise NetnsUnavailable(f"tc per-flow cap {rate} failed: {r.stderr.strip()[:500]}")


@contextlib.contextmanager
def two_hosts(rate=None, flow_rate=None):
    """Yield (Host a, Host b): two namespaces with loopback up and a veth link between
    them (Host: namespace name, its address, its veth interface). rate (e.g. "2gbit")
    caps each direction with a token-bucket filter, so the link, not the CPU copying
    through veth, is the bottleneck, as between real hosts. flow_rate instead caps each
    TCP flow in each direction (a cloud's per-flow cap), assuming connections are made
    from b to a (pyddp's higher ranks connect to the lower ones, and rank 0 is in a).
    Raises NetnsUnavailable when they cannot be made; whatever was made is removed."""
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root")
    if shutil.which("ip") is None:
        raise NetnsUnavailable("iproute2 (`ip`) is not installed")
    tag = os.getpid() % 16000
    ns = (f"pyddp{tag}a", f"pyddp{tag}b")
    veth = (f"pdv{tag}a", f"pdv{tag}b")
    base = 4 * tag   # a /30 inside 10.213.0.0/16
    addr = (f"10.213.{base // 256}.{base % 256 + 1}", f"10.213.{base // 256}.{base % 256 + 2}")
    made = []
    try:
        for n in ns:
            _ip("netns", "add", n)
            made.append(n)
            _ip("-n", n, "link", "set", "lo", "up")
        _ip("link", "add", veth[0], "netns", ns[0], "type", "veth", "peer", "name", veth[1],
            "netns", ns[1])
        for n, v, a in zip(ns, veth, addr):
            _ip("-n", n, "addr", "add", f"{a}/30", "dev", v)
            _ip("-n", n, "link", "set", v, "up")
            if rate:
                r = subprocess.run(["tc", "-n", n, "qdisc", "add", "dev", v, "root", "tbf",
                                    "rate", rate, "burst", "512kb", "latency", "20ms"],
                                   capture_output=True, text=True, timeout=20)
                if r.returncode != 0:
                    raise NetnsUnavailable(f"tc tbf rate {rate} failed: {r.stderr.strip()}")
            elif flow_rate:   # a's egress: flows to b's ephemeral ports; b's: from them
                _cap_each_flow(n, v, flow_rate, "dport" if n == ns[0] else "sport")
        yield Host(ns[0], addr[0], veth[0]), Host(ns[1], addr[1], veth[1])
    finally:
        for n in made:
            subprocess.run(["ip", "netns", "del", n], capture_output=True, timeout=20)


def exec_prefix(ns):
    """Command prefix that runs a command inside namespace ns."""
    return ["ip", "netns", "exec", ns]


Routed = collections.namedtuple("Routed", "a b router router_ifs")


@contextlib.contextmanager
def routed_hosts():
    """Yield Routed(a, b, router, router_ifs): two host namespaces, each with a veth link
    to a third namespace that routes between them (as two VMs behind a router or a
    cloud's virtual network), and a default route via the router, so a lookup toward a
    public address finds the host's own interface. router_ifs: the router's two veth
    interfaces, where partition() drops packets. Addresses from 10.214.0.0/16, two /30s
    chosen from the process id; everything is deleted on exit, also after errors."""
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        raise NetnsUnavailable("iproute2 (`ip`, `tc`) is not installed")
    tag = os.getpid() % 8000
    ns = {k: f"pyddp{tag}{k}" for k in ("a", "b", "r")}
    base = 8 * tag
    pre = f"10.214.{base // 256}."
    low = base % 256
    addr = {"a": pre + str(low + 1), "ra": pre + str(low + 2),
            "b": pre + str(low + 5), "rb": pre + str(low + 6)}
    made = []
    try:
        for n in ns.values():
            _ip("netns", "add", n)
            made.append(n)
            _ip("-n", n, "link", "set", "lo", "up")
        for h in ("a", "b"):
            host_if, router_if = f"pdr{tag}{h}", f"pdr{tag}r{h}"
            _ip("link", "add", host_if, "netns", ns[h], "type", "veth", "peer", "name",
                router_if, "netns", ns["r"])
            _ip("-n", ns[h], "addr", "add", f"{addr[h]}/30", "dev", host_if)
            _ip("-n", ns["r"], "addr", "add", f"{addr['r' + h]}/30", "dev", router_if)
            _ip("-n", ns[h], "link", "set", host_if, "up")
            _ip("-n", ns["r"], "link", "set", router_if, "up")
            _ip("-n", ns[h], "route", "add", "default", "via", addr["r" + h])
        r = subprocess.run(exec_prefix(ns["r"]) + ["sysctl", "-qw", "net.ipv4.ip_forward=1"],
                           capture_output=True, text=True, timeout=20)
        if r.returncode != 0:
            raise NetnsUnavailable(f"cannot enable forwarding: {r.stderr.strip()}")
        yield Routed(Host(ns["a"], addr["a"], f"pdr{tag}a"), Host(ns["b"], addr["b"], f"pdr{tag}b"),
                     ns["r"], (f"pdr{tag}ra", f"pdr{tag}rb"))
    finally:
        for n in made:
            subprocess.run(["ip", "netns", "del", n], capture_output=True, timeout=20)


def partition(routed):
    """Drop every packet the router forwards, in both directions, as a vanished host or
    a network partition does: no FIN, no RST, nothing. A token bucket with a one-byte
    burst (netem is not available everywhere) passes no packet at all."""
    for dev in routed.router_ifs:
        r = subprocess.run(["tc", "-n", routed.router, "qdisc", "add", "dev", dev, "root",
                            "tbf", "rate", "1kbit", "burst", "1", "latency", "1ms"],
                           capture_output=True, text=True, timeout=20)
        if r.returncode != 0:
            raise NetnsUnavailable(f"tc tbf on {dev} failed: {r.stderr.strip()}")


Bridged = collections.namedtuple("Bridged", "hosts switch ports")


@contextlib.contextmanager
def bridged_hosts(n, last=None):
    """Yield Bridged(hosts, switch, ports): n host namespaces on one /24, each with a veth
    link to a bridge in a switch namespace (as VMs in one private network); ports[i] is
    host i's port on the bridge. Addresses from 10.215.0.0/16,
    one /24 chosen from the process id, host i's last byte last[i] (default i + 1);
    everything is deleted on exit, also after errors."""
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root")
    if shutil.which("ip") is None:
        raise NetnsUnavailable("iproute2 (`ip`) is not installed")
    tag = os.getpid() % 250
    sw = f"pyddp{tag}sw"
    made = []
    try:
        _ip("netns", "add", sw)
        made.append(sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        hosts, ports = [], []
        for i in range(n):
            ns, host_if, port = f"pyddp{tag}h{i}", f"pdb{tag}h{i}", f"pdb{tag}p{i}"
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "add", host_if, "netns", ns, "type", "veth", "peer", "name", port,
                "netns", sw)
            addr = f"10.215.{tag}.{last[i] if last else i + 1}"
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", host_if)
            _ip("-n", ns, "link", "set", host_if, "up")
            _ip("-n", sw, "link", "set", port, "master", "br0")
            _ip("-n", sw, "link", "set", port, "up")
            hosts.append(Host(ns, addr, host_if))
            ports.append(port)
        yield Bridged(hosts, sw, ports)
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)

