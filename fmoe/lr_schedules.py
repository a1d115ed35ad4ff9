"""Learning-rate schedules for :func:`fmoe.optim.adamw` (importable from ``fmoe.optim`` too).

A schedule maps the number of optimizer steps done so far to a learning rate: a python int gives a
python float (for logs and plots), a 0-d tensor gives a 0-d float32 tensor on the tensor's device,
so the training loop evaluates it on the device without a host sync. ``s`` counts the steps done
before the current one (0 for the first step). Both branches compute the same function; tests
check that they agree and hit their endpoints.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["Schedule", "warmup_cosine", "warmup_stable_decay"]

# A schedule maps the number of steps done so far (python int, or a 0-d tensor) to a learning rate
# (python float for an int, 0-d float32 tensor on the step's device for a tensor).
Schedule = Callable[[int | Tensor], float | Tensor]


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


def _check_schedule(peak: float, warmup: int, total: int, final: float, fn: str) -> None:
    if not (isinstance(peak, int | float) and peak >= 0):
        raise ValueError(f"{fn}: peak must be a number >= 0, got {peak!r}")
    if not (isinstance(final, int | float) and final >= 0):
        raise ValueError(f"{fn}: final must be a number >= 0, got {final!r}")
    if not (isinstance(warmup, int) and warmup >= 0):
        raise ValueError(f"{fn}: warmup must be an int >= 0, got {warmup!r}")
    if not (isinstance(total, int) and total >= warmup):
        raise ValueError(f"{fn}: total must be an int >= warmup ({warmup}), got {total!r}")
