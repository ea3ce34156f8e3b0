"""The ff7685e kernels of the gated RMSNorm and the q/k norm + rotary (one program per row), kept only for the
old-vs-new timing of ``benchmarks/bench_prefill_ops.py`` (the conv's old tile kernel is still in ops/conv)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdnserve.ops.attention.rope_triton import _reduce_2pi
from gdnserve.ops.launch import launch, pow2
from gdnserve.ops.norm.rmsnorm_triton import warps_for
from gdnserve.ops.norm.rows import row_strides
from gdnserve.ops.tl_compat import cast

_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _gated_rms_norm_row_kernel(x, z, w, out, G, N, sx_t, sx_g, sz_t, sz_g, eps,
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


@triton.jit
def _rms_norm_rope_row_kernel(x, w, positions, inv_freq, out, G, N, sx_t, sx_g, eps,
                          HALF: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t, g = row // G, row % G
    DT = out.dtype.element_ty
    j = tl.arange(0, BLOCK)
    m = j < N
    p_x = x + t * sx_t + g * sx_g
    v = tl.load(p_x + j, mask=m, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(v * v, axis=0) / N + eps)
    y = cast((v * rstd) * (1.0 + tl.load(w + j, mask=m, other=0.0).to(tl.float32)), DT).to(tl.float32)
    rot = j < 2 * HALF
    lo = j < HALF
    pj = tl.where(lo, j + HALF, tl.where(rot, j - HALF, j))
    vp = tl.load(p_x + pj, mask=m, other=0.0).to(tl.float32)
    yp = cast((vp * rstd) * (1.0 + tl.load(w + pj, mask=m, other=0.0).to(tl.float32)), DT).to(tl.float32)
    pos = tl.load(positions + t).to(tl.float32)
    a = _reduce_2pi(pos * tl.load(inv_freq + tl.where(lo, j, j - HALF), mask=rot, other=0.0))
    c = cast(tl.cos(a), DT).to(tl.float32)
    s = cast(tl.sin(a), DT).to(tl.float32)
    yc = cast(y * c, DT).to(tl.float32)
    ys = cast(tl.where(lo, -yp, yp) * s, DT).to(tl.float32)
    res = tl.where(rot, cast(yc + ys, DT), cast(y, DT))
    tl.store(out + row * N + j, res, mask=m)


def gated_rms_norm_per_row(x, z, weight, eps):
    N = x.shape[-1]
    G = 1 if x.dim() == 2 else x.shape[1]
    R = x.numel() // N
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    sx_t, sx_g = row_strides(x)
    sz_t, sz_g = row_strides(z)
    block = max(pow2(N), 16)
    mid = _TL[torch.promote_types(weight.dtype, x.dtype)]
    launch(_gated_rms_norm_row_kernel, (R,), (x, z, weight, out, G, N, sx_t, sx_g, sz_t, sz_g, float(eps), mid,
                                              block), num_warps=warps_for(block))
    return out


def rms_norm_rope_per_row(x, weight, eps, positions, inv_freq):
    T, G, N = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block = max(pow2(N), 16)
    launch(_rms_norm_rope_row_kernel, (T * G,), (x, weight, positions, inv_freq, out, G, N, x.stride(0), x.stride(1),
                                                 float(eps), inv_freq.shape[0], block),
           num_warps=4 if block <= 1024 else 8)
    return out
