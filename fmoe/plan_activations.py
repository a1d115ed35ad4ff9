"""The activation terms of the memory plan (``fmoe plan``): the bytes each stage's F saves for its B,
and their peak over a rank's step.

Activation bytes per token are formulas in the model's widths (:func:`stage_activation_bytes`),
calibrated against the saved tensors of each stage's F measured on CPU (tests/test_plan.py). The
formulas differ per family (MLA, attention sinks, shared experts), so they are keyed by family name
here (``ACTIVATION_FORMULAS``): the one place a new family adds a line. A rank's peak is its
schedule's rows walked in order (:func:`pipeline_walk`, pp > 1) or the micro-batch executor's order
(:func:`local_step_peaks`, pp = 1); :func:`rank_activation_peaks` picks the one a rank runs.
The recipe's ``[memory]`` policy (``fmoe.memory_policy``) changes what a stage keeps between F and
B (:func:`stage_kept_bytes`) and how long expert W operands live (``merge_window``). With
``train.fp8`` and ``memory.fp8_cache``, FP8 linears keep their inputs in FP8 (``fmoe.plan_fp8``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from fmoe import pipeline
from fmoe.memory_policy import EXCHANGE_ROLES, MemoryPolicy
from fmoe.plan_fp8 import Fp8Caching, experts_read_tokens, fp8_cache_bytes, fp8_rows_bytes, local_dispatch
from fmoe.schedules.table import Schedule
from fmoe.stages.spec import Model, Stage

__all__ = [
    "ACTIVATION_FORMULAS",
    "ChunkMemory",
    "MicroBatch",
    "backward_transient_bytes",
    "chunk_activation_bytes",
    "expert_weight_grad_bytes",
    "local_step_peaks",
    "moe_stages",
    "plan_stage_mode",
    "stage_input_bytes",
    "stage_kept_bytes",
    "pipeline_walk",
    "rank_activation_peaks",
    "stage_activation_bytes",
]

FP32 = 4
INT64 = 8


@dataclass(frozen=True)
class MicroBatch:
    """What one micro-batch is on one rank: ``sequences`` of ``seq_local`` tokens each (the cp share
    of ``seq_full``); ``compute_bytes`` per element of the compute dtype; ``device`` "cpu" or "cuda"
    (attention and loss kernels save different tensors)."""

    sequences: int
    seq_local: int
    seq_full: int
    compute_bytes: int
    device: str

    @property
    def tokens(self) -> int:
        return self.sequences * self.seq_local


# the families whose per-stage activation formulas (below) this module has, and the formulas each
# uses (DeepSeek-V3's attention and experts are DeepSeek-V2's); other families plan no activations
ACTIVATION_FORMULAS = {
    "qwen3_moe": "qwen3_moe",
    "deepseek_v2": "deepseek_v2",
    "deepseek_v3": "deepseek_v2",
    "gpt_oss": "gpt_oss",
}


def _attention_bytes(family: str, cfg, mb: MicroBatch, moe: bool, experts: int) -> float:
    """Saved bytes of one attn stage per micro-batch (norms, projections, rotary, attention, router)."""
    e, t, h = mb.compute_bytes, mb.tokens, cfg.hidden_size
    k = cfg.num_experts_per_tok
    # the router: its input (the post-attention norm's output), logits, top-k weights and ids
    router = (e * (h + experts + k + 1) + INT64 * k) if moe else 0
    if family == "deepseek_v2":
        heads = cfg.num_attention_heads
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        q_width = cfg.q_lora_rank or 0
        per_token = e * (
            5 * h + 3 + 3 * cfg.kv_lora_rank + 2 * q_width + 2 * heads * qk + 2 * heads * cfg.v_head_dim
        )
        # SDPA with a value head dim unlike the query's: CPU runs the math kernel (the score matrix
        # is saved); CUDA the memory-efficient one (a log-sum-exp per query)
        scores = mb.sequences * heads * mb.seq_local * mb.seq_full * e if mb.device == "cpu" else 0
        return t * per_token + t * router + scores
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = cfg.head_dim or h // heads
    q, kvw = heads * head_dim, kv * head_dim
    if family == "gpt_oss":
        # an explicit [s, s] score matrix (attention sinks): softmax probabilities saved in fp32
        probs = mb.sequences * heads * mb.seq_local * mb.seq_full * FP32
        return t * (e * (6 * h + 3 * q + 2) + router) + probs
    # qwen3_moe: q/k RMS norms, then SDPA (flash on CPU and CUDA: a log-sum-exp per query and head)
    return t * (e * (6 * h + 3 * q + 4 * kvw + 2 * heads + kv + 2) + router)


def _mlp_bytes(family: str, cfg, mb: MicroBatch, moe: bool, local: bool) -> float:
    """Saved bytes of one mlp stage per micro-batch: routed experts' rows (input, gate/up, the
    activation's operands) for k slots a token, shared experts, or the dense MLP; plus the routed
    output rows the stage's Forwarded keeps until B - under expert parallelism only: with the local
    permutation (``local``) they are in slot order, and combine hands aggregate a view of them,
    whose saved y (its term) they are - and then the slot order mlp saves to gather and put back."""
    e, t, h, k = mb.compute_bytes, mb.tokens, cfg.hidden_size, cfg.num_experts_per_tok
    if not moe:
        return t * e * (h + 4 * cfg.intermediate_size)
    if family == "gpt_oss":  # biased, clamped SwiGLU: more elementwise operands kept
        routed = k * (e * (h + 7 * cfg.intermediate_size) + INT64)
    else:
        routed = k * e * (h + 4 * cfg.moe_intermediate_size)
    shared = 0
    if family == "deepseek_v2" and cfg.n_shared_experts:
        shared = e * (h + 4 * cfg.n_shared_experts * cfg.moe_intermediate_size)
    return t * (routed + shared + (k * INT64 if local else k * e * h))


def stage_activation_bytes(
    family: str, cfg, stage: Stage, moe: bool, mb: MicroBatch, num_experts: int, local: bool = True
) -> float:
    """Bytes one stage's F keeps alive for its B, for one micro-batch on one rank.

    family: the recipe's model family; cfg: its config; moe: whether the stage's layer has routed
    experts; mb: the micro-batch's shape on this rank; local: the MoE dispatch is the local
    permutation (ep 1), whose slot order mlp saves (it gathers the rows and puts them back), not
    dispatch and combine."""
    kind = stage.role
    e, t, h = mb.compute_bytes, mb.tokens, cfg.hidden_size
    k = getattr(cfg, "num_experts_per_tok", 1)
    if kind == "embed":
        return t * INT64
    if kind == "attn":
        return _attention_bytes(family, cfg, mb, moe, num_experts)
    if kind in ("dispatch", "combine"):  # the slot order; mlp's where it gathers and puts back
        return 0 if local else t * k * INT64
    if kind == "mlp":
        return _mlp_bytes(family, cfg, mb, moe, local)
    if kind == "aggregate":
        return t * e * (k * h + k) if moe else 0
    if kind == "head":
        # norm input and output, the logits (CPU: F.cross_entropy's fp32 copy; CUDA: the fused
        # kernel reads the compute-dtype logits), the labels
        logits = FP32 if mb.device == "cpu" else e
        return t * (e * (3 * h + 1) + logits * cfg.vocab_size + INT64)
    raise ValueError(f"the memory plan has no activation formula for stage {stage.name!r} (role {kind!r})")


def stage_input_bytes(family: str, cfg, stage: Stage, moe: bool, mb: MicroBatch, local: bool = True) -> float:
    """Bytes of the carry into one stage (what "full" recompute keeps per micro-batch): the hidden
    state [T, H] in the compute dtype, the routed rows [k T, H] and their slot weights / ids for the
    MoE stages between dispatch and aggregate (into mlp the tokens [T, H] instead, where dispatch is
    the local permutation: ``local``, whose combine hands aggregate a view of its input rows), the
    token ids (embed) and labels (head)."""
    e, t, h = mb.compute_bytes, mb.tokens, cfg.hidden_size
    k = getattr(cfg, "num_experts_per_tok", 1)
    role = stage.role
    if role == "embed":
        return t * INT64
    if role == "head":
        return t * (e * h + INT64)
    routes = t * k * (e + INT64)  # top-k weights and expert ids travel with the hidden state
    if role == "dispatch" or (role == "mlp" and moe and local):
        return t * e * h + routes
    if role in ("mlp", "combine") and moe:
        return t * k * e * h + routes
    if role == "aggregate" and moe:  # the residual and the combined rows (local: a view of
        # combine's input, counted there)
        return t * e * h + (0 if local else t * k * e * h) + routes
    return t * e * h


def _selective_bytes(family: str, cfg, stage: Stage, moe: bool, mb: MicroBatch) -> float:
    """The saved bytes "selective" drops from a stage: its RMSNorms' and SwiGLUs' outputs, taken from
    the formulas' terms. The attn formulas fold each norm's input and output into their ``h`` terms;
    only the two layer norms' outputs (the projections' and the router's inputs, [T, H] each) and
    Qwen3's q/k norm outputs are counted as dropped; DeepSeek's q_a / kv_a norms are not separable
    from the formula's lora terms, so they are counted as kept (conservative: the plan overstates)."""
    e, t, h = mb.compute_bytes, mb.tokens, cfg.hidden_size
    k = getattr(cfg, "num_experts_per_tok", 1)
    if stage.role == "attn":
        norms = 2 * h if moe else h  # without a router the post-attention norm is the mlp stage's
        if family == "qwen3_moe":
            head_dim = cfg.head_dim or h // cfg.num_attention_heads
            norms += (cfg.num_attention_heads + cfg.num_key_value_heads) * head_dim
        return t * e * norms
    if stage.role == "mlp":
        if not moe:
            return t * e * (h + cfg.intermediate_size)  # its norm output and the SwiGLU output
        if family == "gpt_oss":
            return 0  # the clamped, biased SwiGLU's operands are not separable: counted as kept
        shared = (cfg.n_shared_experts or 0) if family == "deepseek_v2" else 0
        return t * e * cfg.moe_intermediate_size * (k + shared)
    if stage.role == "head":
        return t * e * h  # the final norm's output
    return 0


