"""The memory plan: what each rank of a (pp, dp, cp, ep) layout holds at its peak, before anything runs.

Pure functions from a recipe's model config, parameter shapes, mesh sizes and schedule table to
bytes; nothing here touches a process group or allocates a tensor. For every rank the plan gives

  params       fp32 master shards (``parallel.layout``'s sharding: experts over dp x cp after ep
               took its share, the rest over dp x cp x ep, each flat tensor padded to its group)
  optimizer    AdamW's two fp32 moments over the same shards
  grads        the gradients the step holds (``WorkingSet.STEP``: this rank's full gradients, in
               the dtype W makes them, plus the fp32 copy ``parallel_step`` makes before its
               reduce-scatter; ``WorkingSet.UNIT``: the fp32 gradient shards)
  gathered     the parameters gathered in the compute dtype (``STEP``: all of this rank's, for the
               whole step; ``UNIT``: ``parallel.gathered_working_set_bytes``, the gathers per layer
               or pipeline chunk that ``parallel_step`` makes, replayed, with the full gradients)
  activations  the most bytes of saved activations in flight: the schedule's rows walked in order,
               each F adding its (micro-batch, chunk)'s bytes and each W / BW / FB's backward half
               freeing them (the simulator's ``peak_activations`` count, weighted by chunk)

and the peak those make together (:func:`plan_layout`). :func:`layouts` lists the layouts of N
processes the recipe can run on, ranked by the simulator's bubble; ``fmoe plan`` prints them, and
``fmoe train`` logs its own layout's plan and refuses one that does not fit before the first step.

Activation bytes per token are formulas in the model's widths (:func:`stage_activation_bytes`),
calibrated against the saved tensors of each stage's F measured on CPU (tests/test_plan.py). The
formulas differ per family (MLA, attention sinks, shared experts), so they are keyed by family name
here: the one place a new family adds a line.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from fmoe import parallel, pipeline
from fmoe.mesh import DIMS, Mesh, MeshError, check_sizes
from fmoe.schedules.generators import generate
from fmoe.schedules.simulator import simulate
from fmoe.schedules.table import Schedule, ScheduleError
from fmoe.schedules.verify import validate
from fmoe.stages.spec import Model, Stage

GiB = 1 << 30
FP32 = 4
INT64 = 8
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
TERMS = ("params", "grads", "optimizer", "gathered", "activations")


class WorkingSet(enum.Enum):
    """Which gather policy the ``gathered`` and ``grads`` terms describe.

    STEP: today's ``parallel_step``: every parameter of the rank gathered once per step and held to
    its end; full gradients held until one reduce-scatter after the last W.
    UNIT: parameters gathered per pipeline chunk (pp > 1) or per layer (pp = 1) just before first
    use, one unit prefetched ahead, freed after last use; each unit's gradients reduce-scattered
    right after its last W (issue 20 part 2).
    """

    STEP = "step"
    UNIT = "unit"


# ------------------------------------------------------------------------------------------------
# parameters, gradients, optimizer state


@dataclass(frozen=True)
class ParamShard:
    """How one parameter lies on a rank (the sizes of ``parallel.ShardInfo``, without a process group).

    full_numel: elements of this rank's full (ep-local for experts) tensor; group_size: ranks of its
    shard group (dp x cp for experts, dp x cp x ep otherwise)."""

    name: str
    full_numel: int
    group_size: int

    @property
    def shard_numel(self) -> int:
        return -(-self.full_numel // self.group_size)

    @property
    def padded_numel(self) -> int:
        """What an all-gather of the shards holds: the shard times the group."""
        return self.shard_numel * self.group_size


def shard_layout(
    shapes: Mapping[str, Sequence[int]],
    names: Iterable[str],
    experts: Collection[str],
    num_experts: int,
    dp: int,
    cp: int,
    ep: int,
) -> list[ParamShard]:
    """``parallel.layout``'s sharding of ``names`` by sizes alone: experts (the model's
    ``expert_params``) split over ep first (dim 0 of ``num_experts``), then every tensor flat over
    its shard group."""
    out = []
    for name in names:
        shape = tuple(shapes[name])
        numel = math.prod(shape)
        if name in experts:
            if ep > 1:
                numel = numel // num_experts * (num_experts // ep)
            size = dp * cp
        else:
            size = dp * cp * ep
        out.append(ParamShard(name, numel, size))
    return out


def master_bytes(shards: Sequence[ParamShard]) -> int:
    """fp32 master weights: every shard."""
    return sum(s.shard_numel for s in shards) * FP32


def optimizer_bytes(shards: Sequence[ParamShard]) -> int:
    """AdamW's exp_avg and exp_avg_sq, fp32, shaped like the shards (its scalars are noise)."""
    return 2 * sum(s.shard_numel for s in shards) * FP32


