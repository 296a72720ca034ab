"""``python -m pyddp.bench --json FILE --plot FILE.png`` at 2 ranks with tiny sizes: the
JSON holds exactly the rows rank 0 printed, the figure is a PNG, ``python -m
pyddp.bench_plot`` redraws it from the JSON, and without matplotlib ``--plot`` stops
before timing anything with a message naming the ``plot`` extra.

matplotlib is in the test extra, so CI draws; elsewhere the drawing tests skip without
it, and under CI (CI=true) they fail instead, so that CI cannot pass without running
them. Every run has a timeout and its process group is killed by id (tests/launch.py).
"""
import json
import os

import pytest

from launch import ROOT, torchrun

BENCH = os.path.join(ROOT, "pyddp", "bench.py")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = ["-b", "8", "-e", "4K", "-f", "8", "-r", "2", "-t", "2", "-w", "1"]


def need_matplotlib():
    """Skip without matplotlib; under CI, which must draw, fail."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        if os.environ.get("CI", "").lower() in ("1", "true"):
            pytest.fail("matplotlib is missing: CI must run this test (the test extra has it)")
        pytest.skip("matplotlib is not installed (pip install -e '.[plot]')")


def printed_rows(stdout):
    """Rank 0's table rows (the lines that are not comments), split into fields."""
    return [line.split() for line in stdout.splitlines()
            if line.strip() and not line.startswith("#") and line.split()[1].isdigit()]


def assert_png(path):
    with open(path, "rb") as f:
        head = f.read(8)
    assert head == PNG_MAGIC, head
    assert os.path.getsize(path) > 1000


def test_json_matches_printed_rows_and_plot_is_png(tmp_path):
    need_matplotlib()
    out_json, png = tmp_path / "r.json", tmp_path / "r.png"
    res = torchrun(BENCH, 2, args=TINY + ["--compare-gloo", "--json", str(out_json),
                                          "--plot", str(png)], timeout=240)
    assert res.returncode == 0, res.output[-4000:]
    assert_png(png)
    data = json.loads(out_json.read_text())
    assert data["world"] == 2 and data["hosts"] == 1
    assert data["backends"] == ["pyddp", "gloo"]
    printed = printed_rows(res.stdout)
    assert len(printed) == len(data["rows"]) == 4 * 4, res.stdout   # 4 ops x 8 B .. 4 KiB
    for fields, r in zip(printed, data["rows"]):
        want = [r["collective"], str(r["size"]), str(r["count"]), r["type"], r["redop"],
                str(r["root"])]
        for b in ("pyddp", "gloo"):
            x = r["backends"][b]
            want += ["|", f"{x['time_us']:.1f}", f"{x['algbw']:.3f}", f"{x['busbw']:.3f}",
                     str(x["wrong"])]
        want += ["|", f"{r['vs_gloo']['pyddp']:.2f}x"]
        assert fields == want
        assert all(x["wrong"] == 0 for x in r["backends"].values())
    # redrawn from the saved results alone
    from pyddp import bench_plot
    again = tmp_path / "again.png"
    assert bench_plot.main([str(out_json), str(again), "--note", "redrawn"]) == 0
    assert_png(again)


def test_plot_without_matplotlib_names_the_extra(tmp_path):
    """A matplotlib that fails to import (first on PYTHONPATH): every rank stops at once,
    rank 0 says what to install, nothing is timed or written."""
    fake = tmp_path / "fake" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    png = tmp_path / "r.png"
    res = torchrun(BENCH, 2, args=TINY + ["--ops", "all_reduce", "--plot", str(png)],
                   env={"PYTHONPATH": f"{tmp_path / 'fake'}{os.pathsep}{ROOT}"}, timeout=120)
    assert res.returncode != 0
    assert 'pip install "pyddp[plot]"' in res.output, res.output[-4000:]
    assert "all_reduce" not in res.stdout and not png.exists()
