"""Checks of a model family, before any data or step: does it keep its contract, and are its gradients right.

    check_family(family, cfg)       # every stage once on a tiny batch: FamilyError naming the place
    check_gradients(family, cfg)    # every stage's B and W against autograd in float64, chained

``check_family`` is what ``fmoe train`` and ``fmoe plan`` run first. It builds the model from the
recipe's config, runs each stage once, in order, on a batch of 2 x 4 tokens (on the CPU with the
family's own init when the model has at most ``CPU_CHECK_PARAMS`` parameters; otherwise on the
meta device, shapes and dtypes only, up to the first stage whose shapes depend on values, the
expert dispatch) and refuses, with one line naming the family, the stage, its layer and the
parameter or output:
- a parameter some stage reads that the family does not declare, or declares and no stage reads;
- ``init_params`` giving a parameter of another shape than ``param_shapes`` declares;
- a torch operation that refuses its operands: the line names the operation, the line of the
  family's code that called it, and the parameters its operands were computed from, with their
  declared shapes (a wrong shape in ``attention_shapes`` or ``expert_shapes`` ends here);
- fmoe's stage code refusing what a family's function returned (a router returning two values, a
  stage carrying the wrong number of outputs to the next): the line names fmoe's line and the
  inputs the stage was given;
- the routing a "dispatch" stage receives (``spec.RoutedTokens``): expert ids int64 [T, k] within
  [0, Model.num_experts), weights [T, k] in the tokens' dtype.
An exception raised by the family's own Python code (not by a torch operation it calls) is its
code's bug: it propagates unchanged, so its traceback ends in the family's file.
"""

from __future__ import annotations

import importlib.util
import linecache
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor
from torch.overrides import TorchFunctionMode

import fmoe
from fmoe import runner
from fmoe import stage as S
from fmoe.stages import spec
from fmoe.stages.family import BUILTIN_FAMILIES, Family
from fmoe.stages.spec import Model, Stage, StageContext

# a model of at most this many parameters is checked on the CPU (256 MiB of float32), values included
CPU_CHECK_PARAMS = 1 << 26

# fmoe's own code: the runtime and the stage builders, not its families (a family's code, fmoe's or
# a user's, raising is a bug in it: a traceback); torch's
_FMOE_ROOTS = (Path(fmoe.__file__).resolve().parent, Path(spec.__file__).resolve().parent)
_FAMILY_FILES = frozenset(
    Path(importlib.util.find_spec(module).origin).resolve() for module in BUILTIN_FAMILIES.values()
)
_TORCH_ROOT = Path(torch.__file__).resolve().parent
_THIS_FILE = Path(__file__).resolve()


class FamilyError(ValueError):
    """A model family breaks its contract; one line naming the family, the stage, its layer and the
    parameter or output."""


class GradientMismatch(AssertionError):
    """A stage's B or W differs from torch.autograd's; names the family, stage, layer and the input or
    parameter."""


# ----------------------------------------------------------------------------------------------
# check_family


