"""The GPU suite: runs where CUDA is, skipped (with the reason) everywhere else.

    python -m pytest tests/gpu -v

Each module sets ``pytestmark = needs_cuda``. The numbers ``test_bench`` produces belong in
docs/model.md with the GPU's name.
"""

from __future__ import annotations

import pytest
import torch

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU suite; CPU runs skip it)"
)


@pytest.fixture(autouse=True)
def _exact_float32_matmuls() -> None:
    """float32 comparisons need float32 products: TF32 would round the inputs to 10 bits."""
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
