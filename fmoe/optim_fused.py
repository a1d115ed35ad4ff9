"""AdamW's fast path: one step over a params dict on fused kernels, in place, gradients in any float dtype.

:func:`fmoe.optim.adamw`'s ``step`` is :func:`adamw_step_`; its ``update`` is that step run on a copy
of the params. Which kernel takes a parameter:

- fp32 params whose gradients come in another float dtype (bf16 out of a bf16 model), or with a
  ``grad_scale`` to fold in (the clip factor), take ``fmoe.kernels.adamw``: one Triton pass per
  tensor that reads the gradient as it is and folds the scale in (no fp32 copy, no scaling pass);
  bit for bit ``torch._fused_adamw_`` on the fp32 copy with torch 2.11
  (benchmarks/results/adamw_bitwise_h200.json). It runs on CUDA, or on CPU under TRITON_INTERPRET=1,
  for tensors of at least :data:`KERNEL_MIN_NUMEL` elements.
- everything else takes ``torch._fused_adamw_`` (the kernel of ``torch.optim.AdamW(fused=True)``),
  one multi-tensor launch per (device, dtype, decay) group: gradients of another dtype are
  converted first in one cat per group, and a ``grad_scale`` is applied in a pass of its own.

Step times of both routes against torch's: benchmarks/bench_optim.py, results in
benchmarks/results/optim_h200*.json.

Nothing here syncs with the host: the step count, the learning rate, the scale and the skip flag
are device tensors (or python numbers).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from fmoe.kernels import adamw as adamw_kernel
from fmoe.kernels._triton import use_triton

__all__ = ["KERNEL_MIN_NUMEL", "adamw_step_", "group_by_device_dtype"]

# Below this many elements a tensor's gradient takes the copy route even where fmoe's kernel runs:
# a Triton launch costs tens of microseconds of host time, more than the kernel's GPU time for a
# tensor this small, so one launch per small tensor leaves the GPU waiting on the host; the copy
# route converts all such gradients in one cat and steps them in torch's multi-tensor kernel
# (benchmarks/results/optim_h200_small.json against optim_h200_small_launch_each.json). Tests set
# it to 0 to run the kernel on small tensors.
KERNEL_MIN_NUMEL = 1 << 22


def adamw_step_(
    params: dict[str, Tensor],
    grads: Mapping[str, Tensor],
    state: Mapping[str, Tensor],
    step: Tensor,
    lr: float | Tensor,
    *,
    b1: float,
    b2: float,
    eps: float,
    weight_decay: float,
    decays: Callable[[str], bool],
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """One AdamW step (``fmoe.optim.adamw``'s math), in place, on the params and the moments
    ``exp_avg/<name>``, ``exp_avg_sq/<name>`` of ``state``. step: the 1-based step, 0-d float32.
    lr: a number or 0-d float32. decays(name): weight decay or not. grad_scale: None or 0-d float32,
    the gradients' factor. found_inf: None or 0-d float32 on step's device; 1.0 changes nothing."""
    # Step 1: split the parameters between the two kernels (the fused kernels reject empty tensors)
    names = [n for n, p in params.items() if p.numel() > 0]
    own = [n for n in names if _takes_fmoe_kernel(params[n], grads[n], state, n, grad_scale)]
    mine = set(own)
    rest = [n for n in names if n not in mine]
    hyper = {"beta1": b1, "beta2": b2, "eps": eps}

    # Step 2: fmoe's kernel reads the gradients as they are and folds grad_scale in
    for (device, _dtype), group in group_by_device_dtype(params, own).items():
        on_device = _OnDevice(device, step, lr, grad_scale, found_inf)
        for sub, wd in _by_decay(group, decays, weight_decay):
            adamw_kernel.adamw_(
                *_tensor_lists(params, grads, state, sub),
                step=on_device.step,
                lr=on_device.lr,
                weight_decay=wd,
                grad_scale=on_device.grad_scale,
                found_inf=on_device.found_inf,
                **hyper,
            )

    # Step 3: torch's fused kernel, on gradients converted to the params' dtype and scaled first.
    # The plain case (gradients in the params' dtype, no scale) is torch.optim.AdamW(fused=True)
    # by construction, one launch per group where fmoe's kernel launches once per tensor.
    for (device, dtype), group in group_by_device_dtype(params, rest).items():
        on_device = _OnDevice(device, step, lr, grad_scale, found_inf)
        converted = dict(zip(group, _to_dtype([grads[n] for n in group], [params[n] for n in group])))
        if grad_scale is not None:  # e.g. bf16 params: scale in a pass of its own, in their dtype
            torch._foreach_mul_(list(converted.values()), grad_scale.to(device=device, dtype=dtype))
        for sub, wd in _by_decay(group, decays, weight_decay):
            torch._fused_adamw_(
                *_tensor_lists(params, converted, state, sub),
                [],
                [on_device.step] * len(sub),
                lr=on_device.lr,
                weight_decay=wd,
                amsgrad=False,
                maximize=False,
                found_inf=on_device.found_inf,
                **hyper,
            )


def group_by_device_dtype(
    tensors: Mapping[str, Tensor], names: list[str]
) -> dict[tuple[torch.device, torch.dtype], list[str]]:
    """Names grouped by (device, dtype): foreach/fused kernels take one device and dtype per call."""
    groups: dict[tuple[torch.device, torch.dtype], list[str]] = {}
    for n in names:
        t = tensors[n]
        groups.setdefault((t.device, t.dtype), []).append(n)
    return groups


class _OnDevice:
    """The step's scalars moved to one device: step, lr (a python lr stays python), grad_scale and
    found_inf as float32 (None stays None)."""

    def __init__(
        self,
        device: torch.device,
        step: Tensor,
        lr: float | Tensor,
        grad_scale: Tensor | None,
        found_inf: Tensor | None,
    ):
        self.step = step.to(device)
        self.lr = lr.to(device=device, dtype=torch.float32) if isinstance(lr, Tensor) else lr
        self.grad_scale = None if grad_scale is None else grad_scale.to(device=device, dtype=torch.float32)
        self.found_inf = None if found_inf is None else found_inf.to(device)


def _by_decay(
    group: list[str], decays: Callable[[str], bool], weight_decay: float
) -> list[tuple[list[str], float]]:
    """The group split by weight decay: (names, weight_decay) and (names, 0.0), empty parts left out."""
    parts = (([n for n in group if decays(n)], weight_decay), ([n for n in group if not decays(n)], 0.0))
    return [(sub, wd) for sub, wd in parts if sub]


def _tensor_lists(
    params: Mapping[str, Tensor], grads: Mapping[str, Tensor], state: Mapping[str, Tensor], names: list[str]
) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor]]:
    """The fused kernels' first four arguments: params, grads, exp_avgs, exp_avg_sqs of ``names``."""
    return (
        [params[n] for n in names],
        [grads[n] for n in names],
        [state[f"exp_avg/{n}"] for n in names],
        [state[f"exp_avg_sq/{n}"] for n in names],
    )


def _takes_fmoe_kernel(
    p: Tensor, g: Tensor, state: Mapping[str, Tensor], name: str, grad_scale: Tensor | None
) -> bool:
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
