"""The aux-loss-free router bias (DeepSeek-V3): loads out of the attn stage as a declared statistic,
summed over the step and every rank, the bias moved after each optimizer step, kept by checkpoints."""

from __future__ import annotations

import torch
from conftest import random_batch, tiny_config
from test_train import recipe_dict

from fmoe import checkpoint, parallel, pipeline, runner, sharding
from fmoe import dist as D
from fmoe import recipe as R
from fmoe.mesh import build_mesh
from fmoe.schedules.generators import generate
from fmoe.stages import moe, qwen3_moe
from fmoe.train import train

RATE = 0.002


def bias_names(cfg) -> list[str]:
    return [qwen3_moe.router_bias_name(i) for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]


def test_the_attn_stage_returns_each_layers_load_as_a_statistic():
    cfg = tiny_config(num_hidden_layers=3, mlp_only_layers=(0,), moe_router_bias_update_rate=RATE)
    model = qwen3_moe.build(cfg)
    params = model.init(seed=0)
    batch = random_batch(cfg, 4, 8, seed=1)
    result = runner.run_sequential(model, params, batch, num_microbatches=2)
    assert sorted(result.statistics) == sorted(bias_names(cfg))
    # the same loads counted by hand from the router's choices, microbatch by microbatch
    for layer in (1, 2):
        name = qwen3_moe.router_bias_name(layer)
        assert result.statistics[name].dtype == torch.int64
        assert int(result.statistics[name].sum()) == 4 * 8 * cfg.num_experts_per_tok
    assert qwen3_moe.build(tiny_config()).statistics() == [], "no bias, no statistic"


MESHES = {"dp2": (1, 2, 1, 1), "ep2": (1, 1, 1, 2), "pp2": (2, 1, 1, 1)}


def _meshes_worker(rank, world, group):
    return {label: _one_step(sizes) for label, sizes in MESHES.items()}


def _one_step(sizes):
    pp, dp, cp, ep = sizes
    cfg = tiny_config(router_aux_loss_coef=0.0, moe_router_bias_update_rate=RATE)  # 2 MoE layers
    model = qwen3_moe.build(cfg)
    mesh = build_mesh(pp, dp, cp, ep)
    shapes = qwen3_moe.param_shapes(cfg)
    schedule = generate("1f1b", pp, 2) if pp > 1 else None
    names = pipeline.local_param_names(model, schedule, rank=mesh.coords["pp"]) if pp > 1 else list(shapes)
    infos = sharding.layout(model, mesh, shapes, names)
    full = model.init(seed=3)
    # a deliberately uneven start, so the update is not the same for every expert
    for name in bias_names(cfg):
        full[name] = torch.linspace(-0.01, 0.01, cfg.num_experts)
    shards = sharding.shard_canonical(full, infos, mesh)
    batch = random_batch(cfg, 8, 8, seed=5)
    out = parallel.parallel_step(model, shards, infos, batch, 2, mesh, schedule=schedule)
    # this rank's own loads, counted by the sequential runner on exactly the rows it ran
    local = runner.run_sequential(model, full, parallel.local_batch(batch, mesh), 2).statistics
    if pp > 1:  # a pipeline rank runs only its own layers
        local = {n: v for n, v in local.items() if n in infos}
    shards = sharding.add_to_shards(shards, model.buffer_updates(out.statistics), infos, mesh)
    final = sharding.canonical(shards, infos, mesh, list(shapes))
    return {"statistics": out.statistics, "local": local, "bias": final and {n: final[n] for n in bias_names(cfg)},
            "start": {n: full[n] for n in bias_names(cfg)}}  # fmt: skip


def test_loads_are_summed_over_ranks_and_every_rank_applies_the_same_update():
    """dp=2, ep=2 and pp=2 on two gloo processes, one step each."""
    results = D.spawn(_meshes_worker, 2, (), timeout_s=120)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error}\n{r.traceback}"
    for label in MESHES:
        _check_one_step(*(r.value[label] for r in results))


def _check_one_step(a, b):
    assert a["statistics"].keys() == b["statistics"].keys() == set(a["start"])
    for name in a["statistics"]:
        # identical on both ranks, bitwise, and the sum of what each rank counted itself
        assert torch.equal(a["statistics"][name], b["statistics"][name]), name
        total = a["local"].get(name, 0) + b["local"].get(name, 0)
        assert torch.equal(a["statistics"][name], total), name
        assert int(total.sum()) == 8 * 8 * 2  # every token of the global batch, k = 2 slots each
        # the canonical bias after the update: start + one step from the global loads, bitwise
        want = a["start"][name] + moe.router_bias_step(a["statistics"][name], RATE)
        assert torch.equal(a["bias"][name], want), name
        assert not torch.equal(want, a["start"][name])


