"""Qwen3-MoE on the MoE decoder builder (``fmoe.stages.decoder``: the stages, what flows between
them, parameter names and init). What is Qwen3-MoE's own: grouped-query attention with q/k RMS
norms (optional projection biases, optional YaRN), a softmax top-k router (optionally renormalised),
SwiGLU experts, dense layers at ``mlp_only_layers`` / off the ``decoder_sparse_step``.

Parameter names are Hugging Face's (transformers' stacked-expert layout), so checkpoint conversion is
a renaming plus splitting experts. With ``moe_router_bias_update_rate > 0`` each MoE layer also has
``mlp.gate.e_score_correction_bias`` [E] (DeepSeek-V3's name): the builder's router-bias buffer,
added to the router's scores for the top-k selection only and moved by the step's load.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from torch import Tensor

from fmoe.stages import decoder, family, hf_mapping, layers, rotary
from fmoe.stages import moe as moe_blocks
from fmoe.stages.decoder import Ones, Zeros
from fmoe.stages.spec import Params, StageContext


@dataclass(frozen=True)
class Qwen3MoeConfig:
    """Fields named as in Hugging Face's ``Qwen3MoeConfig``; defaults give a tiny CPU model.

    rope_scaling: None (plain RoPE) or a YaRN table (transformers' ``rope_parameters`` without
    ``rope_theta``; see fmoe.stages.rotary.check_rope_scaling).
    """

    vocab_size: int = 512
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = 16
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    intermediate_size: int = 128
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)
    tie_word_embeddings: bool = False
    router_aux_loss_coef: float = 0.001
    initializer_range: float = 0.02
    max_position_embeddings: int = 32768
    attention_bias: bool = False  # q/k/v/o projection biases
    rope_scaling: dict | None = None
    # fmoe training settings (not Hugging Face config fields; hf_config leaves them out)
    moe_capacity_factor: float | None = None  # None: dropless
    moe_router_bias_update_rate: float = 0.0  # > 0: aux-loss-free balancing bias (DeepSeek-V3)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        object.__setattr__(
            self, "rope_scaling", rotary.check_rope_scaling(self.rope_scaling, "Qwen3MoeConfig.rope_scaling")
        )
        non_negative = tuple(
            f.name
            for f in fields(self)
            if type(getattr(self, f.name)) in (int, float)
            and f.name not in ("head_dim", "moe_capacity_factor")
        )
        family.check_fields(
            self, non_negative=non_negative, positive_or_none=("head_dim", "moe_capacity_factor"),
            positive=("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                      "num_experts", "moe_intermediate_size", "intermediate_size", "max_position_embeddings",
                      "rope_theta"),
        )  # fmt: skip
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"Qwen3MoeConfig: num_attention_heads ({self.num_attention_heads}) must divide "
                f"hidden_size ({self.hidden_size}) when head_dim is not set"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"Qwen3MoeConfig: num_key_value_heads ({self.num_key_value_heads}) must divide "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        family.check_top_k(self, "num_experts_per_tok", "num_experts")
        if self.decoder_sparse_step < 1:
            raise ValueError(
                f"Qwen3MoeConfig.decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}"
            )
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(
                f"Qwen3MoeConfig.mlp_only_layers names layers {bad} outside 0..{self.num_hidden_layers - 1}"
            )

    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


# the aux-loss-free balancing bias of a MoE layer (a buffer: never trained, see the module docstring)
ROUTER_BIAS = "mlp.gate.e_score_correction_bias"


def router_bias_name(layer: int) -> str:
    return f"model.layers.{layer}.{ROUTER_BIAS}"


def dims(cfg: Qwen3MoeConfig) -> decoder.DecoderDims:
    biased = cfg.moe_router_bias_update_rate > 0
    return decoder.DecoderDims(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers,
        moe_layers=tuple(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)),
        num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok, norm_eps=cfg.rms_norm_eps,
        aux_loss_coef=cfg.router_aux_loss_coef, tie_word_embeddings=cfg.tie_word_embeddings,
        init_std=cfg.initializer_range, capacity_factor=cfg.moe_capacity_factor,
        router_bias=ROUTER_BIAS if biased else None, router_bias_rate=cfg.moe_router_bias_update_rate,
        max_positions=cfg.max_position_embeddings,
    )  # fmt: skip


def attention(
    cfg: Qwen3MoeConfig, layer: int, p: Params, x: Tensor, positions: Tensor, ctx: StageContext
) -> Tensor:
    """Grouped-query attention with q/k norms, causal. x [b,s,H] normed, positions [b,s]|[s] -> [b,s,H]."""
    biases = {f"{n}_b": p[f"self_attn.{n}_proj.bias"] for n in "qkvo"} if cfg.attention_bias else {}
    rotary_scaling = {}
    if cfg.rope_scaling is not None:  # YaRN's frequencies and cos/sin factor, as transformers computes them
        inv_freq, factor = rotary.rotary_inv_freq(cfg.head_size, cfg.rope_theta, cfg.rope_scaling, x.device)
        rotary_scaling = {"rotary_inv_freq": inv_freq, "rotary_scale": factor}
    return layers.gqa_attention(
        x, positions, p["self_attn.q_proj.weight"], p["self_attn.k_proj.weight"], p["self_attn.v_proj.weight"],
        p["self_attn.o_proj.weight"], p["self_attn.q_norm.weight"], p["self_attn.k_norm.weight"],
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_size, cfg.rope_theta, cfg.rms_norm_eps,
        cp_group=ctx.group("cp"), **biases, **rotary_scaling,
    )  # fmt: skip


def attention_shapes(cfg: Qwen3MoeConfig, layer: int) -> dict[str, tuple[int, ...]]:
    H, d, hq, hkv = cfg.hidden_size, cfg.head_size, cfg.num_attention_heads, cfg.num_key_value_heads
    shapes = {"self_attn.q_proj.weight": (hq * d, H), "self_attn.k_proj.weight": (hkv * d, H)}
    shapes |= {"self_attn.v_proj.weight": (hkv * d, H), "self_attn.o_proj.weight": (H, hq * d)}
    if cfg.attention_bias:
        shapes |= {"self_attn.q_proj.bias": Zeros((hq * d,)), "self_attn.k_proj.bias": Zeros((hkv * d,))}
        shapes |= {"self_attn.v_proj.bias": Zeros((hkv * d,)), "self_attn.o_proj.bias": Zeros((H,))}
    return shapes | {"self_attn.q_norm.weight": Ones((d,)), "self_attn.k_norm.weight": Ones((d,))}


def router(cfg: Qwen3MoeConfig, p: Params, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Softmax top-k (renormalised under norm_topk_prob); the balancing bias, when there is one,
    moves the selection only: x [T,H] -> (probs [T,E], weights [T,k], ids [T,k])."""
    if cfg.moe_router_bias_update_rate > 0:
        return moe_blocks.biased_top_k_router(
            x, p["mlp.gate.weight"], p[ROUTER_BIAS], cfg.num_experts_per_tok, cfg.norm_topk_prob
        )
    return layers.top_k_router(x, p["mlp.gate.weight"], cfg.num_experts_per_tok, cfg.norm_topk_prob)


