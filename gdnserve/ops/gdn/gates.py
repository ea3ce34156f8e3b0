"""Gate math shared by every GDN path (gdn_kernels.md §1.2 step 6), natural-log base throughout:

    g    = -exp(A_log) * softplus(a + dt_bias)     (softplus(x) = x above 20, as HF/fla/vLLM)
    beta = sigmoid(b)
    q, k <- x * rsqrt(sum(x^2) + 1e-6)               (per head, fp32)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

L2_EPS = 1e-6
SOFTPLUS_THRESHOLD = 20.0


def gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
          dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b: [..., HV] raw projections; A_log, dt_bias: [HV]. Returns (g, beta) in `dtype`."""
    x = a.to(dtype) + dt_bias.to(dtype)
    sp = torch.where(x > SOFTPLUS_THRESHOLD, x, torch.log1p(torch.exp(torch.clamp(x, max=SOFTPLUS_THRESHOLD))))
    g = -torch.exp(A_log.to(dtype)) * sp
    beta = torch.sigmoid(b.to(dtype))
    return g, beta


def l2norm(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    x = x.to(dtype)
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


__all__ = ["gates", "l2norm", "L2_EPS", "SOFTPLUS_THRESHOLD", "F"]
