"""fmoe's Triton FP8 expert GEMMs against DeepGEMM's Hopper grouped FP8 kernels (issue 26).

DeepGEMM (github.com/deepseek-ai/DeepGEMM) is DeepSeek-V3's own implementation of the block-scaled
recipe: hand-scheduled SASS-level kernels, JIT-compiled. Its grouped GEMMs are the fastest published
for this recipe (1,214-1,346 TFLOP/s on an H800 at K = 2048-7168). This asks what they give at the
experts' shapes of Qwen3-30B-A3B and DeepSeek-V3-16B, on the same operands as fmoe's kernels: each
expert's forward / input-gradient GEMM of one micro-batch (``m_grouped_fp8_gemm_nt_contiguous``, rows
of each expert padded to DeepGEMM's 128-row alignment) and the weight gradients of a step's micro-
batches merged (``k_grouped_fp8_gemm_nt_contiguous``, each expert's tokens padded to 128, as fmoe's
``Fp8ActT`` already is). Both read fmoe's own quantized tensors (``fq.Fp8Act``, ``fq.Fp8Weight``,
``fq.Fp8ActT``) rearranged into DeepGEMM's layouts outside the timed calls, so the products are
checked against ``fmoe.kernels.fp8_gemm``'s float32 references with the bound bench_cutlass_fp8 uses.
FLOP/s count the routed rows only: the padding is the price DeepGEMM's layout asks.

DeepGEMM is not a dependency of fmoe. ``benchmarks/run_h200.sh deepgemm DIR`` builds and runs it in one
device call; DIR is a DeepGEMM checkout with its submodules (54e2261 was measured, with cutlass f3fde58
and fmt 553ec11; where GitHub is out of reach, ``git archive`` those commits from mirrors into the same
places), carried to the GPU machine, which has no network. By hand, there:

    cd DIR && cp -r third-party/cutlass/include/cute third-party/cutlass/include/cutlass deep_gemm/include/
    DG_USE_LOCAL_VERSION=0 python3 setup.py build_ext --inplace        # in DIR: nvcc, torch's CUDA build
    export LD_PRELOAD=/lib/x86_64-linux-gnu/libstdc++.so.6 PYTHONPATH=.:DIR     # then in fmoe's root:
    python3 -m benchmarks.bench_deepgemm_fp8 --source "DeepGEMM 54e2261" --out F.json

Where the process loads an older libstdc++ than the one DeepGEMM was compiled against (on our GPU
machines: torch's environment), every DeepGEMM call segfaults in ``std::regex`` (its JIT's include
parser); preloading the compiler's libstdc++, as above, mends it. The JIT compiles each shape on its
first call (tens of seconds with nvcc): ``--compile-only KEY`` for every key of ``--list-keys``, in
parallel processes sharing ``DG_JIT_CACHE_DIR``, warms the cache first. DeepGEMM's weight gradient
writes float32 (``D = C + A B^T``, C zeroed inside the timed call), so its error against the float32
reference is not the bf16 rounding the bound allows for.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import fmoe.kernels.fp8_gemm as fg
import fmoe.kernels.fp8_quant as fq
from benchmarks import bench_fp8_grouped as bench_grouped
from benchmarks.common import write_result


def padded_rows(offs: torch.Tensor, align: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """DeepGEMM's contiguous layout of expert-grouped rows: each expert's rows start at a multiple of
    ``align``. Returns (dest [rows] int64: each row's padded position, layout [padded] int32: the
    expert of each padded row or -1, padded)."""
    ends = offs.long().cpu()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    sizes = (counts + align - 1) // align * align
    starts = torch.cumsum(sizes, 0) - sizes
    padded = int(sizes.sum())
    expert = torch.repeat_interleave(torch.arange(len(counts)), counts)
    dest = starts[expert] + torch.arange(int(ends[-1])) - (ends - counts)[expert]
    layout = torch.full((padded,), -1, dtype=torch.int32)
    layout[dest] = expert.to(torch.int32)
    return dest.to(offs.device), layout.to(offs.device), padded


def dg_rows(a: fq.Fp8Act, dest: torch.Tensor, padded: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fmoe's row-quantized activation at DeepGEMM's padded positions: (fp8 [padded, K], scales
    [padded, K / 128] float32 MN-major, as DeepGEMM's SM90 kernels read them); padding rows are zeros
    with scale 1."""
    k, device = a.data.shape[1], a.data.device
    data = torch.zeros(padded, k, dtype=a.data.dtype, device=device)
    data[dest] = a.data
    scale = torch.ones(a.scale.shape[1], padded, device=device).t()
    scale[dest] = a.scale
    return data, scale


