"""DeepSeek-V2 / DeepSeek-V2-Lite on the MoE decoder builder (``fmoe.stages.decoder``: the
stages, what flows between them, parameter names and init).

Multi-head latent attention (MLA): keys and values come from one compressed latent per token
(``kv_a_proj_with_mqa`` -> [kv_lora_rank | qk_rope_head_dim], the latent RMS-normed and expanded per
head by ``kv_b_proj``); the rotary part of the key is one head shared by all heads (decoupled RoPE,
interleaved-pair layout as in transformers). Queries are compressed too (``q_a_proj`` ->
``q_a_layernorm`` -> ``q_b_proj``) unless ``q_lora_rank`` is None (V2-Lite: one ``q_proj``). YaRN
rotary scaling comes from ``rope_scaling``. The first ``first_k_dense_replace`` layers are dense;
the rest have routed experts (softmax router, greedy or group-limited top-k, weights times
``routed_scaling_factor``) plus ``n_shared_experts`` shared experts every token goes through: the
builder runs them in the mlp stage beside the routed ones (dispatch carries the token rows ``x``;
mlp returns ``h1 + shared_experts(x)`` in the residual's slot). Under expert parallelism the shared
experts run on every rank for its own tokens (they are not in ``expert_shapes``, so not among the
model's ``expert_params``: not sharded).

Parameter names and layouts are transformers' (``DeepseekV2ForCausalLM``, stacked experts
``mlp.experts.gate_up_proj`` [E, 2I, H] gate rows first, ``mlp.experts.down_proj`` [E, H, I]); the
hub stores experts one by one, which ``to_hf`` writes and ``from_hf`` reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from fmoe.stages import decoder, hf_mapping, layers, rotary
from fmoe.stages import family as fam
from fmoe.stages.primitives import linear
from fmoe.stages.spec import Params, StageContext

# transformers builds q_a_layernorm / kv_a_layernorm with the RMSNorm default eps, not rms_norm_eps
LATENT_NORM_EPS = 1e-6
TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclass(frozen=True)
class DeepseekV2Config:
    """Fields named as in transformers' ``DeepseekV2Config``; defaults give a tiny CPU model.

    rope_scaling: None (plain RoPE) or a YaRN table as in the hub's config.json (``type``/``rope_type``
    "yarn", ``factor``, ``original_max_position_embeddings``, optional ``beta_fast``, ``beta_slow``,
    ``mscale``, ``mscale_all_dim``, ``attention_factor``, ``truncate``).
    aux_loss_alpha: the router's load-balancing loss weight (the hub config's name; the loss is fmoe's
    Switch-style batch loss, not DeepSeek's per-sequence one).
    """

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
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"
    n_group: int | None = None
    topk_group: int | None = None
    norm_topk_prob: bool = False
    first_k_dense_replace: int = 1
    kv_lora_rank: int = 32
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    aux_loss_alpha: float = 0.001
    # fmoe training settings (not Hugging Face config fields; hf_config leaves them out)
    moe_capacity_factor: float | None = None  # None: dropless

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        fam.check_fields(
            self, non_negative=("n_shared_experts", "first_k_dense_replace", "aux_loss_alpha", "rms_norm_eps"),
            positive=("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "n_routed_experts",
                      "num_experts_per_tok", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                      "moe_intermediate_size", "intermediate_size", "max_position_embeddings", "rope_theta"),
            positive_or_none=("q_lora_rank", "moe_capacity_factor"),
        )  # fmt: skip
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"{name}.qk_rope_head_dim must be even (rotary pairs), got {self.qk_rope_head_dim}"
            )
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(
                f"{name}.num_key_value_heads ({self.num_key_value_heads}) must equal num_attention_heads "
                f"({self.num_attention_heads}): MLA expands keys and values for every head"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"{name}: num_attention_heads ({self.num_attention_heads}) must divide hidden_size "
                f"({self.hidden_size}), as transformers requires"
            )
        fam.check_top_k(self, "num_experts_per_tok", "n_routed_experts")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"{name}.topk_method must be one of {TOPK_METHODS}, got {self.topk_method!r}")
        if self.topk_method == "group_limited_greedy":
            if self.n_group is None or self.topk_group is None:
                raise ValueError(f"{name}: topk_method 'group_limited_greedy' needs n_group and topk_group")
            if self.n_group <= 0 or self.n_routed_experts % self.n_group:
                raise ValueError(
                    f"{name}.n_group ({self.n_group}) must be > 0 and divide n_routed_experts "
                    f"({self.n_routed_experts})"
                )
            if not 1 <= self.topk_group <= self.n_group:
                raise ValueError(
                    f"{name}.topk_group ({self.topk_group}) must be between 1 and n_group ({self.n_group})"
                )
            if self.topk_group * (self.n_routed_experts // self.n_group) < self.num_experts_per_tok:
                raise ValueError(
                    f"{name}: topk_group ({self.topk_group}) groups of {self.n_routed_experts // self.n_group} "
                    f"experts hold fewer than num_experts_per_tok ({self.num_experts_per_tok})"
                )
        if self.norm_topk_prob:
            raise ValueError(
                f"{name}.norm_topk_prob must be false: transformers' DeepseekV2 never renormalises the "
                "top-k weights (the released V2 / V2-Lite configs have it false)"
            )
        object.__setattr__(
            self, "rope_scaling", rotary.check_rope_scaling(self.rope_scaling, f"{name}.rope_scaling")
        )

    @property
    def num_experts(self) -> int:  # transformers' alias
        return self.n_routed_experts

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (as transformers)."""
        scale = self.qk_head_dim**-0.5
        rs = self.rope_scaling
        if rs is not None and rs.get("mscale_all_dim"):
            m = rotary.yarn_mscale(rs["factor"], rs["mscale_all_dim"])
            scale = scale * m * m
        return scale


