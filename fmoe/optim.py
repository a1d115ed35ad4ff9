"""Functional optimizer: optax-style gradient transformations over params dicts.

A transformation is a pair of functions bundled in :class:`GradientTransformation`:

- ``init(params) -> state``
- ``update(updates, state, params) -> (updates, state)``

``params``, ``updates`` (gradients on the way in) and ``state`` are all flat ``dict[str, Tensor]``
keyed by global parameter names. The state of a transformation is one flat dict whose keys say
what they hold (``step``, ``grad_norm``, ``exp_avg/<param name>``, ``exp_avg_sq/<param name>``);
:func:`chain` merges the dicts of its members (a key two members both want is an error at ``init``)
and threads the merged dict through their ``update`` calls. A checkpoint of the optimizer is
therefore just that dict (:func:`state_to_flat`), and it does not depend on the parallel layout.

Buffers: like JAX's buffer donation, ``update`` may overwrite the tensors of ``updates`` and the
large tensors of ``state`` in place and return them; the caller must not reuse what it passed in.
``params`` are never modified by ``update``. Every function runs under ``torch.no_grad()`` (inputs
that require grad build no graph) and none syncs with the host: the global norm, the clip scale, the
step count and the scheduled learning rate are tensors on the parameters' device.

Speed: :func:`step` is the training loop's entry, one optimizer step that also applies the result,
writing straight into the parameter tensors. :func:`adamw`'s step runs on fused kernels and reads
the gradients in whatever float dtype they come, without an fp32 copy (``fmoe.optim_fused``). A
transformation that only multiplies every update by one device scalar (:func:`clip_by_global_norm`)
exposes it as its ``factor``; ``chain``'s fused step hands that scalar to the next fused step, so
``chain(clip_by_global_norm(c), adamw(...))`` reads each gradient once. The optax-style ``update`` +
:func:`apply_updates` route gives the same numbers (to rounding) with a copy of the params and more
passes. Step times against torch's AdamW and torchopt's (whose shape we keep, but whose states are
tuples addressed by position): benchmarks/bench_optim.py, benchmarks/results/optim_h200*.json.

:func:`adamw`'s fused step is tested against optax's composed definition,
``fmoe.optim_composed.adamw = chain(scale_by_adam, add_decayed_weights, scale_by_learning_rate)``.
The learning-rate schedules live in ``fmoe.lr_schedules`` and are importable from here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
from torch import Tensor

from fmoe import optim_fused
from fmoe.lr_schedules import Schedule, warmup_cosine, warmup_stable_decay
from fmoe.optim_fused import group_by_device_dtype

__all__ = [
    "GradientTransformation",
    "adamw",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "default_decay_mask",
    "scale_updates",
    "state_from_flat",
    "state_to_flat",
    "step",
    "warmup_cosine",
    "warmup_stable_decay",
]

Params = dict[str, Tensor]
State = dict[str, Tensor]


class GradientTransformation(NamedTuple):
    """``init(params) -> state``; ``update(updates, state, params) -> (updates, state)``.

    ``step`` (optional) is a fused ``update`` + :func:`apply_updates`:
    ``step(grads, state, params, grad_scale=None, found_inf=None) -> (params, state)``, allowed to
    write into the parameter tensors; ``grad_scale`` (None, or a 0-d float32 tensor on the device)
    means "the gradients are ``grads * grad_scale``"; ``found_inf`` (None, or a 0-d float32 tensor on
    the device, 1.0 or 0.0) set to 1.0 means "skip this step": no parameter and no moment changes,
    decided on the device (no host sync). Use :func:`step` rather than calling the field, it falls
    back to update + apply when absent.

    ``factor`` (optional) is for a transformation whose ``update`` only multiplies every update by
    one device scalar: ``factor(updates, state, params) -> (scalar or None, state)`` gives that 0-d
    float32 tensor (None: leave the updates as they are) and the new state, without touching the
    updates. ``update`` must equal ``factor`` followed by that multiplication.
    """

    init: Callable[[Params], State]
    update: Callable[[Params, State, Params | None], tuple[Params, State]]
    step: Callable[..., tuple[Params, State]] | None = None
    factor: Callable[[Params, State, Params | None], tuple[Tensor | None, State]] | None = None


# --------------------------------------------------------------------------------------------------
# composition and application


def chain(*transforms: GradientTransformation, skip_nonfinite: bool = False) -> GradientTransformation:
    """Compose transformations left to right: ``chain(clip_by_global_norm(1.0), adamw(...))``.

    The chain's state is the union of its members' state dicts; ``init`` raises ValueError naming a
    key two members both keep. ``update`` threads the one dict through the members in order.

    skip_nonfinite: the fused step skips itself (``found_inf``: no parameter or moment changes, the
    step is not counted) when a member's factor is not finite - ``clip_by_global_norm``'s is NaN for
    a NaN or infinite gradient norm. Decided on the device, for torch's fused kernel and fmoe's own
    (its skip flag): no host sync.
    """
    if not transforms:
        raise ValueError("chain: needs at least one transformation")

    @torch.no_grad()
    def init(params: Params) -> State:
        state: State = {}
        for i, tx in enumerate(transforms):
            part = tx.init(params)
            clash = sorted(set(part) & set(state))
            if clash:
                raise ValueError(
                    f"chain: transformation {i} keeps state key(s) {clash[:3]} that an earlier one keeps too"
                )
            state.update(part)
        return state

    @torch.no_grad()
    def update(updates: Params, state: State, params: Params | None = None) -> tuple[Params, State]:
        for tx in transforms:
            updates, state = tx.update(updates, state, params)
        return updates, state

    @torch.no_grad()
    def step_(
        grads: Params,
        state: State,
        params: Params,
        grad_scale: Tensor | None = None,
        found_inf: Tensor | None = None,
    ) -> tuple[Params, State]:
        # A member with a factor only scales: its scalar stays pending, handed to the last member's
        # fused step (folded into its pass over the gradients) or applied before a member that
        # reads the gradients. skip_nonfinite: a non-finite factor skips the step.
        pending = grad_scale
        for tx in transforms[:-1]:
            if pending is not None:
                grads, pending = scale_updates(grads, pending), None
            if tx.factor is not None:
                pending, state = tx.factor(grads, state, params)
                if skip_nonfinite and pending is not None:
                    found_inf = _skip_if_nonfinite(pending, found_inf)
            else:
                grads, state = tx.update(grads, state, params)
        return step(transforms[-1], grads, state, params, grad_scale=pending, found_inf=found_inf)

    return GradientTransformation(init, update, step_)


@torch.no_grad()
def apply_updates(params: Params, updates: Params, inplace: bool = True) -> Params:
    """``params + updates`` for every key of ``params``.

    inplace=True adds into the parameter tensors (one ``torch._foreach_add_`` per device/dtype
    group) and returns the same dict object's tensors in a new dict; inplace=False allocates new
    tensors and leaves ``params`` untouched.
    """
    _check_same_keys(params, updates, "updates")
    names = list(params)
    if not inplace:
        return {n: params[n] + updates[n].to(params[n].dtype) for n in names}
    for group in group_by_device_dtype(params, names).values():
        torch._foreach_add_([params[n] for n in group], [updates[n].to(params[n].dtype) for n in group])
    return dict(params)


@torch.no_grad()
def step(
    tx: GradientTransformation,
    grads: Params,
    state: State,
    params: Params,
    *,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> tuple[Params, State]:
    """One optimizer step: ``(new params, new state)``; the training loop's entry point.

    Writes into the tensors of ``params`` (and of ``grads`` and ``state``): hold no other reference
    to their old values. Uses ``tx.step`` when the transformation has a fused one. grad_scale: None
    or a 0-d float32 tensor the gradients are to be multiplied by (folded into the fused step).
    found_inf: None or a 0-d float32 tensor; 1.0 skips the step (params and moments unchanged; on
    the device for fused steps, a host sync for the update + apply fallback).
    """
    if tx.step is not None:
        kwargs = {} if grad_scale is None else {"grad_scale": grad_scale}
        if found_inf is not None:
            kwargs["found_inf"] = found_inf
        return tx.step(grads, state, params, **kwargs)
    if found_inf is not None and bool(found_inf):
        return params, state
    if grad_scale is not None:
        grads = scale_updates(grads, grad_scale)
    updates, state = tx.update(grads, state, params)
    return apply_updates(params, updates, inplace=True), state


@torch.no_grad()
def scale_updates(updates: Params, scale: Tensor) -> Params:
    """Multiply every update in place by the 0-d tensor ``scale`` (one ``torch._foreach_mul_`` per
    device/dtype group, the scale cast to the group's dtype); returns the same tensors."""
    for group in group_by_device_dtype(updates, [n for n in updates if updates[n].numel() > 0]).values():
        ts = [updates[n] for n in group]
        torch._foreach_mul_(ts, scale.to(device=ts[0].device, dtype=ts[0].dtype))
    return updates


# --------------------------------------------------------------------------------------------------
# transformations


def clip_by_global_norm(
    max_norm: float, sq_norm_reduce: Callable[[Tensor], Tensor] | None = None
) -> GradientTransformation:
    """Scale all updates by ``min(1, max_norm / (global_norm + 1e-6))``, as ``clip_grad_norm_`` does.

    The norm is accumulated in float32 and the scale stays on the device (no host sync). The
    global norm of the last update is kept in the state as ``grad_norm`` (0-d float32) for logging.
    sq_norm_reduce: when parameters are sharded over processes, a function that sums the local
    squared norm over them (e.g. ``lambda t: (dist.all_reduce(t), t)[1]``); None for one process.
    """
    if not (isinstance(max_norm, int | float) and max_norm > 0 and math.isfinite(max_norm)):
        raise ValueError(f"clip_by_global_norm: max_norm must be a positive finite number, got {max_norm!r}")

    @torch.no_grad()
    def init(params: Params) -> State:
        return {"grad_norm": torch.zeros((), dtype=torch.float32, device=_device_of(params))}

    @torch.no_grad()
    def factor(updates: Params, state: State, params: Params | None = None) -> tuple[Tensor | None, State]:
        tensors = [u for u in updates.values() if u.numel() > 0]
        if not tensors:
            return None, state
        device = tensors[0].device
        norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)  # fp32 sums for bf16 updates too
        sq = torch.stack([n.to(device) for n in norms]).square().sum()
        if sq_norm_reduce is not None:
            sq = sq_norm_reduce(sq)
        norm = sq.sqrt()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        # an infinite norm would give a finite 0 scale and inf * 0 = NaN updates: make the scale
        # NaN for any non-finite norm, which chain's fused step reads as "skip this step"
        scale = torch.where(torch.isfinite(norm), scale, torch.full_like(scale, math.nan))
        return scale, {**state, "grad_norm": norm}

    @torch.no_grad()
    def update(updates: Params, state: State, params: Params | None = None) -> tuple[Params, State]:
        scale, state = factor(updates, state, params)
        if scale is None:
            return updates, state
        return scale_updates(updates, scale), state

    return GradientTransformation(init, update, factor=factor)


