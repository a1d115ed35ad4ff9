"""GPT-OSS as pure stage functions.

Attention: grouped-query attention with biased projections, a learned per-head sink logit (a
softmax column every query attends to whose value is zero), and layers alternating between a
causal sliding window of ``sliding_window`` keys and full causal attention (``layer_types``).
Rotary positions (half-rotation layout) with YaRN scaling. Every layer is MoE: a biased router
picks the top-k logits and softmaxes over just those; each expert is a biased, clamped SwiGLU
(``gate`` clamped above at ``swiglu_limit``, ``up`` to +-limit, ``(up + 1) * gate * sigmoid(alpha *
gate)``), its gate and up columns interleaved as in the released checkpoints.

Stages, with what flows between them (b batch, s sequence, T = b*s, k top-k, n = T*k):
  embed      (tokens)            -> (h [b,s,H])
  per layer (one expert-parallel rank, dropless; see fmoe.stages.qwen3_moe for the ep forms):
    attn       (h, positions)    -> (h1, x [T,H], ids [T,k], w [T,k])  + aux loss
    dispatch   (h1, x, ids, w)   -> (h1, x_perm [n,H], w, order [n], offs [E])
    mlp        (h1, x_perm, w, order, offs, *rest) -> (h1, y_perm [n,H], w, order, *rest)
    combine    (h1, y_perm, w, order, *rest)       -> (h1, y [T,k,H], w)
    aggregate  (h1, y, w)        -> (h [b,s,H])
  head       (h, labels)         -> (loss,)
Dispatch, combine and aggregate are Qwen3-MoE's (``fmoe.stages.qwen3_moe``).

Parameter names are transformers' (``GptOssForCausalLM``). One layout differs: fmoe keeps every
expert weight [E, out, in] for its grouped GEMM, so ``mlp.experts.gate_up_proj`` is [E, 2I, H]
(rows interleaved gate, up, gate, ...) and ``mlp.experts.down_proj`` [E, H, I], where transformers
stores [E, H, 2I] and [E, I, H]; ``to_hf`` / ``from_hf`` transpose. The biases
(``mlp.experts.gate_up_proj_bias`` [E, 2I], ``mlp.experts.down_proj_bias`` [E, H]) are as stored.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F
from fmoe.stages import deepseek_v2 as rope
from fmoe.stages import layers, qwen3_moe
from fmoe.stages.primitives import grouped_linear, linear
from fmoe.stages.spec import Model, Params, Stage, StageContext
from torch import Tensor

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
    layers, full on odd). rope_scaling: YaRN table (see fmoe.stages.deepseek_v2.check_rope_scaling)
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
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "num_local_experts",
            "num_experts_per_tok",
            "swiglu_limit",
            "max_position_embeddings",
            "rope_theta",
        )
        for f in positive:
            if getattr(self, f) <= 0:
                raise ValueError(f"{name}.{f} must be > 0, got {getattr(self, f)}")
        for f in ("router_aux_loss_coef", "rms_norm_eps"):
            if getattr(self, f) < 0:
                raise ValueError(f"{name}.{f} must be >= 0, got {getattr(self, f)}")
        if self.head_dim % 2:
            raise ValueError(f"{name}.head_dim must be even (rotary halves), got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{name}: num_key_value_heads ({self.num_key_value_heads}) must divide "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError(
                f"{name}.num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and "
                f"num_local_experts ({self.num_local_experts})"
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"{name}.sliding_window must be > 0 or None, got {self.sliding_window}")
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
        if self.moe_capacity_factor is not None and not self.moe_capacity_factor > 0:
            raise ValueError(
                f"{name}.moe_capacity_factor must be > 0 or None, got {self.moe_capacity_factor}"
            )
        object.__setattr__(
            self, "rope_scaling", rope.check_rope_scaling(self.rope_scaling, f"{name}.rope_scaling")
        )

    @property
    def num_experts(self) -> int:  # the name fmoe's shared MoE stages read
        return self.num_local_experts

    def window(self, layer: int) -> int | None:
        """The layer's attention window in keys (None: full causal)."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers

    def is_moe_layer(self, layer: int) -> bool:
        return True


