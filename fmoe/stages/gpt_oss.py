"""GPT-OSS on the MoE decoder builder (``fmoe.stages.decoder``: the stages, what flows between
them, parameter names and init).

Attention: grouped-query attention with biased projections, a learned per-head sink logit (a
softmax column every query attends to whose value is zero), and layers alternating between a
causal sliding window of ``sliding_window`` keys and full causal attention (``layer_types``).
Rotary positions (half-rotation layout) with YaRN scaling. Every layer is MoE: a biased router
picks the top-k logits and softmaxes over just those; each expert is a biased, clamped SwiGLU
(``gate`` clamped above at ``swiglu_limit``, ``up`` to +-limit, ``(up + 1) * gate * sigmoid(alpha *
gate)``), its gate and up columns interleaved as in the released checkpoints.

Parameter names are transformers' (``GptOssForCausalLM``). One layout differs: fmoe keeps every
expert weight [E, out, in] for its grouped GEMM, so ``mlp.experts.gate_up_proj`` is [E, 2I, H]
(rows interleaved gate, up, gate, ...) and ``mlp.experts.down_proj`` [E, H, I], where transformers
stores [E, H, 2I] and [E, I, H]; ``to_hf`` / ``from_hf`` transpose. The biases
(``mlp.experts.gate_up_proj_bias`` [E, 2I], ``mlp.experts.down_proj_bias`` [E, H]) are as stored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fmoe.stages import decoder, hf_mapping, rotary
from fmoe.stages import family as fam
from fmoe.stages.primitives import grouped_linear, linear
from fmoe.stages.spec import Params, StageContext

LAYER_TYPES = ("sliding_attention", "full_attention")


def _default_rope_scaling() -> dict:
    return {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    }


@dataclass(frozen=True)
class GptOssConfig:
    """Fields named as in transformers' ``GptOssConfig``; defaults give a tiny CPU model.

    layer_types: one of LAYER_TYPES per layer; None means transformers' default (sliding on even
    layers, full on odd). rope_scaling: YaRN table (see fmoe.stages.rotary.check_rope_scaling)
    or None for plain RoPE; the default is gpt-oss's.
    """

    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    sliding_window: int | None = 128
    layer_types: tuple[str, ...] | None = None
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_bias: bool = True
    rms_norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    rope_scaling: dict | None = field(default_factory=_default_rope_scaling)
    max_position_embeddings: int = 131072
    router_aux_loss_coef: float = 0.001
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    # fmoe training settings (not Hugging Face config fields; hf_config leaves them out)
    moe_capacity_factor: float | None = None  # None: dropless

    def __post_init__(self) -> None:
        name = type(self).__name__
        fam.check_fields(
            self, non_negative=("router_aux_loss_coef", "rms_norm_eps"),
            positive=("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "head_dim", "num_local_experts", "num_experts_per_tok", "swiglu_limit",
                      "max_position_embeddings", "rope_theta"),
            positive_or_none=("sliding_window", "moe_capacity_factor"),
        )  # fmt: skip
        if self.head_dim % 2:
            raise ValueError(f"{name}.head_dim must be even (rotary halves), got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{name}: num_key_value_heads ({self.num_key_value_heads}) must divide "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        fam.check_top_k(self, "num_experts_per_tok", "num_local_experts")
        types = self.layer_types
        if types is None:
            types = tuple(LAYER_TYPES[i % 2] for i in range(self.num_hidden_layers))
        types = tuple(types)
        if len(types) != self.num_hidden_layers:
            raise ValueError(
                f"{name}.layer_types has {len(types)} entries for num_hidden_layers={self.num_hidden_layers}"
            )
        for i, t in enumerate(types):
            if t not in LAYER_TYPES:
                raise ValueError(f"{name}.layer_types[{i}] must be one of {LAYER_TYPES}, got {t!r}")
        if "sliding_attention" in types and self.sliding_window is None:
            raise ValueError(f"{name}.sliding_window must be set when layer_types has 'sliding_attention'")
        object.__setattr__(self, "layer_types", types)
        object.__setattr__(
            self, "rope_scaling", rotary.check_rope_scaling(self.rope_scaling, f"{name}.rope_scaling")
        )

    @property
    def num_experts(self) -> int:  # transformers' alias
        return self.num_local_experts

    def window(self, layer: int) -> int | None:
        """The layer's attention window in keys (None: full causal)."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None


