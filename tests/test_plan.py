"""The memory plan (``fmoe plan``, fmoe/plan.py): its figures against measured peaks, its activation
formulas against the tensors each stage's F saves, its sharding against ``sharding.layout``, and
the refusal of a recipe that cannot fit."""

from __future__ import annotations

import ctypes
import gc
from pathlib import Path

import pytest
import torch
from conftest import measuring_env

from fmoe import memory, parallel, pipeline, plan, plan_activations, plan_text, sharding
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
    from fmoe import train, train_setup
    from fmoe.mesh import build_mesh

    torch.set_num_threads(1)
    recipe = R.load(REPO / "recipes" / "tiny.toml", overrides)
    p = recipe.parallel
    fam = family_module(recipe.model_family)
    model, shapes = fam.build(recipe.model), fam.param_shapes(recipe.model)
    mesh = build_mesh(p.pp, p.dp, p.cp, p.ep)
    table = train_setup.schedule(recipe, mesh)
    names = (
        pipeline.local_param_names(model, table, rank=mesh.coords["pp"])
        if table is not None
        else list(shapes)
    )
    infos = sharding.layout(model, mesh, shapes, names)
    full = model.init(seed=0, dtype=torch.float32)
    shards = sharding.shard_canonical(full, infos, mesh)
    del full
    tx, _ = train.make_optimizer(recipe, shapes)
    state = tx.init(shards)
    gen = torch.Generator().manual_seed(0)
    shape = (recipe.train.global_batch, recipe.data.seq_len)
    batch = {
        "tokens": torch.randint(0, recipe.model.vocab_size, shape, generator=gen),
        "labels": torch.randint(0, recipe.model.vocab_size, shape, generator=gen),
    }

    def step(shards, state):
        loss, grads, stats = parallel.parallel_step(
            model, shards, infos, batch, recipe.train.microbatches, mesh, schedule=table,
            gather=recipe.parallel.gather,
        )  # fmt: skip
        shards, state, _ = train._update(tx, model, loss, grads, stats, state, shards, infos, mesh)
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


LAYOUTS = {  # gathers once a step: the plan's STEP terms are exact in time, so within 10%
    "dp2": {"parallel.dp": 2, "parallel.gather": "step"},
    "pp2_1f1b": {"parallel.pp": 2, "parallel.schedule": "1f1b", "parallel.gather": "step"},
    "ep2": {"parallel.ep": 2, "parallel.gather": "step"},
}
# gathers per layer (the default): the plan adds the gathered working set's peak and the
# activations' peak, which come at different times, so it is an upper bound
UPPER_BOUND_LAYOUTS = {"dp2_chunk": {"parallel.dp": 2, "parallel.gather": "chunk"}}


@needs_proc
def test_plan_within_ten_percent_of_the_measured_peak():
    """dp = 2, pp = 2 (1F1B) and ep = 2 on two gloo processes: every rank's planned peak within 10%
    of its measured one, and its planned master bytes exactly its shards'."""
    from fmoe import dist

    layouts = {name: {**MEASURED, **sizes} for name, sizes in {**LAYOUTS, **UPPER_BOUND_LAYOUTS}.items()}
    with measuring_env():
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
    for layout in UPPER_BOUND_LAYOUTS:
        for r in results:
            v = r.value[layout]
            over = v["planned"] / v["measured"] - 1
            print(f"{layout} rank {r.rank}: planned {v['planned'] / 2**20:.1f} MiB, measured "
                  f"{v['measured'] / 2**20:.1f} MiB (+{100 * over:.1f}%)")  # fmt: skip
            assert 0 <= over < 0.25, (
                f"{layout} rank {r.rank}: planned {v['planned']}, measured {v['measured']}"
            )


# ------------------------------------------------------------------------------------------------
# activation formulas against the tensors F saves


