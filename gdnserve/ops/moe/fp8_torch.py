"""FP8 routed experts in PyTorch (any device): the dequantizing reference of the grouped Triton kernels' FP8
path, with the same roundings — activations (the gathered x rows, then the intermediate rounded to x's
dtype) quantized per token-group of 128 (``ops/quant/fp8_ref.py``), each expert's block-FP8 weights
dequantized to float32, float32 matmuls, each pair output scaled and rounded to x's dtype, the k pair outputs
summed in float32 and rounded once (float64 throughout for float64 x: the reference). Reads expert counts on the host (as ``torch_path``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gdnserve.ops.moe.torch_path import expert_groups
from gdnserve.ops.quant.fp8_ref import BLOCK, cdiv, dequantize_weight, qdq_act


def dequantize_gate_up(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One expert's (or stacked) gate_up [.., 2I, H] e4m3 with scales [.., 2·ceil(I/128), ceil(H/128)] (gate
    blocks, then up blocks) -> dense [.., 2I, H]."""
    I, SG = q.shape[-2] // 2, cdiv(q.shape[-2] // 2, BLOCK)
    return torch.cat([dequantize_weight(q[..., :I, :], s[..., :SG, :], dtype),
                      dequantize_weight(q[..., I:, :], s[..., SG:, :], dtype)], dim=-2)


def moe_experts_fp8_torch(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w_gate_up: torch.Tensor,
                          w_down: torch.Tensor, s_gate_up: torch.Tensor, s_down: torch.Tensor) -> torch.Tensor:
    I = w_down.shape[2]
    order, token, groups = expert_groups(experts, w_gate_up.shape[0])
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32     # float64: the reference
    pair_w = weights.flatten()[order, None].to(acc)
    xs = qdq_act(x).to(acc).index_select(0, token)
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    for e, sl in groups:
        gu = F.linear(xs[sl], dequantize_gate_up(w_gate_up[e], s_gate_up[e], acc))
        h = (F.silu(gu[:, :I]) * gu[:, I:]).to(x.dtype)
        y = F.linear(qdq_act(h).to(acc), dequantize_weight(w_down[e], s_down[e], acc)) * pair_w[sl]
        out.index_add_(0, token[sl], y.to(x.dtype).to(acc))
    return out.to(x.dtype)
