"""The fused cross-entropy equals ``F.cross_entropy(logits.float(), labels, ignore_index=-100)``: loss to
float32 rounding, gradient to the logits' dtype rounding, ignored labels and all their corner cases.

Kernels run under the Triton interpreter on CPU tensors, with a small vocab chunk (``block_v``) so
that a 1000-word vocab takes several chunks and a ragged last one. The interpreter truncates
fp32 -> bf16 / fp16 where GPUs round to nearest, so low-precision gradients are compared to the
float32 reference within one ulp of their dtype.

Tolerances come from a rounding-error bound that holds for any order of summation (any CPU, SIMD
width or thread count), not from what one machine produced: see ``_fp32_bound``.
"""

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fmoe.kernels import cross_entropy as ce  # noqa: E402
from fmoe.kernels._triton import BACKEND_ENV, interpreting  # noqa: E402

T, V, BLOCK = 37, 1000, 256  # 1000 = 3 * 256 + 232: a ragged last chunk
ULP = {torch.float32: 2**-23, torch.bfloat16: 2**-8, torch.float16: 2**-11}  # half an ulp: round-to-nearest


def _logits(*shape, seed: int, scale: float = 3.0, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _labels(n: int, vocab: int, seed: int, ignored_every: int = 0) -> torch.Tensor:
    labels = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))
    if ignored_every:
        labels[::ignored_every] = -100
    return labels


def _loss_and_grad(fn, logits: torch.Tensor, labels: torch.Tensor, scale: float = 1.0, **kw):
    x = logits.detach().clone().requires_grad_()
    loss = fn(x, labels, **kw)
    (loss * scale).backward()
    return loss.detach(), x.grad


def _reference_f32_grad(logits: torch.Tensor, labels: torch.Tensor, scale: float = 1.0, ignore_index=-100):
    """The reference loss and its gradient before autograd rounds it to the logits' dtype."""
    x = logits.detach().float().requires_grad_()
    loss = F.cross_entropy(x, labels, ignore_index=ignore_index)
    (loss * scale).backward()
    return loss.detach(), x.grad


EPS32 = torch.finfo(torch.float32).eps  # 2**-23: the float32 ulp at 1


def _fp32_bound(logits: torch.Tensor, labels: torch.Tensor, scale: float = 1.0, ignore_index=-100):
    """Elementwise bound on |g - g_exact| for the float32 gradient of any float32 implementation of
    mean softmax cross-entropy, g_j = scale * (p_j - [j = y]) / n, p_j = exp(x_j - lse), and the
    bound on |loss - loss_exact|. The rounding errors (u = EPS32):
      - the row sum S of V positive terms exp(x_j - m), in any order and blocking: relative error
        about u * sqrt(V) (rounding errors of random sign; the worst case, u * V, never happens with
        these random logits), so lse = m + log S is off by u * sqrt(V) (absolute) plus u * |lse|;
      - x_j - lse: absolute u * (|x_j| + |lse|); exp, the subtraction of the one-hot, the 1/n and
        scale products: a few u relative (4 here).
    So p_j has relative error u * (|x_j| + 2|lse| + sqrt(V) + 4), and g_j absolute error that times
    (p_j + [j = y]) * scale / n (the + [j = y]: p_j - 1 rounded once more). The loss is a mean of
    lse - x_y over n rows: u * (mean(|x_y| + 2|lse|) + sqrt(V) + log2(n) + 4). Comparing two such
    implementations (the kernel and torch) doubles it: the callers multiply by 2.
    """
    x = logits.detach().float()
    counted = labels != ignore_index
    n, vocab = int(counted.sum()), x.shape[-1]
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    finite = torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x))
    rel = EPS32 * (finite + 2 * lse.abs() + math.sqrt(vocab) + 4)
    onehot = torch.zeros_like(x)
    onehot[counted, labels[counted]] = 1.0
    grad_bound = rel * (torch.softmax(x, dim=-1) + onehot) * abs(scale) / max(n, 1)
    grad_bound[~counted] = 0.0
    x_label = finite[counted, labels[counted]]
    loss_bound = EPS32 * (
        float((x_label + 2 * lse[counted, 0].abs()).mean()) + math.sqrt(vocab) + math.log2(max(n, 2)) + 4
    )
    return grad_bound, loss_bound


