"""Gradient bucketing engine behind pyddp.DistributedDataParallel.

Two layers, shared by the torch front-end (``_torch``) and the array front-end
(``ddp``):

``BucketEngine`` owns one bucket plan (made by the C reducer, ``_C.Reducer``), the
bucket arrays (allocated with the parameters' own library, dtype and device) and a
view of each parameter's slot. Its two subclasses move the data:

* ``CPath`` (CPU arrays on pyddp's CPU process group): ``_C.Reducer`` copies each
  ready gradient into its slot and queues each full bucket's averaged all-reduce on
  the communicator's worker thread, then waits and copies the averages back;
* ``GenericPath`` (any library and device, any backend whose process group has
  ``submit``, e.g. NCCL): the same C bookkeeping decides which buckets may start, and
  Python copies with the array library and all-reduces through ``pg.submit``.

The generic path is forced on CPU by ``PYDDP_DDP_GENERIC_PATH=1`` (or the constructor's
private ``_generic_path=True``), which is how the tests keep it honest.

With a reduce dtype ("float16"/"bfloat16"), float32/float64 parameters get buckets of
that dtype ("converted" parameters): the copy into the slot rounds once to it (C:
ddp_dtype_cast.c; generic: ``A.divide_into``), and the copy back widens the average.
float16 slots are divided by the world size on the way in and all-reduced with SUM, so
the sum cannot overflow where the gradients do not (as torch's fp16_compress_hook);
bfloat16 has float32's range, so its slots hold the gradients themselves and are
all-reduced with AVG (the narrowing is then a plain rounding, several times cheaper than
a correctly rounded division). Their ``.grad`` is never a
bucket view (gradient_as_bucket_view applies to the other parameters only).

How each bucket is filled and reduced (narrowed or not, divided by what, SUM or AVG) is
the C plan's rule (``Reducer.bucket_rules``, ddp_plan_bucket_rule), which the C path
follows and the generic path asks for.

``GradSync`` carries out DDP's per-iteration semantics on top of an engine. The rules
themselves (which gradients are expected, the first of a backward, per-parameter counts,
``find_unused_parameters``' use flags, ``static_graph``'s learned counts, the second-
gradient error) are C's (``_C.GradHooks`` over ddp_grad_rules, asked by the C hooks and
by ``on_grad`` alike); GradSync does what their verdicts say: hands gradients to the
engine, words the errors naming the parameters, creates ``.grad`` for parameters only
other ranks used, and rebuilds the buckets once in the order gradients arrived on rank 0.
"""
import numpy as np

from .. import _C
from .._nccl_backend import caller_stream
from .. import _arrays as A
from .._errors import COLLECTIVE_FAILURES, raise_explained

FIRST_BUCKET_BYTES = _C.REDUCER_FIRST_BUCKET_BYTES
_READY, _SECOND, _TOO_MANY = _C.GRAD_READY, _C.GRAD_SECOND, _C.GRAD_TOO_MANY


def dtype_name(x):
    """'float32' for torch.float32, numpy/cupy float32, ml_dtypes bfloat16, ..."""
    return str(x.dtype).rsplit(".", 1)[-1]


def device_key(x):
    """An int naming x's device: -1 for host memory, the GPU index for CUDA arrays."""
    dev = getattr(x, "device", None)
    if dev is None or isinstance(dev, str):
        return -1
    if getattr(dev, "type", None) == "cuda":
        return dev.index if dev.index is not None else 0
    if getattr(dev, "type", None) == "cpu":
        return -1
    return getattr(dev, "id", -1)   # CuPy devices


def int_array_like(like, values, dtype):
    """A 1-D integer array holding values, in like's library and on like's device (so
    that any backend, NCCL included, can communicate it)."""
    lib = A._lib(like)
    host = np.asarray(values, dtype=dtype)
    if lib == "torch":
        import torch
        return torch.from_numpy(host).to(like.device)
    if lib == "cupy":
        import cupy
        return cupy.asarray(host)
    return host


def wait_all(works):
    """Wait for every handle (so none is left using memory), then raise the first error."""
    first = None
    for w in works:
        try:
            w.wait()
        except BaseException as e:  # noqa: B902 - re-raised below, after the others
            first = first or e
    if first is not None:
        raise first