def adamw(
    lr: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    mask: Callable[[str], bool] | Mapping[str, bool] | None = None,
) -> GradientTransformation:
    """AdamW (decoupled weight decay, Loshchilov & Hutter) on fused kernels, gradients in any float dtype.

    Per element, with t the 1-based step and lr_t = lr(t - 1) (or the constant lr):
        p <- p * (1 - lr_t * wd)                              (only where mask says decay)
        m <- b1 m + (1 - b1) g ;  v <- b2 v + (1 - b2) g^2
        p <- p - lr_t * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
    exactly as ``torch.optim.AdamW``, and as ``fmoe.optim_composed.adamw`` (to float32 rounding). A
    schedule gets the step count tensor (steps done before this one) and returns a 0-d tensor on its
    device. The step is ``fmoe.optim_fused.adamw_step_``; ``update`` runs it on a copy of the params.

    mask: which parameters get weight decay, as in optax: ``mask(name) -> True`` (or
    ``mask[name] == True``) means decay; None decays all. :func:`default_decay_mask` gives the
    usual "matrices only" dict. State (fp32 params give fp32 state): ``step`` 0-d float32 (exact
    to 2**24 steps), ``exp_avg/<name>`` and ``exp_avg_sq/<name>`` shaped and typed like the param.
    """
    _check_adamw_args(lr, b1, b2, eps, weight_decay, mask)
    decays = _decay_rule(mask)

    @torch.no_grad()
    def init(params: Params) -> State:
        return _adamw_init(params, decays)

    @torch.no_grad()
    def step_(
        grads: Params,
        state: State,
        params: Params,
        grad_scale: Tensor | None = None,
        found_inf: Tensor | None = None,
    ) -> tuple[Params, State]:
        _check_same_keys(params, grads, "grads")
        lr_t = lr(state["step"]) if callable(lr) else float(lr)
        count = state["step"] + 1  # the kernels read the 1-based step for the bias corrections
        if found_inf is not None:
            found_inf = found_inf.to(device=count.device, dtype=torch.float32)
        optim_fused.adamw_step_(
            params, grads, state, count, lr_t, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
            decays=decays, grad_scale=grad_scale, found_inf=found_inf,
        )  # fmt: skip
        if found_inf is not None:  # a skipped step is not counted (the schedule does not advance)
            count = count - found_inf
        return params, {**state, "step": count}

    return GradientTransformation(init, _update_by_step(step_), step_)


