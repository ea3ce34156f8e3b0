"""Gated RMSNorm in one launch: one program per (token, value head) row.

    n   = round_x(x * rsqrt(mean(x²) + eps))
    m   = round_mid(w * n)                   mid: the promoted dtype of w and x (as torch's ``w * n``)
    out = round_x(m * z / (1 + exp(-z)))     z read in fp32 from its strided view

fp32 arithmetic, rounding exactly where ``gated.gated_rms_norm_torch`` rounds.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdnserve.ops.launch import launch, pow2
from gdnserve.ops.norm.rmsnorm import row_strides
from gdnserve.ops.norm.rmsnorm_triton import warps_for
from gdnserve.ops.tl_compat import cast


@triton.jit
def _gated_rms_norm_kernel(x, z, w, out, G, N, sx_t, sx_g, sz_t, sz_g, eps,
                           MID: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t, g = row // G, row % G
    offs = tl.arange(0, BLOCK)
    m = offs < N
    v = tl.load(x + t * sx_t + g * sx_g + offs, mask=m, other=0.0).to(tl.float32)
    ms = tl.sum(v * v, axis=0) / N
    n = cast(v * tl.math.rsqrt(ms + eps), out.dtype.element_ty).to(tl.float32)
    wv = tl.load(w + offs, mask=m, other=0.0).to(tl.float32)
    mid = cast(wv * n, MID).to(tl.float32)
    zv = tl.load(z + t * sz_t + g * sz_g + offs, mask=m, other=0.0).to(tl.float32)
    y = mid * (zv / (1.0 + tl.exp(-zv)))
    tl.store(out + row * N + offs, cast(y, out.dtype.element_ty), mask=m)


_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def gated_rms_norm_triton(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    N = x.shape[-1]
    G = 1 if x.dim() == 2 else x.shape[1]
    R = x.numel() // N
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if R:
        sx_t, sx_g = row_strides(x)
        sz_t, sz_g = row_strides(z)
        block = max(pow2(N), 16)
        mid = _TL[torch.promote_types(weight.dtype, x.dtype)]
        launch(_gated_rms_norm_kernel, (R,), (x, z, weight, out, G, N, sx_t, sx_g, sz_t, sz_g, float(eps), mid,
                                              block), num_warps=warps_for(block))
    return out