def _loss_close(loss: torch.Tensor, want: torch.Tensor, logits, labels) -> bool:
    """The kernel's float32 loss against the float32 reference: twice _fp32_bound (two implementations)."""
    _, loss_bound = _fp32_bound(logits, labels)
    return abs(float(loss) - float(want)) <= 2 * loss_bound


def _within_ulp(got: torch.Tensor, want: torch.Tensor, dtype, logits, labels, scale: float = 1.0) -> bool:
    """got (rounded to ``dtype``, truncated by the interpreter: up to one ulp = 2 * ULP relative)
    against the float32 reference ``want``: that rounding plus twice the float32 bound of both
    implementations (_fp32_bound), plus the spacing of dtype's subnormals."""
    want = want.float()
    grad_bound, _ = _fp32_bound(logits, labels, scale)
    subnormal = torch.finfo(dtype).tiny * torch.finfo(dtype).eps  # fp16's spacing near 0: 6e-8
    tol = want.abs() * 2 * ULP[dtype] + 2 * grad_bound + subnormal
    return bool(torch.all((got.float() - want).abs() <= tol))


def test_kernels_run_in_the_interpreter_here():
    assert interpreting()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_loss_and_grad_match_reference(dtype):
    logits, labels = _logits(T, V, seed=1, dtype=dtype), _labels(T, V, seed=2)
    loss, grad = _loss_and_grad(ce.cross_entropy, logits, labels, block_v=BLOCK)
    want_loss, want_grad = _reference_f32_grad(logits, labels)
    assert loss.shape == () and loss.dtype == torch.float32
    assert _loss_close(loss, want_loss, logits, labels)
    assert grad.dtype == dtype and grad.shape == logits.shape
    assert _within_ulp(grad, want_grad, dtype, logits, labels)
    # and against torch's own autograd through the upcast (which rounds its fp32 gradient to dtype)
    _, torch_grad = _loss_and_grad(ce.cross_entropy_reference, logits, labels)
    # (both round to dtype: one ulp each of the larger magnitude, plus both float32 bounds)
    grad_bound, _ = _fp32_bound(logits, labels)
    both_rounded = 2 * ULP[dtype] * torch.maximum(grad.float().abs(), torch_grad.float().abs())
    assert torch.all((grad.float() - torch_grad.float()).abs() <= both_rounded + 2 * grad_bound)


def test_one_chunk_per_row_with_the_default_block():
    # V = 1000 < FWD_BLOCK_V: the single chunk is mostly masked
    logits, labels = _logits(9, V, seed=3), _labels(9, V, seed=4)
    loss, grad = _loss_and_grad(ce.cross_entropy, logits, labels)
    want_loss, want_grad = _reference_f32_grad(logits, labels)
    assert _loss_close(loss, want_loss, logits, labels)
    assert _within_ulp(grad, want_grad, torch.float32, logits, labels)


def test_vocab_a_multiple_of_the_block():
    logits, labels = _logits(T, 4 * 64, seed=5), _labels(T, 4 * 64, seed=6)
    loss, grad = _loss_and_grad(ce.cross_entropy, logits, labels, block_v=64)
    want_loss, want_grad = _reference_f32_grad(logits, labels)
    assert _loss_close(loss, want_loss, logits, labels)
    assert _within_ulp(grad, want_grad, torch.float32, logits, labels)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ignored_rows_add_nothing_and_get_zero_gradient(dtype):
    logits, labels = _logits(T, V, seed=7, dtype=dtype), _labels(T, V, seed=8, ignored_every=3)
    loss, grad = _loss_and_grad(ce.cross_entropy, logits, labels, block_v=BLOCK)
    want_loss, want_grad = _reference_f32_grad(logits, labels)
    # the mean is over the 24 counted rows, not all 37
    assert _loss_close(loss, want_loss, logits, labels)
    ignored = labels == -100
    assert int(ignored.sum()) == 13
    assert torch.equal(grad[ignored], torch.zeros_like(grad[ignored]))
    assert _within_ulp(grad, want_grad, dtype, logits, labels)  # (the bound is 0 on ignored rows)