def default_decay_mask(params: Params) -> dict[str, bool]:
    """nanoGPT's rule as an ``adamw`` mask: decay tensors of 2 or more dims (matmul weights,
    embeddings), not vectors (biases, norm scales)."""
    return {name: p.dim() >= 2 for name, p in params.items()}


# --------------------------------------------------------------------------------------------------
# checkpointable state


def state_to_flat(state: State) -> dict[str, Tensor]:
    """The state as a flat ``{key: contiguous tensor}`` dict for a safetensors checkpoint.

    Keys are the state's own (``step``, ``exp_avg/<param name>``, ...), so they name global
    parameters and do not depend on how parameters are laid out over processes.
    """
    flat: dict[str, Tensor] = {}
    for key, value in state.items():
        if not isinstance(key, str) or not isinstance(value, Tensor):
            raise ValueError(
                f"optimizer state entry {key!r} is not a str -> Tensor pair ({type(value).__name__})"
            )
        flat[key] = value.detach().contiguous()
    return flat


def state_from_flat(tx: GradientTransformation, flat: Mapping[str, Tensor], params: Params) -> State:
    """Rebuild ``tx``'s state for ``params`` from a flat dict (e.g. read from a checkpoint).

    Checks keys, shapes and dtypes against what ``tx.init(params)`` would make (traced on the meta
    device: allocates nothing) and raises ValueError naming the first missing, unexpected or
    mismatched key. Tensors are copied to the device of the parameters.
    """
    template = tx.init({n: torch.empty_like(p, device="meta") for n, p in params.items()})
    missing = sorted(set(template) - set(flat))
    unexpected = sorted(set(flat) - set(template))
    if missing or unexpected:
        raise ValueError(
            f"optimizer state does not match the parameters: missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
        )
    device = _device_of(params)
    state: State = {}
    for key, like in template.items():
        value = flat[key]
        if value.shape != like.shape or value.dtype != like.dtype:
            raise ValueError(
                f"optimizer state {key!r}: got {tuple(value.shape)} {value.dtype}, expected "
                f"{tuple(like.shape)} {like.dtype}"
            )
        state[key] = value.to(device)
    return state


