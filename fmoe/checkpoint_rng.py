"""RNG states as JSON, for a checkpoint's trainer state: :func:`capture_rng` / :func:`restore_rng`
(Python, numpy's global, torch CPU and the current CUDA device's)."""

from __future__ import annotations

import base64
import random
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from fmoe.checkpoint_format import CheckpointError

__all__ = ["capture_rng", "restore_rng"]


def capture_rng() -> dict[str, Any]:
    """Python, numpy (global) and torch CPU RNG states, plus the current CUDA device's when CUDA is
    initialized, as a JSON-able dict (torch states base64-encoded)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "keys": keys.tolist(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = _b64(torch.cuda.get_rng_state())
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Restore what :func:`capture_rng` captured (the CUDA state onto the current device; warns and
    skips it without CUDA). ValueError naming the field for a malformed state."""
    try:
        field = "python"
        py = state["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
        field = "numpy"
        n = state["numpy"]
        np.random.set_state(
            (n["kind"], np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached"])
        )
        field = "torch"
        torch.set_rng_state(_unb64(state["torch"]))
        field = "cuda"
        if "cuda" in state:
            if torch.cuda.is_available():
                torch.cuda.set_rng_state(_unb64(state["cuda"]))
            else:
                warnings.warn(
                    "RNG state holds a CUDA state but CUDA is not available: not restored", stacklevel=2
                )
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"RNG state field {field!r} is malformed ({type(e).__name__}: {e})") from e


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)
