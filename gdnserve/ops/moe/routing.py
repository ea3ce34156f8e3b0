"""What the router returns (router.py computes it, router_triton.py on the Triton path): its own module so that
the Triton kernel's module does not import the dispatcher that imports it."""
from __future__ import annotations

from typing import NamedTuple

import torch

from gdnserve.ops.moe.align import Alignment


class Routing(NamedTuple):
    weights: torch.Tensor                # [T, k] in the logits' dtype
    experts: torch.Tensor                # [T, k] expert ids: int32 (Triton) / int64 (PyTorch)
    alignment: Alignment | None          # the grouped GEMM's alignment (Triton path), None on the PyTorch path
