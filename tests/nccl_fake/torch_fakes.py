"""TEST DOUBLES of a CUDA torch tensor and of torch's CUDA calls, for running the CUDA
tensor path of pyddp (its lean C path, ``pyddp/torch_backend/_cuda.py``) with a torch
that has no CUDA, against the test-double libraries fake_nccl.c and fake_cudart.c (whose
"device memory" is host memory). Never shipped.

* :class:`FakeCudaTensor` is a CPU tensor (a ``torch.Tensor`` subclass sharing its
  memory) that says it lives on cuda:0: ``is_cuda`` True, ``get_device()`` 0. torch's
  own functions take it as a tensor (no ``__torch_function__`` dispatch), and
  :func:`install` makes pyddp's C path take it where it takes ``torch.Tensor``.
* :class:`FakeGlue` is ``_cuda.Glue`` without CUDA: the current stream of device d is
  ``STREAMS[d]``, futures have no devices, and completing one switches no stream (its
  side stream is SIDE_STREAM, which fake_cudart.c logs like any stream; the rest of
  ``Glue.completed`` is the real one).
"""
import torch

from pyddp.torch_backend import _cuda

CALLER_STREAM = 0x5150
SIDE_STREAM = 0x51DE
STREAMS = {0: CALLER_STREAM}


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor that pyddp's CUDA path takes for one on cuda:0 (see the module)."""
    __torch_function__ = torch._C._disabled_torch_function_impl
    is_cuda = True
    is_cpu = False
    get_device = (0).__index__      # a C callable: no Python frame per call


def cuda(t):
    """t (a contiguous CPU tensor) as a FakeCudaTensor over the same memory."""
    return t.as_subclass(FakeCudaTensor)


class FakeGlue(_cuda.Glue):
    """``_cuda.Glue`` without CUDA (see the module)."""

    def __init__(self):
        super().__init__()
        self.stream_of = STREAMS.__getitem__     # a C callable, like torch's raw lookup

    def _side(self, dev):
        side = self._sides[dev] = _cuda.Side(None, SIDE_STREAM, 0, dev, 1, [])
        return side

    def _complete_on(self, side, fut, result):
        fut.set_result(result)


def install():
    """Make pyddp's CUDA path take FakeCudaTensor, with FakeGlue's calls."""
    _cuda.install(FakeGlue(), FakeCudaTensor)
