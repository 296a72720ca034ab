"""Worker for tests/test_ddp_reduce_dtype.py, run under torchrun: pyddp's DDP with
reduce_dtype= (gradients reduced as bfloat16/float16), checked per case against an
independent reference:

* curve_<dt>: ~20 SGD steps of a small MLP give the same loss curve as torch's own DDP
  (gloo) with torch's bf16_compress_hook / fp16_compress_hook, on the C path and on
  the generic path, and the weights stay bit-identical across ranks;
* average_<dt>: one backward's averaged gradients equal NumPy's average of the
  per-rank gradients rounded to the reduce dtype, within half-precision tolerance,
  and are exactly representable in it (float32 and float64 parameters, one of them
  non-contiguous, C and generic paths);
* mixed: float32, float64 and float16 parameters in one model (float16 is reduced as it
  is, with AVG), gradient_as_bucket_view (views only for the float16 one) and
  find_unused_parameters (a .grad created in the parameter's dtype);
* overflow: float16 gradients near float16's maximum average without Inf;
* numpy: ArrayDDP with numpy.float16 (and "bfloat16" as ml_dtypes allows);
* errors: bad reduce_dtype values and non-floating parameters raise on rank 0 alone,
  before any communication (the next collective of every rank still matches).

Prints "PASS <case> rank=<r> ..." per case and rank; exits non-zero on the first
failure. Usage: torchrun --nproc_per_node=N ddp_reduce_dtype.py [case ...]
"""
import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pyddp

STEPS = 20
EPS = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}   # unit roundoff * 2
TORCH_DT = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _bf16_hook(state, bucket):
    """torch's bf16_compress_hook itself. DDP refuses to register that function unless
    CUDA and NCCL are there (it checks the name; gloo all-reduces bfloat16 fine)."""
    return default_hooks.bf16_compress_hook(state, bucket)


HOOKS = {"bfloat16": _bf16_hook, "float16": default_hooks.fp16_compress_hook}


def mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 4))


TEACHER = torch.randn(16, 4, generator=torch.Generator().manual_seed(99))


def batch(step, rank):
    """Rank- and step-dependent inputs, labels from a fixed linear teacher (learnable)."""
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1000 * step + rank))
    return x, (x @ TEACHER).argmax(1)


def train(ddp, model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rank = pyddp.get_rank()
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, rank)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def all_of(x):
    out = [None] * pyddp.get_world_size()
    pyddp.all_gather_object(out, x)
    return out


def case_curve(dt, rank):
    ref_model = mlp(rank)       # rank-dependent weights: DDP broadcasts rank 0's
    ref = TorchDDP(ref_model)
    ref.register_comm_hook(None, HOOKS[dt])
    ref_losses = train(ref, ref_model)
    worst = 0.0
    for generic in (False, True):
        model = mlp(rank)
        ours = pyddp.DistributedDataParallel(model, reduce_dtype=TORCH_DT[dt],
                                             _generic_path=generic)
        losses = train(ours, model)
        diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        # two roundings (torch: round(g), then / world size) against one: a few ulps
        # of the reduce dtype per step, which momentum carries along
        if diff > 5e-3 or not losses[-1] < 0.8 * losses[0]:
            raise AssertionError(f"curve {dt} generic={generic}: losses {losses} vs torch's "
                                 f"{ref_losses} (max rel diff {diff:.3g})")
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        if any(not torch.equal(o, all_of(flat)[0]) for o in all_of(flat)):
            raise AssertionError(f"curve {dt} generic={generic}: ranks' weights differ")
        worst = max(worst, diff)
    print(f"PASS curve_{dt} rank={rank} max_rel_diff={worst:.3g} "
          f"loss {ref_losses[0]:.3f}->{ref_losses[-1]:.3f}", flush=True)


def rounded(g, dt, world):
    """NumPy reference of one rank's contribution: g / world rounded to dt."""
    return torch.from_numpy(np.asarray(g, dtype=np.float64) / world).to(TORCH_DT[dt]) \
        .to(torch.float64).numpy()


