"""Rotary positions, plain or YaRN-scaled, and their Hugging Face config forms (shared by families).

``rope_scaling`` is None (plain RoPE) or a validated YaRN table (``check_rope_scaling``);
``rotary_inv_freq`` gives the frequencies and the cos/sin magnitude factor as transformers computes
them; ``rope_parameters`` / ``rope_from_hf`` write and read transformers 5's ``rope_parameters``
(and the hub's older ``rope_theta`` + ``rope_scaling``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

YARN_KEYS = (
    "rope_type",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
)


def check_rope_scaling(rs: Mapping | None, where: str) -> dict | None:
    """None or a validated YaRN dict (``type`` renamed ``rope_type``); errors name ``where``.key."""
    if rs is None:
        return None
    if not isinstance(rs, Mapping):
        raise ValueError(f"{where} must be a table or None, got {type(rs).__name__}")
    rs = dict(rs)
    if "type" in rs:
        rs.setdefault("rope_type", rs.pop("type"))
    unknown = sorted(set(rs) - set(YARN_KEYS))
    if unknown:  # checked for "default" too: a key such as partial_rotary_factor changes plain RoPE
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(YARN_KEYS)})")
    if rs.get("rope_type") == "default":
        return None
    if rs.get("rope_type") != "yarn":
        raise ValueError(f"{where}.rope_type must be 'yarn' (or 'default'), got {rs.get('rope_type')!r}")
    for key in ("factor", "original_max_position_embeddings"):
        if not isinstance(rs.get(key), int | float) or rs[key] <= 0:
            raise ValueError(f"{where}.{key} must be a number > 0, got {rs.get(key)!r}")
    return rs


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rotary_inv_freq(
    dim: int, theta: float, rope_scaling: Mapping | None, device: torch.device | str = "cpu"
) -> tuple[Tensor, float]:
    """(inv_freq [dim/2] float32 on ``device``, attention_factor): plain RoPE, or YaRN's blend of
    interpolated and extrapolated frequencies with its cos/sin magnitude factor (the formulas
    transformers uses). Made on the device that uses it: a step under CUDA graphs may not copy a
    host tensor to the device (a graph would replay the copy from memory that is gone)."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    if rope_scaling is None:
        return 1.0 / pos_freqs, 1.0
    rs = rope_scaling
    factor, original = rs["factor"], rs["original_max_position_embeddings"]
    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dim index that turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


def rotary_angles(
    positions: Tensor, dim: int, theta: float, rope_scaling: Mapping | None
) -> tuple[Tensor, float]:
    """(angles [..., dim/2] float32 for integer ``positions`` [...], attention_factor)."""
    inv_freq, factor = rotary_inv_freq(dim, theta, rope_scaling, positions.device)
    return positions[..., None].to(torch.float32) * inv_freq, factor


def compute_dtype(x: Tensor) -> torch.dtype:
    """At least float32: the dtype rotary and softmax math runs in for ``x``."""
    return torch.promote_types(x.dtype, torch.float32)


def rotate_pairs(x: Tensor, angles: Tensor, factor: float) -> Tensor:
    """Rotate consecutive pairs (x[2i], x[2i+1]) of x [b, heads, s, d] by angles [b|1, s, d/2],
    scaled by ``factor``; computed in at least float32 (transformers' complex form), cast back."""
    dtype = compute_dtype(x)
    cos = (angles.cos() * factor).to(dtype)[:, None]
    sin = (angles.sin() * factor).to(dtype)[:, None]
    pairs = x.to(dtype).unflatten(-1, (-1, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    out = torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


def batch_angles(angles: Tensor) -> Tensor:
    """angles [s, d/2] (shared positions) -> [1, s, d/2]; [b, s, d/2] as it is."""
    return angles if angles.dim() == 3 else angles[None]


def rope_parameters(theta: float, rope_scaling: Mapping | None) -> dict:
    """transformers 5's ``rope_parameters`` from our rope_theta + rope_scaling."""
    if rope_scaling is None:
        return {"rope_type": "default", "rope_theta": theta}
    return {**rope_scaling, "rope_theta": theta}


def rope_from_hf(hf: Mapping, default_theta: float) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from a config.json: transformers 5's ``rope_parameters`` or the
    hub's older ``rope_theta`` + ``rope_scaling``; ValueError when the two forms disagree."""
    rp = hf.get("rope_parameters")
    if isinstance(rp, Mapping):
        rp = dict(rp)
        theta = rp.pop("rope_theta", hf.get("rope_theta", default_theta))
        if "rope_theta" in hf and hf["rope_theta"] != theta:
            raise ValueError(
                f"config.json fields 'rope_theta' ({hf['rope_theta']}) and 'rope_parameters.rope_theta' "
                f"({theta}) disagree"
            )
        scaling = check_rope_scaling(rp, "config.json rope_parameters")
        legacy = check_rope_scaling(hf.get("rope_scaling"), "config.json rope_scaling")
        if legacy is not None and legacy != scaling:
            raise ValueError("config.json fields 'rope_scaling' and 'rope_parameters' disagree")
        return theta, scaling
    if rp is not None:
        raise ValueError(f"config.json field 'rope_parameters' must be a table, got {rp!r}")
    return hf.get("rope_theta", default_theta), check_rope_scaling(
        hf.get("rope_scaling"), "config.json rope_scaling"
    )
