"""Gated RMSNorm in one launch: one program per block of BR (token, value head) rows (a [BR, V] tile: at V = 128
one program per row left the GPU scheduling 131k tiny programs at 4096 tokens).

    n   = round_x(x * rsqrt(mean(x²) + eps))
    m   = round_mid(w * n)                   mid: the promoted dtype of w and x (as torch's ``w * n``)
    out = round_x(m * z / (1 + exp(-z)))     z read in fp32 from its strided view

fp32 arithmetic, rounding exactly where ``gated.gated_rms_norm_torch`` rounds.

``QUANT`` (``quant=True``): also out as the FP8 linear's input ``[T, G·V]`` quantized per token and group of 128
(out_proj's x), in registers: the [BR, V] tile, whose rows are consecutive in that flat layout, viewed as
[BR·V / 128, 128] groups (``tl_fp8.quant_tile``: ``quantize_act_triton`` bit for bit). Needs V a power of two
(no padded columns; V = 128, the real models': one row is one group) and G·V a multiple of 128 (a token's
groups start at its first head); other shapes quantize by a separate ``quantize_act_triton`` launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdnserve.ops.launch import cdiv, launch, pow2
from gdnserve.ops.norm.rmsnorm_triton import QGROUP, warps_for
from gdnserve.ops.norm.rows import row_strides
from gdnserve.ops.quant.quant_out import empty_quant, quantize_out_triton
from gdnserve.ops.quant.tl_fp8 import quant_tile
from gdnserve.ops.tl_compat import cast


@triton.jit
def _gated_rms_norm_kernel(x, z, w, out, oq, osc, R, G, N, NG, sx_t, sx_g, sz_t, sz_g, eps,
                           MID: tl.constexpr, BLOCK: tl.constexpr, BR: tl.constexpr, QUANT: tl.constexpr):
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
    y = cast(mid * (zv / (1.0 + tl.exp(-zv))), out.dtype.element_ty)
    tl.store(out + rows[:, None] * N + offs[None, :], y, mask=m)
    if QUANT:                                 # BLOCK == N: the tile is BR·N consecutive values, whole groups
        qv, sv = quant_tile(tl.reshape(y.to(tl.float32), (BR * BLOCK // 128, 128)))
        tl.store(oq + rows[:, None] * N + offs[None, :], tl.reshape(qv, (BR, BLOCK)).to(oq.dtype.element_ty),
                 mask=m)
        gi = tl.program_id(0).to(tl.int64) * (BR * BLOCK // 128) + tl.arange(0, BR * BLOCK // 128)
        tl.store(osc + gi, sv, mask=gi < NG)


_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def norm_tile(N: int, R: int) -> tuple[int, int]:
    """(BR rows per program, num_warps): ~1024 elements per program (8 rows of 128 on 4 warps), the H200's best
    of 1024 / 2048 / 4096 at every size measured (1 to 8192 tokens: benchmarks/results/prefill_ops_h200.md)."""
    block = max(pow2(N), 16)
    return max(1, min(1024 // block, pow2(R))), warps_for(block)


def quant_fusable(N: int, G: int) -> bool:
    """Whether the kernel can quantize its [BR, N] tiles as whole groups of the [T, G·N] output (``QUANT``)."""
    return N >= 16 and pow2(N) == N and (G * N) % QGROUP == 0


def gated_rms_norm_triton(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                          tile: tuple[int, int] | None = None, quant: bool = False):
    """``gated.gated_rms_norm``'s output; ``quant``: ``(out, (q [T, G·N], s [T, ceil(G·N / 128)]))``."""
    N = x.shape[-1]
    G = 1 if x.dim() == 2 else x.shape[1]
    R = x.numel() // N
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    fuse = quant and quant_fusable(N, G)
    oq, osc = empty_quant(R // G, G * N, x.device) if fuse else (out, out)
    if R:
        sx_t, sx_g = row_strides(x)
        sz_t, sz_g = row_strides(z)
        block = max(pow2(N), 16)
        br, warps = tile or norm_tile(N, R)
        if fuse:
            br = max(br, QGROUP // N)          # whole groups per tile
        mid = _TL[torch.promote_types(weight.dtype, x.dtype)]
        launch(_gated_rms_norm_kernel, (cdiv(R, br),), (x, z, weight, out, oq, osc, R, G, N, R * N // QGROUP, sx_t,
                                                        sx_g, sz_t, sz_g, float(eps), mid, block, br, fuse),
               num_warps=warps)
    if not quant:
        return out
    return out, ((oq, osc) if fuse else quantize_out_triton(out.view(R // G, G * N)))