def plan_stage_mode(policy: MemoryPolicy, stage: Stage, ep: int) -> str:
    """``MemoryPolicy.stage_mode`` for a plan (no context: ``ep`` > 1 stands for an "ep" group)."""
    if stage.custom is not None:
        return "none"
    recomputed = (
        policy.recompute != "none"
        and (not policy.recompute_roles or stage.role in policy.recompute_roles)
        and not (stage.role in EXCHANGE_ROLES and ep > 1)
    )
    if recomputed:
        return policy.recompute
    return "offload" if policy.offload else "none"


def stage_kept_bytes(
    family: str, cfg, stage: Stage, moe: bool, mb: MicroBatch, num_experts: int, mode: str,
    fp8: Fp8Caching | None = None, local: bool = True,
) -> tuple[float, float]:  # fmt: skip
    """(bytes one micro-batch's stage keeps from its F to its B, bytes its B adds while it runs)
    under ``mode`` (``plan_stage_mode``). "none": what F saves, nothing added; "full": the carry in,
    and at B the whole saved set again (the recompute); "selective": F's saved bytes less the norms'
    and SwiGLUs' outputs, which B remakes; "offload": the carry in stays (the saved tensors go to
    the host; the ones under ``fmoe.offload.MIN_BYTES`` = 1 MiB, which stay, are left out: a few
    per stage), and at B the stage's saved set is back on the device. fp8: the step's FP8, its input
    caching (:func:`fp8_cache_bytes`) and the inputs its expert W keeps as FP8 rows
    (:func:`fp8_rows_bytes`), neither of the regions "selective" recomputes; local: the MoE
    dispatch is the local permutation (ep 1: mlp gathers the experts' rows itself)."""
    saved = stage_activation_bytes(family, cfg, stage, moe, mb, num_experts, local)
    cache = (family, cfg, stage.role, moe, mb.tokens, mb.compute_bytes, fp8)
    if mode == "none":
        return saved + _fp8_bytes(cache, False, local, mb.device), 0.0
    if mode == "selective":
        saved += _fp8_bytes(cache, True, local, mb.device)
        dropped = min(saved, _selective_bytes(family, cfg, stage, moe, mb))
        return saved - dropped, dropped
    saved += _fp8_bytes(cache, False, local, mb.device)
    # "full" and "offload": the stage's inputs stay on the device (they are the carry the recompute,
    # or the host copy's owner, starts from); a cheap stage (dispatch) may keep more than it saved
    carry = stage_input_bytes(family, cfg, stage, moe, mb, local)
    return carry, saved


