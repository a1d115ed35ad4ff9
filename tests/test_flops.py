"""Model FLOPs per trained token: each family's own count, checked against a count by hand.

The hand counts below list every weight matrix a token's GEMMs touch for a tiny config (6 FLOPs per
weight per token: 2 forward, 4 backward; the embedding lookup is free; top-k of the routed experts),
then the attention score (Q K^T) and value (P V) GEMMs: 2 FLOPs per multiply-add, times heads, head
width and the keys a query sees (seq / 2 on average under the causal mask, by the usual
convention), 3 x the forward for training.
"""

from __future__ import annotations

import dataclasses

import pytest
from test_train import recipe_dict

from fmoe import data, hf
from fmoe import recipe as R
from fmoe.stages import deepseek_v2, gpt_oss, qwen3_moe
from fmoe.stages.family import BUILTIN_FAMILIES
from fmoe.train import train


def test_qwen3_moe_flops_match_a_hand_count():
    cfg = qwen3_moe.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=48,
        mlp_only_layers=(0,),
    )  # fmt: skip
    attn = 32 * 32 + 16 * 32 + 16 * 32 + 32 * 32  # q [4*8, 32], k and v [2*8, 32], o [32, 4*8]
    dense = 3 * 48 * 32  # layer 0: gate, up, down
    moe = 8 * 32 + 2 * 3 * 16 * 32  # layer 1: the router, two experts of gate, up, down
    head = 64 * 32
    weights = 2 * attn + dense + moe + head
    scores = 2 * (2 * 4 * 8 * 8 + 2 * 4 * 8 * 8)  # 2 layers x (QK^T + PV), 4 heads of 8, 16/2 keys
    assert weights == 16128
    assert qwen3_moe.train_flops_per_token(cfg, 16) == 6 * weights + 3 * scores


@pytest.mark.parametrize("q_lora_rank", [None, 16])
def test_deepseek_v2_flops_match_a_hand_count_of_mla(q_lora_rank):
    cfg = deepseek_v2.DeepseekV2Config(q_lora_rank=q_lora_rank)  # the tiny defaults:
    # vocab 512, hidden 64, 4 heads, nope 16 + rope 8 query/key width, value 16, kv latent 32,
    # layer 0 dense (intermediate 128), layer 1: 8 routed experts (top 2) + 1 shared, width 32
    if q_lora_rank is None:
        q = 4 * 24 * 64  # q_proj
    else:
        q = 16 * 64 + 4 * 24 * 16  # q_a_proj, q_b_proj
    kv = (32 + 8) * 64 + 4 * (16 + 16) * 32  # kv_a_proj_with_mqa, kv_b_proj
    o = 64 * 4 * 16
    attn = q + kv + o
    dense = 3 * 128 * 64
    moe = 8 * 64 + 2 * 3 * 32 * 64 + 3 * 32 * 64  # router, 2 routed experts, the shared expert
    head = 512 * 64
    weights = 2 * attn + dense + moe + head
    scores = 2 * (2 * 4 * 24 * 8 + 2 * 4 * 16 * 8)  # QK^T at width 24, PV at width 16, 16/2 keys
    assert deepseek_v2.train_flops_per_token(cfg, 16) == 6 * weights + 3 * scores


@pytest.mark.parametrize(("seq", "sliding_keys"), [(64, 14), (16, 8)])
def test_gpt_oss_flops_match_a_hand_count_with_a_sliding_window(seq, sliding_keys):
    cfg = gpt_oss.GptOssConfig(sliding_window=16)  # layer 0 sliding, layer 1 full
    # tiny defaults: vocab 512, hidden 64, 4 query heads and 2 key/value heads of 16, 8 experts
    # (top 2) of width 32
    attn = 64 * 64 + 32 * 64 + 32 * 64 + 64 * 64  # q, k, v, o
    moe = 8 * 64 + 2 * (2 * 32 * 64 + 64 * 32)  # the router, 2 experts of gate_up and down
    head = 512 * 64
    weights = 2 * (attn + moe) + head
    # a window of 16 over 64 tokens: the first 16 queries see 8 keys on average, the other 48 see
    # 16: (16 * 8 + 48 * 16) / 64 = 14; over 16 tokens the window changes nothing (16 / 2 = 8)
    assert (16 * 8 + 48 * 16) / 64 == 14
    full_keys = seq / 2
    scores = 2 * 4 * 16 * 2 * (sliding_keys + full_keys)  # (QK^T + PV) x 4 heads of 16, per layer
    assert gpt_oss.train_flops_per_token(cfg, seq) == 6 * weights + 3 * scores


def test_every_family_states_its_own_flops():
    for name in BUILTIN_FAMILIES:
        fam = hf.family(name)
        cfg = R.model_config_class(name)()
        assert fam.train_flops_per_token(cfg, 32) > 0, name


def test_the_trainer_counts_with_the_familys_function(tmp_path, monkeypatch):
    root = tmp_path / "data"
    corpus = data.builtin_corpus(root / "corpus.txt", 20_000)
    data.build([corpus], root / "bytes", tokenizer="bytes", workers=1)
    d = recipe_dict(
        tmp_path,
        str(root / "bytes"),
        train={"steps": 1, "global_batch": 2, "microbatches": 1},
        optim={"warmup": 0},
    )
    d["model"] = {"family": "gpt_oss", "vocab_size": 264, "hidden_size": 32, "num_hidden_layers": 2,
                  "num_local_experts": 4, "sliding_window": 8}  # fmt: skip
    calls = []
    real = gpt_oss.train_flops_per_token
    counting = dataclasses.replace(
        gpt_oss.FAMILY, train_flops_per_token=lambda cfg, seq: calls.append((cfg, seq)) or real(cfg, seq)
    )
    monkeypatch.setattr(gpt_oss, "FAMILY", counting)
    recipe = R.from_dict(d)
    train(recipe)
    assert calls == [(recipe.model, 32)]
