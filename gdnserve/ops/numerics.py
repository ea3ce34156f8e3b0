"""Error metrics shared by tests and benchmarks (gdn_kernels.md §6.4 uses relative RMS)."""
from __future__ import annotations

import torch


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖₂ / ‖ref‖₂ in float64; inf if x has a non-finite value."""
    x64, r64 = x.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(x64).all():
        return float("inf")
    den = r64.norm().item()
    num = (x64 - r64).norm().item()
    return num / den if den > 0 else num


def max_abs(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (x.detach().double().cpu() - ref.detach().double().cpu()).abs().max().item() if x.numel() else 0.0
