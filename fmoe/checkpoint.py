"""Checkpoints: safetensors keyed by global parameter names, written atomically, with trainer state.

A checkpoint directory holds one folder per saved step:

    <dir>/step_00001000/
        model.safetensors     params: {global parameter name: tensor}, dtypes kept, contiguous
        optim.safetensors     the optimizer state as a flat dict (``fmoe.optim.state_to_flat``)
        trainer.json          {"step": N, ...trainer_state}: data cursor, RNG states, anything JSON

A folder is first written as ``<dir>/.tmp-step_<N>-<pid>-<id>``, every file and the folder fsynced,
then renamed to ``step_<N>``: a ``step_*`` folder is always complete, and a crash mid-write leaves
the previous checkpoints as they were. Nothing here knows the parallel layout: callers save and load
whole tensors under global names (gathered / sliced by the caller), so a run can resume on another.
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import shutil
import uuid
import warnings
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

MODEL, OPTIM, TRAINER = "model.safetensors", "optim.safetensors", "trainer.json"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed; its partial folder was removed, earlier checkpoints are intact."""


def save(
    dir: str | os.PathLike,
    step: int,
    params: Mapping[str, torch.Tensor],
    opt_state_flat: Mapping[str, torch.Tensor],
    trainer_state: Mapping[str, Any],
    keep: int = 3,
) -> Path:
    """Write ``<dir>/step_<step:08d>/`` atomically and keep only the newest ``keep`` checkpoints.

    params / opt_state_flat: flat ``{name: tensor}`` (any device; saved from CPU copies).
    trainer_state: JSON-able dict (data cursor, ``capture_rng()``, ...); "step" is added.
    Returns the checkpoint's path. ValueError for bad arguments (before anything is written);
    CheckpointWriteError (chaining the cause) if writing fails.
    """
    if not (isinstance(step, int) and step >= 0):
        raise ValueError(f"checkpoint save: step must be an int >= 0, got {step!r}")
    if not (isinstance(keep, int) and keep >= 1):
        raise ValueError(f"checkpoint save: keep must be an int >= 1, got {keep!r}")
    if "step" in trainer_state and trainer_state["step"] != step:
        raise ValueError(
            f"checkpoint save: trainer_state['step'] = {trainer_state['step']!r} differs from step {step}"
        )
    text = _to_json({**trainer_state, "step": step})
    model = _saveable(params, "params")
    optim = _saveable(opt_state_flat, "opt_state_flat")

    root = Path(dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    old = None
    try:
        tmp.mkdir()
        meta = {"fmoe_step": str(step)}
        _write_tensors(tmp / MODEL, model, {**meta, "fmoe_content": "model"})
        _write_tensors(tmp / OPTIM, optim, {**meta, "fmoe_content": "optim"})
        with open(tmp / TRAINER, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists():  # saving a step again (e.g. after a resume): swap, then drop the old folder
            old = root / f".tmp-old-{final.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
        os.rename(tmp, final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and old.exists() and not final.exists():
            os.rename(old, final)  # put back the checkpoint we were replacing
        if isinstance(e, Exception):
            raise CheckpointWriteError(
                f"writing checkpoint {final} failed ({type(e).__name__}: {e}); the partial folder was removed"
                + (f", {latest(root)} is intact" if latest(root) else "")
            ) from e
        raise
    _fsync_dir(root)  # make the rename durable
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    for stale in list_checkpoints(root)[:-keep]:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def list_checkpoints(dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoint folders under ``dir``, oldest step first; temp folders are ignored."""
    root = Path(dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and all((p / f).is_file() for f in (MODEL, OPTIM, TRAINER)):
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest(dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint folder under ``dir``, or None."""
    found = list_checkpoints(dir)
    return found[-1] if found else None


def load(
    path: str | os.PathLike,
    *,
    expected_keys: Collection[str] | None = None,
    expected_optim_keys: Collection[str] | None = None,
    device: str | torch.device = "cpu",
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
    """Read a checkpoint folder: ``(params, opt_state_flat, trainer_state)``.

    expected_keys / expected_optim_keys: when given, the files must hold exactly those names.
    Errors are one line naming the file: FileNotFoundError when missing, ValueError when truncated,
    corrupt or holding other keys.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint {folder} does not exist")
    params = _read_tensors(folder / MODEL, expected_keys, device)
    optim = _read_tensors(folder / OPTIM, expected_optim_keys, device)
    trainer_file = folder / TRAINER
    if not trainer_file.is_file():
        raise FileNotFoundError(f"{trainer_file}: missing")
    try:
        trainer = json.loads(trainer_file.read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:
        raise ValueError(f"{trainer_file}: corrupt JSON ({e})") from e
    if not isinstance(trainer, dict) or not isinstance(trainer.get("step"), int):
        raise ValueError(f"{trainer_file}: expected a JSON object with an int 'step'")
    return params, optim, trainer


# --------------------------------------------------------------------------------------------------
# RNG states as JSON


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
        raise ValueError(f"RNG state field {field!r} is malformed ({type(e).__name__}: {e})") from e


# --------------------------------------------------------------------------------------------------
# helpers


def _write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write one safetensors file and fsync it (tests replace this to simulate a crash)."""
    save_file(tensors, str(path), metadata=metadata)
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _read_tensors(
    file: Path, expected: Collection[str] | None, device: str | torch.device
) -> dict[str, torch.Tensor]:
    if not file.is_file():
        raise FileNotFoundError(f"{file}: missing")
    try:
        tensors = load_file(str(file), device=str(device))
    except Exception as e:  # safetensors raises its own SafetensorError for a bad header or length
        raise ValueError(f"{file}: truncated or corrupt safetensors file ({type(e).__name__}: {e})") from e
    if expected is not None:
        want = set(expected)
        missing, unexpected = sorted(want - tensors.keys()), sorted(tensors.keys() - want)
        if missing or unexpected:
            raise ValueError(
                f"{file}: keys do not match: {len(missing)} missing {missing[:5]}, "
                f"{len(unexpected)} unexpected {unexpected[:5]}"
            )
    return tensors


def _saveable(tensors: Mapping[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
    """CPU, contiguous, storage-disjoint copies (safetensors refuses tensors sharing memory)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in tensors.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise ValueError(f"checkpoint save: {what} entry {name!r} is not a str -> Tensor pair")
        t = t.detach().to("cpu").contiguous()
        if t.numel() and t.untyped_storage().data_ptr() in seen:
            t = t.clone()  # tied weights: saved twice, loaded as two tensors
        if t.numel():
            seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def _to_json(state: Mapping[str, Any]) -> str:
    try:
        return json.dumps(state, indent=1, allow_nan=False)
    except (TypeError, ValueError):
        for key, value in state.items():
            try:
                json.dumps(value, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise ValueError(f"checkpoint save: trainer_state[{key!r}] is not JSON-able ({e})") from e
        raise


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)
