"""Hugging Face checkpoints: export fmoe params to a folder transformers loads, and import back.

A family module in ``fmoe.stages`` supplies the pure conversions (``to_hf``, ``from_hf``,
``hf_config``, ``config_from_hf``); this module does the files: ``config.json`` and
``model.safetensors``, written atomically.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from types import ModuleType

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from fmoe.stages import deepseek_v2, gpt_oss, qwen3_moe

FAMILIES: dict[str, ModuleType] = {"qwen3_moe": qwen3_moe, "deepseek_v2": deepseek_v2, "gpt_oss": gpt_oss}


def family(name: str) -> ModuleType:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[name]


def export_hf(
    family_name: str, cfg, params: dict[str, Tensor], out_dir: str | Path, dtype: torch.dtype | None = None
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` for transformers; returns the folder."""
    fam = family(family_name)
    out_dir = Path(out_dir)
    tensors = {
        k: (v.to(dtype) if dtype else v).detach().cpu().contiguous()
        for k, v in fam.to_hf(cfg, params).items()
    }
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        config = fam.hf_config(cfg)
        config["torch_dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def import_hf(folder: str | Path, family_name: str | None = None) -> tuple[str, object, dict[str, Tensor]]:
    """Read a Hugging Face folder (config.json + one or more *.safetensors) -> (family, config, params).

    Nothing is guessed or dropped: every config.json key must be one the family honours or knows to
    be harmless (``HF_HONOURED_FIELDS`` / ``HF_PINNED_FIELDS`` / ``HF_METADATA_FIELDS`` of its
    module), and every tensor must be one the config implies, at the shape it implies. Any other
    case raises a one-line ValueError naming the file and the key or tensor.
    """
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path}: no config.json in the Hugging Face folder")
    try:
        hf = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path}: not valid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{config_path}: not a JSON object")
    model_type = hf.get("model_type")
    if family_name is not None and model_type is not None and model_type != family_name:
        raise ValueError(
            f"{config_path}: model_type {model_type!r} is not the family asked for, {family_name!r}"
        )
    name = family_name or model_type
    if name is None:
        raise ValueError(f"{config_path}: no model_type (known: {sorted(FAMILIES)})")
    fam = family(name)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    try:
        cfg = fam.config_from_hf(hf)
    except ValueError as e:
        raise ValueError(f"{config_path}: {e}") from None
    tensors: dict[str, Tensor] = {}
    for f in files:
        try:
            loaded = load_file(f)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{f}: unreadable safetensors file ({e})") from None
        twice = sorted(set(loaded) & set(tensors))
        if twice:
            raise ValueError(f"{f}: tensor {twice[0]!r} is also in another *.safetensors file of the folder")
        tensors.update(loaded)
    try:
        return name, cfg, fam.from_hf(cfg, tensors)
    except KeyError as e:
        raise ValueError(f"{folder}: {e.args[0]}") from None
    except ValueError as e:
        raise ValueError(f"{folder}: {e}") from None
