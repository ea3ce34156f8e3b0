"""Gated RMSNorm in one launch: one program per block of BR (token, value head) rows (a [BR, V] tile: at V = 128
one program per row left the GPU scheduling 131k tiny programs at 4096 tokens).

    n   = round_x(x * rsqrt(mean(x²) + eps))
    m   = round_mid(w * n)                   mid: the promoted dtype of w and x (as torch's ``w * n``)
    out = round_x(m * z / (1 + exp(-z)))     z read in fp32 from its strided view

fp32 arithmetic, rounding exactly where ``gated.gated_rms_norm_torch`` rounds.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdnserve.ops.launch import cdiv, launch, pow2
from gdnserve.ops.norm.rmsnorm import row_strides
from gdnserve.ops.norm.rmsnorm_triton import warps_for
from gdnserve.ops.tl_compat import cast


@triton.jit
def _gated_rms_norm_kernel(x, z, w, out, R, G, N, sx_t, sx_g, sz_t, sz_g, eps,
                           MID: tl.constexpr, BLOCK: tl.constexpr, BR: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    t, g = rows // G, rows % G
    offs = tl.arange(0, BLOCK)
    m_c = offs < N
    m = (rows < R)[:, None] & m_c[None, :]
    v = tl.load(x + (t * sx_t + g * sx_g)[:, None] + offs[None, :], mask=m, other=0.0).to(tl.float32)
    ms = tl.sum(v * v, axis=1) / N
    n = cast(v * tl.math.rsqrt(ms + eps)[:, None], out.dtype.element_ty).to(tl.float32)
    wv = tl.load(w + offs, mask=m_c, other=0.0).to(tl.float32)
    mid = cast(wv[None, :] * n, MID).to(tl.float32)
    zv = tl.load(z + (t * sz_t + g * sz_g)[:, None] + offs[None, :], mask=m, other=0.0).to(tl.float32)
    y = mid * (zv / (1.0 + tl.exp(-zv)))
    tl.store(out + rows[:, None] * N + offs[None, :], cast(y, out.dtype.element_ty), mask=m)


_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def norm_tile(N: int, R: int) -> tuple[int, int]:
    """(BR rows per program, num_warps): ~1024 elements per program (8 rows of 128 on 4 warps), the H200's best
    of 1024 / 2048 / 4096 at every size measured (1 to 8192 tokens: benchmarks/results/prefill_ops_h200.md)."""
    block = max(pow2(N), 16)
    return max(1, min(1024 // block, pow2(R))), warps_for(block)


def gated_rms_norm_triton(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                          tile: tuple[int, int] | None = None) -> torch.Tensor:
    N = x.shape[-1]
    G = 1 if x.dim() == 2 else x.shape[1]
    R = x.numel() // N
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if R:
        sx_t, sx_g = row_strides(x)
        sz_t, sz_g = row_strides(z)
        block = max(pow2(N), 16)
        br, warps = tile or norm_tile(N, R)
        mid = _TL[torch.promote_types(weight.dtype, x.dtype)]
        launch(_gated_rms_norm_kernel, (cdiv(R, br),), (x, z, weight, out, R, G, N, sx_t, sx_g, sz_t, sz_g,
                                                        float(eps), mid, block, br), num_warps=warps)
    return out
