"""Shared building blocks of MoE transformers, as plain functions over tensors.

Shapes use b = batch, s = sequence, T = b * s tokens, H = hidden size, E = experts, k = top-k,
n = T * k routed rows, d = head dim. Weights are stored as in Hugging Face: a linear weight is
[out, in]; expert weights are stacked, gate_up [E, 2I, H] (gate rows first) and down [E, H, I].
"""

from __future__ import annotations

import importlib.util
import zlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from fmoe.kernels._triton import use_triton
from fmoe.kernels.permute import sum_slot_rows
from fmoe.stages.primitives import fp8_swiglu_experts, fuses_fp8_swiglu_experts, grouped_linear, linear
from fmoe.stages.recompute import recomputable


def _fused(t: Tensor) -> bool:
    """Whether a block runs its fused Triton kernels (``fmoe.kernels.fused``): CUDA tensors only.
    On the CPU the blocks stay plain torch ops (float64 gradient tests, exact Hugging Face parity);
    the kernels themselves are tested against their references under the interpreter."""
    return t.is_cuda and use_triton(t)


class _FusedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        from fmoe.kernels import fused

        x2 = x.reshape(-1, x.shape[-1])
        y, rstd = fused.rmsnorm(x2, weight, eps)
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: Tensor):
        from fmoe.kernels import fused

        x2, weight, rstd = ctx.saved_tensors
        dx, dw = fused.rmsnorm_backward(dy.reshape(x2.shape).contiguous(), x2, weight, rstd)
        return dx.view(dy.shape), dw, None


class _FusedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: Tensor) -> Tensor:
        from fmoe.kernels import fused

        ctx.save_for_backward(gate_up)
        return fused.swiglu(gate_up)

    @staticmethod
    def backward(ctx, da: Tensor):
        from fmoe.kernels import fused

        (gate_up,) = ctx.saved_tensors
        return fused.swiglu_backward(gate_up, da.contiguous())


class _FusedMoeSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, r: Tensor, y: Tensor, w: Tensor) -> Tensor:
        from fmoe.kernels import fused

        ctx.save_for_backward(y, w)
        return fused.moe_sum(r, y, w)

    @staticmethod
    def backward(ctx, g: Tensor):
        from fmoe.kernels import fused

        y, w = ctx.saved_tensors
        dy, dw = fused.moe_sum_backward(g, y, w)
        return g, dy, dw


class _FusedRotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        from fmoe.kernels import fused

        ctx.save_for_backward(cos, sin)
        return fused.rotary(x, cos, sin)

    @staticmethod
    def backward(ctx, g: Tensor):
        from fmoe.kernels import fused

        cos, sin = ctx.saved_tensors
        return fused.rotary(g.contiguous(), cos, sin, backward=True), None, None


_HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim, computed in float32 as Hugging Face does. x: [..., D], weight: [D].
    On CUDA one fused kernel each way (its single rounding of ``x * rstd * weight`` differs from
    Hugging Face's two in the last bit of bf16). Its output is recomputed in B, not kept, under
    selective recomputation (``fmoe.stages.recompute``)."""
    return recomputable(_rms_norm, x, weight, eps)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if _fused(x) and x.stride(-1) == 1:
        return _FusedRMSNorm.apply(x, weight, eps)
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rotary_cos_sin(
    positions: Tensor,
    head_dim: int,
    theta: float,
    dtype: torch.dtype,
    inv_freq: Tensor | None = None,
    scale: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """cos, sin tables [..., d] for integer ``positions`` [...] (half-rotation layout).

    ``inv_freq`` [d/2] float32, when given, replaces theta^(-2i/d) (a scaled RoPE such as YaRN);
    ``scale`` multiplies both tables (YaRN's attention factor), in float32 before the cast.
    """
    if inv_freq is None:
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)
        )
    freqs = positions[..., None].to(torch.float32) * inv_freq.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [b, heads, s, d] by cos/sin [b, s, d] (or [s, d])."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotate_heads(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on x [b, s, heads, d] in token-major layout, cos/sin [s, d] or [b, s, d] -> [b, s, heads, d].
    On CUDA one fused kernel each way (fp32 arithmetic, one rounding, where :func:`apply_rotary`'s
    bf16 ops round three times); elsewhere :func:`apply_rotary`."""
    b, s, heads, d = x.shape
    if _fused(x) and not (cos.requires_grad or sin.requires_grad):
        tokens = x.contiguous().view(b * s, heads, d)
        return _FusedRotary.apply(tokens, cos.reshape(-1, d), sin.reshape(-1, d)).view(x.shape)
    return apply_rotary(x.transpose(1, 2), cos, sin).transpose(1, 2)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Causal grouped-query attention. q: [b, hq, s, d], k/v: [b, hkv, s, d] -> [b, hq, s, d].

    Uses flash_attn when importable (CUDA, 16-bit), else torch SDPA (cuDNN/flash on GPU, math on CPU).
    """
    if _HAS_FLASH_ATTN and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        from flash_attn import flash_attn_func

        out = flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale, causal=True
        )
        return out.transpose(1, 2)
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def gqa_attention(
    x: Tensor,
    positions: Tensor,
    q_w: Tensor,
    k_w: Tensor,
    v_w: Tensor,
    o_w: Tensor,
    q_norm_w: Tensor | None,
    k_norm_w: Tensor | None,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rope_theta: float,
    eps: float,
    cp_group=None,
    *,
    q_b: Tensor | None = None,
    k_b: Tensor | None = None,
    v_b: Tensor | None = None,
    o_b: Tensor | None = None,
    rotary_inv_freq: Tensor | None = None,
    rotary_scale: float = 1.0,
) -> Tensor:
    """Grouped-query self-attention with optional per-head QK RMSNorm and rotary positions.

    x: [b, s, H] (already normed), positions: [b, s] or [s] int64 -> [b, s, H]. With a context-
    parallel group, x holds this rank's share of the sequence and positions ([s]) say where it sits.
    q_b/k_b/v_b/o_b: optional projection biases ([heads*d] / [kv_heads*d] / [H]), added before the
    QK norm and after the output projection (Hugging Face's ``attention_bias``). rotary_inv_freq /
    rotary_scale: a scaled RoPE's frequencies and cos/sin factor (see :func:`rotary_cos_sin`).
    """
    b, s, _ = x.shape

    def proj(w: Tensor, bias: Tensor | None, heads: int) -> Tensor:
        y = linear(x, w)
        return (y if bias is None else y + bias).view(b, s, heads, head_dim)

    q, k, v = proj(q_w, q_b, num_heads), proj(k_w, k_b, num_kv_heads), proj(v_w, v_b, num_kv_heads)
    if q_norm_w is not None:
        q, k = rms_norm(q, q_norm_w, eps), rms_norm(k, k_norm_w, eps)
    cos, sin = rotary_cos_sin(positions, head_dim, rope_theta, x.dtype, rotary_inv_freq, rotary_scale)
    q, k = rotate_heads(q, cos, sin), rotate_heads(k, cos, sin)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if cp_group is None:
        out = causal_attention(q, k, v, head_dim**-0.5)
    else:
        from fmoe.stages.context_parallel import causal_attention_cp

        out = causal_attention_cp(q, k, v, positions, head_dim**-0.5, cp_group)
    # a view of SDPA's output (laid out [b, s, heads, d]), which SDPA saves: no FP8 copy of it
    out = linear(out.transpose(1, 2).reshape(b, s, num_heads * head_dim), o_w, cache=False)
    return out if o_b is None else out + o_b


def top_k_router(
    x: Tensor, gate_w: Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Softmax router. x: [T, H], gate_w: [E, H] -> (probs [T, E] f32, weights [T, k] x.dtype, ids [T, k] i64).

    Softmax over all experts in float32, top-k, optionally renormalised over the chosen k.
    """
    logits = linear(x, gate_w, fp8=False)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return probs, weights.to(x.dtype), ids


def load_balancing_loss(probs: Tensor, ids: Tensor, num_experts: int, group=None) -> Tensor:
    """Switch-style aux loss of one layer: E * sum_e f_e * P_e, a scalar float32.

    f_e: share of the T*k routing slots that chose expert e (no gradient); P_e: mean router
    probability of e. probs: [T, E] f32, ids: [T, k]. With a (context-parallel) group, the
    statistics are those of all the group's tokens, so every rank gets the whole sequence's loss.
    """
    counts = torch.zeros(num_experts, dtype=probs.dtype, device=probs.device)
    counts.scatter_add_(0, ids.reshape(-1), torch.ones(ids.numel(), dtype=probs.dtype, device=probs.device))
    prob_sum, tokens = probs.sum(dim=0), ids.shape[0]
    if group is not None:
        import torch.distributed as dist

        from fmoe.stages.context_parallel import all_reduce_sum

        dist.all_reduce(counts, group=group)
        prob_sum = all_reduce_sum(prob_sum, group)
        tokens *= dist.get_world_size(group)
    return num_experts * ((counts / tokens) * (prob_sum / tokens)).sum()


def swiglu(gate_up: Tensor) -> Tensor:
    """silu(gate) * up for gate_up [..., 2I] laid out as [gate | up] -> [..., I]. Its output is
    recomputed in B, not kept, under selective recomputation (``fmoe.stages.recompute``)."""
    return recomputable(_swiglu, gate_up)


def _swiglu(gate_up: Tensor) -> Tensor:
    if _fused(gate_up) and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
        return _FusedSwiGLU.apply(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def expert_mlp(x: Tensor, gate_up_w: Tensor, down_w: Tensor, offs: Tensor) -> Tensor:
    """SwiGLU experts over expert-grouped rows. x: [n, H], gate_up_w: [E, 2I, H], down_w: [E, H, I],
    offs: [E] int32 cumulative end offsets -> [n, H]. In FP8 with the fused kernels one Function
    hands the FP8 operands between the GEMMs and SwiGLU (``primitives.fp8_swiglu_experts``: the bits
    of this composition with the fused SwiGLU). In FP8 the down GEMM's W reads the FP8 rows of
    SwiGLU's output (``w_reads_rows``), which nothing else keeps."""
    if _fused(x) and fuses_fp8_swiglu_experts(x, gate_up_w, down_w):
        return fp8_swiglu_experts(x, gate_up_w, down_w, offs)
    return grouped_linear(swiglu(grouped_linear(x, gate_up_w, offs)), down_w, offs, w_reads_rows=True)


def gathered_expert_mlp(
    tokens: Tensor, order: Tensor, top_k: int, gate_up_w: Tensor, down_w: Tensor, offs: Tensor
) -> Tensor:
    """:func:`expert_mlp` over ``permute_rows(tokens, order, top_k)``, its output put back in token
    order: tokens [T, H], order [n = T*k] int64 (dispatch's slots grouped by expert), offs [E]
    int32 -> [n, H], row ``order[i]`` the output of expert row i (``unpermute_rows``, flat).

    In FP8 with the fused kernels neither gathered copy is written: the experts' Function
    quantizes its input straight from the tokens, its down GEMM stores each row at its slot, and W
    reads the tokens and the output gradient where they lie (``primitives.fp8_swiglu_experts``);
    elsewhere the rows are gathered, ``expert_mlp`` runs, and its rows are put back. Same values and
    gradients either way."""
    if _fused(tokens) and fuses_fp8_swiglu_experts(tokens, gate_up_w, down_w):
        return fp8_swiglu_experts(tokens, gate_up_w, down_w, offs, order=order, top_k=top_k)
    return in_slot_order(lambda rows: expert_mlp(rows, gate_up_w, down_w, offs), tokens, order, top_k)


def in_slot_order(experts: Callable[[Tensor], Tensor], tokens: Tensor, order: Tensor, top_k: int) -> Tensor:
    """``experts`` (expert-grouped rows [n, H] -> [n, H']) over ``permute_rows(tokens, order,
    top_k)``, its output put back in token-slot order, flat: [n = T*k, H'] (``unpermute_rows``)."""
    return unpermute_rows(experts(permute_rows(tokens, order, top_k)), order, top_k).flatten(0, 1)


def dense_mlp(x: Tensor, gate_w: Tensor, up_w: Tensor, down_w: Tensor) -> Tensor:
    """SwiGLU MLP (a dense layer, or a shared expert). x: [..., H] -> [..., H]."""
    return linear(F.silu(linear(x, gate_w)) * linear(x, up_w), down_w)


def expert_order(ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """Stable grouping of the n = T*k routing slots by expert.

    ids: [T, k] -> (order [n] int64: slot indices sorted by expert, stable; offs [E] int32).
    """
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, torch.cumsum(counts, 0).to(torch.int32)


def inverse_permutation(order: Tensor) -> Tensor:
    """inverse[order[i]] = i for a permutation ``order`` [n] int64."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


# Both directions of the expert permutation are gathers, forward and backward. Autograd's own
# backward of ``index_select`` is an ``index_add_`` (atomics on CUDA, ~0.5 ms per 32k x 2048 rows
# on an H200 and not deterministic when a token's k copies meet); with the inverse permutation the
# gradient is a gather too, and a token's k copies are summed in a fixed order.
class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(x: Tensor, order: Tensor, top_k: int) -> Tensor:
        return x.index_select(0, order // top_k)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        _, order, top_k = inputs
        ctx.save_for_backward(order)
        ctx.top_k = top_k

    @staticmethod
    def backward(ctx, grad: Tensor):
        (order,) = ctx.saved_tensors
        return sum_slot_rows(grad, order, ctx.top_k), None, None


class _UnpermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(y: Tensor, order: Tensor, top_k: int) -> Tensor:
        return y.index_select(0, inverse_permutation(order)).view(-1, top_k, y.shape[-1])

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx, grad: Tensor):
        (order,) = ctx.saved_tensors
        return grad.reshape(-1, grad.shape[-1]).index_select(0, order), None, None


def permute_rows(x: Tensor, order: Tensor, top_k: int) -> Tensor:
    """Expert-grouped copy of the token rows: x [T, H] -> [n = T*k, H], row i = x[order[i] // k].
    ``order`` [n] int64 must be a permutation of the n routing slots (dispatch's stable sort)."""
    return _PermuteRows.apply(x, order, top_k)


def unpermute_rows(y: Tensor, order: Tensor, top_k: int) -> Tensor:
    """Inverse of :func:`permute_rows`: y [n, H] expert-grouped -> [T, k, H] in token order."""
    return _UnpermuteRows.apply(y, order, top_k)


def moe_output(h1: Tensor, y: Tensor, w: Tensor) -> Tensor:
    """End of an MoE layer: the residual plus the gate-weighted sum of each token's k expert outputs.
    h1 [..., H] with T tokens, y [T, k, H], w [T, k] -> [..., H] (one fused pass on CUDA)."""
    if _fused(y):
        return _FusedMoeSum.apply(h1.reshape(-1, h1.shape[-1]), y, w).view(h1.shape)
    return h1 + torch.einsum("tkh,tk->th", y, w.to(y.dtype)).view_as(h1)


def cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean token cross-entropy in float32; labels of -100 are ignored. logits [T, V], labels [T].
    On CUDA a fused kernel that reads the logits once each way and never makes a float32 copy of
    them (``fmoe.kernels.cross_entropy``); labels outside [0, V) then give a NaN loss, unchecked."""
    if _fused(logits):
        from fmoe.kernels.cross_entropy import cross_entropy as fused_cross_entropy

        return fused_cross_entropy(logits, labels, ignore_index=-100)
    return F.cross_entropy(logits.float(), labels, ignore_index=-100)


def seeded_normal(name: str, shape: tuple[int, ...], seed: int, std: float) -> Tensor:
    """N(0, std) float32 values for parameter ``name`` from a generator seeded by (seed, name), so a
    parameter's values do not depend on which others are created (every layout inits the same)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen) * std
