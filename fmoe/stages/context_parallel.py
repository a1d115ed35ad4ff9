"""Context parallelism: a sequence split over the ``cp`` group, attention exact across the split.

Layout (zigzag, for causal balance): the sequence is cut into ``2 * cp`` equal chunks and cp rank r
holds chunks r and ``2*cp - 1 - r``, so every rank has the same amount of causal attention work.
Positions travel with the tokens (the ``positions`` batch field), so rotary embeddings and the
causal mask follow the chunks.

Attention gathers K and V from the whole group (an all-gather; fine for small cp, the backward is a
reduce of the K/V gradients back to their owners) and masks by position: query position p sees
key positions <= p. The router's load-balancing statistics are summed over the group, so the aux
loss is that of the whole sequence.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor


def zigzag_positions(seq: int, cp: int, rank: int, device: torch.device | str = "cpu") -> Tensor:
    """The sequence positions cp rank ``rank`` holds: chunks rank and 2*cp-1-rank of 2*cp. -> [seq/cp]."""
    if seq % (2 * cp):
        raise ValueError(f"context parallel: sequence length {seq} must be a multiple of 2 x cp = {2 * cp}")
    chunk = seq // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, second])


def split_batch(batch: dict[str, Tensor], cp: int, rank: int) -> dict[str, Tensor]:
    """This cp rank's share of a batch of [b, s] fields, with its ``positions`` [s/cp]."""
    seq = batch["tokens"].shape[1]
    pos = zigzag_positions(seq, cp, rank, batch["tokens"].device)
    out = {k: v.index_select(1, pos) for k, v in batch.items() if k != "positions"}
    out["positions"] = pos
    return out


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim -2 in rank order; backward sums each rank's gradient slice to its owner."""

    @staticmethod
    def forward(x: Tensor, group) -> Tensor:
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-2)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, group = inputs
        ctx.group, ctx.local = group, x.shape[-2]

    @staticmethod
    def backward(ctx, grad: Tensor):
        rank = dist.get_rank(ctx.group)
        if dist.get_backend(ctx.group) == "nccl":
            chunks = list(grad.contiguous().chunk(dist.get_world_size(ctx.group), dim=-2))
            out = torch.empty_like(chunks[rank])
            dist.reduce_scatter(out, [c.contiguous() for c in chunks], group=ctx.group)
            return out, None
        grad = grad.contiguous()  # gloo has no reduce-scatter: sum everywhere, keep our slice
        dist.all_reduce(grad, group=ctx.group)
        return grad.narrow(-2, rank * ctx.local, ctx.local).contiguous(), None


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group; every rank uses the sum, so the gradient is the sum of their gradients."""

    @staticmethod
    def forward(x: Tensor, group) -> Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def gather_sequence(x: Tensor, group) -> Tensor:
    """x [..., s_local, d] -> [..., cp * s_local, d], rank-ordered, differentiable."""
    return _GatherSeq.apply(x, group)


def all_reduce_sum(x: Tensor, group) -> Tensor:
    """Differentiable sum over the group (every rank receives and uses the result)."""
    return _AllReduceSum.apply(x, group)


def gathered_positions(positions: Tensor, group) -> Tensor:
    """All ranks' positions in rank order: [s_local] -> [cp * s_local] (no gradient)."""
    parts = [torch.empty_like(positions) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, positions.contiguous(), group=group)
    return torch.cat(parts)


def causal_attention_cp(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, scale: float, group) -> Tensor:
    """Exact causal attention over a context-parallel split.

    q: [b, hq, s_local, d], k/v: [b, hkv, s_local, d], positions: [s_local] of this rank's tokens.
    -> [b, hq, s_local, d]: each query attends every key of the whole sequence at a position <= its own.
    """
    k_all, v_all = gather_sequence(k, group), gather_sequence(v, group)
    key_pos = gathered_positions(positions, group)
    mask = key_pos[None, :] <= positions[:, None]
    return F.scaled_dot_product_attention(
        q, k_all, v_all, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
