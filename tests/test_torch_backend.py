"""pyddp as torch.distributed's backend "pyddp", from scripts that never import pyddp.

* The entry point: `import torch` registers the backend without importing pyddp, in
  well under a millisecond; `import pyddp.torch_backend` registers the same creator
  (idempotent) for TORCH_DEVICE_BACKEND_AUTOLOAD=0; a failing registration never
  raises out of the hook.
* One torchrun launch per world size (2 and 3) runs tests/workers/torch_backend.py:
  every torch collective against arithmetic, new_group subgroups, object collectives,
  barriers, functional collectives, DistributedSampler; torch's DDP over "pyddp" against
  torch's DDP over a gloo group in the same processes (nine configurations, two comm
  hooks among them, weights compared after every step); FSDP2 against DDP; DTensor.
* Errors arrive as torch's DistError family (mismatch, the group's timeout, a dead
  peer, a peer killed in the middle of torch DDP's backward); a torchrun restart starts
  clean; a FileStore init and re-inits work.
"""
import json
import re

import pytest

from launch import PY, run, spawn_ranks, torchrun

torch = pytest.importorskip("torch")

SECTIONS = ["all_reduce", "tensor_kinds", "rooted", "gathers", "all_to_all", "p2p",
            "objects_and_barriers", "subgroups", "fsdp2", "dtensor"] + \
    [f"ddp_{c}" for c in ("plain", "tiny_buckets", "bucket_view", "no_sync", "unused",
                          "static_graph", "buffers", "fp16_hook", "powersgd")]


def _ranks_passing(out, section):
    return sorted(int(r) for r in re.findall(rf"PASS {section} rank=(\d+)", out))


@pytest.mark.parametrize("ws", [2, 3])
def test_torch_stack_on_pyddp(ws):
    res = torchrun("torch_backend.py", ws, timeout=420)
    out = res.output
    missing = [s for s in SECTIONS if _ranks_passing(out, s) != list(range(ws))]
    assert not missing and res.returncode == 0, f"sections not passed: {missing}\n{out[-8000:]}"
    assert out.count("pyddp_imported_before_init=False") == ws, out[-3000:]
    assert "backend=pyddp" in out


_PROBE = r"""
import json, os, sys, time
t0 = time.perf_counter()
import torch
t_import = time.perf_counter() - t0
import torch.distributed as dist
plugin = dist.Backend._plugins.get("PYDDP")
info = {"registered": plugin is not None, "pyddp_imported": "pyddp" in sys.modules,
        "hook_imported": "_pyddp_torch_hook" in sys.modules, "import_torch_s": t_import}
if os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD") == "0":
    t0 = time.perf_counter()
    import _pyddp_torch_hook
    t1 = time.perf_counter()
    ok = _pyddp_torch_hook.register()
    info["hook_s"] = time.perf_counter() - t0
    info["register_s"] = time.perf_counter() - t1
    info["registered_by_hook"] = ok
    dist.Backend._plugins.pop("PYDDP")
    info["after_pop"] = "PYDDP" in dist.Backend._plugins
import pyddp.torch_backend
info["creator_is_hook_stub"] = (dist.Backend._plugins["PYDDP"].creator_fn is
                                sys.modules["_pyddp_torch_hook"]._create)
info["extended_api"] = dist.Backend._plugins["PYDDP"].extended_api
info["capability"] = dist.Backend.backend_capability.get("pyddp")
info["defaults"] = dict(dist.Backend.default_device_backend_map)
from importlib.metadata import entry_points
info["entry_points"] = [e.value for e in entry_points(group="torch.backends") if e.name == "pyddp"]
print("PROBE " + json.dumps(info))
"""


def _probe(env):
    res = run([PY, "-c", _PROBE], env=env, timeout=120, cwd="/")
    assert res.returncode == 0, res.output[-4000:]
    return json.loads(re.search(r"^PROBE (.*)$", res.stdout, re.M).group(1))


