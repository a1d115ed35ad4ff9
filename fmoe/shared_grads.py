"""The gradients of parameters that several pipeline ranks hold, summed over those ranks.

DualPipe's two model copies and tied embeddings put one parameter on several ranks of the pipeline
group, each of which ends a step with the gradient of its own rows only. ``sum_shared_grads`` gives
every holder the total: each holder sends its share to the lowest holder (the root), which adds
them in rank order (the same sum whatever the timing) and sends the total back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from fmoe import dist as D
from fmoe.p2p import Channel

__all__ = ["sum_shared_grads"]


def sum_shared_grads(
    grads: dict[str, Tensor], names: Sequence[str], holders: Mapping[str, Sequence[int]], link: Channel
) -> None:
    """Make ``grads[n]`` (this rank's share) the sum over the ranks holding ``n``, for each of ``names``.

    holders: {name: the pipeline ranks holding it, ascending} (``pipeline.param_holders``); link:
    this rank's end of the pipeline group. The entries of ``grads`` are replaced, not written into.
    """
    rank, group = link.rank, link.group
    pairs: dict[tuple[int, int], list[str]] = {}  # (root, other holder) -> names, for this rank's pairs
    for n in names:
        hs = holders[n]
        for o in hs[1:]:
            if rank in (hs[0], o):
                pairs.setdefault((hs[0], o), []).append(n)
    if not pairs:
        return
    dev, g = link.device(), grads

    def flat(ns):
        return torch.cat([g[n].reshape(-1) for n in ns]).to(dev)

    def unpack(buf, ns):
        at, out = 0, {}
        for n in ns:
            out[n] = buf[at : at + g[n].numel()].view_as(g[n]).to(g[n].device)
            at += g[n].numel()
        return out

    def exchange(send_from_root: bool) -> dict:
        ops, bufs = [], {}
        for (root, o), ns in sorted(pairs.items()):
            src, dst = (root, o) if send_from_root else (o, root)
            if rank == src:
                ops.append(dist.P2POp(dist.isend, flat(ns), D.global_rank(group, dst), group))
            else:
                bufs[(root, o)] = buf = torch.empty(
                    sum(g[n].numel() for n in ns), dtype=g[ns[0]].dtype, device=dev
                )
                ops.append(dist.P2POp(dist.irecv, buf, D.global_rank(group, src), group))
        link.wait(dist.batch_isend_irecv(ops), "the shared-gradient exchange")
        return bufs

    for (root, o), buf in sorted(exchange(send_from_root=False).items()):  # roots: add in rank order
        for n, t in unpack(buf, pairs[(root, o)]).items():
            g[n] = g[n] + t
    for (root, o), buf in exchange(send_from_root=True).items():
        for n, t in unpack(buf, pairs[(root, o)]).items():
            g[n] = t.clone()
