"""Checkpoints: safetensors keyed by global parameter names, written atomically, with trainer state.

A checkpoint directory holds one folder per saved step:

    <dir>/step_00001000/
        model.safetensors     params: {global parameter name: tensor}, dtypes kept, contiguous
        optim.safetensors     the optimizer state as a flat dict (``fmoe.optim.state_to_flat``)
        trainer.json          {"step": N, ...trainer_state}: data cursor, RNG states, anything JSON
        manifest.json         {"format": 1, "files": {file name: {"bytes": n, "sha256": hex}}}

A folder is first written as ``<dir>/.tmp-step_<N>-<pid>-<id>``, every file and the folder fsynced,
then renamed to ``step_<N>``: a ``step_*`` folder is always complete, and a crash mid-write leaves
the previous checkpoints as they were (and a ``.tmp-*`` folder that :func:`clean_temp` removes at the
next start). Old checkpoints are dropped by renaming them to ``.tmp-drop-*`` first, so a crash while
deleting one leaves no half-deleted ``step_*`` folder. Non-finite tensors are never written.

Integrity: the manifest records each file's SHA-256 (hashed from the bytes on disk after the write),
and :func:`load` verifies it before reading: a flipped bit or a truncated file is a
:class:`CorruptCheckpointError` naming the file; :func:`newest_intact` picks the newest checkpoint
that verifies. Nothing here knows the parallel layout: callers save and load whole tensors under
global names (gathered / sliced by the caller), so a run can resume on another.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import re
import shutil
import uuid
import warnings
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

MODEL, OPTIM, TRAINER = "model.safetensors", "optim.safetensors", "trainer.json"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_MOVED_ASIDE = re.compile(r"^\.tmp-old-(step_\d{8,})-[0-9a-f]+$")


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed; its partial folder was removed, earlier checkpoints are intact."""


class CorruptCheckpointError(ValueError):
    """A checkpoint's file does not match its recorded checksum, or cannot be parsed; the message
    names the file. An older checkpoint may still be intact (:func:`newest_intact`)."""


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
    Returns the checkpoint's path. ValueError for bad arguments or a non-finite floating tensor
    (before anything is written); CheckpointWriteError (chaining the cause) if writing fails, e.g.
    a full disk: the partial folder is removed and the earlier checkpoints are left as they were.
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
        _write_text(tmp / TRAINER, text)
        files = {name: {"bytes": (tmp / name).stat().st_size, "sha256": file_sha256(tmp / name)}
                 for name in (MODEL, OPTIM, TRAINER)}  # fmt: skip
        _write_text(tmp / MANIFEST, json.dumps({"format": MANIFEST_FORMAT, "files": files}, indent=1))
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
        _drop(stale)
    return final


def clean_temp(dir: str | os.PathLike) -> list[str]:
    """Tidy what a killed writer left under ``dir``; returns one line per action, for a log.

    A ``.tmp-old-step_N-*`` folder whose ``step_N`` is missing is the checkpoint a crashed save was
    replacing: it is renamed back. Every other ``.tmp-*`` folder (a partial write, a half-deleted
    old checkpoint) is removed. Call it before a run writes, from one process only.
    """
    root = Path(dir)
    if not root.is_dir():
        return []
    done = []
    for p in sorted(root.iterdir()):
        moved = _MOVED_ASIDE.match(p.name)
        if moved and p.is_dir() and not (root / moved.group(1)).exists():
            os.rename(p, root / moved.group(1))
            done.append(f"restored {root / moved.group(1)} from {p.name}")
        elif p.name.startswith(".tmp-"):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            done.append(f"removed {p}")
    if done:
        _fsync_dir(root)
    return done


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


def verify(path: str | os.PathLike) -> bool:
    """Check every file of a checkpoint folder against its manifest's size and SHA-256.

    Returns True when verified, False for a folder without a manifest (written before checksums
    existed: nothing to verify against). FileNotFoundError naming a missing file;
    CorruptCheckpointError naming the first file that differs (or a corrupt manifest).
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint {folder} does not exist")
    manifest_file = folder / MANIFEST
    if not manifest_file.is_file():
        return False
    try:
        manifest = json.loads(manifest_file.read_text(encoding="utf-8"))
        files = manifest["files"]
        expected = {
            name: (int(files[name]["bytes"]), str(files[name]["sha256"])) for name in (MODEL, OPTIM, TRAINER)
        }
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise CorruptCheckpointError(f"{manifest_file}: corrupt manifest ({type(e).__name__}: {e})") from e
    for name, (size, digest) in expected.items():
        file = folder / name
        if not file.is_file():
            raise FileNotFoundError(f"{file}: missing")
        got = file.stat().st_size
        if got != size:
            raise CorruptCheckpointError(
                f"{file}: {got} bytes, the manifest records {size} (truncated or corrupt)"
            )
        if file_sha256(file) != digest:
            raise CorruptCheckpointError(f"{file}: SHA-256 differs from the manifest's (corrupt)")
    return True


def newest_intact(dir: str | os.PathLike) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint under ``dir`` that verifies (:func:`verify`), and the newer ones that
    did not, each with the reason (newest first). (None, [...]) when none is intact."""
    rejected: list[tuple[Path, str]] = []
    for path in reversed(list_checkpoints(dir)):
        try:
            verify(path)
            return path, rejected
        except (CorruptCheckpointError, FileNotFoundError) as e:
            rejected.append((path, str(e)))
    return None, rejected


