"""Point-to-point transfers of a carry tuple between pipeline ranks.

A send posts a header (int64 [HEADER]: count, then dtype code, ndim, sizes per tensor; -1 for a
missing gradient) and then each tensor, asynchronously (``isend``; the handles are waited on later,
which is never less safe than the blocking sends the validator proved deadlock-free); a receive
reads the header, then the tensors. Integer tensors (expert ids, orders) travel like the others.
Ownership: a sent tensor is read by the send until it is waited on; nothing here writes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fmoe import dist as D
from fmoe import stage as S

__all__ = ["HEADER", "MAX_IN_FLIGHT", "Channel"]

HEADER = 64
MAX_IN_FLIGHT = 8
_DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
)  # fmt: skip
_CODE = {d: i for i, d in enumerate(_DTYPES)}


@dataclass
class Channel:
    """This rank's end of the pipeline group's transfers: its sends in flight (at most
    ``MAX_IN_FLIGHT``, each kept alive with its tensors until waited on) and the wait bound."""

    group: dist.ProcessGroup
    rank: int
    timeout_s: float
    pending: list = field(default_factory=list)  # (works, tensors kept alive, what)

    def device(self) -> torch.device:
        """Where transfers happen: the current CUDA device under NCCL, else the CPU."""
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def wait(self, works, what: str) -> None:
        D.wait(works, self.group, what, self.rank, self.timeout_s)

    def send(self, tensors: tuple, peer: int, what: str) -> None:
        """Post ``tensors`` (None for a missing gradient) to pipeline rank ``peer``."""
        header = torch.zeros(HEADER, dtype=torch.int64)
        header[0] = len(tensors)
        at, payload = 1, []
        for t in tensors:
            if t is None:
                need = [-1, -1]
            else:
                if t.dtype not in _CODE:
                    raise S.StageError(f"{what}: cannot send a tensor of dtype {t.dtype}")
                need = [_CODE[t.dtype], t.dim(), *t.shape]
                payload.append(t.contiguous().view(torch.uint8) if t.dtype == torch.bool else t.contiguous())
            if at + len(need) > HEADER:
                raise S.StageError(f"{what}: the carry tuple needs more than {HEADER} header words")
            header[at : at + len(need)] = torch.tensor(need)
            at += len(need)
        header = header.to(self.device())
        gpeer = D.global_rank(self.group, peer)
        ops = [dist.P2POp(dist.isend, header, gpeer, self.group)]
        ops += [dist.P2POp(dist.isend, t, gpeer, self.group) for t in payload]
        self.pending.append((dist.batch_isend_irecv(ops), (header, payload), what))
        while len(self.pending) > MAX_IN_FLIGHT:  # bound what in-flight sends keep alive
            works, _, sent = self.pending.pop(0)
            self.wait(works, sent)

    def recv(self, peer: int, what: str) -> tuple:
        """The tuple pipeline rank ``peer`` sent (a header first, then its tensors)."""
        dev = self.device()
        gpeer = D.global_rank(self.group, peer)
        header = torch.empty(HEADER, dtype=torch.int64, device=dev)
        self.wait(dist.batch_isend_irecv([dist.P2POp(dist.irecv, header, gpeer, self.group)]), what)
        h = header.tolist()
        out: list = []
        bufs, at = [], 1
        for _ in range(h[0]):
            code, ndim = h[at], h[at + 1]
            if code < 0:
                out.append(None)
                at += 2
                continue
            shape = h[at + 2 : at + 2 + ndim]
            at += 2 + ndim
            dtype = _DTYPES[code]
            buf = torch.empty(shape, dtype=torch.uint8 if dtype == torch.bool else dtype, device=dev)
            bufs.append(buf)
            out.append(buf.view(torch.bool) if dtype == torch.bool else buf)
        if bufs:
            self.wait(
                dist.batch_isend_irecv([dist.P2POp(dist.irecv, b, gpeer, self.group) for b in bufs]), what
            )
        return tuple(out)

    def wait_all(self) -> None:
        """Wait for every send still in flight."""
        for works, _, what in self.pending:
            self.wait(works, what)
        self.pending.clear()
