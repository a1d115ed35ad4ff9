"""The 4D mesh (pp, dp, cp, ep) with ZeRO-3 shards against the single-process reference (gloo, CPU)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_batch, relative_error, tiny_config

from fmoe import collectives, optim, parallel, pipeline, runner, sharding
from fmoe import dist as D
from fmoe.mesh import MeshError, build_mesh, check_sizes
from fmoe.schedules.generators import generate
from fmoe.stages import qwen3_moe

MICROBATCHES = 2
SEQ = 8
STEPS = 3


def setup(sizes):
    pp, dp, cp, ep = sizes
    # 4 layers (1 dense), 8 experts over up to 2 ep ranks
    cfg = tiny_config(num_hidden_layers=3, mlp_only_layers=(0,), router_aux_loss_coef=0.01)
    model = qwen3_moe.build(cfg)
    batch = random_batch(cfg, dp * ep * MICROBATCHES * 2, SEQ, seed=11)  # 2 sequences per microbatch
    return cfg, model, batch


def make_tx(shapes):
    mask = {n: len(s) >= 2 for n, s in shapes.items()}
    return optim.chain(
        optim.clip_by_global_norm(1.0, sq_norm_reduce=collectives.world_sq_norm),
        optim.adamw(1e-3, 0.9, 0.95, 1e-8, 0.1, mask=mask),
    )


def mesh_worker(rank, world, group, sizes):
    pp, dp, cp, ep = sizes
    cfg, model, batch = setup(sizes)
    mesh = build_mesh(pp, dp, cp, ep)
    shapes = qwen3_moe.param_shapes(cfg)
    schedule = generate("1f1b", pp, MICROBATCHES) if pp > 1 else None
    names = pipeline.local_param_names(model, schedule, rank=mesh.coords["pp"]) if pp > 1 else list(shapes)
    infos = sharding.layout(model, mesh, shapes, names)
    full = model.init(seed=3)
    shards = sharding.shard_canonical(full, infos, mesh)
    tx = make_tx({n: shapes[n] for n in names})
    state = tx.init(shards)
    losses, first_grads = [], None
    for step in range(STEPS):
        loss, grad_shards, _ = parallel.parallel_step(
            model, shards, infos, batch, MICROBATCHES, mesh, schedule=schedule, seed=step
        )
        if step == 0:
            first_grads = sharding.canonical(grad_shards, infos, mesh, list(shapes))
        losses.append(loss)
        shards, state = optim.step(tx, grad_shards, state, shards)
    final = sharding.canonical(shards, infos, mesh, list(shapes))
    shard_numels = {n: shards[n].numel() for n in shards}
    expected = {n: infos[n].shard_numel for n in infos}
    return {"losses": losses, "grads": first_grads, "params": final, "numels": shard_numels, "expected": expected,
            "state_numels": {k: v.numel() for k, v in state.items() if k.startswith("exp_avg/")}}  # fmt: skip


def reference(sizes):
    pp, dp, cp, ep = sizes
    cfg, model, batch = setup(sizes)
    params = model.init(seed=3)
    shapes = qwen3_moe.param_shapes(cfg)
    tx = make_tx(shapes)
    state = tx.init(params)
    losses, first = [], None
    for step in range(STEPS):
        res = runner.run_sequential(model, params, batch, dp * ep * MICROBATCHES, seed=step)
        if step == 0:
            first = {n: g.clone() for n, g in res.grads.items()}
        losses.append(res.loss)
        params, state = optim.step(tx, res.grads, state, params)
    return losses, first, params


@pytest.mark.parametrize(
    "sizes", [(1, 2, 1, 1), (1, 1, 2, 1), (1, 2, 1, 2), (2, 2, 1, 2), (2, 1, 2, 2), (1, 2, 2, 2)], ids=str
)
def test_mesh_matches_the_single_process_reference(sizes):
    pp, dp, cp, ep = sizes
    results = D.spawn(mesh_worker, pp * dp * cp * ep, (sizes,), timeout_s=300)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error}\n{r.traceback}"
    ref_losses, ref_grads, ref_params = reference(sizes)
    ours = results[0].value
    # the loss is a mean over data ranks (and over cp shares of each sequence): the reduction order
    # differs from the reference's, so equal to float32 rounding, not bitwise
    for mine, theirs in zip(ours["losses"], ref_losses):
        assert abs(mine.item() - theirs.item()) <= 1e-6 * abs(theirs.item())
    # float32 gradients summed over up to dp x cp x ep = 8 ranks and their microbatches in another
    # order than the reference's (~16 roundings of 2^-24 = 1e-6 per element); three AdamW steps after
    # a clip by the global norm pass that on, scaled by lr / sqrt(v): 1e-5 leaves a factor of 10
    for name, g in ref_grads.items():
        assert relative_error(ours["grads"][name], g) <= 1e-5, name
    for name, p in ref_params.items():
        assert relative_error(ours["params"][name], p) <= 1e-5, name
    for r in results:  # every rank holds exactly its shard of params and optimizer state
        assert r.value["numels"] == r.value["expected"]
        assert r.value["state_numels"] == {f"exp_avg/{n}": v for n, v in r.value["expected"].items()}


def test_bad_sizes_say_which_to_change():
    with pytest.raises(
        MeshError, match=r"pp x dp x cp x ep = 2 x 2 x 1 x 1 = 4, but the job has 2 processes"
    ):
        check_sizes(2, 2, 1, 1, 2)
    with pytest.raises(MeshError, match=r"dualpipev needs train.microbatches >= 2 x parallel.pp = 8, got 4"):
        check_sizes(4, 1, 1, 1, 4, microbatches=4, schedule="dualpipev")
    with pytest.raises(MeshError, match=r"model.num_experts \(6\) must be a multiple of parallel.ep \(4\)"):
        check_sizes(1, 1, 1, 4, 4, num_experts=6)
    with pytest.raises(MeshError, match=r"data.seq_len \(6\) must be a multiple of 2 x parallel.cp = 4"):
        check_sizes(1, 1, 2, 1, 2, seq_len=6)


def test_one_rank_step_hands_compute_dtype_grads_to_the_optimizer():
    # One rank: nothing reduces or scales the gradients, so they stay in the compute dtype (no fp32
    # copy of each); their values are those of the sequential runner on the same bf16 parameters.
    cfg, model, batch = setup((1, 1, 1, 1))
    mesh = build_mesh(1, 1, 1, 1)
    shapes = qwen3_moe.param_shapes(cfg)
    infos = sharding.layout(model, mesh, shapes, list(shapes))
    full = model.init(seed=3)
    shards = sharding.shard_canonical(full, infos, mesh)
    loss, grad_shards, _ = parallel.parallel_step(
        model, shards, infos, batch, MICROBATCHES, mesh, dtype=torch.bfloat16, seed=0
    )
    assert {g.dtype for g in grad_shards.values()} == {torch.bfloat16}
    bf16 = {n: p.to(torch.bfloat16) for n, p in full.items()}
    ref = runner.run_sequential(model, bf16, batch, MICROBATCHES, seed=0)
    grads = sharding.canonical(grad_shards, infos, mesh, list(shapes))
    for n in shapes:
        assert torch.equal(grads[n], ref.grads[n]), n
    state = make_tx(shapes).init(shards)
    new, _ = optim.step(make_tx(shapes), grad_shards, state, {n: s.clone() for n, s in shards.items()})
    assert all(new[n].dtype == torch.float32 and not torch.equal(new[n], shards[n]) for n in new)
