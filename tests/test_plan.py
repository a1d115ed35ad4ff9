"""The memory plan (``fmoe plan``, fmoe/plan.py): its figures against measured peaks, its activation
formulas against the tensors each stage's F saves, its sharding against ``parallel.layout``, and
the refusal of a recipe that cannot fit."""

from __future__ import annotations

import ctypes
import gc
from pathlib import Path

import pytest
import torch

from fmoe import memory, parallel, pipeline, plan
from fmoe import recipe as R
from fmoe.hf import family as family_module

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[1]
needs_proc = pytest.mark.skipif(not memory.can_measure(CPU), reason="needs Linux /proc")

# A Qwen3-MoE whose planned peak per rank is some 50 MB, far above the interpreter's noise:
# parameters, optimizer state, gradients, gathered copies and activations of comparable sizes.
MEASURED = {
    "model.vocab_size": 2048,
    "model.hidden_size": 128,
    "model.num_hidden_layers": 4,
    "model.num_attention_heads": 4,
    "model.num_key_value_heads": 2,
    "model.head_dim": 32,
    "model.num_experts": 16,
    "model.num_experts_per_tok": 2,
    "model.moe_intermediate_size": 128,
    "model.intermediate_size": 256,
    "data.seq_len": 128,
    "train.global_batch": 8,
    "train.microbatches": 2,
    "train.threads": 1,
}


def _tensor_bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors if isinstance(t, torch.Tensor))


def measure_layout(overrides: dict) -> dict:
    """Two training steps of the recipe on this rank's layout; the second one's peak, measured
    (VmHWM above the baseline, plus the shards and optimizer state the baseline already holds),
    beside the plan's figures for this rank."""
    from fmoe import train as T
    from fmoe.mesh import build_mesh

    torch.set_num_threads(1)
    recipe = R.load(REPO / "recipes" / "tiny.toml", overrides)
    p = recipe.parallel
    fam = family_module(recipe.model_family)
    model, shapes = fam.build(recipe.model), fam.param_shapes(recipe.model)
    mesh = build_mesh(p.pp, p.dp, p.cp, p.ep)
    table = T._schedule(recipe, mesh)
    names = (
        pipeline.local_param_names(model, table, rank=mesh.coords["pp"])
        if table is not None
        else list(shapes)
    )
    infos = parallel.layout(model, mesh, shapes, names)
    full = model.init(seed=0, dtype=torch.float32)
    shards = parallel.shard_canonical(full, infos, mesh)
    del full
    tx, _ = T.make_optimizer(recipe, shapes)
    state = tx.init(shards)
    gen = torch.Generator().manual_seed(0)
    shape = (recipe.train.global_batch, recipe.data.seq_len)
    batch = {
        "tokens": torch.randint(0, recipe.model.vocab_size, shape, generator=gen),
        "labels": torch.randint(0, recipe.model.vocab_size, shape, generator=gen),
    }

    def step(shards, state):
        loss, grads, stats = parallel.parallel_step(
            model, shards, infos, batch, recipe.train.microbatches, mesh, schedule=table
        )
        shards, state, _ = T._update(tx, model, loss, grads, stats, state, shards, infos, mesh)
        return shards, state

    shards, state = step(shards, state)  # the first step makes what later steps reuse (gloo buffers)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap pages back, so the baseline is what is live
    base = memory.reset_peak(CPU)
    shards, state = step(shards, state)
    peak = memory.peak_bytes(CPU) - base
    held = _tensor_bytes(shards.values()) + _tensor_bytes(state.values())
    planned = plan.plan_layout(recipe, model, shapes, (p.pp, p.dp, p.cp, p.ep), table=table, device="cpu")
    terms = planned.stage_terms[mesh.coords["pp"]]
    return {
        "measured": peak + held,
        "planned": terms.peak,
        "params": terms.params,
        "params_held": _tensor_bytes(shards.values()),
        "terms": terms,
    }


def measure_worker(rank: int, world: int, group, layouts: dict[str, dict]) -> dict:
    """``measure_layout`` of each layout in turn (every one a mesh of this world), by name."""
    out = {}
    for name, overrides in layouts.items():
        out[name] = measure_layout(overrides)
        gc.collect()
    return out


LAYOUTS = {
    "dp2": {"parallel.dp": 2},
    "pp2_1f1b": {"parallel.pp": 2, "parallel.schedule": "1f1b"},
    "ep2": {"parallel.ep": 2},
}


@needs_proc
def test_plan_within_ten_percent_of_the_measured_peak(monkeypatch):
    """dp = 2, pp = 2 (1F1B) and ep = 2 on two gloo processes: every rank's planned peak within 10%
    of its measured one, and its planned master bytes exactly its shards'."""
    from fmoe import dist

    # every tensor above 64 KiB its own mapping, returned to the system when freed: the resident
    # peak then follows the tensors' peak (glibc's adaptive threshold would keep freed ones resident)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(64 << 10))
    layouts = {name: {**MEASURED, **sizes} for name, sizes in LAYOUTS.items()}
    results = dist.spawn(measure_worker, 2, (layouts,), timeout_s=240)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}"
    for layout in LAYOUTS:
        for r in results:
            v = r.value[layout]
            assert v["params"] == v["params_held"], f"{layout}: planned master bytes differ from the shards'"
            error = abs(v["planned"] - v["measured"]) / v["measured"]
            print(f"{layout} rank {r.rank}: planned {v['planned'] / 2**20:.1f} MiB, measured "
                  f"{v['measured'] / 2**20:.1f} MiB ({100 * error:.1f}%) {v['terms']}")  # fmt: skip
            assert error < 0.10, (
                f"{layout} rank {r.rank}: planned {v['planned']} bytes, measured {v['measured']} ({error:.1%})"
            )
