"""What a stage and a model are: plain descriptions, no behaviour.

A stage is a pure function ``forward(params, inputs, ctx) -> outputs``. ``params`` maps the stage's
local parameter names (its global names less ``prefix``) to tensors, ``inputs`` is the tuple the
previous stage returned followed by the batch fields the stage names in ``batch_inputs``, and
``outputs`` is a tuple of tensors: first the ones the next stage receives, then one scalar per entry
of ``losses`` (a loss term with that weight, e.g. the router's load-balancing loss), then one int64
tensor per entry of ``statistics`` (a count the runtime sums over the step, e.g. a router's load
per expert; never differentiated).

fmoe's runtime (``fmoe.stage``) derives each stage's F, B and W from the forward alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from torch import Tensor

Params = Mapping[str, Tensor]
StageFn = Callable[[Params, tuple[Tensor, ...], "StageContext"], tuple[Tensor, ...]]


@dataclass(frozen=True)
class StageContext:
    """Static description of one stage call.

    microbatch: index of the microbatch in the step; seed: the step's seed (randomness, if any,
    derives from it and ``microbatch``); groups: process groups by mesh dim name ("ep", "cp", ...),
    absent when that dim has size 1; fp8: run FP8 GEMMs where a stage supports them.
    """

    microbatch: int = 0
    seed: int = 0
    groups: Mapping[str, Any] = field(default_factory=dict)
    fp8: bool = False

    def group(self, name: str) -> Any:
        return self.groups.get(name)


@dataclass(frozen=True)
class Statistic:
    """A count a stage returns beside its outputs (after its loss terms): int64, ``shape``.

    The runtime sums it over the step's microbatches and over every rank of the mesh (ranks that do
    not run the stage add zeros; those that do see different tokens), so the step's total is the same
    on every rank. name: unique within the model, e.g. the router bias the count steers.
    """

    name: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class CustomGrad:
    """Hand-written F/B/W for a stage, used instead of the derived ones (tests compare the two).

    forward(params, inputs, ctx) -> (outputs, saved)
    backward_input(params, saved, grad_outputs) -> (grad_inputs, w_saved)
        grad_outputs: one tensor or None per output (losses included, already scaled)
        grad_inputs: one tensor or None per input
    backward_weight(params, w_saved) -> {local parameter name: gradient}
    """

    forward: Callable[..., tuple[tuple[Tensor, ...], Any]]
    backward_input: Callable[..., tuple[tuple[Tensor | None, ...], Any]]
    backward_weight: Callable[..., dict[str, Tensor]]


# What a stage is in the model: the embedding, a layer's attention (+ router), the exchange of
# routed tokens to their experts, the experts (or a dense MLP), the exchange back, the weighted sum
# with the residual, the LM head; "other" for a stage with none of these roles.
# the five stages of a transformer layer, in forward order (the FB interpreter numbers them 1..5)
LAYER_ROLES = ("attn", "dispatch", "mlp", "combine", "aggregate")
ROLES = ("embed", *LAYER_ROLES, "head", "other")


class RoutedTokens(NamedTuple):
    """The inputs of every "dispatch" stage (its first four; a family may carry more after them).

    residual: h1 [b,s,H], the residual stream after attention; tokens: x [T,H], the normed rows the
    experts read; expert_ids: [T,k] int64, the experts each token is routed to, each in
    [0, Model.num_experts); weights: [T,k] in the tokens' dtype. fmoe's family check (before a run)
    refuses a model whose stage before a dispatch carries anything else.
    """

    residual: Tensor
    tokens: Tensor
    expert_ids: Tensor
    weights: Tensor


@dataclass(frozen=True)
class Stage:
    """One pure stage of a model.

    name: unique within the model, e.g. "layers.3.attn"; params: the global parameter names it reads;
    prefix: stripped from those names to form the keys ``forward`` sees; role: what the stage is in
    its layer, one of ``ROLES`` (the FB interpreter pairs stages by role; expert parallelism reads
    the routing at the "dispatch" stage, whose inputs are ``RoutedTokens``; "dispatch" and "combine"
    are the communication a schedule overlaps with another microbatch's compute); statistics: the
    counts ``forward`` returns after its loss terms (see ``Statistic``).
    """

    name: str
    forward: StageFn
    params: tuple[str, ...] = ()
    prefix: str = ""
    batch_inputs: tuple[str, ...] = ()
    losses: tuple[float, ...] = ()
    role: str = "other"
    custom: CustomGrad | None = None
    statistics: tuple[Statistic, ...] = ()

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"Stage {self.name!r}: role must be one of {ROLES}, got {self.role!r}")

    def local_name(self, global_name: str) -> str:
        return global_name[len(self.prefix) :]

    def num_carried(self, num_outputs: int) -> int:
        """How many of ``num_outputs`` outputs go to the next stage (the rest: losses, statistics)."""
        return num_outputs - len(self.losses) - len(self.statistics)


@dataclass(frozen=True)
class Model:
    """A model: its config, its stages in forward order, and a seeded parameter initialiser.

    init(seed, dtype, device) -> params dict keyed by global (Hugging Face) names.
    layer_of[i] is the transformer layer stage i belongs to (-1 for the embedding and the head).
    buffer_updates(statistics) -> {param name: additive update}: how the step's summed statistics
    ({Statistic.name: tensor}) move the params that are not trained by gradients (e.g. the
    aux-loss-free router bias); the trainer adds each update after the optimizer step. None: the
    model has no such params. buffers: the names of those params; the step reads them in float32
    whatever its compute dtype (a bf16 copy would round their small updates away). num_experts:
    the routed experts of each MoE layer (the range of a dispatch stage's ``expert_ids``); 0 when
    the model has no MoE layer. expert_params: the global names of the stacked expert tensors
    ([num_experts, ...], experts on dim 0) that expert parallelism shards over the ep ranks (each
    holds its [num_experts / ep, ...] slice under the same name); every other parameter is
    replicated over ep. A declaration the runtime reads: it never infers it from the names.
    """

    config: Any
    stages: tuple[Stage, ...]
    init: Callable[..., dict[str, Tensor]]
    layer_of: tuple[int, ...] = ()
    buffer_updates: Callable[[Mapping[str, Tensor]], dict[str, Tensor]] | None = None
    buffers: tuple[str, ...] = ()
    num_experts: int = 0
    expert_params: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.expert_params:
            unknown = sorted(self.expert_params - set(self.param_names()))
            if unknown:
                raise ValueError(f"Model.expert_params names {unknown[0]!r}, which no stage reads")

    def statistics(self) -> list[Statistic]:
        """Every stage's statistics, in stage order."""
        return [s for stage in self.stages for s in stage.statistics]

    def param_names(self) -> list[str]:
        seen: dict[str, None] = {}
        for stage in self.stages:
            for name in stage.params:
                seen.setdefault(name)
        return list(seen)
