"""Routed experts as a loop over experts (PyTorch, any device). Rounding follows HF's eager experts: each
matmul in the activation dtype, each expert's output scaled in that dtype and added into an activation-dtype
buffer in ascending expert order (with k > 2 a token's bf16 sum is not associative, so the order matters).

It reads the per-expert counts on the host to split the groups: a sync, and not capturable in a CUDA graph.
The GPU path is ``grouped_triton`` (device-side offsets)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def expert_groups(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, slice]]]:
    """The T*k (token, expert) pairs grouped by expert, token order kept within a group: (order [T*k] into the
    flattened pairs, token [T*k] of each sorted pair, [(expert, slice of the sorted pairs)] for the non-empty
    experts in ascending order). Reads the counts on the host."""
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).cpu().tolist()
    groups, start = [], 0
    for e, n in enumerate(counts):
        if n:
            groups.append((e, slice(start, start + n)))
            start += n
    return order, order // experts.shape[1], groups


def moe_experts_torch(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w_gate_up: torch.Tensor,
                      w_down: torch.Tensor) -> torch.Tensor:
    I = w_down.shape[2]
    order, token, groups = expert_groups(experts, w_gate_up.shape[0])
    pair_w = weights.flatten()[order, None]
    xs = x.index_select(0, token)
    out = torch.zeros_like(x)
    for e, sl in groups:
        gu = F.linear(xs[sl], w_gate_up[e])
        y = F.linear(F.silu(gu[:, :I]) * gu[:, I:], w_down[e]) * pair_w[sl]
        out.index_add_(0, token[sl], y)             # top-k experts are distinct: one add per token per call
    return out
