"""torchrun restarts and network settings: a restarted attempt never reads the previous
attempt's keys; PYDDP_PORT_RANGE and PYDDP_SOCKET_IFNAME choose what peers connect to."""
import re

from launch import spawn_ranks, torchrun
from test_errors import results


def test_torchrun_restart_starts_clean():
    res = torchrun("restart.py", 2, extra=["--max-restarts=1"], timeout=180)
    assert res.returncode == 0, res.output[-5000:]
    assert sorted(re.findall(r"rank (\d): PASS attempt=1", res.output)) == ["0", "1"], \
        res.output[-4000:]


def test_port_range_and_interface():
    res = spawn_ranks("netcfg.py", 3, env={"PYDDP_PORT_RANGE": "45100-45120",
                                          "PYDDP_SOCKET_IFNAME": "lo"}, timeout=60)
    rs = results(res)
    assert len(rs) == 3 and all(r["ok"] for r in rs), [r.output for r in res]
    for r in rs:
        for desc in r["peers"].split(";"):
            m = re.search(r"\((.+):(\d+)\)", desc)
            assert m, desc
            assert m.group(1) == "127.0.0.1", desc       # lo's address
            port = int(m.group(2))
            assert port == 0 or 45100 <= port <= 45120, desc