def test_entry_point_registers_without_importing_pyddp():
    info = _probe({"TORCH_DEVICE_BACKEND_AUTOLOAD": "1"})
    assert info["entry_points"] == ["_pyddp_torch_hook:register"], info
    assert info["registered"] and info["hook_imported"] and not info["pyddp_imported"], info
    assert info["creator_is_hook_stub"] and info["extended_api"], info
    assert info["capability"] == ["cpu", "cuda"], info
    # registering claims no device: gloo and nccl stay torch's defaults
    assert info["defaults"]["cpu"] == "gloo" and info["defaults"]["cuda"] == "nccl", info


def test_hook_cost_and_autoload_off():
    info = _probe({"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert not info["registered"] and not info["hook_imported"], info
    assert info["registered_by_hook"] and not info["after_pop"], info
    # import plus registration of the hook (the import compiles the module when no
    # bytecode is cached); the bounds are generous for a loaded CI machine
    assert info["register_s"] < 0.002 and info["hook_s"] < 0.005, info
    print(f"hook: register {info['register_s'] * 1e6:.0f} us, import+register "
          f"{info['hook_s'] * 1e6:.0f} us (import torch: {info['import_torch_s']:.2f} s)")
    assert info["creator_is_hook_stub"], info      # pyddp.torch_backend registered it


def test_hook_never_raises(monkeypatch):
    import torch.distributed as dist
    import _pyddp_torch_hook as hook

    def boom(cls, *a, **k):
        raise RuntimeError("registry broken")
    monkeypatch.delitem(dist.Backend._plugins, "PYDDP", raising=False)
    monkeypatch.setattr(dist.Backend, "register_backend", classmethod(boom))
    assert hook.register() is False


def test_errors_arrive_as_torch_dist_errors():
    res = torchrun("torch_backend.py", 2, args=["errors"], timeout=180)
    out = res.output
    # one case per match, even if another rank's output ever lands inside the line
    cases = re.findall(r"ERRCASE (\w+) rank=(\d) type=(\w+)((?:(?!ERRCASE)[^\n])*)", out)
    mism = sorted(int(r) for c, r, t, rest in cases if c == "mismatch" and
                  t == "CollectiveMismatchError" and "pyddp_class=True names_both=True" in rest)
    assert mism == [0, 1], out[-6000:]
    rep = sorted((int(r), rest.strip()) for c, r, t, rest in cases if c == "repeated")
    assert rep == [(0, "missed=0 alive=none"), (1, "missed=0 alive=none")], out[-6000:]
    tmo = [rest for c, r, t, rest in cases if c == "timeout"]
    assert len(tmo) == 1 and "timeouterror=True" in tmo[0], out[-6000:]
    assert float(re.search(r"after=([\d.]+)", tmo[0]).group(1)) < 15, tmo
    dead = [rest for c, r, t, rest in cases if c == "dead"]
    assert len(dead) == 1 and float(re.search(r"after=([\d.]+)", dead[0]).group(1)) < 15, out


@pytest.mark.parametrize("ws", [2, 3])
def test_peer_killed_during_backward_surfaces_as_torch_error(ws):
    """torch's DDP over "pyddp": the last rank SIGKILLs itself in the middle of
    backward. On every survivor loss.backward() raises torch's DistNetworkError or
    DistBackendError (also pyddp's class) naming the lost rank, not the RuntimeError
    "Cannot extract tensors from value: PicklingError" of an error that does not
    pickle, nor the SIGSEGV of one that does (see pyddp/torch_backend/_failure.py);
    and torch's reducer has finished its end of backward (a plain backward of the
    module afterwards runs: the hooks of a wrapper replaced after the error are quiet)."""
    res = spawn_ranks("torch_backward_death.py", ws, env={"PYDDP_TIMEOUT": "60"},
                      timeout=120)
    assert res[-1].returncode == -9, res[-1].output[-3000:]
    for r in range(ws - 1):
        out = res[r].output
        assert res[r].returncode == 0, out[-3000:]
        m = re.search(rf"DEATH rank={r} torch_class=(\w+) pyddp_class=(\w+) type=(\w+) "
                      rf"msg=(.*) after=(.*)", out)
        assert m, out[-3000:]
        assert m.group(1) == m.group(2) == "True", m.group(0)
        assert f"rank {ws - 1}" in m.group(4), m.group(0)
        assert m.group(5) == "ok", m.group(0)       # the reducer's hooks went quiet


def test_torchrun_restart_starts_clean():
    res = torchrun("torch_backend.py", 2, args=["restart"], extra=["--max-restarts=1"],
                   timeout=240)
    assert res.returncode == 0, res.output[-6000:]
    for r in range(2):
        assert f"PASS restart rank={r} attempt=1" in res.output, res.output[-4000:]


def test_file_store_and_reinit_with_autoload_off(tmp_path):
    """init_method=file:// (torch's FileStore, no TCPStore underneath): rank 0 hosts a
    pyddp store and announces it through torch's store. Then env:// twice, where rank 0
    hosts torch's TCPStore again on the same port: pyddp's store client of the first
    must not be reused. Autoload is off, so the script registers the backend by
    importing pyddp.torch_backend."""
    path = str(tmp_path / "rdzv")
    results = spawn_ranks("torch_backend.py", 2, args=["plain", "--import-backend", "--file",
                                                       path],
                          env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}, timeout=120)
    for r, res in enumerate(results):
        assert res.returncode == 0, res.output[-4000:]
        for i, kind in enumerate(["FileStore", "TCPStore", "TCPStore"]):
            assert f"PASS plain{i} rank={r} store={kind}" in res.output, res.output[-2000:]


def test_example_differs_from_the_gloo_script_only_in_the_backend(tmp_path):
    """examples/torch_backend.py is the stock torch script with BACKEND = "pyddp": the
    gloo version (one line changed) trains to the same losses and accuracy."""
    from launch import ROOT
    example = f"{ROOT}/examples/torch_backend.py"
    lines = open(example).read().splitlines()
    gloo_lines = [line.replace('BACKEND = "pyddp"', 'BACKEND = "gloo"') for line in lines]
    assert sum(a != b for a, b in zip(lines, gloo_lines)) == 1
    assert not any(line.startswith(("import pyddp", "from pyddp")) for line in lines)
    gloo = tmp_path / "torch_gloo.py"
    gloo.write_text("\n".join(gloo_lines) + "\n")
    outs = {}
    for name, script in (("pyddp", example), ("gloo", str(gloo))):
        res = torchrun(script, 2, args=["--epochs", "2", "--checkpoint",
                                        str(tmp_path / f"{name}.pt")], timeout=180)
        assert res.returncode == 0, res.output[-4000:]
        assert f"backend {name}, 2 ranks" in res.stdout, res.output[-2000:]
        outs[name] = re.findall(r"epoch \d/2  loss (\S+)", res.stdout)
        acc = float(re.search(r"accuracy (\S+),", res.stdout).group(1))
        assert acc > 0.9, res.stdout
    assert len(outs["pyddp"]) == 2 and outs["pyddp"] == outs["gloo"], outs


def test_pyddp_timeout_wins_over_torchs_default():
    """torch's init_process_group always passes a timeout (30 min by default); a
    PYDDP_TIMEOUT set in the environment is the user's choice and bounds the group's
    collectives: a peer that never joins fails rank 0 after about 3 s, not 30 min."""
    from launch import torchrun
    res = torchrun("torch_timeout.py", 2, args=["14"], env={"PYDDP_TIMEOUT": "3"}, timeout=90)
    m = re.search(r"TIMEOUT_AFTER (\S+) (\w+)", res.stdout)
    assert m, res.output[-4000:]
    assert m.group(1) != "none" and float(m.group(1)) < 12, m.group(0)
    assert m.group(2) == "DistTimeoutError", m.group(0)
