"""The collectives, with torch.distributed's names and semantics, on the default group
or any group from new_group() (``group=``; src/dst are global ranks, as in torch).

Each function validates its arguments (types, dtypes, sizes, ranks) before anything
is sent, hands contiguous buffers to the backend's process group, and either waits
(``async_op=False``, returns None) or returns a :class:`Work` handle. Results are
written in place into the caller's arrays, also for torch tensors that require grad
and for non-contiguous arrays (which are staged through a contiguous copy).

A blocking all_reduce, broadcast, reduce or barrier of a contiguous host buffer takes
the lean path (``_lean``); everything else submits through ``_C.ProcessGroup.submit``
and gets a :class:`Work` (``_work``). monitored_barrier is ``_monitored_barrier``'s.
"""
import enum
import functools

import numpy as np

from . import _C, _lean
from . import _arrays as A
from ._group import _resolve, timeout_ms
from ._monitored_barrier import monitored_barrier  # noqa: F401 - part of this API
from ._nccl_backend import caller_stream
from ._work import Joined as _Joined, Work


class ReduceOp(enum.IntEnum):
    """Reduction operations (torch.distributed.ReduceOp's names)."""
    SUM = _C.OP_SUM
    AVG = _C.OP_AVG
    MIN = _C.OP_MIN
    MAX = _C.OP_MAX
    PRODUCT = _C.OP_PRODUCT


def _op(op):
    if isinstance(op, ReduceOp):
        return int(op)
    name = getattr(op, "name", None) or (op if isinstance(op, str) else None)
    if name is None and type(op).__name__ in ("RedOpType", "ReduceOp"):
        name = str(op).split(".")[-1]
    if isinstance(name, str) and name.upper() in ReduceOp.__members__:
        return int(ReduceOp[name.upper()])
    raise _C.DistValueError(f"unsupported reduce op {op!r}; use pyddp.ReduceOp.SUM, AVG, MIN, "
                            f"MAX or PRODUCT")


def _rank_arg(g, r, name):
    """The group rank of global rank r (src/dst/peer arguments are global, as in torch)."""
    if not isinstance(r, int) or isinstance(r, bool):
        raise _C.DistTypeError(f"{name} must be an int rank, not {type(r).__name__}")
    if r < 0:
        raise _C.DistValueError(f"{name}={r} is out of range")
    return g.group_rank(r, name)


def _run(g, kind, a=None, b=None, op=0, root=0, async_op=False, post=None, what=None,
         source=None):
    """Submit one collective of kind on group g's process group (a, b: its buffers as
    the core takes them; root a group rank; post the copy-out after it; source a
    receive's, see Work), and return its Work (async_op) or wait for it and return
    None."""
    pg = g.pg(what or "a collective")
    stream = caller_stream(a if a is not None else b)
    w = Work(pg.submit(kind, a, b, op, root, timeout_ms(g), stream), post, g, source)
    if async_op:
        return w
    w.wait()
    return None