def check_family(family: Family, cfg: Any, batch_size: int = 2, seq_len: int = 4) -> None:
    """Run every stage of ``family.build(cfg)`` once on a tiny batch; FamilyError at the first
    broken contract (see the module docstring). Returns None when the family keeps its contract."""
    where = f"model family {family.name!r}"
    declared = _builder_step(where, lambda: family.param_shapes(cfg))
    for name, shape in declared.items():
        if not (isinstance(shape, tuple | list) and all(type(d) is int and d >= 0 for d in shape)):
            raise FamilyError(
                f"{where}: param_shapes declares {name!r} as {shape!r}, not a tuple of ints >= 0"
            )
    shapes = {name: tuple(shape) for name, shape in declared.items()}
    model = _builder_step(where, lambda: family.build(cfg))
    _check_declared(where, model, shapes)
    on_cpu = sum(math.prod(s) for s in shapes.values()) <= CPU_CHECK_PARAMS
    if on_cpu:
        params = _builder_step(where, lambda: family.init_params(cfg, seed=0))
        for name, shape in shapes.items():
            got = params.get(name)
            if got is None or tuple(got.shape) != shape:
                have = "nothing" if got is None else f"shape {tuple(got.shape)}"
                raise FamilyError(
                    f"{where}: init_params gives {have} for {name!r}; param_shapes declares {shape}"
                )
    else:
        params = {n: torch.empty(s, device="meta") for n, s in shapes.items()}
    device = "cpu" if on_cpu else "meta"
    seq = min(seq_len, family.sizes(cfg).max_positions or seq_len)
    tokens = torch.randint(
        0, family.sizes(cfg).vocab_size, (batch_size, seq), generator=torch.Generator().manual_seed(0)
    )
    batch = runner.with_positions({"tokens": tokens.to(device), "labels": tokens.to(device)})
    carry: tuple[Tensor, ...] = ()
    for i, stage in enumerate(model.stages):
        layer = model.layer_of[i] if model.layer_of else -1
        place = f"{where}, stage {stage.name!r}" + (f" (layer {layer})" if layer >= 0 else "")
        given = _given(model, i, len(carry))
        trace = _Provenance({n: params[n] for n in stage.params})
        try:
            inputs = runner.stage_inputs(stage, carry, batch)
            with torch.no_grad(), trace:
                outputs = S.call(stage, params, inputs, StageContext())
        except Exception as e:
            if not on_cpu and _needs_values(e):
                return  # on the meta device the rest depends on values (which experts, how many rows)
            why = trace.explain(e, shapes) or _fmoe_refusal(e, given)
            if why is None:
                raise  # the family's own code raised: its traceback is the report
            raise FamilyError(f"{place}: {why}") from None
        carry, _ = runner.split_outputs(stage, outputs)
        following = model.stages[i + 1] if i + 1 < len(model.stages) else None
        if following is not None and following.role == "dispatch":
            _check_routing(place, carry, model.num_experts, trace, values=on_cpu)


def _check_declared(where: str, model: Model, shapes: dict[str, tuple[int, ...]]) -> None:
    """Every parameter a stage reads is declared, and every declared one is read by some stage."""
    for stage in model.stages:
        for name in stage.params:
            if name not in shapes:
                raise FamilyError(
                    f"{where}, stage {stage.name!r}: reads parameter {name!r}, which param_shapes does not declare"
                )
    read = set(model.param_names())
    for name in shapes:
        if name not in read:
            raise FamilyError(f"{where}: param_shapes declares {name!r}, which no stage reads")


def _given(model: Model, i: int, carried: int) -> str:
    """What stage i was given, in words (for a stage that refuses its inputs)."""
    stage = model.stages[i]
    parts = [f"{carried} carried from stage {model.stages[i - 1].name!r}"] if i else []
    parts += [f"batch field {k!r}" for k in stage.batch_inputs]
    return f"given {carried + len(stage.batch_inputs)} inputs ({', '.join(parts) or 'none'})"


def _check_routing(
    place: str, carried: tuple[Tensor, ...], num_experts: int, trace: _Provenance, values: bool
) -> None:
    """The routing a dispatch stage takes (``spec.RoutedTokens``), as the stage before it carries it."""
    fields = spec.RoutedTokens._fields
    if len(carried) < len(fields):
        raise FamilyError(
            f"{place}: carries {len(carried)} outputs to a dispatch stage, whose inputs start with "
            f"RoutedTokens ({', '.join(fields)})"
        )
    _, tokens, ids, weights = carried[: len(fields)]

    def refuse(index: int, wanted: str) -> FamilyError:
        tensor, made = carried[index], trace.made_from(carried[index])
        source = f" (computed from {', '.join(made)})" if made else ""
        return FamilyError(
            f"{place}: {fields[index]} (output {index}) is {tensor.dtype} {list(tensor.shape)}{source}; "
            f"a dispatch stage takes {wanted}"
        )

    if tokens.dim() != 2 or not tokens.is_floating_point():
        raise refuse(1, "tokens [T, H] of a floating dtype")
    T = tokens.shape[0]
    if ids.dtype != torch.int64 or ids.dim() != 2 or ids.shape[0] != T:
        raise refuse(2, f"expert_ids int64 [T, k] (T = {T} tokens)")
    if weights.dtype != tokens.dtype or tuple(weights.shape) != tuple(ids.shape):
        raise refuse(3, f"weights {tokens.dtype} (the tokens' dtype) {list(ids.shape)} (as expert_ids)")
    if values and ids.numel() and not (int(ids.min()) >= 0 and int(ids.max()) < num_experts):
        made = trace.made_from(ids)
        source = f" (computed from {', '.join(made)})" if made else ""
        raise FamilyError(
            f"{place}: expert_ids (output 2) hold {int(ids.min())}..{int(ids.max())}{source}; the model has "
            f"{num_experts} experts (Model.num_experts): ids must be in [0, {num_experts})"
        )


