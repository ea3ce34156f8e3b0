"""A producer op's optional quantized output (``quant=True`` of ``rms_norm``, ``gated_rms_norm``,
``sigmoid_mul``): its rounded output y as an FP8 linear's input, ``(q [M, K] e4m3, s [M, ceil(K/128)]
float32)``, both contiguous — exactly ``quantize_act_triton(y)`` (the Triton kernels quantize y in their
registers with ``tl_fp8.quant_tile``; these are the other paths' same numbers)."""
from __future__ import annotations

import torch

from gdnserve.ops.quant.fp8_ref import quantize_act


def quantize_out_torch(y2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """y2 [M, K] -> (q, s) by ``fp8_ref.quantize_act`` (the PyTorch backends), bit for bit the Triton kernels'
    numbers: a negative value that rounds to zero becomes +0 as ``quant_tile`` gives it (``+ 0.0``; exact)."""
    q, s = quantize_act(y2)
    return (q.float() + 0.0).to(q.dtype), s


def quantize_out_triton(y2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """y2 [M, K] -> (q, s) by its own launch (a Triton producer whose tile does not hold whole groups)."""
    from gdnserve.ops.quant.fp8_gemm_triton import quantize_act_triton
    return quantize_act_triton(y2)


def empty_quant(M: int, K: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised (q [M, K] e4m3, s [M, ceil(K/128)] float32) for a kernel to fill."""
    return (torch.empty(M, K, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(M, -(-K // 128), dtype=torch.float32, device=device))
