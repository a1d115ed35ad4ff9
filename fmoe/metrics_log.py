"""What a training run reports: metrics lines (``<log.dir>/metrics.jsonl``, TensorBoard when it is
installed), the console's progress bar, and warnings on stderr.

The records themselves are the training loop's (``fmoe.train``); this module only writes them.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

__all__ = ["MetricsLog", "Progress", "warn"]


def warn(message: str) -> None:
    """One ``fmoe: warning: ...`` line on stderr (the run goes on)."""
    print(f"fmoe: warning: {message}", file=sys.stderr, flush=True)


class MetricsLog:
    """Metrics as JSON lines (strict JSON: a non-finite number is written as null), and to
    TensorBoard when it is installed. A partial last line (a run killed mid-write) is cut off when
    the file is opened again, so every line parses.

    start: the step the run starts from. Lines of later steps are a past run's that this one
    repeats (it was killed after its last checkpoint, or fell back from a corrupt one): they move to
    ``metrics.rewound.jsonl`` (appended, nothing lost), so ``metrics.jsonl`` holds each step once,
    and TensorBoard purges them (``purge_step``)."""

    def __init__(self, folder: Path, start: int = 0):
        folder.mkdir(parents=True, exist_ok=True)
        _cut_partial_last_line(folder / "metrics.jsonl")
        _rewind(folder / "metrics.jsonl", start, folder / "metrics.rewound.jsonl")
        self.file = open(folder / "metrics.jsonl", "a")  # noqa: SIM115 - closed in close()
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(folder / "tensorboard"), purge_step=start + 1 if start else None)
        except Exception:  # tensorboard not installed
            self.tb = None

    def write(self, record: dict) -> None:
        safe = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        self.file.write(json.dumps(safe, allow_nan=False) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, int | float):
                    self.tb.add_scalar(k, v, record["step"])

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def _rewind(path: Path, start: int, rewound: Path) -> None:
    """Move the lines of ``path`` whose step is after ``start`` to the end of ``rewound``; the
    shortened file replaces ``path`` atomically, after ``rewound`` is written and synced."""
    if not path.is_file():
        return
    keep, moved = [], []
    for line in path.read_text().splitlines(keepends=True):
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            step = None  # not a metrics record: kept where it is
        (moved if isinstance(step, int) and step > start else keep).append(line)
    if not moved:
        return
    with open(rewound, "a") as f:
        f.writelines(moved)
        f.flush()
        os.fsync(f.fileno())
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.writelines(keep)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _cut_partial_last_line(path: Path) -> None:
    """Truncate ``path`` after its last newline when it does not end with one."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        end = f.seek(0, os.SEEK_END)
        f.seek(end - 1)
        if f.read(1) == b"\n":
            return
        pos = end
        while pos > 0:  # scan back block by block for the last newline
            start = max(0, pos - (64 << 10))
            f.seek(start)
            cut = f.read(pos - start).rfind(b"\n")
            if cut >= 0:
                f.truncate(start + cut + 1)
                return
            pos = start
        f.truncate(0)


class Progress:
    """A tqdm bar with step, loss, tokens/s and ETA (MFU on GPU); silent when ``shown`` is False
    (``log.progress`` off, or a rank other than 0)."""

    def __init__(self, shown: bool, start: int, total: int):
        self.bar = None
        if shown:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True)
        self.last = start

    def update(self, step: int, loss: float, tps: float, mfu: float | None) -> None:
        if self.bar is None:
            return
        post = {"loss": f"{loss:.4f}", "tok/s": f"{tps:,.0f}"}
        if mfu is not None:
            post["mfu"] = f"{100 * mfu:.1f}%"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(step - self.last)
        self.last = step

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
