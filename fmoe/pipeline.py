"""Model chunking: which of a Model's stages each pipeline (rank, chunk) runs, and which params it holds.

A model's stages are cut into ``num_stages`` contiguous pipeline stages, never inside a transformer
layer (a layer's five stages stay together, so its dispatch/combine can overlap another microbatch's
compute within one chunk). The stages before the first layer (the embedding) go to pipeline stage 0,
those after the last layer (head + loss) to the last one, and the layers are spread evenly; when
they do not divide evenly the extra layers go to the middle stages first, which carry neither the
embedding nor the head. With fewer layers than pipeline stages some middle stages are empty: they
pass their input through unchanged (a valid, if wasteful, layout; the tests use it).

Placements (``fmoe.schedules.stage_of``): "loop" and "v" hold ``pp * chunks`` pipeline stages of one
model copy; "bidir" (DualPipe) holds two copies of a ``pp``-stage model, chunk 0 = stage r of copy 0
and chunk 1 = stage pp-1-r of copy 1 on rank r, so every parameter of stage s lives on ranks s and
pp-1-s and their gradients must be summed (``param_holders`` says who shares what).
"""

from __future__ import annotations

from fmoe.schedules.table import PLACEMENTS, Schedule, stage_of
from fmoe.stages.spec import Model


def layer_units(model: Model) -> tuple[list[int], list[list[int]], list[int]]:
    """(stages before the first layer, each layer's stage indices in order, stages after the last).

    A layer is a maximal run of stages with the same ``model.layer_of`` value >= 0. A model without
    ``layer_of`` counts every stage as its own layer.
    """
    n = len(model.stages)
    layer_of = model.layer_of or tuple(range(n))
    if len(layer_of) != n:
        raise ValueError(f"Model.layer_of has {len(layer_of)} entries for {n} stages")
    units: list[list[int]] = []
    prefix: list[int] = []
    suffix: list[int] = []
    for i, layer in enumerate(layer_of):
        if layer < 0:
            (prefix if not units else suffix).append(i)
            continue
        if suffix:
            raise ValueError(
                f"Model stage {model.stages[i].name!r} (layer {layer}) comes after non-layer stage "
                f"{model.stages[suffix[0]].name!r}; only the stages before the first layer and after "
                "the last may have layer_of -1"
            )
        if units and layer_of[units[-1][-1]] == layer:
            units[-1].append(i)
        else:
            units.append([i])
    return prefix, units, suffix


def layers_per_stage(num_layers: int, num_stages: int) -> list[int]:
    """How many layers each of ``num_stages`` pipeline stages gets: even, extras to the middle first."""
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    counts = [num_layers // num_stages] * num_stages
    middle = list(range(1, num_stages - 1))
    ends = [0, num_stages - 1] if num_stages > 1 else [0]
    for s in (middle + ends)[: num_layers % num_stages]:
        counts[s] += 1
    return counts


def split_stages(model: Model, num_stages: int) -> list[tuple[int, ...]]:
    """The model stage indices of each of ``num_stages`` contiguous pipeline stages (forward order)."""
    prefix, units, suffix = layer_units(model)
    counts = layers_per_stage(len(units), num_stages)
    parts: list[tuple[int, ...]] = []
    at = 0
    for s, c in enumerate(counts):
        idx = [i for unit in units[at : at + c] for i in unit]
        at += c
        if s == 0:
            idx = prefix + idx
        if s == num_stages - 1:
            idx = idx + suffix
        parts.append(tuple(idx))
    return parts


def _check_layout(placement: str, pp: int, chunks: int) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    if not (isinstance(pp, int) and pp >= 1):
        raise ValueError(f"pp must be an integer >= 1, got {pp!r}")
    if not (isinstance(chunks, int) and chunks >= 1) or (placement != "loop" and chunks != 2):
        raise ValueError(
            f"chunks must be {'>= 1' if placement == 'loop' else 2} for placement {placement}, got {chunks!r}"
        )


def stage_map(model: Model, placement: str, pp: int, chunks: int) -> dict[tuple[int, int], tuple[int, ...]]:
    """{(rank, chunk): the model stage indices that chunk runs, in forward order}."""
    _check_layout(placement, pp, chunks)
    total = pp if placement == "bidir" else pp * chunks
    parts = split_stages(model, total)
    return {(r, c): parts[stage_of(placement, pp, r, c)] for r in range(pp) for c in range(chunks)}


def schedule_stage_map(model: Model, schedule: Schedule) -> dict[tuple[int, int], tuple[int, ...]]:
    """``stage_map`` for a schedule's layout."""
    return stage_map(model, schedule.placement, schedule.pp, schedule.chunks)


def local_param_names(
    model: Model, placement: str | Schedule, pp: int | None = None, chunks: int | None = None, rank: int = 0
) -> list[str]:
    """The global parameter names pipeline ``rank`` holds (all its chunks), in model order.

    ``placement`` may be a Schedule, which then also gives pp and chunks.
    """
    if isinstance(placement, Schedule):
        placement, pp, chunks = placement.placement, placement.pp, placement.chunks
    if pp is None or chunks is None:
        raise ValueError("local_param_names needs pp and chunks (or a Schedule)")
    if not 0 <= rank < pp:
        raise ValueError(f"rank {rank} outside 0..{pp - 1}")
    smap = stage_map(model, placement, pp, chunks)
    mine = {i for c in range(chunks) for i in smap[(rank, c)]}
    seen: dict[str, None] = {}
    for i, stage in enumerate(model.stages):
        if i in mine:
            for name in stage.params:
                seen.setdefault(name)
    return list(seen)


def param_holders(
    model: Model, placement: str | Schedule, pp: int | None = None, chunks: int | None = None
) -> dict[str, tuple[int, ...]]:
    """{global name: the pipeline ranks holding it, ascending}; more than one rank = grads to sum
    (DualPipe's two copies, tied embeddings split between the first and last stage)."""
    if isinstance(placement, Schedule):
        placement, pp, chunks = placement.placement, placement.pp, placement.chunks
    assert pp is not None and chunks is not None
    holders: dict[str, list[int]] = {n: [] for n in model.param_names()}
    for r in range(pp):
        for name in local_param_names(model, placement, pp, chunks, r):
            holders[name].append(r)
    return {n: tuple(rs) for n, rs in holders.items()}