def router_shapes(cfg: Qwen3MoeConfig) -> dict[str, tuple[int, ...]]:
    shapes = {"mlp.gate.weight": (cfg.num_experts, cfg.hidden_size)}
    return shapes | ({ROUTER_BIAS: (cfg.num_experts,)} if cfg.moe_router_bias_update_rate > 0 else {})


def expert_shapes(cfg: Qwen3MoeConfig) -> dict[str, tuple[int, ...]]:
    return decoder.swiglu_expert_shapes(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)


def dense_shapes(cfg: Qwen3MoeConfig) -> dict[str, tuple[int, ...]]:
    return decoder.gated_mlp_shapes("mlp.", cfg.hidden_size, cfg.intermediate_size)


DECODER = decoder.MoEDecoder(
    dims, attention, attention_shapes, router, router_shapes, decoder.swiglu_experts, expert_shapes,
    gathered_experts=decoder.swiglu_gathered_experts,
    dense_mlp=decoder.dense_swiglu, dense_shapes=dense_shapes,
)  # fmt: skip
# the family's functions under their usual names
build, init_params, param_shapes = DECODER.build, DECODER.init_params, DECODER.param_shapes
logits = DECODER.logits


def train_flops_per_token(cfg: Qwen3MoeConfig, seq: int) -> float:
    """Model FLOPs per trained token at sequence length ``seq`` (what MFU divides by): forward +
    backward = 6 x the weights a token's GEMMs touch (q/k/v/o, the router and top-k experts of MoE
    layers, the dense MLPs, the LM head; the embedding lookup is free), plus the causal score and
    value GEMMs, 3 x their forward (seq/2 keys on average)."""
    H, d = cfg.hidden_size, cfg.head_size
    attn = H * d * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    active = cfg.vocab_size * H
    for i in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(i):
            mlp = cfg.num_experts_per_tok * 3 * H * cfg.moe_intermediate_size + H * cfg.num_experts
        else:
            mlp = 3 * H * cfg.intermediate_size
        active += attn + mlp
    scores = 3 * 2 * 2 * cfg.num_hidden_layers * cfg.num_attention_heads * d * seq / 2
    return 6.0 * active + scores