def _uneven_start(tmp_path, recipe_data) -> None:
    """A weights-only step-0 checkpoint whose router bias favours experts 0 and 1 of every layer."""
    rec = R.from_dict(recipe_data)
    cfg = rec.model
    params = qwen3_moe.build(cfg).init(seed=rec.train.seed)
    for name in bias_names(cfg):
        params[name] = torch.tensor([0.06, 0.06] + [0.0] * (cfg.num_experts - 2))
    checkpoint.save(rec.checkpoint.dir, 0, params, {}, {"step": 0, "data_cursor": 0})


def test_the_bias_moves_and_the_loads_even_out_in_training(tmp_path, dataset, monkeypatch):
    d = recipe_dict(
        tmp_path, dataset,
        model={"router_aux_loss_coef": 0.0, "moe_router_bias_update_rate": RATE, "num_experts": 8},
        train={"steps": 40, "global_batch": 8, "microbatches": 2},
        optim={"lr": 1e-3}, checkpoint={"every": 1000},
    )  # fmt: skip
    _uneven_start(tmp_path, d)
    seen = []
    real = parallel.parallel_step

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(out.statistics)
        return out

    monkeypatch.setattr(parallel, "parallel_step", spy)
    result = train(R.from_dict(d))
    assert len(seen) == 40
    cfg = R.from_dict(d).model
    start = torch.tensor([0.06, 0.06] + [0.0] * (cfg.num_experts - 2))
    for name in bias_names(cfg):  # the favoured experts' bias came down, the others' went up
        moved = result.params[name] - start
        assert moved[:2].sum() < 0 < moved[2:].sum(), f"{name}: {result.params[name].tolist()}"

    def favoured_share(stats):  # fraction of the routing slots on experts 0 and 1, over the layers
        return sum(float(v[:2].sum()) for v in stats.values()) / sum(float(v.sum()) for v in stats.values())

    def imbalance(stats):  # max / mean load, worst layer
        return max(float(v.max()) / float(v.float().mean()) for v in stats.values())

    assert favoured_share(seen[0]) == 1.0 and imbalance(seen[0]) == 4.0  # every slot on experts 0, 1
    last = seen[-10:]
    # a fair share of experts 0, 1 is 2/8; the tokens and a trained gate keep it from being exact
    assert sum(map(favoured_share, last)) / len(last) < 0.5
    assert sum(map(imbalance, last)) / len(last) < 3.0


def test_resume_restores_the_router_bias_bitwise(tmp_path, dataset):
    def recipe(folder):
        return recipe_dict(
            folder, dataset, model={"moe_router_bias_update_rate": RATE},
            train={"steps": 4}, checkpoint={"every": 2},
        )  # fmt: skip

    straight = train(R.from_dict(recipe(tmp_path / "a")))
    first = train(R.from_dict(recipe(tmp_path / "b")), stop_after=2)
    second = train(R.from_dict(recipe(tmp_path / "b")))
    assert first.step == 2 and second.step == 4
    names = bias_names(R.from_dict(recipe(tmp_path / "a")).model)
    assert names
    for name in names:
        assert straight.params[name].abs().sum() > 0, f"{name} never moved"
        assert not torch.equal(first.params[name], straight.params[name]), "steps 3-4 moved it further"
        assert torch.equal(second.params[name], straight.params[name]), name


def test_a_bf16_step_routes_with_the_float32_bias():
    """Steps of the bias far below bf16's spacing still steer the router: the step reads it in
    float32 (Model.buffers) while the other params are cast to the compute dtype."""
    cfg = tiny_config(moe_router_bias_update_rate=RATE)
    model = qwen3_moe.build(cfg)
    assert model.buffers == tuple(bias_names(cfg))
    mesh = build_mesh(1, 1, 1, 1)
    shapes = qwen3_moe.param_shapes(cfg)
    infos = sharding.layout(model, mesh, shapes, list(shapes))
    full = model.init(seed=3)
    # a zero gate makes every expert's probability exactly 1/8: the bias alone picks the top 2.
    # bf16 spacing at 0.5 is 2^-8 ~ 0.0039: all eight values below round to 0.5 there
    for name in bias_names(cfg):
        full[name.replace("e_score_correction_bias", "weight")] = torch.zeros(
            shapes[name] + (cfg.hidden_size,)
        )
        full[name] = torch.tensor([0.5010, 0.5004, 0.5012, 0.5008, 0.5006, 0.5002, 0.5019, 0.5015])
    shards = sharding.shard_canonical(full, infos, mesh)
    batch = random_batch(cfg, 4, 8, seed=2)
    out = parallel.parallel_step(model, shards, infos, batch, 2, mesh, dtype=torch.bfloat16)
    for name in bias_names(cfg):
        assert out.statistics[name].tolist() == [0, 0, 0, 0, 0, 0, 32, 32], name
