"""Recipes: a TOML file -> frozen dataclasses, validated once with errors that name the field.

[model]      family and the family's config fields (Hugging Face names)
[data]       dataset folder, tokenizer, sequence length, what to build it from if missing
[train]      steps, batch sizes, seed, dtype, device
[optim]      AdamW, clipping, learning-rate schedule
[parallel]   pp, dp, cp, ep sizes and the pipeline schedule (a generator name or a CSV file)
[checkpoint] folder, interval, how many to keep
[log]        folder, interval
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class RecipeError(ValueError):
    """A recipe that cannot run; the message names the file and the field."""


@dataclass(frozen=True)
class DataConfig:
    path: str = "data/tiny"
    tokenizer: str = "bytes"  # "bytes" or a tokenizer.json path
    seq_len: int = 128
    build_from: str = ""  # "builtin", or a text/JSONL file: built into `path` when it is missing
    builtin_bytes: int = 2_000_000
    shuffle_seed: int = 0


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    global_batch: int = 8  # sequences per optimizer step (over all data-parallel ranks)
    microbatches: int = 2  # per step, per data-parallel rank
    seed: int = 0
    dtype: str = "float32"  # compute dtype: float32 or bfloat16 (master weights stay float32)
    device: str = "auto"  # auto, cpu or cuda
    fp8: bool = False
    fp8_dense: bool = True  # with fp8: the attention projections in FP8 too (False: experts only)
    threads: int = 0  # torch CPU threads of this process; 0: 1 on CPU runs (see fmoe.train.cpu_threads)


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 10
    schedule: str = "cosine"  # cosine or wsd
    decay_fraction: float = 0.2  # wsd: share of steps spent decaying
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip: float = 1.0


@dataclass(frozen=True)
class ParallelConfig:
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    schedule: str = "1f1b"  # a generator name, or a path to a CSV table
    chunks: int = 1  # model chunks per pipeline rank for interleaved schedules


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = "runs/tiny/checkpoints"
    every: int = 50
    keep: int = 2
    resume: bool = True


@dataclass(frozen=True)
class LogConfig:
    dir: str = "runs/tiny"
    every: int = 10
    progress: bool = True


@dataclass(frozen=True)
class Recipe:
    model_family: str
    model: Any  # the family's config dataclass
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    path: str = ""


SECTIONS = {
    "data": DataConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "parallel": ParallelConfig,
    "checkpoint": CheckpointConfig,
    "log": LogConfig,
}


def _check_type(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            if option is type(None) and value is None:
                return None
            try:
                return _check_type(value, option, where)
            except RecipeError:
                continue
        raise RecipeError(f"{where} must be {hint}, got {type(value).__name__} {value!r}")
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise RecipeError(f"{where} must be a list, got {type(value).__name__} {value!r}")
        (item, *_) = typing.get_args(hint)
        return tuple(_check_type(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is Any:
        return value
    if hint in (int, float, str, bool) and (
        not isinstance(value, hint) or (hint is int and isinstance(value, bool))
    ):
        raise RecipeError(f"{where} must be {hint.__name__}, got {type(value).__name__} {value!r}")
    return value


def build_dataclass(cls: type, data: dict, where: str) -> Any:
    """cls(**data) with unknown keys and wrong types reported as '<where>.<key>: ...'."""
    if not isinstance(data, dict):
        raise RecipeError(f"{where} must be a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - names)
    if unknown:
        raise RecipeError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(names))})")
    kwargs = {k: _check_type(v, hints[k], f"{where}.{k}") for k, v in data.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise RecipeError(f"{where}: {e}") from None


def model_config_class(family: str) -> type:
    from fmoe.hf import family as family_module

    try:
        module = family_module(family)
    except ValueError as e:
        raise RecipeError(str(e)) from None
    return next(v for k, v in vars(module).items() if k.endswith("Config") and dataclasses.is_dataclass(v))


def validate(recipe: Recipe) -> None:
    """Cross-field checks, each naming the fields to change."""
    where = recipe.path or "recipe"
    t, p = recipe.train, recipe.parallel
    positive = [
        ("train.steps", t.steps),
        ("train.global_batch", t.global_batch),
        ("train.microbatches", t.microbatches),
    ]
    positive += [("data.seq_len", recipe.data.seq_len), ("checkpoint.every", recipe.checkpoint.every)]
    positive += [("checkpoint.keep", recipe.checkpoint.keep), ("log.every", recipe.log.every)]
    positive += [(f"parallel.{k}", getattr(p, k)) for k in ("pp", "dp", "cp", "ep", "chunks")]
    for name, value in positive:
        if value < 1:
            raise RecipeError(f"{where}: {name} must be >= 1, got {value}")
    if t.global_batch % (p.dp * t.microbatches):
        raise RecipeError(
            f"{where}: train.global_batch ({t.global_batch}) must be a multiple of parallel.dp x train.microbatches "
            f"({p.dp} x {t.microbatches})"
        )
    if t.threads < 0:
        raise RecipeError(f"{where}: train.threads must be >= 0 (0: automatic), got {t.threads}")
    if t.dtype not in ("float32", "bfloat16"):
        raise RecipeError(f"{where}: train.dtype must be 'float32' or 'bfloat16', got {t.dtype!r}")
    if t.device not in ("auto", "cpu", "cuda"):
        raise RecipeError(f"{where}: train.device must be 'auto', 'cpu' or 'cuda', got {t.device!r}")
    if recipe.optim.schedule not in ("cosine", "wsd"):
        raise RecipeError(f"{where}: optim.schedule must be 'cosine' or 'wsd', got {recipe.optim.schedule!r}")
    if recipe.optim.warmup >= t.steps:
        raise RecipeError(
            f"{where}: optim.warmup ({recipe.optim.warmup}) must be below train.steps ({t.steps})"
        )


def from_dict(data: dict, path: str = "recipe") -> Recipe:
    """A Recipe from a parsed TOML dict (paths in it stay as written)."""
    data = dict(data)
    unknown = sorted(set(data) - {"model", *SECTIONS})
    if unknown:
        raise RecipeError(f"{path}: unknown section [{unknown[0]}] (known: model, {', '.join(SECTIONS)})")
    model = dict(data.pop("model", {}))
    family = model.pop("family", "qwen3_moe")
    if not isinstance(family, str):
        raise RecipeError(f"{path}: model.family must be str, got {family!r}")
    cfg = build_dataclass(model_config_class(family), model, f"{path}: model")
    sections = {
        name: build_dataclass(cls, data.get(name, {}), f"{path}: {name}") for name, cls in SECTIONS.items()
    }
    recipe = Recipe(model_family=family, model=cfg, path=path, **sections)
    validate(recipe)
    return recipe


def load(path: str | Path, overrides: dict | None = None) -> Recipe:
    """Read and validate a recipe TOML. overrides: {"train.steps": 10, ...} applied on top."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"{path}: recipe file not found")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{path}: not valid TOML ({e})") from None
    for key, value in (overrides or {}).items():
        section, _, name = key.partition(".")
        if not name:
            raise RecipeError(f"override {key!r} must be SECTION.KEY=VALUE")
        data.setdefault(section, {})[name] = value
    return from_dict(data, str(path))


def parse_override(text: str) -> tuple[str, Any]:
    """'train.steps=10' -> ('train.steps', 10): the value is read as TOML, else as a string."""
    key, sep, raw = text.partition("=")
    if not sep:
        raise RecipeError(f"override {text!r} must be SECTION.KEY=VALUE")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip(), value