# ----------------------------------------------------------------------------------------------
# Hugging Face checkpoint layout: experts stored one by one (the hub's layout; transformers also
# reads it into its stacked layout), everything else under the same names as here.
#
# Import trusts no field it does not know: every key of config.json is either honoured (it sets a
# config field, or is checked against one), pinned (only the listed values, the ones whose math
# fmoe implements, are accepted), or harmless metadata (names, versions, storage dtype, token ids,
# output flags: nothing the model computes). Anything else is refused with the key named. A key
# config.json omits takes transformers' default (HF_DEFAULTS), as transformers itself would.

# transformers' Qwen3MoeConfig defaults, for keys config.json omits
HF_DEFAULTS = {
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": None, "max_position_embeddings": 32768,
    "initializer_range": 0.02, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
    "decoder_sparse_step": 1, "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_experts": 128,
    "norm_topk_prob": False, "router_aux_loss_coef": 0.001, "mlp_only_layers": (),
}  # fmt: skip
HF_DEFAULT_ROPE_THETA = 10000.0


def to_hf(cfg: Qwen3MoeConfig, params: Params) -> dict[str, Tensor]:
    """fmoe params -> Hugging Face hub tensors (per-expert gate/up/down projections); the router
    bias, an fmoe training buffer, is left out (Qwen3-MoE on the hub has none)."""
    return hf_mapping.unstack_hub_experts(
        params, DECODER.hub_experts(cfg), skip=frozenset(DECODER.buffers(cfg))
    )


def from_hf(cfg: Qwen3MoeConfig, tensors: Params) -> dict[str, Tensor]:
    """Hugging Face tensors (hub per-expert layout or transformers' stacked layout) -> fmoe params.

    Raises KeyError naming the first missing tensor, ValueError naming a tensor whose shape is not
    the one the config implies or one the config has no place for.
    """
    buffers = frozenset(DECODER.buffers(cfg))  # not in Hugging Face checkpoints: start neutral
    derived = hf_mapping.hf_derived_tensors(cfg.num_hidden_layers)
    return hf_mapping.stack_hub_experts(
        param_shapes(cfg), tensors, DECODER.hub_experts(cfg), derived, cfg.tie_word_embeddings, buffers
    )


def write_hf(cfg: Qwen3MoeConfig) -> dict:
    """config.json's keys besides the fields: head_dim resolved, the rope as transformers 4
    (rope_theta) and 5 (rope_parameters) read it, the experts' activation."""
    rope = rotary.rope_parameters(cfg.rope_theta, cfg.rope_scaling)
    return {
        "head_dim": cfg.head_size,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope,
        "hidden_act": "silu",
    }


def read_hf(hf: Mapping, kwargs: dict) -> dict:
    """The rope from rope_parameters (transformers 5: default or yarn) or rope_theta + rope_scaling
    (transformers 4 / the hub: null or yarn); a null mlp_only_layers is no dense layer, as in transformers."""
    theta, scaling = rotary.rope_from_hf(hf, HF_DEFAULT_ROPE_THETA)
    dense = () if kwargs.get("mlp_only_layers") is None else kwargs["mlp_only_layers"]
    return kwargs | {"rope_theta": theta, "rope_scaling": scaling, "mlp_only_layers": dense}


HF = hf_mapping.HFMapping(
    Qwen3MoeConfig, "Qwen3MoeForCausalLM", "qwen3_moe", defaults=HF_DEFAULTS,
    not_in_hf=("moe_capacity_factor", "moe_router_bias_update_rate", "rope_theta", "rope_scaling"),
    # transformers 5 writes num_local_experts, the hub and transformers 4 num_experts
    aliases={"num_experts": ("num_local_experts", "num_experts")},
    extra_honoured=hf_mapping.HF_ROPE_KEYS,
    # fields accepted only at these values: fmoe has no math for the others
    pinned_fields={
        "hidden_act": ("silu",),
        "attention_dropout": (0.0,),
        "use_sliding_window": (False,),  # sliding-window attention is not implemented
    },
    # sliding_window / max_window_layers are read only when use_sliding_window is true (refused above)
    extra_metadata=frozenset({"sliding_window", "max_window_layers"}),
    write=write_hf, read=read_hf, to_hf=to_hf, from_hf=from_hf,
)  # fmt: skip
# its conversions under their usual names
hf_config, config_from_hf = HF.hf_config, HF.config_from_hf
# attn passes ctx.group("cp") to the attention and the aux loss
FAMILY = DECODER.family(
    "qwen3_moe", Qwen3MoeConfig, train_flops_per_token, HF, supports_context_parallel=True
)
