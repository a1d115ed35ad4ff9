"""Point-to-point transfers of a carry tuple between pipeline ranks.

A send posts a header (int64 [HEADER]: count, then dtype code, ndim, sizes per tensor; -1 for a
missing gradient) and then each tensor, asynchronously (``isend``; the handles are waited on later,
which is never less safe than the blocking sends the validator proved deadlock-free); a receive
reads the header, then the tensors. Integer tensors (expert ids, orders) travel like the others.
Ownership: a sent tensor is read by the send until it is waited on; nothing here writes it.

What goes on the wire is the transport's (``transport``, chosen once per Channel from the group's
backend and the device the tuples live on):

  Direct  NCCL (device tensors on the wire), or gloo with CPU tensors: the tensors themselves are
          sent and received into fresh buffers; nothing staged, no extra synchronisation.
  Staged  gloo with CUDA tensors (several ranks sharing a GPU): gloo's send of a CUDA tensor kills
          the sender (``gloo::IoException ... writev: Bad address``), so every payload goes through
          pinned host buffers, copied on a side CUDA stream (``copy_stream``), not the compute one:
          send: the copy stream waits for the compute stream (the tensors' producers), copies device
          -> host and records an event; the send is posted by the transport's sender thread once
          that event has completed (gloo reads the host buffer from its own thread, so it must hold
          the values by then). The compute thread goes on queueing the next micro-batch's kernels
          meanwhile: the copy overlaps them (the overlap DualPipeV's F&B pairs are made for). The
          header is posted at once, on its own tag (``HEADER_TAG``), so the peer learns the shapes
          and posts its receives without waiting for this rank's GPU; the payloads follow on tag 0
          from one sender thread, in order: each tag's messages match the peer's receives one by one;
          receive: the message lands in host buffers; once the receive has completed (its wait
          returned), the copy stream copies them into new device tensors (allocated on the copy
          stream, ``record_stream``-ed for the compute stream that reads them) and records an event
          that the compute stream waits for: whatever is queued after the receive (its consumer)
          runs after the copy, while compute queued before it keeps running (the overlap).

Ownership of a staged host buffer (when it may be reused): a buffer serves one transfer at a time
and is kept per (peer, shape, dtype) for the next transfer of that key. A send's buffers return to
the pool when the send has been waited on (gloo reads them no more); a receive's when their copies
to the device have been issued, together with those copies' event, which the next taker waits for
before gloo writes into the buffer. So no buffer is written while a send or a device copy still
reads it. The pool lives as long as its Channel (one step). A device tensor being sent is read by
the copy stream after ``send`` returns: it is ``record_stream``-ed there, so the caller may drop it.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from fmoe import dist as D
from fmoe import stage as S

__all__ = [
    "HEADER",
    "HEADER_TAG",
    "MAX_IN_FLIGHT",
    "Channel",
    "Direct",
    "Incoming",
    "Posted",
    "Staged",
    "arrived",
    "copy_stream",
    "transport",
]

HEADER = 64
HEADER_TAG = 1  # staged headers' tag (payloads: 0); NCCL ignores tags, and Direct sends all on 0
MAX_IN_FLIGHT = 8
_DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
)  # fmt: skip
_CODE = {d: i for i, d in enumerate(_DTYPES)}
_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream staged transfers copy on (one per CUDA device, made on first use)."""
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


class Direct:
    """The tensors themselves on the wire: NCCL (``wire`` a CUDA device) or gloo on the CPU."""

    header_tag = 0

    def __init__(self, wire: torch.device):
        self.wire = wire

    def post(self, header: Tensor, tensors: Sequence[Tensor], peer: int, group: dist.ProcessGroup) -> Posted:
        """Post ``header`` then ``tensors`` (contiguous, on ``wire``) to pipeline rank ``peer``."""
        gpeer = D.global_rank(group, peer)
        ops = [dist.P2POp(dist.isend, t, gpeer, group) for t in (header, *tensors)]
        return Posted(dist.batch_isend_irecv(ops), header, list(tensors))

    def sent(self, wire: Sequence[Tensor], peer: int) -> None:
        """The send of ``wire`` has been waited on."""

    def close(self) -> None:
        """Every send has been waited on (the step's end)."""

    def buffers(self, specs: Sequence[tuple[list[int], torch.dtype]], peer: int) -> list[Tensor]:
        """Where a receive of tensors of these (shape, dtype) lands."""
        return [torch.empty(shape, dtype=dtype, device=self.wire) for shape, dtype in specs]

    def landed(self, wire: Sequence[Tensor], peer: int) -> list[Tensor]:
        """The received tensors for their consumer, once the receive into ``wire`` has completed."""
        return list(wire)


