"""The time model of the memory policies: what each ``[memory]`` policy costs a step, in seconds,
beside ``recompute none, merge_window 0, offload off`` (the fastest, the most memory).

A policy only ever adds work; this module prices that work from the model's widths, the
micro-batch a rank runs and a small table of measured rates (:class:`Rates`; the shipped one is
``H200_RATES``, the one place its figures live). Per micro-batch and stage it counts what F does
(:class:`Work`: dense GEMM FLOPs, attention FLOPs, expert GEMM FLOPs and the rows each expert's
GEMM has, bytes moved by memory-bound ops, the part of those in recomputable regions) and adds:

  recompute  "full": the stage's F again; "selective": its RMSNorms and SwiGLUs again
             (``fmoe.stages.recompute``: their bytes at the elementwise rate)
  window     merge_window N (pp = 1): the expert weight GEMMs run over N micro-batches' rows rather
             than the whole step's, at the grouped GEMM rate of that height
  offload    the saved bytes of the offloaded stages cross the host link after F and again before
             B; the copy runs beside the compute, so only what the micro-batch's F (B) time does
             not cover costs time

which stages are recomputed or offloaded is ``fmoe.plan_activations.plan_stage_mode``: the memory
plan's own reading of the policy. Torch-free; the per-family widths are read as the activation
formulas read them (``fmoe.plan_activations.ACTIVATION_FORMULAS``: a family without formulas is
not modelled and costs nothing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fmoe import pipeline
from fmoe.memory_policy import MemoryPolicy
from fmoe.plan_activations import (
    ACTIVATION_FORMULAS,
    MicroBatch,
    moe_stages,
    plan_stage_mode,
    stage_activation_bytes,
)
from fmoe.plan_fp8 import local_dispatch
from fmoe.stages.spec import Model

__all__ = ["H200_RATES", "Rates", "TimeCost", "Work", "policy_time", "stage_work"]

TERA, GIGA = 1e12, 1e9


@dataclass(frozen=True)
class Rates:
    """Achieved rates of one device. grouped_tflops: (rows per expert, TFLOP/s) of the expert
    weight-gradient GEMM, rows ascending; between two points the rate is interpolated in log2(rows),
    outside them clamped to the nearest."""

    dense_tflops: float  # bf16 dense GEMMs: projections, router, shared experts, LM head
    grouped_tflops: tuple[tuple[int, float], ...]
    attention_tflops: float  # causal attention (SDPA), counted as 4 x tokens x keys x heads x head_dim / 2
    elementwise_gbps: float  # memory-bound kernels (RMSNorm, SwiGLU): bytes read + written per second
    host_copy_gbps: float  # pinned host <-> device copies, one direction

    def __post_init__(self) -> None:
        for name in ("dense_tflops", "attention_tflops", "elementwise_gbps", "host_copy_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Rates.{name} must be > 0, got {getattr(self, name)!r}")
        rows = [r for r, _ in self.grouped_tflops]
        if (
            not rows
            or rows != sorted(set(rows))
            or rows[0] < 1
            or any(not t > 0 for _, t in self.grouped_tflops)
        ):
            raise ValueError(
                f"Rates.grouped_tflops must be (rows >= 1, TFLOP/s > 0) pairs, rows ascending, got {self.grouped_tflops!r}"
            )

    def grouped(self, rows_per_expert: float) -> float:
        """TFLOP/s of an expert GEMM of ``rows_per_expert`` rows. The running maximum of the table:
        a GEMM of n x m rows can always be run as n GEMMs of m rows, so taller is never slower per
        FLOP (this keeps a merge window from ever looking faster than merging the whole step)."""
        points, best = [], 0.0
        for r, t in self.grouped_tflops:
            best = max(best, t)
            points.append((math.log2(r), best))
        x = math.log2(max(rows_per_expert, 1.0))
        if x <= points[0][0]:
            return points[0][1]
        for (x0, t0), (x1, t1) in zip(points, points[1:]):
            if x <= x1:
                return t0 + (t1 - t0) * (x - x0) / (x1 - x0)
        return points[-1][1]


# The shipped rates: one H200, bf16, torch 2.11 - measured by benchmarks/measure_role_costs.py
# (benchmarks/results/role_costs_h200.json, 2026-12-04) at the Qwen3-30B-A3B shapes, but for one:
H200_RATES = Rates(
    # q/k/v/o projections at 4096 tokens, FLOP-weighted (q 585, k 231, v 233, o 613 TFLOP/s)
    dense_tflops=509.0,
    # both expert weight-gradient GEMMs at each number of rows per expert (W, and a merge window's)
    grouped_tflops=(
        (64, 136.2),
        (128, 247.0),
        (256, 397.2),
        (512, 518.6),
        (1024, 593.2),
        (2048, 614.8),
        (4096, 632.9),
    ),  # fmt: skip
    attention_tflops=426.2,  # causal SDPA forward, 4096 tokens, 32 heads x 128
    # the exception: the fused RMSNorm and SwiGLU kernels the step runs (fp8_h200.json bandwidth:
    # 3962 and 3946 GB/s). role_costs_h200.json's 939 GB/s times one [4096, 2048] RMSNorm call at a
    # time, whose launch outweighs its 32 MB; inside a step (CUDA graphs) launches cost nothing
    elementwise_gbps=3950.0,
    host_copy_gbps=55.0,  # pinned host <-> device, 256 MiB, the slower direction (d2h 55.02, h2d 55.02)
)


@dataclass(frozen=True)
class Work:
    """What one stage's F does for one micro-batch on one rank."""

    dense_flops: float = 0.0
    attention_flops: float = 0.0
    grouped_flops: float = 0.0
    rows_per_expert: float = 0.0  # rows of each expert GEMM (the grouped FLOPs' height)
    elementwise_bytes: float = 0.0  # read + written by memory-bound ops
    recomputable_bytes: float = 0.0  # of those, the RMSNorms' and SwiGLUs' (selective recompute)

    def forward_s(self, rates: Rates) -> float:
        return (
            self.dense_flops / (rates.dense_tflops * TERA)
            + self.attention_flops / (rates.attention_tflops * TERA)
            + self.grouped_s(rates, 1)
            + self.elementwise_bytes / (rates.elementwise_gbps * GIGA)
        )

    def backward_s(self, rates: Rates) -> float:
        """B: every GEMM's input gradient has its forward's FLOPs; flash attention's backward is
        2.5 x its forward (it recomputes the scores); an elementwise backward reads the output's
        gradient and the input and writes the input's gradient: twice the forward's bytes."""
        return (
            self.dense_flops / (rates.dense_tflops * TERA)
            + 2.5 * self.attention_flops / (rates.attention_tflops * TERA)
            + self.grouped_s(rates, 1)
            + 2 * self.elementwise_bytes / (rates.elementwise_gbps * GIGA)
        )

    def weight_s(self, rates: Rates, merged: int) -> float:
        """W: one weight-gradient GEMM per forward GEMM, the same FLOPs; the expert ones merged over
        ``merged`` micro-batches run at ``merged`` x the rows (their time per micro-batch)."""
        return self.dense_flops / (rates.dense_tflops * TERA) + self.grouped_s(rates, merged)

    def grouped_s(self, rates: Rates, merged: int) -> float:
        if not self.grouped_flops:
            return 0.0
        return self.grouped_flops / (rates.grouped(self.rows_per_expert * merged) * TERA)