def _saved_bytes_per_stage(recipe_name: str) -> list[tuple[str, int, float]]:
    """(stage name, bytes its F saved for B - autograd's saved tensors, parameters left out -, the
    plan's formula) for every stage of a recipe's model at 2 x 64 tokens, float32 on CPU."""
    from fmoe import runner
    from fmoe import stage as S
    from fmoe.stages.spec import StageContext

    recipe = R.load(REPO / "recipes" / f"{recipe_name}.toml")
    cfg = recipe.model
    model = family_module(recipe.model_family).build(cfg)
    params = model.init(seed=0, dtype=torch.float32)
    param_storages = {t.untyped_storage().data_ptr() for t in params.values()}
    tokens = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    batch = runner.with_positions({"tokens": tokens, "labels": tokens})
    mb = plan_activations.MicroBatch(sequences=2, seq_local=64, seq_full=64, compute_bytes=4, device="cpu")
    moe = plan_activations.moe_stages(model)
    carry: tuple = ()
    out = []
    for i, stage in enumerate(model.stages):
        saved: dict[int, int] = {}

        def pack(t, saved=saved):
            storage = t.untyped_storage()
            if storage.data_ptr() not in param_storages:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            outputs, _ = S.forward(stage, params, runner.stage_inputs(stage, carry, batch), StageContext())
        carry, _ = runner.split_outputs(stage, outputs)
        planned = plan_activations.stage_activation_bytes(
            recipe.model_family, cfg, stage, i in moe, mb, model.num_experts
        )
        out.append((stage.name, stage.role, sum(saved.values()), planned))
    return out


@pytest.mark.parametrize("recipe_name", ["tiny", "deepseek_v2_lite_tiny", "gpt_oss_tiny"])
def test_activation_formulas_match_the_tensors_each_stage_saves(recipe_name):
    """Per stage, the plan's bytes within 3% of what autograd saved (the formulas leave out a few
    per-head and per-position vectors: rotary tables, router scalars), and exact where nothing is
    left out (embedding, dispatch, combine, aggregate, head)."""
    for name, kind, measured, planned in _saved_bytes_per_stage(recipe_name):
        if kind in ("embed", "dispatch", "combine", "aggregate"):
            assert planned == measured, (name, planned, measured)
        elif kind == "head":  # the loss's scalar output is saved too
            assert 0 <= measured - planned <= 8, (name, planned, measured)
        else:
            assert abs(planned - measured) <= 0.03 * measured, (name, planned, measured)


# ------------------------------------------------------------------------------------------------
# pieces of the plan


def test_per_unit_gathers_plan_less_than_whole_step_gathers_for_data_parallel():
    """dp = 4 over a 4-layer model: per-layer gathers hold two layers (plus one layer's gradient)
    where whole-step gathers hold all four, and gradient shards where the step holds full ones."""
    recipe = R.load(REPO / "recipes" / "tiny.toml", {"parallel.dp": 4})
    fam = family_module(recipe.model_family)
    model, shapes = fam.build(recipe.model), fam.param_shapes(recipe.model)
    step = plan.plan_layout(
        recipe, model, shapes, (1, 4, 1, 1), device="cpu", working_set=plan.WorkingSet.STEP
    )
    unit = plan.plan_layout(
        recipe, model, shapes, (1, 4, 1, 1), device="cpu", working_set=plan.WorkingSet.UNIT
    )
    s, u = step.stage_terms[0], unit.stage_terms[0]
    assert (u.params, u.optimizer, u.activations) == (s.params, s.optimizer, s.activations)
    assert u.gathered < s.gathered and u.grads < s.grads
    assert u.grads == s.params  # fp32 gradient shards, shaped like the fp32 master shards


def test_the_pipeline_walk_weights_the_simulators_in_flight_count():
    """With every chunk the same size, the walk's activation peak is the simulator's
    peak_activations times that size, rank by rank, for 1F1B, ZB-H1 and DualPipeV."""
    from fmoe.schedules.generators import generate
    from fmoe.schedules.simulator import simulate

    for name in ("1f1b", "zb-h1", "dualpipev"):
        table = generate(name, 4, 8)
        sim = simulate(table)
        chunks = [plan_activations.ChunkMemory(activations=1000, transient=0, grads=0)] * table.chunks
        for r in range(4):
            assert plan_activations.pipeline_walk(table, r, chunks)[0] == 1000 * sim.peak_activations[r], (
                name,
                r,
            )


def test_the_refusal_names_the_fullest_rank_and_its_largest_term():
    terms = (
        plan.RankTerms(0, (0, 0, 0, 0), 10, 10, 20, 0, 30, 70),
        plan.RankTerms(2, (1, 0, 0, 0), 10, 10, 20, 0, 90, 130),
    )
    layout = plan.LayoutPlan(2, 2, 1, 1, "1f1b", 0.1, terms)
    assert plan_text.refusal(layout, 200) is None
    line = plan_text.refusal(layout, 100)
    assert "rank 2 (pp 1)" in line and "activations" in line and "pp=2 dp=2 cp=1 ep=1" in line


