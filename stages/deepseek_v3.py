"""DeepSeek-V3 as pure stage functions: DeepSeek-V2's model with V3's router.

What V3 shares with V2 runs V2's functions (``fmoe.stages.deepseek_v2``) on an equivalent
``DeepseekV2Config`` (``DeepseekV3Config.v2``): multi-head latent attention with interleaved
decoupled RoPE and YaRN, the dense first ``first_k_dense_replace`` layers, the shared experts, the
routed expert MLPs, dispatch / combine / aggregate and the head. What differs is the router
(``noaux_tc_router``): sigmoid scores; for the choice only, each expert's score plus its
``mlp.gate.e_score_correction_bias``; experts in ``n_group`` groups, a group scored by the sum of its
two best biased scores, only the ``topk_group`` best groups eligible, the top-k eligible experts
chosen; weights are the chosen experts' sigmoid scores without the bias, normalised over the k if
``norm_topk_prob``, times ``routed_scaling_factor``. The bias is a buffer, not trained: with
``moe_router_bias_update_rate > 0`` each MoE attn stage returns its layer's load as a statistic
(``Stage.statistics``) and ``Model.buffer_updates`` moves the bias by rate * sign(mean load - load)
after each optimizer step (aux-loss-free balancing; ``fmoe.stages.moe.router_bias_step``).
Multi-token prediction (``num_nextn_predict_layers`` > 0) is refused.

Stages are DeepSeek-V2's; parameter names transformers' (``DeepseekV3ForCausalLM``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch
from fmoe.stages import deepseek_v2 as v2
from fmoe.stages import layers, qwen3_moe
from fmoe.stages import moe as moe_blocks
from fmoe.stages.primitives import linear
from fmoe.stages.spec import Model, Params, Stage, StageContext, Statistic
from torch import Tensor

ROUTER_BIAS = qwen3_moe.ROUTER_BIAS  # "mlp.gate.e_score_correction_bias", V3's own name
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
            object.__setattr__(self, "rope_scaling", self.v2.rope_scaling)
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
    def v2(self) -> v2.DeepseekV2Config:
        """The DeepSeek-V2 config with this model's attention, experts and layers (greedy softmax
        routing there, unused: V3's router replaces it); V2's stage functions run on it."""
        return v2.DeepseekV2Config(**{f: getattr(self, f) for f in V2_FIELDS}, aux_loss_alpha=0.0)

    @property
    def num_experts(self) -> int:  # the name fmoe's runtime reads
        return self.n_routed_experts

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
# stage functions: V2's, but for the attn stage's router


def attn(cfg: DeepseekV3Config, moe: bool, p: Params, inputs: tuple[Tensor, ...], ctx: StageContext):
    """DeepSeek-V2's attn stage with V3's router in MoE layers: (h [b,s,H], positions) ->
    MoE (h1, x [T,H], ids [T,k] i64, w [T,k], *[aux []], *[load [E] i64]); dense (h1, x)."""
    if not moe:
        return v2.attn(cfg.v2, False, p, inputs, ctx)
    h1, x = v2.attn(cfg.v2, False, p, inputs, ctx)
    scores, w, ids = noaux_tc_router(
        x, p["mlp.gate.weight"], p[ROUTER_BIAS], cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
        cfg.norm_topk_prob, cfg.routed_scaling_factor,
    )  # fmt: skip
    outputs = (h1, x, ids, w)
    if cfg.aux_loss_alpha:
        probs = scores / scores.sum(dim=-1, keepdim=True)
        outputs += (layers.load_balancing_loss(probs, ids, cfg.num_experts),)
    if cfg.moe_router_bias_update_rate > 0:  # the statistic the bias update reads
        outputs += (moe_blocks.expert_load(ids, cfg.num_experts),)
    return outputs


def router_bias_updates(cfg: DeepseekV3Config, statistics: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``Model.buffer_updates``: {bias name: [E] f32 step} from each layer's load over the step."""
    rate = cfg.moe_router_bias_update_rate
    return {name: moe_blocks.router_bias_step(load, rate) for name, load in statistics.items()}


# ----------------------------------------------------------------------------------------------
# the model


