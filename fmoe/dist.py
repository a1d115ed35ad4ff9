"""Process-group helpers: init from torchrun's environment or an explicit spawn (tests), and failure
propagation with no hang.

How a failure brings the group down (the choice, and why): a rank whose action raises writes its
message under a key of the group's TCPStore (``fail``) before raising; every blocking wait of the
interpreter (``wait``) polls that key while it waits and raises ``PipelineError`` with the failing
rank's message when it appears, and gives up after ``timeout_s`` (then it writes the key itself, so
its peers come down too). An all-reduce of an error flag per action would cost a collective per row;
the store is polled only while a rank is blocked anyway (every ``POLL_S``), so a healthy step pays
nothing for it.

Why a waiter thread: on gloo a pending send/recv can neither be polled (``is_completed`` stays False
until ``wait``) nor aborted (``abort``/``shutdown``/``destroy_process_group`` leave a blocked peer
blocked; only the owning process exiting unblocks it; checked on torch 2.13), and ``wait(timeout)``
cannot be retried. So for gloo the blocking ``Work.wait()`` runs on one daemon thread per process
while the calling thread waits on an Event and polls the store. After a failure the group is dead
(the stuck thread still holds its recv): the process should exit, which also closes its sockets. On
NCCL ``Work.wait()`` only orders the CUDA stream and returns at once, so it is called directly;
failures of peers surface at the next host sync and through NCCL's own timeout/abort watchdog.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from fmoe.stages.torch_dist import all_gather_single, reduce_scatter_single  # noqa: F401 - re-exported

FAILURE_KEY = "fmoe/pipeline_failure"
POLL_S = 0.02
DEFAULT_TIMEOUT_S = 600.0  # library default; a recipe sets its own (parallel.timeout_s)


class PipelineError(RuntimeError):
    """A pipeline rank failed (or timed out); the message names the rank and what it ran."""


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago (for a test's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BACKENDS = ("auto", "nccl", "gloo")


class BackendError(ValueError):
    """A process-group backend that cannot run on these devices; the message names parallel.backend."""


def local_device(local_rank: int, device_count: int) -> torch.device:
    """The device local rank ``local_rank`` computes on: ``cuda:(local_rank % device_count)``, so
    more local ranks than devices share them round-robin (one GPU: every rank on cuda:0); the CPU
    when ``device_count`` is 0."""
    if local_rank < 0 or device_count < 0:
        raise ValueError(
            f"local_device: local_rank {local_rank} and device_count {device_count} must be >= 0"
        )
    return torch.device("cpu") if device_count == 0 else torch.device("cuda", local_rank % device_count)


def choose_backend(requested: str, device_type: str, local_ranks: int, device_count: int) -> tuple[str, str]:
    """(the process group's backend, a note for the log or "") for ``parallel.backend = requested``.

    device_type: where the ranks compute ("cuda" or "cpu"); local_ranks: processes on this host;
    device_count: its CUDA devices. "auto": NCCL when every local rank has a CUDA device of its
    own, gloo otherwise (on the CPU, or ranks sharing a device: NCCL refuses two ranks on one
    device, "invalid usage", while gloo moves CUDA tensors; the note says why it chose gloo).
    Raises BackendError for an unknown name and for NCCL on the CPU or on a shared device.
    """
    if requested not in BACKENDS:
        raise BackendError(f"parallel.backend must be 'auto', 'nccl' or 'gloo', got {requested!r}")
    shared = device_type == "cuda" and local_ranks > device_count
    if requested == "gloo":
        return "gloo", ""
    if requested == "nccl" and device_type != "cuda":
        raise BackendError(
            "parallel.backend = 'nccl' needs CUDA devices but the run is on the CPU: use 'gloo'"
        )
    if requested == "nccl" and shared:
        raise BackendError(
            f"parallel.backend = 'nccl' with {local_ranks} local ranks on {device_count} CUDA device(s): "
            f"NCCL refuses two ranks on one device; use parallel.backend = 'gloo'"
        )
    if device_type != "cuda":
        return "gloo", ""
    if shared:
        return "gloo", (
            f"parallel.backend = 'auto' chose gloo: {local_ranks} local ranks share {device_count} CUDA "
            f"device(s) and NCCL refuses two ranks on one device"
        )
    return "nccl", ""


def init_from_env(
    backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, device: torch.device | None = None
) -> dist.ProcessGroup:
    """The default process group from torchrun's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT.

    backend: None for "nccl" when CUDA is available, else "gloo"; device: this rank's CUDA device
    (made current; None or no index: ``local_device`` of LOCAL_RANK under NCCL).
    """
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"init_from_env: environment lacks {missing}; launch with torchrun")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if device is not None and device.type == "cuda" and device.index is None:
        device = None  # "cuda" without an index: the local rank's, as below
    if device is None and backend == "nccl":
        device = local_device(int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count())
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return c10d._get_default_group()


def init_explicit(
    rank: int, world_size: int, port: int, backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S
) -> dist.ProcessGroup:
    """The default process group over a TCPStore on localhost:``port`` (rank 0 hosts it)."""
    store = dist.TCPStore(
        "127.0.0.1", port, world_size, rank == 0, timeout=datetime.timedelta(seconds=timeout_s)
    )
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
    )
    return c10d._get_default_group()


def failure_store(group: dist.ProcessGroup) -> dist.Store:
    """The store the group's ranks share (where ``fail`` writes and ``wait`` looks)."""
    try:
        return c10d._get_process_group_store(group)
    except Exception:  # a group made outside init_process_group's bookkeeping
        return c10d._get_default_store()


def fail(group: dist.ProcessGroup, message: str) -> None:
    """Record ``message`` as the group's failure (the first one wins), so blocked peers raise it."""
    store = failure_store(group)
    try:
        if not store.check([FAILURE_KEY]):
            store.set(FAILURE_KEY, message)
    except Exception:  # the store is gone (rank 0 exited): peers will time out or see closed sockets
        pass


def failure(group: dist.ProcessGroup) -> str | None:
    """The group's recorded failure message, or None."""
    store = failure_store(group)
    try:
        if store.check([FAILURE_KEY]):
            return store.get(FAILURE_KEY).decode()
    except Exception:
        return "the failure store is unreachable (rank 0 exited?)"
    return None


class _Waiter:
    """One daemon thread that runs blocking ``Work.wait()`` calls for the main thread (gloo)."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="fmoe-waiter", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            works, done, box = self.jobs.get()
            try:
                for w in works:
                    w.wait()
            except BaseException as e:  # handed to the caller
                box.append(e)
            done.set()


_WAITER: _Waiter | None = None
_WAITER_LOCK = threading.Lock()


def _waiter() -> _Waiter:
    global _WAITER
    with _WAITER_LOCK:
        if _WAITER is None:
            _WAITER = _Waiter()
        return _WAITER


def wait(
    works: Sequence[Any], group: dist.ProcessGroup, what: str, rank: int, timeout_s: float = DEFAULT_TIMEOUT_S
) -> None:
    """Wait for ``works``; raise PipelineError if a peer recorded a failure or after ``timeout_s``.

    what: names the row being waited on, for the timeout message; rank: this rank in ``group``.
    """
    works = [w for w in works if w is not None]
    if not works:
        return
    if dist.get_backend(group) != "gloo":
        for w in works:
            w.wait()
        return
    done, box = threading.Event(), []
    _waiter().jobs.put((works, done, box))
    deadline = time.monotonic() + timeout_s
    while not done.wait(POLL_S):
        msg = failure(group)
        if msg is not None:
            raise PipelineError(msg)
        if time.monotonic() > deadline:
            msg = f"pipeline rank {rank} timed out after {timeout_s:g} s waiting for {what}"
            fail(group, msg)
            raise PipelineError(msg)
    if box:
        msg = failure(group)
        raise PipelineError(msg or f"pipeline rank {rank}: {what} failed: {box[0]}") from box[0]


def global_rank(group: dist.ProcessGroup, rank: int) -> int:
    """The global rank of ``rank`` of ``group`` (P2POp wants global ranks)."""
    return dist.get_global_rank(group, rank) if group is not c10d._get_default_group() else rank


# ----------------------------------------------------------------------------------------------
# explicit spawn, for tests: every rank's result or error comes back; a hang is killed


@dataclass(frozen=True)
class RankResult:
    """What one spawned rank returned (ok) or the error it raised (type name, message, traceback)."""

    rank: int
    ok: bool
    value: Any = None
    error_type: str = ""
    error: str = ""
    traceback: str = ""


def _spawned(
    rank: int, world_size: int, port: int, backend: str, out_dir: str, fn: Callable, args: tuple
) -> None:
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        group = init_explicit(rank, world_size, port, backend, timeout_s=120)
        result = RankResult(rank, True, fn(rank, world_size, group, *args))
        clean = True
    except BaseException as e:
        result = RankResult(rank, False, None, type(e).__name__, str(e), traceback.format_exc())
        clean = False
    with open(path + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(path + ".tmp", path)
    if clean:
        dist.barrier()  # nobody closes its sockets while a peer still talks
        dist.destroy_process_group()
    # after a failure the group cannot be torn down (a waiter thread may hold a recv): just exit;
    # rank 0 hosts the store, so it lingers a moment for peers still reading the failure message
    if not clean and rank == 0:
        time.sleep(2.0)
    os._exit(0)


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    backend: str = "gloo",
    timeout_s: float = 120.0,
) -> list[RankResult]:
    """Run ``fn(rank, world_size, group, *args)`` in ``world_size`` fresh processes on one host.

    fn must be importable (module level). Returns each rank's RankResult; a rank that has not
    finished after ``timeout_s`` is killed and reported as error_type "Timeout".
    """
    ctx = torch.multiprocessing.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="fmoe-spawn-") as out_dir:
        procs = [
            ctx.Process(target=_spawned, args=(r, world_size, port, backend, out_dir, fn, args), daemon=False)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        results = []
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join()
            path = os.path.join(out_dir, f"rank{r}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    results.append(pickle.load(f))
            elif p.exitcode is None or p.exitcode < 0:
                results.append(
                    RankResult(r, False, error_type="Timeout", error=f"rank {r} hung past {timeout_s:g} s")
                )
            else:
                results.append(
                    RankResult(r, False, error_type="Exit", error=f"rank {r} exited with {p.exitcode}")
                )
        return results
