"""Selective recomputation: blocks whose outputs backward recomputes instead of keeping.

A stage author writes ``recomputable(fn, *args)`` around a cheap block with a large output (a norm,
an activation such as SwiGLU). Under plain autograd, and in a stage run without selective
recomputation, it is ``fn(*args)``. When fmoe's stage machinery runs a stage's F inside
:func:`recompute_outputs` (``fmoe.memory_policy``: ``recompute = "selective"``), saved-tensor hooks
keep, in place of the block's output wherever a later op saves it (a GEMM's input), a small record
of the block; B recomputes the output from ``args`` the first time it is unpacked. The autograd
graph is unchanged (the same nodes, the same saved values), so the gradients are bitwise those of
a run that kept the output, the weight GEMMs a B leaves for W included (``fmoe.stages.primitives``:
the tape keeps the recomputed tensor until W, or, for an FP8 expert GEMM whose W reads its input's
FP8 rows, the rows B quantizes of it).
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["is_recomputed", "recomputable", "recompute_outputs", "recomputing"]


class _Region:
    """One ``recomputable`` call of an F: its function and arguments, a weak reference to its output
    (whose memory selective recomputation gives back), and the output recomputed once B needs it."""

    def __init__(self, fn: Callable[..., Tensor], args: tuple, out: Tensor):
        self.fn, self.args, self.out = fn, args, weakref.ref(out)
        self.offset = out.storage_offset()
        self.value: Tensor | None = None

    def recomputed(self) -> Tensor:
        out = self.out()
        if out is not None:  # still alive (e.g. handed to the next stage): nothing to recompute
            return out
        if self.value is None:  # once per region: several GEMMs may save the same output
            with torch.no_grad():
                self.value = self.fn(*self.args)
        return self.value


@dataclass(frozen=True)
class _Dropped:
    """What autograd keeps in place of a saved region output (or a view of one): how to get it back."""

    region: _Region
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # from the output's own storage offset


class _Regions:
    """The recomputable outputs of one F by storage address, and the saved-tensor hooks that swap
    them (and views of them) for their region while autograd holds them."""

    def __init__(self) -> None:
        self.by_storage: dict[int, _Region] = {}

    def add(self, fn: Callable[..., Tensor], args: tuple, out: Tensor) -> None:
        if out.numel() > 0:
            self.by_storage[out.untyped_storage().data_ptr()] = _Region(fn, args, out)

    def pack(self, t: Tensor) -> Tensor | _Dropped:
        region = self.by_storage.get(t.untyped_storage().data_ptr()) if t.numel() > 0 else None
        # only while the output is alive: the same address is then the same storage, never a reuse
        if region is None or region.out() is None:
            return t
        return _Dropped(region, tuple(t.shape), t.stride(), t.storage_offset() - region.offset)

    @staticmethod
    def unpack(saved: Tensor | _Dropped) -> Tensor:
        if isinstance(saved, Tensor):
            return saved
        value = saved.region.recomputed()  # the same function on the same arguments: the same layout
        return value.as_strided(saved.shape, saved.stride, value.storage_offset() + saved.offset)


_ACTIVE: contextvars.ContextVar[_Regions | None] = contextvars.ContextVar("fmoe_recompute", default=None)


def recomputable(fn: Callable[..., Tensor], *args) -> Tensor:
    """``fn(*args)``, marked for selective recomputation (see the module docstring).

    fn must be deterministic and return a new tensor (not a view of an argument); ``args`` are kept
    until B (a block's inputs: the residual stream, a GEMM's output - what autograd keeps anyway).
    """
    out = fn(*args)
    regions = _ACTIVE.get()
    if regions is not None and torch.is_grad_enabled() and out.requires_grad:
        regions.add(fn, args, out)
    return out


def is_recomputed(t: Tensor) -> bool:
    """Whether ``t`` is (a view of) the output of a :func:`recomputable` block of the F running now
    under selective recomputation: an operation that saves it keeps only a record of the block."""
    regions = _ACTIVE.get()
    if regions is None or t.numel() == 0:
        return False
    region = regions.by_storage.get(t.untyped_storage().data_ptr())
    return region is not None and region.out() is not None


def recomputing() -> bool:
    """Whether the F running now runs under selective recomputation (inside :func:`recompute_outputs`)."""
    return _ACTIVE.get() is not None


@contextlib.contextmanager
def recompute_outputs() -> Iterator[None]:
    """Selective recomputation for the forward run inside: the outputs of its :func:`recomputable`
    blocks are recomputed in backward rather than saved; every other saved tensor is kept as is."""
    regions = _Regions()
    token = _ACTIVE.set(regions)
    try:
        with torch.autograd.graph.saved_tensors_hooks(regions.pack, _Regions.unpack):
            yield
    finally:
        _ACTIVE.reset(token)
