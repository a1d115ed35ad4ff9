"""The Triton stable expert sort equals torch's stable argsort + bincount; token permute helpers.

The kernels run under the Triton interpreter on CPU (TRITON_INTERPRET=1 must be set before triton
is imported, since triton.jit picks interpreter or compiler when a kernel is defined). The
interpreter is slow (about 1 ms per id at these block sizes), so sizes stay small and most cases
use small blocks, which also makes every case span several CTAs.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import textwrap  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import compile_for_sm90  # noqa: E402

from fmoe.kernels import permute  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]


def _assert_stable_sort(ids: torch.Tensor, num_experts: int, result: tuple[torch.Tensor, ...]) -> None:
    order, counts = result[0], result[1]
    assert order.dtype == torch.int64 and counts.dtype == torch.int64
    assert order.shape == ids.shape and counts.shape == (num_experts,)
    assert torch.equal(order, torch.argsort(ids, stable=True))
    assert torch.equal(counts, torch.bincount(ids.long(), minlength=num_experts))
    if len(result) == 3:
        assert torch.equal(result[2], permute.inverse_permutation(order))


def test_interpreter_is_active_and_cpu_training_keeps_the_reference():
    # Guards every other test here: without the interpreter they could not run the kernels on CPU.
    assert permute.HAS_TRITON and permute.INTERPRETED
    # expert_sort dispatches to Triton on CUDA only; on CPU the tests call expert_sort_triton
    assert not permute.uses_triton(torch.zeros(4, dtype=torch.int64), 8)


@pytest.mark.parametrize(
    "n, num_experts, block, dtype",
    [
        (1200, 16, 256, torch.int64),
        (1100, 128, 512, torch.int32),
        (777, 5, 64, torch.int64),  # num_experts not a power of two, n not a multiple of block
        (1024, 256, 128, torch.int32),
    ],
)
def test_expert_sort_equals_stable_argsort_and_bincount_on_random_ids(n, num_experts, block, dtype):
    gen = torch.Generator().manual_seed(n + num_experts)
    ids = torch.randint(0, num_experts, (n,), generator=gen, dtype=dtype)
    _assert_stable_sort(
        ids, num_experts, permute.expert_sort_triton(ids, num_experts, block=block, return_inverse=True)
    )


def test_default_block_size_equals_stable_argsort():
    # The configuration the GPU runs (4096 ids per CTA, a 12-bit local index in the sort keys).
    # One interpreted CTA of 4096 costs several seconds; multi-CTA logic is covered at smaller blocks.
    assert permute.DEFAULT_BLOCK == 4096
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 128, (4096,), generator=gen)
    _assert_stable_sort(ids, 128, permute.expert_sort_triton(ids, 128, return_inverse=True))


def _adversarial_cases():
    gen = torch.Generator().manual_seed(3)
    rand = lambda n, e: torch.randint(0, e, (n,), generator=gen)
    return {
        "all_tokens_to_one_expert": (torch.full((700,), 5), 8),
        "all_tokens_to_last_expert": (torch.full((300,), 31), 32),
        "empty_experts": (torch.tensor([0, 3, 31])[rand(600, 3)], 32),
        "n_not_multiple_of_block": (rand(1000, 8), 8),
        "n_equals_block": (rand(128, 8), 8),
        "n_zero": (torch.zeros(0, dtype=torch.int64), 8),
        "n_one": (torch.tensor([3]), 8),
        "num_experts_one": (torch.zeros(500, dtype=torch.int64), 1),
        "many_experts_few_tokens": (rand(10, 128), 128),
        "256_experts_few_tokens": (rand(37, 256), 256),
        "already_sorted": (rand(600, 16).sort().values, 16),
        "reverse_sorted": (rand(600, 16).sort(descending=True).values, 16),
        "int32_ids": (rand(500, 64).to(torch.int32), 64),
    }


@pytest.mark.parametrize("case", sorted(_adversarial_cases()))
def test_expert_sort_equals_stable_argsort_on_adversarial_inputs(case):
    ids, num_experts = _adversarial_cases()[case]
    _assert_stable_sort(
        ids, num_experts, permute.expert_sort_triton(ids, num_experts, block=128, return_inverse=True)
    )


def test_block_offsets_carry_across_prefix_sum_tiles(monkeypatch):
    # Kernel 2 walks the (block, expert) table in tiles of rows; shrink the tile so 16 blocks take
    # 8 tiles and the running per-expert carry between tiles is exercised.
    monkeypatch.setattr(permute, "_OFFSETS_TILE", 64)
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 40, (1000,), generator=gen)
    _assert_stable_sort(ids, 40, permute.expert_sort_triton(ids, 40, block=64, return_inverse=True))


def test_reference_equals_stable_argsort_and_bincount():
    ids = torch.randint(0, 9, (301,), generator=torch.Generator().manual_seed(1))
    _assert_stable_sort(ids, 9, permute.expert_sort_reference(ids, 9, return_inverse=True))


@pytest.mark.parametrize("bad", [-1, 8, 1000])
@pytest.mark.parametrize("path", ["reference", "triton", "dispatch"])
def test_out_of_range_ids_raise_value_error(bad, path):
    ids = torch.tensor([0, 1, bad, 2, 7])
    fn = {
        "reference": permute.expert_sort_reference,
        "triton": lambda i, e: permute.expert_sort_triton(i, e, block=16),  # check defaults to True on CPU
        "dispatch": permute.expert_sort,
    }[path]
    with pytest.raises(
        ValueError, match=r"outside \[0, num_experts=8\).*expert_ids\[\[2\]\] = \[" + str(bad)
    ):
        fn(ids, 8)


def test_unchecked_triton_path_sorts_valid_ids_and_marks_invalid_ones():
    # With check=False a bad id is not detected, but nothing valid is corrupted: the valid ids fill
    # order[:counts.sum()] in stable order and every bad element's slot_of is -1.
    ids = torch.tensor([3, -1, 0, 9, 3, 1, 0, 12, 2])
    order, counts, slot_of = permute.expert_sort_triton(ids, 4, check=False, block=16, return_inverse=True)
    valid = (ids >= 0) & (ids < 4)
    kept = valid.nonzero().flatten()
    assert int(counts.sum()) == int(valid.sum())
    assert torch.equal(order[: int(counts.sum())], kept[torch.argsort(ids[kept], stable=True)])
    assert torch.equal(slot_of[~valid], torch.full((int((~valid).sum()),), -1))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"expert_ids": torch.zeros(2, 3, dtype=torch.int64)}, "1-D"),
        ({"expert_ids": torch.zeros(4)}, "int32 or int64"),
        ({"num_experts": 0}, "num_experts"),
        ({"num_experts": 2.0}, "num_experts"),
        ({"block": 100}, "block"),
        ({"num_experts": permute.MAX_TRITON_EXPERTS + 1}, "num_experts"),
    ],
)
def test_bad_arguments_raise_errors_naming_the_field(kwargs, match):
    args = {"expert_ids": torch.zeros(4, dtype=torch.int64), "num_experts": 4} | kwargs
    block = args.pop("block", 16)
    with pytest.raises(ValueError, match=match):
        permute.expert_sort_triton(args["expert_ids"], args["num_experts"], block=block)


def test_permute_then_unpermute_returns_each_token_once_per_choice():
    T, topk, h, E = 13, 3, 5, 6
    gen = torch.Generator().manual_seed(2)
    ids = torch.rand(T, E, generator=gen).topk(topk, dim=1).indices.flatten()
    x = torch.randn(T, h, generator=gen)
    order, counts, slot_of = permute.expert_sort(ids, E, return_inverse=True)
    x_perm = permute.permute_tokens(x, order, topk)
    assert x_perm.shape == (T * topk, h)
    # rows come grouped by expert: segment e of x_perm holds exactly the tokens routed to e
    seg = torch.repeat_interleave(torch.arange(E), counts)
    assert torch.equal(ids[order], seg)
    assert torch.equal(x_perm, x[order // topk])
    expected = x[:, None, :].expand(T, topk, h)
    assert torch.equal(permute.unpermute_tokens(x_perm, order, T, topk), expected)
    assert torch.equal(permute.unpermute_tokens(x_perm, order, T, topk, slot_of=slot_of), expected)


def test_permute_tokens_gradient_sums_each_tokens_copies():
    T, topk, h, E = 9, 2, 4, 5
    gen = torch.Generator().manual_seed(4)
    ids = torch.rand(T, E, generator=gen).topk(topk, dim=1).indices.flatten()
    order, _ = permute.expert_sort(ids, E)
    x = torch.randn(T, h, dtype=torch.float64, generator=gen)
    g = torch.randn(T * topk, h, dtype=torch.float64, generator=gen)
    # against autograd's own gradient of the plain gather
    x_ref = x.clone().requires_grad_()
    x_ref[order // topk].backward(g)
    out, vjp = torch.func.vjp(lambda x_: permute.permute_tokens(x_, order, topk), x)
    assert torch.equal(out, x[order // topk])
    (grad_x,) = vjp(g)
    torch.testing.assert_close(grad_x, x_ref.grad, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x_: permute.permute_tokens(x_, order, topk), (x.requires_grad_(),))


def test_unpermute_tokens_gradient_is_the_permuted_gradient():
    T, topk, h, E = 7, 2, 3, 4
    gen = torch.Generator().manual_seed(5)
    ids = torch.rand(T, E, generator=gen).topk(topk, dim=1).indices.flatten()
    order, _, slot_of = permute.expert_sort(ids, E, return_inverse=True)
    y_perm = torch.randn(T * topk, h, dtype=torch.float64, generator=gen)
    g = torch.randn(T, topk, h, dtype=torch.float64, generator=gen)
    for kw in ({}, {"slot_of": slot_of}):
        _, vjp = torch.func.vjp(lambda y, kw=kw: permute.unpermute_tokens(y, order, T, topk, **kw), y_perm)
        (grad,) = vjp(g)
        assert torch.equal(grad, g.reshape(T * topk, h)[order])


def test_permute_helpers_reject_mismatched_shapes():
    order = torch.arange(6)
    with pytest.raises(ValueError, match="tokens \\* topk"):
        permute.permute_tokens(torch.zeros(4, 2), order, 2)
    with pytest.raises(ValueError, match="x must be 2-D"):
        permute.permute_tokens(torch.zeros(3, 2, 1), order, 2)
    with pytest.raises(ValueError, match="order must be 1-D int64"):
        permute.permute_tokens(torch.zeros(3, 2), order.int(), 2)
    with pytest.raises(ValueError, match="slot_of"):
        permute.unpermute_tokens(torch.zeros(6, 2), order, 3, 2, slot_of=order[:5])


@pytest.mark.parametrize("n, width, extra", [(70, 300, 5), (1, 7, 0), (33, 256, 40)])
@pytest.mark.parametrize("dest_dtype", [torch.int32, torch.int64])
def test_scatter_rows_kernel_equals_index_copy(n, width, extra, dest_dtype):
    # widths and row counts off the 32 x 256 tile, so masked tails are covered; rows of out that no
    # dest names keep their contents
    g = torch.Generator().manual_seed(n + width)
    src = torch.randn(n, width, generator=g).to(torch.bfloat16)
    dest = torch.randperm(n + extra, generator=g)[:n].to(dest_dtype)
    out = torch.randn(n + extra, width, generator=g).to(torch.bfloat16)
    want = permute.scatter_rows_reference(src, dest.long(), out.clone())
    got = permute.scatter_rows_triton(src, dest, out)
    assert got is out and torch.equal(got, want)
    # the CPU dispatch takes the reference and agrees
    assert torch.equal(permute.scatter_rows(src, dest.long(), torch.zeros_like(out))[dest.long()], src)


def _slot_sum_fp32(grad: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    """Each token's top_k rows added in float32 in slot order (the kernel's arithmetic), unrounded."""
    slots = grad.float().index_select(0, permute.inverse_permutation(order)).view(-1, top_k, grad.shape[1])
    acc = torch.zeros_like(slots[:, 0])
    for j in range(top_k):
        acc = acc + slots[:, j]
    return acc


@pytest.mark.parametrize("tokens,width,top_k", [(37, 200, 8), (64, 256, 2), (5, 300, 1)])
def test_sum_slot_rows_kernel_sums_each_tokens_rows_in_float32(tokens, width, top_k):
    # the permutation's backward in one pass: each token's top_k rows, read where they lie, added
    # in float32 in slot order and rounded once; the interpreter rounds float32 -> bf16 toward
    # zero (a GPU to nearest: tests/test_cuda.py checks its bits), so within one bf16 ulp here
    g = torch.Generator().manual_seed(tokens)
    grad = torch.randn(tokens * top_k, width, generator=g).bfloat16()
    order = torch.randperm(tokens * top_k, generator=g)
    got = permute.sum_slot_rows_triton(grad, order, top_k)
    want = _slot_sum_fp32(grad, order, top_k)
    ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(2**-126))) - 7)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, width)
    assert torch.all((got.float() - want).abs() <= ulp)
    ref = permute.sum_slot_rows_reference(grad, order, top_k)
    assert torch.all((ref.float() - want).abs() <= ulp)  # the CPU path: the same sums
    with pytest.raises(ValueError, match="sum_slot_rows: grad"):
        permute.sum_slot_rows_triton(grad, order[:-1], top_k)


def test_scatter_rows_rejects_mismatched_arguments():
    src, out = torch.zeros(4, 3), torch.zeros(6, 3)
    with pytest.raises(ValueError, match="must share w"):
        permute.scatter_rows(src, torch.arange(4), torch.zeros(6, 2))
    with pytest.raises(ValueError, match="dest must be \\[4\\] int32/int64"):
        permute.scatter_rows_triton(src, torch.arange(3), out)
    with pytest.raises(ValueError, match="one dtype"):
        permute.scatter_rows(src, torch.arange(4), out.double())
    with pytest.raises(ValueError, match="contiguous"):
        permute.scatter_rows(torch.zeros(3, 4).t(), torch.arange(4), out)


def test_benchmark_runs_on_cpu_and_writes_json(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_permute", REPO / "benchmarks" / "bench_permute.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "permute.json"
    argv = ["--device", "cpu", "--tokens", "128", "--topk", "2", "--hidden", "64", "--block", "128"]
    bench.main([*argv, "--warmup", "0", "--iters", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["backend"] == "triton-interpreter" and result["correct"] is True
    assert result["shape"]["n_ids"] == 256
    for key in ("expert_sort", "torch_argsort_bincount", "torch_sort_stable"):
        assert result["ms"][key] > 0
    for key in ("permute_tokens", "scatter_rows", "index_copy_rows"):
        assert result["gather_bf16"][key]["GB_per_s"] > 0
    assert result["torch"] == torch.__version__


_COMPILE_SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from fmoe.kernels import permute

    assert not permute.INTERPRETED
    target = GPUTarget("cuda", 90, 32)  # H100 / H200
    compiled = 0
    # the default launch (128 experts) and the smallest one (n <= 16 ids)
    for ep, block, num_warps in [(128, permute.DEFAULT_BLOCK, permute.DEFAULT_NUM_WARPS), (32, 16, 1)]:
        eb = min(ep, 32)
        kernels = [
            (permute._block_histogram_kernel,
             {"ids_ptr": "*i64", "hist_ptr": "*i32", "n": "i32", "num_experts": "i32",
              "BLOCK": "constexpr", "EP": "constexpr"},
             {"BLOCK": block, "EP": ep}),
            (permute._block_offsets_kernel,
             {"hist_ptr": "*i32", "totals_ptr": "*i32", "counts_ptr": "*i64", "num_blocks": "i32",
              "num_experts": "i32", "EP": "constexpr", "EB": "constexpr", "ROWS": "constexpr"},
             {"EP": ep, "EB": eb, "ROWS": permute._OFFSETS_TILE // eb}),
            (permute._scatter_kernel,
             {"ids_ptr": "*i32", "offsets_ptr": "*i32", "totals_ptr": "*i32", "order_ptr": "*i64",
              "slot_of_ptr": "*i64", "n": "i32", "num_experts": "i32", "BLOCK": "constexpr",
              "LOG_BLOCK": "constexpr", "EP": "constexpr", "WRITE_INVERSE": "constexpr"},
             {"BLOCK": block, "LOG_BLOCK": block.bit_length() - 1, "EP": ep, "WRITE_INVERSE": True}),
            (permute._scatter_rows_kernel,
             {"src_ptr": "*bf16", "dest_ptr": "*i64", "out_ptr": "*bf16", "n": "i32", "width": "i32",
              "BLOCK_R": "constexpr", "BLOCK_C": "constexpr"},
             {"BLOCK_R": permute._SCATTER_ROWS, "BLOCK_C": permute._SCATTER_COLS}),
            (permute._sum_slot_rows_kernel,
             {"grad_ptr": "*bf16", "row_of_ptr": "*i64", "out_ptr": "*bf16", "T": "i32", "width": "i32",
              "TOPK": "constexpr", "BLOCK_T": "constexpr", "BLOCK_C": "constexpr"},
             {"TOPK": 8, "BLOCK_T": permute._SUM_TOKENS, "BLOCK_C": permute._SUM_COLS}),
        ]
        for fn, signature, constexprs in kernels:
            src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
            kernel = triton.compile(src, target=target, options={"num_warps": num_warps})
            assert kernel.asm["cubin"], fn.__name__
            compiled += 1
    print("compiled", compiled)
    """
)


def test_kernels_compile_for_sm90_without_a_gpu():
    # The interpreter does not lower anything; this compiles the real kernels (histogram, scan,
    # sort, gather, row scatter, slot-row sum) down to an sm_90 cubin with the ptxas bundled in triton, no GPU needed.
    compile_for_sm90(_COMPILE_SCRIPT, 10, timeout=300)