def dims(cfg: GptOssConfig) -> decoder.DecoderDims:
    return decoder.DecoderDims(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers,
        moe_layers=tuple(range(cfg.num_hidden_layers)), num_experts=cfg.num_local_experts,
        top_k=cfg.num_experts_per_tok, norm_eps=cfg.rms_norm_eps, aux_loss_coef=cfg.router_aux_loss_coef,
        tie_word_embeddings=cfg.tie_word_embeddings, init_std=cfg.initializer_range,
        capacity_factor=cfg.moe_capacity_factor, max_positions=cfg.max_position_embeddings,
    )  # fmt: skip


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """GPT-OSS's RMSNorm: normalise and scale in float32, then cast (Llama casts before scaling)."""
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x32).to(x.dtype)


def biased_linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    y = linear(x, w)
    return y if b is None else y + b


def rotate_halves(x: Tensor, angles: Tensor, factor: float) -> Tensor:
    """Rotate (x[:d/2], x[d/2:]) of x [b, heads, s, d] by angles [b|1, s, d/2], scaled by factor."""
    cos = (angles.cos() * factor).to(x.dtype)[:, None]
    sin = (angles.sin() * factor).to(x.dtype)[:, None]
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def sink_attention(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, positions: Tensor, scale: float, window: int | None
) -> Tensor:
    """Causal (optionally sliding-window) attention with a sink logit per head.

    q: [b, hq, s, d], k/v: [b, hkv, s, d], sinks: [hq], positions: [b, s] | [s] int64 -> [b, hq, s, d].
    Query i sees key j when pos_j <= pos_i (and pos_i - pos_j < window); the sink joins each row's
    softmax and is then dropped, so a row's weights sum to below one. An explicit [s, s] score
    matrix (exact in any dtype; a fused kernel with sinks is future work), softmax in >= float32.
    """
    b, hq, s, d = q.shape
    groups = hq // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale  # [b, hq, s, s]
    pos = positions if positions.dim() == 2 else positions[None]
    delta = pos[:, :, None] - pos[:, None, :]  # [b|1, s_q, s_k]: query position minus key position
    allowed = delta >= 0
    if window is not None:
        allowed = allowed & (delta < window)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    sink = sinks.to(scores.dtype).view(1, hq, 1, 1).expand(b, hq, s, 1)
    probs = torch.softmax(
        torch.cat((scores, sink), dim=-1), dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)
    )
    return probs[..., :-1].to(v.dtype) @ v


