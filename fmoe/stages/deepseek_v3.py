"""DeepSeek-V3 on the MoE decoder builder (``fmoe.stages.decoder``: stages, parameter names, init):
DeepSeek-V2's model with V3's router.

What V3 shares with V2 runs V2's functions (``fmoe.stages.deepseek_v2``) on an equivalent
``DeepseekV2Config`` (``DeepseekV3Config.v2_config``): multi-head latent attention with interleaved
decoupled RoPE and YaRN, the dense first ``first_k_dense_replace`` layers, the shared experts and the
routed SwiGLU experts. What differs is the router
(``noaux_tc_router``): sigmoid scores; for the choice only, each expert's score plus its
``mlp.gate.e_score_correction_bias``; experts in ``n_group`` groups, a group scored by the sum of its
two best biased scores, only the ``topk_group`` best groups eligible, the top-k eligible experts
chosen; weights are the chosen experts' sigmoid scores without the bias, normalised over the k if
``norm_topk_prob``, times ``routed_scaling_factor``. The bias is the builder's router-bias buffer
(``DecoderDims.router_bias``): with ``moe_router_bias_update_rate > 0`` it moves by
rate * sign(mean load - load) after each optimizer step (aux-loss-free balancing). Multi-token
prediction (``num_nextn_predict_layers`` > 0) is refused. Parameter names are transformers'
(``DeepseekV3ForCausalLM``); the hub stores experts one by one, which ``to_hf`` / ``from_hf`` convert.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from fmoe.stages import decoder, hf_mapping, rotary
from fmoe.stages import deepseek_v2 as v2
from fmoe.stages.primitives import linear
from fmoe.stages.spec import Params, StageContext

ROUTER_BIAS = "mlp.gate.e_score_correction_bias"  # V3's name for the balancing bias
# fields whose meaning is DeepSeek-V2's: they make the V2 config V2's stage functions run on
V2_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts",
    "num_experts_per_tok", "first_k_dense_replace", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
    "max_position_embeddings", "tie_word_embeddings", "initializer_range", "moe_capacity_factor",
)  # fmt: skip


@dataclass(frozen=True)
class DeepseekV3Config:
    """Fields named as in transformers' ``DeepseekV3Config`` (``rope_scaling`` as DeepSeek-V2's);
    defaults give a tiny CPU model. aux_loss_alpha: an optional Switch-style load-balancing loss on
    the normalised sigmoid scores (0: V3's aux-loss-free balancing alone)."""

    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    moe_intermediate_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None
    n_shared_experts: int = 1
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    routed_scaling_factor: float = 2.5
    n_group: int = 4
    topk_group: int = 2
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 1
    kv_lora_rank: int = 32
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    aux_loss_alpha: float = 0.0
    # fmoe training settings (not Hugging Face config fields; hf_config leaves them out)
    moe_capacity_factor: float | None = None  # None: dropless
    moe_router_bias_update_rate: float = 0.001  # DeepSeek-V3's bias update speed (0: frozen bias)

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        try:  # every shared field checked once, by DeepSeek-V2's config; the error names ours
            object.__setattr__(self, "rope_scaling", self.v2_config.rope_scaling)
        except ValueError as e:
            raise ValueError(str(e).replace("DeepseekV2Config", name)) from None
        E, groups = self.n_routed_experts, self.n_group
        if groups <= 0 or E % groups or E // groups < 2:
            raise ValueError(
                f"{name}.n_group ({groups}) must divide n_routed_experts ({E}) into groups of >= 2 experts "
                "(a group is scored by its two best experts)"
            )
        if not 1 <= self.topk_group <= groups or self.topk_group * (E // groups) < self.num_experts_per_tok:
            raise ValueError(
                f"{name}.topk_group ({self.topk_group}) must be between 1 and n_group ({groups}) and its "
                f"groups must hold num_experts_per_tok ({self.num_experts_per_tok}) experts"
            )
        for f in ("routed_scaling_factor", "aux_loss_alpha", "moe_router_bias_update_rate"):
            if not getattr(self, f) >= 0:
                raise ValueError(f"{name}.{f} must be >= 0, got {getattr(self, f)}")

    @functools.cached_property
    def v2_config(self) -> v2.DeepseekV2Config:
        """The DeepSeek-V2 config with this model's attention, experts and layers (greedy softmax
        routing there, unused: V3's router replaces it); V2's stage functions run on it."""
        return v2.DeepseekV2Config(**{f: getattr(self, f) for f in V2_FIELDS}, aux_loss_alpha=0.0)

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))


