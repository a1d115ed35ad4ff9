"""The FP8 input caching's term of the memory plan (``fmoe plan``; ``fmoe.plan_activations`` adds it).

With ``train.fp8`` and ``memory.fp8_cache`` (:class:`Fp8Caching`), an FP8 linear whose input is made
inside its stage, is not a view and is read by FP8 linears only keeps that input in FP8 for its
weight gradient (``fmoe.stages.fp8_mode``). :func:`fp8_cache_bytes` is what that changes in a stage's
saved bytes: each cached input's form (``cached_input_bytes``) in place of its compute-dtype bytes;
:func:`fp8_rows_bytes` what FP8 expert weight gradients change, cached or not: the input kept as the
FP8 rows its GEMM read (SwiGLU's output). Both per the stages' code (:func:`fp8_inputs` lists the
inputs per family and role), checked to the byte against the saved tensors of a CPU run
(tests/test_fp8_cache.py). The FP8 weight copies are the
gathered term's (``fmoe.plan.fp8_weight_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from fmoe.memory_policy import MemoryPolicy
from fmoe.stages.fp8_mode import cached_input_bytes

__all__ = [
    "Fp8Caching",
    "Fp8Input",
    "experts_read_tokens",
    "fp8_cache_bytes",
    "fp8_inputs",
    "fp8_rows_bytes",
    "local_dispatch",
    "mlp_copies_rows",
]


@dataclass(frozen=True)
class Fp8Caching:
    """Which FP8 linears of a step keep their inputs in FP8 (``fp8_training``'s cache_inputs /
    cache_expert_inputs, as ``parallel_step`` opens it): ``dense`` (``linear``), ``experts``
    (``grouped_linear``); ``local_experts``: a rank's experts (the cached form pads each one). Its
    presence says the step runs FP8 (both False: FP8 with nothing cached). ``expert_grads``: the
    expert weight gradients run in FP8 (``train.fp8_expert_wgrad``), so W keeps the FP8 rows of the
    experts' output gradients, not the gradients themselves (``primitives.GroupedWeightGrad``)."""

    dense: bool
    experts: bool
    local_experts: int
    expert_grads: bool = True

    @staticmethod
    def of(
        fp8: bool,
        fp8_dense: bool,
        policy: MemoryPolicy,
        pp: int,
        microbatches: int,
        local_experts: int,
        fp8_dense_wgrad: bool = True,
        fp8_expert_wgrad: bool = True,
    ) -> Fp8Caching | None:
        """The caching of a step (``train.fp8``, ``train.fp8_dense``, ``train.fp8_dense_wgrad``,
        ``train.fp8_expert_wgrad``, the ``[memory]`` policy); None: FP8 is off. With FP8 on and
        ``fp8_cache`` off nothing is cached, but the plan still knows FP8 is on (the fused FP8
        experts make no gathered copy: ``experts_read_tokens``). A weight gradient in the compute
        dtype reads the input itself, so nothing of its kind is cached."""
        if not fp8:
            return None
        if not policy.fp8_cache:
            return Fp8Caching(False, False, local_experts, fp8_expert_wgrad)
        dense = fp8_dense and fp8_dense_wgrad
        experts = fp8_expert_wgrad and policy.fp8_cache_experts(pp, microbatches)
        return Fp8Caching(dense, experts, local_experts, fp8_expert_wgrad)


class Fp8Input(NamedTuple):
    """An input an FP8 stage may cache: [rows, width]; eligible: a weight reading it has dims that are
    multiples of 128 (runs in FP8); kept: another reading it does not, and so saves it in the compute
    dtype anyway (the cached form is then extra); expert: an expert GEMM's (grouped by expert);
    region: the output of a recomputable region, which "selective" drops where it is kept in the
    compute dtype; w_reads_rows: kept as the FP8 rows the forward GEMM reads (1 byte an element and
    a float32 scale per 128), never cached, wherever the expert weight gradients run in FP8
    (``grouped_linear``'s ``w_reads_rows``: SwiGLU experts' down input)."""

    rows: int
    width: int
    eligible: bool
    kept: bool = False
    expert: bool = False
    region: bool = False
    w_reads_rows: bool = False