def check_against_numpy(name, got, local, dt, world, exact_in_dt=True):
    """got: this rank's averaged gradients; local: every rank's own gradients."""
    for k, g in enumerate(got):
        g64 = g.detach().to(torch.float64).numpy()
        contrib = [rounded(loc[k], dt, world) for loc in local]
        ref = np.sum(contrib, axis=0)
        scale = np.sum(np.abs(contrib), axis=0)
        # every partial sum may be rounded once: (world - 1) roundings + the last
        tol = world * EPS[dt] * scale + 2.0 ** -24
        bad = np.abs(g64 - ref) > tol
        if bad.any():
            raise AssertionError(f"{name}: gradient {k}: {g64[bad][:5]} vs NumPy "
                                 f"{ref[bad][:5]} (tolerance {tol[bad][:5]})")
        if exact_in_dt and not torch.equal(g.to(TORCH_DT[dt]).to(g.dtype), g):
            raise AssertionError(f"{name}: gradient {k} is not a {dt} value widened")


def case_average(dt, rank, world):
    for generic in (False, True):
        for dtype in (torch.float32, torch.float64):
            model = mlp(0).to(dtype)
            # a non-contiguous parameter (and gradient): staged before it is narrowed
            model[0].weight = nn.Parameter(model[0].weight.detach().t().contiguous().t())
            ours = pyddp.DistributedDataParallel(model, reduce_dtype=dt,
                                                 bucket_cap_mb=0.01, _generic_path=generic)
            x, y = batch(7, rank)
            plain = mlp(0).to(dtype)
            plain.load_state_dict(model.state_dict())
            F.cross_entropy(plain(x.to(dtype)), y).backward()
            local = all_of([p.grad.numpy() for p in plain.parameters()])
            F.cross_entropy(ours(x.to(dtype)), y).backward()
            got = [p.grad for p in model.parameters()]
            if got[0].is_contiguous():
                raise AssertionError("average: the strided parameter's gradient is contiguous")
            if any(g.dtype != dtype for g in got):
                raise AssertionError(f"average {dt}: .grad dtypes {[g.dtype for g in got]}")
            check_against_numpy(f"average {dt} {dtype} generic={generic}", got, local, dt,
                                world)
    print(f"PASS average_{dt} rank={rank}", flush=True)


