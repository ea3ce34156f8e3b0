"""Residual add + zero-centred RMSNorm in one launch: one program per row (a [T, G, N] input has T·G rows).

    s = round(x + residual)            stored (the residual stream), then read back from registers
    y = round(s * rsqrt(mean(s²) + eps) * (1 + w))

fp32 arithmetic, rounding exactly where ``rmsnorm.rms_norm_torch`` rounds.

``QUANT`` (``quant=True``): also the FP8 linear's input, y quantized per row and group of 128 columns in
registers (the row viewed as [BLOCK / 128, 128]; N not a multiple of 128: the last group partial, its masked
entries 0; N <= 64: one group of BLOCK) with ``tl_fp8.quant_tile``: ``quantize_act_triton(y)`` bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdnserve.ops.launch import launch, pow2
from gdnserve.ops.norm.rows import row_strides
from gdnserve.ops.quant.fp8_ref import BLOCK as QGROUP        # the FP8 activation group (128 columns)
from gdnserve.ops.quant.quant_out import empty_quant
from gdnserve.ops.quant.tl_fp8 import quant_tile
from gdnserve.ops.tl_compat import cast


@triton.jit
def _add_rms_norm_kernel(x, res, w, y, s_out, yq, ys, G, N, SG, sx_t, sx_g, sr_t, sr_g, eps,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t, g = row // G, row % G
    offs = tl.arange(0, BLOCK)
    m = offs < N
    v = tl.load(x + t * sx_t + g * sx_g + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res + t * sr_t + g * sr_g + offs, mask=m, other=0.0).to(tl.float32)
        sv = cast(v + r, s_out.dtype.element_ty)
        tl.store(s_out + row * N + offs, sv, mask=m)
        v = sv.to(tl.float32)
    ms = tl.sum(v * v, axis=0) / N
    rstd = tl.math.rsqrt(ms + eps)
    wv = tl.load(w + offs, mask=m, other=0.0).to(tl.float32)
    out = cast((v * rstd) * (1.0 + wv), y.dtype.element_ty)
    tl.store(y + row * N + offs, out, mask=m)
    if QUANT:                                 # y as rounded, [BLOCK / GROUP, GROUP] groups (masked entries 0)
        qv, sv = quant_tile(tl.reshape(out.to(tl.float32), (BLOCK // GROUP, GROUP)))
        tl.store(yq + row * N + offs, tl.reshape(qv, (BLOCK,)).to(yq.dtype.element_ty), mask=m)
        gi = tl.arange(0, BLOCK // GROUP)
        tl.store(ys + row * SG + gi, sv, mask=gi < SG)


def warps_for(block: int) -> int:
    return 4 if block <= 1024 else (8 if block <= 4096 else 16)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                    quant: bool = False) -> torch.Tensor | tuple:
    """``rmsnorm.rms_norm``'s results; ``quant``: with ``(q [R, N], s [R, ceil(N/128)])`` appended."""
    N = x.shape[-1]
    G = 1 if x.dim() == 2 else x.shape[1]
    R = x.numel() // N
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = None if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    yq, ys = empty_quant(R, N, x.device) if quant else (y, y)
    if R:
        sx_t, sx_g = row_strides(x)
        sr_t, sr_g = (0, 0) if residual is None else row_strides(residual)
        block = max(pow2(N), 16)
        launch(_add_rms_norm_kernel, (R,), (x, residual, weight, y, s, yq, ys, G, N, -(-N // QGROUP), sx_t, sx_g,
                                            sr_t, sr_g, float(eps), residual is not None, block, quant,
                                            min(block, QGROUP)), num_warps=warps_for(block))
    out = (y,) if residual is None else (y, s)
    if quant:
        out += ((yq, ys),)
    return out[0] if len(out) == 1 else out
