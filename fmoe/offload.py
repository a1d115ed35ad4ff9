"""Activation offloading: what an F saves for B waits in host memory instead of on the device.

    with offloaded(keep=(*params, *inputs)):   # around a stage's F (``fmoe.stage.forward``)
        outputs = stage.forward(...)

Inside, saved-tensor hooks copy each tensor autograd saves (of at least ``MIN_BYTES``, and not one
of ``keep``: the stage's parameters and inputs, alive anyway by the ownership rules) to host memory
and keep only the copy; B's first use of it copies it back. The same tensor saved by several ops
(a norm's output read by three projections) goes once each way.

On CUDA the host copy is pinned and made on a side stream, after the compute stream's work so far
(``wait_stream``); the device tensor's memory is not reused before that copy has run
(``record_stream``), so the compute stream never waits for it. The way back is issued on the
compute stream after the copy's event (``wait_event``), so B never reads a copy that is still in
flight. On the CPU the "host" copy is an ordinary tensor: no memory is saved, but the path is the
same (what the CPU tests compare bitwise against keeping the tensors). Either way every copy keeps
the tensor's sizes and strides, so B computes on exactly the values and layouts it would have read.
Not prefetched: the way back runs when B first needs the tensor.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

__all__ = ["MIN_BYTES", "offloaded"]

MIN_BYTES = 1 << 20  # smaller saved tensors stay where they are: a copy's latency outweighs them


def _key(t: Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


class _Host:
    """One saved tensor's host copy, the event its copy recorded (CUDA), and the device copy made
    back from it while B still holds that."""

    def __init__(self, t: Tensor, stream: torch.cuda.Stream | None):
        self.device, self.original = t.device, weakref.ref(t)
        self.host = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, pin_memory=stream is not None)
        self.event = None
        if stream is None:
            self.host.copy_(t)
        else:
            stream.wait_stream(torch.cuda.current_stream(t.device))  # t's producer has run
            with torch.cuda.stream(stream):
                self.host.copy_(t, non_blocking=True)
            t.record_stream(stream)  # its memory is not reused before the copy ran
            self.event = stream.record_event()
        self.back: weakref.ref | None = None

    def restore(self) -> Tensor:
        t = self.original()  # still alive (an output handed on): no copy back
        if t is None and self.back is not None:
            t = self.back()
        if t is not None:
            return t
        t = torch.empty_strided(
            self.host.shape, self.host.stride(), dtype=self.host.dtype, device=self.device
        )
        if self.event is None:
            t.copy_(self.host)
        else:
            torch.cuda.current_stream(self.device).wait_event(self.event)  # the way out finished
            t.copy_(self.host, non_blocking=True)
        self.back = weakref.ref(t)
        return t


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}  # the copy stream of each device, made once


class _Offload:
    def __init__(self, keep: Iterable[Tensor]):
        self.keep = {t.untyped_storage().data_ptr() for t in keep}
        self.copies: dict[tuple, _Host] = {}  # by layout, while F runs: a tensor saved twice goes once

    def pack(self, t: Tensor) -> Tensor | _Host:
        if t.numel() * t.element_size() < MIN_BYTES or t.untyped_storage().data_ptr() in self.keep:
            return t
        key = _key(t)
        # the tensor saved before only while it is alive: a later tensor may reuse its address
        if key not in self.copies or self.copies[key].original() is not t:
            stream = None
            if t.is_cuda:
                if t.device not in _STREAMS:
                    _STREAMS[t.device] = torch.cuda.Stream(t.device)
                stream = _STREAMS[t.device]
            self.copies[key] = _Host(t, stream)
        return self.copies[key]

    @staticmethod
    def unpack(saved: Tensor | _Host) -> Tensor:
        return saved if isinstance(saved, Tensor) else saved.restore()


@contextlib.contextmanager
def offloaded(keep: Iterable[Tensor]) -> Iterator[None]:
    """Offload what autograd saves in this block, except tensors sharing storage with ``keep``."""
    hooks = _Offload(keep)
    with torch.autograd.graph.saved_tensors_hooks(hooks.pack, _Offload.unpack):
        yield
