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
``params`` are never modified by ``update``. Speed: :func:`step` is the training loop's entry, one
optimizer step that also applies the result, writing straight into the parameter tensors. AdamW
takes the gradients in whatever float dtype they come (bf16 out of a bf16 model) without an fp32
copy: fp32 parameters with gradients of another dtype, or with a scale to fold in, go through
``fmoe.kernels.adamw`` (one Triton pass per tensor; bit for bit ``torch._fused_adamw_`` on the fp32
copy, with torch 2.11) on CUDA, or on CPU under TRITON_INTERPRET=1, for tensors of at least
``KERNEL_MIN_NUMEL`` elements; smaller ones, and plain CPU, convert their grads in one cat and take
torch's kernel. The plain case (gradients in the params' dtype, no scale) runs
``torch._fused_adamw_`` itself, the kernel of ``torch.optim.AdamW(fused=True)``.

A transformation that only multiplies every update by one device scalar
(:func:`clip_by_global_norm`) exposes it as its ``factor``; ``chain``'s fused step hands that
scalar to the next fused step instead of scaling the gradients in a pass of their own, so
``chain(clip_by_global_norm(c), adamw(...))`` reads each gradient once: on an H200, 3.2B params
with bf16 grads take 23 ms a step, against 47 ms for fp32 copies + the clip's pass + torch's
AdamW (benchmarks/results/optim_h200_3b.json). The optax-style ``update`` + :func:`apply_updates` route gives identical numbers (to
rounding) but needs a copy of the params and more passes.

Every function runs under ``torch.no_grad()``: inputs that require grad build no graph.

No host sync: nothing here calls ``.item()``. The global norm, the clip scale, the step count and
the scheduled learning rate are tensors on the parameters' device.

We keep torchopt's shape of things (``GradientTransformation``, ``chain``, ``apply_updates`` with
``inplace=True``) but not its code: its states are tuples of named tuples addressed by position (not
checkpointable by parameter name) and its AdamW is a chain of elementwise ops, ~6x slower than the
fused kernel on 1.07B parameters (56 ms vs 8.7 ms per step on an H200).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
from torch import Tensor

from fmoe.kernels import adamw as adamw_kernel
from fmoe.kernels._triton import use_triton

