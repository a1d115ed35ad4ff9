"""AdamW composed of three small transformations, as optax defines it: the reference for the fused step.

    adamw(lr, b1, b2, eps, weight_decay, mask) = chain(scale_by_adam(b1, b2, eps),
                                                       add_decayed_weights(weight_decay, mask),
                                                       scale_by_learning_rate(lr))

Per element, with t the 1-based step, lr_t = lr(t - 1) and g the gradient in the moments' dtype:

    scale_by_adam:           m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
                             u  = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
    add_decayed_weights:     u <- u + wd p                       (where the mask says decay)
    scale_by_learning_rate:  u <- -lr_t u

so ``apply_updates`` gives p + u = p (1 - lr_t wd) - lr_t adam, the update of ``torch.optim.AdamW``
and of :func:`fmoe.optim.adamw`, whose fused step (``fmoe.optim_fused``) is tested against this one
in tests/test_optim.py. The roundings happen in another order, so the two agree to float32 rounding,
not bit for bit. Plain elementwise torch, one tensor at a time: slow, and written to be read.

State keys: ``step``, ``exp_avg/<name>``, ``exp_avg_sq/<name>`` (as the fused adamw's) and
``lr_step`` (the steps the learning rate has seen; each member keeps its own count, as in optax).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from fmoe.lr_schedules import Schedule
from fmoe.optim import GradientTransformation, Params, State, chain

__all__ = ["adamw", "add_decayed_weights", "scale_by_adam", "scale_by_learning_rate"]


def adamw(
    lr: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    mask: Callable[[str], bool] | Mapping[str, bool] | None = None,
) -> GradientTransformation:
    """AdamW as a chain; the arguments are :func:`fmoe.optim.adamw`'s."""
    return chain(
        scale_by_adam(b1, b2, eps), add_decayed_weights(weight_decay, mask), scale_by_learning_rate(lr)
    )


def scale_by_adam(b1: float, b2: float, eps: float) -> GradientTransformation:
    """Updates -> Adam's bias-corrected direction ``m_hat / (sqrt(v_hat) + eps)``."""

    @torch.no_grad()
    def init(params: Params) -> State:
        state = {"step": torch.zeros((), dtype=torch.float32, device=_device_of(params))}
        for name, p in params.items():
            state[f"exp_avg/{name}"] = torch.zeros_like(p)
            state[f"exp_avg_sq/{name}"] = torch.zeros_like(p)
        return state

    @torch.no_grad()
    def update(updates: Params, state: State, params: Params | None = None) -> tuple[Params, State]:
        t = state["step"] + 1
        out, new = {}, {"step": t}
        for name, u in updates.items():
            m, v = state[f"exp_avg/{name}"], state[f"exp_avg_sq/{name}"]
            g = u.to(m.dtype)
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
            out[name] = m_hat / (v_hat.sqrt() + eps)
            new[f"exp_avg/{name}"], new[f"exp_avg_sq/{name}"] = m, v
        return out, {**state, **new}

    return GradientTransformation(init, update)


def add_decayed_weights(
    weight_decay: float, mask: Callable[[str], bool] | Mapping[str, bool] | None = None
) -> GradientTransformation:
    """Updates -> ``u + weight_decay * p`` for the parameters the mask marks (None: all); no state."""

    def decays(name: str) -> bool:
        return True if mask is None else bool(mask(name) if callable(mask) else mask[name])

    @torch.no_grad()
    def update(updates: Params, state: State, params: Params | None = None) -> tuple[Params, State]:
        if params is None:
            raise ValueError("add_decayed_weights: update needs params")
        out = {n: u + weight_decay * params[n] if decays(n) else u for n, u in updates.items()}
        return out, state

    return GradientTransformation(lambda params: {}, update)


def scale_by_learning_rate(lr: float | Schedule) -> GradientTransformation:
    """Updates -> ``-lr_t * u``, lr_t the constant or ``lr(steps done before this one)``."""

    @torch.no_grad()
    def init(params: Params) -> State:
        return {"lr_step": torch.zeros((), dtype=torch.float32, device=_device_of(params))}

    @torch.no_grad()
    def update(updates: Params, state: State, params: Params | None = None) -> tuple[Params, State]:
        count = state["lr_step"]
        lr_t = lr(count) if callable(lr) else lr
        return {n: -lr_t * u for n, u in updates.items()}, {**state, "lr_step": count + 1}

    return GradientTransformation(init, update)


def _device_of(params: Params) -> torch.device:
    return next(iter(params.values())).device if params else torch.device("cpu")