def _gathered_bytes(s: ParamShard, compute_bytes: int, uncast: bool) -> int:
    """Bytes ``parallel.gather_params`` makes for one parameter: a buffer of the padded shards in
    the compute dtype (fp32 for a buffer); nothing when the group is one rank and no cast is made
    (the shard itself is used)."""
    element = FP32 if uncast else compute_bytes
    if s.group_size > 1:
        return s.padded_numel * element
    return 0 if element == FP32 else s.full_numel * element


def step_grads_bytes(
    shards: Sequence[ParamShard], compute_bytes: int, dp: int, cp: int, ep: int, buffers
) -> int:
    """``WorkingSet.STEP``: the full gradients W makes (in the compute dtype; a buffer's in fp32),
    plus the fp32 copy ``parallel_step`` makes of each one it scales or sums over ranks, plus the
    fp32 shards the reduce-scatter returns - all alive together at the end of the step."""
    total = 0
    scale = dp * cp * ep != 1
    for s in shards:
        element = FP32 if s.name in buffers else compute_bytes
        total += s.full_numel * element
        if element != FP32 and (scale or s.group_size > 1):
            total += s.full_numel * FP32  # g.float(): the compute-dtype gradient is still referenced
        if s.group_size > 1:
            total += s.shard_numel * FP32
    return total


# ------------------------------------------------------------------------------------------------
# activations


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


def _mlp_bytes(family: str, cfg, mb: MicroBatch, moe: bool) -> float:
    """Saved bytes of one mlp stage per micro-batch: routed experts' rows (input, gate/up, the
    activation's operands) for k slots a token, shared experts, or the dense MLP; plus the routed
    output rows the stage's Forwarded keeps until B."""
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
    return t * (routed + shared + k * e * h)


def stage_activation_bytes(
    family: str, cfg, stage: Stage, moe: bool, mb: MicroBatch, num_experts: int
) -> float:
    """Bytes one stage's F keeps alive for its B, for one micro-batch on one rank.

    family: the recipe's model family; cfg: its config; moe: whether the stage's layer has routed
    experts; mb: the micro-batch's shape on this rank."""
    kind = stage.role
    e, t, h = mb.compute_bytes, mb.tokens, cfg.hidden_size
    k = getattr(cfg, "num_experts_per_tok", 1)
    if kind == "embed":
        return t * INT64
    if kind == "attn":
        return _attention_bytes(family, cfg, mb, moe, num_experts)
    if kind in ("dispatch", "combine"):
        return t * k * INT64  # the slot order
    if kind == "mlp":
        return _mlp_bytes(family, cfg, mb, moe)
    if kind == "aggregate":
        return t * e * (k * h + k) if moe else 0
    if kind == "head":
        # norm input and output, the logits (CPU: F.cross_entropy's fp32 copy; CUDA: the fused
        # kernel reads the compute-dtype logits), the labels
        logits = FP32 if mb.device == "cpu" else e
        return t * (e * (3 * h + 1) + logits * cfg.vocab_size + INT64)
    raise ValueError(f"the memory plan has no activation formula for stage {stage.name!r} (role {kind!r})")


def expert_weight_grad_bytes(family: str, cfg, mb: MicroBatch) -> float:
    """What a pp = 1 step keeps per micro-batch and MoE layer for the expert weight GEMMs it merges
    over the step (``runner.weight_grads`` with ``merge_later``): inputs and output gradients of
    gate/up ([k T, H], [k T, 2I]) and down ([k T, I], [k T, H])."""
    inter = cfg.intermediate_size if family == "gpt_oss" else cfg.moe_intermediate_size
    return mb.tokens * cfg.num_experts_per_tok * mb.compute_bytes * (2 * cfg.hidden_size + 3 * inter)


def _moe_stages(model: Model) -> set[int]:
    """Indices of the stages whose layer has routed experts."""
    _, units, _ = pipeline.layer_units(model)
    out: set[int] = set()
    for unit in units:
        if any(n in model.expert_params for i in unit for n in model.stages[i].params):
            out.update(unit)
    return out


