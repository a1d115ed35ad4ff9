"""Recipes: a TOML file -> frozen dataclasses, validated once with errors that name the field.

[model]      family and the family's config fields (Hugging Face names)
[data]       dataset folder, tokenizer, sequence length, what to build it from if missing
[train]      steps, batch sizes, seed, dtype, device
[optim]      AdamW, clipping, learning-rate schedule
[parallel]   pp, dp, cp, ep sizes, the pipeline schedule (a generator or a CSV file), the backend
[checkpoint] folder, interval, how many to keep
[log]        folder, interval
[memory]     merge window of the expert weight GEMMs, recomputation, offloading, or policy = "auto"
             (the default: the memory plan picks them; ``fmoe.memory_policy.MemoryPolicy``)
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fmoe.memory_policy import MemoryPolicy, memory_table  # torch-free until a policy is built

if TYPE_CHECKING:  # torch is imported lazily: reading a recipe never needs it
    from fmoe.stages.family import Family


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
    # with fp8_dense: their weight gradients in FP8 too (False: in the compute dtype, on the input kept
    # in it; no token-wise quantization of the input and output gradient: 1.5% faster a step at
    # DeepSeek-V3-16B shapes, level at Qwen3's, benchmarks/results/issue26_variants_2026-12-07_h100.json)
    fp8_dense_wgrad: bool = True
    # with fp8: the experts' weight gradients in FP8 too (False: in the compute dtype, 0.8-2.4% slower a
    # step at both families' shapes, same file)
    fp8_expert_wgrad: bool = True
    # steps with a non-finite loss or gradient norm are skipped; this many in a row stop the run
    max_nonfinite_steps: int = 10
    threads: int = 0  # torch CPU threads of this process; 0: 1 on CPU runs (see fmoe.train.cpu_threads)
    # capture each step (stages' F/B/W, optimizer) once as a CUDA graph and replay it (fmoe.cuda_graphs);
    # CUDA only; runs with collectives in the step (more than one process) stay eager, saying why
    cuda_graphs: bool = False
    # memory per device the run may plan for, GiB (``fmoe plan``); 0: the CUDA device's total, no limit on CPU
    device_memory_gib: float = 0.0


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
    timeout_s: float = 600.0  # how long a rank waits for a peer (pipeline transfers, process group)
    # when sharded parameters are gathered: "chunk" just before each layer's use (pp = 1) or each
    # pipeline chunk's first use (pp > 1), gradients reduced as soon as final; "step": all at once
    gather: str = "chunk"
    # the process group's: "auto" (NCCL when each local rank has a GPU of its own, else gloo), "nccl", "gloo"
    backend: str = "auto"


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = "runs/tiny/checkpoints"
    every: int = 50
    keep: int = 2
    resume: bool = True
    # stage the state in host memory and write it on a thread while training goes on (False: the
    # step waits for the whole write); the next save, and the run's end, wait for a pending write
    asynchronous: bool = True
    # besides SIGTERM and SIGINT, this signal also stops the run after the step in flight with a
    # checkpoint (SLURM's ``--signal=USR1@90`` sends it ahead of the time limit); "" for none
    signal: str = "SIGUSR1"


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
    memory: MemoryPolicy = field(default_factory=lambda: MemoryPolicy(policy="auto"))
    path: str = ""


SECTIONS = {
    "data": DataConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "parallel": ParallelConfig,
    "checkpoint": CheckpointConfig,
    "log": LogConfig,
    "memory": MemoryPolicy,
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
        # a config's own check names its class ("Qwen3MoeConfig.head_dim"); the recipe's author wrote
        # the section's field ("model.head_dim")
        file, _, section = where.rpartition(": ")
        text = str(e).replace(f"{cls.__name__}.", f"{section}.").replace(f"{cls.__name__}:", f"{section}:")
        raise RecipeError(f"{file}: {text}" if file else f"{where}: {text}") from None


def model_family(family: str, where: str = "recipe") -> Family:
    """The family ``model.family`` names: a builtin name or a module's import path (its FAMILY)."""
    from fmoe.stages.family import lookup as lookup_family  # torch, only once a model is needed

    try:
        return lookup_family(family)
    except ValueError as e:
        raise RecipeError(f"{where}: model.family: {e}") from None


def model_config_class(family: str) -> type:
    """The config dataclass of the family ``family`` names."""
    return model_family(family).config_class


