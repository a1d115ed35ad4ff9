"""Hugging Face import trusts nothing it does not know (issue 17, defect 3).

Every config.json key is honoured, pinned to the values fmoe implements, or harmless metadata;
anything else, and any tensor the config does not imply (or implies at another shape), is refused
with a one-line ValueError naming it. Checkpoints are made on the spot (fmoe's own export, or a tiny
random transformers model saved with the installed transformers); nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config
from safetensors.torch import load_file, save_file

from fmoe import cli, hf
from fmoe.stages import deepseek_v2, gpt_oss, qwen3_moe

FAMILY_MODULES = {"qwen3_moe": qwen3_moe, "deepseek_v2": deepseek_v2, "gpt_oss": gpt_oss}


def _export(tmp_path, family: str, cfg, seed: int = 0):
    params = FAMILY_MODULES[family].init_params(cfg, seed=seed)
    return hf.export_hf(family, cfg, params, tmp_path / "hf"), params


def _tiny(family: str):
    if family == "qwen3_moe":
        return tiny_config()
    if family == "deepseek_v2":
        return deepseek_v2.DeepseekV2Config(num_hidden_layers=2)
    return gpt_oss.GptOssConfig(num_hidden_layers=2)


def _edit_config(folder, **changes) -> None:
    """Set (value) or delete (None passed as ``...``) config.json keys."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is ...:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def _edit_tensors(folder, drop=(), **add) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    for name in drop:
        del tensors[name]
    tensors.update({name.replace("__", "."): t for name, t in add.items()})
    save_file(tensors, path)


def _one_line_error(folder, match: str) -> str:
    with pytest.raises(ValueError, match=match) as info:
        hf.import_hf(folder)
    message = str(info.value)
    assert "\n" not in message
    return message


# ----------------------------------------------------------------------------------------------
# a Qwen3-MoE saved by the installed transformers, with an unusual config


def _transformers_qwen3_moe(tmp_path, **overrides):
    """A tiny random transformers Qwen3MoeForCausalLM in float64, saved to tmp_path / "hf"."""
    transformers = pytest.importorskip("transformers")
    kwargs = dict(
        vocab_size=101,  # odd
        hidden_size=32,
        intermediate_size=40,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,  # not hidden_size / heads
        num_experts=10,  # more than fmoe's default 8; saved as num_local_experts
        num_experts_per_tok=3,
        mlp_only_layers=[1],
        norm_topk_prob=False,
        tie_word_embeddings=False,
        attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        experts_implementation="eager",  # transformers' grouped_mm takes no float64 (not saved)
    )
    kwargs.update(overrides)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**kwargs)).to(torch.float64)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # every weight random and O(1)-ish, biases too, so each one matters
        for name, p in model.named_parameters():
            scale = 0.1 if name.endswith("norm.weight") else 0.3
            base = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(base + scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    return model.eval(), folder


def test_transformers_saved_qwen3_moe_with_unusual_config_imports_with_logits_and_gradient_parity(tmp_path):
    model, folder = _transformers_qwen3_moe(tmp_path)
    saved = json.loads((folder / "config.json").read_text())
    assert "num_local_experts" in saved and "num_experts" not in saved, "transformers 5 naming expected"

    family, cfg, params = hf.import_hf(folder)
    assert family == "qwen3_moe"
    assert (cfg.num_experts, cfg.head_size, cfg.vocab_size, cfg.mlp_only_layers) == (10, 12, 101, (1,))
    assert cfg.attention_bias and not cfg.norm_topk_prob and not cfg.tie_word_embeddings
    assert cfg.rope_theta == 5000.0
    assert all(t.dtype == torch.float64 for t in params.values())

    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)

    theirs = model(tokens).logits
    their_loss = F.cross_entropy(theirs.reshape(-1, cfg.vocab_size), labels.reshape(-1))
    their_loss.backward()
    leaves = {n: t.clone().requires_grad_() for n, t in params.items()}
    ours = qwen3_moe.logits(cfg, leaves, tokens)
    our_loss = F.cross_entropy(ours.reshape(-1, cfg.vocab_size), labels.reshape(-1))
    our_loss.backward()

    assert theirs.abs().max() > 1.0, "logits too small for the comparison to mean anything"
    # float64 throughout: both sides sum a few hundred terms per output, ~1e-14 relative apart;
    # 1e-9 leaves room for a different summation order and still catches any dropped term
    torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-9)
    # their gradients, through the family's name conversion (stacked experts as in fmoe)
    their_grads = qwen3_moe.from_hf(cfg, {n: p.grad for n, p in model.named_parameters()})
    assert set(their_grads) == set(params)
    for name, ref in their_grads.items():
        g = leaves[name].grad
        assert ref.norm() > 0, f"{name}: no gradient reached it; the comparison would be empty"
        assert ((g - ref).norm() / ref.norm()).item() <= 1e-9, name


