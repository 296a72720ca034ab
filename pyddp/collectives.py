"""The collectives of the default group, with torch.distributed's names and semantics.

Each function validates its arguments (types, dtypes, sizes, ranks) before anything
is sent, hands contiguous buffers to the backend's process group, and either waits
(``async_op=False``, returns None) or returns a :class:`Work` handle. Results are
written in place into the caller's arrays, also for torch tensors that require grad
and for non-contiguous arrays (which are staged through a contiguous copy).
"""
import enum

from . import _C
from . import _arrays as A
from ._group import _check_group, default_pg, default_timeout_ms, get_rank, get_world_size


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


def _rank_arg(r, name):
    if not isinstance(r, int) or isinstance(r, bool):
        raise _C.DistTypeError(f"{name} must be an int rank, not {type(r).__name__}")
    ws = get_world_size()
    if not 0 <= r < ws:
        raise _C.DistValueError(f"{name}={r} is out of range for world size {ws}")
    return r


class Work:
    """Handle of an asynchronous collective (``async_op=True``).

    ``wait(timeout=None)`` blocks until it finishes (the GIL is released; Ctrl-C aborts
    the group), raises its error if it failed, then finishes any copy-out; it returns
    True. ``is_completed()`` never blocks. Keep the handle until it completed: a
    handle dropped earlier waits for its collective when it is garbage-collected (the
    arrays it writes must stay alive until then).
    """

    def __init__(self, work, post=None):
        self._work = work
        self._post = post
        self._done = False

    def wait(self, timeout=None):
        if not self._done:
            ms = -1 if timeout is None else int(_seconds(timeout) * 1000)
            self._work.wait(ms)
            self._done = True
            if self._post is not None:
                post, self._post = self._post, None
                post()
        return True

    def is_completed(self):
        """True once the collective finished and its results are in the caller's arrays
        (the copy-out of list outputs and staged arrays runs here, so a True answer
        never shows stale data). Never blocks; an error is raised by wait()."""
        if self._done:
            return True
        if not self._work.is_completed():
            return False
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - reported by wait()/exception(), not here
            pass
        return True

    def is_success(self):
        return self.is_completed() and self._work.exception() is None

    def exception(self):
        return self._work.exception()



def _seconds(t):
    return t.total_seconds() if hasattr(t, "total_seconds") else float(t)


def _run(kind, a=None, b=None, op=0, root=0, async_op=False, post=None):
    w = Work(default_pg().submit(kind, a, b, op, root, default_timeout_ms()), post)
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
    _check_group(group)
    opc = _op(op)
    s = A.Staged(tensor)
    return _run(_C.COLL_ALLREDUCE, s.array, None, opc, 0, async_op, _finisher(s))


def broadcast(tensor, src=0, group=None, async_op=False):
    """Copy src's tensor into every rank's tensor."""
    _check_group(group)
    src = _rank_arg(src, "src")
    s = A.Staged(tensor)
    return _run(_C.COLL_BROADCAST, s.array, None, 0, src, async_op, _finisher(s))


def reduce(tensor, dst=0, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce into dst's tensor; other ranks' tensors are left unchanged."""
    _check_group(group)
    dst = _rank_arg(dst, "dst")
    opc = _op(op)
    s = A.Staged(tensor)
    return _run(_C.COLL_REDUCE, s.array, None, opc, dst, async_op, _finisher(s))


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """output = concatenation of every rank's input, in rank order (output has
    world_size times input's elements; any shape, e.g. [ws*n] or [ws, n])."""
    _check_group(group)
    out = A.Staged(output_tensor)
    inp = A.Staged(input_tensor)
    return _run(_C.COLL_ALLGATHER, inp.array, out.array, 0, 0, async_op, _finisher(out))


def all_gather(tensor_list, tensor, group=None, async_op=False):
    """tensor_list[r] = rank r's tensor, for every r."""
    _check_group(group)
    ws = get_world_size()
    A.check_list(tensor_list, "tensor_list", ws, tensor)
    inp = A.Staged(tensor)
    flat = A.empty_flat(inp.array, ws * A.numel(tensor))
    return _run(_C.COLL_ALLGATHER, inp.array, flat, 0, 0, async_op,
                lambda: A.unpack_into(tensor_list, flat))


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    """output = rank's block of the reduction of every rank's input (input has
    world_size times output's elements)."""
    _check_group(group)
    opc = _op(op)
    out = A.Staged(output)
    inp = A.Staged(input)
    return _run(_C.COLL_REDUCE_SCATTER, inp.array, out.array, opc, 0, async_op, _finisher(out))


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    """output = reduction over ranks of input_list[rank]."""
    _check_group(group)
    ws = get_world_size()
    A.check_list(input_list, "input_list", ws, output)
    opc = _op(op)
    flat = A.pack(input_list, output)
    out = A.Staged(output)
    return _run(_C.COLL_REDUCE_SCATTER, flat, out.array, opc, 0, async_op, _finisher(out))


def gather(tensor, gather_list=None, dst=0, group=None, async_op=False):
    """At dst, gather_list[r] = rank r's tensor. Other ranks pass gather_list=None."""
    _check_group(group)
    dst = _rank_arg(dst, "dst")
    ws = get_world_size()
    inp = A.Staged(tensor)
    if get_rank() != dst:
        if gather_list:
            raise _C.DistValueError("gather_list must be None or empty on non-destination ranks")
        return _run(_C.COLL_GATHER, inp.array, None, 0, dst, async_op)
    A.check_list(gather_list, "gather_list", ws, tensor)
    flat = A.empty_flat(inp.array, ws * A.numel(tensor))
    return _run(_C.COLL_GATHER, inp.array, flat, 0, dst, async_op,
                lambda: A.unpack_into(gather_list, flat))


def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False):
    """tensor = src's scatter_list[rank]. Other ranks pass scatter_list=None."""
    _check_group(group)
    src = _rank_arg(src, "src")
    ws = get_world_size()
    out = A.Staged(tensor)
    if get_rank() != src:
        if scatter_list:
            raise _C.DistValueError("scatter_list must be None or empty on non-source ranks")
        return _run(_C.COLL_SCATTER, None, out.array, 0, src, async_op, _finisher(out))
    A.check_list(scatter_list, "scatter_list", ws, tensor)
    flat = A.pack(scatter_list, tensor)
    return _run(_C.COLL_SCATTER, flat, out.array, 0, src, async_op, _finisher(out))


def send(tensor, dst, group=None, tag=0):
    """Send tensor to rank dst (blocks until handed to the transport)."""
    isend(tensor, dst, group, tag).wait()


def recv(tensor, src=None, group=None, tag=0):
    """Receive into tensor from rank src. Returns src."""
    irecv(tensor, src, group, tag).wait()
    return src


def isend(tensor, dst, group=None, tag=0):
    _check_group(group)
    dst = _rank_arg(dst, "dst")
    s = A.Staged(tensor)
    return _run(_C.COLL_SEND, s.array, None, 0, dst, True)


def irecv(tensor, src=None, group=None, tag=0):
    _check_group(group)
    if src is None:
        raise _C.DistValueError("recv from any source is not supported by pyddp; pass src=")
    src = _rank_arg(src, "src")
    s = A.Staged(tensor)
    return _run(_C.COLL_RECV, s.array, None, 0, src, True, _finisher(s))


def barrier(group=None, async_op=False, device_ids=None):
    """Block until every rank reached the barrier."""
    _check_group(group)
    return _run(_C.COLL_BARRIER, None, None, 0, 0, async_op)