# ----------------------------------------------------------------------------------------------
# building blocks


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


# ----------------------------------------------------------------------------------------------
# stage functions: pure, over a params dict with the layer prefix stripped


def embed(p: Params, inputs: tuple[Tensor, ...], ctx: StageContext) -> tuple[Tensor, ...]:
    """(tokens [b,s] int64) -> (h [b,s,H])."""
    (tokens,) = inputs
    return (F.embedding(tokens, p["model.embed_tokens.weight"]),)


def attention(cfg: GptOssConfig, layer: int, p: Params, x: Tensor, positions: Tensor) -> Tensor:
    """Sink attention of layer ``layer``. x: [b, s, H] (normed), positions [b, s] | [s] -> [b, s, H]."""
    b, s, _ = x.shape
    d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads

    def proj(n: str, heads: int) -> Tensor:
        bias = p[f"self_attn.{n}.bias"] if cfg.attention_bias else None
        return biased_linear(x, p[f"self_attn.{n}.weight"], bias).view(b, s, heads, d).transpose(1, 2)

    q, k, v = proj("q_proj", hq), proj("k_proj", hkv), proj("v_proj", hkv)
    angles, factor = rope.rotary_angles(positions, d, cfg.rope_theta, cfg.rope_scaling)
    angles = angles if angles.dim() == 3 else angles[None]
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


def attn(cfg: GptOssConfig, layer: int, p: Params, inputs: tuple[Tensor, ...], ctx: StageContext):
    """Pre-norm sink attention with residual, the post-attention norm, the router.

    (h [b,s,H], positions [b,s]|[s]) -> (h1 [b,s,H], x [T,H], ids [T,k] i64, w [T,k], aux [])
    """
    h, positions = inputs
    if ctx.group("cp") is not None:
        raise NotImplementedError(
            "GPT-OSS sink attention has no context-parallel form yet: run it with parallel.cp = 1"
        )
    h1 = h + attention(cfg, layer, p, rms_norm(h, p["input_layernorm.weight"], cfg.rms_norm_eps), positions)
    x = rms_norm(h1, p["post_attention_layernorm.weight"], cfg.rms_norm_eps).reshape(-1, cfg.hidden_size)
    probs, w, ids = router(cfg, x, p["mlp.router.weight"], p["mlp.router.bias"])
    outputs = (h1, x, ids, w)
    if cfg.router_aux_loss_coef:
        outputs += (layers.load_balancing_loss(probs, ids, cfg.num_experts),)
    return outputs


def dispatch(cfg: GptOssConfig, p: Params, inputs: tuple[Tensor, ...], ctx: StageContext):
    """Qwen3-MoE's dispatch: (h1, x [T,H], ids, w) -> (h1, x_perm [n,H], w, order, offs, *ep extras)."""
    return qwen3_moe.dispatch(cfg, p, inputs, ctx)


def mlp(cfg: GptOssConfig, p: Params, inputs: tuple[Tensor, ...], ctx: StageContext):
    """Biased clamped-SwiGLU experts of this ep rank over expert-grouped rows:
    (h1, x_perm [n,H], w, order, offs [El], *rest) -> (h1, y_perm [n,H], w, order, *rest)."""
    h1, x_perm, w, order, offs, *rest = inputs
    gate_up, down = p["mlp.experts.gate_up_proj"], p["mlp.experts.down_proj"]
    if gate_up.shape[0] != offs.shape[0] or down.shape[0] != offs.shape[0]:
        raise ValueError(
            f"mlp.experts.gate_up_proj / down_proj hold {gate_up.shape[0]} / {down.shape[0]} experts but "
            f"dispatch grouped rows for {offs.shape[0]}: under expert parallelism pass each rank its "
            "shard (fmoe.expert_parallel.shard_params)"
        )
    expert = row_experts(offs, x_perm.shape[0])
    a = grouped_linear(x_perm, gate_up, offs) + p["mlp.experts.gate_up_proj_bias"].index_select(0, expert)
    a = clamped_swiglu(a, cfg.swiglu_alpha, cfg.swiglu_limit)
    y = grouped_linear(a, down, offs) + p["mlp.experts.down_proj_bias"].index_select(0, expert)
    return (h1, y, w, order, *rest)


