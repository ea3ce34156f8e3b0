"""The routed-experts op: picks the PyTorch loop or the Triton grouped GEMM (ops/backend.py)."""
from __future__ import annotations

import torch

from gdnserve.ops.backend import Backend, resolve
from gdnserve.ops.moe.align import Alignment, align_pairs
from gdnserve.ops.moe.align_triton import MAX_PAIRS, align_pairs_triton
from gdnserve.ops.moe.grouped_triton import block_rows, moe_experts_triton
from gdnserve.ops.moe.torch_path import moe_experts_torch


def moe_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor, backend: Backend = "auto", alignment: Alignment | None = None) -> torch.Tensor:
    """Sum over each token's k experts of ``weights[t, j] * down_e(silu(gate_e x) * up_e x)``.

    x [T, H] (activation dtype); weights [T, k] (x.dtype); experts [T, k] int (distinct per row, in
    [0, E)); w_gate_up [E, 2I, H] rows ``[gate I | up I]``; w_down [E, H, I] -> [T, H] in x.dtype.
    The Triton path reads nothing on the host (CUDA-graph safe); the PyTorch path reads expert counts.
    ``alignment``: the Triton path's grouping of ``experts`` when the caller has it already (the fused router,
    ``router.route``); None = aligned here."""
    if x.dim() != 2 or weights.shape != experts.shape or weights.shape[0] != x.shape[0]:
        raise ValueError(f"moe_experts: x [T, H], weights/experts [T, k]; got {list(x.shape)}, "
                         f"{list(weights.shape)}, {list(experts.shape)}")
    E, I2, H = w_gate_up.shape
    if H != x.shape[1] or w_down.shape != (E, H, I2 // 2):
        raise ValueError(f"moe_experts: w_gate_up {list(w_gate_up.shape)} / w_down {list(w_down.shape)} do not "
                         f"match hidden {x.shape[1]}")
    if w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        raise ValueError(f"moe_experts: expert weights ({w_gate_up.dtype}, {w_down.dtype}) must have x's dtype "
                         f"{x.dtype}")
    if resolve(backend, x) == "torch":
        return moe_experts_torch(x, weights, experts, w_gate_up, w_down)
    if not (w_gate_up.is_contiguous() and w_down.is_contiguous()):   # never copy every expert on every step
        raise ValueError("moe_experts: the Triton path needs contiguous expert weights (make them so at load time)")
    if x.stride(1) != 1:
        x = x.contiguous()
    T, k = experts.shape
    if T == 0:
        return torch.zeros_like(x)
    BM = block_rows(T * k, E)
    if alignment is not None and alignment.BM != BM:
        raise ValueError(f"moe_experts: alignment row block {alignment.BM} != the grouped GEMM's {BM}")
    al = alignment
    if al is None:
        al = align_pairs_triton(experts, E, BM) if T * k <= MAX_PAIRS else align_pairs(experts, E, BM)
    return moe_experts_triton(x, weights.contiguous(), al, w_gate_up, w_down, k)