def _fp8_bytes(cache: tuple, selective: bool, local: bool, device: str) -> int:
    """FP8's change of a stage's saved bytes: its input caching (``plan_fp8.fp8_cache_bytes``) and
    the inputs kept as FP8 rows for the expert weight gradients (``plan_fp8.fp8_rows_bytes``)."""
    where = dict(selective=selective, local=local, device=device)
    return fp8_cache_bytes(*cache, **where) + fp8_rows_bytes(*cache, **where)


def expert_weight_grad_bytes(
    family: str, cfg, mb: MicroBatch, copies_rows: bool = True, fp8_grads: bool = False
) -> float:
    """What a pp = 1 step keeps per micro-batch and MoE layer for the expert weight GEMMs it merges
    over the step (``runner.weight_grads`` with ``merge_later``): inputs and output gradients of
    gate/up ([k T, H], [k T, 2I]) and down ([k T, I], [k T, H]); gate/up's input is the [T, H]
    tokens instead where the experts read them where they lie (``copies_rows`` False: the fused
    FP8 experts of the local dispatch, ``plan_fp8.experts_read_tokens``); ``fp8_grads``: the expert
    weight gradients run in FP8, so each expert GEMM that runs in FP8 (both of its weight's dims
    multiples of 128) keeps its output gradient's FP8 rows (a byte an element and a float32 scale
    per 128), and the down GEMM of SwiGLU experts the FP8 rows of its input
    (``grouped_linear``'s ``w_reads_rows``, under selective recomputation too: B quantizes the remade
    output; not gpt-oss's clamped SwiGLU)."""
    inter = cfg.intermediate_size if family == "gpt_oss" else cfg.moe_intermediate_size
    k, h = cfg.num_experts_per_tok, cfg.hidden_size
    x_rows = k if copies_rows else 1

    def fp8_bytes(out: int, inp: int) -> float:  # an element W keeps in FP8 rows of [E, out, inp]'s GEMM
        return 1 + 4 / 128 if fp8_grads and out % 128 == 0 and inp % 128 == 0 else mb.compute_bytes

    grads = fp8_bytes(2 * inter, h) * 2 * inter + fp8_bytes(h, inter) * h  # gate/up's, down's
    a = mb.compute_bytes if family == "gpt_oss" else fp8_bytes(h, inter)  # SwiGLU's output
    return mb.tokens * (mb.compute_bytes * x_rows * h + k * (a * inter + grads))


