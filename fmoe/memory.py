"""Peak memory of this process, measured: what the memory plan (``fmoe plan``) is checked against.

On a CUDA device the caching allocator's peak (``torch.cuda.max_memory_allocated``). On a CPU the
process's peak resident set (``VmHWM`` in ``/proc/self/status``), which Linux resets when "5" is
written to ``/proc/self/clear_refs``. The resident peak follows the tensors' peak (plus the
interpreter's own few hundred MiB, which ``reset_peak``'s baseline removes) only where freed tensors
leave the resident set: in a process started with a fixed mmap threshold (``MALLOC_MMAP_THRESHOLD_=65536``
in its environment, as the tests' measuring processes are), where every tensor above it is a mapping
of its own, returned when freed. glibc's default threshold is adaptive: freeing a mapped block raises
it (to 32 MiB at most), and later blocks below it come from the heap and may stay resident when freed.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_bytes(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    if match is None:
        raise OSError(f"{_STATUS} has no {field} line: peak memory cannot be measured on this system")
    return int(match.group(1)) * 1024


def can_measure(device: torch.device) -> bool:
    """Whether ``reset_peak`` / ``peak_bytes`` work here (CUDA, or a Linux /proc)."""
    return device.type == "cuda" or (_STATUS.exists() and _CLEAR_REFS.exists())


def reset_peak(device: torch.device) -> int:
    """Start a new peak measurement; returns the bytes in use now (the baseline ``peak_bytes`` is
    compared with)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    _CLEAR_REFS.write_text("5")  # resets VmHWM to the current resident set
    return _status_bytes("VmRSS")


def current_bytes(device: torch.device) -> int:
    """The bytes in use now (CUDA: allocated tensors; CPU: resident set), comparable with
    ``reset_peak``'s baseline."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    return _status_bytes("VmRSS")


def peak_bytes(device: torch.device) -> int:
    """The most bytes in use since the last ``reset_peak`` (CUDA: allocated tensors; CPU: resident set)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    return _status_bytes("VmHWM")