def test_all_rows_ignored_gives_nan_loss_and_zero_gradient_like_torch():
    logits, labels = _logits(T, V, seed=9), torch.full((T,), -100)
    loss, grad = _loss_and_grad(ce.cross_entropy, logits, labels, block_v=BLOCK)
    want_loss, want_grad = _loss_and_grad(ce.cross_entropy_reference, logits, labels)
    assert torch.isnan(want_loss) and torch.isnan(loss)
    assert torch.equal(want_grad, torch.zeros_like(want_grad)) and torch.equal(grad, want_grad)


def test_no_rows_gives_nan_loss_like_torch():
    logits, labels = torch.zeros(0, V), torch.zeros(0, dtype=torch.int64)
    loss, grad = _loss_and_grad(ce.cross_entropy, logits, labels, block_v=BLOCK)
    assert torch.isnan(ce.cross_entropy_reference(logits, labels)) and torch.isnan(loss)
    assert grad.shape == (0, V)


def test_ignore_index_inside_the_vocab():
    logits, labels = _logits(T, V, seed=10), _labels(T, V, seed=11)
    labels[::4] = 7  # ignore_index=7: these rows are skipped, their label is not a class
    loss, grad = _loss_and_grad(ce.cross_entropy, logits, labels, block_v=BLOCK, ignore_index=7)
    want_loss, want_grad = _reference_f32_grad(logits, labels, ignore_index=7)
    assert _loss_close(loss, want_loss, logits, labels)
    assert torch.equal(grad[labels == 7], torch.zeros(10, V))
    assert _within_ulp(grad, want_grad, torch.float32, logits, labels)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_scales_with_the_upstream_gradient(dtype):
    logits, labels = _logits(T, V, seed=12, dtype=dtype), _labels(T, V, seed=13, ignored_every=5)
    _, grad = _loss_and_grad(ce.cross_entropy, logits, labels, scale=3.0, block_v=BLOCK)
    _, want_grad = _reference_f32_grad(logits, labels, scale=3.0)
    _, unit_grad = _reference_f32_grad(logits, labels)
    assert not torch.allclose(want_grad, unit_grad)  # the test can tell the two apart
    assert _within_ulp(grad, want_grad, dtype, logits, labels, scale=3.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_logits_do_not_overflow(dtype):
    # exp(+-80) is ~1e+-35: a sum of 1000 of them without the running max would be inf in float32
    # half the time and 0 the other; the spikes at +-1e4 overflow any unshifted exp outright.
    signs = torch.where(torch.rand(T, V, generator=torch.Generator().manual_seed(14)) < 0.5, -1.0, 1.0)
    logits = 80.0 * signs
    logits[0, 500], logits[1, 999], logits[2, :] = 1e4, -1e4, -80.0
    logits[3, :300] = -1e4  # whole first chunks far below the rest of the row
    logits = logits.to(dtype)
    labels = _labels(T, V, seed=15)
    labels[0] = 500
    loss, grad = _loss_and_grad(ce.cross_entropy, logits, labels, block_v=BLOCK)
    want_loss, want_grad = _reference_f32_grad(logits, labels)
    assert torch.isfinite(loss) and torch.isfinite(grad.float()).all()
    assert _loss_close(loss, want_loss, logits, labels)
    assert _within_ulp(grad, want_grad, dtype, logits, labels)


def test_minus_inf_logits_in_the_first_chunks():
    # masked-out words (-inf) filling whole chunks before any finite logit: the running max is still
    # -inf there, and exp(-inf - -inf) must not turn the row into nan
    logits, labels = _logits(T, V, seed=26), _labels(T, V, seed=27) % 400 + 600
    logits[:, : 2 * BLOCK + 10] = float("-inf")
    loss, grad = _loss_and_grad(ce.cross_entropy, logits, labels, block_v=BLOCK)
    want_loss, want_grad = _reference_f32_grad(logits, labels)
    assert torch.isfinite(want_loss) and _loss_close(loss, want_loss, logits, labels)
    assert torch.equal(grad[:, : 2 * BLOCK + 10], torch.zeros(T, 2 * BLOCK + 10))
    assert _within_ulp(grad, want_grad, torch.float32, logits, labels)


def test_strided_and_transposed_logits_and_strided_labels():
    wide = _logits(T, V + 50, seed=16)
    logits = wide[:, :V]  # row stride V + 50
    labels = _labels(T, V, seed=17)
    loss, grad = _loss_and_grad(ce.cross_entropy, logits, labels, block_v=BLOCK)
    want_loss, want_grad = _reference_f32_grad(logits, labels)
    assert _loss_close(loss, want_loss, logits, labels)
    assert _within_ulp(grad, want_grad, torch.float32, logits, labels)
    transposed = _logits(V, T, seed=18).t()  # column-major: taken through a contiguous copy
    loss = ce.cross_entropy(transposed, labels, block_v=BLOCK)
    assert _loss_close(loss, ce.cross_entropy_reference(transposed, labels), transposed, labels)
    every_other = _labels(2 * T, V, seed=19)[::2]  # a strided view of the labels
    loss, grad = _loss_and_grad(ce.cross_entropy, logits, every_other, block_v=BLOCK)
    want_loss, want_grad = _reference_f32_grad(logits, every_other)
    assert _loss_close(loss, want_loss, logits, every_other)
    assert _within_ulp(grad, want_grad, torch.float32, logits, every_other)


def test_kernel_path_saves_lse_and_runs_its_own_backward():
    logits = _logits(T, V, seed=19, dtype=torch.bfloat16).requires_grad_()
    loss = ce.cross_entropy(logits, _labels(T, V, seed=20), block_v=BLOCK)
    assert type(loss.grad_fn).__name__ == "_CrossEntropyBackward"
    saved = loss.grad_fn.saved_tensors
    assert saved[0] is logits or saved[0].data_ptr() == logits.data_ptr()  # no copy of the logits
    assert all(t.numel() <= T for t in saved[1:])  # the rest are per-row or scalars


def test_torch_backend_takes_the_reference(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "torch")
    logits, labels = _logits(T, V, seed=21).requires_grad_(), _labels(T, V, seed=22, ignored_every=4)
    loss = ce.cross_entropy(logits, labels, block_v=BLOCK)
    assert "NllLoss" in type(loss.grad_fn).__name__
    assert torch.equal(loss, F.cross_entropy(logits.float(), labels, ignore_index=-100))


def test_forward_kernel_gives_nan_for_an_out_of_range_label():
    # What CUDA does (labels are not checked there): the row's loss is nan, nothing is read out of bounds.
    logits, labels = _logits(4, V, seed=23), torch.tensor([3, V, -5, -100])
    loss_rows, lse, n_valid = ce.cross_entropy_forward(logits, labels, block_v=BLOCK)
    assert torch.isfinite(loss_rows[0]) and torch.isnan(loss_rows[1:3]).all() and loss_rows[3] == 0
    want_lse = torch.logsumexp(logits[:3], dim=1)  # two implementations, each within u (sqrt(V) + 2|lse| + 4)
    assert torch.all((lse[:3] - want_lse).abs() <= 2 * EPS32 * (math.sqrt(V) + 2 * want_lse.abs() + 4))
    assert lse[3] == 0
    assert n_valid.item() == 3


def test_bad_inputs_name_the_argument():
    logits, labels = _logits(T, V, seed=24), _labels(T, V, seed=25)
    with pytest.raises(ValueError, match="logits:"):
        ce.cross_entropy(logits[0], labels)
    with pytest.raises(ValueError, match="logits:"):
        ce.cross_entropy(logits.long(), labels)
    with pytest.raises(ValueError, match="labels:"):
        ce.cross_entropy(logits, labels[:-1])
    with pytest.raises(ValueError, match="labels:"):
        ce.cross_entropy(logits, labels.int())
    bad = labels.clone()
    bad[5] = V
    with pytest.raises(ValueError, match=r"labels: 1000 at row 5 is outside \[0, 1000\)"):
        ce.cross_entropy(logits, bad)
    bad[5] = -1
    with pytest.raises(ValueError, match="labels: -1 at row 5"):
        ce.cross_entropy(logits, bad)
    with pytest.raises(ValueError, match="block_v"):
        ce.cross_entropy(logits, labels, block_v=1000)
