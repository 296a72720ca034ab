"""The torch.distributed ProcessGroup that the "pyddp" backend hands to torch.

``ProcessGroupPyddp`` subclasses ``torch.distributed.ProcessGroup`` (torch 2.13 cannot
subclass its C++ ``Backend`` from Python) and implements every method torch calls on a
group, from Python (``dist.all_reduce`` calls ``group.allreduce``) and from C++ (DDP's
reducer, functional collectives, through pybind's trampoline), under both the old and
the new names where torch has two. Each method maps torch's arguments onto pyddp's
collective of the same meaning, on this group's pyddp group handle: CPU tensors go
to pyddp's CPU transport and CUDA tensors to its NCCL path, chosen by the handle.

Two paths:

* the thin path, for a call on one contiguous CPU tensor (all_reduce: torch DDP's
  bucket; broadcast, reduce, barrier): straight to ``_C.ProcessGroup`` with the tensor
  passed by address, read and started in one C call (``ProcessGroup.torch_run``:
  torch's options and the tensor's facts read in C). torch's blocking wrappers say so
  (``opts.asyncOp`` False) and wait at once, so such a call runs to completion here,
  through the lean path (a small one inline on this thread), and returns None, which
  torch takes as "the backend has synchronised"; an asynchronous one is submitted and
  gets a :class:`PyddpWork` whose future pyddp's completion thread completes
  (``_work``). The same C call takes one contiguous CUDA tensor to pyddp's NCCL path
  with torch's "nccl" semantics (queued, the current stream ordered after it; the
  torch Work made in C, its future only when asked: ``_cuda``);
* the general path for everything else (several tensors, CUDA tensors, lists, odd
  layouts), through pyddp's own functions (``collectives``) with ``async_op=True``.

torch's options carry group ranks; pyddp's functions take global ranks, so roots are
translated through the handle's member list (the thin path passes group ranks to the
core as they are). torch's semantics kept here:

* a call with ``asyncOp`` (every call from C++, and torch's ``async_op=True``) returns a
  torch ``Work`` over a ``torch.futures.Future`` whose value is the list of output
  tensors, completed by pyddp's own completion thread, never by a Python thread per
  call (on one CUDA tensor, as torch's "nccl" does: a future made when asked for,
  completed at once with CUDA events that follow the collective, ``_cuda``);
* errors raised while the collective runs reach the future (or, for a blocking call,
  the caller) as torch's DistError family (``_errors.torch_error``); arguments pyddp
  refuses raise at the call, before anything is sent;
* ``ReduceOp.PREMUL_SUM`` is a SUM of the inputs scaled by its factor; the bitwise
  ops are refused before communicating.
"""
import torch
import torch.distributed as dist

from .. import _C
from .. import _arrays as A
from .. import collectives as C
from .._errors import COLLECTIVE_FAILURES, raise_as_torch, \
    raise_explained_as_torch as _raise_explained_as_torch
from ._ops import SUM as _SUM, flat as _flat, reduce_op as _reduce_op, \
    scaled as _scaled, thin_ops as _thin_ops, all_reduce_sparse
from ._cuda import CudaWork as _CudaWork
from ._work import PyddpWork, _Completion, _Future, _One, first_error_or_empty, refused, \
    future_for

_PG = _C.ProcessGroup
_CWork = _C.Work
_torch_cpu_code = A.torch_cpu_code     # the one contiguous-CPU-tensor test

# ProcessGroup.torch_run: torch's blocking call on one CPU tensor read and run in C
_C.torch_thin_config(*A.torch_hook_config(torch), _thin_ops())
_ALLREDUCE, _BROADCAST, _REDUCE, _BARRIER = (_C.COLL_ALLREDUCE, _C.COLL_BROADCAST,
                                             _C.COLL_REDUCE, _C.COLL_BARRIER)