# ------------------------------------------------------------------------------------------------
# the command line


def test_fmoe_plan_ranks_layouts_by_bubble_and_says_which_fit(capsys):
    from fmoe.cli import main

    assert main(["plan", str(REPO / "recipes" / "tiny.toml"), "--nproc", "4"]) == 0
    out = capsys.readouterr().out
    rows = [
        line.split() for line in out.splitlines() if line.strip()[:1].isdigit() and len(line.split()) >= 9
    ]
    layouts = [tuple(int(v) for v in row[:4]) for row in rows if len(row) >= 10]
    bubbles = [float(row[5]) for row in rows if len(row) >= 10]
    assert (1, 4, 1, 1) in layouts and (4, 1, 1, 1) in layouts and (2, 2, 1, 1) in layouts
    assert bubbles == sorted(bubbles) and bubbles[-1] > 0
    assert all(row[-1] == "yes" for row in rows if len(row) >= 10)  # no limit given
    # a limit between the smallest and the largest peak of recompute none (explicit: "auto", the
    # recipe's default, would find each layout a policy that fits): some fit, some do not
    fmoe_tiny = R.load(REPO / "recipes" / "tiny.toml")
    fam = family_module(fmoe_tiny.model_family)
    peaks = [p.peak for p in plan.layouts(fmoe_tiny, fam.build(fmoe_tiny.model), fam.param_shapes(fmoe_tiny.model),
                                          4, supports_cp=True, device="cpu")]  # fmt: skip
    limit_gib = (min(peaks) + max(peaks)) / 2 / plan.GiB
    assert (
        main(
            [
                "plan",
                str(REPO / "recipes" / "tiny.toml"),
                "--nproc",
                "4",
                "--device-memory",
                str(limit_gib),
                "--recompute",
                "none",
            ]
        )  # fmt: skip
        == 0
    )
    fits = [
        line.split()[-1]
        for line in capsys.readouterr().out.splitlines()
        if line.split()[-1:] in (["yes"], ["no"])
    ]
    assert "yes" in fits and "no" in fits


def test_a_recipe_that_cannot_fit_is_refused_before_the_first_step(tmp_path, dataset, capsys, monkeypatch):
    """``fmoe train`` with train.device_memory_gib below the plan: exit 2, one line naming the
    recipe, the rank and its largest term; no step runs and no checkpoint is written."""
    from test_train import recipe_dict, toml_text

    from fmoe import cli

    def no_step(*args, **kwargs):
        raise AssertionError("a step ran")

    monkeypatch.setattr("fmoe.parallel.parallel_step", no_step)
    path = tmp_path / "big.toml"
    path.write_text(toml_text(recipe_dict(tmp_path, dataset, train={"device_memory_gib": 0.0001})))
    code = cli.main(["train", str(path)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("fmoe: error: "), err
    for part in (str(path), "rank 0 (pp 0)", "largest term is activations", "train.device_memory_gib"):
        assert part in err, (part, err)
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())
    # the same recipe with room to spare trains, its plan in the log folder
    path.write_text(toml_text(recipe_dict(tmp_path, dataset, train={"device_memory_gib": 1.0, "steps": 3})))
    monkeypatch.undo()
    assert cli.main(["train", str(path)]) == 0
    assert (tmp_path / "log" / "memory_plan.txt").read_text().startswith("memory plan, pp=1 dp=1 cp=1 ep=1")


def test_the_qwen3_30b_a3b_recipe_has_the_benchmarks_shapes_and_30b_parameters():
    """recipes/qwen3_30b_a3b.toml: the layer shapes benchmarks/train_throughput.py measures, 48
    layers, 30.5B parameters (the hub's Qwen3-30B-A3B)."""
    import math

    from benchmarks.bench_stages import QWEN3_30B_A3B_LAYER

    recipe = R.load(REPO / "recipes" / "qwen3_30b_a3b.toml")
    for name, value in QWEN3_30B_A3B_LAYER.items():
        if name != "num_hidden_layers":
            assert getattr(recipe.model, name) == value, name
    assert recipe.model.num_hidden_layers == 48
    shapes = family_module(recipe.model_family).param_shapes(recipe.model)
    assert round(sum(math.prod(s) for s in shapes.values()) / 1e9, 1) == 30.5