def _attention_work(family: str, cfg, mb: MicroBatch, moe: bool, experts: int) -> Work:
    """Projections (+ router), the attention core, the norms / rotary / residual around them."""
    e, t, h = mb.compute_bytes, mb.tokens, cfg.hidden_size
    heads = cfg.num_attention_heads
    if family == "deepseek_v2":  # MLA: low-rank q (optional) and kv, then per-head up-projections
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        q = h * cfg.q_lora_rank + cfg.q_lora_rank * heads * qk if cfg.q_lora_rank else h * heads * qk
        kv = h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * heads * (
            cfg.qk_nope_head_dim + cfg.v_head_dim
        )
        params, qk_dim, v_dim, q_width = q + kv + heads * cfg.v_head_dim * h, qk, cfg.v_head_dim, heads * qk
        norms_out = 0  # the q_a / kv_a norms are not separated (as in plan_activations)
    else:  # qwen3_moe, gpt_oss: grouped-query attention (gpt_oss's sliding window counted as full)
        hd = cfg.head_dim or h // heads
        q_width, kvw = heads * hd, cfg.num_key_value_heads * hd
        params, qk_dim, v_dim = h * (q_width + 2 * kvw) + q_width * h, hd, hd
        norms_out = 2 * (q_width + kvw) if family == "qwen3_moe" else 0  # q/k RMSNorm: read + write
    router = 2 * t * h * experts if moe else 0
    # causal: each query sees seq_full / 2 keys on average (its cp chunk's share included)
    core = 2 * t * (mb.seq_full / 2) * heads * (qk_dim + v_dim)
    norms = e * t * (2 * 2 * h + norms_out)  # input and post-attention RMSNorm: read [T,H], write [T,H]
    other = e * t * (3 * h + 4 * q_width)  # the residual add, rotary on q and k (read + write)
    return Work(dense_flops=2 * t * params + router, attention_flops=core,
                elementwise_bytes=norms + other, recomputable_bytes=norms)  # fmt: skip