def chunk_activation_bytes(
    family: str, cfg, model: Model, stage_indices: Iterable[int], mb: MicroBatch
) -> int:
    """Saved activation bytes of one micro-batch through the given model stages."""
    moe = _moe_stages(model)
    return int(
        sum(
            stage_activation_bytes(family, cfg, model.stages[i], i in moe, mb, model.num_experts)
            for i in stage_indices
        )
    )


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
    one: int, transient: int, expert_keep: int, dense_grads: int, all_grads: int, microbatches: int
) -> tuple[int, int]:
    """pp = 1 (``parallel._local_step``): (most activation bytes at once, most activation plus
    gradient bytes). Micro-batch after micro-batch: F of every stage, B, W - but the expert weight
    GEMMs wait for the step's end (``merge_later``), keeping ``expert_keep`` bytes per micro-batch.
    The last micro-batch's B of the head is the activations' peak (the earlier micro-batches' dense
    gradients exist by then); the step's end, every micro-batch's expert operands and all gradients."""
    during = one + (microbatches - 1) * expert_keep + transient
    end = microbatches * expert_keep
    return max(during, end), max(during + (dense_grads if microbatches > 1 else 0), end + all_grads)


# ------------------------------------------------------------------------------------------------
# one rank, one layout


@dataclass(frozen=True)
class RankTerms:
    """One rank's planned memory, bytes. ``peak`` = params + optimizer + the larger of the step
    phase (gathered + activations + the gradients W has made) and, under ``WorkingSet.STEP``, the
    reduce phase after the last W (``grads``: full gradients, their fp32 copy and the shards)."""

    rank: int
    coords: tuple[int, int, int, int]  # (pp, dp, cp, ep) indices
    params: int
    grads: int
    optimizer: int
    gathered: int
    activations: int
    peak: int

    def largest_term(self) -> tuple[str, int]:
        return max(((n, getattr(self, n)) for n in TERMS), key=lambda kv: kv[1])


@dataclass(frozen=True)
class LayoutPlan:
    """A layout's plan: sizes, the schedule's simulated bubble (max over pipeline ranks; 0 for
    pp = 1), and one RankTerms per pipeline rank (the ranks of a pipeline stage hold the same)."""

    pp: int
    dp: int
    cp: int
    ep: int
    schedule: str
    bubble: float
    stage_terms: tuple[RankTerms, ...]  # index: pipeline rank
    activations_planned: bool = True  # False: a family the activation formulas do not know (0 counted)

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp, self.cp, self.ep)

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.ep

    @property
    def peak(self) -> int:
        return max(t.peak for t in self.stage_terms)

    def worst(self) -> RankTerms:
        return max(self.stage_terms, key=lambda t: t.peak)

    def ranks_of(self, pp_rank: int) -> list[int]:
        """The global ranks of pipeline rank ``pp_rank`` (``fmoe.mesh``: pp is the outermost dim)."""
        per = self.dp * self.cp * self.ep
        return list(range(pp_rank * per, (pp_rank + 1) * per))

    def fits(self, limit_bytes: float | None) -> bool:
        return limit_bytes is None or self.peak <= limit_bytes


def _table(recipe, pp: int) -> Schedule | None:
    """The recipe's schedule for ``pp`` ranks (None for pp = 1); ScheduleError if it cannot be made."""
    if pp == 1:
        return None
    p = recipe.parallel
    if p.schedule.endswith(".csv"):
        from fmoe.schedules.table import read_csv

        table = read_csv(p.schedule)
        if table.pp != pp or table.microbatches != recipe.train.microbatches:
            raise ScheduleError(f"{p.schedule} is for pp={table.pp}, microbatches={table.microbatches}")
    else:
        options = {"chunks": p.chunks} if p.schedule == "interleaved-1f1b" else {}
        table = generate(p.schedule, pp, recipe.train.microbatches, **options)
    validate(table)
    return table


