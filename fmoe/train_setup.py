"""What a training run is built from, once, before its first step (``setup``): the family checked,
the device, the process group and mesh, the resume point every rank agrees on, the dataset, the
model, the pipeline table, the parameters' ZeRO-3 layout, and the memory plan checked against the
device, with the memory policy the run uses (``memory.policy = "auto"`` resolved here, once: the
step only ever sees an explicit policy, ``Run.memory``).

Errors are one-liners naming the recipe's field: :class:`fmoe.recipe.RecipeError`, and
``fmoe.checkpoint``'s for a resume point that cannot be used.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from fmoe import data, pipeline, plan_policy, plan_text, sharding
from fmoe import dist as D
from fmoe import plan as memory_plan
from fmoe.check import check_family
from fmoe.gather_plan import GatherPlan, step_gather_plan
from fmoe.hf import family as family_module
from fmoe.memory_policy import MemoryPolicy
from fmoe.mesh import Mesh, MeshError, build_mesh, check_sizes
from fmoe.recipe import Recipe, RecipeError
from fmoe.schedules.generators import generate
from fmoe.schedules.table import Schedule, read_csv
from fmoe.schedules.verify import validate
from fmoe.stages.family import Family
from fmoe.stages.spec import Model
from fmoe.train_data import check_dataset_tokenizer, open_dataset
from fmoe.train_state import agree_on_resume_point

__all__ = [
    "Run",
    "backend",
    "check_memory_plan",
    "note_fp8_without_blocks",
    "pick_device",
    "place",
    "schedule",
    "setup",
    "setup_mesh",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Run:
    """What the step loop runs on, built by :func:`setup`. shapes: {name: canonical shape} of every
    parameter (in the family's order); infos: {name: ShardInfo} of the parameters this rank holds
    (its pipeline stage's); table: the pipeline schedule (None for pp = 1); dtype: the compute
    dtype; resume_from: the checkpoint every rank resumes from (None: a fresh start); memory: the
    explicit memory policy the step runs (the recipe's, or the one "auto" chose)."""

    family: Family
    model: Model
    mesh: Mesh
    device: torch.device
    dtype: torch.dtype
    table: Schedule | None
    shapes: dict[str, tuple[int, ...]]
    infos: dict[str, sharding.ShardInfo]
    gathers: GatherPlan  # the per-unit gather plan of every step (``gather_plan.step_gather_plan``)
    dataset: data.TokenDataset
    resume_from: Path | None
    memory: MemoryPolicy


def setup(recipe: Recipe, stack: contextlib.ExitStack) -> Run:
    """Everything before the first step, in this order (each check before what it guards is built):
    every stage of the family once on a tiny batch (a broken family named before any data), the
    dataset's tokenizer, the mesh, the resume point (rank 0 takes the checkpoint folder's lock on
    ``stack``), the dataset, the model and its layout, the memory plan. Seeds torch's RNG."""
    fam = family_module(recipe.model_family)
    cfg = recipe.model
    check_family(fam, cfg)  # every stage once on a tiny batch: a broken family named before any data
    check_dataset_tokenizer(recipe)
    device = place(recipe)
    if recipe.train.cuda_graphs and device.type != "cuda":  # train.device = "auto" on a CPU machine
        raise RecipeError(f"{recipe.path}: train.cuda_graphs needs a CUDA device; this run is on {device}")
    mesh = setup_mesh(recipe, device)
    dtype = _DTYPES[recipe.train.dtype]
    torch.manual_seed(recipe.train.seed)
    resume_from = agree_on_resume_point(recipe, mesh, stack)
    dataset = open_dataset(recipe, fam.sizes(cfg).vocab_size, mesh.rank, mesh.world)
    model = fam.build(cfg)
    table = schedule(recipe, mesh)
    shapes = fam.param_shapes(cfg)
    note_fp8_without_blocks(recipe, shapes, mesh.rank)
    names = list(shapes)
    local = pipeline.local_param_names(model, table, rank=mesh.coords["pp"]) if table is not None else names
    infos = sharding.layout(model, mesh, shapes, local)
    gathers = step_gather_plan(model, mesh, recipe.train.microbatches, table)
    memory = check_memory_plan(recipe, model, shapes, table, mesh, device)
    return Run(family=fam, model=model, mesh=mesh, device=device, dtype=dtype, table=table, shapes=shapes,
               infos=infos, gathers=gathers, dataset=dataset, resume_from=resume_from, memory=memory)  # fmt: skip


def note_fp8_without_blocks(recipe: Recipe, shapes: dict, rank: int) -> None:
    """With ``train.fp8``, rank 0 says so when no weight can run as an FP8 GEMM: FP8 quantizes weights
    in 128 x 128 blocks (``fmoe.stages.fp8_mode``), so a weight runs in FP8 only where both its last
    dims are multiples of 128. The run goes on in the compute dtype (a setting that does nothing
    must not pass in silence; some weights qualifying is the model's own choice, not said)."""
    blocked = any(len(s) >= 2 and s[-1] % 128 == 0 and s[-2] % 128 == 0 for s in shapes.values())
    if recipe.train.fp8 and not blocked and rank == 0:
        print(f"fmoe: train.fp8 is on, but no weight of this model has both dims multiples of 128 (FP8's "
              f"block size): every GEMM runs in {recipe.train.dtype}", flush=True)  # fmt: skip


def pick_device(name: str) -> torch.device:
    """``train.device``: "auto" (CUDA when there is one, else the CPU), "cuda" (refused without one),
    or any torch device name."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RecipeError("train.device is 'cuda' but no CUDA device is available")
    return torch.device(name)


def place(recipe: Recipe) -> torch.device:
    """This rank's device: ``pick_device``, and under torchrun (LOCAL_RANK) the CUDA device
    ``fmoe.dist.local_device`` maps its local rank to (ranks share devices when there are fewer
    devices than local ranks), made current."""
    device = pick_device(recipe.train.device)
    if device.type == "cuda" and "LOCAL_RANK" in os.environ:
        device = D.local_device(int(os.environ["LOCAL_RANK"]), torch.cuda.device_count())
        torch.cuda.set_device(device)
    return device


def backend(recipe: Recipe, device: torch.device) -> str:
    """The process group's backend for ``parallel.backend`` on ``device`` (``fmoe.dist.choose_backend``)
    over this host's local ranks (torchrun's LOCAL_WORLD_SIZE; a launcher without it: WORLD_SIZE,
    the whole job on one host); rank 0 prints why when "auto" chose gloo."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    count = torch.cuda.device_count() if device.type == "cuda" else 0
    try:
        name, note = D.choose_backend(recipe.parallel.backend, device.type, local, count)
    except D.BackendError as e:
        raise RecipeError(f"{recipe.path}: {e}") from None
    if note and os.environ.get("RANK", "0") == "0":
        print(f"fmoe: {note}", flush=True)
    return name


def setup_mesh(recipe: Recipe, device: torch.device | None = None) -> Mesh:
    """Process group (torchrun's environment; its backend from ``backend``) and mesh; sizes checked
    before anything is built. device: this rank's (``place``; None: ``pick_device``'s)."""
    p, t = recipe.parallel, recipe.train
    fam = family_module(recipe.model_family)
    if p.cp > 1 and not fam.supports_context_parallel:
        raise RecipeError(
            f"{recipe.path}: parallel.cp = {p.cp}, but model family {recipe.model_family!r} has no "
            f"context-parallel attention yet: set parallel.cp = 1"
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if dist.is_initialized():
        world = dist.get_world_size()
    try:
        check_sizes(p.pp, p.dp, p.cp, p.ep, world, microbatches=t.microbatches, schedule=p.schedule,
                    num_experts=fam.sizes(recipe.model).num_experts, seq_len=recipe.data.seq_len,
                    global_batch=t.global_batch)  # fmt: skip
    except MeshError as e:
        raise RecipeError(f"{recipe.path}: {e}") from None
    device = device if device is not None else pick_device(recipe.train.device)
    chosen = backend(recipe, device)  # one process too: a backend the run could not use is refused
    if world > 1 and not dist.is_initialized():
        D.init_from_env(chosen, timeout_s=p.timeout_s, device=device)
    return build_mesh(p.pp, p.dp, p.cp, p.ep)


def schedule(recipe: Recipe, mesh: Mesh) -> Schedule | None:
    """The pipeline table for pp > 1: a generator name or a CSV file."""
    if mesh.pp == 1:
        return None
    p = recipe.parallel
    try:
        if p.schedule.endswith(".csv"):
            table = read_csv(p.schedule)
        else:
            options = {"chunks": p.chunks} if p.schedule == "interleaved-1f1b" else {}
            table = generate(p.schedule, mesh.pp, recipe.train.microbatches, **options)
        validate(table)
    except (ValueError, FileNotFoundError) as e:
        raise RecipeError(f"{recipe.path}: parallel.schedule {p.schedule!r}: {e}") from None
    if table.pp != mesh.pp or table.microbatches != recipe.train.microbatches:
        raise RecipeError(
            f"{recipe.path}: parallel.schedule {p.schedule!r} is for pp={table.pp}, microbatches="
            f"{table.microbatches}; the recipe has parallel.pp={mesh.pp}, train.microbatches={recipe.train.microbatches}"
        )
    return table


def check_memory_plan(recipe: Recipe, model, shapes, table, mesh, device: torch.device) -> MemoryPolicy:
    """The memory plan of this layout (``fmoe.plan``) and the policy the run uses
    (``fmoe.plan_policy.choose``: the recipe's explicit one, or under ``memory.policy = "auto"`` the
    fastest that fits), before any parameter exists. RecipeError naming the rank, its largest term
    and the policy when a rank's planned peak exceeds the device's memory
    (``train.device_memory_gib``, else the CUDA device's total); else rank 0 writes the plan, the
    policy and its modelled time to ``<log.dir>/memory_plan.txt`` and, with ``log.progress``,
    prints it. Every rank computes the same choice from the same recipe and sizes."""
    cuda_total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    limit = memory_plan.device_limit_bytes(recipe, device.type, cuda_total)
    sizes = (mesh.pp, mesh.dp, mesh.cp, mesh.ep)
    choice = plan_policy.choose(recipe, model, shapes, sizes, limit, table=table, device=device.type)
    refused = None if limit is None else plan_text.refusal(choice.plan, limit, auto=choice.auto)
    if refused is not None:
        raise RecipeError(f"{recipe.path}: {refused} (train.device_memory_gib sets the limit)")
    if mesh.rank == 0:  # the log folder keeps it; the console shows it beside the progress bar
        text = plan_text.summary(choice.plan, limit, choice.cost, choice.auto)
        (Path(recipe.log.dir) / "memory_plan.txt").write_text(text + "\n")
        if recipe.log.progress:
            print(text, flush=True)
    return choice.policy
