"""A training run's clock and throughput: steady-state tokens/s and MFU.

Steady state leaves out the run's first step (compilation, CUDA graph capture, allocator warm-up)
and the time saving checkpoints held the loop up (issue 29's definition); :class:`Clock` keeps
those apart, :class:`Throughput` turns (steps, seconds) into tokens/s and MFU.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from fmoe.recipe import Recipe
from fmoe.stages.family import Family

__all__ = ["PEAK_BF16_TFLOPS", "Clock", "Throughput", "throughput"]

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0}


@dataclass(frozen=True)
class Throughput:
    """tokens_per_step: global_batch x seq; flops_per_step: the family's training FLOPs of a step;
    peak: the mesh's peak bf16 TFLOP/s (every GPU's), None off a known GPU (then no MFU)."""

    tokens_per_step: int
    flops_per_step: float
    peak: float | None

    def tokens_per_s(self, steps: int, seconds: float) -> float:
        return steps * self.tokens_per_step / max(seconds, 1e-9)

    def mfu(self, steps: int, seconds: float) -> float | None:
        """Model FLOPs utilisation of ``steps`` in ``seconds``; None without a known peak."""
        if not self.peak:
            return None
        return self.flops_per_step * steps / max(seconds, 1e-9) / (self.peak * 1e12)


def throughput(recipe: Recipe, family: Family, device: torch.device, world: int) -> Throughput:
    """The run's :class:`Throughput`: a step's tokens and the family's FLOPs count for them; the
    peak is the current CUDA device's (by name) x ``world``."""
    tokens_per_step = recipe.train.global_batch * recipe.data.seq_len
    flops_per_step = tokens_per_step * family.train_flops_per_token(recipe.model, recipe.data.seq_len)
    peak = next(
        (
            v
            for k, v in PEAK_BF16_TFLOPS.items()
            if device.type == "cuda" and k in torch.cuda.get_device_name()
        ),
        None,
    )
    if peak:
        peak *= world
    return Throughput(tokens_per_step, flops_per_step, peak)


class Clock:
    """This run's time for its throughput: steps and seconds apart from the time saving held the
    loop up and apart from the run's first step (compilation, CUDA graph capture, allocator warm-up;
    the data was built before the loop). On CUDA the first step is waited for once, so its time is
    its own; the other boundaries fall at the loop's host syncs (a log line, a save)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.steps = 0
        self.start = time.perf_counter()
        self.first_step_s = 0.0
        self.saved_total = 0.0
        self.window_start, self.window_steps, self.window_saved = self.start, 0, 0.0

    def stepped(self) -> None:
        self.steps += 1
        self.window_steps += 1
        if self.steps == 1:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.first_step_s = time.perf_counter() - self.start

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """The block's time is saving's, not the steps' (``saved_total``, the window's ``saved``)."""
        if self.device.type == "cuda":  # the steps queued before belong to the steps' time
            torch.cuda.synchronize(self.device)
        t = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - t
            self.saved_total += spent
            self.window_saved += spent

    def window(self) -> tuple[int, float, float]:
        """(steps, seconds, seconds saving) since the last call, without the run's first step
        (unless it is the window's only one); starts the next window."""
        now = time.perf_counter()
        steps, seconds, saved = (
            self.window_steps,
            now - self.window_start - self.window_saved,
            self.window_saved,
        )
        if self.steps == steps and steps > 1:  # this window holds the run's first step
            steps, seconds = steps - 1, seconds - self.first_step_s
        self.window_start, self.window_steps, self.window_saved = now, 0, 0.0
        return steps, seconds, saved

    def steady(self) -> tuple[int, float]:
        """(steps, seconds) of the whole run, saving and the first step left out (unless it was
        the only step)."""
        seconds = time.perf_counter() - self.start - self.saved_total
        if self.steps > 1:
            return self.steps - 1, seconds - self.first_step_s
        return self.steps, seconds