def moe_stages(model: Model) -> set[int]:
    """Indices of the stages whose layer has routed experts."""
    _, units, _ = pipeline.layer_units(model)
    out: set[int] = set()
    for unit in units:
        if any(n in model.expert_params for i in unit for n in model.stages[i].params):
            out.update(unit)
    return out


def chunk_activation_bytes(
    family: str, cfg, model: Model, stage_indices: Iterable[int], mb: MicroBatch,
    policy: MemoryPolicy | None = None, ep: int = 1, fp8: Fp8Caching | None = None,
) -> tuple[int, int]:  # fmt: skip
    """(activation bytes one micro-batch keeps through the given stages from F to B under ``policy``
    (None: recompute none, no offload) and ``fp8`` (the FP8 input caching; None: FP8 off), the most a
    single stage's B adds: its recompute or reload)."""
    moe = moe_stages(model)
    policy = policy or MemoryPolicy()
    kept = extra = 0.0
    for i in stage_indices:
        st = model.stages[i]
        mode = plan_stage_mode(policy, st, ep)
        k, x = stage_kept_bytes(
            family, cfg, st, i in moe, mb, model.num_experts, mode, fp8, local=local_dispatch(cfg, ep)
        )
        kept, extra = kept + k, max(extra, x)
    return int(kept), int(extra)


def backward_transient_bytes(
    family: str, cfg, model: Model, stage_indices: Iterable[int], mb: MicroBatch
) -> int:
    """The largest temporary a chunk's B makes beyond what its F saved: the loss's logits gradient
    (CPU: ``F.cross_entropy``'s fp32 log-softmax gradient and the logits' gradient; CUDA: the fused
    kernel's logits gradient in the compute dtype). 0 for a chunk without the head."""
    if not any(model.stages[i].role == "head" for i in stage_indices):
        return 0
    per_logit = 2 * FP32 if mb.device == "cpu" else mb.compute_bytes
    return mb.tokens * cfg.vocab_size * per_logit


@dataclass(frozen=True)
class ChunkMemory:
    """One (micro-batch, chunk)'s bytes: activations F saves for B (and B's operands kept for W),
    the transient its B adds, and the chunk's gradients (made by its first W, held to the step's end)."""

    activations: int
    transient: int
    grads: int


def pipeline_walk(table: Schedule, rank: int, chunks: Sequence[ChunkMemory]) -> tuple[int, int]:
    """(most activation bytes rank ``rank`` holds at once, most activation plus gradient bytes).

    Its rows in order: F (and an FB's forward half) adds ``chunks[chunk].activations``; B, BW and an
    FB's backward half add their transient while they run; W, BW and an FB's backward half free the
    activations and leave the chunk's gradients. ``simulate``'s ``peak_activations`` weighted by
    chunk; B keeps W's operands (the taped inputs and output gradients) until W."""
    live = peak_acts = peak_all = 0
    made: set[int] = set()

    def note(extra: int) -> None:
        nonlocal peak_acts, peak_all
        peak_acts = max(peak_acts, live + extra)
        peak_all = max(peak_all, live + extra + sum(chunks[c].grads for c in made))

    for a in table.actions[rank]:
        if a.kind in ("F", "FB"):
            live += chunks[a.chunk].activations
            note(0)
        back = a.b_chunk if a.kind == "FB" else a.chunk
        if a.kind in ("B", "BW", "FB"):
            note(chunks[back].transient)
        if a.kind in ("W", "BW", "FB"):
            live -= chunks[back].activations
            made.add(back)
            note(0)
    return peak_acts, peak_all