def validate(recipe: Recipe) -> None:
    """Cross-field checks, each naming the fields to change."""
    where = recipe.path or "recipe"
    t, p = recipe.train, recipe.parallel
    positive = [
        ("train.steps", t.steps),
        ("train.global_batch", t.global_batch),
        ("train.microbatches", t.microbatches),
        ("train.max_nonfinite_steps", t.max_nonfinite_steps),
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
    if not (math.isfinite(t.device_memory_gib) and t.device_memory_gib >= 0):
        raise RecipeError(
            f"{where}: train.device_memory_gib must be a finite number >= 0, got {t.device_memory_gib}"
        )
    if t.dtype not in ("float32", "bfloat16"):
        raise RecipeError(f"{where}: train.dtype must be 'float32' or 'bfloat16', got {t.dtype!r}")
    if t.device not in ("auto", "cpu", "cuda"):
        raise RecipeError(f"{where}: train.device must be 'auto', 'cpu' or 'cuda', got {t.device!r}")
    if t.cuda_graphs and t.device == "cpu":
        raise RecipeError(f"{where}: train.cuda_graphs needs a CUDA device; train.device is 'cpu'")
    _validate_optim(recipe, where)
    _validate_signal(recipe.checkpoint.signal, where)
    if not (math.isfinite(p.timeout_s) and p.timeout_s > 0):
        raise RecipeError(
            f"{where}: parallel.timeout_s must be a finite number of seconds > 0, got {p.timeout_s}"
        )
    if p.gather not in ("chunk", "step"):
        raise RecipeError(f"{where}: parallel.gather must be 'chunk' or 'step', got {p.gather!r}")
    if p.backend not in ("auto", "nccl", "gloo"):
        raise RecipeError(f"{where}: parallel.backend must be 'auto', 'nccl' or 'gloo', got {p.backend!r}")
    sizes = model_family(recipe.model_family, where).sizes(recipe.model)
    check_scale(sizes, where)
    if sizes.max_positions is not None and sizes.max_positions < recipe.data.seq_len:
        raise RecipeError(
            f"{where}: model.{sizes.max_positions_field} ({sizes.max_positions}) must be >= data.seq_len "
            f"({recipe.data.seq_len})"
        )
    _validate_schedule(recipe, where)


# Sizes refused before anything walks the layers or experts (a typo's extra zeros is refused in
# well under a second, not planned for minutes): 100x the deepest MoE models trained today (~60-100
# layers) and 64x the most routed experts per layer (256 to 1,024). At these counts no device holds
# even its own part: one layer's fp32 master, gradient and AdamW moments are >= 16 bytes per weight
# and a layer of the smallest width that trains (hidden 1,024) has >= 8M weights, so 10,000 such
# layers are >= 1.3 TB of state before a single activation.
MAX_LAYERS = 10_000
MAX_EXPERTS = 65_536


def check_scale(sizes, where: str) -> None:
    """Layer and expert counts no run could hold, refused naming the family's count."""
    if sizes.num_layers > MAX_LAYERS:
        raise RecipeError(
            f"{where}: model: {sizes.num_layers:,} layers is more than any device could hold "
            f"(at most {MAX_LAYERS:,}): check the model's layer count"
        )
    if sizes.num_experts > MAX_EXPERTS:
        raise RecipeError(
            f"{where}: model: {sizes.num_experts:,} routed experts per layer is more than any device "
            f"could hold (at most {MAX_EXPERTS:,}): check the model's expert count"
        )


def _validate_signal(name: str, where: str) -> None:
    """checkpoint.signal: "" or a signal name a handler can catch."""
    import signal

    catchable = sorted(s.name for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP))
    if name and name not in catchable:
        raise RecipeError(
            f"{where}: checkpoint.signal must be '' or a catchable signal name such as 'SIGUSR1', got {name!r}"
        )


def _validate_optim(recipe: Recipe, where: str) -> None:
    """The optimizer fields, named as the recipe names them (the optimizer's own checks name its
    arguments, which a recipe's author never wrote)."""
    o, steps = recipe.optim, recipe.train.steps
    if o.schedule not in ("cosine", "wsd"):
        raise RecipeError(f"{where}: optim.schedule must be 'cosine' or 'wsd', got {o.schedule!r}")
    for name in ("lr", "eps", "clip"):
        value = getattr(o, name)
        if not (math.isfinite(value) and value > 0):
            raise RecipeError(f"{where}: optim.{name} must be a finite number > 0, got {value}")
    for name in ("min_lr", "weight_decay"):
        value = getattr(o, name)
        if not (math.isfinite(value) and value >= 0):
            raise RecipeError(f"{where}: optim.{name} must be a finite number >= 0, got {value}")
    if o.min_lr > o.lr:
        raise RecipeError(f"{where}: optim.min_lr ({o.min_lr}) must be <= optim.lr ({o.lr})")
    for name in ("b1", "b2"):
        value = getattr(o, name)
        if not 0 <= value < 1:
            raise RecipeError(f"{where}: optim.{name} must be in [0, 1), got {value}")
    if o.warmup < 0:
        raise RecipeError(f"{where}: optim.warmup must be >= 0, got {o.warmup}")
    if o.warmup >= steps:
        raise RecipeError(f"{where}: optim.warmup ({o.warmup}) must be below train.steps ({steps})")
    if o.schedule == "wsd":
        if not 0 < o.decay_fraction <= 1:
            raise RecipeError(f"{where}: optim.decay_fraction must be in (0, 1], got {o.decay_fraction}")
        decay = max(1, int(steps * o.decay_fraction))  # as fmoe.train.make_optimizer computes it
        if decay > steps - o.warmup:
            raise RecipeError(
                f"{where}: optim.decay_fraction ({o.decay_fraction}) x train.steps ({steps}) = {decay} decay "
                f"steps do not fit after optim.warmup ({o.warmup}): lower one of them"
            )


