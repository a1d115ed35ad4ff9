"""How a step spends activation memory: the recipe's ``[memory]`` section, read by the executor.

    [memory]
    merge_window = 1           # expert weight GEMMs merged over at most 1 micro-batch (0: the whole step)
    recompute = "full"         # "none" | "full" | "selective"
    recompute_roles = ["mlp"]  # the stage roles it applies to (empty: every role)
    offload = true             # the other stages' saved tensors wait in host memory (default false)
    fp8_cache = true           # with train.fp8: FP8 linears keep their inputs in FP8 (default true)
    policy = "explicit"        # "auto" | "explicit": who picks the four above (see below)

policy: "auto" (a recipe's default when it sets none of merge_window, recompute, recompute_roles,
offload) lets the memory plan pick them: ``fmoe train`` runs the fastest policy (``fmoe.plan_time``)
whose planned peak fits the device (``fmoe.plan_policy.choose``); with no device limit (a CPU run)
that is recompute none, merge_window 0, offload off. "explicit" runs the fields as set (the
default of a ``MemoryPolicy`` built in code; a recipe that sets any of the four). An "auto" policy
is never run as such: ``fmoe.train_setup`` resolves it to an explicit one once, before the first step.

merge_window (pp = 1, ``fmoe.runner.execute``): the expert weight GEMMs of a layer are merged over
the micro-batches of one window (consecutive micro-batches, at most ``merge_window`` of them) and
run at the window's last B of that layer, so a micro-batch's expert inputs and output gradients
live at most until then (their merged GEMM, one per window, adds into the gradient: only the
order of the summation differs from another window). 0 merges the whole step (the fastest, the most memory: every micro-batch's
expert GEMM operands live until the step's end); 1 runs each micro-batch's expert W right after
its B. Pipelined steps (pp > 1) run W where their table says and do not merge.

recompute, per stage (``stage_mode``, carried out by ``fmoe.stage.forward``):
- "none": F keeps what autograd saves for B (today's behaviour);
- "full": F keeps only the stage's inputs and parameters (alive anyway: the ownership rules of
  ``fmoe.stage``) and discards what autograd saves; just before B it re-runs the stage's forward on
  them with the same context, and B differentiates that fresh graph. A stage's randomness derives
  from its context (``StageContext``), so the re-run computes bitwise the same tensors;
- "selective": F keeps the stage's saved tensors except the outputs of its recomputable regions
  (``fmoe.stages.recompute.recomputable``: the RMSNorms and SwiGLUs of ``fmoe.stages.layers``),
  which B recomputes from the regions' inputs when it first needs them. Every other saved tensor
  (every GEMM input that is not such an output) is kept.
offload: the saved tensors of every stage that is not recomputed go to (pinned) host memory after
F and come back when B needs them (``fmoe.offload``).
fp8_cache (only with ``train.fp8``; no effect without it): each FP8 linear keeps its input in the
FP8 form its weight gradient reads (quantized along tokens, with its scales: ~0.52 of the bf16
bytes) instead of in the compute dtype, where that saves bytes (not a stage's input, which F keeps
anyway; ``fmoe.stages.fp8_mode`` says which); on by default. The expert
GEMMs' inputs are cached only where no merge window holds two micro-batches
(``fp8_cache_experts``: pp > 1, one micro-batch, or merge_window = 1): a merged W quantizes the
micro-batches' rows together, in 128-token tiles that straddle them, so per-micro-batch cached parts
would change its bits. Elsewhere they stay in the compute dtype.
Losses and gradients are bitwise those of "none" (and of fp8_cache = false): the same operations
on the same values.
Under expert parallelism (an "ep" group in the stage's context) the "dispatch" and "combine" stages
are never recomputed: they hold the all-to-all exchanges, which a recompute must not repeat. Every
rank of a group runs the same policy, so the collectives a recompute does repeat (the context-
parallel gathers, the router's all-reduced counts) stay matched across the group.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch-free: a recipe is read without it
    from fmoe.stages.spec import Stage, StageContext

__all__ = [
    "EXCHANGE_ROLES",
    "POLICIES",
    "POLICY_FIELDS",
    "RECOMPUTE_MODES",
    "STAGE_MODES",
    "MemoryPolicy",
    "memory_table",
]

RECOMPUTE_MODES = ("none", "full", "selective")
# what a stage's F does with what autograd saves (``fmoe.stage.forward``): keep it, keep nothing and
# recompute, recompute the marked blocks' outputs, offload it
STAGE_MODES = (*RECOMPUTE_MODES, "offload")
# the roles holding the expert-parallel all-to-all: never recomputed when an "ep" group exists
EXCHANGE_ROLES = ("dispatch", "combine")
# who picks the policy: the memory plan ("auto") or the fields as set ("explicit")
POLICIES = ("auto", "explicit")
# the fields an "auto" policy picks (a recipe setting any of them is explicit)
POLICY_FIELDS = ("merge_window", "recompute", "recompute_roles", "offload")


def memory_table(table: Any) -> Any:
    """A recipe's [memory] table as written, with ``policy`` filled in when it is not: "auto" when
    the table sets none of ``POLICY_FIELDS``, else "explicit". policy = "auto" beside one of them is
    refused (ValueError) naming it: the plan would pick over it. A non-table is returned as is."""
    if not isinstance(table, dict):
        return table
    given = [k for k in POLICY_FIELDS if k in table]
    if table.get("policy") == "auto":
        # a field at its default picks nothing over the plan: what a policy written back in full
        # (``dataclasses.asdict``, a saved recipe) holds, so it reads back as the same "auto"
        defaults = {f.name: f.default for f in fields(MemoryPolicy)}
        given = [k for k in given if _as_written(table[k]) != defaults[k]]
    if table.get("policy") == "auto" and given:
        raise ValueError(
            f"memory.policy = 'auto' picks the memory policy itself, but memory.{given[0]} is set: "
            f"drop memory.{given[0]}, or set memory.policy = 'explicit'"
        )
    if "policy" in table:
        return table
    return {**table, "policy": "explicit" if given else "auto"}


def _as_written(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value  # TOML arrays are lists


@dataclass(frozen=True)
class MemoryPolicy:
    """The ``[memory]`` section (see the module docstring); validated here, errors name the field."""

    merge_window: int = 0
    recompute: str = "none"
    recompute_roles: tuple[str, ...] = ()
    offload: bool = False
    policy: str = "explicit"
    fp8_cache: bool = True

    def __post_init__(self) -> None:
        from fmoe.stages.spec import ROLES  # torch: only once a policy is built

        if self.policy not in POLICIES:
            raise ValueError(f"MemoryPolicy.policy must be one of {POLICIES}, got {self.policy!r}")
        if self.policy == "auto":  # the plan picks the fields: one set alongside would be ignored
            default = MemoryPolicy()
            changed = [n for n in POLICY_FIELDS if getattr(self, n) != getattr(default, n)]
            if changed:
                raise ValueError(
                    f"MemoryPolicy.policy is 'auto' (the plan picks the policy) but MemoryPolicy.{changed[0]} "
                    f"is set: drop it, or set MemoryPolicy.policy = 'explicit'"
                )

        if (
            isinstance(self.merge_window, bool)
            or not isinstance(self.merge_window, int)
            or self.merge_window < 0
        ):
            raise ValueError(
                f"MemoryPolicy.merge_window must be an int >= 0 (0: the whole step), got {self.merge_window!r}"
            )
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(
                f"MemoryPolicy.recompute must be one of {RECOMPUTE_MODES}, got {self.recompute!r}"
            )
        unknown = [r for r in self.recompute_roles if r not in ROLES]
        if unknown:
            raise ValueError(
                f"MemoryPolicy.recompute_roles: unknown role {unknown[0]!r} (roles: {', '.join(ROLES)})"
            )
        if not isinstance(self.fp8_cache, bool):
            raise ValueError(f"MemoryPolicy.fp8_cache must be true or false, got {self.fp8_cache!r}")
        if self.recompute_roles and self.recompute == "none":  # a setting that would do nothing
            raise ValueError(
                "MemoryPolicy.recompute_roles is set but MemoryPolicy.recompute is 'none': set recompute "
                "to 'full' or 'selective', or drop recompute_roles"
            )

    def stage_mode(self, stage: Stage, ctx: StageContext) -> str:
        """What ``stage``'s F under ``ctx`` does with what autograd saves: one of ``STAGE_MODES``."""
        if stage.custom is not None:
            return "none"  # a CustomGrad stage's F saves what its own B reads
        recomputed = (
            self.recompute != "none"
            and (not self.recompute_roles or stage.role in self.recompute_roles)
            and not (
                stage.role in EXCHANGE_ROLES and ctx.group("ep") is not None
            )  # never repeat an all-to-all
        )
        if recomputed:
            return self.recompute
        return "offload" if self.offload else "none"

    def merge_closes(self, microbatch: int, num_microbatches: int) -> bool:
        """Whether ``microbatch`` is the last of its merge window (its B runs the window's merged W)."""
        last = microbatch == num_microbatches - 1
        return last or (self.merge_window > 0 and (microbatch + 1) % self.merge_window == 0)

    def fp8_cache_experts(self, pp: int, num_microbatches: int) -> bool:
        """Whether a step of ``num_microbatches`` at pipeline size ``pp`` caches its expert GEMMs'
        inputs in FP8: ``fp8_cache``, and no micro-batch's expert W is merged with another's (pp > 1
        runs W per micro-batch; at pp = 1 a window of ``merge_window`` != 1 holds several)."""
        return self.fp8_cache and (pp > 1 or num_microbatches == 1 or self.merge_window == 1)
