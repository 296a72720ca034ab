"""The collectives, with torch.distributed's names and semantics, on the default group
or any group from new_group() (``group=``; src/dst are global ranks, as in torch).

Each function validates its arguments (types, dtypes, sizes, ranks) before anything
is sent, hands contiguous buffers to the backend's process group, and either waits
(``async_op=False``, returns None) or returns a :class:`Work` handle. Results are
written in place into the caller's arrays, also for torch tensors that require grad
and for non-contiguous arrays (which are staged through a contiguous copy).
"""
import enum
import threading

from . import _C
from . import _arrays as A
from ._group import _resolve, timeout_ms
from ._nccl_backend import caller_stream


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
        self._lock = None if post is None else threading.Lock()

    def _copy_out(self):
        """Run the copy-out once, whichever thread gets here first."""
        if self._post is None:
            return
        with self._lock:
            post, self._post = self._post, None
            if post is not None:
                post()

    def wait(self, timeout=None):
        if not self._done:
            ms = -1 if timeout is None else int(_seconds(timeout) * 1000)
            self._work.wait(ms)
            self._copy_out()
            self._done = True
        return True

    def add_done_callback(self, fn):
        """Call fn(work) once, when the collective finished and its results are in the
        caller's arrays, from pyddp's completion thread (holding the GIL), or at once
        if it already finished. In fn, ``work.exception()`` is None or the error."""
        def done(_w):
            if _w.exception() is None:
                try:
                    self._copy_out()
                except Exception as e:  # noqa: BLE001 - surfaced through fn's work
                    self._post_error = e
            fn(self)
        self._work.add_done_callback(done)

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
        return getattr(self, "_post_error", None) or self._work.exception()



def _seconds(t):
    return t.total_seconds() if hasattr(t, "total_seconds") else float(t)


def _run(g, kind, a=None, b=None, op=0, root=0, async_op=False, post=None, what=None):
    pg = g.pg(what or "a collective")
    stream = caller_stream(a if a is not None else b)
    w = Work(pg.submit(kind, a, b, op, root, timeout_ms(g), stream), post)
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
    opc = _op(op)
    s = A.Staged(tensor)
    return _run(g, _C.COLL_ALLREDUCE, s.array, None, opc, 0, async_op, _finisher(s),
                "all_reduce")


def broadcast(tensor, src=0, group=None, async_op=False):
    """Copy src's tensor into every rank's tensor."""
    g = _resolve(group)
    src = _rank_arg(g, src, "src")
    s = A.Staged(tensor)
    return _run(g, _C.COLL_BROADCAST, s.array, None, 0, src, async_op, _finisher(s),
                "broadcast")


def reduce(tensor, dst=0, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce into dst's tensor; other ranks' tensors are left unchanged."""
    g = _resolve(group)
    dst = _rank_arg(g, dst, "dst")
    opc = _op(op)
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
    """Receive into tensor from rank src. Returns src."""
    irecv(tensor, src, group, tag).wait()
    return src


def isend(tensor, dst, group=None, tag=0):
    g = _resolve(group)
    g.pg("isend")
    dst = _rank_arg(g, dst, "dst")
    s = A.Staged(tensor)
    return _run(g, _C.COLL_SEND, s.array, None, 0, dst, True, None, "isend")


def irecv(tensor, src=None, group=None, tag=0):
    g = _resolve(group)
    g.pg("irecv")
    if src is None:
        raise _C.DistValueError("recv from any source is not supported by pyddp; pass src=")
    src = _rank_arg(g, src, "src")
    s = A.Staged(tensor)
    return _run(g, _C.COLL_RECV, s.array, None, 0, src, True, _finisher(s), "irecv")


def barrier(group=None, async_op=False, device_ids=None):
    """Block until every rank of group reached the barrier."""
    g = _resolve(group)
    return _run(g, _C.COLL_BARRIER, None, None, 0, 0, async_op, None, "barrier")