def _builder_step(where: str, call):
    """``call()`` (the family's build or init); a refusal by fmoe's builder code is a FamilyError."""
    try:
        return call()
    except Exception as e:
        why = _fmoe_refusal(e, "")
        if why is None:
            raise
        raise FamilyError(f"{where}: {why}") from None


@dataclass
class _Failure:
    error: BaseException
    op: str
    operands: list[Tensor]
    params: list[str]
    caller: str


class _Provenance(TorchFunctionMode):
    """Records, for each tensor a stage computes, the parameters it was computed from, and the first
    op that raised: what the op was, its operands, where the stage called it.

    A tensor computed from parameters alone (a parameter's transpose, slice or cast) stands for them
    ("weight-like"). An op that reads parameters or weight-like tensors gives its output those
    parameters (the nearest); any other op the union of its operands' parameters. An in-place op
    adds to its first operand's."""

    def __init__(self, params: dict[str, Tensor]):
        super().__init__()
        self.param_of = {id(t): n for n, t in params.items()}
        self.keep = list(params.values())  # ids stay unique while recorded
        # id -> (tensor, the parameters it was computed from, weight-like)
        self.sources: dict[int, tuple[Tensor, tuple[str, ...], bool]] = {}
        self.failure: _Failure | None = None

    def made_from(self, t: Tensor) -> tuple[str, ...]:
        if id(t) in self.param_of:
            return (self.param_of[id(t)],)
        return self.sources.get(id(t), (None, (), False))[1]

    def _weight_like(self, t: Tensor) -> bool:
        return id(t) in self.param_of or self.sources.get(id(t), (None, (), False))[2]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        operands = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        weights = [t for t in operands if self._weight_like(t)]
        direct = tuple(dict.fromkeys(n for t in weights for n in self.made_from(t)))
        try:
            out = func(*args, **kwargs)
        except Exception as e:
            if self.failure is None:
                made = [n for t in operands if not self._weight_like(t) for n in self.made_from(t)]
                self.failure = _Failure(
                    e, _op_name(func), operands, list(dict.fromkeys([*direct, *made])), _caller()
                )
            raise
        made = direct or tuple(dict.fromkeys(n for t in operands for n in self.made_from(t)))
        weight_like = bool(weights) and len(weights) == len(operands)
        name = getattr(func, "__name__", "")
        if operands and (name == "__setitem__" or (name.endswith("_") and not name.startswith("__"))):
            first = operands[0]  # written in place: it now holds what it was made from and this op's
            before = self.made_from(first)
            self.sources[id(first)] = (first, tuple(dict.fromkeys([*before, *made])), False)
        for t in pytree.tree_leaves(out):
            if isinstance(t, Tensor) and id(t) not in self.param_of:
                self.sources[id(t)] = (t, made, weight_like)
        return out

    def explain(self, e: BaseException, shapes: dict[str, tuple[int, ...]]) -> str | None:
        """The one line for an op that refused its operands, when the failure is such an op's and
        its operands came from parameters (or fmoe's code called it); None otherwise."""
        f = self.failure
        if f is None or f.error is not e or not (f.params or _in_fmoe(f.caller)):
            return None
        message = _first_line(e)
        operands = ", ".join(f"{t.dtype} {list(t.shape)}" for t in f.operands)
        made = (
            "; operands computed from " + ", ".join(f"{n} (declared {shapes[n]})" for n in f.params)
            if f.params
            else ""
        )
        return f"{f.op} at {f.caller} refused its operands ({operands}): {message}{made}"


