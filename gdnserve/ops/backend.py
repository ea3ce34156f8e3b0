"""Which implementation an op runs: Triton on CUDA, PyTorch elsewhere.

``backend="auto"`` picks Triton for CUDA tensors and PyTorch otherwise. ``"triton"`` on CPU
tensors works only under Triton's interpreter (``TRITON_INTERPRET=1`` set before import), which
is how CI exercises the kernels at small sizes.
"""
from __future__ import annotations

import os
from typing import Literal

import torch

Backend = Literal["auto", "torch", "triton"]


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve(backend: Backend, ref: torch.Tensor) -> Literal["torch", "triton"]:
    if backend == "auto":
        return "triton" if ref.is_cuda else "torch"
    if backend == "triton":
        if not ref.is_cuda and not interpreting():
            raise ValueError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before import")
        return "triton"
    if backend == "torch":
        return "torch"
    raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
