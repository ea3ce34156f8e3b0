"""Argument validation for the public op functions: run once per call, on the host, from
shapes/dtypes/strides only (never from tensor contents, so it is safe under CUDA-graph capture)."""
from __future__ import annotations

from typing import Sequence

import torch

INDEX_DTYPE = torch.int32
_INDEX_DTYPES = (INDEX_DTYPE,)


def check_tensor(name: str, t: torch.Tensor | None, shape: Sequence[int | None], dtypes: Sequence[torch.dtype],
                 device: torch.device | None = None, last_contiguous: bool = True) -> None:
    """Raise ValueError naming `name` unless `t` has `shape` (None = any), a dtype in `dtypes`,
    lives on `device` and has unit stride in its last dim."""
    if _fits(t, shape, dtypes, device, last_contiguous):   # the common case, kept cheap (host cost per call)
        return
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if last_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: last dim must have stride 1, got strides {t.stride()}")


def _fits(t, shape, dtypes, device, last_contiguous) -> bool:
    if type(t) is not torch.Tensor or t.dtype not in dtypes:
        return False
    ts = t.shape
    if len(ts) != len(shape):
        return False
    for s, d in zip(shape, ts):
        if s is not None and s != d:
            return False
    if device is not None and t.device != device:
        return False
    return not last_contiguous or not ts or ts[-1] <= 1 or t.stride(-1) == 1


def check_index(name: str, t: torch.Tensor | None, n: int | None, device: torch.device) -> None:
    """An int32 index vector of length n (slot ids, rows, counts)."""
    check_tensor(name, t, (n,), _INDEX_DTYPES, device)
    if t.dim() == 1 and t.numel() > 1 and t.stride(0) != 1:
        raise ValueError(f"{name}: must be contiguous")


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous, got strides {t.stride()} for shape {list(t.shape)}")


ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
STATE_DTYPES = (torch.float32, torch.bfloat16)