def _finisher(*staged):
    def post():
        for s in staged:
            s.finish()
    return post


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce tensor across all ranks in place; every rank gets the result."""
    g = _resolve(group)
    opc = op if type(op) is ReduceOp else _op(op)
    r = _lean.run(g, _C.COLL_ALLREDUCE, tensor, opc, 0, async_op)
    if r is not _lean.NOT_TAKEN:
        return r
    s = A.Staged(tensor)
    return _run(g, _C.COLL_ALLREDUCE, s.array, None, opc, 0, async_op, _finisher(s),
                "all_reduce")


def broadcast(tensor, src=0, group=None, async_op=False):
    """Copy src's tensor into every rank's tensor."""
    g = _resolve(group)
    src = _rank_arg(g, src, "src")
    r = _lean.run(g, _C.COLL_BROADCAST, tensor, 0, src, async_op)
    if r is not _lean.NOT_TAKEN:
        return r
    s = A.Staged(tensor)
    return _run(g, _C.COLL_BROADCAST, s.array, None, 0, src, async_op, _finisher(s),
                "broadcast")


def reduce(tensor, dst=0, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce into dst's tensor; other ranks' tensors are left unchanged."""
    g = _resolve(group)
    dst = _rank_arg(g, dst, "dst")
    opc = _op(op)
    r = _lean.run(g, _C.COLL_REDUCE, tensor, opc, dst, async_op)
    if r is not _lean.NOT_TAKEN:
        return r
    s = A.Staged(tensor)
    return _run(g, _C.COLL_REDUCE, s.array, None, opc, dst, async_op, _finisher(s), "reduce")


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """output = concatenation of every rank's input, in rank order (output has
    world_size times input's elements; any shape, e.g. [ws*n] or [ws, n])."""
    g = _resolve(group)
    out = A.Staged(output_tensor)
    inp = A.Staged(input_tensor)
    return _run(g, _C.COLL_ALLGATHER, inp.array, out.array, 0, 0, async_op, _finisher(out),
                "all_gather_into_tensor")


def all_gather(tensor_list, tensor, group=None, async_op=False):
    """tensor_list[r] = rank r's tensor, for every r."""
    g = _resolve(group)
    ws = g.size
    g.pg("all_gather")
    A.check_list(tensor_list, "tensor_list", ws, tensor)
    inp = A.Staged(tensor)
    flat = A.empty_flat(inp.array, ws * A.numel(tensor))
    return _run(g, _C.COLL_ALLGATHER, inp.array, flat, 0, 0, async_op,
                lambda: A.unpack_into(tensor_list, flat), "all_gather")


def all_gather_coalesced(output_tensor_lists, input_tensor_list, group=None,
                         async_op=False):
    """output_tensor_lists[r][i] = rank r's input_tensor_list[i], for every rank r and
    input i (torch's semantics). The inputs (one dtype; any sizes, the same on every
    rank) travel packed in one all_gather."""
    g = _resolve(group)
    ws = g.size
    g.pg("all_gather_coalesced")
    inputs = input_tensor_list
    if not isinstance(inputs, (list, tuple)) or not inputs:
        raise _C.DistValueError("all_gather_coalesced needs a non-empty input_tensor_list")
    if not isinstance(output_tensor_lists, (list, tuple)) or len(output_tensor_lists) != ws:
        raise _C.DistValueError(f"all_gather_coalesced: output_tensor_lists must have one "
                                f"list per rank ({ws})")
    dt = getattr(inputs[0], "dtype", None)
    for r, outs in enumerate(output_tensor_lists):
        if not isinstance(outs, (list, tuple)) or len(outs) != len(inputs):
            raise _C.DistValueError(f"all_gather_coalesced: output_tensor_lists[{r}] must "
                                    f"have one tensor per input ({len(inputs)})")
        for i, (o, t) in enumerate(zip(outs, inputs)):
            if A.numel(o) != A.numel(t) or getattr(o, "dtype", None) != dt or \
                    getattr(t, "dtype", None) != dt:
                raise _C.DistValueError(f"all_gather_coalesced: output_tensor_lists[{r}][{i}] "
                                        f"must have input {i}'s element count and the "
                                        f"inputs' one dtype {dt}")
    flat_in = A.pack_ragged(list(inputs))
    n = A.numel(flat_in)
    flat_out = A.empty_flat(flat_in, ws * n)

    def post():
        for r, outs in enumerate(output_tensor_lists):
            A.unpack_ragged(list(outs), flat_out[r * n:(r + 1) * n])
    return _run(g, _C.COLL_ALLGATHER, flat_in, flat_out, 0, 0, async_op, post,
                "all_gather_coalesced")


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    """output = rank's block of the reduction of every rank's input (input has
    world_size times output's elements)."""
    g = _resolve(group)
    opc = _op(op)
    out = A.Staged(output)
    inp = A.Staged(input)
    return _run(g, _C.COLL_REDUCE_SCATTER, inp.array, out.array, opc, 0, async_op,
                _finisher(out), "reduce_scatter_tensor")


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    """output = reduction over ranks of input_list[rank]."""
    g = _resolve(group)
    ws = g.size
    g.pg("reduce_scatter")
    A.check_list(input_list, "input_list", ws, output)
    opc = _op(op)
    flat = A.pack(input_list, output)
    out = A.Staged(output)
    return _run(g, _C.COLL_REDUCE_SCATTER, flat, out.array, opc, 0, async_op, _finisher(out),
                "reduce_scatter")


