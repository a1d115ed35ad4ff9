"""The FP8 mode of a step: which linears run as FP8 GEMMs, their weights quantized once, their inputs
cached in FP8 for the weight gradient. ``fp8_training`` opens it (``fmoe.stages.primitives``, whose
``linear`` / ``grouped_linear`` read it, re-exports it: users import it from there).

FP8 activation caching. Without it, an FP8 ``linear`` / ``grouped_linear`` saves its input ``x``
[n, k] in the compute dtype (2 bytes an element in bf16) and its weight-gradient step (W) quantizes
it along tokens (``Fp8ActT``: 1x128 groups along tokens, each expert's rows padded to a multiple of
128). With it, F makes that very ``Fp8ActT`` - ``quantize_act_t(x, offs)``, the call W's kernel
would make (``fmoe.kernels.fp8_linear._cols``), in the same pass as the forward GEMM's row
quantization (``with_rows=True``, the bits of ``quantize_act``) - and the Function saves only it:
1 byte an element plus a float32 scale per 128 (~0.52 of bf16 for a dense input; an expert input
also holds the padding of each expert's last tile, see :func:`cached_input_bytes`). W reads the
cached form as it is, so the gradient's bits are those without caching: the same quantization of
the same values.

Which linears cache is set per step by ``fp8_training(cache_inputs=..., cache_expert_inputs=...)``,
which the trainer opens from the recipe's ``memory.fp8_cache`` (``fmoe.memory_policy``). Expert
inputs are cached only where a micro-batch's expert W is not merged with another's
(``MemoryPolicy.fp8_cache_experts``): a merged W quantizes the concatenation of the micro-batches'
rows, whose 128-token tiles straddle micro-batches, so it cannot read per-micro-batch cached parts
and keep its bits (``merge_grouped_weight_grads`` refuses them).

Only an input made inside the F is cached: a stage's input (a leaf, or a view of one) is kept by F
for B anyway; nor is the output of a block selective recomputation remakes in B (a norm's, a SwiGLU's:
it keeps no bytes of them). A linear whose input another operation saves is called with ``linear(...,
cache=False)``: o_proj, whose input is a view of the attention's output, which SDPA saves; MLA's
query projection, whose input also feeds ``kv_a_proj_with_mqa`` (576 rows keep it out of FP8, so it
saves the input in the compute dtype).

The FP8 SwiGLU experts (``primitives.fp8_swiglu_experts``, one Function for two grouped linears)
cache as those two would: x where ``cached_input`` says; SwiGLU's output never, since with FP8
weight gradients the down GEMM's W reads the FP8 rows its forward read (``grouped_linear``'s
``w_reads_rows``; next paragraph), which are smaller than its cached form and give the same bits at
any merge window.

Output gradients, and SwiGLU's output. An FP8 expert GEMM's B quantizes its output gradient's rows
(1x128 groups) for the input-gradient GEMM, and its W (``GroupedWeightGrad``) keeps those FP8 rows,
requantized along tokens when it runs (``quantize_act_t`` of an ``Fp8Act``: the rows' values, bits
times scale, quantized again; DeepSeek-V3's 1x128 -> 128x1 recipe), not the bf16 gradient: half the
bytes held until a merged W, and the fused SwiGLU experts write no bf16 gate/up gradient at all. The
down GEMM's input, SwiGLU's output, is kept so too: F's FP8 rows of it, not the bf16 product (which
the fused experts then never write). Each such value goes through two roundings to E4M3 where an
input's cached form (above) goes through one.

Weights from the masters. A stacked expert weight that a rank holds whole reaches the stages of an FP8
step as its fp32 master, not a bf16 copy (``quantized_from_master`` names them; ``parallel`` and the
benchmarks hand them over so): the FP8 copies are all that is read of it, quantized once from fp32,
and its weight gradient comes out in the compute dtype (dy's) all the same.

Within one F (``input_scope``, opened by ``defer_weight_grads``) an input read by several linears
(q, k and v of one normed hidden state; gate and up of a dense MLP) is quantized once and its cached
form shared, as the compute-dtype tensor was. The scope forgets everything when F ends.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from fmoe.stages.recompute import is_recomputed

if TYPE_CHECKING:
    from fmoe.kernels.fp8_quant import Fp8Act, Fp8ActT

__all__ = [
    "CachedInput",
    "cached_input",
    "cached_input_bytes",
    "cols_from_saved",
    "cols_to_save",
    "fp8_dense_wgrad",
    "fp8_expert_wgrad",
    "fp8_swiglu_expert_weights",
    "fp8_training",
    "fp8_weight",
    "input_scope",
    "quantized_from_master",
]

_FP8_WEIGHTS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("fmoe_fp8_weights", default=None)
_FP8_DENSE: contextvars.ContextVar[bool] = contextvars.ContextVar("fmoe_fp8_dense", default=True)
_FP8_DENSE_WGRAD: contextvars.ContextVar[bool] = contextvars.ContextVar("fmoe_fp8_dense_wgrad", default=True)
_FP8_EXPERT_WGRAD: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "fmoe_fp8_expert_wgrad", default=True
)
# the primitives whose inputs are cached now: "linear" and/or "grouped_linear"
_CACHED: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "fmoe_fp8_cached", default=frozenset()
)


@dataclass(frozen=True)
class CachedInput:
    """An FP8 linear's input quantized once in F: ``rows`` feeds the forward GEMM (never saved: it
    lives until the F's ``input_scope`` ends), ``cols`` is what the Function saves for W.
    x: [n, k] -> rows: Fp8Act [n, k]; cols: Fp8ActT [k, cap] (``fmoe.kernels.fp8_quant``)."""

    rows: Fp8Act
    cols: Fp8ActT


@dataclass(frozen=True)
class _Seen:
    x: weakref.ref  # the input object (weak: the cache must not keep it alive)
    offs: Tensor | None
    version: int
    value: CachedInput


# the current F's inputs already quantized: id(x) -> _Seen (None: outside an F, no sharing)
_SEEN: contextvars.ContextVar[dict[int, _Seen] | None] = contextvars.ContextVar("fmoe_fp8_seen", default=None)


@contextlib.contextmanager
def fp8_training(
    enabled: bool = True,
    *,
    dense: bool = True,
    dense_wgrad: bool = True,
    expert_wgrad: bool = True,
    cache_inputs: bool = False,
    cache_expert_inputs: bool = False,
) -> Iterator[None]:
    """Run ``linear`` / ``grouped_linear`` as FP8 GEMMs (DeepSeek-V3's recipe) inside this block.

    Activations and output gradients are quantized in 1x128 groups, weights in 128x128 blocks, FP32
    accumulation. A weight is quantized once per block - the training loop opens one per optimizer
    step - and reused by every microbatch; the cache is keyed by the weight's storage and version, so
    an in-place update is seen. Layers whose dims are not multiples of 128, and calls made with
    ``fp8=False`` (router, LM head), stay in the compute dtype. ``dense=False`` keeps every
    ``linear`` (the attention projections) in the compute dtype too: only the expert GEMMs run in
    FP8 (at a few thousand tokens per microbatch the projections' GEMMs are too small to gain).
    ``dense_wgrad=False`` keeps the dense linears' forward and input-gradient GEMMs in FP8 but runs
    their weight gradient in the compute dtype, on the input kept in it: no token-wise quantization
    of x and dy, which at a few thousand tokens per micro-batch can cost more than the FP8 GEMM saves
    (a DeepSeek-V3-16B step 1.5% faster, a Qwen3 one level: ``benchmarks/results/
    issue26_variants_2026-12-07_h100.json``); the gradient is then that of the compute dtype.
    ``expert_wgrad=False`` does the same for the experts' (``grouped_linear``) weight gradients (the
    merged BF16 grouped GEMM over a step's rows, on a gathered copy of them: 0.8-2.4% slower a step
    than FP8 reading the rows where they lie, same file); no expert input is cached then.
    cache_inputs / cache_expert_inputs: ``linear`` / ``grouped_linear`` keep their input in the FP8
    form their weight gradient reads, not in the compute dtype (bitwise the same results; see the
    module docstring). Expert inputs only where no micro-batch's expert W is merged with another's
    (``MemoryPolicy.fp8_cache_experts`` decides; a merge of cached parts is refused).
    """
    token = _FP8_WEIGHTS.set({} if enabled else None)
    dense_token = _FP8_DENSE.set(dense)
    wgrad_token = _FP8_DENSE_WGRAD.set(dense_wgrad)
    expert_wgrad_token = _FP8_EXPERT_WGRAD.set(expert_wgrad)
    kinds = frozenset(
        k for k, on in (("linear", cache_inputs), ("grouped_linear", cache_expert_inputs)) if on
    )
    cached_token = _CACHED.set(kinds)
    try:
        yield
    finally:
        _CACHED.reset(cached_token)
        _FP8_EXPERT_WGRAD.reset(expert_wgrad_token)
        _FP8_DENSE_WGRAD.reset(wgrad_token)
        _FP8_DENSE.reset(dense_token)
        _FP8_WEIGHTS.reset(token)


def _quantize_weight(w: Tensor):
    from fmoe.kernels.fp8_quant import quantize_weight

    return quantize_weight(w)


def _fp8_weight(w: Tensor, cache: dict):
    # strides too: a view (``w.t()``, a slice of a fused weight) is another weight on the same storage
    key = (
        w.untyped_storage().data_ptr(),
        w.storage_offset(),
        tuple(w.shape),
        w.stride(),
        w.dtype,
        w._version,
    )
    if key not in cache:
        cache[key] = _quantize_weight(w.detach())
    return cache[key]


def _fp8_eligible(in_features: int, w: Tensor) -> bool:
    return all(d % 128 == 0 for d in w.shape[-2:]) and in_features == w.shape[-1]


def _fp8_weight_for(in_features: int, w: Tensor, dense: bool):
    cache = _FP8_WEIGHTS.get()
    if cache is None or (dense and not _FP8_DENSE.get()) or not _fp8_eligible(in_features, w):
        return None
    return _fp8_weight(w, cache)


def fp8_weight(x: Tensor, w: Tensor, dense: bool):
    """The FP8 form of ``w`` for a ``linear`` (dense) / ``grouped_linear`` call on ``x`` now, or None:
    the call runs in the compute dtype (outside ``fp8_training``, dims not multiples of 128, or a
    dense call with ``dense=False``)."""
    return _fp8_weight_for(x.shape[-1], w, dense)


def fp8_swiglu_expert_weights(x: Tensor, gate_up_w: Tensor, down_w: Tensor):
    """The FP8 forms of an expert MLP's two weights (``grouped_linear(swiglu(grouped_linear(x,
    gate_up_w)), down_w)``), or None unless both of its GEMMs run in FP8 now.
    x: [n, H], gate_up_w: [E, 2I, H], down_w: [E, H, I]."""
    inter = gate_up_w.shape[-2] // 2
    if down_w.shape[-1] != inter or gate_up_w.shape[-2] != 2 * inter:
        return None
    up = _fp8_weight_for(x.shape[-1], gate_up_w, dense=False)
    down = _fp8_weight_for(inter, down_w, dense=False) if up is not None else None
    return None if down is None else (up, down)


def quantized_from_master(
    shapes: Mapping[str, Sequence[int]], expert_params: Collection[str]
) -> frozenset[str]:
    """The weights an FP8 step hands its stages as the fp32 masters, with no compute-dtype copy: the
    stacked expert tensors [E, out, in] of ``shapes`` (those named in ``expert_params``) whose last
    two dims are multiples of 128.

    Their only users are the experts' grouped GEMMs, and inside ``fp8_training`` every one of those
    reads the weight's FP8 copy (quantized once a step from whatever float dtype it is given), never
    the weight itself. A bf16 copy would be written and read once, only to be quantized: 4 of the 10
    bytes an element that casting and quantizing move, and 2 bytes an element held for the step
    (Qwen3-30B-A3B: 1.2 GB a layer). Quantizing the fp32 value is also one rounding, not two. Their
    weight gradients come out in the compute dtype (dy's), as the cast weights' do.

    The caller passes only tensors it holds whole (a shard of one rank): a sharded one is gathered
    anyway, and in the compute dtype that is half the bytes to move."""
    return frozenset(
        n
        for n, shape in shapes.items()
        if n in expert_params and len(shape) == 3 and shape[-1] % 128 == 0 and shape[-2] % 128 == 0
    )


def fp8_dense_wgrad() -> bool:
    """Whether an FP8 ``linear``'s weight gradient runs in FP8 (``fp8_training(dense_wgrad=...)``)."""
    return _FP8_DENSE_WGRAD.get()


def fp8_expert_wgrad() -> bool:
    """Whether an FP8 ``grouped_linear``'s weight gradient runs in FP8 (``fp8_training(expert_wgrad=...)``)."""
    return _FP8_EXPERT_WGRAD.get()


@contextlib.contextmanager
def input_scope() -> Iterator[None]:
    """One F: an input read by several FP8 linears is quantized once (its cached form is shared)."""
    token = _SEEN.set({})
    try:
        yield
    finally:
        _SEEN.reset(token)


def cached_input(kind: str, x: Tensor, x2: Tensor, offs: Tensor | None) -> CachedInput | None:
    """The cached form of ``x`` for the FP8 primitive ``kind``, or None where it is not cached.

    x: the tensor the stage passed (its identity keys the sharing within an F); x2: its [n, k] rows
    (x itself, or ``x.reshape(-1, k)``); offs: [E] int32 cumulative expert end rows (grouped), or
    None (one group). Not cached outside ``fp8_training``'s caching, when no gradient is being
    recorded, when ``x`` is a leaf or a view of a leaf that requires grad (a stage's input, which F
    keeps for B anyway: a cached form would only add bytes), when selective recomputation remakes it
    in B (``recompute.is_recomputed``: nothing of it is kept), or where the cached form is not
    smaller than x (``cached_input_bytes``: a few rows, or many experts' tiles padded)."""
    base = x._base
    stage_input = base is not None and base.requires_grad and base.grad_fn is None
    if kind not in _CACHED.get() or not torch.is_grad_enabled() or x.grad_fn is None or stage_input:
        return None
    if is_recomputed(x):  # selective recomputation keeps no bytes of it at all
        return None
    if not _caches_made_input(kind, x2.shape[0], x2.shape[1], x2.element_size(), offs):
        return None
    seen = _SEEN.get()
    hit = seen.get(id(x)) if seen is not None else None
    if hit is not None and hit.x() is x and hit.offs is offs and hit.version == x._version:
        return hit.value
    from fmoe.kernels.fp8_quant import quantize_act_t

    rows, cols = quantize_act_t(x2.detach(), offs, with_rows=True)
    value = CachedInput(rows, cols)
    if seen is not None:
        seen[id(x)] = _Seen(weakref.ref(x), offs, x._version, value)
    return value


def _caches_made_input(kind: str, rows: int, k: int, itemsize: int, offs: Tensor | None) -> bool:
    """Whether an input [rows, k] (``itemsize`` bytes an element) that an F made - not a stage's
    input, not recomputed - for the FP8 primitive ``kind`` is kept in its cached form now: caching is
    on for ``kind`` and the cached form is smaller (``cached_input_bytes``). offs: [E] int32, or None
    (one group)."""
    if kind not in _CACHED.get() or not torch.is_grad_enabled():
        return False
    experts = 1 if offs is None else offs.numel()
    return cached_input_bytes(rows, k, experts) < rows * k * itemsize


def cols_to_save(cols: Fp8ActT) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The tensors of an Fp8ActT, for ``ctx.save_for_backward`` (so saved-tensor hooks - offload,
    recompute - see them like any saved tensor); :func:`cols_from_saved` is the inverse."""
    return cols.data, cols.scale, cols.group_start, cols.group_len


def cols_from_saved(saved: tuple[Tensor, ...]) -> Fp8ActT:
    from fmoe.kernels.fp8_quant import Fp8ActT

    data, scale, group_start, group_len = saved
    return Fp8ActT(data=data, scale=scale, group_start=group_start, group_len=group_len)


def cached_input_bytes(rows: int, k: int, experts: int = 1) -> int:
    """Bytes of the cached form of an input [rows, k] over ``experts`` groups (1: a dense linear):
    ``quantize_act_t`` allocates cap = cdiv(rows, 128) + experts - 1 tiles of 128 tokens (an upper
    bound of the tiles any routing needs), 1 byte per element and a float32 scale per 1x128 group,
    plus two int32 per expert."""
    tiles = max(-(-rows // 128) + experts - 1, 1)
    return k * tiles * 128 + 4 * k * tiles + 8 * experts
