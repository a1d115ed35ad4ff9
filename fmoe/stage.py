"""F, B and W of a stage, derived from its forward alone.

    outputs, fwd = forward(stage, params, inputs, ctx)      # F: run, keep what B needs
    grad_inputs, wgt = backward_input(fwd, grad_outputs)    # B: input gradients, leave W's GEMMs
    grads = backward_weight(wgt)                            # W: {global name: gradient}, any time later

F runs the stage's pure forward on detached leaves of its inputs and parameters (the caller's
tensors are never mutated and the returned outputs are detached), so each call's autograd graph is
private to it. B differentiates that graph with respect to the floating-point inputs, and to the
parameters used outside deferrable primitives (norm weights, embeddings); the weight GEMMs of
``linear``/``grouped_linear`` go on a tape instead (see ``fmoe.stages.primitives``). W runs the
taped GEMMs. Nothing is recomputed unless F is asked to (below): B + W then do exactly the work
of one backward.

Recomputation (``forward``'s ``mode``, chosen per stage by ``fmoe.memory_policy``): "full" runs
F with autograd on (the very kernels of a plain F) but keeps nothing it would save, only the stage's
inputs and parameters (alive anyway, rule 1 below) and their version counters; B first checks those
counters (an input or parameter written in place since F raises ``StageError`` naming it: the re-run
would differentiate other values), re-runs F on them with the same context and differentiates that
fresh graph. "selective" keeps every saved tensor except the outputs of the stage's
``fmoe.stages.recompute.recomputable`` blocks, which B recomputes. Either way B sees the same values
as without recomputation, so its results are bitwise the same. "offload" keeps the saved tensors in
host memory between F and B (``fmoe.offload``): B reads copies of the same values and layouts.

Why autograd and not ``torch.func.vjp``: a vjp materialises a zero gradient for every deferred
weight (a weight-sized write per stage call) and, measured on this CPU, costs 155 us per call
against 54 us for ``torch.autograd.grad`` on a tiny stage; the stage functions stay pure, so
``torch.func`` transforms still apply to them directly (the tests use ``torch.func`` as a reference).

Ownership: who may write which tensor. Autograd hands back one tensor object wherever a gradient
passes through unchanged (``x + p["pos"]`` with ``pos`` shaped like ``x`` gives ``x`` and ``pos``
the same gradient object; ``sum`` gives an expanded view of its seed), so these rules hold for every
tensor that crosses F, B and W, in ``fmoe.runner``, ``fmoe.interpreter`` and the optimizer:

1. Read-only, by everyone, until the step's last W has run: params and inputs given to F; F's
   outputs (the next stage's inputs; the interpreter hands the same objects from one chunk to
   another of its rank, or sends them); the grad_outputs given to B and the grad_inputs B returns
   (the previous stage's grad_outputs, again the same objects on one rank). Any of these may be the
   same object as, or share memory with, another of them, and W's deferred GEMMs (and the expert
   GEMMs a step merges, ``merge_later``) read some of them after later Bs have run.
2. Owned by the caller: the tensors of W's result (``backward_weight``, which includes the
   gradients B already had, ``WeightGradWork.partial``). None shares memory with a tensor of rule 1,
   with W's pending GEMMs, with another result or with itself, so the caller may add into them in
   place: ``runner.accumulate`` adopts the first gradient of a name as the accumulator, and the
   optimizer overwrites its gradients (buffer donation).
3. ``into`` (W's accumulator, owned by the caller by rule 2): W adds dense GEMMs into its tensors in
   place (a GEMM with beta = 1, or a product and an add when the accumulator shares memory with the
   GEMM's operands), an embedding's rows into the rows looked up, and the GEMM of a parameter view
   into the view's slice.

B enforces rule 2: a partial gradient whose storage is that of a grad_output or loss seed, a
grad_input, the output gradient of a taped GEMM or an earlier partial, or that overlaps itself, is
cloned. Those are all it can share memory with: autograd's formulas return new tensors or views of
the gradients they receive, never an activation or a parameter. The check compares storage pointers
(about ten for a stage with partial gradients, none for the others) and copies nothing when no
alias exists, the ordinary case (norm weights, embeddings).
A ``CustomGrad`` stage's W results get the same check at W time, against the tensors its B saved
for W (all a hand-written W can return besides fresh tensors) and its params.

Parameter views: ``linear(x, p["qkv"].chunk(3)[0])`` (or ``grouped_linear`` on a view of an expert
weight, FP8 or not) defers its GEMM like one on the whole parameter; W adds it into the view's slice
of the parameter's gradient (creating a zero gradient first when none exists yet). Expert GEMMs on
views run in W rather than in a step's merged GEMM (``merge_later`` holds whole parameters).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from fmoe.offload import offloaded
from fmoe.stages.primitives import (
    ACCUMULATES_IN_PLACE,
    GroupedWeightGrad,
    WeightGrad,
    WeightGradTape,
    defer_weight_grads,
    non_overlapping,
)
from fmoe.stages.recompute import recompute_outputs
from fmoe.stages.spec import Stage, StageContext


class StageError(RuntimeError):
    """A stage broke its contract (bad outputs, missing parameters); the message names the stage."""


class _StageParams(dict):
    """The local params dict a stage sees; a missing key names the stage and the global name."""

    def __init__(self, stage: Stage, items: dict[str, Tensor]):
        super().__init__(items)
        self.stage = stage

    def __missing__(self, key: str) -> Tensor:
        raise StageError(
            f"stage {self.stage.name!r} reads params[{key!r}] (global name {self.stage.prefix + key!r}), "
            f"which is not among its declared parameters {list(self)}"
        )


@dataclass
class Forwarded:
    """What F keeps for B: the private graph's outputs and leaves."""

    stage: Stage
    ctx: StageContext
    outputs: tuple[Tensor, ...]
    input_leaves: tuple[Tensor | None, ...]
    param_leaves: dict[str, Tensor]  # global name -> leaf
    custom_saved: Any = None
    tape: WeightGradTape | None = None
    kept: Kept | None = None  # full recomputation: what B re-runs F on (then no graph is kept)


