"""Random inputs for GDN op tests: fresh each call, never zeros."""
from __future__ import annotations

import math

import torch

GATE_REGIMES = ("strong", "mild", "slow", "extreme")


def gate_params(HV: int, regime: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A_log, dt_bias such that g = -exp(A_log) softplus(a + dt_bias) lands in the regime
    (strong: Qwen-like A in U(1,16); mild ≈ -0.03; slow ≈ -0.003; extreme: g ≈ -300)."""
    if regime == "strong":
        A_log = torch.log(torch.empty(HV).uniform_(1, 16))
    elif regime == "mild":
        A_log = torch.full((HV,), math.log(0.05)) + 0.1 * torch.randn(HV)
    elif regime == "slow":
        A_log = torch.full((HV,), math.log(0.005)) + 0.1 * torch.randn(HV)
    elif regime == "extreme":
        A_log = torch.full((HV,), math.log(100.0))
    else:
        raise ValueError(regime)
    dt_bias = torch.rand(HV) + (3.0 if regime == "extreme" else 0.0)
    return A_log.float().to(device), dt_bias.float().to(device)


def mixed_gate_params(HV: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A_log, dt_bias of HV value heads, head j in regime GATE_REGIMES[j % 4]: value heads are independent in every
    kernel, so one call covers all regimes (HV >= 4), and any head count (an odd group of value heads) fits."""
    parts = [gate_params(1, GATE_REGIMES[j % len(GATE_REGIMES)], device) for j in range(HV)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def gdn_inputs(T: int, H: int, HV: int, K: int, V: int, dtype: torch.dtype, device, regime: str = "strong"):
    q = torch.randn(T, H, K, device=device).to(dtype)
    k = torch.randn(T, H, K, device=device).to(dtype)
    v = torch.randn(T, HV, V, device=device).to(dtype)
    a = torch.randn(T, HV, device=device).to(dtype)
    b = torch.randn(T, HV, device=device).to(dtype)
    A_log, dt_bias = gate_params(HV, regime, device)
    return q, k, v, a, b, A_log, dt_bias


def random_pool(S: int, HV: int, V: int, K: int, dtype: torch.dtype, device) -> torch.Tensor:
    return (torch.randn(S, HV, V, K, device=device) * 0.5).to(dtype)


def idx(vals, device) -> torch.Tensor:
    return torch.tensor(list(vals), dtype=torch.int32, device=device)