def clamped_swiglu(gate_up: Tensor, alpha: float, limit: float) -> Tensor:
    """gate_up [..., 2I] interleaved (gate, up, gate, up, ...) -> [..., I]."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def row_experts(offs: Tensor, rows: int) -> Tensor:
    """The expert of each of ``rows`` expert-grouped rows, from offs [E] int32 cumulative ends -> [rows] i64."""
    idx = torch.searchsorted(offs, torch.arange(rows, device=offs.device, dtype=offs.dtype), right=True)
    return idx.clamp_(max=offs.shape[0] - 1)


def attention(
    cfg: GptOssConfig, layer: int, p: Params, x: Tensor, positions: Tensor, ctx: StageContext
) -> Tensor:
    """Sink attention of layer ``layer``. x: [b, s, H] (normed), positions [b, s] | [s] -> [b, s, H]."""
    if ctx.group("cp") is not None:
        raise NotImplementedError(
            "GPT-OSS sink attention has no context-parallel form yet: run it with parallel.cp = 1"
        )
    b, s, _ = x.shape
    d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads

    def proj(n: str, heads: int) -> Tensor:
        bias = p[f"self_attn.{n}.bias"] if cfg.attention_bias else None
        return biased_linear(x, p[f"self_attn.{n}.weight"], bias).view(b, s, heads, d).transpose(1, 2)

    q, k, v = proj("q_proj", hq), proj("k_proj", hkv), proj("v_proj", hkv)
    angles, factor = rotary.rotary_angles(positions, d, cfg.rope_theta, cfg.rope_scaling)
    angles = rotary.batch_angles(angles)
    q, k = rotate_halves(q, angles, factor), rotate_halves(k, angles, factor)
    out = sink_attention(q, k, v, p["self_attn.sinks"], positions, d**-0.5, cfg.window(layer))
    o_bias = p["self_attn.o_proj.bias"] if cfg.attention_bias else None
    return biased_linear(out.transpose(1, 2).reshape(b, s, hq * d), p["self_attn.o_proj.weight"], o_bias)


def router(cfg: GptOssConfig, x: Tensor, w: Tensor, bias: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x [T, H], w [E, H], bias [E] -> (probs [T, E] f32 for the aux loss, weights [T, k], ids [T, k] i64):
    top-k of the biased logits, softmax over the k chosen."""
    logits = linear(x, w, fp8=False) + bias
    top, ids = torch.topk(logits, cfg.num_experts_per_tok, dim=-1)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    return probs, torch.softmax(top, dim=-1), ids


def attention_shapes(cfg: GptOssConfig, layer: int) -> dict[str, tuple[int, ...]]:
    H, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    shapes: dict[str, tuple[int, ...]] = {}
    for n, out, into in (
        ("q_proj", hq * d, H),
        ("k_proj", hkv * d, H),
        ("v_proj", hkv * d, H),
        ("o_proj", H, hq * d),
    ):
        shapes[f"self_attn.{n}.weight"] = (out, into)
        if cfg.attention_bias:
            shapes[f"self_attn.{n}.bias"] = decoder.Zeros((out,))
    return shapes | {"self_attn.sinks": (hq,)}