Params = dict[str, Tensor]
State = dict[str, Tensor]
# A schedule maps the number of steps done so far (python int, or a 0-d tensor) to a learning rate
# (python float for an int, 0-d float32 tensor on the step's device for a tensor).
Schedule = Callable[[int | Tensor], float | Tensor]


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
        # A member with a factor only scales: keep its scalar pending and hand it to the last
        # member's fused step, which folds it into its own pass over the gradients. A pending
        # scale is applied to the gradients only before a member that has to read them scaled.
        # skip_nonfinite: a non-finite factor (the clip's, for a NaN or infinite norm) skips the step.
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
    for group in _group(params, names).values():
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
    for group in _group(updates, [n for n in updates if updates[n].numel() > 0]).values():
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
    exactly as ``torch.optim.AdamW``. A schedule is called with the step count tensor (steps done
    before this one) and must return a 0-d tensor on its device (the schedules here do).

    mask: which parameters get weight decay, as in optax: ``mask(name) -> True`` (or
    ``mask[name] == True``) means decay; None decays all. :func:`default_decay_mask` gives the
    usual "matrices only" dict. State (fp32 params give fp32 state): ``step`` 0-d float32 (exact
    to 2**24 steps), ``exp_avg/<name>`` and ``exp_avg_sq/<name>`` shaped and typed like the param.

    The fused step takes grads in the params' dtype through ``torch._fused_adamw_``; fp32 params
    with grads of another float dtype (bf16, fp16), or with a ``grad_scale`` to fold in, through
    ``fmoe.kernels.adamw`` (same math and rounding) for tensors of at least ``KERNEL_MIN_NUMEL``
    elements where it runs (CUDA, or the interpreter); the others through ``torch._fused_adamw_``
    after one batched fp32 conversion and a scaling pass.
    """
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

    def decays(name: str) -> bool:
        if mask is None:
            return True
        if callable(mask):
            return bool(mask(name))
        if name not in mask:
            raise ValueError(f"adamw: mask has no entry for parameter {name!r}")
        return bool(mask[name])

    @torch.no_grad()
    def init(params: Params) -> State:
        state: State = {"step": torch.zeros((), dtype=torch.float32, device=_device_of(params))}
        for name, p in params.items():
            if not p.is_floating_point():
                raise ValueError(f"adamw: parameter {name!r} has dtype {p.dtype}, expected a floating type")
            decays(name)  # a dict mask missing a name fails here, at init, not in the first step
            state[f"exp_avg/{name}"] = torch.zeros_like(p)
            state[f"exp_avg_sq/{name}"] = torch.zeros_like(p)
        return state

    @torch.no_grad()
    def step_(
        grads: Params,
        state: State,
        params: Params,
        grad_scale: Tensor | None = None,
        found_inf: Tensor | None = None,
    ) -> tuple[Params, State]:
        _check_same_keys(params, grads, "grads")
        count = state["step"]
        lr_t = lr(count) if callable(lr) else float(lr)
        count = count + 1  # the kernels read the 1-based step for the bias corrections
        names = [n for n, p in params.items() if p.numel() > 0]  # the fused kernel rejects empty tensors
        if found_inf is not None:
            found_inf = found_inf.to(device=count.device, dtype=torch.float32)
        # fp32 params whose grads come in another dtype or are to be scaled: fmoe's kernel, which
        # reads the grads as they are and folds the scale in (no copy, no scaling pass). The plain
        # case keeps torch's fused kernel: it is torch.optim.AdamW(fused=True) by construction, and
        # one multi-tensor launch per group where fmoe's kernel launches once per tensor. (fmoe's
        # kernel gives the same bits with torch 2.11 and is not slower: on an H200, 1.07B fp32
        # params, clip folded in and norm included, 8.70 ms a step against 8.72 ms for torch's
        # plain step without a clip; taking it for large plain tensors would gain little.)
        own = [n for n in names if _own_kernel(params[n], grads[n], state, n, grad_scale)]
        mine = set(own)
        for (device, _dtype), group in _group(params, own).items():
            lr_dev = lr_t.to(device=device, dtype=torch.float32) if isinstance(lr_t, Tensor) else lr_t
            scale = None if grad_scale is None else grad_scale.to(device=device, dtype=torch.float32)
            for decay in (True, False):
                sub = [n for n in group if decays(n) == decay]
                if sub:
                    adamw_kernel.adamw_(
                        [params[n] for n in sub],
                        [grads[n] for n in sub],
                        [state[f"exp_avg/{n}"] for n in sub],
                        [state[f"exp_avg_sq/{n}"] for n in sub],
                        step=count.to(device),
                        lr=lr_dev,
                        beta1=b1,
                        beta2=b2,
                        eps=eps,
                        weight_decay=weight_decay if decay else 0.0,
                        grad_scale=scale,
                        found_inf=None if found_inf is None else found_inf.to(device),
                    )
        for (device, _dtype), group in _group(params, [n for n in names if n not in mine]).items():
            lr_dev = lr_t.to(device=device, dtype=torch.float32) if isinstance(lr_t, Tensor) else lr_t
            steps = [count.to(device)] * len(group)
            gs = dict(zip(group, _to_dtype([grads[n] for n in group], [params[n] for n in group])))
            if grad_scale is not None:  # e.g. bf16 params: scale in a pass of its own, as update does
                gs = scale_updates(gs, grad_scale)
            for decay in (True, False):
                sub = [n for n in group if decays(n) == decay]
                if not sub:
                    continue
                torch._fused_adamw_(
                    [params[n] for n in sub],
                    [gs[n] for n in sub],
                    [state[f"exp_avg/{n}"] for n in sub],
                    [state[f"exp_avg_sq/{n}"] for n in sub],
                    [],
                    steps[: len(sub)],
                    lr=lr_dev,
                    beta1=b1,
                    beta2=b2,
                    weight_decay=weight_decay if decay else 0.0,
                    eps=eps,
                    amsgrad=False,
                    maximize=False,
                    found_inf=None if found_inf is None else found_inf.to(device),
                )
        if found_inf is not None:  # a skipped step is not counted (the schedule does not advance)
            count = count - found_inf
        return params, {**state, "step": count}

    @torch.no_grad()
    def update(updates: Params, state: State, params: Params | None = None) -> tuple[Params, State]:
        if params is None:
            raise ValueError("adamw: update needs params (the weight decay and the fused kernel read them)")
        # Run the fused step on a copy of the params, then report the difference as the update.
        new, state = step_(updates, state, {n: p.clone() for n, p in params.items()})
        names = list(params)
        for group in _group(params, names).values():
            torch._foreach_sub_([new[n] for n in group], [params[n] for n in group])
        return new, state

    return GradientTransformation(init, update, step_)


def default_decay_mask(params: Params) -> dict[str, bool]:
    """nanoGPT's rule as an ``adamw`` mask: decay tensors of 2 or more dims (matmul weights,
    embeddings), not vectors (biases, norm scales)."""
    return {name: p.dim() >= 2 for name, p in params.items()}


# --------------------------------------------------------------------------------------------------
# learning-rate schedules: python int -> python float, 0-d tensor -> 0-d float32 tensor (no sync)


def warmup_cosine(peak: float, warmup: int, total: int, final: float = 0.0) -> Schedule:
    """Linear warmup to ``peak`` then cosine decay to ``final`` at step ``total`` (held after).

    lr(s) = peak * (s + 1) / warmup                                  for s < warmup
          = final + (peak - final) * (1 + cos(pi * p)) / 2,  p = (s - warmup) / (total - warmup)
    with p clamped to [0, 1]; s counts the steps done before the current one (0 for the first).
    """
    _check_schedule(peak, warmup, total, final, "warmup_cosine")
    span = max(total - warmup, 1)

    def schedule(s: int | Tensor) -> float | Tensor:
        if isinstance(s, Tensor):
            s = s.to(torch.float32)
            p = ((s - warmup) / span).clamp(0.0, 1.0)
            cos = final + (peak - final) * 0.5 * (1.0 + torch.cos(math.pi * p))
            return torch.where(s < warmup, peak * (s + 1.0) / max(warmup, 1), cos)
        if s < warmup:
            return peak * (s + 1) / warmup
        p = min(max((s - warmup) / span, 0.0), 1.0)
        return final + (peak - final) * 0.5 * (1.0 + math.cos(math.pi * p))

    return schedule


def warmup_stable_decay(
    peak: float, warmup: int, total: int, decay: int, final: float = 0.0, shape: str = "linear"
) -> Schedule:
    """Warmup-stable-decay (WSD): linear warmup, ``peak`` until ``total - decay``, then decay to
    ``final`` over the last ``decay`` steps (held after ``total``).

    shape: "linear" (peak -> final linearly), "sqrt" (1 - sqrt: lr = peak - (peak - final) sqrt(p),
    Hägele et al. 2024) or "cosine", with p in [0, 1] the fraction of the decay phase done.
    """
    _check_schedule(peak, warmup, total, final, "warmup_stable_decay")
    if not (isinstance(decay, int) and 0 <= decay <= total - warmup):
        raise ValueError(f"warmup_stable_decay: decay must be an int in [0, total - warmup], got {decay!r}")
    if shape not in ("linear", "sqrt", "cosine"):
        raise ValueError(f"warmup_stable_decay: shape must be 'linear', 'sqrt' or 'cosine', got {shape!r}")
    start = total - decay

    def schedule(s: int | Tensor) -> float | Tensor:
        if isinstance(s, Tensor):
            s = s.to(torch.float32)
            p = ((s - start) / max(decay, 1)).clamp(0.0, 1.0)
            if shape == "linear":
                frac = p
            elif shape == "sqrt":
                frac = p.sqrt()
            else:
                frac = 0.5 * (1.0 - torch.cos(math.pi * p))
            return torch.where(s < warmup, peak * (s + 1.0) / max(warmup, 1), peak - (peak - final) * frac)
        if s < warmup:
            return peak * (s + 1) / warmup
        p = min(max((s - start) / max(decay, 1), 0.0), 1.0)
        if shape == "linear":
            frac = p
        elif shape == "sqrt":
            frac = math.sqrt(p)
        else:
            frac = 0.5 * (1.0 - math.cos(math.pi * p))
        return peak - (peak - final) * frac

    return schedule


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


def _device_of(params: Params) -> torch.device:
    for p in params.values():
        return p.device
    return torch.device("cpu")


def _group(
    tensors: Mapping[str, Tensor], names: list[str]
) -> dict[tuple[torch.device, torch.dtype], list[str]]:
    """Names grouped by (device, dtype): foreach/fused kernels take one device and dtype per call."""
    groups: dict[tuple[torch.device, torch.dtype], list[str]] = {}
    for n in names:
        t = tensors[n]
        groups.setdefault((t.device, t.dtype), []).append(n)
    return groups


# Below this many elements a tensor's gradient takes the copy route even where fmoe's kernel runs:
# a Triton launch costs ~30 us of host time, more than the kernel's GPU time for a tensor this small
# (26 bytes an element at ~4 TB/s), so one launch per small tensor leaves the GPU waiting on the
# host. On an H200, 2048 tensors of 16K elements (clip + AdamW, bf16 grads): 67 ms a step with a
# launch each, 32 ms through the old per-tensor .float() copies, 29 ms through this route, which
# converts all such gradients in one cat and steps them in torch's multi-tensor kernel
# (benchmarks/results/optim_h200_small*.json; torch's clip + fused AdamW on fp32 grads, no
# conversion to do, takes 14 ms there). Tests set it to 0 to run the kernel on small tensors.
KERNEL_MIN_NUMEL = 1 << 22


def _own_kernel(p: Tensor, g: Tensor, state: State, name: str, grad_scale: Tensor | None) -> bool:
    """Whether fmoe's AdamW kernel takes this parameter: fp32, at least KERNEL_MIN_NUMEL elements,
    contiguous tensors all round, a gradient of another float dtype or a scale to fold in, and a
    device where the Triton kernel runs (CUDA, or CPU under TRITON_INTERPRET=1). Else torch's fused
    kernel, after a copy and a scaling pass where needed."""
    if p.dtype != torch.float32 or not (g.dtype != p.dtype or grad_scale is not None):
        return False
    if p.numel() < KERNEL_MIN_NUMEL or not use_triton(p):  # CPU: torch's CPU kernel after a copy is fast
        return False
    m, v = state[f"exp_avg/{name}"], state[f"exp_avg_sq/{name}"]
    return (
        g.is_floating_point()
        and g.shape == p.shape
        and g.device == p.device
        and all(t.is_contiguous() for t in (p, g, m, v))
        and m.dtype == v.dtype == torch.float32
    )


def _to_dtype(grads: list[Tensor], params: list[Tensor]) -> list[Tensor]:
    """``grads[i]`` in ``params[i]``'s dtype (one dtype for all params). Those of another dtype whose
    param is contiguous are converted through one cat (a few kernels for any number of tensors, not
    one each) and come back as views of it; the others by ``.to``, which keeps their strides."""
    dtype = params[0].dtype
    out = [g if g.dtype == dtype or p.is_contiguous() else g.to(dtype) for g, p in zip(grads, params)]
    idx = [i for i, (g, p) in enumerate(zip(grads, params)) if g.dtype != dtype and p.is_contiguous()]
    if idx:
        flat = torch.cat([grads[i].reshape(-1) for i in idx]).to(dtype)
        for i, piece in zip(idx, flat.split([grads[i].numel() for i in idx])):
            out[i] = piece.view(grads[i].shape)
    return out


def _skip_if_nonfinite(scale: Tensor, found_inf: Tensor | None) -> Tensor:
    """found_inf (0-d float32, 1.0 = skip) raised to 1.0 when ``scale`` is not finite (no sync)."""
    bad = (~torch.isfinite(scale)).to(torch.float32)
    return bad if found_inf is None else torch.maximum(found_inf.to(bad.device, torch.float32), bad)


def _check_same_keys(params: Mapping[str, Tensor], other: Mapping[str, Tensor], what: str) -> None:
    if len(params) != len(other) or any(n not in other for n in params):
        missing = [n for n in params if n not in other]
        extra = [n for n in other if n not in params]
        raise ValueError(f"{what} do not match the parameters: missing {missing[:5]}, unexpected {extra[:5]}")


def _check_schedule(peak: float, warmup: int, total: int, final: float, fn: str) -> None:
    if not (isinstance(peak, int | float) and peak >= 0):
        raise ValueError(f"{fn}: peak must be a number >= 0, got {peak!r}")
    if not (isinstance(final, int | float) and final >= 0):
        raise ValueError(f"{fn}: final must be a number >= 0, got {final!r}")
    if not (isinstance(warmup, int) and warmup >= 0):
        raise ValueError(f"{fn}: warmup must be an int >= 0, got {warmup!r}")
    if not (isinstance(total, int) and total >= warmup):
        raise ValueError(f"{fn}: total must be an int >= warmup ({warmup}), got {total!r}")
