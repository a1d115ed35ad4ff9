"""Expert parallelism on gloo (CPU, float32) against the single-process sequential reference.

Each ep size runs once in spawned processes (every routing scenario, each step twice) and writes
its results; the tests below compare them with ``fmoe.runner.run_sequential`` over the whole batch,
where rank r's local batch is microbatches r*m .. r*m+m-1 of the reference.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import random_batch, relative_error, tiny_config

from fmoe import expert_parallel as EP
from fmoe import runner
from fmoe import stage as S
from fmoe.stages import moe, qwen3_moe
from fmoe.stages.spec import StageContext

LOCAL_BATCH, SEQ, LOCAL_MICROBATCHES = 2, 8, 2
SCENARIOS = ("random", "all_to_one_expert", "last_rank_gets_none")
# float32 gradients summed over ep x microbatches = at most 8 parts in another order than the
# sequential run's: each element within ~8 roundings (8 x 2^-24 = 4.8e-7) of its magnitude
GRAD_RTOL = 1e-6


def scenario(name: str):
    """(cfg, full params, global batch factory) of a routing scenario; routing forced by the bias."""
    if name == "random":
        cfg = tiny_config(num_hidden_layers=3, mlp_only_layers=(0,))
    elif name == "all_to_one_expert":
        cfg = tiny_config(num_hidden_layers=3, mlp_only_layers=(0,), num_experts_per_tok=1,
                          moe_router_bias_update_rate=0.01)  # fmt: skip
    else:
        cfg = tiny_config(num_hidden_layers=3, mlp_only_layers=(0,), moe_router_bias_update_rate=0.01)
    params = qwen3_moe.init_params(cfg, seed=5)
    for layer in (1, 2):
        name_b = qwen3_moe.router_bias_name(layer)
        if name == "all_to_one_expert":
            params[name_b] = torch.zeros(cfg.num_experts).index_fill_(0, torch.tensor([5]), 10.0)
        elif name == "last_rank_gets_none":  # experts 4..7 (the last rank's at ep 2) never chosen
            params[name_b] = torch.zeros(cfg.num_experts).index_fill_(0, torch.tensor([4, 5, 6, 7]), -10.0)
    return cfg, params


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CountHostReads:
    """Counts Tensor.tolist / .item calls, split into reads of one allowed (CPU) tensor and others."""

    def __init__(self, allowed: torch.Tensor | None = None):
        self.allowed, self.other, self.of_allowed = allowed, 0, 0

    def __enter__(self):
        self.saved = torch.Tensor.tolist, torch.Tensor.item
        counter = self

        def wrap(fn):
            def counted(t, *a, **k):
                ok = counter.allowed is not None and t.device.type == "cpu"
                ok = ok and t.untyped_storage().data_ptr() == counter.allowed.untyped_storage().data_ptr()
                if ok:
                    counter.of_allowed += 1
                else:
                    counter.other += 1
                return fn(t, *a, **k)

            return counted

        torch.Tensor.tolist, torch.Tensor.item = wrap(self.saved[0]), wrap(self.saved[1])
        return self

    def __exit__(self, *exc):
        torch.Tensor.tolist, torch.Tensor.item = self.saved


def host_syncs_of_one_layer(model, params_local, batch_local, group) -> dict[str, int]:
    """Host reads in F and B of layer 1's dispatch and combine (mlp, whose CPU grouped GEMM loops
    over offsets in Python, is not counted)."""
    ctx = StageContext(groups={"ep": group})
    mb = runner.with_positions(batch_local)
    carry, fwds, counts = (), {}, {}
    for stage in model.stages:
        if stage.name == "layers.1.aggregate":
            break
        inputs = runner.stage_inputs(stage, carry, mb)
        kind = stage.name.split(".")[-1]
        with CountHostReads(inputs[-1] if kind == "combine" else None) as c:
            outputs, fwds[kind] = S.forward(stage, params_local, inputs, ctx)
        counts[kind] = c
        carry, _ = runner.split_outputs(stage, outputs)
    with CountHostReads() as combine_b:
        g, _ = S.backward_input(fwds["combine"], [torch.ones_like(carry[0]), torch.ones_like(carry[1]), None])
    g, _ = S.backward_input(fwds["mlp"], list(g))
    with CountHostReads() as dispatch_b:
        S.backward_input(fwds["dispatch"], list(g))
    return {
        "dispatch_f": counts["dispatch"].other,
        "combine_f_device": counts["combine"].other,
        "combine_f_cpu_splits": counts["combine"].of_allowed,
        "combine_b": combine_b.other,
        "dispatch_b": dispatch_b.other,
    }


def worker(rank: int, ep: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ep)
    torch.manual_seed(0)
    results = {}
    for name in SCENARIOS:
        cfg, params = scenario(name)
        model = qwen3_moe.build(cfg)
        batch = random_batch(cfg, LOCAL_BATCH * ep, SEQ, seed=11)
        local = {k: v[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH] for k, v in batch.items()}
        params_local = EP.shard_params(params, model.expert_params, ep, rank)
        runs = []
        for _ in range(2):
            res = EP.ep_step(model, params_local, local, LOCAL_MICROBATCHES, dist.group.WORLD)
            runs.append(
                {
                    "loss": res.loss,
                    "grads": EP.all_gather_expert_params(res.grads, model.expert_params, dist.group.WORLD),
                    "local_grads": res.grads,
                    "loads": res.expert_loads,
                }
            )
        results[name] = runs
        if name == "random":
            results["syncs"] = host_syncs_of_one_layer(model, params_local, local, dist.group.WORLD)
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 4], ids=lambda ep: f"ep{ep}")
def ep_run(request, tmp_path_factory):
    ep = request.param
    out = tmp_path_factory.mktemp(f"ep{ep}")
    mp.spawn(worker, args=(ep, free_port(), str(out)), nprocs=ep, join=True)
    return ep, [torch.load(out / f"rank{r}.pt") for r in range(ep)]


def reference(name: str, ep: int):
    cfg, params = scenario(name)
    model = qwen3_moe.build(cfg)
    batch = random_batch(cfg, LOCAL_BATCH * ep, SEQ, seed=11)
    return cfg, runner.run_sequential(model, params, batch, num_microbatches=ep * LOCAL_MICROBATCHES)


@pytest.mark.parametrize("name", SCENARIOS)
def test_ep_loss_bitwise_and_grads_equal_the_sequential_reference(ep_run, name):
    ep, ranks = ep_run
    cfg, ref = reference(name, ep)
    experts = qwen3_moe.build(cfg).expert_params
    for r, result in enumerate(ranks):
        got = result[name][0]
        assert torch.equal(got["loss"], ref.loss), f"rank {r}: loss {got['loss']} != {ref.loss}"
        assert set(got["grads"]) == set(ref.grads)
        for n, g in ref.grads.items():
            err = relative_error(got["grads"][n], g)
            assert err <= GRAD_RTOL, f"rank {r} {n}: relative error {err}"
            if n in experts:  # each rank's own gradient is the reference's slice
                start, stop = EP.expert_range(g.shape[0], ep, r)
                err = relative_error(got["local_grads"][n], g[start:stop])
                assert err <= GRAD_RTOL, f"rank {r} {n}: own experts' relative error {err}"


def test_the_skewed_scenarios_route_as_claimed(ep_run):
    ep, ranks = ep_run
    loads = {name: ranks[0][name][0]["loads"] for name in SCENARIOS}
    for layer, load in loads["all_to_one_expert"].items():
        assert load[5].item() == load.sum().item() > 0, f"layer {layer}: {load}"
    for layer, load in loads["last_rank_gets_none"].items():
        # experts 4..7: rank 1 of 2, ranks 2 and 3 of 4 receive no tokens at all
        assert load[4:].sum().item() == 0 and load[:4].sum().item() > 0, f"layer {layer}: {load}"
    # loads are global (all ranks, all microbatches): T * k slots per microbatch
    for name in SCENARIOS:
        k = 1 if name == "all_to_one_expert" else 2
        for load in loads[name].values():
            assert load.sum().item() == ep * LOCAL_BATCH * SEQ * k


def test_the_same_ep_step_twice_is_bitwise_identical(ep_run):
    _, ranks = ep_run
    for result in ranks:
        for name in SCENARIOS:
            first, second = result[name]
            assert torch.equal(first["loss"], second["loss"])
            for n, g in first["local_grads"].items():
                assert torch.equal(g, second["local_grads"][n]), f"{name} {n}"


def test_dispatch_syncs_the_host_once_and_combine_and_backwards_never(ep_run):
    _, ranks = ep_run
    for result in ranks:
        syncs = result["syncs"]
        assert syncs["dispatch_f"] == 1, syncs
        assert syncs["combine_f_device"] == 0 and syncs["combine_b"] == 0 and syncs["dispatch_b"] == 0, syncs
        assert syncs["combine_f_cpu_splits"] >= 1, syncs  # it reads the split sizes, from the CPU


# ---------------------------------------------------------------------------------------------
# one process


def test_ep_step_without_a_group_equals_run_sequential_bitwise():
    cfg, params = scenario("random")
    model = qwen3_moe.build(cfg)
    batch = random_batch(cfg, 4, SEQ, seed=3)
    ref = runner.run_sequential(model, params, batch, num_microbatches=2)
    got = EP.ep_step(model, params, batch, 2, None)
    assert torch.equal(got.loss, ref.loss)
    for n, g in ref.grads.items():
        assert torch.equal(got.grads[n], g), n
    ids_load = sum(got.expert_loads.values())
    assert ids_load.sum().item() == 2 * 4 * SEQ * cfg.num_experts_per_tok


def layer_outputs(cfg, params, batch):
    """(dispatch inputs, combine output y [T, k, H]) of layer 1."""
    model = qwen3_moe.build(cfg)
    mb = runner.with_positions(batch)
    carry = ()
    for stage in model.stages:
        inputs = runner.stage_inputs(stage, carry, mb)
        if stage.name == "layers.1.dispatch":
            dispatch_inputs = inputs
        carry, _ = runner.split_outputs(stage, S.call(stage, params, inputs, StageContext()))
        if stage.name == "layers.1.combine":
            return dispatch_inputs, carry[1]
    raise AssertionError("no layer 1")


def per_token_experts(x: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor):
    """Each slot's expert output by definition, one token at a time: x [T, H], ids [T, k] ->
    [T, k, H], expert e = SwiGLU with gate_up[e] [2I, H] laid out [gate | up] and down[e] [H, I]."""
    out = torch.empty(*ids.shape, x.shape[1], dtype=x.dtype)
    for t in range(ids.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t, j] = down[e] @ (torch.nn.functional.silu(gate) * up)
    return out


@pytest.mark.parametrize("name", SCENARIOS)
def test_moe_layer_equals_each_token_run_through_its_chosen_experts_one_by_one(name):
    """The grouped path (sort by expert, offsets, grouped GEMMs, un-permute) against no grouping
    at all, so that a wrong offset or order cannot hide in a reference that shares it."""
    cfg, params = scenario(name)
    (_, x, ids, _), y = layer_outputs(cfg, params, random_batch(cfg, 2, SEQ, seed=3))
    prefix = "model.layers.1.mlp.experts."
    want = per_token_experts(x, ids, params[prefix + "gate_up_proj"], params[prefix + "down_proj"])
    # float32, two chained products over at most 2I = 32 terms each, in another order: within
    # ~2 x 32 roundings (64 x 2^-24 = 3.8e-6) of each output's magnitude
    err = relative_error(y, want)
    assert err <= 1e-5, f"{name}: relative error {err}"


def test_capacity_drops_the_later_slots_of_each_expert_and_zeroes_them():
    cfg, params = scenario("random")
    batch = random_batch(cfg, 2, SEQ, seed=3)
    (_, _, ids, _), y_full = layer_outputs(cfg, params, batch)
    factor = 0.5
    (_, _, ids_c, _), y_cap = layer_outputs(
        qwen3_moe.Qwen3MoeConfig(**{**cfg.__dict__, "moe_capacity_factor": factor}), params, batch
    )
    assert torch.equal(ids, ids_c)
    cap = moe.capacity(factor, ids.numel(), cfg.num_experts)
    flat = ids.reshape(-1)
    kept = torch.zeros(flat.numel(), dtype=torch.bool)
    for e in range(cfg.num_experts):
        slots = (flat == e).nonzero().flatten()  # slot order = token order: the deterministic order
        kept[slots[:cap]] = True
    assert (~kept).any() and kept.any(), "the capacity must drop some slots and keep others"
    y_cap, y_full = y_cap.reshape(flat.numel(), -1), y_full.reshape(flat.numel(), -1)
    assert torch.equal(y_cap[~kept], torch.zeros_like(y_cap[~kept]))
    torch.testing.assert_close(y_cap[kept], y_full[kept], rtol=1e-6, atol=1e-6)


def test_a_capacity_that_drops_nothing_equals_the_dropless_path():
    cfg, params = scenario("random")
    batch = random_batch(cfg, 2, SEQ, seed=4)
    _, y_full = layer_outputs(cfg, params, batch)
    big = qwen3_moe.Qwen3MoeConfig(**{**cfg.__dict__, "moe_capacity_factor": float(cfg.num_experts)})
    _, y_big = layer_outputs(big, params, batch)
    torch.testing.assert_close(y_big, y_full, rtol=1e-6, atol=1e-6)


def test_shard_then_gather_gives_back_the_params():
    cfg, params = scenario("random")
    experts = qwen3_moe.build(cfg).expert_params
    shards = [EP.shard_params(params, experts, 4, r) for r in range(4)]
    name = "model.layers.1.mlp.experts.gate_up_proj"
    assert shards[1][name].shape[0] == 2 and torch.equal(shards[1][name], params[name][2:4])
    router = "model.layers.1.mlp.gate.weight"
    assert router not in experts and shards[1][router] is params[router]
    back = EP.gather_shards(shards, experts)
    assert set(back) == set(params) and all(torch.equal(back[n], params[n]) for n in params)
    with pytest.raises(ValueError, match="divisible"):
        EP.shard_params(params, experts, 3, 0)


def test_router_bias_update_moves_load_from_busy_to_idle_experts():
    cfg, params = scenario("random")
    cfg = qwen3_moe.Qwen3MoeConfig(**{**cfg.__dict__, "moe_router_bias_update_rate": 0.5})
    params = qwen3_moe.init_params(cfg, seed=5)
    name = qwen3_moe.router_bias_name(1)
    assert name in qwen3_moe.build(cfg).param_names() and torch.equal(params[name], torch.zeros(8))
    load = torch.tensor([9, 0, 1, 2, 2, 1, 1, 0])
    new = moe.update_router_bias(params, {name: load}, 0.5)
    assert torch.equal(new[name], torch.tensor([-0.5, 0.5, 0.5, 0, 0, 0.5, 0.5, 0.5]))
    assert torch.equal(params[name], torch.zeros(8)), "update_router_bias must not mutate its input"
    # a large bias on expert 3 makes every token choose it, and no gradient reaches the bias
    params[name] = torch.zeros(8).index_fill_(0, torch.tensor([3]), 5.0)
    (_, _, ids, _), _ = layer_outputs(cfg, params, random_batch(cfg, 2, SEQ))
    assert (ids == 3).any(dim=1).all()
    res = runner.run_sequential(qwen3_moe.build(cfg), params, random_batch(cfg, 2, SEQ))
    assert torch.equal(res.grads[name], torch.zeros(8))


def test_bad_capacity_factor_names_the_field():
    with pytest.raises(ValueError, match="moe_capacity_factor"):
        tiny_config(moe_capacity_factor=0.0)