def dims(cfg: DeepseekV2Config) -> decoder.DecoderDims:
    return decoder.DecoderDims(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers,
        moe_layers=tuple(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)),
        num_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok, norm_eps=cfg.rms_norm_eps,
        aux_loss_coef=cfg.aux_loss_alpha, tie_word_embeddings=cfg.tie_word_embeddings,
        init_std=cfg.initializer_range, capacity_factor=cfg.moe_capacity_factor,
        max_positions=cfg.max_position_embeddings,
    )  # fmt: skip


def mla_attention(cfg: DeepseekV2Config, p: Params, x: Tensor, positions: Tensor) -> Tensor:
    """Multi-head latent attention, causal. x: [b, s, H] (normed), positions [b, s] | [s] -> [b, s, H]."""
    b, s, _ = x.shape
    nh, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    # x is kept in the compute dtype for kv_a_proj_with_mqa ([kv_lora + rope, H]: 576 rows, not FP8),
    # so the query projection shares it rather than caching an FP8 copy (``fmoe.stages.fp8_mode``)
    if cfg.q_lora_rank is None:
        q = linear(x, p["self_attn.q_proj.weight"], cache=False)
    else:
        q_latent = layers.rms_norm(
            linear(x, p["self_attn.q_a_proj.weight"], cache=False),
            p["self_attn.q_a_layernorm.weight"],
            LATENT_NORM_EPS,
        )
        q = linear(q_latent, p["self_attn.q_b_proj.weight"])
    q_nope, q_pe = q.view(b, s, nh, dn + dr).transpose(1, 2).split([dn, dr], dim=-1)
    kv_latent, k_pe = linear(x, p["self_attn.kv_a_proj_with_mqa.weight"]).split(
        [cfg.kv_lora_rank, dr], dim=-1
    )
    kv_latent = layers.rms_norm(kv_latent, p["self_attn.kv_a_layernorm.weight"], LATENT_NORM_EPS)
    kv = linear(kv_latent, p["self_attn.kv_b_proj.weight"]).view(b, s, nh, dn + dv).transpose(1, 2)
    k_nope, v = kv.split([dn, dv], dim=-1)

    angles, factor = rotary.rotary_angles(positions, dr, cfg.rope_theta, cfg.rope_scaling)
    angles = rotary.batch_angles(angles)
    q_pe = rotary.rotate_pairs(q_pe, angles, factor)
    k_pe = rotary.rotate_pairs(k_pe.view(b, 1, s, dr), angles, factor)  # one rotary key head, shared
    q = torch.cat((q_nope, q_pe), dim=-1)
    k = torch.cat((k_nope, k_pe.expand(b, nh, s, dr)), dim=-1)
    # SDPA: query/key and value head dims differ (MLA), which flash_attn does not take
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=cfg.softmax_scale)
    # SDPA's fused kernels save their output, which o_proj reads as a view: no FP8 copy of it (the
    # CPU math path reads a copy, left in the compute dtype too)
    return linear(out.transpose(1, 2).reshape(b, s, nh * dv), p["self_attn.o_proj.weight"], cache=False)


