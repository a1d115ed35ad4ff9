"""Where Triton kernels run, and a stand-in so kernel files import on machines without Triton.

Kernels launch when the tensors are on a CUDA device, or on CPU tensors when ``TRITON_INTERPRET=1``
(Triton's interpreter, which is how the tests run them; it must be set before triton is imported).
Anywhere else, or with ``FMOE_KERNEL_BACKEND=torch``, the launchers take their plain-torch reference
path, so the rest of fmoe works on a laptop CPU.
"""

import os

import torch

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    HAS_TRITON = True
except ImportError:  # macOS / Windows: pyproject installs triton on Linux only

    class _NoTriton:
        """Enough of ``triton`` / ``triton.language`` for the kernel definitions to import."""

        constexpr = None

        @staticmethod
        def jit(fn=None, **_):
            return fn if fn is not None else (lambda f: f)

    triton = tl = _NoTriton()
    TensorDescriptor = None
    HAS_TRITON = False


def _patch_interpreter_scalars() -> None:
    """Let Triton 3.6's interpreter run loops with run-time bounds under numpy >= 2.4.

    The interpreter holds scalars as 1-element arrays and turns them into loop bounds with
    ``int(array)``, which numpy 2.4 refuses for arrays that are not 0-d. Only interpreter runs
    are affected: compiled kernels never go through this code.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "fmoe_scalars", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.fmoe_scalars = True
    interpreter._patch_lang_tensor = patched


if HAS_TRITON:
    _patch_interpreter_scalars()


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


BACKEND_ENV = "FMOE_KERNEL_BACKEND"
BACKENDS = ("auto", "triton", "torch", "cublas", "deep_gemm")


def kernel_backend() -> str:
    """``FMOE_KERNEL_BACKEND``: ``auto`` (default), ``triton``, ``torch`` (every kernel takes its
    reference), ``cublas`` (dense FP8 GEMMs through cuBLAS where it supports them, the rest through
    Triton) or ``deep_gemm`` (dense GEMMs through deep_gemm, the rest through Triton)."""
    backend = os.environ.get(BACKEND_ENV, "auto")
    if backend not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}: must be one of {BACKENDS}, got {backend!r}")
    return backend


def use_triton(t: torch.Tensor) -> bool:
    """Whether a kernel over ``t`` launches through Triton (else: its plain-torch reference)."""
    return HAS_TRITON and kernel_backend() != "torch" and (t.is_cuda or interpreting())


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; a small number under the interpreter, so that
    persistent kernels still run several tiles per program in the tests."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 3