def local_step_peaks(
    one: int, transient: int, expert_keep: int, dense_grads: int, all_grads: int, microbatches: int,
    window: int = 0,
) -> tuple[int, int]:  # fmt: skip
    """pp = 1 (``parallel._local_step``): (most activation bytes at once, most activation plus
    gradient bytes). Micro-batch after micro-batch: F of every stage, B, W - but the expert weight
    GEMMs wait for their merge window's last B (``window`` micro-batches, 0: the step's end),
    keeping ``expert_keep`` bytes per micro-batch meanwhile. The last micro-batch's B of the head is
    the activations' peak (the earlier micro-batches' dense gradients exist by then); the window's
    end, its micro-batches' expert operands and all gradients."""
    held = microbatches if window == 0 else min(window, microbatches)
    during = one + (held - 1) * expert_keep + transient
    end = held * expert_keep
    return max(during, end), max(during + (dense_grads if microbatches > 1 else 0), end + all_grads)


def _w_fp8_grads(fp8: Fp8Caching | None) -> bool:
    """Whether the step's expert weight gradients run in FP8 (``expert_weight_grad_bytes``' fp8_grads)."""
    return fp8 is not None and fp8.expert_grads


def _w_reads_tokens(
    family: str, cfg, mb: MicroBatch, policy: MemoryPolicy, ep: int, fp8: Fp8Caching | None
) -> bool:
    """``plan_fp8.experts_read_tokens`` for a step: FP8 on (``fp8`` not None, whatever it caches),
    selective where it covers mlp."""
    if fp8 is None:
        return False
    selective = policy.recompute == "selective" and (
        not policy.recompute_roles or "mlp" in policy.recompute_roles
    )
    return experts_read_tokens(family, cfg, local_dispatch(cfg, ep), mb.device, selective)


def rank_activation_peaks(
    family: str, cfg, model: Model, table: Schedule | None, rank: int, mb: MicroBatch,
    grad_bytes: Mapping[str, int], microbatches: int, policy: MemoryPolicy | None = None, ep: int = 1,
    fp8: Fp8Caching | None = None,
) -> tuple[int, int]:  # fmt: skip
    """(most activation bytes pipeline rank ``rank`` holds at once, most activation plus gradient
    bytes) over one step. family: a key of ``ACTIVATION_FORMULAS``; table: the schedule (None:
    pp = 1); grad_bytes: {name: bytes of its full gradient} of the rank's parameters; policy: the
    recipe's ``[memory]`` (None: the defaults); ep: the expert-parallel size (exchanges not recomputed);
    fp8: the step's FP8 input caching (``Fp8Caching.of``; None: FP8 off)."""
    policy = policy or MemoryPolicy()
    if table is not None:
        smap = pipeline.schedule_stage_map(model, table)
        chunks = []
        for c in range(table.chunks):
            idx = smap[(rank, c)]
            names = {n for i in idx for n in model.stages[i].params}
            kept, extra = chunk_activation_bytes(family, cfg, model, idx, mb, policy, ep, fp8)
            chunks.append(ChunkMemory(kept, backward_transient_bytes(family, cfg, model, idx, mb) + extra,
                                      sum(grad_bytes[n] for n in names)))  # fmt: skip
        return pipeline_walk(table, rank, chunks)
    every = range(len(model.stages))
    moe = moe_stages(model)  # once: asked per layer it made the plan quadratic
    moe_layers = sum(1 for u in pipeline.layer_units(model)[1] if set(u) & moe)
    kept, extra = chunk_activation_bytes(family, cfg, model, every, mb, policy, ep, fp8)
    return local_step_peaks(
        kept,
        backward_transient_bytes(family, cfg, model, every, mb) + extra,
        moe_layers
        * int(
            expert_weight_grad_bytes(
                family,
                cfg,
                mb,
                not _w_reads_tokens(family, cfg, mb, policy, ep, fp8),
                _w_fp8_grads(fp8),
            )
        ),
        sum(b for n, b in grad_bytes.items() if n not in model.expert_params),
        sum(grad_bytes.values()),
        microbatches,
        policy.merge_window,
    )
