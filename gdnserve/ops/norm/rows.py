"""The row strides the Triton norms' kernels take (rmsnorm_triton.py, gated_triton.py): its own module so that the
kernels' modules do not import the dispatcher (rmsnorm.py) that imports them."""
from __future__ import annotations

import torch


def row_strides(t: torch.Tensor) -> tuple[int, int]:
    """(stride over T, stride over G) of a [R, N] (G = 1) or [T, G, N] tensor."""
    return (t.stride(0), 0) if t.dim() == 2 else (t.stride(0), t.stride(1))