class Mixed(nn.Module):
    """Parameters of three dtypes with gradients chosen directly: d loss/d p = c_p."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(300))
        self.b = nn.Parameter(torch.zeros(50, dtype=torch.float64))
        self.h = nn.Parameter(torch.zeros(40, dtype=torch.float16))
        self.spare = nn.Parameter(torch.zeros(10))    # used by rank 0 only

    def forward(self, coeffs, use_spare):
        loss = sum((p * c).sum() for p, c in zip((self.a, self.b, self.h), coeffs))
        return loss + (self.spare * coeffs[3]).sum() if use_spare else loss


def case_mixed(rank, world):
    gen = torch.Generator().manual_seed(rank + 10)
    coeffs = [torch.randn(300, generator=gen), torch.randn(50, generator=gen).double(),
              torch.randn(40, generator=gen).half(), torch.randn(10, generator=gen)]
    local = all_of([c.numpy() for c in coeffs])
    for generic in (False, True):
        model = Mixed()
        ours = pyddp.DistributedDataParallel(model, reduce_dtype=torch.bfloat16,
                                             gradient_as_bucket_view=True,
                                             find_unused_parameters=True,
                                             bucket_cap_mb=0.0005, _generic_path=generic)
        ours(coeffs, rank == 0).backward()
        name = f"mixed generic={generic}"
        dtypes = [p.grad.dtype for p in model.parameters()]
        if dtypes != [torch.float32, torch.float64, torch.float16, torch.float32]:
            raise AssertionError(f"{name}: .grad dtypes {dtypes}")
        # float32/float64 (and the spare one, all ranks but 0 contributing zeros): bf16
        check_against_numpy(name, [model.a.grad, model.b.grad], [lo[:2] for lo in local],
                            "bfloat16", world)
        spare = [lo[3] if r == 0 else np.zeros(10, np.float32) for r, lo in enumerate(local)]
        check_against_numpy(name, [model.spare.grad], [[s] for s in spare], "bfloat16", world)
        # float16 is not wider than bfloat16: reduced as it is (AVG in float32, rounded)
        ref = np.mean([lo[2].astype(np.float64) for lo in local], axis=0)
        h = model.h.grad.double().numpy()
        if not np.allclose(h, ref, rtol=2 * EPS["float16"], atol=1e-6):
            raise AssertionError(f"{name}: float16 gradient {h[:4]} vs {ref[:4]}")
        views = [v.data_ptr() == p.grad.data_ptr()
                 for v, p in zip(ours._sync.engine.views, model.parameters())]
        if views != [False, False, True, False]:
            raise AssertionError(f"{name}: bucket views {views} (float16 only)")
    print(f"PASS mixed rank={rank}", flush=True)


class Scale(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.p = nn.Parameter(torch.zeros(n))

    def forward(self, c):
        return (self.p * c).sum()


def case_overflow(rank, world):
    # every rank's gradient is close to float16's maximum (65504): their sum is not
    big = torch.full((64,), 60000.0) + rank * 100.0
    want = 60000.0 + 100.0 * (world - 1) / 2
    for generic in (False, True):
        model = Scale(64)
        ours = pyddp.DistributedDataParallel(model, reduce_dtype=torch.float16,
                                             _generic_path=generic)
        ours(big).backward()
        g = model.p.grad
        if not torch.isfinite(g).all() or (g - want).abs().max() > want * world * EPS["float16"]:
            raise AssertionError(f"overflow generic={generic}: {g[:4]} vs {want}")
    print(f"PASS overflow rank={rank}", flush=True)


class NpParam:
    def __init__(self, data):
        self.data, self.grad = data, None


def case_numpy(rank, world):
    kinds = [np.float16, "float16"]
    try:
        import ml_dtypes
        kinds.append(ml_dtypes.bfloat16)
    except ImportError:
        ml_dtypes = None
    for generic in (False, True):
        for kind in kinds:
            dt = np.dtype(kind).name
            rng = np.random.default_rng(rank)
            params = [NpParam(np.zeros((7, 5))), NpParam(np.zeros(300, np.float32))]
            ddp = pyddp.DistributedDataParallel(params, reduce_dtype=kind,
                                                _generic_path=generic)
            for p in params:
                p.grad = rng.normal(size=p.data.shape).astype(p.data.dtype)
            local = all_of([p.grad.copy() for p in params])
            ddp.sync_gradients()
            got = [torch.from_numpy(p.grad) for p in params]
            check_against_numpy(f"numpy {dt} generic={generic}", got, local, dt, world)
    if ml_dtypes is None and rank == 0:
        try:
            pyddp.DistributedDataParallel([NpParam(np.zeros(3))], reduce_dtype="bfloat16")
        except pyddp.DistValueError as e:
            assert "ml_dtypes" in str(e), e
        else:
            raise AssertionError("bfloat16 for NumPy without ml_dtypes did not raise")
    print(f"PASS numpy rank={rank} kinds={[np.dtype(k).name for k in kinds]}", flush=True)


def case_errors(rank, world):
    if rank == 0:    # alone: any communication would hang or mismatch the others
        bad = [(mlp(0), torch.float32, "torch.bfloat16 or torch.float16"),
               (mlp(0), "int8", "not 'int8'"), (mlp(0), np.float16, "not <class"),
               (mlp(0), 16, "not 16"),
               ([NpParam(np.zeros(3))], torch.float16, "numpy.float16 or ml_dtypes"),
               ([NpParam(np.zeros(3, np.int32))], "float16", "parameter '[0]' has dtype "
                                                               "int32")]
        for module, rd, text in bad:
            try:
                pyddp.DistributedDataParallel(module, reduce_dtype=rd)
            except pyddp.DistTypeError as e:
                if text not in str(e):
                    raise AssertionError(f"reduce_dtype={rd!r}: message {e}")
            else:
                raise AssertionError(f"reduce_dtype={rd!r} did not raise")
    t = torch.tensor([float(rank)])
    pyddp.all_reduce(t)
    if t.item() != world * (world - 1) / 2:
        raise AssertionError(f"errors: the next all-reduce gave {t.item()}")
    print(f"PASS errors rank={rank}", flush=True)


def main():
    names = sys.argv[1:] or ["errors", "curve_bfloat16", "curve_float16", "average_bfloat16",
                             "average_float16", "mixed", "overflow", "numpy"]
    tdist.init_process_group("gloo")
    pyddp.init_process_group("cpu", timeout=timedelta(seconds=60))
    rank, world = pyddp.get_rank(), pyddp.get_world_size()
    for name in names:
        kind, _, dt = name.partition("_")
        if kind == "curve":
            case_curve(dt, rank)
        elif kind == "average":
            case_average(dt, rank, world)
        elif name == "mixed":
            case_mixed(rank, world)
        elif name == "overflow":
            case_overflow(rank, world)
        elif name == "numpy":
            case_numpy(rank, world)
        elif name == "errors":
            case_errors(rank, world)
        else:
            raise SystemExit(f"unknown case {name!r}")
    pyddp.destroy_process_group()
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
