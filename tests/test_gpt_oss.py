"""GPT-OSS: stage gradients against autograd, sink / sliding-window attention against a direct
reference, logits parity with transformers' GptOssForCausalLM after export and import, and
DualPipeV at pp 2 against the sequential runner."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_pipeline_matches_sequential, assert_runner_matches_autograd, random_batch
from test_deepseek_v2 import (
    RECIPES,
    assert_b_and_w_equal_autograd,
    assert_ep2_matches_sequential,
    stage_cases,
    tiny_recipe_trains,
)

from fmoe import hf, recipe
from fmoe.stages import gpt_oss

STAGES = ["embed"] + [
    f"layers.{i}.{n}" for i in (0, 1) for n in ("attn", "dispatch", "mlp", "combine", "aggregate")
]
STAGES += ["head"]


def tiny(**overrides) -> gpt_oss.GptOssConfig:
    """A tiny GPT-OSS: 2 layers (sliding window 4, then full), YaRN, clamp limit low enough to bind."""
    fields = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=4,
        swiglu_limit=0.5,
        router_aux_loss_coef=0.01,
        rope_scaling={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                      "truncate": False, "original_max_position_embeddings": 16},
        max_position_embeddings=128,
    )  # fmt: skip
    fields.update(overrides)
    return gpt_oss.GptOssConfig(**fields)


def with_random_biases(params: dict, seed: int = 1, scale: float = 0.3) -> dict:
    """Init leaves biases at zero; make them matter (and the sinks larger) for the checks."""
    gen = torch.Generator().manual_seed(seed)
    return {
        n: (
            t + scale * torch.randn(t.shape, generator=gen, dtype=t.dtype)
            if n.endswith(("bias", "sinks"))
            else t
        )
        for n, t in params.items()
    }


@pytest.fixture(scope="module")
def float64_cases():
    # 16 experts, top-2 over 6 tokens: at most 12 slots, so several experts get no tokens
    cfg = tiny(num_local_experts=16, initializer_range=0.3, sliding_window=2)
    model = gpt_oss.build(cfg)
    params = with_random_biases(model.init(seed=1, dtype=torch.float64))
    return params, stage_cases(model, params, random_batch(cfg, 2, 3))


@pytest.mark.parametrize("wanted", STAGES)
def test_every_stage_b_and_w_equal_autograd_in_float64(float64_cases, wanted):
    params, cases = float64_cases
    names = [s.name for s, _ in cases]
    assert names == STAGES
    stage, inputs = cases[names.index(wanted)]
    if wanted.endswith(".mlp"):
        offs = inputs[4]
        assert (torch.diff(offs, prepend=offs.new_zeros(1)) == 0).any(), "some expert must get no tokens"
        assert any(n.endswith("gate_up_proj_bias") for n in stage.params)
    if wanted.endswith(".attn"):
        assert stage.losses and any(n.endswith("self_attn.sinks") for n in stage.params)
    assert_b_and_w_equal_autograd(stage, params, inputs)


def test_sink_attention_equals_a_per_query_softmax_with_the_sink_and_the_window():
    gen = torch.Generator().manual_seed(0)
    b, hq, hkv, s, d, window = 2, 4, 2, 7, 8, 3
    q = torch.randn(b, hq, s, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, hkv, s, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, hkv, s, d, generator=gen, dtype=torch.float64)
    sinks = torch.randn(hq, generator=gen, dtype=torch.float64)
    for w in (window, None):
        out = gpt_oss.sink_attention(q, k, v, sinks, torch.arange(s), 0.3, w)
        ref = torch.empty_like(out)
        for h in range(hq):
            kv = h // (hq // hkv)
            for i in range(s):
                lo = 0 if w is None else max(0, i - w + 1)
                logits = torch.einsum("bd,bnd->bn", q[:, h, i], k[:, kv, lo : i + 1]) * 0.3
                e = torch.exp(logits - logits.amax(-1, keepdim=True))
                z = e.sum(-1, keepdim=True) + torch.exp(sinks[h] - logits.amax(-1, keepdim=True))
                ref[:, h, i] = torch.einsum("bj,bjd->bd", e / z, v[:, kv, lo : i + 1])
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("variant", ["yarn_bias", "plain_rope_no_attention_bias"])
def test_export_loads_in_transformers_with_equal_logits_and_imports_back_identically(tmp_path, variant):
    transformers = pytest.importorskip("transformers")
    if variant == "yarn_bias":
        cfg = tiny(initializer_range=0.2)
    else:
        cfg = tiny(initializer_range=0.2, rope_scaling=None, attention_bias=False,
                   layer_types=("full_attention", "sliding_attention"))  # fmt: skip
    params = with_random_biases(gpt_oss.init_params(cfg, seed=7))
    folder = hf.export_hf("gpt_oss", cfg, params, tmp_path / "hf")

    model, info = transformers.GptOssForCausalLM.from_pretrained(
        folder, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = model.eval()(tokens).logits
        ours = gpt_oss.logits(cfg, params, tokens)
    assert theirs.abs().max() > 0.5, "logits too small for the comparison to mean anything"
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # the clamp binds: the same weights without it give other logits
    unclamped = gpt_oss.logits(tiny(**{**cfg.__dict__, "swiglu_limit": 1e4}), params, tokens)
    assert (unclamped - ours).abs().max() > 1e-3

    family, cfg_back, params_back = hf.import_hf(folder)
    assert family == "gpt_oss" and cfg_back == cfg
    assert set(params_back) == set(params)
    for name, t in params.items():
        assert torch.equal(params_back[name], t), name


def test_import_of_a_quantized_checkpoint_says_to_dequantize(tmp_path):
    from safetensors.torch import load_file, save_file

    cfg = tiny()
    folder = hf.export_hf("gpt_oss", cfg, gpt_oss.init_params(cfg), tmp_path / "hf")
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj"
    tensors[name + "_blocks"] = torch.zeros(1, dtype=torch.uint8)
    del tensors[name]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"down_proj' MXFP4-quantized.*dequantized"):
        hf.import_hf(folder)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(layer_types=("full_attention",)), "layer_types"),
        (dict(layer_types=("full_attention", "local")), r"layer_types\[1\]"),
        (dict(sliding_window=None), "sliding_window"),
        (dict(num_key_value_heads=3), "num_key_value_heads"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok"),
        (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_type"),
    ],
)
def test_bad_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny(**overrides)


def test_runner_loss_bitwise_equals_autograd_and_grads_match():
    cfg = tiny(num_hidden_layers=3)
    model = gpt_oss.build(cfg)
    assert_runner_matches_autograd(model, with_random_biases(model.init(seed=3)), random_batch(cfg, 4, 8))


def test_dualpipev_at_pp2_loss_bitwise_equals_sequential():
    cfg = tiny(num_hidden_layers=4)
    model = gpt_oss.build(cfg)
    assert_pipeline_matches_sequential(
        "dualpipev", model, with_random_biases(model.init(seed=1)), random_batch(cfg, 4, 8, seed=5)
    )


def test_tiny_recipe_trains_and_real_recipe_has_gpt_oss_20b_size(tmp_path):
    losses = tiny_recipe_trains("gpt_oss_tiny.toml", tmp_path)
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5, losses
    real = recipe.load(RECIPES / "gpt_oss_20b.toml")
    assert real.model_family == "gpt_oss" and real.train.dtype == "bfloat16" and real.train.device == "cuda"
    assert real.model.layer_types[:2] == ("sliding_attention", "full_attention")
    total = sum(math.prod(s) for s in gpt_oss.param_shapes(real.model).values())
    assert abs(total / 20.91e9 - 1) < 0.005, f"{total:,} parameters; gpt-oss-20b has 20.91B"


def test_expert_parallel_ep2_loss_bitwise_equals_sequential():
    cfg = tiny(num_hidden_layers=2)
    assert_ep2_matches_sequential("gpt_oss", cfg, with_random_biases(gpt_oss.init_params(cfg, seed=5)))