def _mlp_work(family: str, cfg, mb: MicroBatch, moe: bool, experts: int, ep: int) -> Work:
    """Routed experts (gate/up [H -> 2I], SwiGLU, down [I -> H]) over T k rows, shared experts;
    or a dense layer's SwiGLU MLP."""
    e, t, h = mb.compute_bytes, mb.tokens, cfg.hidden_size
    if not moe:
        i = cfg.intermediate_size
        swiglu = 3 * e * t * i  # read [T, 2I], write [T, I]
        return Work(dense_flops=6 * t * h * i, elementwise_bytes=swiglu, recomputable_bytes=swiglu)
    k = cfg.num_experts_per_tok
    inter = cfg.intermediate_size if family == "gpt_oss" else cfg.moe_intermediate_size
    rows = t * k  # rows this rank's experts get: under ep it sends T k rows and receives as many on average
    swiglu = 3 * e * rows * inter
    dense = shared_swiglu = 0.0
    if family == "deepseek_v2" and cfg.n_shared_experts:
        si = cfg.n_shared_experts * cfg.moe_intermediate_size
        dense, shared_swiglu = 6 * t * h * si, 3 * e * t * si
    return Work(dense_flops=dense, grouped_flops=6 * rows * h * inter, rows_per_expert=rows * ep / experts,
                elementwise_bytes=swiglu + shared_swiglu, recomputable_bytes=swiglu + shared_swiglu)  # fmt: skip


def stage_work(family: str, cfg, role: str, moe: bool, mb: MicroBatch, experts: int, ep: int) -> Work:
    """What a stage of ``role`` does in F for one micro-batch (family: a value of
    ``ACTIVATION_FORMULAS``; moe: its layer has routed experts; ep: the expert-parallel size)."""
    e, t, h = mb.compute_bytes, mb.tokens, cfg.hidden_size
    k = getattr(cfg, "num_experts_per_tok", 1)
    if role == "attn":
        return _attention_work(family, cfg, mb, moe, experts)
    if role == "mlp":
        return _mlp_work(family, cfg, mb, moe, experts, ep)
    if role in ("dispatch", "combine"):
        # the rows gathered into (out of) expert order: here under the exchange; with the local
        # permutation in mlp (none in the fused FP8 experts), counted here all the same
        return Work(elementwise_bytes=2 * e * t * k * h)
    if role == "aggregate":
        return Work(elementwise_bytes=e * t * h * ((k + 2) if moe else 3))  # read y and h1, write h
    if role == "embed":
        return Work(elementwise_bytes=e * t * h)
    if role == "head":  # the final norm, the logits GEMM, the loss reading and writing the logits
        norm = 2 * e * t * h
        return Work(dense_flops=2 * t * h * cfg.vocab_size, elementwise_bytes=norm + 2 * e * t * cfg.vocab_size,
                    recomputable_bytes=norm)  # fmt: skip
    return Work()