class Staged:
    """Tensors on ``device`` through host buffers on the wire (gloo): pinned, copied on
    ``copy_stream``, pooled per (peer, shape, dtype) by the module docstring's ownership rule. On a
    CPU ``device`` (what the CPU tests run) the copies are plain and there are no streams."""

    wire = torch.device("cpu")
    header_tag = HEADER_TAG

    def __init__(self, device: torch.device):
        self.device = device
        self.copies = copy_stream(device) if device.type == "cuda" else None
        self.pool: dict[tuple, list[tuple[Tensor, torch.cuda.Event | None]]] = {}
        self.allocated = 0  # host buffers made (the rest were reused): what the tests count
        # one thread posts the sends, in order, each once its copy is done (the module docstring)
        self.sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fmoe-p2p-send")

    def _take(self, peer: int, shape, dtype: torch.dtype) -> Tensor:
        free = self.pool.get((peer, tuple(shape), dtype))
        if free:
            buf, copied = free.pop()
            if copied is not None:
                copied.synchronize()  # a device copy may still read it: gloo must not write it yet
            return buf
        self.allocated += 1
        return torch.empty(shape, dtype=dtype, pin_memory=self.copies is not None)

    def _give(self, buf: Tensor, peer: int, copied: torch.cuda.Event | None = None) -> None:
        self.pool.setdefault((peer, tuple(buf.shape), buf.dtype), []).append((buf, copied))

    def post(self, header: Tensor, tensors: Sequence[Tensor], peer: int, group: dist.ProcessGroup) -> Posted:
        hosts = [self._take(peer, t.shape, t.dtype) for t in tensors]
        copied = None
        if self.copies is None:
            for h, t in zip(hosts, tensors):
                h.copy_(t)
        else:
            self.copies.wait_stream(torch.cuda.current_stream(self.device))  # the tensors' producers ran
            with torch.cuda.stream(self.copies):
                for h, t in zip(hosts, tensors):
                    h.copy_(t, non_blocking=True)
                    t.record_stream(self.copies)  # the caller may drop it before the copy has read it
                copied = torch.cuda.Event()
                copied.record()
        gpeer = D.global_rank(group, peer)
        told = dist.isend(header, gpeer, group, tag=HEADER_TAG)
        return Posted(
            [told, self.sender.submit(_post_when_copied, copied, hosts, gpeer, group)], header, hosts
        )

    def close(self) -> None:
        self.sender.shutdown(wait=False)

    def sent(self, wire: Sequence[Tensor], peer: int) -> None:
        for h in wire:
            self._give(h, peer)

    def buffers(self, specs: Sequence[tuple[list[int], torch.dtype]], peer: int) -> list[Tensor]:
        return [self._take(peer, shape, dtype) for shape, dtype in specs]

    def landed(self, wire: Sequence[Tensor], peer: int) -> list[Tensor]:
        if self.copies is None:
            out = [h.clone() for h in wire]
            for h in wire:
                self._give(h, peer)
            return out
        compute = torch.cuda.current_stream(self.device)
        out = []
        with torch.cuda.stream(self.copies):  # allocated on the copy stream: nothing it waits for
            for h in wire:
                t = torch.empty(h.shape, dtype=h.dtype, device=self.device)
                t.copy_(h, non_blocking=True)
                t.record_stream(compute)  # its memory is not reused before the compute stream's reads
                out.append(t)
            copied = torch.cuda.Event()
            copied.record()
        compute.wait_event(copied)  # the consumer, queued after this, reads the copies
        for h in wire:
            self._give(h, peer, copied)
        return out


@dataclass
class Posted:
    """One tuple's send in flight: ``wait()`` returns once every message of it is on its way (the
    works gloo or NCCL returned, or, staged, a future of them the sender thread fulfils). ``header``
    and ``payload`` (the tensors on the wire: the tuple's own, or their host copies) are read until
    then."""

    works: list
    header: Tensor
    payload: list[Tensor]

    def wait(self) -> None:
        for w in self.works:
            for work in w.result() if isinstance(w, Future) else [w]:
                work.wait()


def _post_when_copied(
    copied: torch.cuda.Event | None, wire: list[Tensor], gpeer: int, group: dist.ProcessGroup
) -> list:
    """On the sender thread: wait for the device -> host copy, then post one isend per tensor on tag
    0 (plain isends: gloo has no coalescing, and a coalescing manager's state is per group, not per
    thread)."""
    if copied is not None:
        copied.synchronize()
    return [dist.isend(t, gpeer, group) for t in wire]