class BucketEngine:
    """One bucket plan with its arrays and slot views; the data movement is the
    subclass's (CPath or GenericPath; ``make_engine`` picks).

    params: the parameter arrays (torch tensors, NumPy or CuPy arrays), registration
    order. order: their expected ready order (None: reverse registration order).
    """

    def __init__(self, params, pg, world_size, cap_bytes, timeout_ms, order=None,
                 reduce_dtype=None):
        self._params = params
        self._pg = pg
        self._world = world_size
        self._timeout_ms = timeout_ms
        specs = [(A.numel(p), dtype_name(p), device_key(p)) for p in params]
        # The first bucket is small so that communication starts early in backward
        # (never larger than the cap the user asked for).
        self._c = _C.Reducer(specs, min(FIRST_BUCKET_BYTES, cap_bytes), cap_bytes, order,
                             reduce_dtype)
        layout, pbucket, poffset = self._c.layout()
        self.layout = layout
        # (narrow, divisor, op) of each bucket: narrowed buckets hold the gradients in the
        # reduce dtype, divided by divisor on the way in (C's rule, for both paths)
        self.bucket_rules = self._c.bucket_rules(world_size)
        self.buckets = []
        for (members, numel, dt, _dev), (narrow, _div, _op) in zip(layout, self.bucket_rules):
            like = A.for_core(params[members[0]])
            b = A.empty_flat(like, numel, A.dtype_in(like, dt) if narrow else None)
            b[...] = 0
            self.buckets.append(b)
        self.converted = [self.bucket_rules[pbucket[i]][0] for i in range(len(params))]
        self._pbucket = pbucket
        self.views = [self.buckets[pbucket[i]][poffset[i]:poffset[i] + A.numel(p)]
                      .reshape(tuple(p.shape)) for i, p in enumerate(params)]
        self._copy_back = {}    # index -> gradient the average is copied into by Python

    # -- bookkeeping (C) shared by both paths -----------------------------------------
    def begin(self):
        self._c.begin()

    @property
    def in_iteration(self):
        return self._c.in_iteration

    def note_used(self, i):
        self._c.note_used(i)

    def unready(self):
        return self._c.unready()

    def arrival(self):
        return self._c.arrival()

    def _copy_back_python(self, used):
        for i, g in self._copy_back.items():
            if used is None or used[i]:
                A.copy_into(g, self.views[i])
        self._copy_back.clear()

    # -- data: the subclass's ------------------------------------------------------------
    def ready(self, i, grad, copy_back):
        """Parameter i's gradient (None: zeros) is final for this iteration: put it in
        its slot and start every bucket that may now start. With copy_back, finish()
        writes the average into grad."""
        raise NotImplementedError

    def finish(self, track_used):
        """Wait for every bucket and copy the averages back (skipping parameters no rank
        used, when track_used). Returns the per-parameter count of ranks that used it
        (track_used) or None. Ends the iteration, also on error."""
        raise NotImplementedError

    def drain(self):
        """Error path: wait for whatever is in flight, ignore results, end the iteration."""
        raise NotImplementedError


class CPath(BucketEngine):
    """Host memory on pyddp's CPU process group: _C.Reducer copies each gradient into
    its slot, queues full buckets on the communicator's worker thread, waits and copies
    back, all in C."""

    def __init__(self, params, pg, world_size, cap_bytes, timeout_ms, order=None,
                 reduce_dtype=None):
        super().__init__(params, pg, world_size, cap_bytes, timeout_ms, order, reduce_dtype)
        self._c.attach(pg if world_size > 1 else None, self.buckets)

    def ready(self, i, grad, copy_back):
        # A contiguous CPU torch tensor goes by address: no NumPy view or DLPack capsule
        # per gradient.
        code = A.torch_cpu_code(grad)
        if code is not None:
            self._c.ready(i, grad, copy_back, grad.data_ptr(), grad.numel(), code)
            return
        if grad is not None and not A.is_contiguous(grad):
            if copy_back:
                self._copy_back[i] = grad
            if not self.converted[i]:
                # The C path takes contiguous memory only: stage through the slot.
                A.copy_into(self.views[i], grad)
                self._c.ready(i, A.for_core(self.views[i]), False)
            elif self._world == 1:
                # The average over one rank is grad itself: leave it exact.
                self._copy_back.pop(i, None)
                self._c.ready(i, None, False)
            else:
                # A contiguous copy for C to narrow into the slot.
                self._c.ready(i, A.host_view(A.Staged(grad).array), False)
        else:
            self._c.ready(i, None if grad is None else A.host_view(grad), copy_back)

    def finish(self, track_used):
        try:
            self._c.finish(track_used)
            used = self._c.global_used() if track_used else None
            self._copy_back_python(used)
            return used
        finally:
            self._copy_back.clear()

    def drain(self):
        self._copy_back.clear()
        self._c.drain()


