"""Stopping a run on a signal: finish the step in flight, checkpoint, exit 0; a second signal aborts.

A cluster stops a job with a signal: SLURM sends SIGTERM at preemption or the time limit (and,
with ``--signal=USR1@90``, a chosen signal that long before), torchrun forwards SIGTERM and SIGINT
to its workers, Ctrl-C sends SIGINT. While a run trains, :class:`StopSignals` catches those (and
the recipe's ``checkpoint.signal``): the first one only sets ``requested``, which the training loop
reads between steps (on several processes the ranks agree on it, so all stop after the same step),
then saves a checkpoint and returns. A second signal raises :class:`Aborted` in the main thread at
once, wherever it is; the loop then drops the checkpoint it was writing (no ``.tmp-*`` folder is
left) and the run exits with 128 + the signal's number, as a shell reports a process the signal
killed. Handlers can only be set from the main thread; elsewhere (a run started on another thread)
none is installed and the process's own handling stays.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Sequence


class Aborted(BaseException):
    """A second stop signal arrived: the run stops at once (a BaseException, like KeyboardInterrupt,
    so no ``except Exception`` on the way swallows it). signum: the signal's number."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


class StopSignals:
    """Catch ``names`` (signal names) while the ``with`` block runs; restore the old handlers after.

    requested: the first signal's name once one arrived, else None. Inside ``deferred()`` a second
    signal does not raise at once but when the block ends (a checkpoint's rename and rotation, a
    few file operations, are not cut in half)."""

    def __init__(self, names: Sequence[str]):
        self.signums = [signal.Signals[n] for n in dict.fromkeys(names)]
        self.requested: str | None = None
        self.previous: dict[int, object] = {}
        self._defer = 0
        self._late: Aborted | None = None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in self.signums:
                self.previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous.clear()

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested is None:
            self.requested = name
            print(
                f"fmoe: {name} received: finishing the step in flight, then saving a checkpoint "
                f"(send it again to stop at once, without one)",
                file=sys.stderr,
                flush=True,
            )
            return
        abort = Aborted(signum, f"stopped at once by a second signal ({name}); no new checkpoint was written")
        if self._defer:
            self._late = abort
            return
        raise abort

    def deferred(self) -> _Deferred:
        return _Deferred(self)


class _Deferred:
    def __init__(self, stops: StopSignals):
        self.stops = stops

    def __enter__(self) -> None:
        self.stops._defer += 1

    def __exit__(self, *exc) -> None:
        self.stops._defer -= 1
        late, self.stops._late = self.stops._late, None
        if late is not None and not self.stops._defer and exc[0] is None:
            raise late
