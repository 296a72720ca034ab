"""The "pyddp" backend's CUDA tensors: the torch Work of an asynchronous call on one
CUDA tensor, and the few torch CUDA calls that Work needs.

``ProcessGroup.torch_run`` (csrc/py/py_torch_cuda.c) queues torch's call on one
contiguous CUDA tensor on pyddp's NCCL path in one C call, with the semantics of torch's
own "nccl" backend:

* a blocking call (``opts.asyncOp`` False) returns None once queued, the caller's
  current stream ordered after it; the host does not wait;
* an asynchronous one returns a :class:`CudaWork`, made in C, holding the queued
  ``_C.Work`` (``_cw``) and the output tensors (``_result``). ``wait()`` orders the
  current stream after the collective without waiting on the host, as torch's NCCL
  Work does; ``get_future()`` makes the future only when asked (torch's DDP asks; a
  plain ``async_op=True`` caller usually does not), already completed, with CUDA events
  that follow the collective, as torch's NCCL future is.

Failures: pyddp's completion thread polls every queued collective until it ends; one
that fails or passes its deadline aborts the group's NCCL communicator (its kernels
exit), so the next call on the group raises the reason, as torch's NCCL watchdog makes
happen. ``wait()``, ``is_completed()`` and ``exception()`` report a failure already
known, and a future asked for after it holds the error.

:class:`Glue` is where the torch CUDA calls are (the current stream, a future with
devices, completing it on a stream that follows the collective). The tests replace it
(:func:`install`) where torch has no CUDA, with the test-double libraries of
tests/nccl_fake.
"""
import torch
import torch.distributed as dist

from .. import _nccl_backend
from .._errors import raise_as_torch, torch_error


class Glue:
    """torch's CUDA calls for the CUDA path. ``stream_of(device)`` is the current stream
    of a device as an int cudaStream_t (torch's raw lookup)."""

    def __init__(self):
        self.stream_of = _nccl_backend.torch_stream_of(torch)
        self._sides = {}        # device -> a torch Stream the futures complete on

    def completed(self, cw, result):
        """A torch future with value result (the output tensors of cw, a queued
        ``_C.Work``), completed at once: its CUDA events follow the collective, so a
        consumer that waits on it (torch's DDP, ``then`` callbacks) sees the results.
        Holds cw's error instead when cw already failed."""
        dev = result[0].get_device()
        fut = self._future(dev)
        side, ptr = self._side(dev)
        try:
            cw.publish(ptr)             # side follows the collective on the device
        except Exception as e:  # noqa: BLE001 - the failure goes into the future
            fut.set_exception(torch_error(e))
            return fut
        with self._on(side):
            fut.set_result(result)      # events recorded on side, after the collective
        return fut

    def _future(self, dev):
        return torch.futures.Future(devices=[torch.device("cuda", dev)])

    def _side(self, dev):
        """(a torch Stream of device dev that pyddp owns, its cudaStream_t)."""
        s = self._sides.get(dev)
        if s is None:
            st = torch.cuda.Stream(device=dev)
            s = self._sides[dev] = (st, st.cuda_stream)
        return s

    def _on(self, stream):
        return torch.cuda.stream(stream)


GLUE = Glue()


def install(glue, tensor_type=None):
    """Use glue's torch CUDA calls from now on, and hand C its stream lookup with the
    CUDA tensor class tensor_type (torch.Tensor when None); the test doubles' way in."""
    global GLUE
    GLUE = glue
    _nccl_backend.torch_cuda_setup(torch, tensor_type, glue.stream_of)


_nccl_backend.torch_cuda_setup(torch, None, GLUE.stream_of)


class CudaWork(dist.Work):
    """The torch Work of an asynchronous call on one CUDA tensor (see the module's
    docstring). Made in C without arguments; C then sets ``_cw`` (the ``_C.Work``) and
    ``_result`` (the output tensors)."""

    _fut = None

    def wait(self, timeout=None):
        """Order the current stream after the collective (no host wait), as torch's NCCL
        Work does; raise its error, as torch's, if it already failed."""
        try:
            self._cw.publish(GLUE.stream_of(self._result[0].get_device()))
        except Exception as e:
            raise_as_torch(e)
        return True

    def get_future(self):
        fut = self._fut
        if fut is None:
            fut = self._fut = GLUE.completed(self._cw, self._result)
        return fut

    def is_completed(self):
        return self._cw.is_completed()

    def is_success(self):
        return self._cw.is_completed() and self._cw.exception() is None

    def exception(self):
        e = self._cw.exception()
        return None if e is None else torch_error(e)

    def result(self):
        self.wait()
        return self._result

    def synchronize(self):
        self.wait()

    def __repr__(self):
        return f"<pyddp CUDA Work {'done' if self._cw.is_completed() else 'queued'}>"