# --------------------------------------------------------------------------------------------------
# helpers


def _check_adamw_args(
    lr: object, b1: float, b2: float, eps: float, weight_decay: float, mask: object
) -> None:
    """ValueError naming the first bad hyperparameter of :func:`adamw`."""
    for field, value, lo, hi in (("b1", b1, 0.0, 1.0), ("b2", b2, 0.0, 1.0)):
        if not (isinstance(value, int | float) and lo <= value < hi):
            raise ValueError(f"adamw: {field} must be in [{lo}, {hi}), got {value!r}")
    for field, value in (("eps", eps), ("weight_decay", weight_decay)):
        if not (isinstance(value, int | float) and value >= 0 and math.isfinite(value)):
            raise ValueError(f"adamw: {field} must be a finite number >= 0, got {value!r}")
    if not callable(lr) and not (isinstance(lr, int | float) and lr >= 0 and math.isfinite(lr)):
        raise ValueError(f"adamw: lr must be a number >= 0 or a schedule (step -> lr), got {lr!r}")
    if mask is not None and not (callable(mask) or isinstance(mask, Mapping)):
        raise ValueError(
            f"adamw: mask must be None, a callable name -> bool or a dict, got {type(mask).__name__}"
        )


def _decay_rule(mask: Callable[[str], bool] | Mapping[str, bool] | None) -> Callable[[str], bool]:
    """``mask`` as a function name -> "this parameter gets weight decay"; a dict without the name
    raises ValueError naming it."""

    def decays(name: str) -> bool:
        if mask is None:
            return True
        if callable(mask):
            return bool(mask(name))
        if name not in mask:
            raise ValueError(f"adamw: mask has no entry for parameter {name!r}")
        return bool(mask[name])

    return decays