def gather(tensor, gather_list=None, dst=0, group=None, async_op=False):
    """At dst, gather_list[r] = rank r's tensor. Other ranks pass gather_list=None."""
    g = _resolve(group)
    g.pg("gather")
    dst = _rank_arg(g, dst, "dst")
    ws = g.size
    inp = A.Staged(tensor)
    if g.rank != dst:
        if gather_list:
            raise _C.DistValueError("gather_list must be None or empty on non-destination ranks")
        return _run(g, _C.COLL_GATHER, inp.array, None, 0, dst, async_op, None, "gather")
    A.check_list(gather_list, "gather_list", ws, tensor)
    flat = A.empty_flat(inp.array, ws * A.numel(tensor))
    return _run(g, _C.COLL_GATHER, inp.array, flat, 0, dst, async_op,
                lambda: A.unpack_into(gather_list, flat), "gather")


def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False):
    """tensor = src's scatter_list[rank]. Other ranks pass scatter_list=None."""
    g = _resolve(group)
    g.pg("scatter")
    src = _rank_arg(g, src, "src")
    ws = g.size
    out = A.Staged(tensor)
    if g.rank != src:
        if scatter_list:
            raise _C.DistValueError("scatter_list must be None or empty on non-source ranks")
        return _run(g, _C.COLL_SCATTER, None, out.array, 0, src, async_op, _finisher(out),
                    "scatter")
    A.check_list(scatter_list, "scatter_list", ws, tensor)
    flat = A.pack(scatter_list, tensor)
    return _run(g, _C.COLL_SCATTER, flat, out.array, 0, src, async_op, _finisher(out),
                "scatter")


def send(tensor, dst, group=None, tag=0):
    """Send tensor to rank dst (blocks until handed to the transport)."""
    isend(tensor, dst, group, tag).wait()


def recv(tensor, src=None, group=None, tag=0):
    """Receive into tensor from rank src, or (src=None) from whichever rank sends to
    this one first. Returns the sender's global rank."""
    return irecv(tensor, src, group, tag).source_rank()


def isend(tensor, dst, group=None, tag=0):
    g = _resolve(group)
    g.pg("isend")
    dst = _rank_arg(g, dst, "dst")
    s = A.Staged(tensor)
    return _run(g, _C.COLL_SEND, s.array, None, 0, dst, True, None, "isend")


def irecv(tensor, src=None, group=None, tag=0):
    """Receive into tensor from rank src, or (src=None, host memory only) from the first
    rank whose next call sends to this one; the Work's source_rank() names the sender.
    A peer whose next call is something else is passed over (its call runs later), and
    when no peer can send the receive fails with a mismatch naming their calls."""
    g = _resolve(group)
    g.pg("irecv")
    if src is None:
        if A.on_gpu(tensor):
            raise _C.DistValueError("recv from any source needs a CPU tensor: NCCL can only "
                                    "receive from a named peer; pass src=")
        who = np.full(1, -1, dtype=np.int32)    # the core writes the sender's group rank
        s = A.Staged(tensor)
        return _run(g, _C.COLL_RECV, s.array, who, 0, _C.ANY_SOURCE, True, _finisher(s),
                    "irecv", lambda: int(who[0]))
    src = _rank_arg(g, src, "src")
    s = A.Staged(tensor)
    return _run(g, _C.COLL_RECV, s.array, None, 0, src, True, _finisher(s), "irecv", src)