def noaux_tc_router(
    x: Tensor, gate_w: Tensor, bias: Tensor, top_k: int, n_group: int, topk_group: int,
    norm_topk_prob: bool, routed_scaling_factor: float,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """DeepSeek-V3's group-limited sigmoid router (``topk_method = "noaux_tc"``).

    x [T, H], gate_w [E, H], bias [E] (a buffer: no gradient reaches it) -> (scores [T, E] sigmoid,
    weights [T, k] x.dtype, ids [T, k] int64). Scores are computed in at least float32. The choice
    sees scores + bias: groups ranked by the sum of their two best, the ``topk_group`` best kept, the
    top-k of their experts chosen; the weights are the chosen unbiased scores, over their sum
    (+1e-20, as transformers) if ``norm_topk_prob``, times ``routed_scaling_factor``.
    """
    dtype = torch.promote_types(x.dtype, torch.float32)
    scores = torch.sigmoid(linear(x.to(dtype), gate_w.to(dtype), fp8=False))
    choice = scores.detach() + bias.detach().to(dtype)
    per_group = choice.shape[-1] // n_group
    group_scores = choice.unflatten(-1, (n_group, per_group)).topk(2, dim=-1).values.sum(-1)
    best_groups = group_scores.topk(topk_group, dim=-1).indices
    eligible = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    choice = choice.masked_fill(~eligible.repeat_interleave(per_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return scores, (weights * routed_scaling_factor).to(x.dtype), ids


# ----------------------------------------------------------------------------------------------
# what the decoder builder takes: V2's attention and experts (on cfg.v2_config), V3's router


def dims(cfg: DeepseekV3Config) -> decoder.DecoderDims:
    return decoder.DecoderDims(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers,
        moe_layers=tuple(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)),
        num_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok, norm_eps=cfg.rms_norm_eps,
        aux_loss_coef=cfg.aux_loss_alpha, tie_word_embeddings=cfg.tie_word_embeddings,
        init_std=cfg.initializer_range, capacity_factor=cfg.moe_capacity_factor, router_bias=ROUTER_BIAS,
        router_bias_rate=cfg.moe_router_bias_update_rate, max_positions=cfg.max_position_embeddings,
    )  # fmt: skip


def attention(
    cfg: DeepseekV3Config, layer: int, p: Params, x: Tensor, positions: Tensor, ctx: StageContext
) -> Tensor:
    """DeepSeek-V2's MLA: x [b,s,H] normed -> [b,s,H]."""
    return v2.attention(cfg.v2_config, layer, p, x, positions, ctx)


def route(cfg: DeepseekV3Config, p: Params, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``MoEDecoder.router``: x [T,H] -> (probs [T,E] the sigmoid scores normalised over the experts,
    read by the aux loss only; weights [T,k]; ids [T,k] i64), ``noaux_tc_router`` with the config."""
    scores, weights, ids = noaux_tc_router(
        x, p["mlp.gate.weight"], p[ROUTER_BIAS], cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
        cfg.norm_topk_prob, cfg.routed_scaling_factor,
    )  # fmt: skip
    return scores / scores.sum(dim=-1, keepdim=True), weights, ids


def router_shapes(cfg: DeepseekV3Config) -> dict[str, tuple[int, ...]]:
    return {"mlp.gate.weight": (cfg.n_routed_experts, cfg.hidden_size), ROUTER_BIAS: (cfg.n_routed_experts,)}


def attention_shapes(cfg: DeepseekV3Config, layer: int) -> dict[str, tuple[int, ...]]:
    return v2.attention_shapes(cfg.v2_config, layer)


def expert_shapes(cfg: DeepseekV3Config) -> dict[str, tuple[int, ...]]:
    return v2.expert_shapes(cfg.v2_config)


def shared_experts(cfg: DeepseekV3Config, p: Params, x: Tensor) -> Tensor:
    return v2.shared_experts(cfg.v2_config, p, x)


def shared_shapes(cfg: DeepseekV3Config) -> dict[str, tuple[int, ...]]:
    return v2.shared_shapes(cfg.v2_config)


def dense_shapes(cfg: DeepseekV3Config) -> dict[str, tuple[int, ...]]:
    return v2.dense_shapes(cfg.v2_config)


DECODER = decoder.MoEDecoder(
    dims, attention, attention_shapes, route, router_shapes, decoder.swiglu_experts, expert_shapes,
    gathered_experts=decoder.swiglu_gathered_experts,
    shared_experts=shared_experts, shared_shapes=shared_shapes, dense_mlp=decoder.dense_swiglu,
    dense_shapes=dense_shapes,
)  # fmt: skip
build, init_params, param_shapes, logits = (
    DECODER.build,
    DECODER.init_params,
    DECODER.param_shapes,
    DECODER.logits,
)


def train_flops_per_token(cfg: DeepseekV3Config, seq: int) -> float:
    """DeepSeek-V2's count (the same GEMMs: the router's [E, H] product, top-k + shared experts, MLA)."""
    return v2.train_flops_per_token(cfg.v2_config, seq)


# ----------------------------------------------------------------------------------------------
# Hugging Face checkpoint layout: as DeepSeek-V2's (experts one by one on the hub), with the router
# biases stored too. config.json keys are honoured, pinned or metadata (``hf_mapping.check_hf_fields``).

# transformers' DeepseekV3Config defaults, for keys config.json omits (rope_theta 10000, plain RoPE)
HF_DEFAULTS = {k: v for k, v in v2.HF_DEFAULTS.items() if k != "topk_method"} | {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "max_position_embeddings": 4096, "aux_loss_alpha": 0.0,
}  # fmt: skip


def write_hf(cfg: DeepseekV3Config) -> dict:
    """config.json's keys besides the fields: the rope, V3's router and layout, what fmoe's math fixes."""
    return dict(
        rope_parameters=rotary.rope_parameters(cfg.rope_theta, cfg.rope_scaling), topk_method="noaux_tc",
        scoring_func="sigmoid", rope_interleave=True, num_nextn_predict_layers=0, hidden_act="silu",
        attention_bias=False, head_dim=cfg.qk_rope_head_dim,
    )  # fmt: skip


# tensors: the hub's layout, the router biases included (V3 checkpoints hold them; a missing one
# is refused by name): HFMapping's default to_hf / from_hf. Multi-token prediction is refused.
HF = hf_mapping.HFMapping(
    DeepseekV3Config, "DeepseekV3ForCausalLM", "deepseek_v3", defaults=HF_DEFAULTS,
    not_in_hf=("moe_capacity_factor", "moe_router_bias_update_rate", "rope_theta", "rope_scaling"),
    aliases={"n_routed_experts": ("n_routed_experts", "num_experts", "num_local_experts")},
    extra_honoured=hf_mapping.HF_ROPE_KEYS,
    pinned_fields={
        **v2.HF.pinned_fields,
        "topk_method": ("noaux_tc",),  # the hub's remote code: V3's group-limited sigmoid choice
        "scoring_func": ("sigmoid",),
        "rope_interleave": (True,),  # rotary pairs interleaved, as DeepSeek-V2 (and the hub) lay them out
        "num_nextn_predict_layers": (0,),  # multi-token prediction modules: not implemented
        "num_mtp_layers": (0,),  # transformers' alias of num_nextn_predict_layers
    },
    extra_metadata=v2.HF.extra_metadata, write=write_hf, read=v2.read_hf,
)  # fmt: skip
# its conversions under their usual names
hf_config, config_from_hf = HF.hf_config, HF.config_from_hf
FAMILY = DECODER.family("deepseek_v3", DeepseekV3Config, train_flops_per_token, HF)