def _adamw_init(params: Params, decays: Callable[[str], bool]) -> State:
    """AdamW's state for ``params``: ``step`` (0-d float32, 0) and zero ``exp_avg/<name>``,
    ``exp_avg_sq/<name>`` like each parameter."""
    state: State = {"step": torch.zeros((), dtype=torch.float32, device=_device_of(params))}
    for name, p in params.items():
        if not p.is_floating_point():
            raise ValueError(f"adamw: parameter {name!r} has dtype {p.dtype}, expected a floating type")
        decays(name)  # a dict mask missing a name fails here, at init, not in the first step
        state[f"exp_avg/{name}"] = torch.zeros_like(p)
        state[f"exp_avg_sq/{name}"] = torch.zeros_like(p)
    return state


def _update_by_step(step_: Callable[..., tuple[Params, State]]) -> Callable[..., tuple[Params, State]]:
    """:func:`adamw`'s optax ``update``: its fused step run on a copy of the params, new - old returned."""

    @torch.no_grad()
    def update(updates: Params, state: State, params: Params | None = None) -> tuple[Params, State]:
        if params is None:
            raise ValueError("adamw: update needs params (the weight decay and the fused kernel read them)")
        new, state = step_(updates, state, {n: p.clone() for n, p in params.items()})
        for group in group_by_device_dtype(params, list(params)).values():
            torch._foreach_sub_([new[n] for n in group], [params[n] for n in group])
        return new, state

    return update


def _device_of(params: Params) -> torch.device:
    for p in params.values():
        return p.device
    return torch.device("cpu")


def _skip_if_nonfinite(scale: Tensor, found_inf: Tensor | None) -> Tensor:
    """found_inf (0-d float32, 1.0 = skip) raised to 1.0 when ``scale`` is not finite (no sync)."""
    bad = (~torch.isfinite(scale)).to(torch.float32)
    return bad if found_inf is None else torch.maximum(found_inf.to(bad.device, torch.float32), bad)


def _check_same_keys(params: Mapping[str, Tensor], other: Mapping[str, Tensor], what: str) -> None:
    if len(params) != len(other) or any(n not in other for n in params):
        missing = [n for n in params if n not in other]
        extra = [n for n in other if n not in params]
        raise ValueError(f"{what} do not match the parameters: missing {missing[:5]}, unexpected {extra[:5]}")