@dataclass(frozen=True)
class Kept:
    """What F keeps under full recomputation: the stage's parameters and inputs (the caller's
    tensors, read-only by rule 1) and the version counter of each when F read it."""

    params: dict[str, Tensor]  # global name -> tensor
    inputs: tuple[Tensor, ...]
    versions: tuple[int, ...]  # params' then inputs' ``_version``

    @staticmethod
    def of(params: dict[str, Tensor], inputs: Sequence[Tensor]) -> Kept:
        tensors = (*params.values(), *inputs)
        return Kept(dict(params), tuple(inputs), tuple(t._version for t in tensors))

    def check(self, stage: Stage) -> None:
        """Raise ``StageError`` if a kept tensor was written in place since F read it."""
        names = [f"parameter {n!r}" for n in self.params] + [f"input {i}" for i in range(len(self.inputs))]
        for name, t, seen in zip(names, (*self.params.values(), *self.inputs), self.versions, strict=True):
            if t._version != seen:
                raise StageError(
                    f"stage {stage.name!r}: its {name} was written in place between F and B (version "
                    f"{seen} -> {t._version}); a recompute would differentiate other values than F's"
                )


_SAVING = {  # the saved-tensor hooks of a mode that keeps the graph, given the stage's own tensors
    "selective": lambda keep: recompute_outputs(),
    "offload": offloaded,
}


def _drop(t: Tensor) -> None:
    return None  # full recomputation: F keeps nothing autograd would save


def _dropped(_: None) -> Tensor:
    raise StageError("a graph made under full recomputation was differentiated (it keeps no tensors)")


@dataclass
class WeightGradWork:
    """What B leaves for W: gradients B already has plus the taped weight GEMMs."""

    stage: Stage
    partial: dict[str, Tensor] = field(default_factory=dict)
    tape: WeightGradTape = field(default_factory=WeightGradTape)
    names: dict[int, str] = field(default_factory=dict)  # id(leaf) -> global name
    custom_saved: Any = None
    params: Mapping[str, Tensor] | None = None