def load(
    path: str | os.PathLike,
    *,
    expected_keys: Collection[str] | None = None,
    expected_optim_keys: Collection[str] | None = None,
    expected_shapes: Mapping[str, Sequence[int]] | None = None,
    expected_optim_shapes: Mapping[str, Sequence[int]] | None = None,
    device: str | torch.device = "cpu",
    check_integrity: bool = True,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
    """Read a checkpoint folder: ``(params, opt_state_flat, trainer_state)``.

    expected_keys / expected_optim_keys: when given, the files must hold exactly those names.
    expected_shapes: {name: shape}: the model file must hold exactly those names, with those shapes.
    expected_optim_shapes: {key: shape}: those optimizer keys, where present, must have those shapes.
    check_integrity: verify the files against the manifest first (False: the caller just did).
    Errors are one line naming the file: FileNotFoundError when missing, CorruptCheckpointError
    (a ValueError) when a checksum differs or a file does not parse, ValueError naming the tensor,
    the checkpoint's shape and the expected one for a shape mismatch, ValueError for other keys.
    """
    folder = Path(path)
    if check_integrity:
        verify(folder)
    elif not folder.is_dir():
        raise FileNotFoundError(f"checkpoint {folder} does not exist")
    if expected_shapes is not None:
        expected_keys = list(expected_shapes)
    params = _read_tensors(folder / MODEL, expected_keys, device)
    optim = _read_tensors(folder / OPTIM, expected_optim_keys, device)
    _check_shapes(folder / MODEL, params, expected_shapes or {})
    _check_shapes(
        folder / OPTIM, optim, {k: v for k, v in (expected_optim_shapes or {}).items() if k in optim}
    )
    trainer_file = folder / TRAINER
    if not trainer_file.is_file():
        raise FileNotFoundError(f"{trainer_file}: missing")
    try:
        trainer = json.loads(trainer_file.read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:
        raise CorruptCheckpointError(f"{trainer_file}: corrupt JSON ({e})") from e
    if not isinstance(trainer, dict) or not isinstance(trainer.get("step"), int):
        raise CorruptCheckpointError(f"{trainer_file}: expected a JSON object with an int 'step'")
    return params, optim, trainer


def file_sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes, read in 8 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


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


def _check_shapes(
    file: Path, tensors: Mapping[str, torch.Tensor], shapes: Mapping[str, Sequence[int]]
) -> None:
    for name, want in shapes.items():
        got = tuple(tensors[name].shape)
        if got != tuple(want):
            raise ValueError(
                f"{file}: tensor {name!r} has shape {got} in the checkpoint, the recipe needs {tuple(want)} "
                f"(a checkpoint of another model: point checkpoint.dir elsewhere or restore the model sizes)"
            )


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _drop(folder: Path) -> None:
    """Delete a checkpoint folder: renamed to ``.tmp-drop-*`` first (atomic), so a crash midway
    leaves a temp folder for :func:`clean_temp`, never a half-deleted ``step_*``."""
    doomed = folder.with_name(f".tmp-drop-{folder.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(folder, doomed)
    except OSError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


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
        raise CorruptCheckpointError(
            f"{file}: truncated or corrupt safetensors file ({type(e).__name__}: {e})"
        ) from e
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
    """CPU, contiguous, storage-disjoint copies (safetensors refuses tensors sharing memory);
    ValueError naming the first floating tensor holding a NaN or an infinity."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in tensors.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise ValueError(f"checkpoint save: {what} entry {name!r} is not a str -> Tensor pair")
        t = t.detach().to("cpu").contiguous()
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(
                f"checkpoint save: {what}[{name!r}] holds non-finite values; nothing was written"
            )
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
