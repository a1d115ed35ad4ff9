"""Shared benchmark helpers: timing with CUDA events (or perf_counter on CPU) and the JSON record."""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def environment() -> dict:
    """GPU, versions and date: what every recorded result carries."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": platform.python_version(),
        "cpu": _cpu_model(),  # host-bound steps depend on it
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def time_ms(fn: Callable[[], object], warmup: int = 3, iters: int = 10, device: str = "cuda") -> float:
    """Median milliseconds of ``fn()`` over ``iters`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def write_result(path: str | Path | None, result: dict, *, echo: bool = True) -> None:
    """Print the result (unless ``echo`` is off) and, if ``path`` is given, write it as JSON with the
    environment: to a temporary file renamed over ``path``, so a killed run leaves no half file."""
    record = {"environment": environment(), **result}
    text = json.dumps(record, indent=2)
    if echo:
        print(text)
    if path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(path)
