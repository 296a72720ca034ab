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
  catches either family catches it.

torch is never imported here unless a torch mapping is asked for (then it already is).
"""
from . import _C, _forensics

# The failures of a collective that the straggler report can explain.
COLLECTIVE_FAILURES = (_C.DistTimeoutError, _C.DistNetworkError, _C.DistBackendError)

_MIXED = {}       # (torch class, pyddp class) -> the class raised for both

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
    if isinstance(e, _C.DistNetworkError):
        tcls = dist.DistNetworkError
    elif isinstance(e, _C.DistStoreError):
        tcls = dist.DistStoreError
    else:
        tcls = dist.DistBackendError
    pcls = type(e)
    cls = _MIXED.get((tcls, pcls))
    if cls is None:
        cls = type(pcls.__name__, (tcls, pcls), {
            "__module__": "pyddp.torch_backend",
            "__doc__": f"pyddp's {pcls.__name__} as torch's {tcls.__name__}."})
        _MIXED[(tcls, pcls)] = cls
    out = cls(str(e))
    out.__cause__ = e
    return out


def raise_as_torch(e):
    """Raise torch_error(e) with e as its cause, or e itself when it needs no mapping
    (call inside the ``except`` block that caught e)."""
    t = torch_error(e)
    if t is e:
        raise e
    raise t from e