def plan_layout(
    recipe,
    model: Model,
    shapes: Mapping[str, Sequence[int]],
    sizes: tuple[int, int, int, int],
    *,
    table: Schedule | None = None,
    device: str = "cuda",
    working_set: WorkingSet | None = None,
) -> LayoutPlan:
    """The plan of ``recipe`` on mesh ``sizes`` = (pp, dp, cp, ep).

    table: the pipeline schedule (default: the recipe's, made for pp); device: "cuda" or "cpu";
    working_set: None plans what ``parallel_step`` will do (``recipe_working_set``)."""
    pp, dp, cp, ep = sizes
    if working_set is None:
        working_set = recipe_working_set(recipe, sizes)
    cfg, t = recipe.model, recipe.train
    if pp > 1 and table is None:
        table = _table(recipe, pp)
    e = DTYPE_BYTES[t.dtype]
    buffers = frozenset(model.buffers)
    seqs = t.global_batch // (dp * ep) // t.microbatches
    mb = MicroBatch(seqs, recipe.data.seq_len // cp, recipe.data.seq_len, e, device)
    bubble = max(simulate(table).bubble) if table is not None else 0.0
    terms = []
    for r in range(pp):
        names = pipeline.local_param_names(model, table, rank=r) if table is not None else list(shapes)
        shards = shard_layout(shapes, names, model.expert_params, model.num_experts, dp, cp, ep)
        params, opt = master_bytes(shards), optimizer_bytes(shards)
        fam, w_bytes = (
            ACTIVATION_FORMULAS.get(recipe.model_family),
            {s.name: s.full_numel * (FP32 if s.name in buffers else e) for s in shards},
        )
        if fam is None:
            acts = acts_and_grads = 0
        elif table is not None:
            smap = pipeline.schedule_stage_map(model, table)
            chunks = []
            for c in range(table.chunks):
                idx = smap[(r, c)]
                names_c = {n for i in idx for n in model.stages[i].params}
                chunks.append(ChunkMemory(chunk_activation_bytes(fam, cfg, model, idx, mb),
                                          backward_transient_bytes(fam, cfg, model, idx, mb),
                                          sum(w_bytes[n] for n in names_c)))  # fmt: skip
            acts, acts_and_grads = pipeline_walk(table, r, chunks)
        else:
            every = range(len(model.stages))
            moe_stages = _moe_stages(model)  # once: asked per layer it made the plan quadratic
            moe_layers = sum(1 for u in pipeline.layer_units(model)[1] if set(u) & moe_stages)
            acts, acts_and_grads = local_step_peaks(
                chunk_activation_bytes(fam, cfg, model, every, mb),
                backward_transient_bytes(fam, cfg, model, every, mb),
                moe_layers * int(expert_weight_grad_bytes(fam, cfg, mb)),
                sum(b for n, b in w_bytes.items() if n not in model.expert_params),
                sum(w_bytes.values()),
                t.microbatches,
            )
        if working_set is WorkingSet.STEP:
            gathered = sum(_gathered_bytes(s, e, s.name in buffers) for s in shards)
            grads = step_grads_bytes(shards, e, dp, cp, ep, buffers)
            peak = params + opt + max(gathered + acts_and_grads, grads)
        else:
            coords = {**dict.fromkeys(DIMS, 0), "pp": r}
            gathered = parallel.gathered_working_set_bytes(
                model, Mesh(pp, dp, cp, ep, rank=r * dp * cp * ep, coords=coords), shapes, names,
                None if t.dtype == "float32" else torch.bfloat16, num_microbatches=t.microbatches,
                schedule=table if pp > 1 else None,
            )  # fmt: skip
            grads = sum(s.shard_numel for s in shards) * FP32
            peak = params + opt + grads + gathered + acts
        rank0 = r * dp * cp * ep
        terms.append(RankTerms(rank0, (r, 0, 0, 0), params, grads, opt, gathered, acts, peak))
    name = "-" if table is None else (recipe.parallel.schedule if pp > 1 else "-")
    planned = recipe.model_family in ACTIVATION_FORMULAS
    return LayoutPlan(pp, dp, cp, ep, name, bubble, tuple(terms), activations_planned=planned)


def recipe_working_set(recipe, sizes: tuple[int, int, int, int]) -> WorkingSet:
    """The gathers ``parallel_step`` does for this recipe on these sizes: per unit
    (``parallel.gather = "chunk"``) where some parameter is sharded (dp x cp x ep > 1) and FP8 is
    off, else once for the step."""
    _, dp, cp, ep = sizes
    per_unit = recipe.parallel.gather == "chunk" and not recipe.train.fp8 and dp * cp * ep > 1
    return WorkingSet.UNIT if per_unit else WorkingSet.STEP


def candidate_sizes(
    recipe, nproc: int, supports_cp: bool, num_experts: int
) -> list[tuple[int, int, int, int]]:
    """Every (pp, dp, cp, ep) of ``nproc`` processes the recipe's sizes allow (``check_sizes``)."""
    out = []
    divisors = [d for d in range(1, nproc + 1) if nproc % d == 0]
    t = recipe.train
    for pp in divisors:
        for dp in divisors:
            for cp in divisors:
                if nproc % (pp * dp * cp) or (cp > 1 and not supports_cp):
                    continue
                ep = nproc // (pp * dp * cp)
                try:
                    check_sizes(pp, dp, cp, ep, nproc, microbatches=t.microbatches, schedule=recipe.parallel.schedule,
                                num_experts=num_experts, seq_len=recipe.data.seq_len,
                                global_batch=t.global_batch)  # fmt: skip
                except MeshError:
                    continue
                out.append((pp, dp, cp, ep))
    return out


def layouts(
    recipe, model: Model, shapes, nproc: int, *, supports_cp: bool, device: str = "cuda",
    working_set: WorkingSet | None = None,
) -> list[LayoutPlan]:  # fmt: skip
    """The plans of every layout of ``nproc`` processes the recipe can run, fewest idle first
    (bubble, then peak bytes). A pp whose schedule cannot be made (too few micro-batches) is left out."""
    plans = []
    for sizes in candidate_sizes(recipe, nproc, supports_cp, model.num_experts):
        try:
            plans.append(plan_layout(recipe, model, shapes, sizes, device=device, working_set=working_set))
        except (ScheduleError, ValueError):
            continue
    return sorted(plans, key=lambda p: (round(p.bubble, 6), p.peak, p.sizes))


# ------------------------------------------------------------------------------------------------
# text


def gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def human(n: float) -> str:
    """Bytes as MiB below 1 GiB, else GiB."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def rank_lines(plan: LayoutPlan) -> list[str]:
    """One line per pipeline rank: its global ranks and every term (GiB, or MiB for a small plan)."""
    unit, scale = ("GiB", GiB) if plan.peak >= GiB else ("MiB", 2**20)
    header = ("params", "grads", "optim", "gathered", "activ", "peak")
    lines = [f"{'ranks':>12}  " + " ".join(f"{h:>8}" for h in header) + f"  {unit}"]
    for r, t in enumerate(plan.stage_terms):
        ranks = plan.ranks_of(r)
        span = f"{ranks[0]}" if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"
        cells = " ".join(f"{getattr(t, n) / scale:>8.2f}" for n in (*TERMS, "peak"))
        lines.append(f"{span:>12}  {cells}")
    return lines


def layout_name(plan: LayoutPlan) -> str:
    return " ".join(f"{d}={v}" for d, v in zip(DIMS, plan.sizes))


def refusal(plan: LayoutPlan, limit_bytes: float) -> str | None:
    """The one line refusing ``plan`` when a rank's peak exceeds ``limit_bytes`` (else None): the
    rank, its peak and its largest term."""
    worst = plan.worst()
    if worst.peak <= limit_bytes:
        return None
    term, size = worst.largest_term()
    pp_rank = plan.stage_terms.index(worst)
    return (
        f"memory plan: rank {plan.ranks_of(pp_rank)[0]} (pp {pp_rank}) needs {human(worst.peak)}, "
        f"more than the device's {human(limit_bytes)}; its largest term is {term} ({human(size)}) "
        f"on layout {layout_name(plan)}: run `fmoe plan` for layouts that fit"
    )


# ------------------------------------------------------------------------------------------------
# the recipe's own layout (``fmoe train``) and the command line (``fmoe plan``)


def device_limit_bytes(recipe, device_type: str, cuda_total: int | None = None) -> float | None:
    """The bytes a rank may plan for: ``train.device_memory_gib`` when set, else the CUDA device's
    total (``cuda_total``), else no limit (a CPU run without the field)."""
    if recipe.train.device_memory_gib > 0:
        return recipe.train.device_memory_gib * GiB
    return float(cuda_total) if device_type == "cuda" and cuda_total else None


def summary(plan: LayoutPlan, limit_bytes: float | None) -> str:
    """The compact block ``fmoe train`` prints at its start (rank 0)."""
    limit = "no limit" if limit_bytes is None else f"{human(limit_bytes)} per device"
    head = f"memory plan, {layout_name(plan)} ({plan.schedule}, bubble {plan.bubble:.3f}), {limit}:"
    if not plan.activations_planned:
        head += " (activations not planned: fmoe.plan has no formulas for this family)"
    return "\n".join([head, *rank_lines(plan)])


def table_lines(plans: Sequence[LayoutPlan], limit_bytes: float | None) -> list[str]:
    """One line per layout: sizes, schedule, bubble, peak, largest term of its fullest rank, fits."""
    unit, scale = ("GiB", GiB) if max((p.peak for p in plans), default=GiB) >= GiB else ("MiB", 2**20)
    lines = [f"{'pp':>3} {'dp':>3} {'cp':>3} {'ep':>3}  {'schedule':<16} {'bubble':>6}  {'peak ' + unit:>9}  "
             f"{f'largest term ({unit})':<24} fits"]  # fmt: skip
    for p in plans:
        term, size = p.worst().largest_term()
        fits = "yes" if p.fits(limit_bytes) else "no"
        lines.append(
            f"{p.pp:>3} {p.dp:>3} {p.cp:>3} {p.ep:>3}  {p.schedule:<16} {p.bubble:>6.3f}  {p.peak / scale:>9.2f}  "
            f"{f'{term} {size / scale:.2f}':<24} {fits}"
        )
    return lines