def local_dispatch(cfg, ep: int) -> bool:
    """Whether a MoE layer's dispatch is the local permutation (``decoder_stages.dispatch_stage``'s
    test): one expert-parallel rank and dropless routing (no ``moe_capacity_factor``); else the
    exchange, whose received rows are mlp's input."""
    return ep == 1 and cfg.moe_capacity_factor is None


def experts_read_tokens(family: str, cfg, local: bool, device: str, selective: bool) -> bool:
    """Whether a MoE layer's experts read their rows from the tokens, with no gathered copy (and
    their merged weight gradient keeps the [T, H] tokens): the fused FP8 SwiGLU experts of the
    local dispatch (``layers.gathered_expert_mlp``: on CUDA, both expert GEMMs in FP8, no selective
    recomputation; gpt-oss's experts are not SwiGLU's). With FP8 on: the caller knows that."""
    if not local or device != "cuda" or family == "gpt_oss" or selective:
        return False
    return cfg.hidden_size % 128 == 0 and cfg.moe_intermediate_size % 128 == 0


def mlp_copies_rows(family: str, cfg, local: bool, device: str, selective: bool) -> bool:
    """Whether a MoE layer's mlp makes a gathered copy of its experts' rows: where dispatch hands
    it the tokens (``local``) and the experts do not read them where they lie
    (:func:`experts_read_tokens`); under the exchange the received rows are its input."""
    return local and not experts_read_tokens(family, cfg, local, device, selective)


def fp8_inputs(family: str, cfg, role: str, moe: bool, t: int, copies_rows: bool = True) -> list[Fp8Input]:
    """The inputs a stage's FP8 linears read that are made inside it and saved by nothing else (per
    ``fmoe.stages``' code): a linear on the stage's input (or a view of it) or called with
    ``cache=False`` caches nothing (``fmoe.stages.fp8_mode``). copies_rows: the MoE mlp gathers its
    experts' rows into a copy (:func:`mlp_copies_rows`), which gate_up reads."""
    ok = lambda *dims: all(d % 128 == 0 for d in dims)  # noqa: E731
    h, k = cfg.hidden_size, getattr(cfg, "num_experts_per_tok", 1)
    if role == "attn" and family == "deepseek_v2":  # q_proj / q_a_proj share x with kv_a: not cached
        nh, dv, lora = cfg.num_attention_heads, cfg.v_head_dim, cfg.kv_lora_rank
        out = [Fp8Input(t, lora, ok(lora, nh * (cfg.qk_nope_head_dim + dv)))]
        if cfg.q_lora_rank:
            qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
            out.append(Fp8Input(t, cfg.q_lora_rank, ok(cfg.q_lora_rank, nh * qk)))
        return out  # o_proj: cache=False (SDPA saves its output)
    if role == "attn":  # q, k, v share the normed hidden state; o reads the attention's output:
        # SDPA's, which it saves (Qwen3: cache=False), or a copy of the sinks' matmul (gpt-oss)
        heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        d = cfg.head_dim or h // heads
        o = Fp8Input(t, heads * d, ok(h, heads * d) and family == "gpt_oss")
        q_fp8, kv_fp8 = ok(h, heads * d), ok(h, kv * d)
        return [Fp8Input(t, h, q_fp8 or kv_fp8, kept=q_fp8 != kv_fp8, region=True), o]
    if role != "mlp":
        return []
    if not moe:  # gate and up read the stage's input; down the SwiGLU product
        return [Fp8Input(t, cfg.intermediate_size, ok(h, cfg.intermediate_size))]
    inter = cfg.intermediate_size if family == "gpt_oss" else cfg.moe_intermediate_size
    # the experts' down reads the SwiGLU output; gate_up the rows mlp gathers from the tokens (a
    # copy, where it makes one) or its input (expert parallelism)
    swiglu = family != "gpt_oss"
    out = [Fp8Input(t * k, inter, ok(h, inter), expert=True, region=swiglu, w_reads_rows=swiglu)]
    if copies_rows:
        out.append(Fp8Input(t * k, h, ok(h, 2 * inter), expert=True))
    shared = (cfg.n_shared_experts or 0) if family == "deepseek_v2" else 0
    if shared:
        out.append(Fp8Input(t, shared * inter, ok(h, shared * inter)))
    return out


