"""The fused cross-entropy equals ``F.cross_entropy(logits.float(), labels, ignore_index=-100)``: loss to
float32 rounding, gradient to the logits' dtype rounding, ignored labels and all their corner cases.

Kernels run under the Triton interpreter on CPU tensors, with a small vocab chunk (``block_v``) so
that a 1000-word vocab takes several chunks and a ragged last one. The interpreter truncates
fp32 -> bf16 / fp16 where GPUs round to nearest, so low-precision gradients are compared to the
float32 reference within one ulp of their dtype.
"""

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


def _within_ulp(got: torch.Tensor, want: torch.Tensor, dtype) -> bool:
    """got (rounded to ``dtype``, truncated by the interpreter) within one ulp of the float32 want."""
    want = want.float()
    subnormal = torch.finfo(dtype).tiny * torch.finfo(dtype).eps  # fp16's spacing near 0: 6e-8
    tol = want.abs() * 2 * ULP[dtype] + 1e-6 * want.abs().max() + subnormal
    return bool(torch.all((got.float() - want).abs() <= tol))


def test_kernels_run_in_the_interpreter_here():
    assert interpreting()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_loss_and_grad_match_reference(dtype):
    logits, labels = _logits(T, V, seed=1, dtype=dtype), _labels(T, V, seed=2)
    loss, grad = _loss_and_grad(ce.cross_entropy, logits, labels, block_v=BLOCK)
    want_loss, want_grad = _reference_f32_grad(logits, labels)
    assert loss.shape == () and loss.dtype == torch.float32
    assert abs(float(loss / want_loss) - 1) < 2e-6
    assert grad.dtype == dtype and grad.shape == logits.shape
    assert _within_ulp(grad, want_grad, dtype)
    # and against torch's own autograd through the upcast (which rounds its fp32 gradient to dtype)
    _, torch_grad = _loss_and_grad(ce.cross_entropy_reference, logits, labels)
    assert float((grad.float() - torch_grad.float()).abs().max()) <= 2 * ULP[dtype] * float(
        want_grad.abs().max()
    )


def test_one_chunk_per_row_with_the_default_block():
    # V = 1000 < FWD_BLOCK_V: the single chunk is mostly masked
    logits, labels = _logits(9, V, seed=3), _labels(9, V, seed=4)
    loss, grad = _loss_and_grad(ce.cross_entropy, logits, labels)
    want_loss, want_grad = _reference_f32_grad(logits, labels)
    assert abs(float(loss / want_loss) - 1) < 2e-6
    assert torch.allclose(grad, want_grad, rtol=1e-5, atol=1e-8)


def test_vocab_a_multiple_of_the_block():
    logits, labels = _logits(T, 4 * 64, seed=5), _labels(T, 4 * 64, seed=6)
    loss, grad = _loss_and_grad(ce.cross_entropy, logits, labels, block_v=64)
    want_loss, want_grad = _reference_f32_grad(logits, labels)
    assert abs(float(loss / want_loss) - 1) < 2e-6
    assert torch.allclose(grad, want_grad, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ignored_rows_add_nothing_and_get_zero_gradient(dtype):
    logits, labels = _logits(T, V, seed=7, dtype=dtype), _labels(T, V, seed=8, ignored_every=3)
    loss, grad = _loss_and_grad(ce.cross_entropy, logits, labels, block_v=BLOCK)
    want_loss, want_grad = _reference_f32_grad(logits, labels)
    # the mean is over the 24 counted rows, not all 37
    assert abs(float(loss / want_loss) - 1) < 2e-6
    ignored = labels == -100
    assert int(ignored.sum()) == 13
    assert torch.equal(grad[ignored], torch.zeros_like(grad[ignored]))
    assert _within_ulp(grad[~ignored], want_grad[~ignored], dtype)


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
    assert abs(float(loss / want_loss) - 1) < 2e-6
    assert torch.equal(grad[labels == 7], torch.zeros(10, V))
    assert torch.allclose(grad, want_grad, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_scales_with_the_upstream_gradient(dtype):
    logits, labels = _logits(T, V, seed=12, dtype=dtype), _labels(T, V, seed=13, ignored_every=5)
    _, grad = _loss_and_grad(ce.cross_entropy, logits, labels, scale=3.0, block_v=BLOCK)
    _, want_grad = _reference_f32_grad(logits, labels, scale=3.0)
    _, unit_grad = _reference_f32_grad(logits, labels)
    assert not torch.allclose(want_grad, unit_grad)  # the test can tell the two apart
    assert _within_ulp(grad, want_grad, dtype)


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
    assert abs(float(loss / want_loss) - 1) < 2e-6
    assert _within_ulp(grad, want_grad, dtype)


def test_minus_inf_logits_in_the_first_chunks():
    # masked-out words (-inf) filling whole chunks before any finite logit: the running max is still
    # -inf there, and exp(-inf - -inf) must not turn the row into nan
    logits, labels = _logits(T, V, seed=26), _labels(T, V, seed=27) % 400 + 600
    logits[:, : 2 * BLOCK + 10] = float("-inf")
    loss, grad = _loss_and_grad(ce.cross_entropy, logits, labels, block_v=BLOCK)
    want_loss, want_grad = _reference_f32_grad(logits, labels)
    assert torch.isfinite(want_loss) and abs(float(loss / want_loss) - 1) < 2e-6
    assert torch.equal(grad[:, : 2 * BLOCK + 10], torch.zeros(T, 2 * BLOCK + 10))
    assert torch.allclose(grad, want_grad, rtol=1e-5, atol=1e-8)


def test_strided_and_transposed_logits_and_strided_labels():
    wide = _logits(T, V + 50, seed=16)
    logits = wide[:, :V]  # row stride V + 50
    labels = _labels(T, V, seed=17)
    loss, grad = _loss_and_grad(ce.cross_entropy, logits, labels, block_v=BLOCK)
    want_loss, want_grad = _reference_f32_grad(logits, labels)
    assert abs(float(loss / want_loss) - 1) < 2e-6
    assert torch.allclose(grad, want_grad, rtol=1e-5, atol=1e-8)
    transposed = _logits(V, T, seed=18).t()  # column-major: taken through a contiguous copy
    loss = ce.cross_entropy(transposed, labels, block_v=BLOCK)
    assert abs(float(loss / ce.cross_entropy_reference(transposed, labels)) - 1) < 2e-6
    every_other = _labels(2 * T, V, seed=19)[::2]  # a strided view of the labels
    loss, grad = _loss_and_grad(ce.cross_entropy, logits, every_other, block_v=BLOCK)
    want_loss, want_grad = _reference_f32_grad(logits, every_other)
    assert abs(float(loss / want_loss) - 1) < 2e-6
    assert torch.allclose(grad, want_grad, rtol=1e-5, atol=1e-8)


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
    assert torch.allclose(lse[:3], torch.logsumexp(logits[:3], dim=1)) and lse[3] == 0
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