def dg_wgrad_operand(t: fq.Fp8ActT) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """fmoe's token-transposed operand in DeepGEMM's SM90 K-grouped layout: each expert's [cols, K_e]
    block K-major and contiguous, one after another (flat fp8), scales [cols, sum K_e / 128] MN-major,
    and the K_e (multiples of 128)."""
    ks = t.group_len.tolist()
    starts = t.group_start.tolist()
    assert starts == [sum(ks[:e]) for e in range(len(ks))], "expected experts packed in order"
    total = sum(ks)
    flat = torch.cat([t.data[:, s : s + k].contiguous().flatten() for s, k in zip(starts, ks) if k])
    return flat, t.scale[:, : total // 128], ks


class DeepGemm:
    def __init__(self):
        import deep_gemm

        self.dg = deep_gemm
        self.align = deep_gemm.get_mk_alignment_for_contiguous_layout()

    def nt_operands(self, a: fq.Fp8Act, w: fq.Fp8Weight, offs: torch.Tensor):
        dest, layout, padded = padded_rows(offs, self.align)
        data, scale = dg_rows(a, dest, padded)
        out = torch.empty(padded, w.data.shape[1], dtype=torch.bfloat16, device="cuda")
        return dest, ((data, scale), (w.data, w.scale), out, layout)

    def nt(self, ops) -> torch.Tensor:
        a, b, out, layout = ops
        self.dg.m_grouped_fp8_gemm_nt_contiguous(a, b, out, layout, ensure_zero_padding=False)
        return out

    def wgrad_operands(self, at: fq.Fp8ActT, bt: fq.Fp8ActT):
        fa, sa, ks = dg_wgrad_operand(at)
        fb, sb, _ = dg_wgrad_operand(bt)
        out = torch.zeros(len(ks), at.data.shape[0], bt.data.shape[0], device="cuda")
        layout = torch.tensor(ks, dtype=torch.int32, device="cuda")
        return ((fa, sa), (fb, sb), out, ks, layout)

    def wgrad(self, ops) -> torch.Tensor:
        a, b, out, ks, layout = ops
        out.zero_()  # D = C + A B^T with C = D: a fresh product each call
        self.dg.k_grouped_fp8_gemm_nt_contiguous(a, b, out, ks, layout, out)
        return out


def _guarded(fn, *args):
    """fn(*args)'s value, or the message of what it raised (a shape DeepGEMM refuses is a finding too)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - recorded, not hidden
        return f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"


def checks(dg: DeepGemm) -> dict:
    """Relative error against the float32 product of the dequantized operands (Triton's beside it)."""
    out = {}
    for name, counts, n, k in bench_grouped.NT_CHECKS:
        offs, _, _, a, w8 = bench_grouped.nt_case(counts, n, k, seed=0)
        ref = fg.fp8_gemm_nt_reference(a, w8.data, w8.scale, offs, out_dtype=torch.float32)
        out[name] = {"triton": bench_grouped.rel(fg.fp8_gemm_nt(a, w8.data, w8.scale, offs), ref)}
        dest, ops = dg.nt_operands(a, w8, offs)
        out[name]["deepgemm"] = _guarded(lambda o, d, r: bench_grouped.rel(dg.nt(o)[d], r), ops, dest, ref)
    for name, counts, m, n in bench_grouped.WGRAD_CHECKS:
        _, _, _, at, bt = bench_grouped.wgrad_case(counts, m, n, seed=7)
        ref = fg.fp8_gemm_wgrad_reference(at, bt, out_dtype=torch.float32)
        out[name] = {"triton": bench_grouped.rel(fg.fp8_gemm_wgrad(at, bt, grouped=True), ref)}
        out[name]["deepgemm"] = _guarded(
            lambda a, b, r: bench_grouped.rel(dg.wgrad(dg.wgrad_operands(a, b)), r), at, bt, ref
        )
    return out


def _ratios(r: dict, flop: float) -> dict:
    for key in ("bf16", "triton", "deepgemm"):
        r[f"{key}_tflops"] = flop / r[f"{key}_ms"] / 1e9
    r["triton_x_bf16"] = r["bf16_ms"] / r["triton_ms"]
    r["deepgemm_x_bf16"] = r["bf16_ms"] / r["deepgemm_ms"]
    r["deepgemm_x_triton"] = r["triton_ms"] / r["deepgemm_ms"]
    return {k: round(v, 4) for k, v in r.items()}


def _time_nt(dg: DeepGemm, counts: list[int], n: int, k: int, compile_only: bool) -> dict:
    offs, x, w, a, w8 = bench_grouped.nt_case(counts, n, k, seed=1)
    rows = x.shape[0]
    wt = w.transpose(-2, -1)
    _, ops = dg.nt_operands(a, w8, offs)
    if compile_only:  # DeepGEMM JIT-compiles a kernel per shape on its first call
        return {"compiled": bool(dg.nt(ops).shape)}
    r = {
        "bf16_ms": bench_grouped.ms(lambda: torch._grouped_mm(x, wt, offs=offs)),
        "triton_ms": bench_grouped.ms(lambda: fg.fp8_gemm_nt(a, w8.data, w8.scale, offs)),
        "deepgemm_ms": bench_grouped.ms(lambda: dg.nt(ops)),
        "deepgemm_padded_rows": ops[0][0].shape[0],
    }
    return _ratios(r, 2.0 * rows * n * k)


def _time_wgrad(dg: DeepGemm, counts: list[int], m: int, n: int, compile_only: bool) -> dict:
    offs, dy, x, at, bt = bench_grouped.wgrad_case(counts, m, n, seed=2)
    dyt = dy.t().contiguous()
    ops = dg.wgrad_operands(at, bt)
    if compile_only:
        return {"compiled": bool(dg.wgrad(ops).shape)}
    zero = torch.zeros_like(ops[2])
    r = {
        "bf16_ms": bench_grouped.ms(lambda: torch._grouped_mm(dyt, x, offs=offs)),
        "triton_ms": bench_grouped.ms(lambda: fg.fp8_gemm_wgrad(at, bt, grouped=True)),
        "deepgemm_ms": bench_grouped.ms(lambda: dg.wgrad(ops)),
        "deepgemm_zero_fill_ms": bench_grouped.ms(
            lambda: ops[2].copy_(zero)
        ),  # inside deepgemm_ms: D = C + A B^T
    }
    return _ratios(r, 2.0 * dy.shape[0] * m * n)


def timing(dg: DeepGemm, family: str, only: str | None = None, compile_only: bool = False) -> dict:
    """The four GEMMs of one micro-batch's routed rows, then the two weight gradients of a step's
    micro-batches merged (the routing draws of bench_cutlass_fp8, so the two files' rows compare).
    only: one GEMM's name; compile_only: call DeepGEMM once, time nothing (a JIT warm-up)."""
    experts, top_k, hidden, inter = bench_grouped.FAMILIES[family]
    gen = torch.Generator().manual_seed(0)
    counts = bench_grouped.routed_counts(experts, bench_grouped.TOKENS * top_k, gen).tolist()
    merged = (
        (
            bench_grouped.routed_counts(
                experts, bench_grouped.TOKENS * top_k * bench_grouped.MICROBATCHES, gen
            )
            + 15
        )
        // 16
        * 16
    ).tolist()
    res = {}
    for name, (n, k) in bench_grouped.expert_gemms(hidden, inter).items():
        if only in (None, name):
            res[name] = _time_nt(dg, counts, n, k, compile_only)
            print(family, name, res[name], flush=True)
    for name, (m, n) in {"up_wgrad": (2 * inter, hidden), "down_wgrad": (hidden, inter)}.items():
        if only in (None, name):
            res[name] = _time_wgrad(dg, merged, m, n, compile_only)
            print(family, name, res[name], flush=True)
    return res


def warm_keys() -> list[str]:
    """What ``--compile-only`` takes: "checks", or "family/gemm" (one JIT compile each, so that
    several processes can compile in parallel into DeepGEMM's cache before the timed run)."""
    gemms = [*bench_grouped.expert_gemms(1, 1), "up_wgrad", "down_wgrad"]
    return ["checks", *(f"{f}/{g}" for f in bench_grouped.FAMILIES for g in gemms)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="JSON file to write")
    p.add_argument("--source", default="", help="which DeepGEMM was built (commit), for the record")
    p.add_argument("--compile-only", metavar="KEY", help="JIT-compile one key's kernels, time nothing")
    p.add_argument("--list-keys", action="store_true", help="print the --compile-only keys")
    p.add_argument(
        "--family", choices=sorted(bench_grouped.FAMILIES), action="append", help="only these (default: all)"
    )
    args = p.parse_args()
    if args.list_keys:
        print(" ".join(warm_keys()))
        return
    dg = DeepGemm()
    if args.compile_only:
        if args.compile_only not in warm_keys():
            p.error(f"--compile-only: unknown key {args.compile_only!r} (--list-keys)")
        if args.compile_only == "checks":
            checks(dg)
        else:
            family, gemm = args.compile_only.split("/")
            timing(dg, family, only=gemm, compile_only=True)
        return
    result = {
        "deep_gemm": f"{getattr(dg.dg, '__version__', '?')} {args.source}".strip(),
        "mk_alignment": dg.align,
        "timing": "triton.testing.do_bench median (bench_fp8_grouped.ms)",
        "rel_err_vs_fp32_reference": checks(dg),
    }
    errors = [e for row in result["rel_err_vs_fp32_reference"].values() for e in row.values()]
    # NaN compares False; a refused call is recorded as its message
    result["all_match_reference"] = all(isinstance(e, float) and e < bench_grouped.BF16_REL for e in errors)
    print(json.dumps(result["rel_err_vs_fp32_reference"], indent=1), flush=True)
    if not result["all_match_reference"]:
        print(
            f"WARNING: a relative error is not below {bench_grouped.BF16_REL}: the timings below are of wrong results"
        )
    for family in args.family or bench_grouped.FAMILIES:
        result[family] = timing(dg, family)
    write_result(args.out, result, echo=False)


if __name__ == "__main__":
    main()