class _BackendInfo:
    """What torch asks of ``pg._get_backend(device)``: a backend that cannot split
    (``init_process_group(device_id=...)``, DeviceMesh), allocates no special tensors
    (FSDP2), has no coalescing or time estimation."""
    supports_splitting = False
    supports_coalescing = False
    supports_time_estimate = False

    def __init__(self, device):
        self.device = device

    def supports_tensor_alloc(self, device):
        return False

    def name(self):
        return "pyddp"

    def __repr__(self):
        return f"<pyddp backend for {self.device}>"


class ProcessGroupPyddp(dist.ProcessGroup):
    """A torch process group whose collectives run on ``handle``, a pyddp group
    (``pyddp._group.Group``). rank and size are this process's rank in the group and
    the group's size; ranks are the handle's global ranks, indexed by group rank;
    timeout is the group's (a timedelta); on_shutdown(pg) runs once at shutdown."""

    def __init__(self, handle, rank, size, ranks, timeout, on_shutdown=None):
        super().__init__(rank, size)
        self._handle = handle
        self._timeout_ms = int(handle._timeout_s * 1000)   # the core's, for the thin path
        self._ranks = list(ranks)
        self._timeout = timeout
        self._on_shutdown = on_shutdown
        self._name = ""
        self._desc = "undefined"
        self._closed = False
        self._coalesced = None      # futures collected between _start/_end_coalescing

    # -- identity: what torch, FSDP2 and DeviceMesh look up ----------------------------

    def getBackendName(self):
        return "pyddp"

    def setGroupName(self, name):
        self._name = name

    def getGroupName(self):
        return self._name

    def setGroupDesc(self, desc):
        self._desc = desc

    def getGroupDesc(self):
        return self._desc

    def _get_backend(self, device):
        return _BackendInfo(torch.device(device))

    @property
    def _device_types(self):
        devs = [torch.device("cpu")]
        if torch.cuda.is_available():
            devs.append(torch.device("cuda"))
        return devs

    @property
    def handle(self):
        """The pyddp group this process group runs on."""
        return self._handle

    def __repr__(self):
        return (f"<ProcessGroupPyddp {self._name!r} rank {self.rank()} of {self.size()}, "
                f"global ranks {self._ranks}>")

    # -- plumbing -------------------------------------------------------------------

    def _global(self, group_rank, what):
        if not 0 <= group_rank < len(self._ranks):
            raise _C.DistValueError(f"{what}={group_rank} is out of range for a group of "
                                       f"{len(self._ranks)} ranks")
        return self._ranks[group_rank]

    def _kw(self):
        return {"group": self._handle, "async_op": True}

    def _run(self, calls, result, post=None):
        """Start every call (each returns a pyddp Work, or None when it needs no
        communication) and return one torch Work that completes when all finished,
        with value ``result`` (a list of tensors). A pyddp error raised while starting
        is raised as torch's; works already started still complete the future."""
        fut = future_for(result)
        works = []
        try:
            for call in calls:
                w = call()
                if w is not None:
                    works.append(w)
        except Exception as e:
            if not works:
                return refused(e, result, self._handle)
            # The calls already queued run anyway; wait for them, then report.
            for w in works:
                try:
                    w.wait()
                except Exception:  # noqa: BLE001 - the first error is reported below
                    pass
            raise_as_torch(e)
        comp = _Completion(fut, works, result, post)
        if self._coalesced is not None:
            self._coalesced.append(fut)
        return PyddpWork(fut, comp, self._handle)

    def _in_c(self, kind, tensors, opts):
        """Offer torch's call of kind (_ALLREDUCE, _REDUCE, _BROADCAST, _BARRIER) to
        ProcessGroup.torch_run, which takes a call on one CPU or CUDA tensor in one C
        call: the method's return value, None once a blocking call ran to the end (on a
        CUDA tensor: was queued, ``_cuda``), the torch Work of a submitted asynchronous
        one; or NotImplemented: nothing was sent and the method goes on with its Python
        path. A failure raises as torch's error, a blocking collective's with the
        straggler report."""
        pg = self._handle._pg
        if type(pg) is not _PG:
            return NotImplemented
        try:
            w = pg.torch_run(kind, tensors, opts, self._timeout_ms, _CudaWork)
        except Exception as e:
            if getattr(opts, "asyncOp", False):    # a refused submission
                return refused(e, [] if tensors is None else list(tensors), self._handle)
            self._thin_failed(e)
        if type(w) is _CWork:
            return self._work_of(w, [] if tensors is None else list(tensors))
        if self._coalesced is not None and type(w) is _CudaWork:
            self._coalesced.append(w.get_future())
        return w

    def _work_of(self, w, result):
        """The torch Work of a submitted thin-path call: w its ``_C.Work``, result the
        future's value (the output tensors)."""
        fut = _Future()
        if self._coalesced is not None:
            self._coalesced.append(fut)
        return PyddpWork(fut, _One(fut, w, result), self._handle)

    def _thin_failed(self, e):
        """Raise e, raised by ProcessGroup.torch_run, as torch's error (a collective's
        failure with the straggler report)."""
        if isinstance(e, COLLECTIVE_FAILURES):
            _raise_explained_as_torch(self._handle, e)
        raise_as_torch(e)

    def _thin(self, kind, t, op, root, opts):
        """The thin path of a call of kind (COLL_*) on one tensor t (None: barrier), op a
        ReduceOp code and root a group rank: the torch Work of an asynchronous call,
        None once a blocking one (``opts.asyncOp`` False) is done, or NotImplemented,
        with nothing sent, when t needs the general path (not an exact, contiguous,
        non-empty CPU torch.Tensor of a dtype the core takes; a destroyed group). A
        failure raises as torch's error, a blocking collective's with the straggler
        report. This is the hot path of torch's blocking calls: keep it to attribute
        reads."""
        g = self._handle
        pg = g._pg
        if type(pg) is not _PG:
            return NotImplemented
        if t is None:
            ptr = n = 0
            code = _C.DT_UINT8
        else:
            code = _torch_cpu_code(t)
            if code is None:
                return NotImplemented
            n = t.numel()
            if not n:
                return NotImplemented
            ptr = t.data_ptr()
        tmo = self._timeout_ms
        if opts is not None and not opts.asyncOp:
            # torch's blocking wrapper, which would wait at once: run it to the end here
            # (the lean path: inline when small and nothing is queued)
            try:
                pg.run(kind, ptr, op, root, tmo, n, code)
            except COLLECTIVE_FAILURES as e:
                _raise_explained_as_torch(g, e)
            except Exception as e:
                raise_as_torch(e)
            return None
        try:
            w = pg.submit(kind, None if t is None else (t, ptr, n, code), None, op, root, tmo)
        except Exception as e:
            return refused(e, [] if t is None else [t], g)
        return self._work_of(w, [] if t is None else [t])

    # -- reductions -----------------------------------------------------------------

    # Each thin-path method first offers the call to ProcessGroup.torch_run (_in_c),
    # which takes torch's call on one CPU tensor in one C call (a blocking one run, an
    # asynchronous one submitted) and answers NotImplemented for everything else, with
    # nothing sent.

    def allreduce(self, tensors, opts=None):
        if (w := self._in_c(_ALLREDUCE, tensors, opts)) is not NotImplemented:
            return w
        rop = opts.reduceOp if opts is not None else _SUM
        if any(t.is_sparse for t in tensors):     # gloo's sparse all_reduce, blocking
            for t in tensors:
                try:
                    all_reduce_sparse(t, _reduce_op(rop)[0], self._handle)
                except Exception as e:
                    raise_as_torch(e)
            return self._run([], list(tensors))
        if rop == _SUM:
            op, factor = C.ReduceOp.SUM, None
        else:
            op, factor = _reduce_op(rop)
        if factor is not None:
            with torch.no_grad():
                for t in tensors:
                    t.detach().mul_(factor)
        if len(tensors) == 1:
            w = self._thin(_C.COLL_ALLREDUCE, tensors[0], op, 0, opts)
            if w is not NotImplemented:
                return w
        kw = self._kw()
        return self._run([lambda t=t: C.all_reduce(t, op=op, **kw) for t in tensors],
                         list(tensors))

    def allreduce_coalesced(self, tensors, opts=None):
        op, factor = _reduce_op(opts.reduceOp if opts is not None else _SUM)
        if factor is not None:
            with torch.no_grad():
                for t in tensors:
                    t.detach().mul_(factor)
        kw = self._kw()
        if not tensors:
            return self._run([], [])
        return self._run([lambda: C.all_reduce_coalesced(list(tensors), op=op, **kw)],
                         list(tensors))

    def reduce(self, tensors, opts):
        if (w := self._in_c(_REDUCE, tensors, opts)) is not NotImplemented:
            return w
        op, factor = _reduce_op(opts.reduceOp)
        dst = self._global(opts.rootRank, "dst")
        if factor is None and len(tensors) == 1:
            w = self._thin(_C.COLL_REDUCE, tensors[0], op, opts.rootRank, opts)
            if w is not NotImplemented:
                return w
        kw = self._kw()
        if factor is None:
            return self._run([lambda t=t: C.reduce(t, dst=dst, op=op, **kw)
                              for t in tensors], list(tensors))
        # reduce leaves non-root inputs unchanged: scale a copy, copy the root's back
        scaled = [_scaled(t, factor) for t in tensors]
        me = self.rank() == opts.rootRank

        def post():
            if me:
                with torch.no_grad():
                    for t, s in zip(tensors, scaled):
                        t.copy_(s)
        return self._run([lambda s=s: C.reduce(s, dst=dst, op=op, **kw) for s in scaled],
                         list(tensors), post)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        op, factor = _reduce_op(opts.reduceOp if opts is not None else _SUM)
        if factor is not None:
            input_lists = [[_scaled(t, factor) for t in lst] for lst in input_lists]
        kw = self._kw()
        return self._run([lambda o=o, lst=lst: C.reduce_scatter(o, list(lst), op=op, **kw)
                          for o, lst in zip(outputs, input_lists)], list(outputs))

    def reduce_scatter_single(self, output, input, opts=None):
        op, factor = _reduce_op(opts.reduceOp if opts is not None else _SUM)
        if factor is not None:
            input = _scaled(input, factor)
        kw = self._kw()
        return self._run([lambda: C.reduce_scatter_tensor(output, input, op=op, **kw)],
                         [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        op, factor = _reduce_op(opts.reduceOp if opts is not None else _SUM)
        if factor is not None:
            inputs = [_scaled(t, factor) for t in inputs]
        kw = self._kw()
        return self._run([lambda o=o, i=i: C.reduce_scatter_tensor(o, i, op=op, **kw)
                          for o, i in zip(outputs, inputs)], list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- data movement ----------------------------------------------------------------

    def broadcast(self, tensors, opts=None):
        if (w := self._in_c(_BROADCAST, tensors, opts)) is not NotImplemented:
            return w
        root = opts.rootRank if opts is not None else 0
        src = self._global(root, "src")
        if len(tensors) == 1:
            w = self._thin(_C.COLL_BROADCAST, tensors[0], 0, root, opts)
            if w is not NotImplemented:
                return w
        kw = self._kw()
        return self._run([lambda t=t: C.broadcast(t, src=src, **kw) for t in tensors],
                         list(tensors))

    def allgather(self, output_lists, inputs, opts=None):
        kw = self._kw()
        return self._run([lambda o=o, i=i: C.all_gather(list(o), i, **kw)
                          for o, i in zip(output_lists, inputs)], _flat(output_lists))

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        # torch's all_gather_coalesced: output_lists[r][i] is rank r's inputs[i]
        kw = self._kw()
        return self._run([lambda: C.all_gather_coalesced([list(o) for o in output_lists],
                                                         list(inputs), **kw)],
                         _flat(output_lists))

    def all_gather_single(self, output, input, opts=None):
        kw = self._kw()
        return self._run([lambda: C.all_gather_into_tensor(output, input, **kw)], [output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        kw = self._kw()
        return self._run([lambda o=o, i=i: C.all_gather_into_tensor(o, i, **kw)
                          for o, i in zip(outputs, inputs)], list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_lists, inputs, opts):
        dst = self._global(opts.rootRank, "dst")
        me = self.rank() == opts.rootRank
        kw = self._kw()
        outs = list(output_lists[0]) if me and output_lists else None
        return self._run([lambda: C.gather(inputs[0], outs, dst=dst, **kw)],
                         outs if outs is not None else [])

    def scatter(self, outputs, input_lists, opts):
        src = self._global(opts.rootRank, "src")
        me = self.rank() == opts.rootRank
        kw = self._kw()
        ins = list(input_lists[0]) if me and input_lists else None
        return self._run([lambda: C.scatter(outputs[0], ins, src=src, **kw)],
                         list(outputs))

    def alltoall(self, outputs, inputs, opts=None):
        kw = self._kw()
        return self._run([lambda: C.all_to_all(list(outputs), list(inputs), **kw)],
                         list(outputs))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        kw = self._kw()
        osz = list(output_split_sizes) or None
        isz = list(input_split_sizes) or None
        return self._run([lambda: C.all_to_all_single(
            output, input, output_split_sizes=osz, input_split_sizes=isz, **kw)], [output])

    alltoall_base = all_to_all_single

    # -- point to point and barriers ----------------------------------------------------

    def send(self, tensors, dst, tag=0):
        peer = self._global(dst, "dst")
        return self._run([lambda t=t: C.isend(t, peer, group=self._handle, tag=tag)
                          for t in tensors], list(tensors))

    def recv(self, tensors, src, tag=0):
        peer = self._global(src, "src")
        return self._run([lambda t=t: C.irecv(t, peer, group=self._handle, tag=tag)
                          for t in tensors], list(tensors))

    def recv_anysource(self, tensors, tag=0):
        """torch's recv/irecv without src: the Work's _source_rank() is the sender's group
        rank (torch's recv turns it into the global rank it returns)."""
        if len(tensors) != 1:
            raise _C.DistValueError(f"recv from any source takes one tensor, not "
                                    f"{len(tensors)}")
        started = []

        def call():
            started.append(C.irecv(tensors[0], None, group=self._handle, tag=tag))
            return started[0]
        work = self._run([call], list(tensors))
        work._source = lambda: self._handle.group_rank(started[0].source_rank(), "src")
        return work

    def barrier(self, opts=None):
        if (w := self._in_c(_BARRIER, None, opts)) is not NotImplemented:
            return w
        w = self._thin(_C.COLL_BARRIER, None, 0, 0, opts)
        if w is not NotImplemented:
            return w
        return self._run([lambda: C.barrier(**self._kw())], [])

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """torch's monitored_barrier: every rank reports to the group's first rank, which
        names the ranks that did not arrive within timeout (the group's by default)."""
        try:
            C.monitored_barrier(group=self._handle,
                                timeout=self._timeout if timeout is None else timeout,
                                wait_all_ranks=wait_all_ranks)
        except Exception as e:
            raise_as_torch(e)

    # -- coalescing (torch's old-style _coalescing_manager with a device) ---------------

    def _start_coalescing(self, device=None):
        self._coalesced = []

    def _end_coalescing(self, device=None):
        futs, self._coalesced = self._coalesced or [], None
        return PyddpWork(torch.futures.collect_all(futs).then(first_error_or_empty))

    start_coalescing = _start_coalescing
    end_coalescing = _end_coalescing

    # -- lifetime ---------------------------------------------------------------------

    def shutdown(self):
        """Close the pyddp group (torch calls this from destroy_process_group)."""
        if self._closed:
            return
        self._closed = True
        on_shutdown, self._on_shutdown = self._on_shutdown, None
        if on_shutdown is not None:
            on_shutdown(self)

    def abort(self):
        """Break the group now: peers blocked on this rank fail fast."""
        pg = getattr(self._handle, "_pg", None)
        if pg is not None:
            pg.abort("abort() called through torch")
        self.shutdown()
