"""A training step captured once as a CUDA graph and replayed: one launch of host work per step.

fmoe's stages are pure functions of their tensors with static shapes (at ep = 1 the dropless routed
buffer is tokens x top-k rows; only the per-expert offsets vary, and they stay on the device), so a
whole step - every stage's F, B and W over every micro-batch, and the optimizer - launches the same
kernels on the same addresses each time. ``GraphedStep`` runs such a step eagerly for its first
``warmup`` calls (kernel compilation, cuBLAS workspaces, the caching allocator's first blocks),
captures it on the next call and replays it from then on:

    step = GraphedStep(fn)           # fn(*args) -> outputs; args and outputs: pytrees of tensors
    outputs = step(*args)            # eager, then captured, then replayed

Contract (what ``fn`` must be, and what the caller may do):
- Its work depends only on the *values* of the tensor leaves of ``args`` and on the non-tensor
  leaves (which must not change between calls: a change, or a change of any tensor's shape, dtype,
  device or strides, captures anew). Nothing in it may read a device value on the host (``.item()``,
  ``bool(t)``, ``nonzero``, host-synced split sizes): capture refuses that, and ``CaptureError``
  says so. Randomness, if any, must come from torch's CUDA generator (captured graphs advance it).
- Inputs: on every replay, each tensor leaf of ``args`` is copied into the tensor the graph was
  captured on, unless it *is* that tensor's memory (the same data pointer, shape and strides) -
  the case of state that ``fn`` updates in place and hands back (params, optimizer moments), which
  therefore costs no copy. The graph keeps references to its captured inputs.
- Outputs: the same tensor objects on every call after capture, overwritten by the next replay.
  The caller owns them until then: it may read them or write into them (the optimizer's buffer
  donation), but must copy what it keeps past the next call.
- Replays are bitwise the eager step: the same kernels on the same data (the GPU test tier checks
  this for a training step, bf16 and FP8).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor


class CaptureError(RuntimeError):
    """The step could not be captured as a CUDA graph (e.g. it reads a device value on the host)."""


def _signature(leaves: list[Any]) -> tuple:
    return tuple(
        ("tensor", t.shape, t.dtype, t.device, t.stride()) if isinstance(t, Tensor) else ("value", t)
        for t in leaves
    )


def _same_memory(a: Tensor, b: Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


class GraphedStep:
    """``fn`` run eagerly ``warmup`` times, then captured once as a CUDA graph and replayed.

    fn: see the module docstring for its contract; warmup: eager calls before the capture (>= 1:
    the first call compiles kernels and sizes cuBLAS workspaces, which a capture cannot do).
    ``replays`` counts the calls served by the graph (the tests read it)."""

    def __init__(self, fn: Callable[..., Any], warmup: int = 2):
        if not torch.cuda.is_available():
            raise RuntimeError("GraphedStep: CUDA graphs need a CUDA device, and none is available")
        if warmup < 1:
            raise ValueError(f"warmup: at least 1 eager call precedes the capture, got {warmup}")
        self.fn, self.warmup = fn, warmup
        self.replays = 0
        self._calls = 0
        self._signature: tuple | None = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._inputs: list[Tensor | None] = []
        self._outputs: Any = None
        self._stream: torch.cuda.Stream | None = None

    def __call__(self, *args: Any) -> Any:
        leaves, _ = pytree.tree_flatten(args)
        signature = _signature(leaves)
        if signature != self._signature:  # first call, or new shapes: start over
            self._signature, self._graph, self._outputs, self._calls = signature, None, None, 0
            self._inputs = []
        self._calls += 1
        if self._graph is None and self._calls <= self.warmup:
            return self._eager(args)
        if self._graph is None:
            return self._capture(args, leaves)
        for static, new in zip(self._inputs, leaves):
            if static is not None and not _same_memory(static, new):
                static.copy_(new)
        self._graph.replay()
        self.replays += 1
        return self._outputs

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def _eager(self, args: tuple) -> Any:
        # on a side stream, as the capture will be: the allocator's blocks are then those of a stream
        # other than the default's, which the capture may use without waiting on unrelated work
        stream = self._side_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out = self.fn(*args)
        torch.cuda.current_stream().wait_stream(stream)
        return out

    def _capture(self, args: tuple, leaves: list[Any]) -> Any:
        graph = torch.cuda.CUDAGraph()
        stream = self._side_stream()
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.graph(graph, stream=stream):
                outputs = self.fn(*args)
        except Exception as e:
            raise CaptureError(
                f"the step could not be captured as a CUDA graph ({type(e).__name__}: {e}); a step "
                f"under CUDA graphs may not read device values on the host (.item(), bool(t), "
                f"host-synced split sizes): set train.cuda_graphs = false to run it eagerly"
            ) from e
        torch.cuda.current_stream().wait_stream(stream)
        self._graph = graph
        self._inputs = [t if isinstance(t, Tensor) else None for t in leaves]  # kept alive
        self._outputs = outputs
        graph.replay()  # the capture recorded the work; this call's step runs now
        self.replays += 1
        return outputs
