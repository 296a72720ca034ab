"""torch's arguments in pyddp's terms, for the "pyddp" backend's process group
(``_pg``): torch's ReduceOp as pyddp's op (PREMUL_SUM as a scaled SUM; the table
of hashes that ProcessGroup.torch_run reduces in C), and the all_reduce of sparse
tensors, which gloo supports and pyddp's transports (dense buffers) do not carry as
such: every rank's coalesced indices and values travel in all_gathers and each rank
adds them up itself.
"""
import torch
import torch.distributed as dist

from .. import _C
from .. import collectives as C

_RedOpType = dist.ReduceOp.RedOpType
SUM = _RedOpType.SUM        # opts.reduceOp == SUM is the cheap test (ReduceOp.__eq__)
_OPS = {_RedOpType.SUM: C.ReduceOp.SUM, _RedOpType.AVG: C.ReduceOp.AVG,
        _RedOpType.MIN: C.ReduceOp.MIN, _RedOpType.MAX: C.ReduceOp.MAX,
        _RedOpType.PRODUCT: C.ReduceOp.PRODUCT}


def thin_ops():
    """{hash(ReduceOp): pyddp op code} for the ops ProcessGroup.torch_run reduces in C,
    or None (the C path then leaves reductions to Python) unless this torch's
    ReduceOp hash is proven to name the op: distinct, small, and none of the other
    ops' (bitwise, PREMUL_SUM) hashes."""
    try:
        ops = {hash(dist.ReduceOp(k)): int(v) for k, v in _OPS.items()}
        others = {hash(dist.ReduceOp(k)) for k in
                  (_RedOpType.BAND, _RedOpType.BOR, _RedOpType.BXOR)}
        others.add(hash(dist._make_nccl_premul_sum(2.0)))
    except Exception:  # noqa: BLE001 - another torch: no C reductions
        return None
    if len(ops) != len(_OPS) or others & set(ops) or not all(0 <= h < 16 for h in ops):
        return None
    return ops


def reduce_op(op):
    """(pyddp ReduceOp, PREMUL_SUM factor or None) for torch's ReduceOp (or RedOpType).
    Raises ValueError for ops pyddp cannot run (the bitwise ones), before any call."""
    kind = op.op if isinstance(op, dist.ReduceOp) else op
    if kind == _RedOpType.PREMUL_SUM:
        return C.ReduceOp.SUM, op.factor
    if kind in _OPS:
        return _OPS[kind], None
    raise _C.DistValueError(
        f"the pyddp backend does not support ReduceOp.{getattr(kind, 'name', kind)}; it "
        f"supports SUM, AVG, MIN, MAX, PRODUCT and PREMUL_SUM. For bool tensors use MAX "
        f"for logical or and MIN for logical and.")


def scaled(t, factor):
    """A new tensor t * factor (PREMUL_SUM's input), leaving t unchanged."""
    with torch.no_grad():
        return t.detach() * factor


def flat(lists):
    """The tensors of a list of lists, in order."""
    return [t for lst in lists for t in lst]


def all_reduce_sparse(t, op, group):
    """t, a sparse COO tensor in host memory, becomes the coalesced sum of every rank's
    t in group (a pyddp group), in place, as gloo's sparse all_reduce: only ReduceOp.SUM,
    the same shape on every rank. Each rank's number of non-zeros travels first, then its
    indices and values padded to the largest number (two all_gathers). Blocking."""
    if op != C.ReduceOp.SUM:
        raise _C.DistValueError("all_reduce of sparse tensors supports ReduceOp.SUM only")
    if t.is_cuda:
        raise _C.DistValueError("the pyddp backend reduces sparse tensors in host memory "
                                "only; move the tensor to the CPU first")
    ws = group.size
    c = t.detach().coalesce()
    idx, val = c.indices(), c.values()
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(ws)]
    C.all_gather(counts, torch.tensor([idx.shape[1]], dtype=torch.int64), group=group)
    counts = [int(k) for k in counts]
    most = max(counts)
    pidx = torch.zeros((idx.shape[0], most), dtype=torch.int64)
    pidx[:, :idx.shape[1]] = idx
    pval = torch.zeros((most,) + tuple(val.shape[1:]), dtype=val.dtype)
    pval[:val.shape[0]] = val
    gidx = [torch.empty_like(pidx) for _ in range(ws)]
    gval = [torch.empty_like(pval) for _ in range(ws)]
    if most:
        C.all_gather(gidx, pidx, group=group)
        C.all_gather(gval, pval, group=group)
    total = torch.sparse_coo_tensor(torch.cat([i[:, :k] for i, k in zip(gidx, counts)], 1),
                                    torch.cat([v[:k] for v, k in zip(gval, counts)]),
                                    t.shape).coalesce()
    with torch.no_grad():
        t.copy_(total)
