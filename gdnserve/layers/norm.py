"""RMSNorms of the Qwen3-Next / Qwen3.5 family (HF modeling files are the reference)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm of the decoder and q/k norms: y = x / rms(x) * (1 + w), in fp32, cast back."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """The GDN output norm, norm before gate, plain weight: y = w * (x / rms(x)) * silu(z).
    Rounding as HF: normalise in fp32, round to the input dtype, multiply by w, then by silu(z) in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(dt)
        y = self.weight * y
        return (y * F.silu(z.float())).to(dt)