def router(cfg: DeepseekV2Config, x: Tensor, gate_w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x [T, H], gate_w [E, H] -> (probs [T, E] >= f32, weights [T, k] x.dtype, ids [T, k] i64).

    Softmax over all experts in (at least) float32; greedy top-k, or (group_limited_greedy) top-k among the
    experts of the ``topk_group`` groups with the highest best score; weights = the chosen
    probabilities times ``routed_scaling_factor`` (never renormalised).
    """
    probs = torch.softmax(linear(x, gate_w, fp8=False), dim=-1, dtype=rotary.compute_dtype(x))
    scores = probs
    if cfg.topk_method == "group_limited_greedy":
        per = cfg.n_routed_experts // cfg.n_group
        best = probs.view(-1, cfg.n_group, per).amax(dim=-1)  # [T, groups]
        groups = torch.topk(best, cfg.topk_group, dim=-1).indices
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, groups, True)
        scores = probs.masked_fill(~keep.repeat_interleave(per, dim=1), 0.0)
    weights, ids = torch.topk(scores, cfg.num_experts_per_tok, dim=-1)
    return probs, (weights * cfg.routed_scaling_factor).to(x.dtype), ids


def attention(
    cfg: DeepseekV2Config, layer: int, p: Params, x: Tensor, positions: Tensor, ctx: StageContext
) -> Tensor:
    """``MoEDecoder.attention``: MLA, refusing a sequence-sharded (context-parallel) call."""
    if ctx.group("cp") is not None:
        raise NotImplementedError(
            "DeepSeek-V2 MLA attention has no context-parallel form yet: run it with parallel.cp = 1"
        )
    return mla_attention(cfg, p, x, positions)


def attention_shapes(cfg: DeepseekV2Config, layer: int) -> dict[str, tuple[int, ...]]:
    H, nh, r = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
    if cfg.q_lora_rank is None:
        shapes = {"self_attn.q_proj.weight": (nh * cfg.qk_head_dim, H)}
    else:
        shapes = {
            "self_attn.q_a_proj.weight": (cfg.q_lora_rank, H),
            "self_attn.q_a_layernorm.weight": decoder.Ones((cfg.q_lora_rank,)),
            "self_attn.q_b_proj.weight": (nh * cfg.qk_head_dim, cfg.q_lora_rank),
        }
    return shapes | {
        "self_attn.kv_a_proj_with_mqa.weight": (r + cfg.qk_rope_head_dim, H),
        "self_attn.kv_a_layernorm.weight": decoder.Ones((r,)),
        "self_attn.kv_b_proj.weight": (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), r),
        "self_attn.o_proj.weight": (H, nh * cfg.v_head_dim),
    }


def route(cfg: DeepseekV2Config, p: Params, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``MoEDecoder.router``: ``router`` with the layer's gate."""
    return router(cfg, x, p["mlp.gate.weight"])


def router_shapes(cfg: DeepseekV2Config) -> dict[str, tuple[int, ...]]:
    return {"mlp.gate.weight": (cfg.n_routed_experts, cfg.hidden_size)}


def expert_shapes(cfg: DeepseekV2Config) -> dict[str, tuple[int, ...]]:
    return decoder.swiglu_expert_shapes(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)


def shared_experts(cfg: DeepseekV2Config, p: Params, x: Tensor) -> Tensor:
    """The n_shared_experts shared experts, one SwiGLU MLP of n_shared x moe_intermediate_size."""
    return decoder.gated_mlp(p, "mlp.shared_experts.", x)


def shared_shapes(cfg: DeepseekV2Config) -> dict[str, tuple[int, ...]]:
    if not cfg.n_shared_experts:
        return {}
    inter = cfg.moe_intermediate_size * cfg.n_shared_experts
    return decoder.gated_mlp_shapes("mlp.shared_experts.", cfg.hidden_size, inter)


def dense_shapes(cfg: DeepseekV2Config) -> dict[str, tuple[int, ...]]:
    return decoder.gated_mlp_shapes("mlp.", cfg.hidden_size, cfg.intermediate_size)


DECODER = decoder.MoEDecoder(
    dims, attention, attention_shapes, route, router_shapes, decoder.swiglu_experts, expert_shapes,
    gathered_experts=decoder.swiglu_gathered_experts,
    shared_experts=shared_experts, shared_shapes=shared_shapes, dense_mlp=decoder.dense_swiglu,
    dense_shapes=dense_shapes,
)  # fmt: skip
# the family's functions under their usual names
build, init_params, param_shapes = DECODER.build, DECODER.init_params, DECODER.param_shapes
logits = DECODER.logits


def train_flops_per_token(cfg: DeepseekV2Config, seq: int) -> float:
    """Model FLOPs per trained token at sequence length ``seq`` (what MFU divides by): forward +
    backward = 6 x the weights a token's GEMMs touch (MLA's low-rank projections, top-k routed and
    the shared experts, the router, the LM head; the embedding lookup is free), plus the causal
    score and value GEMMs (query-key width qk_nope + qk_rope, value width v_head_dim; seq/2 keys
    on average), 3 x their forward."""
    H, nh, r, dr = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    q = H * nh * cfg.qk_head_dim if cfg.q_lora_rank is None else cfg.q_lora_rank * (H + nh * cfg.qk_head_dim)
    attn = q + H * (r + dr) + r * nh * (cfg.qk_nope_head_dim + cfg.v_head_dim) + nh * cfg.v_head_dim * H
    active = cfg.vocab_size * H
    for i in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(i):
            experts = cfg.num_experts_per_tok + cfg.n_shared_experts
            mlp = experts * 3 * H * cfg.moe_intermediate_size + H * cfg.n_routed_experts
        else:
            mlp = 3 * H * cfg.intermediate_size
        active += attn + mlp
    scores = 3 * 2 * cfg.num_hidden_layers * nh * (cfg.qk_head_dim + cfg.v_head_dim) * seq / 2
    return 6.0 * active + scores


# ----------------------------------------------------------------------------------------------
# Hugging Face checkpoint layout: the hub's DeepSeek-V2 stores experts one by one (transformers'
# conversion mapping stacks them on load); everything else under the same names as here. config.json
# keys are honoured, pinned or metadata, as in fmoe.stages.qwen3_moe; anything else is refused.

# transformers' DeepseekV2Config defaults, for keys config.json omits (rope_theta 10000, plain RoPE)
HF_DEFAULTS = {
    "vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None, "max_position_embeddings": 2048,
    "initializer_range": 0.02, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "first_k_dense_replace": 0,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "n_group": None, "n_routed_experts": 64, "n_shared_experts": 2,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "routed_scaling_factor": 1.0, "topk_group": None,
    "topk_method": "greedy", "norm_topk_prob": False, "v_head_dim": 128, "num_experts_per_tok": None,
    "moe_intermediate_size": 1407,
}  # fmt: skip
HF_DEFAULT_ROPE_THETA = 10000.0


def write_hf(cfg: DeepseekV2Config) -> dict:
    """config.json's keys besides the fields: the rope (transformers 5's rope_parameters) and what
    transformers' DeepseekV2 reads that fmoe's math fixes."""
    rope = rotary.rope_parameters(cfg.rope_theta, cfg.rope_scaling)
    return dict(rope_parameters=rope, hidden_act="silu", attention_bias=False, mlp_bias=False,
                head_dim=cfg.qk_rope_head_dim)  # fmt: skip


def read_hf(hf: Mapping, kwargs: dict) -> dict:
    """The rope from rope_parameters (transformers 5: default or yarn) or rope_theta + rope_scaling
    (the hub / transformers 4: null or yarn)."""
    theta, scaling = rotary.rope_from_hf(hf, HF_DEFAULT_ROPE_THETA)
    return kwargs | {"rope_theta": theta, "rope_scaling": scaling}


# tensors: the hub's layout (above), HFMapping's default to_hf / from_hf
HF = hf_mapping.HFMapping(
    DeepseekV2Config, "DeepseekV2ForCausalLM", "deepseek_v2", defaults=HF_DEFAULTS,
    not_in_hf=("moe_capacity_factor", "rope_theta", "rope_scaling"),
    aliases={"n_routed_experts": ("n_routed_experts", "num_experts")},  # transformers' alias
    extra_honoured=hf_mapping.HF_ROPE_KEYS,
    pinned_fields={
        "hidden_act": ("silu",),
        "attention_bias": (False,),  # q_a / kv_a / o projection biases: not implemented
        "mlp_bias": (False,),
        "attention_dropout": (0.0,),
        "moe_layer_freq": (1,),  # the hub's remote code: MoE every layer after first_k_dense_replace
        "scoring_func": ("softmax",),  # the hub's remote code: the router's softmax
        "quantization_config": (None,),
    },
    extra_metadata=frozenset({
        "head_dim",  # transformers recomputes it as qk_rope_head_dim
        "qk_head_dim",  # transformers recomputes it as qk_nope_head_dim + qk_rope_head_dim
        "pretraining_tp",  # the hub's remote code: tensor-parallel slicing of the same products
        "ep_size",  # the hub's remote code: its expert-parallel degree
        "seq_aux",  # the hub's remote code: the aux loss's form (fmoe's is its own, see aux_loss_alpha)
        "auto_map",  # the hub's remote-code pointer (fmoe, like transformers 5, reads the weights itself)
    }),
    write=write_hf, read=read_hf,
)  # fmt: skip
# its conversions under their usual names
hf_config, config_from_hf = HF.hf_config, HF.config_from_hf
FAMILY = DECODER.family("deepseek_v2", DeepseekV2Config, train_flops_per_token, HF)
