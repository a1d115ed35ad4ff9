"""fmoe.memory measures a peak that a freed tensor leaves behind, and a reset forgets it."""

import pytest
import torch

from fmoe import memory

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not memory.can_measure(CPU), reason="needs Linux /proc")


def test_a_freed_tensor_raises_the_peak_and_a_reset_forgets_it():
    size = 256 * 2**20  # far above the noise of a Python process's own allocations
    base = memory.reset_peak(CPU)
    x = torch.ones(size, dtype=torch.uint8)
    del x
    peak = memory.peak_bytes(CPU)
    # other pages of the process may be returned between the reset and the tensor (a full test
    # session frees caches as it goes): the peak is the tensor's bytes, less what was returned
    assert peak - base >= size * 15 // 16
    base = memory.reset_peak(CPU)
    assert memory.peak_bytes(CPU) - base < size // 4