def combine(cfg: GptOssConfig, p: Params, inputs: tuple[Tensor, ...], ctx: StageContext):
    """Qwen3-MoE's combine: (h1, y_perm, w, order, *rest) -> (h1, y [T,k,H], w)."""
    return qwen3_moe.combine(cfg, p, inputs, ctx)


def aggregate(cfg: GptOssConfig, p: Params, inputs: tuple[Tensor, ...], ctx: StageContext):
    """(h1, y [T,k,H], w [T,k]) -> (h [b,s,H])."""
    return qwen3_moe.aggregate(cfg, True, p, inputs, ctx)


def head_logits(cfg: GptOssConfig, p: Params, h: Tensor) -> Tensor:
    """Final norm and LM head: h [b,s,H] -> logits [b,s,V] (as Qwen3-MoE's)."""
    return qwen3_moe.head_logits(cfg, p, h)


def head(cfg: GptOssConfig, p: Params, inputs: tuple[Tensor, ...], ctx: StageContext):
    """(h [b,s,H], labels [b,s] i64, -100 ignored) -> (mean token cross-entropy,) (as Qwen3-MoE's)."""
    return qwen3_moe.head(cfg, p, inputs, ctx)


# ----------------------------------------------------------------------------------------------
# the model


def param_shapes(cfg: GptOssConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's global name and shape, in a stable order."""
    H, d, E, I = cfg.hidden_size, cfg.head_dim, cfg.num_local_experts, cfg.intermediate_size
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, H)}
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        shapes[pre + "input_layernorm.weight"] = (H,)
        for n, out in (("q_proj", hq * d), ("k_proj", hkv * d), ("v_proj", hkv * d)):
            shapes[pre + f"self_attn.{n}.weight"] = (out, H)
            if cfg.attention_bias:
                shapes[pre + f"self_attn.{n}.bias"] = (out,)
        shapes[pre + "self_attn.o_proj.weight"] = (H, hq * d)
        if cfg.attention_bias:
            shapes[pre + "self_attn.o_proj.bias"] = (H,)
        shapes[pre + "self_attn.sinks"] = (hq,)
        shapes[pre + "post_attention_layernorm.weight"] = (H,)
        shapes[pre + "mlp.router.weight"] = (E, H)
        shapes[pre + "mlp.router.bias"] = (E,)
        shapes[pre + "mlp.experts.gate_up_proj"] = (E, 2 * I, H)
        shapes[pre + "mlp.experts.gate_up_proj_bias"] = (E, 2 * I)
        shapes[pre + "mlp.experts.down_proj"] = (E, H, I)
        shapes[pre + "mlp.experts.down_proj_bias"] = (E, H)
    shapes["model.norm.weight"] = (H,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, H)
    return shapes