def transport(backend: str, device: torch.device) -> Direct | Staged:
    """The transport for a group of ``backend`` carrying tensors that live on ``device``: NCCL
    sends them as they are (on the current CUDA device), gloo CPU tensors as they are and CUDA ones
    staged through pinned host buffers."""
    if backend == "nccl":
        return Direct(torch.device("cuda", torch.cuda.current_device()))
    if device.type == "cpu":
        return Direct(torch.device("cpu"))
    return Staged(device)


@dataclass
class Channel:
    """This rank's end of the pipeline group's transfers: its sends in flight (at most
    ``MAX_IN_FLIGHT``, each kept alive with its tensors until waited on), the wait bound, and the
    transport (``transport``: from the group's backend and ``compute``, the device the tuples'
    tensors live on; a test may pass its own)."""

    group: dist.ProcessGroup
    rank: int
    timeout_s: float
    compute: torch.device = torch.device("cpu")
    transport: Direct | Staged | None = None
    pending: list = field(default_factory=list)  # (Posted, peer, what)

    def __post_init__(self) -> None:
        if self.transport is None:
            self.transport = transport(dist.get_backend(self.group), self.compute)

    def device(self) -> torch.device:
        """Where the wire's tensors live: the current CUDA device under NCCL, else the CPU."""
        return self.transport.wire

    def wait(self, works, what: str) -> None:
        D.wait(works, self.group, what, self.rank, self.timeout_s)

    def _retire(self, entry) -> None:
        posted, peer, what = entry
        self.wait([posted], what)
        self.transport.sent(posted.payload, peer)

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
        posted = self.transport.post(header.to(self.device()), payload, peer, self.group)
        self.pending.append((posted, peer, what))
        while len(self.pending) > MAX_IN_FLIGHT:  # bound what in-flight sends keep alive
            self._retire(self.pending.pop(0))

    def post_recv(self, peer: int, what: str) -> Incoming:
        """Receive the header pipeline rank ``peer`` sent (waiting for it), then post the receives
        of its tensors (in order, so later messages cannot overtake them) without waiting: the
        returned ``Incoming`` waits when its consumer first needs the tuple."""
        gpeer = D.global_rank(self.group, peer)
        header = torch.empty(HEADER, dtype=torch.int64, device=self.device())
        tag = self.transport.header_tag
        self.wait(dist.batch_isend_irecv([dist.P2POp(dist.irecv, header, gpeer, self.group, tag)]), what)
        h = header.tolist()
        specs, dtypes, at = [], [], 1  # dtypes: each tuple entry's (None: a missing gradient)
        for _ in range(h[0]):
            code, ndim = h[at], h[at + 1]
            if code < 0:
                dtypes.append(None)
                at += 2
                continue
            dtype = _DTYPES[code]
            specs.append((h[at + 2 : at + 2 + ndim], torch.uint8 if dtype == torch.bool else dtype))
            dtypes.append(dtype)
            at += 2 + ndim
        bufs = self.transport.buffers(specs, peer) if specs else []
        ops = [dist.P2POp(dist.irecv, b, gpeer, self.group) for b in bufs]
        return Incoming(self, peer, what, dist.batch_isend_irecv(ops) if ops else [], bufs, dtypes)

    def recv(self, peer: int, what: str) -> tuple:
        """The tuple pipeline rank ``peer`` sent (a header first, then its tensors)."""
        return self.post_recv(peer, what).result()

    def wait_all(self) -> None:
        """Wait for every send still in flight."""
        for entry in self.pending:
            self._retire(entry)
        self.pending.clear()
        self.transport.close()


@dataclass
class Incoming:
    """A tuple whose header has arrived and whose tensors' receives are posted (``post_recv``).
    ``result()`` waits for them and hands them over through the transport (staged: copied to the
    device, the compute stream ordered after the copy), once; what ran on the device before it
    overlaps the transfer. bufs: where the tensors land; dtypes: each entry's (None: missing)."""

    channel: Channel
    peer: int
    what: str
    works: list
    bufs: list[Tensor]
    dtypes: list[torch.dtype | None]
    done: tuple | None = None

    def result(self) -> tuple:
        if self.done is None:
            got: list[Tensor] = []
            if self.bufs:
                self.channel.wait(self.works, self.what)
                got = self.channel.transport.landed(self.bufs, self.peer)
            tensors = iter(got)
            out = [None if d is None else next(tensors) for d in self.dtypes]
            self.done = tuple(t.view(torch.bool) if d == torch.bool else t for t, d in zip(out, self.dtypes))
        return self.done


def arrived(carry: tuple | Incoming) -> tuple:
    """``carry`` itself, or the tuple an ``Incoming`` brings (waiting for it now)."""
    return carry.result() if isinstance(carry, Incoming) else carry