def _op_name(func) -> str:
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    module = getattr(func, "__module__", None)
    return f"{module}.{name}" if module and not name.startswith(module) else name


def _caller() -> str:
    """file:line `source` of the innermost frame outside torch and this module, where the op was
    called; when that is fmoe's code, also the innermost frame of the family's own code, if any."""
    frame: FrameType | None = sys._getframe(1)
    found: list[str] = []
    while frame is not None:
        where = _where(frame.f_code.co_filename, frame.f_lineno)
        path = Path(frame.f_code.co_filename).resolve()
        if path != _THIS_FILE and not path.is_relative_to(_TORCH_ROOT):
            if not found:
                found.append(where)
                if not _in_fmoe(where):
                    break
            elif not _in_fmoe(where):
                found.append(f"called from {where}")
                break
        frame = frame.f_back
    return ", ".join(found) or "?"


def _where(filename: str, line: int) -> str:
    source = linecache.getline(filename, line).strip()
    return f"{filename}:{line}" + (f" `{source}`" if source else "")


def _in_fmoe(where: str) -> bool:
    """Whether ``where`` (a file, or "file:line ...") is fmoe's runtime or builder code."""
    path = Path(where.split(":", 1)[0]).resolve()
    in_roots = any(path.is_relative_to(root) for root in _FMOE_ROOTS)
    return in_roots and path != _THIS_FILE and path not in _FAMILY_FILES


def _fmoe_refusal(e: BaseException, given: str) -> str | None:
    """The one line for an exception raised by fmoe's own code (a stage builder refusing what a
    family's function returned, a stage contract fmoe.stage enforces); None when the innermost
    frame outside torch is the family's own code."""
    tb: TracebackType | None = e.__traceback__
    innermost = None
    while tb is not None:
        path = Path(tb.tb_frame.f_code.co_filename).resolve()
        if path != _THIS_FILE and not path.is_relative_to(_TORCH_ROOT):
            innermost = tb
        tb = tb.tb_next
    if innermost is None or not _in_fmoe(innermost.tb_frame.f_code.co_filename):
        return None
    if isinstance(e, S.StageError):  # fmoe.stage's own message names the stage and what it broke
        return _first_line(e)
    at = _where(innermost.tb_frame.f_code.co_filename, innermost.tb_lineno)
    context = f", {given}" if given else ""
    return f"{_first_line(e)} (at {at}{context})"


def _first_line(e: BaseException) -> str:
    text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


def _needs_values(e: BaseException) -> bool:
    """An op the meta device cannot run without values (an output shape that depends on them)."""
    return isinstance(e, NotImplementedError) or "meta" in str(e).lower()


# ----------------------------------------------------------------------------------------------
# check_gradients

# float64: the derived B and W apply the same per-op derivatives as autograd, accumulated in possibly
# another order (deferred weight GEMMs, a gradient summed over several uses): a few tens of
# eps = 1.1e-16 per element, far below this
GRADIENT_RTOL = 1e-12


