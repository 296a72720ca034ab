"""What a failed collective raises: pyddp's error with the straggler report added, and
the same error as torch's DistError family for the "pyddp" torch backend.

Two mappings, each written once:

* :func:`raise_explained` is the one forensic re-raise. A collective that failed
  because a peer timed out, went away or broke the group (DistTimeoutError,
  DistNetworkError, DistBackendError) is re-raised with ``_forensics.explain``'s
  summary appended (who had not arrived, where each rank is, or where a lost
  connection came from), as a new exception of the same class without the old
  traceback. Every blocking wait of pyddp's Python layer goes through it: ``Work.wait``,
  the lean path, DDP's end of backward, the torch backend's blocking calls.
* :func:`torch_error` maps pyddp's exception classes onto torch's (DistNetworkError,
  DistStoreError, else DistBackendError) by a class derived from both, so code that
  catches either family catches it. Those classes are made at run time (one per pyddp
  class, torch imported only then), so an instance pickles as "this pyddp class as
  torch's" (:func:`_remake`, found by reference), never by its class's name: it survives
  ``pickle``, ``multiprocessing`` and torch's RPC with its class and message.

torch is never imported here unless a torch mapping is asked for (then it already is).
"""
from . import _C, _forensics

# The failures of a collective that the straggler report can explain.
COLLECTIVE_FAILURES = (_C.DistTimeoutError, _C.DistNetworkError, _C.DistBackendError)

_MIXED = {}       # pyddp class -> the class raised for it in torch code (torch's and it)

# The class of the last collective failure handed to torch code (pyddp.elastic reads it:
# torch's DDP passes a failed all-reduce on as a plain RuntimeError). The class only: the
# exception's traceback would keep its frames, and the groups in them, alive.
last_failure = None


def raise_explained(group, e):
    """Raise e, a failure of a collective on group (a ``_group.Group``), with the
    straggler summary of ``_forensics.explain`` appended to its message when there is
    one: then as a fresh exception of e's class (no chained context, so the message is
    read once). group None: no summary is looked for (a wait that only expired). Call
    inside the ``except`` block that caught e; waits at most about
    ``_forensics.REPORT_WAIT_S`` for the other ranks' reports."""
    extra = _forensics.explain(group, e) if group is not None else None
    if extra:
        raise type(e)(f"{e}\n{extra}") from None
    raise e


def torch_error(e):
    """The exception torch code expects for pyddp's exception e: an instance of a class
    derived from both torch's DistError class (DistNetworkError, DistStoreError, else
    DistBackendError, the one torch raises for failed collectives) and e's own pyddp
    class, so ``except torch.distributed.DistBackendError``, ``except
    pyddp.CollectiveMismatchError`` and ``except TimeoutError`` (pyddp's timeouts) all
    catch it. Same message, e as its cause. Anything else (argument errors,
    KeyboardInterrupt, errors that already are torch's) is returned unchanged."""
    if not isinstance(e, _C.DistError):
        return e
    global last_failure
    if isinstance(e, COLLECTIVE_FAILURES):
        last_failure = type(e)
    import torch.distributed as dist    # e is mapped for torch code: torch is imported
    if isinstance(e, dist.DistError):
        return e
    out = _mixed_class(type(e), dist)(str(e))
    out.__cause__ = e
    return out


def _mixed_class(pcls, dist):
    """The class raised for pyddp's class pcls in torch code (dist: torch.distributed):
    derived from torch's DistNetworkError, DistStoreError or DistBackendError and from
    pcls, made once per pcls."""
    cls = _MIXED.get(pcls)
    if cls is None:
        if issubclass(pcls, _C.DistNetworkError):
            tcls = dist.DistNetworkError
        elif issubclass(pcls, _C.DistStoreError):
            tcls = dist.DistStoreError
        else:
            tcls = dist.DistBackendError
        cls = type(pcls.__name__, (tcls, pcls), {
            "__module__": "pyddp.torch_backend", "__reduce__": _reduce_mixed,
            "_pyddp_class": pcls,
            "__doc__": f"pyddp's {pcls.__name__} as torch's {tcls.__name__}."})
        _MIXED[pcls] = cls
    return cls


def _reduce_mixed(self):
    """pickle's recipe for an instance of a mixed class: _remake(its pyddp class, its
    arguments), plus its attributes. The class itself cannot be found by name (it is
    made at run time), the pyddp class and _remake can."""
    return _remake, (self._pyddp_class, self.args), (self.__dict__ or None)


def _remake(pcls, args):
    """Unpickling: the mixed class of pyddp's class pcls, made with args (torch is
    imported: the pickled error was torch's)."""
    import torch.distributed as dist
    return _mixed_class(pcls, dist)(*args)


def raise_explained_as_torch(group, e):
    """Raise e, a failure of a collective on group (a ``_group.Group``), with the
    straggler report (:func:`raise_explained`), as torch's error."""
    try:
        raise_explained(group, e)
    except Exception as x:
        raise_as_torch(x)


def raise_as_torch(e):
    """Raise torch_error(e) with e as its cause, or e itself when it needs no mapping
    (call inside the ``except`` block that caught e)."""
    t = torch_error(e)
    if t is e:
        raise e
    raise t from e