def _validate_schedule(recipe: Recipe, where: str) -> None:
    """parallel.schedule names a generator or an existing CSV (whatever pp is), and with pp > 1 every
    pipeline rank runs at least one model stage (a rank with none would wait on its peers forever)."""
    from fmoe import pipeline
    from fmoe.schedules.generators import GENERATORS
    from fmoe.schedules.table import read_csv

    p = recipe.parallel
    name = p.schedule
    if name.endswith(".csv"):
        if not Path(name).is_file():
            raise RecipeError(f"{where}: parallel.schedule: {name!r}: file not found")
    elif name not in GENERATORS:
        raise RecipeError(
            f"{where}: parallel.schedule: unknown schedule {name!r}; choose one of "
            f"{', '.join(GENERATORS)} or a .csv table"
        )
    if p.pp == 1:
        return
    if name.endswith(".csv"):
        try:
            table = read_csv(name)
        except (ValueError, OSError) as e:
            raise RecipeError(f"{where}: parallel.schedule {name!r}: {e}") from None
        placement, chunks = table.placement, table.chunks
    else:
        _, placement, chunks = GENERATORS[name]
        if name == "interleaved-1f1b":
            chunks = p.chunks
    model = model_family(recipe.model_family, where).build(recipe.model)
    try:
        stage_map = pipeline.stage_map(model, placement, p.pp, chunks)
    except ValueError as e:
        raise RecipeError(f"{where}: parallel.schedule {name!r}: {e}") from None
    idle = [r for r in range(p.pp) if not any(stage_map[(r, c)] for c in range(chunks))]
    if idle:
        raise RecipeError(
            f"{where}: parallel.pp = {p.pp} ({name}: {p.pp if placement == 'bidir' else p.pp * chunks} "
            f"pipeline stages) but the model has {model_family(recipe.model_family).sizes(recipe.model).num_layers} layers: pipeline "
            f"rank {idle[0]} would run no stage; use fewer pipeline ranks or more layers"
        )


def from_dict(data: dict, path: str = "recipe") -> Recipe:
    """A Recipe from a parsed TOML dict (paths in it stay as written)."""
    data = dict(data)
    unknown = sorted(set(data) - {"model", *SECTIONS})
    if unknown:
        raise RecipeError(f"{path}: unknown section [{unknown[0]}] (known: model, {', '.join(SECTIONS)})")
    model = model_of(data, path)
    family, cfg = model.model_family, model.model
    try:
        data["memory"] = memory_table(data.get("memory", {}))
    except ValueError as e:
        raise RecipeError(f"{path}: {e}") from None
    sections = {
        name: build_dataclass(cls, data.get(name, {}), f"{path}: {name}") for name, cls in SECTIONS.items()
    }
    recipe = Recipe(model_family=family, model=cfg, path=path, **sections)
    validate(recipe)
    return recipe


def load(path: str | Path, overrides: dict | None = None) -> Recipe:
    """Read and validate a recipe TOML. overrides: {"train.steps": 10, ...} applied on top."""
    return from_dict(read_toml(path, overrides), str(path))


@dataclass(frozen=True)
class ModelRecipe:
    """What converting a checkpoint reads of a recipe: model.family, its config (the rest of
    [model]) and data.tokenizer (written beside an exported model)."""

    model_family: str
    model: Any
    tokenizer: str


def model_of(data: dict, path: str = "recipe") -> ModelRecipe:
    """A parsed recipe's [model] (and data.tokenizer, type-checked) built alone: the other sections
    are neither built nor cross-checked against it."""
    model = dict(data.get("model", {}))
    family = model.pop("family", "qwen3_moe")
    if not isinstance(family, str):
        raise RecipeError(f"{path}: model.family must be str, got {family!r}")
    cfg = build_dataclass(model_family(family, path).config_class, model, f"{path}: model")
    tokenizer = build_dataclass(DataConfig, data.get("data", {}), f"{path}: data").tokenizer
    return ModelRecipe(family, cfg, tokenizer)


def load_model(path: str | Path) -> ModelRecipe:
    """A recipe's [model] alone (``model_of``): what ``fmoe checkpoint export-hf`` / ``import-hf``
    need. A conversion reads no data and runs no step, so nothing else of the recipe is checked
    (data.seq_len may exceed the model's longest sequence; the data need not exist)."""
    return model_of(read_toml(path), str(path))


def read_toml(path: str | Path, overrides: dict | None = None) -> dict:
    """A recipe TOML parsed (RecipeError naming the file), with overrides applied on top."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"{path}: recipe file not found")
    try:
        data = tomllib.loads(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise RecipeError(f"{path}: cannot read the recipe ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise RecipeError(f"{path}: not a TOML text file (byte {e.start} is not UTF-8)") from None
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{path}: not valid TOML ({e})") from None
    for key, value in (overrides or {}).items():
        section, _, name = key.partition(".")
        if not name:
            raise RecipeError(f"override {key!r} must be SECTION.KEY=VALUE")
        data.setdefault(section, {})[name] = value
    return data


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