class GenericPath(BucketEngine):
    """Any array library and device, any backend with ``submit`` (NCCL, ...): the C
    bookkeeping says which buckets may start; Python copies with the array library and
    all-reduces each bucket through ``pg.submit``."""

    def __init__(self, params, pg, world_size, cap_bytes, timeout_ms, order=None,
                 reduce_dtype=None):
        super().__init__(params, pg, world_size, cap_bytes, timeout_ms, order, reduce_dtype)
        self._works = []        # bucket all-reduces in flight, in bucket order

    def ready(self, i, grad, copy_back):
        view = self.views[i]
        stays = self._world == 1 and copy_back   # the average over one rank is grad itself
        if grad is None:
            view[...] = 0
        elif self.converted[i] and not stays:
            # narrowed once into the slot, divided as the bucket's rule says
            A.divide_into(view, grad, self.bucket_rules[self._pbucket[i]][1])
        elif grad is not view and not stays:
            A.copy_into(view, grad)
        if copy_back and grad is not None and not stays:
            self._copy_back[i] = grad
        first, count = self._c.mark_ready(i)
        if self._world > 1:
            for b in range(first, first + count):
                x = A.for_core(self.buckets[b])
                self._works.append(self._pg.submit(_C.COLL_ALLREDUCE, x, None,
                                                   self.bucket_rules[b][2], 0,
                                                   self._timeout_ms, caller_stream(x)))

    def finish(self, track_used):
        try:
            used = None
            if track_used:
                used = self._c.local_used()
                if self._world > 1:     # after the buckets, like the C path
                    flags = int_array_like(A.for_core(self._params[0]), used, np.int32)
                    self._works.append(self._pg.submit(_C.COLL_ALLREDUCE, flags, None,
                                                       _C.OP_SUM, 0, self._timeout_ms,
                                                       caller_stream(flags)))
            works, self._works = self._works, []
            wait_all(works)
            if track_used and self._world > 1:
                used = flags.tolist()
            self._copy_back_python(used)
            return used
        finally:
            self._copy_back.clear()
            self._c.end()

    def drain(self):
        self._copy_back.clear()
        works, self._works = self._works, []
        try:
            wait_all(works)
        except BaseException:  # noqa: B902 - the caller is already raising its own error
            pass
        self._c.end()


def make_engine(params, pg, world_size, cap_bytes, generic, timeout_ms, order=None,
                reduce_dtype=None):
    return (GenericPath if generic else CPath)(params, pg, world_size, cap_bytes, timeout_ms,
                                               order, reduce_dtype)


