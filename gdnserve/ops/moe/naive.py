"""Float64 reference for the routed experts: one (token, expert) pair at a time."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_moe_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w_gate_up: torch.Tensor,
                      w_down: torch.Tensor) -> torch.Tensor:
    """x [T, H], weights/experts [T, k], w_gate_up [E, 2I, H] (rows gate | up), w_down [E, H, I] -> float64 [T, H]."""
    x, w, gu, dn = x.double(), weights.double(), w_gate_up.double(), w_down.double()
    I = w_down.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            h = gu[e] @ x[t]
            out[t] += w[t, j] * (dn[e] @ (F.silu(h[:I]) * h[I:]))
    return out
