"""Hugging Face Accelerate on pyddp's backend (where `accelerate` is installed: the
optional extra "accelerate"). Accelerate's CPU path picks gloo or mpi itself, so the
documented pattern makes torch's default group with backend "pyddp" first and then builds
Accelerator(cpu=True), which keeps it. The same training under Accelerate's own gloo
group must give bit-identical weights (two ranks: the sums are order-free), and
accelerator.gather must return every rank's tensors on both of its paths."""
import json
import re

import pytest

from launch import reference_exit_abort, torchrun

pytest.importorskip("accelerate")


def _rows(res, reference=False):
    done = [f'RESULT {{"rank": {r}, ' for r in range(2)]
    ok = res.returncode == 0 or (reference and reference_exit_abort(res, done))
    assert ok, res.output[-6000:]
    rows = [json.loads(m) for m in re.findall(r"^RESULT (.*)$", res.stdout, re.M)]
    assert sorted(r["rank"] for r in rows) == [0, 1], res.output[-4000:]
    return sorted(rows, key=lambda r: r["rank"])


def test_accelerate_on_pyddp_matches_gloo():
    ours = _rows(torchrun("accelerate_train.py", 2, args=["pyddp"], timeout=180))
    # torch's gloo reference now and then aborts at exit, after both ranks printed
    # their results (twice in a row under CI's load): its results still count
    gloo = _rows(torchrun("accelerate_train.py", 2, args=["gloo"], timeout=180), reference=True)
    want = {"v": [[0.0, 10.0], [1.0, 11.0]], "i": [[0, 0], [1, 2]]}
    for o, g in zip(ours, gloo):
        assert o["backend"] == "pyddp" and g["backend"] == "gloo", (o, g)
        assert o["world"] == 2 and o["wrapped"] and g["wrapped"], (o, g)
        assert o["weights"] == g["weights"], (o, g)
        for path in ("listed", "flat"):
            got = {k: [v[2 * i:2 * i + 2] for i in range(2)] if isinstance(v[0], (int, float))
                   else v for k, v in o[path].items()}
            assert got == want, (path, o[path])
    assert ours[0]["weights"] == ours[1]["weights"]