def _is_differentiable(t: Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _own(grads: dict[str, Tensor], shared: Iterable[Tensor | None]) -> None:
    """Make ``grads`` the caller's (rule 2 of the module docstring), in place: clone each gradient that
    shares a storage with a tensor of ``shared`` or an earlier gradient, or that overlaps itself."""
    seen = {t.untyped_storage().data_ptr() for t in shared if t is not None}
    for name, g in grads.items():
        ptr = g.untyped_storage().data_ptr()
        if ptr in seen or not non_overlapping(g):
            g = grads[name] = g.clone(memory_format=torch.contiguous_format)
            ptr = g.untyped_storage().data_ptr()
        seen.add(ptr)


def stage_params(stage: Stage, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The stage's parameters by global name, with an error naming any that ``params`` lacks."""
    missing = [n for n in stage.params if n not in params]
    if missing:
        raise StageError(f"stage {stage.name!r} needs parameters missing from the params dict: {missing}")
    return {n: params[n] for n in stage.params}


def _check_outputs(stage: Stage, outputs: Any) -> tuple[Tensor, ...]:
    if isinstance(outputs, Tensor):
        outputs = (outputs,)
    if not isinstance(outputs, tuple | list):
        raise StageError(
            f"stage {stage.name!r} returned {type(outputs).__name__}; a stage returns a tuple of tensors"
        )
    for i, out in enumerate(outputs):
        if not isinstance(out, Tensor):
            raise StageError(
                f"stage {stage.name!r} returned {type(out).__name__} at output {i}; a stage returns a tuple of tensors"
            )
    carried = stage.num_carried(len(outputs))
    if carried < 0:
        raise StageError(
            f"stage {stage.name!r} declares {len(stage.losses)} loss and {len(stage.statistics)} statistic "
            f"outputs but returned {len(outputs)}"
        )
    for i in range(carried, carried + len(stage.losses)):
        if outputs[i].numel() != 1:
            raise StageError(
                f"stage {stage.name!r}: loss output {i} has shape {tuple(outputs[i].shape)}, not a scalar"
            )
    for stat, out in zip(stage.statistics, outputs[carried + len(stage.losses) :]):
        if out.dtype != torch.int64 or tuple(out.shape) != tuple(stat.shape):
            raise StageError(
                f"stage {stage.name!r}: statistic {stat.name!r} is {out.dtype} {tuple(out.shape)}, "
                f"declared int64 {tuple(stat.shape)}"
            )
    return tuple(outputs)


def call(
    stage: Stage, params: Mapping[str, Tensor], inputs: Sequence[Tensor], ctx: StageContext
) -> tuple[Tensor, ...]:
    """Run a stage's forward as a plain function (no derivation), e.g. under user autograd."""
    local = _StageParams(stage, {stage.local_name(n): t for n, t in stage_params(stage, params).items()})
    return _check_outputs(stage, stage.forward(local, tuple(inputs), ctx))


def forward(
    stage: Stage,
    params: Mapping[str, Tensor],
    inputs: Sequence[Tensor],
    ctx: StageContext,
    mode: str = "none",
) -> tuple[tuple[Tensor, ...], Forwarded]:
    """F: run the stage; return its (detached) outputs and what B needs.

    params: {global name: tensor} (may hold more than the stage's); inputs: the previous stage's
    outputs followed by the stage's batch fields; mode: what F does with what autograd saves,
    "none" (keeps it), "full" or "selective" (recomputation, see the module docstring) or
    "offload" (``fmoe.offload``); a ``CustomGrad`` stage is always run as "none".
    """
    own = stage_params(stage, params)
    if stage.custom is None and mode != "none":
        if mode == "full":
            with torch.autograd.graph.saved_tensors_hooks(_drop, _dropped):
                outputs, _ = forward(stage, own, inputs, ctx)
            return outputs, Forwarded(stage, ctx, outputs, (), {}, kept=Kept.of(own, inputs))
        if mode not in _SAVING:
            raise StageError(
                f"stage {stage.name!r}: mode must be 'none', 'full', 'selective' or 'offload', got {mode!r}"
            )
        keep = [t for t in (*own.values(), *inputs) if isinstance(t, Tensor)]
        with _SAVING[mode](keep):
            return forward(stage, own, inputs, ctx)
    if stage.custom is not None:
        local = _StageParams(stage, {stage.local_name(n): t for n, t in own.items()})
        outputs, saved = stage.custom.forward(local, tuple(inputs), ctx)
        outputs = _check_outputs(stage, outputs)
        fwd = Forwarded(stage, ctx, outputs, (), {}, custom_saved=(local, saved))
        return outputs, fwd
    param_leaves = {n: t.detach().requires_grad_(_is_differentiable(t)) for n, t in own.items()}
    input_leaves = tuple(
        t.detach().requires_grad_() if isinstance(t, Tensor) and _is_differentiable(t) else None
        for t in inputs
    )
    leaf_inputs = tuple(leaf if leaf is not None else t for leaf, t in zip(input_leaves, inputs))
    local = _StageParams(stage, {stage.local_name(n): t for n, t in param_leaves.items()})
    tape = WeightGradTape(param_ids=frozenset(id(leaf) for leaf in param_leaves.values()))
    with torch.enable_grad(), defer_weight_grads(tape):
        outputs = _check_outputs(stage, stage.forward(local, leaf_inputs, ctx))
    fwd = Forwarded(stage, ctx, outputs, input_leaves, param_leaves, tape=tape)
    return tuple(o.detach() for o in outputs), fwd


def _grad_outputs(
    fwd: Forwarded, grad_outputs: Sequence[Tensor | None], loss_scale: float
) -> list[Tensor | None]:
    stage = fwd.stage
    carried = stage.num_carried(len(fwd.outputs))
    if len(grad_outputs) != carried:
        raise StageError(
            f"stage {stage.name!r}: B got {len(grad_outputs)} output gradients for {carried} outputs"
        )
    seeds = [
        torch.full_like(fwd.outputs[carried + i], weight * loss_scale)
        for i, weight in enumerate(stage.losses)
    ]
    return list(grad_outputs) + seeds + [None] * len(stage.statistics)  # counts: no gradient


def backward_input(
    fwd: Forwarded, grad_outputs: Sequence[Tensor | None], loss_scale: float = 1.0
) -> tuple[tuple[Tensor | None, ...], WeightGradWork]:
    """B: gradients of the stage's inputs (None for integer inputs), and the work W has left.

    grad_outputs: one per carried output (None = zero); the stage's loss outputs are seeded with
    ``weight * loss_scale`` (the runner passes 1 / microbatches); statistics get none.
    """
    stage = fwd.stage
    if fwd.kept is not None:  # full recomputation: F again, on what it read, with the same context
        fwd.kept.check(stage)
        _, fwd = forward(stage, fwd.kept.params, fwd.kept.inputs, fwd.ctx)
    grads_out = _grad_outputs(fwd, grad_outputs, loss_scale)
    if stage.custom is not None:
        local, saved = fwd.custom_saved
        grad_inputs, w_saved = stage.custom.backward_input(local, saved, grads_out)
        return tuple(grad_inputs), WeightGradWork(stage, custom_saved=w_saved, params=local)
    outs, gouts = [], []
    for out, g in zip(fwd.outputs, grads_out):
        if g is not None and out.requires_grad:
            outs.append(out)
            gouts.append(g)
    inputs = [leaf for leaf in fwd.input_leaves if leaf is not None]
    params = [leaf for leaf in fwd.param_leaves.values() if leaf.requires_grad]
    work = WeightGradWork(stage, tape=fwd.tape, names={id(leaf): n for n, leaf in fwd.param_leaves.items()})
    grads: Sequence[Tensor | None] = [None] * (len(inputs) + len(params))
    if outs and (inputs or params):
        grads = torch.autograd.grad(outs, inputs + params, gouts, allow_unused=True)
    it = iter(grads[: len(inputs)])
    grad_inputs = tuple(None if leaf is None else next(it) for leaf in fwd.input_leaves)
    for name, g in zip(
        (n for n, leaf in fwd.param_leaves.items() if leaf.requires_grad), grads[len(inputs) :]
    ):
        if g is not None:
            work.partial[name] = g
    if work.partial:  # rule 2: what W returns shares memory with nothing B hands on or keeps (a
        # taped dy in FP8 is B's own new quantization, which no gradient can share)
        kept = (compute.dy for _, compute in fwd.tape.entries)
        _own(work.partial, (*grads_out, *grad_inputs, *(dy for dy in kept if isinstance(dy, Tensor))))
    # the graph is gone; free the leaves' references early
    fwd.outputs, fwd.input_leaves, fwd.tape = (), (), None
    return grad_inputs, work


def backward_weight(
    work: WeightGradWork,
    merge_later: dict[str, list[GroupedWeightGrad]] | None = None,
    into: dict[str, Tensor] | None = None,
) -> dict[str, Tensor]:
    """W: {global name: gradient} for every parameter of the stage that received one.

    merge_later: if given, expert-grouped weight GEMMs are not run but appended to
    ``merge_later[name]``, for the caller to merge over microbatches
    (``fmoe.stages.primitives.merge_grouped_weight_grads``); their names are then absent here.
    into: the caller's own gradient accumulator ({name: tensor it may modify}); a dense weight GEMM
    or an embedding whose parameter already has an entry there is added to it in place (inside the
    GEMM; the embedding's rows looked up alone), and is then absent from the result. The caller
    adds the rest (``fmoe.runner.accumulate``).
    """
    stage = work.stage
    if stage.custom is not None:
        local_grads = stage.custom.backward_weight(work.params, work.custom_saved)
        grads = {stage.prefix + k: g for k, g in local_grads.items()}
        # rule 2: what its W returns may be what its B saved (and handed on), or a parameter
        kept = [t for t in pytree.tree_leaves(work.custom_saved) if isinstance(t, Tensor)]
        _own(grads, (*kept, *work.params.values()))
        return grads
    grads = dict(work.partial)
    for weight, compute in work.tape.entries:
        base = weight._base  # a view of a parameter: its gradient is a slice of the parameter's
        name = work.names.get(id(weight if base is None else base))
        if name is None:
            raise StageError(
                f"stage {stage.name!r}: a deferred weight GEMM used a tensor that is not one of its params"
            )
        if base is not None:
            with torch.no_grad():
                _add_to_slice(grads, into, name, base, weight, compute)
            continue
        if merge_later is not None and isinstance(compute, GroupedWeightGrad):
            merge_later.setdefault(name, []).append(compute)
            continue
        if into is not None and name in into and isinstance(compute, ACCUMULATES_IN_PLACE):
            with torch.no_grad():
                compute.accumulate_into(into[name])
            continue
        with torch.no_grad():  # taped activations still require grad; W builds no graph
            g = compute()
        grads[name] = grads[name] + g if name in grads else g
    work.tape.entries.clear()
    return grads


def _add_to_slice(
    grads: dict[str, Tensor],
    into: dict[str, Tensor] | None,
    name: str,
    base: Tensor,
    view: Tensor,
    compute: WeightGrad,
) -> None:
    """Add a deferred GEMM's gradient of ``view`` (a view of the parameter leaf ``base``) into the
    matching slice of the parameter's gradient: ``into[name]`` if the caller has one, else
    ``grads[name]`` (ours by rule 2), else a new zero gradient in ``grads``."""
    total = into.get(name) if into is not None else None
    if total is None:
        total = grads.get(name)
    if total is None:
        # base's strides (a parameter is dense), the GEMM's dtype (an fp32 master's is the compute dtype)
        total = grads[name] = torch.zeros_like(base, dtype=compute.grad_dtype)
    if total.shape == base.shape and total.stride() == base.stride():
        offset = total.storage_offset() + view.storage_offset() - base.storage_offset()
        region = total.as_strided(view.shape, view.stride(), offset)
        if isinstance(compute, ACCUMULATES_IN_PLACE):
            compute.accumulate_into(region)
        else:
            region.add_(compute())
        return
    # a gradient laid out unlike the parameter: place the slice in a buffer laid out like the
    # parameter (its memory from its first element on), then add that
    span = 1 + sum((n - 1) * st for n, st in zip(base.shape, base.stride()))
    full = total.new_zeros(span)
    full.as_strided(view.shape, view.stride(), view.storage_offset() - base.storage_offset()).copy_(compute())
    total.add_(full.as_strided(base.shape, base.stride(), 0))
