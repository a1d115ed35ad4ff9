"""DeepSeek-V2 / V2-Lite: stage gradients against autograd, logits parity with transformers'
DeepseekV2ForCausalLM after export and import, and DualPipeV at pp 2 against the sequential runner."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import assert_pipeline_matches_sequential, assert_runner_matches_autograd, random_batch

from fmoe import data, expert_parallel, hf, recipe, runner
from fmoe import dist as dist_helpers
from fmoe import stage as S
from fmoe.stages import deepseek_v2
from fmoe.stages.spec import StageContext
from fmoe.train import train

# layer 0 dense (first_k_dense_replace=1), layer 1 MoE
STAGES = ["embed", "layers.0.attn", "layers.0.mlp", "layers.0.aggregate"]
STAGES += [f"layers.1.{n}" for n in ("attn", "dispatch", "mlp", "combine", "aggregate")] + ["head"]
YARN = {
    "type": "yarn",
    "factor": 40,
    "original_max_position_embeddings": 16,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.9,  # != mscale: both the softmax scale and the rotary magnitude change
}


def tiny(**overrides) -> deepseek_v2.DeepseekV2Config:
    """A tiny V2 (query compression, group-limited routing, YaRN); V2-Lite-like with q_lora_rank=None."""
    fields = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        kv_lora_rank=16,
        q_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        n_routed_experts=8,
        n_shared_experts=2,
        num_experts_per_tok=2,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
        moe_intermediate_size=16,
        intermediate_size=40,
        first_k_dense_replace=1,
        rope_scaling=YARN,
        max_position_embeddings=640,
        aux_loss_alpha=0.01,
    )
    fields.update(overrides)
    return deepseek_v2.DeepseekV2Config(**fields)


def stage_cases(model, params, batch):
    """(stage, inputs) for every stage, inputs taken from a real forward."""
    batch = runner.with_positions(batch)
    carry, cases = (), []
    for stage in model.stages:
        inputs = runner.stage_inputs(stage, carry, batch)
        cases.append((stage, inputs))
        carry, _ = runner.split_outputs(stage, S.call(stage, params, inputs, StageContext()))
    return cases


def assert_b_and_w_equal_autograd(stage, params, inputs, seed=2, loss_scale=0.5):
    """Derived B and W of ``stage`` against plain autograd of <outputs, random cotangents> + loss terms."""
    outputs, fwd = S.forward(stage, params, inputs, StageContext())
    carried = outputs[: len(outputs) - len(stage.losses)]
    gen = torch.Generator().manual_seed(seed)
    grad_outputs = [
        torch.randn(o.shape, generator=gen, dtype=o.dtype) if o.is_floating_point() else None for o in carried
    ]
    grad_inputs, work = S.backward_input(fwd, grad_outputs, loss_scale=loss_scale)
    grads = S.backward_weight(work)

    p = {n: params[n].clone().requires_grad_() for n in stage.params}
    x = [t.clone().requires_grad_() if t.is_floating_point() else t for t in inputs]
    ref_out = S.call(stage, p, x, StageContext())
    total = sum((o * g).sum() for o, g in zip(ref_out, grad_outputs) if g is not None)
    total = total + sum(w * loss_scale * ref_out[len(carried) + i] for i, w in enumerate(stage.losses))
    total.backward()
    for i, (g, t) in enumerate(zip(grad_inputs, x)):
        if not t.is_floating_point():
            assert g is None, f"{stage.name}: integer input {i} got a gradient"
            continue
        assert g is not None, f"{stage.name}: input {i} got no gradient"
        torch.testing.assert_close(g, t.grad, rtol=1e-10, atol=1e-10, msg=f"{stage.name} input {i}")
    assert set(grads) == {n for n in stage.params if p[n].grad is not None}
    for n in stage.params:
        if p[n].grad is not None:
            torch.testing.assert_close(grads[n], p[n].grad, rtol=1e-10, atol=1e-10, msg=f"{stage.name} {n}")


@pytest.fixture(scope="module")
def float64_cases():
    # 16 experts, top-2 over 6 tokens: at most 12 slots, so several experts get no tokens
    cfg = tiny(n_routed_experts=16, n_group=4, topk_group=2)
    model = deepseek_v2.build(cfg)
    params = model.init(seed=1, dtype=torch.float64)
    return params, stage_cases(model, params, random_batch(cfg, 2, 3))


@pytest.mark.parametrize("wanted", STAGES)
def test_every_stage_b_and_w_equal_autograd_in_float64(float64_cases, wanted):
    params, cases = float64_cases
    names = [s.name for s, _ in cases]
    assert names == STAGES
    stage, inputs = cases[names.index(wanted)]
    if wanted == "layers.1.mlp":
        offs = inputs[5]
        assert (torch.diff(offs, prepend=offs.new_zeros(1)) == 0).any(), "some expert must get no tokens"
        assert any("shared_experts" in n for n in stage.params)
    if wanted == "layers.1.attn":
        assert stage.losses and any("q_a_proj" in n for n in stage.params)
    assert_b_and_w_equal_autograd(stage, params, inputs)


def test_group_limited_routing_keeps_to_the_best_groups_and_scales_weights():
    cfg = tiny(n_routed_experts=16, n_group=4, topk_group=1, routed_scaling_factor=2.0)
    x = torch.randn(50, cfg.hidden_size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    gate = torch.randn(16, cfg.hidden_size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    probs, w, ids = deepseek_v2.router(cfg, x, gate)
    best_group = probs.view(50, 4, 4).amax(-1).argmax(-1)
    assert torch.equal(ids // 4, best_group[:, None].expand_as(ids)), "top-k left the best group"
    torch.testing.assert_close(w, 2.0 * probs.gather(1, ids))
    greedy = deepseek_v2.router(tiny(n_routed_experts=16, topk_method="greedy"), x, gate)[2]
    assert not torch.equal(greedy.sort(-1).values, ids.sort(-1).values), "the group limit never mattered"


@pytest.mark.parametrize("variant", ["v2", "v2_lite"])
def test_export_loads_in_transformers_with_equal_logits_and_imports_back_identically(tmp_path, variant):
    transformers = pytest.importorskip("transformers")
    if variant == "v2":
        cfg = tiny(initializer_range=0.2)
    else:  # V2-Lite: no query compression, greedy routing, shared experts, plain RoPE
        cfg = tiny(initializer_range=0.2, q_lora_rank=None, topk_method="greedy", n_group=None,
                   topk_group=None, routed_scaling_factor=1.0, rope_scaling=None)  # fmt: skip
    params = deepseek_v2.init_params(cfg, seed=7)
    folder = hf.export_hf("deepseek_v2", cfg, params, tmp_path / "hf")

    model, info = transformers.DeepseekV2ForCausalLM.from_pretrained(
        folder, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    tokens = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = model.eval()(tokens).logits
        ours = deepseek_v2.logits(cfg, params, tokens)
    assert theirs.abs().max() > 0.5, "logits too small for the comparison to mean anything"
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)

    family, cfg_back, params_back = hf.import_hf(folder)
    assert family == "deepseek_v2" and cfg_back == cfg
    assert set(params_back) == set(params)
    for name, t in params.items():
        assert torch.equal(params_back[name], t), name


def test_import_reads_the_hub_config_format_and_a_missing_expert_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    cfg = tiny()
    folder = hf.export_hf("deepseek_v2", cfg, deepseek_v2.init_params(cfg), tmp_path / "hf")
    hub = {k: v for k, v in deepseek_v2.hf_config(cfg).items() if k != "rope_parameters"}
    hub.update(rope_theta=cfg.rope_theta, rope_scaling=YARN)  # the hub's pre-transformers-5 keys
    assert deepseek_v2.config_from_hf(hub) == cfg
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.5.down_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"lacks tensor 'model\.layers\.1\.mlp\.experts\.5\.down_proj\.weight'"
    ):
        hf.import_hf(folder)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(num_key_value_heads=2), "num_key_value_heads"),
        (dict(topk_method="noaux_tc"), "topk_method"),
        (dict(n_group=3), "n_group"),
        (dict(norm_topk_prob=True), "norm_topk_prob"),
        (dict(rope_scaling={"type": "yarn", "factor": 4}), "original_max_position_embeddings"),
        (dict(qk_rope_head_dim=5), "qk_rope_head_dim"),
    ],
)
def test_bad_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny(**overrides)


def test_runner_loss_bitwise_equals_autograd_and_grads_match():
    cfg = tiny(num_hidden_layers=3)
    model = deepseek_v2.build(cfg)
    assert_runner_matches_autograd(model, model.init(seed=3), random_batch(cfg, 4, 8))


def test_dualpipev_at_pp2_loss_bitwise_equals_sequential():
    cfg = tiny(num_hidden_layers=4)
    model = deepseek_v2.build(cfg)
    assert_pipeline_matches_sequential(
        "dualpipev", model, model.init(seed=1), random_batch(cfg, 4, 8, seed=5)
    )


RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def tiny_recipe_trains(recipe_name: str, tmp_path) -> list[float]:
    """Train a recipe for 8 steps on a small byte dataset in tmp_path; returns the step losses."""
    corpus = data.builtin_corpus(tmp_path / "corpus.txt", 100_000)
    data.build([corpus], tmp_path / "bytes", tokenizer="bytes", workers=1)
    overrides = {
        "data.path": str(tmp_path / "bytes"),
        "data.seq_len": 32,
        "train.steps": 8,
        "train.global_batch": 4,
        "optim.warmup": 1,
        "checkpoint.dir": str(tmp_path / "ckpt"),
        "checkpoint.every": 8,
        "log.dir": str(tmp_path / "log"),
        "log.progress": False,
    }
    return train(recipe.load(RECIPES / recipe_name, overrides)).losses


def test_tiny_recipe_trains_and_real_recipe_has_v2_lite_size(tmp_path):
    losses = tiny_recipe_trains("deepseek_v2_lite_tiny.toml", tmp_path)
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5, losses
    real = recipe.load(RECIPES / "deepseek_v2_lite.toml")
    assert (
        real.model_family == "deepseek_v2" and real.train.dtype == "bfloat16" and real.train.device == "cuda"
    )
    total = sum(math.prod(s) for s in deepseek_v2.param_shapes(real.model).values())
    assert abs(total / 15.7e9 - 1) < 0.005, f"{total:,} parameters; DeepSeek-V2-Lite has 15.7B"


def ep_worker(rank: int, world: int, group, family: str, cfg, params: dict) -> dict:
    """One ep rank's step over its half of the batch, against the sequential run of the whole batch."""
    model = hf.family(family).build(cfg)
    batch = random_batch(cfg, 2 * world, 8, seed=11)
    local = {k: v[rank * 2 : (rank + 1) * 2] for k, v in batch.items()}
    res = expert_parallel.ep_step(
        model, expert_parallel.shard_params(params, model.expert_params, world, rank), local, 2, group
    )
    ref = runner.run_sequential(model, params, batch, num_microbatches=2 * world)
    full = expert_parallel.all_gather_expert_params(res.grads, model.expert_params, group)
    return {
        "loss_equal": torch.equal(res.loss, ref.loss),
        "worst_rel": max(((g - ref.grads[n]).norm() / ref.grads[n].norm().clamp_min(1e-30)).item()
                         for n, g in full.items()),
    }  # fmt: skip


def assert_ep2_matches_sequential(family: str, cfg, params: dict) -> None:
    results = dist_helpers.spawn(ep_worker, 2, (family, cfg, params), timeout_s=170)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}"
        assert r.value["loss_equal"], f"rank {r.rank}: expert-parallel loss differs from the sequential one"
        assert r.value["worst_rel"] < 1e-5, f"rank {r.rank}: gradient relative error {r.value['worst_rel']}"


def test_expert_parallel_ep2_loss_bitwise_equals_sequential():
    cfg = tiny(num_hidden_layers=3)
    assert_ep2_matches_sequential("deepseek_v2", cfg, deepseek_v2.init_params(cfg, seed=5))