def test_qwen3_moe_attention_bias_is_imported_and_used(tmp_path):
    # on 49ceb4b the q/k/v/o biases were dropped on import and the logits were off
    model, folder = _transformers_qwen3_moe(tmp_path, num_experts=8, mlp_only_layers=[])
    _, cfg, params = hf.import_hf(folder)
    assert cfg.attention_bias
    assert torch.equal(
        params["model.layers.0.self_attn.o_proj.bias"], model.model.layers[0].self_attn.o_proj.bias
    )
    tokens = torch.randint(0, cfg.vocab_size, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(
            qwen3_moe.logits(cfg, params, tokens), model(tokens).logits, rtol=1e-9, atol=1e-9
        )


def test_qwen3_moe_attention_bias_round_trips_through_export(tmp_path):
    cfg = tiny_config(attention_bias=True)
    params = qwen3_moe.init_params(cfg, seed=3)
    params = {n: (t + 0.5 if n.endswith("_proj.bias") else t) for n, t in params.items()}
    folder = hf.export_hf("qwen3_moe", cfg, params, tmp_path / "hf")
    assert json.loads((folder / "config.json").read_text())["attention_bias"] is True
    _, cfg_back, params_back = hf.import_hf(folder)
    assert cfg_back == cfg and set(params_back) == set(params)
    tokens = torch.randint(0, cfg.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    no_bias = {n: (torch.zeros_like(t) if n.endswith("_proj.bias") else t) for n, t in params.items()}
    assert (qwen3_moe.logits(cfg, params, tokens) - qwen3_moe.logits(cfg, no_bias, tokens)).abs().max() > 1e-3


def _randomized(model):
    """Every weight of a transformers model random and O(1)-ish (norm weights near 1), seeded."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = name.endswith("norm.weight")
            p.copy_(
                (1.0 if norm else 0.0)
                + (0.1 if norm else 0.3) * torch.randn(p.shape, generator=gen, dtype=p.dtype)
            )
    return model.eval()


@pytest.mark.parametrize("family", ["deepseek_v2", "gpt_oss"])
def test_transformers_saved_deepseek_v2_and_gpt_oss_import_with_logits_parity(tmp_path, family):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=77, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=32, experts_implementation="eager")  # fmt: skip
    if family == "deepseek_v2":
        yarn = dict(
            rope_type="yarn", factor=4.0, original_max_position_embeddings=8, mscale=0.7, mscale_all_dim=0.7
        )
        config = transformers.DeepseekV2Config(
            **common, intermediate_size=40, moe_intermediate_size=16, n_routed_experts=6, n_shared_experts=1,
            num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8,
            qk_rope_head_dim=4, v_head_dim=8, rope_parameters={**yarn, "rope_theta": 1000.0},
        )  # fmt: skip
        model = _randomized(transformers.DeepseekV2ForCausalLM(config).to(torch.float64))
    else:
        yarn = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8, beta_fast=32.0, beta_slow=1.0,
                    truncate=False)  # fmt: skip
        config = transformers.GptOssConfig(
            **common, intermediate_size=16, num_key_value_heads=2, head_dim=8, num_local_experts=6,
            num_experts_per_tok=2, sliding_window=4, rope_parameters={**yarn, "rope_theta": 1000.0},
        )  # fmt: skip
        model = _randomized(transformers.GptOssForCausalLM(config).to(torch.float64))
    model.save_pretrained(tmp_path / "hf")

    name, cfg, params = hf.import_hf(tmp_path / "hf")
    assert name == family and cfg.num_experts == 6 and cfg.vocab_size == 77 and cfg.rope_scaling == yarn
    tokens = torch.randint(0, 77, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = FAMILY_MODULES[family].logits(cfg, params, tokens), model(tokens).logits
    assert theirs.abs().max() > 1.0, "logits too small for the comparison to mean anything"
    # float64 except the rotary tables, float32 on both sides: cos/sin of the same float32 angles
    # differ by an ulp (6e-8 relative) between the two codes' kernels, and logits of size ~10 carry
    # that as ~1e-6; 1e-5 is ten times that, far below what a wrong field would give
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# the expert count under transformers 5's name


def test_num_local_experts_sets_the_expert_count(tmp_path):
    # on 49ceb4b num_local_experts was ignored: 8 experts assumed, experts 8 and 9 silently dropped
    cfg = tiny_config(num_experts=10)
    folder, params = _export(tmp_path, "qwen3_moe", cfg)
    _edit_config(folder, num_experts=..., num_local_experts=10)
    _, cfg_back, params_back = hf.import_hf(folder)
    assert cfg_back.num_experts == 10
    for name, t in params.items():
        assert torch.equal(params_back[name], t), name


def test_num_local_experts_fewer_than_eight_imports(tmp_path):
    # on 49ceb4b: "lacks tensor ...experts.6..." (8 assumed)
    cfg = tiny_config(num_experts=6)
    folder, _ = _export(tmp_path, "qwen3_moe", cfg)
    _edit_config(folder, num_experts=..., num_local_experts=6)
    assert hf.import_hf(folder)[1].num_experts == 6


def test_disagreeing_expert_counts_are_refused(tmp_path):
    folder, _ = _export(tmp_path, "qwen3_moe", tiny_config())
    _edit_config(folder, num_local_experts=16)
    _one_line_error(folder, r"'num_local_experts' \(16\) and 'num_experts' \(8\) disagree")


# ----------------------------------------------------------------------------------------------
# config fields that change the math: honoured, or refused by name


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
def test_hidden_act_other_than_silu_is_refused(tmp_path, family):
    folder, _ = _export(tmp_path, family, _tiny(family))
    _edit_config(folder, hidden_act="gelu")
    _one_line_error(folder, r"field 'hidden_act' = \"gelu\" is not supported.*silu")


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        (dict(use_sliding_window=True, sliding_window=16), "field 'use_sliding_window'"),
        (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}),
         r"rope_parameters\.rope_type must be 'yarn' \(or 'default'\), got 'linear'"),
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}),
         r"rope_parameters\.original_max_position_embeddings must be a number"),
        (dict(rope_parameters=..., rope_theta=1e6, rope_scaling={"type": "linear", "factor": 2.0}),
         r"rope_scaling\.rope_type must be 'yarn'"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}),
         r"rope_parameters: unknown key 'partial_rotary_factor'"),
        (dict(attention_dropout=0.1), "field 'attention_dropout'"),
    ],
    ids=["sliding_window", "rope_linear", "rope_yarn_incomplete", "legacy_rope_scaling", "partial_rotary",
         "attention_dropout"],
)  # fmt: skip
def test_qwen3_moe_fields_without_fmoe_math_are_refused_by_name(tmp_path, changes, field):
    folder, _ = _export(tmp_path, "qwen3_moe", tiny_config())
    _edit_config(folder, **changes)
    _one_line_error(folder, field)


def test_qwen3_moe_yarn_rope_scaling_is_imported_with_logits_parity(tmp_path):
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
    model, folder = _transformers_qwen3_moe(
        tmp_path, num_experts=8, rope_parameters={**yarn, "rope_theta": 5000.0}, max_position_embeddings=32
    )
    _, cfg, params = hf.import_hf(folder)
    assert cfg.rope_scaling == yarn and cfg.rope_theta == 5000.0
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, theirs = qwen3_moe.logits(cfg, params, tokens), model(tokens).logits
        plain = qwen3_moe.logits(dataclasses.replace(cfg, rope_scaling=None), params, tokens)
    torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-9)
    assert (plain - theirs).abs().max() > 1e-3, "the scaling changed nothing; the test would be empty"
    # and back out: transformers reads fmoe's export of it to the same logits
    transformers = pytest.importorskip("transformers")
    out = hf.export_hf("qwen3_moe", cfg, params, tmp_path / "back")
    again = transformers.Qwen3MoeForCausalLM.from_pretrained(
        out, dtype=torch.float64, experts_implementation="eager"
    )
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(tokens).logits, theirs, rtol=1e-9, atol=1e-9)


def test_qwen3_moe_sliding_window_without_use_sliding_window_is_inert_and_accepted(tmp_path):
    cfg = tiny_config()
    folder, _ = _export(tmp_path, "qwen3_moe", cfg)
    _edit_config(folder, use_sliding_window=False, sliding_window=4096, max_window_layers=2)
    assert hf.import_hf(folder)[1] == cfg


@pytest.mark.parametrize(
    ("family", "changes", "field"),
    [
        ("deepseek_v2", dict(attention_bias=True), "attention_bias"),
        ("deepseek_v2", dict(mlp_bias=True), "mlp_bias"),
        ("deepseek_v2", dict(scoring_func="sigmoid"), "scoring_func"),
        (
            "deepseek_v2",
            dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
            "rope_parameters",
        ),  # fmt: skip
        (
            "deepseek_v2",
            dict(rope_parameters=..., rope_scaling={"type": "dynamic", "factor": 2.0}),
            "rope_scaling",
        ),
        ("gpt_oss", dict(attention_dropout=0.1), "attention_dropout"),
        ("gpt_oss", dict(quantization_config={"quant_method": "mxfp4"}), "quantization_config"),
        ("gpt_oss", dict(experts_per_token=3), "experts_per_token"),
        (
            "gpt_oss",
            dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
            "rope_parameters",
        ),  # fmt: skip
    ],
)
def test_other_families_fields_without_fmoe_math_are_refused_by_name(tmp_path, family, changes, field):
    folder, _ = _export(tmp_path, family, _tiny(family))
    _edit_config(folder, **changes)
    _one_line_error(folder, field)


@pytest.mark.parametrize("family", sorted(FAMILY_MODULES))
def test_an_unknown_config_key_is_refused_by_name(tmp_path, family):
    folder, _ = _export(tmp_path, family, _tiny(family))
    _edit_config(folder, frobnication_factor=2)
    _one_line_error(folder, r"config\.json: config\.json field 'frobnication_factor' is unknown")


@pytest.mark.parametrize("family", sorted(FAMILY_MODULES))
def test_a_value_of_the_wrong_type_is_refused_by_name(tmp_path, family):
    folder, _ = _export(tmp_path, family, _tiny(family))
    _edit_config(folder, hidden_size="64")
    _one_line_error(folder, r"field 'hidden_size' must be int")


@pytest.mark.parametrize("family", sorted(FAMILY_MODULES))
def test_every_key_of_the_installed_transformers_default_config_is_classified(tmp_path, family):
    transformers = pytest.importorskip("transformers")
    config_class = {
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "deepseek_v2": transformers.DeepseekV2Config,
        "gpt_oss": transformers.GptOssConfig,
    }[family]
    config_class().save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    module = FAMILY_MODULES[family]
    honoured, pinned, metadata = (
        module.FAMILY.hf.honoured_fields,
        set(module.FAMILY.hf.pinned_fields),
        module.FAMILY.hf.metadata_fields,
    )
    assert not (honoured & pinned or honoured & metadata or pinned & metadata), "a key in two classes"
    unclassified = sorted(set(saved) - honoured - pinned - metadata)
    assert not unclassified, f"{family}: config.json keys neither honoured nor metadata: {unclassified}"
    # and what fmoe's own export writes
    exported = set(module.hf_config(_tiny(family))) | {"torch_dtype"}
    assert not sorted(exported - honoured - pinned - metadata)
    # the default config itself: imported, or refused with a field named (DeepSeek-V2's default
    # leaves num_experts_per_tok null)
    if family == "deepseek_v2":
        with pytest.raises(ValueError, match=r"'num_experts_per_tok' must be int, got null"):
            module.config_from_hf(saved)
    else:
        cfg = module.config_from_hf(saved)
        assert cfg.num_experts == saved["num_local_experts"] and cfg.hidden_size == saved["hidden_size"]


def test_keys_config_json_omits_take_transformers_defaults():
    # transformers' defaults, not fmoe's tiny-model ones: 128 experts, no top-k renormalisation,
    # rope_theta 10000
    cfg = qwen3_moe.config_from_hf({"model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 4})
    assert (cfg.num_experts, cfg.norm_topk_prob, cfg.rope_theta, cfg.num_experts_per_tok) == (
        128,
        False,
        1e4,
        8,
    )


# ----------------------------------------------------------------------------------------------
# config and tensors that disagree


def test_more_experts_in_the_checkpoint_than_the_config_says_is_refused(tmp_path):
    # on 49ceb4b experts 6 and 7 were silently dropped (the router's shape is what gives it away)
    folder, _ = _export(tmp_path, "qwen3_moe", tiny_config())
    _edit_config(folder, num_experts=6)
    _one_line_error(
        folder, r"'model\.layers\.0\.mlp\.gate\.weight' has shape \(8, 32\), config\.json implies \(6, 32\)"
    )


def test_expert_tensors_beyond_the_config_count_are_refused(tmp_path):
    # on 49ceb4b expert 8 was silently dropped
    folder, _ = _export(tmp_path, "qwen3_moe", tiny_config())
    extra = {
        f"model__layers__1__mlp__experts__8__{n}_proj__weight": torch.zeros(16, 32) for n in ("gate", "up")
    }
    _edit_tensors(folder, **extra, model__layers__1__mlp__experts__8__down_proj__weight=torch.zeros(32, 16))
    _one_line_error(
        folder, r"tensor 'model\.layers\.1\.mlp\.experts\.8\.down_proj\.weight' of shape \(32, 16\)"
    )


def test_more_layers_in_the_checkpoint_than_the_config_says_is_refused(tmp_path):
    folder, _ = _export(tmp_path, "qwen3_moe", tiny_config(num_hidden_layers=3))
    _edit_config(folder, num_hidden_layers=2)
    _one_line_error(
        folder, r"tensor 'model\.layers\.2\.input_layernorm\.weight' of shape \(32,\) has no place"
    )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(hidden_size=48, head_dim=8), r"'model\.embed_tokens\.weight' has shape \(64, 32\), config\.json implies \(64, 48\)"),
        (dict(vocab_size=50), r"'model\.embed_tokens\.weight' has shape \(64, 32\), config\.json implies \(50, 32\)"),
        (dict(moe_intermediate_size=12),
         r"'model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight' has shape \(16, 32\), config\.json implies \(12, 32\)"),
    ],
    ids=["hidden_size", "vocab_size", "moe_intermediate_size"],
)  # fmt: skip
def test_a_config_the_tensors_contradict_is_refused_naming_tensor_and_shapes(tmp_path, changes, message):
    folder, _ = _export(tmp_path, "qwen3_moe", tiny_config())
    _edit_config(folder, **changes)
    _one_line_error(folder, message)


def test_an_expert_tensor_of_the_wrong_shape_is_refused_naming_it(tmp_path):
    # on 49ceb4b: "stack expects each tensor to be equal size" (no tensor named)
    folder, _ = _export(tmp_path, "qwen3_moe", tiny_config())
    _edit_tensors(folder, model__layers__1__mlp__experts__3__down_proj__weight=torch.zeros(32, 15))
    _one_line_error(
        folder,
        r"'model\.layers\.1\.mlp\.experts\.3\.down_proj\.weight' has shape \(32, 15\), config\.json implies \(32, 16\)",
    )


@pytest.mark.parametrize("family", sorted(FAMILY_MODULES))
def test_an_extra_tensor_is_refused_naming_it(tmp_path, family):
    folder, _ = _export(tmp_path, family, _tiny(family))
    _edit_tensors(folder, model__layers__0__mlp__mystery__weight=torch.zeros(3, 2))
    _one_line_error(folder, r"tensor 'model\.layers\.0\.mlp\.mystery\.weight' of shape \(3, 2\) has no place")


def test_a_tied_lm_head_is_accepted_only_when_it_equals_the_embedding(tmp_path):
    cfg = tiny_config(tie_word_embeddings=True)
    folder, params = _export(tmp_path, "qwen3_moe", cfg)
    _edit_tensors(folder, lm_head__weight=params["model.embed_tokens.weight"].clone())
    assert set(hf.import_hf(folder)[2]) == set(params)
    _edit_tensors(folder, lm_head__weight=params["model.embed_tokens.weight"] + 1)
    _one_line_error(folder, r"tensor 'lm_head\.weight' of shape \(64, 32\) has no place")


def test_the_cli_prints_one_error_line_naming_the_field(tmp_path, capsys):
    folder, _ = _export(tmp_path, "qwen3_moe", tiny_config())
    _edit_config(folder, use_sliding_window=True)
    assert cli.main(["checkpoint", "import-hf", str(folder), "--out", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fmoe: error: ") and "'use_sliding_window'" in err and "\n" not in err
    assert not (tmp_path / "ck").exists(), "nothing is written for a refused import"


def test_a_model_type_other_than_the_family_asked_for_is_refused(tmp_path):
    folder, _ = _export(tmp_path, "qwen3_moe", tiny_config())
    with pytest.raises(ValueError, match=r"model_type 'qwen3_moe' is not the family asked for, 'gpt_oss'"):
        hf.import_hf(folder, "gpt_oss")
    _edit_config(folder, model_type=...)
    with pytest.raises(ValueError, match=r"no model_type"):
        hf.import_hf(folder)
    assert hf.import_hf(folder, "qwen3_moe")[0] == "qwen3_moe"