def route(cfg: GptOssConfig, p: Params, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``MoEDecoder.router``: ``router`` with the layer's weight and bias."""
    return router(cfg, x, p["mlp.router.weight"], p["mlp.router.bias"])


def router_shapes(cfg: GptOssConfig) -> dict[str, tuple[int, ...]]:
    return {
        "mlp.router.weight": (cfg.num_local_experts, cfg.hidden_size),
        "mlp.router.bias": decoder.Zeros((cfg.num_local_experts,)),
    }


def experts(cfg: GptOssConfig, p: Params, x: Tensor, offs: Tensor) -> Tensor:
    """Biased clamped-SwiGLU experts of this ep rank over expert-grouped rows x [n,H] (offs [El]) -> [n,H]."""
    expert = row_experts(offs, x.shape[0])
    a = grouped_linear(x, p["mlp.experts.gate_up_proj"], offs)
    a = clamped_swiglu(
        a + p["mlp.experts.gate_up_proj_bias"].index_select(0, expert), cfg.swiglu_alpha, cfg.swiglu_limit
    )
    return grouped_linear(a, p["mlp.experts.down_proj"], offs) + p["mlp.experts.down_proj_bias"].index_select(
        0, expert
    )


def expert_shapes(cfg: GptOssConfig) -> dict[str, tuple[int, ...]]:
    E, H, inter = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    return {
        "mlp.experts.gate_up_proj": (E, 2 * inter, H),
        "mlp.experts.gate_up_proj_bias": decoder.Zeros((E, 2 * inter)),
        "mlp.experts.down_proj": (E, H, inter),
        "mlp.experts.down_proj_bias": decoder.Zeros((E, H)),
    }


def norm(x: Tensor, p: Params, name: str, eps: float) -> Tensor:
    """``MoEDecoder.norm``: GPT-OSS's RMSNorm with weight ``{name}.weight``."""
    return rms_norm(x, p[f"{name}.weight"], eps)


# hub_expert_parts=(): transformers' GptOss checkpoints hold the experts stacked (to_hf / from_hf)
DECODER = decoder.MoEDecoder(
    dims,
    attention,
    attention_shapes,
    route,
    router_shapes,
    experts,
    expert_shapes,
    norm=norm,
    hub_expert_parts=(),
)
# the family's functions under their usual names
build, init_params, param_shapes = DECODER.build, DECODER.init_params, DECODER.param_shapes
logits = DECODER.logits


def causal_keys(seq: int, window: int | None) -> float:
    """Keys a query sees on average in a causal sequence of ``seq`` tokens, the last ``window`` of
    them at most (None: all): seq / 2 for full attention (the usual convention), and in the same
    continuous count w - w^2 / (2 seq) for a window w < seq (w for most queries, fewer at the start)."""
    if window is None or window >= seq:
        return seq / 2
    return window - window * window / (2 * seq)


def train_flops_per_token(cfg: GptOssConfig, seq: int) -> float:
    """Model FLOPs per trained token at sequence length ``seq`` (what MFU divides by): forward +
    backward = 6 x the weights a token's GEMMs touch (q/k/v/o, the router, top-k experts, the LM
    head; the embedding lookup is free), plus the score and value GEMMs, 3 x their forward, over
    each layer's keys (``causal_keys``: sliding-window layers see at most ``sliding_window``)."""
    H, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    attn = H * d * (2 * hq + 2 * hkv)
    mlp = cfg.num_experts_per_tok * 3 * H * cfg.intermediate_size + H * cfg.num_local_experts
    active = cfg.vocab_size * H + cfg.num_hidden_layers * (attn + mlp)
    keys = sum(causal_keys(seq, cfg.window(i)) for i in range(cfg.num_hidden_layers))
    return 6.0 * active + 3 * 2 * 2 * hq * d * keys


# ----------------------------------------------------------------------------------------------
# Hugging Face checkpoint layout: transformers' (the dequantized bf16 checkpoints' names), stacked
# experts [E, in, out]; fmoe's expert weights are [E, out, in] (see the module docstring).
# config.json keys are honoured, pinned or metadata, as in fmoe.stages.qwen3_moe.

# the local names of the expert weights transformers stores [E, in, out]
_TRANSPOSED_LOCAL = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# transformers' GptOssConfig defaults, for keys config.json omits (rope: gpt-oss's YaRN, theta 150000)
HF_DEFAULTS = {
    "num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
    "sliding_window": 128, "tie_word_embeddings": False, "initializer_range": 0.02,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "num_experts_per_tok": 4, "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0, "router_aux_loss_coef": 0.001, "layer_types": None, "attention_bias": True,
}  # fmt: skip
HF_DEFAULT_ROPE_THETA = 150000.0


def transposed(cfg: GptOssConfig) -> frozenset[str]:
    """The global names of the expert weights transformers stores transposed ([E, in, out])."""
    layers = DECODER.dims(cfg).moe_layers
    return frozenset(hf_mapping.layer_prefix(i) + n for i in layers for n in _TRANSPOSED_LOCAL)


def to_hf(cfg: GptOssConfig, params: Params) -> dict[str, Tensor]:
    """fmoe params -> transformers' GptOss tensors (expert weights transposed to [E, in, out])."""
    flip = transposed(cfg)
    out = {name: (t.transpose(1, 2) if name in flip else t) for name, t in params.items()}
    return {k: v.contiguous() for k, v in out.items()}


def from_hf(cfg: GptOssConfig, tensors: Params) -> dict[str, Tensor]:
    """transformers' GptOss tensors -> fmoe params. Raises KeyError naming the first missing tensor;
    MXFP4-quantized checkpoints (``*_blocks`` / ``*_scales``) must be dequantized first; ValueError
    names a tensor of the wrong shape or one the config has no place for."""
    shapes, flip = param_shapes(cfg), transposed(cfg)
    params: dict[str, Tensor] = {}
    for name, shape in shapes.items():
        if name not in tensors:
            if name + "_blocks" in tensors:
                raise KeyError(
                    f"Hugging Face checkpoint holds {name!r} MXFP4-quantized ({name}_blocks); "
                    "import a dequantized (bf16) checkpoint"
                )
            raise KeyError(f"Hugging Face checkpoint lacks tensor {name!r}")
        t = tensors[name]
        # transformers stores the expert weights [E, in, out]: the shape config.json implies there
        stored = (shape[0], shape[2], shape[1]) if name in flip else shape
        hf_mapping.check_shape(name, t, stored)
        params[name] = t.transpose(1, 2).contiguous() if name in flip else t
    derived = hf_mapping.hf_derived_tensors(cfg.num_hidden_layers)
    hf_mapping.refuse_surplus(tensors, set(shapes), cfg.tie_word_embeddings, derived)
    return params


def write_hf(cfg: GptOssConfig) -> dict:
    """config.json's keys besides the fields: the rope (transformers 5's rope_parameters), the activation."""
    return {"rope_parameters": rotary.rope_parameters(cfg.rope_theta, cfg.rope_scaling), "hidden_act": "silu"}


def read_hf(hf: Mapping, kwargs: dict) -> dict:
    """The released checkpoints' duplicate experts_per_token checked; null head count / head_dim
    read as the plain ones (as transformers); the rope from rope_parameters (transformers 5) or
    rope_theta + rope_scaling (transformers 4 / the hub), gpt-oss's YaRN when neither gives it."""
    if "experts_per_token" in hf and hf["experts_per_token"] != kwargs["num_experts_per_tok"]:
        raise ValueError(
            f"config.json fields 'experts_per_token' ({hf['experts_per_token']}) and 'num_experts_per_tok' "
            f"({kwargs['num_experts_per_tok']}) disagree"
        )
    kwargs = dict(kwargs)
    if kwargs["num_key_value_heads"] is None:
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    if kwargs["head_dim"] is None and all(
        type(kwargs[k]) is int for k in ("hidden_size", "num_attention_heads")
    ):
        kwargs["head_dim"] = kwargs["hidden_size"] // max(kwargs["num_attention_heads"], 1)
    theta, scaling = rotary.rope_from_hf(hf, HF_DEFAULT_ROPE_THETA)
    kwargs["rope_theta"] = theta
    if "rope_parameters" in hf or "rope_scaling" in hf:
        kwargs["rope_scaling"] = scaling
    return kwargs


HF = hf_mapping.HFMapping(
    GptOssConfig, "GptOssForCausalLM", "gpt_oss", defaults=HF_DEFAULTS,
    not_in_hf=("moe_capacity_factor", "rope_theta", "rope_scaling"),
    aliases={"num_local_experts": ("num_local_experts", "num_experts")},  # transformers' alias
    # experts_per_token: the released checkpoints' duplicate of num_experts_per_tok
    extra_honoured=hf_mapping.HF_ROPE_KEYS | {"experts_per_token"},
    pinned_fields={
        "attention_dropout": (0.0,),
        "quantization_config": (None,),  # MXFP4 checkpoints: dequantize to bf16 first
    },
    extra_metadata=frozenset({
        "hidden_act",  # transformers' GptOss never reads it: the experts' clamped SwiGLU is fixed
        "initial_context_length",  # the release's note of its pre-YaRN length; transformers never reads it
    }),
    write=write_hf, read=read_hf, to_hf=to_hf, from_hf=from_hf,
)  # fmt: skip
# its conversions under their usual names
hf_config, config_from_hf = HF.hf_config, HF.config_from_hf
FAMILY = DECODER.family("gpt_oss", GptOssConfig, train_flops_per_token, HF)