def init_params(
    cfg: GptOssConfig, seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> dict[str, Tensor]:
    """Seeded init: norms 1, biases 0, everything else (sinks included) N(0, initializer_range), each
    parameter from its own generator seeded by (seed, name) so any layout inits the same numbers."""
    params = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith("norm.weight"):
            value = torch.ones(shape)
        elif name.endswith("bias"):
            value = torch.zeros(shape)
        else:
            value = layers.seeded_normal(name, shape, seed, cfg.initializer_range)
        params[name] = value.to(device=device, dtype=dtype)
    return params


def build(cfg: GptOssConfig) -> Model:
    """The model's stages in forward order."""
    shapes = param_shapes(cfg)
    stages = [Stage("embed", embed, ("model.embed_tokens.weight",), batch_inputs=("tokens",))]
    layer_of = [-1]
    aux_weight = cfg.router_aux_loss_coef / cfg.num_hidden_layers
    part = functools.partial
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        owned = [n for n in shapes if n.startswith(pre)]
        attn_params = tuple(n for n in owned if "self_attn" in n or "layernorm" in n or ".mlp.router." in n)
        mlp_params = tuple(n for n in owned if n not in attn_params)
        losses = (aux_weight,) if cfg.router_aux_loss_coef else ()
        layer = [
            Stage(f"layers.{i}.attn", part(attn, cfg, i), attn_params, pre, ("positions",), losses),
            Stage(f"layers.{i}.dispatch", part(dispatch, cfg), kind="comm"),
            Stage(f"layers.{i}.mlp", part(mlp, cfg), mlp_params, pre),
            Stage(f"layers.{i}.combine", part(combine, cfg), kind="comm"),
            Stage(f"layers.{i}.aggregate", part(aggregate, cfg)),
        ]
        stages += layer
        layer_of += [i] * len(layer)
    head_params = (
        "model.norm.weight",
        "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight",
    )
    stages.append(Stage("head", part(head, cfg), head_params, batch_inputs=("labels",), losses=(1.0,)))
    layer_of.append(-1)
    return Model(cfg, tuple(stages), part(init_params, cfg), tuple(layer_of))


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


def logits(cfg: GptOssConfig, params: Params, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
    """Plain forward to logits [b,s,V] (inference, HF parity checks); runs the same stage functions."""
    return rope.run_to_logits(build(cfg), functools.partial(head_logits, cfg), params, tokens, positions)


# ----------------------------------------------------------------------------------------------
# Hugging Face checkpoint layout: transformers' (the dequantized bf16 checkpoints' names), stacked
# experts [E, in, out]; fmoe's expert weights are [E, out, in] (see the module docstring).

HF_ARCHITECTURE = "GptOssForCausalLM"
HF_MODEL_TYPE = "gpt_oss"
FMOE_ONLY_FIELDS = ("moe_capacity_factor", "rope_theta", "rope_scaling")
_TRANSPOSED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# config.json keys, as in fmoe.stages.qwen3_moe: honoured (set or checked against a config field),
# pinned (only the listed values), metadata (nothing the model computes); anything else is refused
HF_HONOURED_FIELDS = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "num_local_experts",
        "num_experts",  # transformers' alias of num_local_experts
        "num_experts_per_tok",
        "experts_per_token",  # the released checkpoints' duplicate of num_experts_per_tok
        "sliding_window",
        "layer_types",
        "swiglu_alpha",
        "swiglu_limit",
        "attention_bias",
        "rms_norm_eps",
        "rope_parameters",  # transformers 5: default or yarn (deepseek_v2.check_rope_scaling)
        "rope_theta",  # transformers 4 / the hub
        "rope_scaling",  # transformers 4 / the hub: null or yarn
        "max_position_embeddings",
        "router_aux_loss_coef",
        "tie_word_embeddings",
        "initializer_range",
    }
)
HF_PINNED_FIELDS: dict[str, tuple] = {
    "attention_dropout": (0.0,),
    "quantization_config": (None,),  # MXFP4 checkpoints: dequantize to bf16 first
}
HF_METADATA_FIELDS = qwen3_moe.HF_COMMON_METADATA_FIELDS | {
    "hidden_act",  # transformers' GptOss never reads it: the experts' clamped SwiGLU is fixed
    "initial_context_length",  # the release's note of its pre-YaRN length; transformers never reads it
}
# transformers' GptOssConfig defaults, for keys config.json omits (rope: gpt-oss's YaRN, theta 150000)
HF_DEFAULTS = {
    "num_hidden_layers": 36,
    "num_local_experts": 128,
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "head_dim": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "sliding_window": 128,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "num_experts_per_tok": 4,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "router_aux_loss_coef": 0.001,
    "layer_types": None,
    "attention_bias": True,
}
HF_DEFAULT_ROPE_THETA = 150000.0