def _cached(
    family: str, cfg, role: str, moe: bool, tokens: int, elem: int, fp8: Fp8Caching | None, selective: bool,
    copies_rows: bool,
) -> list[Fp8Input]:  # fmt: skip
    """The inputs of ``fp8_inputs`` the step caches, as ``fp8_mode.cached_input`` decides: FP8, of a
    kind ``fp8`` caches, smaller cached than in the compute dtype (``elem`` bytes an element), and
    not a region's output the stage recomputes (``selective``)."""
    if fp8 is None:
        return []
    return [
        i
        for i in fp8_inputs(family, cfg, role, moe, tokens, copies_rows)
        if i.eligible
        and not i.w_reads_rows
        and (fp8.experts if i.expert else fp8.dense)
        and _cached_bytes(i, fp8) < i.rows * i.width * elem
        and not (selective and i.region)
    ]


def _cached_bytes(i: Fp8Input, fp8: Fp8Caching) -> int:
    return cached_input_bytes(i.rows, i.width, fp8.local_experts if i.expert else 1)


def fp8_cache_bytes(
    family: str, cfg, role: str, moe: bool, tokens: int, elem: int, fp8: Fp8Caching | None,
    selective: bool = False, local: bool = True, device: str = "cpu",
) -> int:  # fmt: skip
    """What FP8 input caching changes in the bytes one micro-batch's stage of ``role`` saves: each
    cached input's form less its bytes in the compute dtype (``elem`` bytes an element; none where
    another reader keeps it: the form is then extra). tokens: the micro-batch's tokens on the rank;
    selective: the stage runs under selective recomputation, whose regions' outputs are not cached
    (it keeps nothing of them); local: the dispatch is the local permutation; device: "cpu" or
    "cuda" (with ``local``, what decides whether mlp copies its experts' rows: ``mlp_copies_rows``)."""
    copies_rows = mlp_copies_rows(family, cfg, local, device, selective) if moe else False
    cached = _cached(family, cfg, role, moe, tokens, elem, fp8, selective, copies_rows)
    return sum(_cached_bytes(i, fp8) - (0 if i.kept else i.rows * i.width * elem) for i in cached)


def fp8_rows_bytes(
    family: str, cfg, role: str, moe: bool, tokens: int, elem: int, fp8: Fp8Caching | None,
    selective: bool = False, local: bool = True, device: str = "cpu",
) -> int:  # fmt: skip
    """What the FP8 expert weight gradients change in the bytes one micro-batch's stage of ``role``
    saves, cached or not: each input kept as the FP8 rows the forward GEMM reads (``w_reads_rows``:
    1 byte an element and a float32 scale per 128) less its bytes in the compute dtype (``elem``);
    none where FP8, or the FP8 expert weight gradient, is off, or the input is a region ``selective``
    recomputes. Arguments as :func:`fp8_cache_bytes`'."""
    if fp8 is None or not fp8.expert_grads:
        return 0
    copies_rows = mlp_copies_rows(family, cfg, local, device, selective) if moe else False
    return sum(
        i.rows * (i.width + 4 * (i.width // 128)) - i.rows * i.width * elem
        for i in fp8_inputs(family, cfg, role, moe, tokens, copies_rows)
        if i.w_reads_rows and i.eligible and not (selective and i.region)
    )