def barrier(group=None, async_op=False, device_ids=None):
    """Block until every rank of group reached the barrier."""
    g = _resolve(group)
    if not async_op and _lean.run(g, _C.COLL_BARRIER, None, 0, 0) is None:
        return None
    return _run(g, _C.COLL_BARRIER, None, None, 0, 0, async_op, None, "barrier")


def all_reduce_coalesced(tensors, op=ReduceOp.SUM, group=None, async_op=False):
    """all_reduce of several tensors in one collective per dtype and device: each is
    packed into one flat buffer, reduced, and copied back (torch's semantics)."""
    g = _resolve(group)
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise _C.DistValueError("all_reduce_coalesced needs a non-empty list of tensors")
    opc = _op(op)
    g.pg("all_reduce_coalesced")
    groups = {}
    for t in tensors:
        key = (str(getattr(t, "dtype", None)), str(getattr(t, "device", "cpu")), A._lib(t))
        groups.setdefault(key, []).append(t)
    works = []
    for members in groups.values():
        flat = A.pack_ragged(members)
        works.append(_run(g, _C.COLL_ALLREDUCE, flat, None, opc, 0, True,
                          functools.partial(A.unpack_ragged, members, flat),
                          "all_reduce_coalesced"))
    w = _Joined(works)
    if async_op:
        return w
    w.wait()
    return None


def _split_sizes(splits, n_rows, ws, what):
    """Rows per rank for all_to_all_single: even split when splits is None."""
    if splits is None or len(splits) == 0:
        if n_rows % ws:
            raise _C.DistValueError(f"all_to_all_single: {what} has {n_rows} rows, which does "
                                    f"not split evenly over {ws} ranks; pass {what}_split_sizes")
        return [n_rows // ws] * ws
    splits = [int(s) for s in splits]
    if len(splits) != ws:
        raise _C.DistValueError(f"all_to_all_single: {what}_split_sizes has {len(splits)} "
                                f"entries but the group has {ws} ranks")
    if any(s < 0 for s in splits) or sum(splits) != n_rows:
        raise _C.DistValueError(f"all_to_all_single: {what}_split_sizes {splits} must be "
                                f"non-negative and add up to the {n_rows} rows of {what}")
    return splits


def _offsets(counts):
    out, off = [], 0
    for c in counts:
        out.append(off)
        off += c
    return out


def _alltoall(g, inp, out, scounts, rcounts, async_op, post, what):
    pg = g.pg(what)
    w = Work(pg.alltoall(inp, out, scounts, _offsets(scounts), rcounts, _offsets(rcounts),
                         timeout_ms(g), caller_stream(inp)), post, g)
    if async_op:
        return w
    w.wait()
    return None


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op=False):
    """Split input along dim 0 (evenly, or by input_split_sizes rows), send block q to
    rank q, and concatenate what arrives from every rank into output along dim 0 (by
    output_split_sizes rows). input and output may be the same tensor."""
    g = _resolve(group)
    ws = g.size
    g.pg("all_to_all_single")
    if getattr(output, "dtype", None) != getattr(input, "dtype", None):
        raise _C.DistTypeError(f"all_to_all_single: output dtype {output.dtype} differs from "
                               f"input dtype {input.dtype}")
    in_rows = int(input.shape[0]) if len(input.shape) else 1
    out_rows = int(output.shape[0]) if len(output.shape) else 1
    in_row = A.numel(input) // in_rows if in_rows else 0
    out_row = A.numel(output) // out_rows if out_rows else 0
    if in_rows and out_rows and tuple(input.shape[1:]) != tuple(output.shape[1:]):
        raise _C.DistValueError(f"all_to_all_single: input rows have shape "
                                f"{tuple(input.shape[1:])} but output rows "
                                f"{tuple(output.shape[1:])}")
    sc = [s * in_row for s in _split_sizes(input_split_sizes, in_rows, ws, "input")]
    rc = [s * out_row for s in _split_sizes(output_split_sizes, out_rows, ws, "output")]
    si = A.Staged(input)
    src = si.array if si.array is not A.for_core(output) else A.for_core(input).clone() \
        if A._lib(input) == "torch" else A.for_core(input).copy()
    so = A.Staged(output)
    return _alltoall(g, A.flat(src), A.flat(so.array), sc, rc, async_op, _finisher(so),
                     "all_to_all_single")


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    """output_tensor_list[p] = rank p's input_tensor_list[this rank], for every p (the
    tensors may differ in size between ranks, as long as each pair agrees)."""
    g = _resolve(group)
    ws = g.size
    g.pg("all_to_all")
    for name, lst in (("output_tensor_list", output_tensor_list),
                      ("input_tensor_list", input_tensor_list)):
        if not isinstance(lst, (list, tuple)) or len(lst) != ws:
            raise _C.DistValueError(f"all_to_all: {name} must be a list of {ws} tensors")
    dt = getattr(input_tensor_list[0], "dtype", None)
    for name, lst in (("output_tensor_list", output_tensor_list),
                      ("input_tensor_list", input_tensor_list)):
        for i, t in enumerate(lst):
            if getattr(t, "dtype", None) != dt:
                raise _C.DistTypeError(f"all_to_all: {name}[{i}] has dtype {t.dtype} but "
                                       f"input_tensor_list[0] has {dt}")
    sc = [A.numel(t) for t in input_tensor_list]
    rc = [A.numel(t) for t in output_tensor_list]
    flat_in = A.pack_ragged(list(input_tensor_list))
    flat_out = A.empty_flat(flat_in, sum(rc))
    return _alltoall(g, flat_in, flat_out, sc, rc, async_op,
                     functools.partial(A.unpack_ragged, list(output_tensor_list), flat_out),
                     "all_to_all")