def param_shapes(cfg: DeepseekV3Config) -> dict[str, tuple[int, ...]]:
    """Every parameter's global name and shape: DeepSeek-V2's, plus each MoE layer's router bias."""
    shapes = {}
    for name, shape in v2.param_shapes(cfg.v2).items():
        shapes[name] = shape
        if name.endswith("mlp.gate.weight"):
            shapes[name.removesuffix("weight") + "e_score_correction_bias"] = (cfg.n_routed_experts,)
    return shapes


def init_params(
    cfg: DeepseekV3Config,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict[str, Tensor]:
    """DeepSeek-V2's seeded init; the router biases start at 0, in float32 (buffers)."""
    params = v2.init_params(cfg.v2, seed, dtype, device)
    zeros = functools.partial(torch.zeros, dtype=torch.float32, device=device)
    return {n: params[n] if n in params else zeros(s) for n, s in param_shapes(cfg).items()}


def build(cfg: DeepseekV3Config) -> Model:
    """The model's stages in forward order."""
    shapes, part, mla = param_shapes(cfg), functools.partial, cfg.v2
    stages = [Stage("embed", v2.embed, ("model.embed_tokens.weight",), batch_inputs=("tokens",))]
    layer_of = [-1]
    aux_weight = cfg.aux_loss_alpha / max(cfg.num_moe_layers, 1)
    updated = cfg.moe_router_bias_update_rate > 0
    for i in range(cfg.num_hidden_layers):
        pre, moe = f"model.layers.{i}.", cfg.is_moe_layer(i)
        owned = [n for n in shapes if n.startswith(pre)]
        router_params = ("mlp.gate.weight", ROUTER_BIAS)
        attn_params = tuple(
            n for n in owned if "self_attn" in n or "layernorm" in n or n.endswith(router_params)
        )
        mlp_params = tuple(n for n in owned if n not in attn_params)
        losses = (aux_weight,) if moe and cfg.aux_loss_alpha else ()
        stats = (Statistic(pre + ROUTER_BIAS, (cfg.n_routed_experts,)),) if moe and updated else ()
        attn_stage = Stage(f"layers.{i}.attn", part(attn, cfg, moe), attn_params, pre, ("positions",), losses,
                           statistics=stats)  # fmt: skip
        if moe:
            layer = [
                attn_stage,
                Stage(f"layers.{i}.dispatch", part(v2.dispatch, mla), kind="comm"),
                Stage(f"layers.{i}.mlp", part(v2.mlp, mla, True), mlp_params, pre),
                Stage(f"layers.{i}.combine", part(v2.combine, mla), kind="comm"),
            ]
        else:
            layer = [attn_stage, Stage(f"layers.{i}.mlp", part(v2.mlp, mla, False), mlp_params, pre)]
        layer.append(Stage(f"layers.{i}.aggregate", part(v2.aggregate, mla, moe)))
        stages += layer
        layer_of += [i] * len(layer)
    head_params = ("model.norm.weight", "lm_head.weight")
    if cfg.tie_word_embeddings:
        head_params = ("model.norm.weight", "model.embed_tokens.weight")
    stages.append(Stage("head", part(v2.head, mla), head_params, batch_inputs=("labels",), losses=(1.0,)))
    layer_of.append(-1)
    return Model(
        cfg, tuple(stages), part(init_params, cfg), tuple(layer_of),
        buffer_updates=part(router_bias_updates, cfg) if updated else None,
        buffers=tuple(n for n in shapes if n.endswith(ROUTER_BIAS)),
    )  # fmt: skip


def train_flops_per_token(cfg: DeepseekV3Config, seq: int) -> float:
    """DeepSeek-V2's count (the same GEMMs: the router's [E, H] product, top-k + shared experts, MLA)."""
    return v2.train_flops_per_token(cfg.v2, seq)


def logits(cfg: DeepseekV3Config, params: Params, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
    """Plain forward to logits [b,s,V] (inference, HF parity checks); runs the same stage functions."""
    return v2.run_to_logits(build(cfg), functools.partial(v2.head_logits, cfg.v2), params, tokens, positions)


# ----------------------------------------------------------------------------------------------
# Hugging Face checkpoint layout: as DeepSeek-V2's (experts one by one on the hub), with the router
# biases stored too. config.json keys are honoured, pinned or metadata (see fmoe.stages.qwen3_moe).

HF_ARCHITECTURE = "DeepseekV3ForCausalLM"
HF_MODEL_TYPE = "deepseek_v3"
FMOE_ONLY_FIELDS = ("moe_capacity_factor", "moe_router_bias_update_rate", "rope_theta", "rope_scaling")
HF_HONOURED_FIELDS = (v2.HF_HONOURED_FIELDS - {"topk_method"}) | {"num_local_experts"}
HF_PINNED_FIELDS: dict[str, tuple] = {
    **v2.HF_PINNED_FIELDS,
    "topk_method": ("noaux_tc",),  # the hub's remote code: V3's group-limited sigmoid choice
    "scoring_func": ("sigmoid",),
    "rope_interleave": (True,),  # the rotary pairs interleaved, as DeepSeek-V2 (and the hub) lay them out
    "num_nextn_predict_layers": (0,),  # multi-token prediction modules: not implemented
    "num_mtp_layers": (0,),  # transformers' alias of num_nextn_predict_layers
}
HF_METADATA_FIELDS = v2.HF_METADATA_FIELDS
# transformers' DeepseekV3Config defaults, for keys config.json omits (rope_theta 10000, plain RoPE)
HF_DEFAULTS = {
    **v2.HF_DEFAULTS,
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "max_position_embeddings": 4096, "aux_loss_alpha": 0.0,
}  # fmt: skip
del HF_DEFAULTS["topk_method"]


def to_hf(cfg: DeepseekV3Config, params: Params) -> dict[str, Tensor]:
    """fmoe params -> Hugging Face hub tensors (per-expert projections; the router biases kept)."""
    out = qwen3_moe.to_hf(cfg.v2, params)  # writes every tensor but the biases
    out.update({n: t.contiguous() for n, t in params.items() if n.endswith(ROUTER_BIAS)})
    return out


def from_hf(cfg: DeepseekV3Config, tensors: Params) -> dict[str, Tensor]:
    """Hugging Face tensors (hub per-expert or transformers' stacked layout) -> fmoe params; KeyError
    names a missing tensor (a router bias too: V3 checkpoints hold them), ValueError a misfit."""
    shapes = param_shapes(cfg)
    missing = [n for n in shapes if n.endswith(ROUTER_BIAS) and n not in tensors]
    if missing:
        raise KeyError(f"Hugging Face checkpoint lacks tensor {missing[0]!r}")
    return qwen3_moe.stack_hub_experts(shapes, cfg.n_routed_experts, tensors, cfg.tie_word_embeddings)


def hf_config(cfg: DeepseekV3Config) -> dict:
    """config.json for transformers' DeepseekV3ForCausalLM."""
    out = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name not in FMOE_ONLY_FIELDS}
    out.update(
        rope_parameters=v2.rope_parameters(cfg.rope_theta, cfg.rope_scaling),
        architectures=[HF_ARCHITECTURE], model_type=HF_MODEL_TYPE, topk_method="noaux_tc",
        scoring_func="sigmoid", rope_interleave=True, num_nextn_predict_layers=0, hidden_act="silu",
        attention_bias=False, head_dim=cfg.qk_rope_head_dim, output_router_logits=False, use_cache=False,
    )  # fmt: skip
    return out


def config_from_hf(hf: Mapping) -> DeepseekV3Config:
    """Our config from a config.json dict; ValueError names an unknown key or an unsupported value
    (multi-token prediction: ``num_nextn_predict_layers`` > 0)."""
    qwen3_moe.check_hf_fields(hf, HF_MODEL_TYPE, HF_HONOURED_FIELDS, HF_PINNED_FIELDS, HF_METADATA_FIELDS)
    names = {f.name for f in fields(DeepseekV3Config) if f.name not in FMOE_ONLY_FIELDS}
    kwargs = dict(HF_DEFAULTS)
    kwargs.update({k: v for k, v in hf.items() if k in names and k != "n_routed_experts"})
    keys = ("n_routed_experts", "num_experts", "num_local_experts")
    kwargs.update(qwen3_moe.aliased_field(hf, "n_routed_experts", keys))
    kwargs["rope_theta"], kwargs["rope_scaling"] = v2.rope_from_hf(hf, v2.HF_DEFAULT_ROPE_THETA)
    return DeepseekV3Config(**qwen3_moe.checked_kwargs(DeepseekV3Config, kwargs))
