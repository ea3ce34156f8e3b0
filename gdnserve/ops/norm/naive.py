"""Float64 references of the norms in this package (what the kernels are tested against)."""
from __future__ import annotations

import torch


def naive_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (float64 ``s / rms(s) * (1 + w)``, s) with ``s = x + residual`` rounded to x's dtype (the residual
    stream is stored in the activation dtype, so the reference starts from the same rounded sum)."""
    s = x if residual is None else (x.double() + residual.double()).to(x.dtype)
    sd = s.double()
    y = sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.double())
    return y, s


def naive_gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """float64 ``w * (x / rms(x)) * silu(z)`` over the last dim, no intermediate rounding."""
    xd, zd = x.double(), z.double()
    y = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    return y * zd * torch.sigmoid(zd)
