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


class Side:
    """A CUDA stream of one device that pyddp owns, on which futures are completed: the
    torch Stream, its cudaStream_t (ptr), torch's (stream_id, device_index, device_type)
    for it, and the future's device list."""
    __slots__ = ("stream", "ptr", "sid", "device", "dtype", "devices")

    def __init__(self, stream, ptr, sid, device, dtype, devices):
        self.stream, self.ptr, self.sid = stream, ptr, sid
        self.device, self.dtype, self.devices = device, dtype, devices


class Glue:
    """torch's CUDA calls for the CUDA path. ``stream_of(device)`` is the current stream
    of a device as an int cudaStream_t (torch's raw lookup)."""

    def __init__(self):
        self.stream_of = _nccl_backend.torch_stream_of(torch)
        self._sides = {}        # device -> Side
        c = torch._C            # torch's own stream calls, where it has them (2.x does)
        self._get = getattr(c, "_cuda_getCurrentStream", None)
        self._set = getattr(c, "_cuda_setStream", None)
        self._device = getattr(c, "_cuda_getDevice", None)

    def completed(self, cw, result):
        """A torch future with value result (the output tensors of cw, a queued
        ``_C.Work``), completed at once: its CUDA events follow the collective, so a
        consumer that waits on it (torch's DDP, ``then`` callbacks) sees the results; a
        ``torch._C.Future``, as torch's NCCL Work gives. Holds cw's error instead when
        cw already failed."""
        dev = result[0].get_device()
        side = self._sides.get(dev) or self._side(dev)
        try:
            cw.publish(side.ptr)        # side follows the collective on the device
        except Exception as e:  # noqa: BLE001 - the failure goes into the future
            fut = torch.futures.Future()
            fut.set_exception(torch_error(e))
            return fut
        fut = torch._C.Future(side.devices)
        self._complete_on(side, fut, result)
        return fut

    def _side(self, dev):
        st = torch.cuda.Stream(device=dev)
        side = self._sides[dev] = Side(st, st.cuda_stream, st.stream_id, st.device_index,
                                       st.device_type, [torch.device("cuda", dev)])
        return side

    def _complete_on(self, side, fut, result):
        """fut.set_result(result) with side's stream current on its device: the events
        the future records there follow the collective. torch's own stream calls when
        the current device is side's (then switching streams leaves the device alone),
        else its stream context."""
        prev = None
        if self._set is not None and self._get is not None and self._device is not None \
                and self._device() == side.device:
            prev = self._get(side.device)    # (stream_id, device_index, device_type)
        if not isinstance(prev, tuple) or len(prev) != 3:
            with torch.cuda.stream(side.stream):
                fut.set_result(result)
            return
        self._set(stream_id=side.sid, device_index=side.device, device_type=side.dtype)
        try:
            fut.set_result(result)
        finally:
            self._set(stream_id=prev[0], device_index=prev[1], device_type=prev[2])


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