class GradSync:
    """DDP's iteration semantics over a BucketEngine, carrying out the verdicts of the C
    rules (``_C.GradHooks``).

    The front-end supplies the parameters (arrays), their names, and how to read and
    replace a parameter's gradient (``get_grad(i)``, ``set_grad(i, g)``). It calls
    ``start()`` when a synced backward is expected, then for each accumulated gradient
    either the C hook (``hooks.hook(i)``, which asks the rules and calls ``act`` for what
    it does not do itself) or ``on_grad(i)``, and ``finalize()`` once backward is over.
    reduce_dtype: None, "float16" or "bfloat16" (checked by the front-end).
    """

    def __init__(self, params, names, get_grad, set_grad, *, pg, rank, world_size,
                 bucket_cap_bytes, find_unused, static_graph, view_mode, generic,
                 timeout_ms, reduce_dtype=None, group=None):
        self.params, self.names = params, names
        self._group = group          # the pyddp Group, for straggler reports
        self.get_grad, self.set_grad = get_grad, set_grad
        self._reduce_dtype = reduce_dtype
        self.rank, self.world = rank, world_size
        self._pg, self._timeout_ms = pg, timeout_ms
        self._cap, self._generic = bucket_cap_bytes, generic
        self.static_graph = static_graph
        self.dynamic_unused = find_unused and not static_graph
        self.view_mode = view_mode
        self.engine = make_engine(params, pg, world_size, bucket_cap_bytes, generic, timeout_ms,
                                  reduce_dtype=reduce_dtype)
        # The per-gradient rules and their state (expected backward, counts, static
        # graph's learned counts) live in C, where the torch front-end's hooks ask them.
        self.hooks = _C.GradHooks(len(params), static_graph=static_graph,
                                  find_unused=self.dynamic_unused)
        self.broken = None           # message of an unrecoverable error
        self.synced_used = None      # last finalize: per-parameter use counts (None: all)
        self.rebuilt = False
        self._order_seen = None      # arrival order of the first synced iteration
        self._static_used = None     # global use counts of a static graph's iteration 1
        if view_mode:
            self._point_grads_at_views()
        self._set_reducer()

    expect = property(lambda self: self.hooks.expect)

    def _set_reducer(self):
        """The rules note use in the engine's reducer; the C hooks hand the common case to
        it themselves (see GradHooks) on the C data path with none of static_graph,
        find_unused_parameters, gradient_as_bucket_view."""
        lean = isinstance(self.engine, CPath) and not (self.static_graph or
                                                       self.dynamic_unused or self.view_mode)
        self.hooks.set_reducer(self.engine._c, lean)

    # -- iteration ---------------------------------------------------------------------
    def check_prior(self):
        """Raise if an earlier error broke DDP, or if the previous synced backward started
        but never finished (some gradients arrived, the reduction did not complete)."""
        if self.broken:
            raise _C.DistError(self.broken)
        if self.engine.in_iteration:
            if len(self.engine.unready()) < len(self.params):
                self._fail(self._unused_message(self.engine.unready(), when="in the previous "
                                                "iteration"))
            self.engine.drain()      # forward without backward: nothing to reduce

    def start(self):
        self.check_prior()
        self.engine.begin()
        self.hooks.begin()

    def on_grad(self, i):
        """Parameter i's gradient was accumulated: ask the rules, do what they say.
        Returns True for the first gradient of a synced iteration: the caller then makes
        finalize() run after backward."""
        g = self.get_grad(i)
        return self.act(i, self.hooks.on_grad(i, g is not None), g)

    def act(self, i, verdict, g=None):
        """Carry out the rules' verdict (GradHooks.on_grad's) on parameter i's gradient g
        (None: read it): pre-mark a static graph's never-used parameters, hand the
        gradient to the engine, or raise the error the rules found. Returns the
        verdict's `first`."""
        action, first, premark, count, expected = verdict
        if premark:
            for j in self.hooks.never_used():
                self._ready(j)
        if action == _READY:
            try:
                self._ready(i, g)
            except BaseException as e:
                self.hook_failed(e)
                raise
        elif action == _TOO_MANY:
            self._fail(f"DDP (static_graph=True): rank {self.rank}: parameter "
                       f"{self.names[i]!r} received {count} gradients in one "
                       f"backward pass but {expected} in the first "
                       f"iteration; the graph is not static, so use static_graph=False")
        elif action == _SECOND:
            self._fail(f"DDP: rank {self.rank}: parameter {self.names[i]!r} received a second "
                       f"gradient in one backward pass (reentrant backward, e.g. activation "
                       f"checkpointing, or a parameter shared by modules run in separate "
                       f"backward calls). Its bucket was already being reduced. If the graph "
                       f"is the same every iteration, pass static_graph=True.")
        return first

    def hook_failed(self, e):
        """Handing a gradient to the engine raised e inside autograd: remember why (and
        break the group), so the next forward explains it instead of reporting missing
        gradients. Raises DDP's error unless DDP was already broken."""
        if not self.broken:
            self._fail(f"DDP: rank {self.rank}: the gradient reduction failed: {e}", cause=e)

    def _viewed(self, i):
        """gradient_as_bucket_view applies to parameter i (its bucket has its dtype)."""
        return self.view_mode and not self.engine.converted[i]

    def _ready(self, i, g=None):
        """Parameter i's gradient g (None: read it) is final: hand it to the engine."""
        if g is None:
            g = self.get_grad(i)
        if self._viewed(i):
            view = self.engine.views[i]
            self.engine.ready(i, g, False)
            if g is not None and g is not view:
                self.set_grad(i, view)
        else:
            skip = self._static_used is not None and not self._static_used[i]
            self.engine.ready(i, g, g is not None and not skip)

    def finalize(self):
        """End of backward: hand in (or report) the parameters the rules say, wait for
        every bucket, and leave averaged gradients in .grad."""
        try:
            outcome, pending, track = self.hooks.end_backward()
            if outcome == _C.GRAD_END_OK:
                for i in pending:
                    self._ready(i)
            elif outcome == _C.GRAD_END_STATIC_UNUSED:
                self._fail(self._unused_message(pending, when="in this backward pass, "
                                                "unlike in the first iteration") +
                           " (static_graph=True requires the same graph every iteration)")
            else:
                self._fail(self._unused_message(pending, when="in this backward pass"))
            try:
                used = self.engine.finish(track)
            except COLLECTIVE_FAILURES as e:
                raise_explained(self._group, e)
            if self.hooks.learn():
                self._static_used = used
            elif self.static_graph:
                used = self._static_used
            if used is not None:
                self._create_missing_grads(used)
            self.synced_used = used
            if not self.rebuilt and self._order_seen is None and not self.dynamic_unused:
                self._order_seen = self.engine.arrival()
        except BaseException:
            if self.engine.in_iteration:
                self.engine.drain()
            raise

    def _create_missing_grads(self, used):
        """Parameters some rank used but this one did not: give them the average (torch
        creates their .grad; parameters no rank used keep theirs untouched)."""
        for i, n in enumerate(used):
            if n and self.get_grad(i) is None:
                view = self.engine.views[i]
                self.set_grad(i, view if self._viewed(i) else A.copy_as(view, self.params[i]))

    def _fail(self, msg, cause=None):
        """This rank cannot go on: break the process group first, so that peers waiting
        in this iteration's all-reduces fail at once instead of at the timeout."""
        self.broken = msg
        if self.world > 1:
            self._pg.abort(msg)
        if self.engine.in_iteration:
            self.engine.drain()
        raise _C.DistError(msg) from cause

    def _unused_message(self, unready, when):
        names = [self.names[i] for i in unready]
        shown = names if len(names) <= 20 else names[:20] + [f"... ({len(names) - 20} more)"]
        return (f"DDP: rank {self.rank}: {len(names)} parameter(s) received no gradient "
                f"{when}, so their buckets could never be all-reduced: {shown} (indices "
                f"{unready[:20]}). Make every parameter contribute to the loss (use all "
                f"forward outputs in the loss), or pass find_unused_parameters=True to "
                f"DistributedDataParallel. This DDP instance is now unusable: fix the "
                f"model and restart the job.")

    # -- buckets in arrival order -----------------------------------------------------------
    def rebuild_due(self):
        """The buckets are re-planned at this forward (the first after the first synced
        iteration, unless a dynamic unused set means there is no order to learn)."""
        return not (self.rebuilt or self._order_seen is None or self.engine.in_iteration)

    def maybe_rebuild(self):
        """Once, after the first synced iteration: re-plan the buckets in the order the
        gradients arrived on rank 0 (broadcast, so every rank gets the same plan).
        Collective: every rank calls it at the same point (the next forward)."""
        if not self.rebuild_due():
            return False
        self.rebuild()
        return True

    def rebuild(self):
        """Re-plan the buckets in rank 0's arrival order (collective, see maybe_rebuild).
        A rank that saw no synced backward of its own (joined before the first) offers
        the planned order, reverse registration (rank 0's order is the one used)."""
        seen = self._order_seen
        if seen is None:
            seen = list(reversed(range(len(self.params))))
        order = int_array_like(A.for_core(self.params[0]), seen, np.int64)
        if self.world > 1:
            self._pg.submit(_C.COLL_BROADCAST, order, None, 0, 0, self._timeout_ms,
                            caller_stream(order)).wait()
        engine = make_engine(self.params, self._pg, self.world, self._cap, self._generic,
                             self._timeout_ms, order=order.tolist(),
                             reduce_dtype=self._reduce_dtype)
        self.engine = engine
        self._set_reducer()
        self.rebuilt = True
        self._order_seen = None
        if self.view_mode:
            self._point_grads_at_views()

    def _point_grads_at_views(self):
        """gradient_as_bucket_view: existing gradients move into their bucket slots and
        .grad becomes the slot itself."""
        for i, view in enumerate(self.engine.views):
            g = self.get_grad(i)
            if self._viewed(i) and g is not None and g is not view:
                A.copy_into(view, g)
                self.set_grad(i, view)