class P2POp:
    """One point-to-point operation for batch_isend_irecv: op is pyddp.isend or
    pyddp.irecv (or torch.distributed's), peer a global rank."""

    def __init__(self, op, tensor, peer=None, group=None, tag=0, group_peer=None):
        name = getattr(op, "__name__", str(op))
        if name not in ("isend", "irecv"):
            raise _C.DistValueError(f"P2POp: op must be isend or irecv, not {op!r}")
        self.op, self.tensor, self.group, self.tag = op, tensor, group, tag
        self.is_send = name == "isend"
        g = _resolve(group)
        if peer is None and group_peer is not None:
            peer = g.ranks[group_peer]
        if peer is None:
            raise _C.DistValueError("P2POp needs peer=")
        self.peer = peer


def batch_isend_irecv(p2p_op_list):
    """Run every send and receive of the list concurrently (so a ring exchange, where
    each rank sends to one neighbour and receives from the other, cannot deadlock).
    Returns a list with one handle (wait on any of them: all complete together)."""
    if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list:
        raise _C.DistValueError("batch_isend_irecv needs a non-empty list of P2POp")
    groups = {id(_resolve(p.group)) for p in p2p_op_list}
    if len(groups) != 1:
        raise _C.DistValueError("batch_isend_irecv: every P2POp must use the same group")
    g = _resolve(p2p_op_list[0].group)
    staged, ops = [], []
    for p in p2p_op_list:
        if not isinstance(p, P2POp):
            raise _C.DistTypeError(f"batch_isend_irecv takes P2POp objects, not "
                                   f"{type(p).__name__}")
        s = A.Staged(p.tensor)
        staged.append(s)
        ops.append((p.is_send, s.array, _rank_arg(g, p.peer, "peer")))
    pg = g.pg("batch_isend_irecv")
    w = Work(pg.p2p_batch(ops, timeout_ms(g), caller_stream(ops[0][1])),
             _finisher(*[s for s, p in zip(staged, p2p_op_list) if not p.is_send]), g)
    return [w]