def to_hf(cfg: GptOssConfig, params: Params) -> dict[str, Tensor]:
    """fmoe params -> transformers' GptOss tensors (expert weights transposed to [E, in, out])."""
    out = {name: (t.transpose(1, 2) if name.endswith(_TRANSPOSED) else t) for name, t in params.items()}
    return {k: v.contiguous() for k, v in out.items()}


def from_hf(cfg: GptOssConfig, tensors: Params) -> dict[str, Tensor]:
    """transformers' GptOss tensors -> fmoe params. Raises KeyError naming the first missing tensor;
    MXFP4-quantized checkpoints (``*_blocks`` / ``*_scales``) must be dequantized first; ValueError
    names a tensor of the wrong shape or one the config has no place for."""
    shapes = param_shapes(cfg)
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
        stored = (shape[0], shape[2], shape[1]) if name.endswith(_TRANSPOSED) else shape
        qwen3_moe.check_shape(name, t, stored)
        params[name] = t.transpose(1, 2).contiguous() if name.endswith(_TRANSPOSED) else t
    qwen3_moe.refuse_surplus(tensors, set(shapes), cfg.tie_word_embeddings)
    return params


def hf_config(cfg: GptOssConfig) -> dict:
    """config.json for transformers' GptOssForCausalLM."""
    out = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name not in FMOE_ONLY_FIELDS}
    out["layer_types"] = list(cfg.layer_types)
    out["rope_parameters"] = rope.rope_parameters(cfg.rope_theta, cfg.rope_scaling)
    out.update(
        architectures=[HF_ARCHITECTURE],
        model_type=HF_MODEL_TYPE,
        hidden_act="silu",
        output_router_logits=False,
        use_cache=False,
    )
    return out


def config_from_hf(hf: Mapping) -> GptOssConfig:
    """Our config from a config.json dict: every key honoured, pinned or metadata (HF_HONOURED_FIELDS
    ...), a key it omits at transformers' default; ValueError names an unknown key or bad value."""
    qwen3_moe.check_hf_fields(hf, HF_MODEL_TYPE, HF_HONOURED_FIELDS, HF_PINNED_FIELDS, HF_METADATA_FIELDS)
    names = {f.name for f in fields(GptOssConfig) if f.name not in FMOE_ONLY_FIELDS}
    kwargs = dict(HF_DEFAULTS)
    kwargs.update({k: v for k, v in hf.items() if k in names and k != "num_local_experts"})
    kwargs.update(qwen3_moe.aliased_field(hf, "num_local_experts", ("num_local_experts", "num_experts")))
    if "experts_per_token" in hf and hf["experts_per_token"] != kwargs["num_experts_per_tok"]:
        raise ValueError(
            f"config.json fields 'experts_per_token' ({hf['experts_per_token']}) and 'num_experts_per_tok' "
            f"({kwargs['num_experts_per_tok']}) disagree"
        )
    # transformers: null head count / head_dim mean the plain ones
    if kwargs["num_key_value_heads"] is None:
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    if kwargs["head_dim"] is None and all(
        type(kwargs[k]) is int for k in ("hidden_size", "num_attention_heads")
    ):
        kwargs["head_dim"] = kwargs["hidden_size"] // max(kwargs["num_attention_heads"], 1)
    theta, scaling = rope.rope_from_hf(hf, HF_DEFAULT_ROPE_THETA)
    kwargs["rope_theta"] = theta
    if "rope_parameters" in hf or "rope_scaling" in hf:
        kwargs["rope_scaling"] = scaling
    return GptOssConfig(**qwen3_moe.checked_kwargs(GptOssConfig, kwargs))