def check_gradients(
    family: Family,
    cfg: Any,
    seed: int = 0,
    batch_size: int = 2,
    seq_len: int = 5,
    rtol: float = GRADIENT_RTOL,
) -> dict[str, float]:
    """Every stage's B (input gradients) and W (parameter gradients), derived or hand-written
    (``spec.CustomGrad``), against torch.autograd of its forward, in float64, chained through the
    whole model: each stage runs on the outputs of the one before, from a seeded batch of
    ``batch_size`` x ``seq_len`` tokens and the family's init (``seed``), with seeded random output
    gradients and its loss terms weighted 0.5.

    Returns {"<stage>: <input i | parameter name>": relative error ||got - autograd|| / ||autograd||};
    raises GradientMismatch naming the family, stage, layer and the input or parameter whose error
    exceeds ``rtol`` (or that got a gradient autograd does not give, or none where it gives one).
    Run it on the tiny config of a family under test: it holds the whole model in float64.
    """
    model = family.build(cfg)
    params = family.init_params(cfg, seed=seed, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    seq = min(seq_len, family.sizes(cfg).max_positions or seq_len)
    tokens, labels = torch.randint(0, family.sizes(cfg).vocab_size, (2, batch_size, seq), generator=gen)
    batch = runner.with_positions({"tokens": tokens, "labels": labels})
    errors: dict[str, float] = {}
    carry: tuple[Tensor, ...] = ()
    for i, stage in enumerate(model.stages):
        layer = model.layer_of[i] if model.layer_of else -1
        place = f"model family {family.name!r}, stage {stage.name!r}" + (
            f" (layer {layer})" if layer >= 0 else ""
        )
        inputs = runner.stage_inputs(stage, carry, batch)
        outputs, fwd = S.forward(stage, params, inputs, StageContext())
        carried, _ = runner.split_outputs(stage, outputs)
        grad_outputs = [
            torch.randn(o.shape, generator=gen, dtype=o.dtype) if o.is_floating_point() else None
            for o in carried
        ]
        grad_inputs, work = S.backward_input(fwd, grad_outputs, loss_scale=0.5)
        grads = S.backward_weight(work)
        want_inputs, want_params = _autograd_gradients(stage, params, inputs, grad_outputs, loss_scale=0.5)
        got = {f"input {k}": g for k, g in enumerate(grad_inputs)} | grads
        want = {f"input {k}": g for k, g in enumerate(want_inputs)} | want_params
        for what, err in _compare(place, got, want, rtol).items():
            errors[f"{stage.name}: {what}"] = err
        carry = carried
    return errors


def _compare(place: str, got: dict, want: dict, rtol: float) -> dict[str, float]:
    """{what: relative error} of the stage's gradients ``got`` against autograd's ``want``; raises
    GradientMismatch naming ``place`` for the first over ``rtol`` or given by only one of the two."""
    errors: dict[str, float] = {}
    for what in dict.fromkeys([*want, *got]):
        g, w = got.get(what), want.get(what)
        which = "B" if what.startswith("input") else "W"
        if w is None or g is None:
            if w is not None or g is not None:
                raise GradientMismatch(
                    f"{place}: {which} gives {'no' if g is None else 'a'} gradient of {what}, autograd "
                    f"{'none' if w is None else 'one'}"
                )
            continue
        err = _relative_error(g, w)
        errors[what] = err
        if not err <= rtol:
            raise GradientMismatch(
                f"{place}: {which}'s gradient of {what} differs from autograd's by relative error "
                f"{err:.3g} (float64; tolerance {rtol:g})"
            )
    return errors


def _autograd_gradients(
    stage: Stage, params: dict[str, Tensor], inputs: tuple[Tensor, ...], grad_outputs: list, loss_scale: float
) -> tuple[list[Tensor | None], dict[str, Tensor]]:
    """Gradients of sum(<carried outputs, grad_outputs>) + loss_scale * the weighted loss terms, by
    plain torch.autograd through the stage's forward: (per input or None, {parameter: gradient})."""
    leaves = {n: params[n].clone().requires_grad_() for n in stage.params}
    xs = [t.clone().requires_grad_() if t.is_floating_point() else t for t in inputs]
    with torch.enable_grad():
        outputs = S.call(stage, leaves, xs, StageContext())
        carried, terms = runner.split_outputs(stage, outputs)
        total = sum((o * g).sum() for o, g in zip(carried, grad_outputs) if g is not None and o.requires_grad)
        total = total + sum(loss_scale * t.sum() for t in terms)
        if isinstance(total, Tensor) and total.requires_grad:
            total.backward()
    return [x.grad if x.is_floating_point() else None for x in xs], {
        n: t.grad for n, t in leaves.items() if t.grad is not None
    }


def _relative_error(got: Tensor, want: Tensor) -> float:
    """||got - want|| / ||want|| in float64 (0 when both are zero, inf for a nonzero got of a zero want)."""
    if got.shape != want.shape:
        return float("inf")
    num, den = (got.double() - want.double()).norm().item(), want.double().norm().item()
    return (0.0 if num == 0.0 else float("inf")) if den == 0.0 else num / den