@dataclass(frozen=True)
class TimeCost:
    """A policy's modelled time on one rank, seconds per micro-batch summed over the model's stages
    (a pipeline rank's share is its stages'; the ratio is the same). base: F + B + W under
    ``recompute none, merge_window 0, offload off``; the other three: what the policy adds."""

    base_s: float
    recompute_s: float
    window_s: float
    offload_s: float
    layers: int
    microbatches: int
    modelled: bool = True  # False: a family without formulas (every cost 0)

    @property
    def extra_s(self) -> float:
        return self.recompute_s + self.window_s + self.offload_s

    @property
    def fraction(self) -> float:
        """The extra time per layer as a share of the base (0.12: 12% slower)."""
        return self.extra_s / self.base_s if self.base_s else 0.0

    @property
    def extra_ms_per_layer(self) -> float:
        """Extra milliseconds per layer and step (all micro-batches)."""
        return 1e3 * self.extra_s * self.microbatches / max(self.layers, 1)

    def text(self) -> str:
        if not self.modelled:
            return "time not modelled for this family"
        # the rates are the shipped H200's whatever device the run is on: said, so a CPU run's line
        # is not read as its own time
        return (f"+{100 * self.fraction:.1f}% time per layer at H200 rates "
                f"({self.extra_ms_per_layer:.3g} ms per layer and step)")  # fmt: skip


def policy_time(
    family_name: str, cfg, model: Model, mb: MicroBatch, microbatches: int, pp: int, ep: int,
    policy: MemoryPolicy, rates: Rates = H200_RATES,
) -> TimeCost:  # fmt: skip
    """The time ``policy`` costs a step of ``model`` on a (pp, ep) layout whose ranks run
    ``microbatches`` micro-batches of ``mb`` each (see the module docstring for the terms)."""
    layers = len(pipeline.layer_units(model)[1])
    family = ACTIVATION_FORMULAS.get(family_name)
    if family is None:
        return TimeCost(0.0, 0.0, 0.0, 0.0, layers, microbatches, modelled=False)
    moe = moe_stages(model)
    base = recompute = window = offloaded = forward = backward = 0.0
    # pp = 1 merges the expert W over the step (window 0) or over N micro-batches; pipelines run W
    # where their table says, one micro-batch at a time, whatever the window
    merged_base = microbatches if pp == 1 else 1
    merged = merged_base if policy.merge_window == 0 else min(policy.merge_window, merged_base)
    for i, st in enumerate(model.stages):
        work = stage_work(family, cfg, st.role, i in moe, mb, model.num_experts, ep)
        f, b = work.forward_s(rates), work.backward_s(rates)
        forward, backward = forward + f, backward + b
        base += f + b + work.weight_s(rates, merged_base)
        window += work.grouped_s(rates, merged) - work.grouped_s(rates, merged_base)
        mode = plan_stage_mode(policy, st, ep)
        if mode == "full":  # the stage's F once more, just before its B
            recompute += f
        elif mode == "selective":  # its norms' and SwiGLUs' outputs remade from their inputs
            recompute += work.recomputable_bytes / (rates.elementwise_gbps * GIGA)
        elif mode == "offload":
            offloaded += stage_activation_bytes(
                family, cfg, st, i in moe, mb, model.num_experts, local_dispatch(cfg, ep)
            )
    # offload: the saved bytes go out while the micro-batch's F runs and come back while its B runs
    # (one copy engine each way); the copy's time beyond the compute it hides behind is the cost
    copy = offloaded / (rates.host_copy_gbps * GIGA)
    offload = max(0.0, copy - forward) + max(0.0, copy - backward)
    return TimeCost(base, recompute, window, offload, layers, microbatches)
