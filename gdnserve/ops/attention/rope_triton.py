"""q/k RMSNorm + partial rotary in one launch: one program per block of BR (token, head) rows of Dh dims (a [BR, Dh]
tile for the mean square and the unrotated dims, [BR, R/2] tiles for the two rotated halves: no gather).

    y_j  = round(x_j * rsqrt(mean(x²) + eps) * (1 + w_j))               the zero-centred norm (rms_norm)
    a_j  = position * inv_freq[j mod R/2],  c_j = round(cos a_j),  s_j = round(sin a_j)     for j < R
                                                   (a_j reduced to [-π, π] first: see _reduce_2pi)
    out_j = round(round(y_j * c_j) + round(sign_j * y_p(j) * s_j))     j < R: rotate-half partner p(j) = j ± R/2,
    out_j = y_j                                                        j >= R       sign -1 below R/2, +1 above

fp32 arithmetic, rounding where ``rope.rms_norm_rope``'s PyTorch path rounds.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdnserve.ops.launch import cdiv, launch, pow2
from gdnserve.ops.tl_compat import cast


@triton.jit
def _reduce_2pi(a):
    """a - 2πk with k = round(a / 2π), in two steps (2π = C1 + C2, C1 = 6.28125 exact in 8 bits, so k * C1 is
    exact for |a| < 2^16 · 2π): the angle the hardware sin/cos sees stays in [-π, π], where they are accurate."""
    k = tl.floor(a * 0.15915494309189535 + 0.5)
    return (a - k * 6.28125) - k * 0.001935307179586232


@triton.jit
def _rms_norm_rope_kernel(x, w, positions, inv_freq, out, R, G, N, sx_t, sx_g, eps,
                          HALF: tl.constexpr, BLOCK: tl.constexpr, BH: tl.constexpr, BR: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m_r = rows < R
    t, g = rows // G, rows % G
    DT = out.dtype.element_ty
    p_x = x + t * sx_t + g * sx_g                                       # [BR] row starts
    p_o = out + rows * N
    j = tl.arange(0, BLOCK)
    m_j = j < N
    v = tl.load(p_x[:, None] + j[None, :], mask=m_r[:, None] & m_j[None, :], other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(v * v, axis=1) / N + eps)
    y = cast((v * rstd[:, None]) * (1.0 + tl.load(w + j, mask=m_j, other=0.0).to(tl.float32))[None, :], DT)
    tl.store(p_o[:, None] + j[None, :], y, mask=m_r[:, None] & (m_j & (j >= 2 * HALF))[None, :])
    # the rotated dims: the two halves [0, HALF) and [HALF, 2 HALF) as their own tiles (L1 hits)
    h = tl.arange(0, BH)
    m_h = h < HALF
    m = m_r[:, None] & m_h[None, :]
    v_lo = tl.load(p_x[:, None] + h[None, :], mask=m, other=0.0).to(tl.float32)
    v_hi = tl.load(p_x[:, None] + (h + HALF)[None, :], mask=m, other=0.0).to(tl.float32)
    w_lo = 1.0 + tl.load(w + h, mask=m_h, other=0.0).to(tl.float32)
    w_hi = 1.0 + tl.load(w + h + HALF, mask=m_h, other=0.0).to(tl.float32)
    y_lo = cast((v_lo * rstd[:, None]) * w_lo[None, :], DT).to(tl.float32)
    y_hi = cast((v_hi * rstd[:, None]) * w_hi[None, :], DT).to(tl.float32)
    pos = tl.load(positions + t, mask=m_r, other=0).to(tl.float32)
    a = _reduce_2pi(pos[:, None] * tl.load(inv_freq + h, mask=m_h, other=0.0).to(tl.float32)[None, :])
    c = cast(tl.cos(a), DT).to(tl.float32)
    s = cast(tl.sin(a), DT).to(tl.float32)
    o_lo = cast(y_lo * c, DT).to(tl.float32) + cast(-y_hi * s, DT).to(tl.float32)
    o_hi = cast(y_hi * c, DT).to(tl.float32) + cast(y_lo * s, DT).to(tl.float32)
    tl.store(p_o[:, None] + h[None, :], cast(o_lo, DT), mask=m)
    tl.store(p_o[:, None] + (h + HALF)[None, :], cast(o_hi, DT), mask=m)


def rope_tile(N: int, R: int) -> tuple[int, int]:
    """(BR rows per program, num_warps) on 4 warps: ~1024 elements of the [BR, Dh] tile per program below 65536
    rows, 2048 from there (the H200's best of 1024 / 2048 / 4096 per size: benchmarks/results/prefill_ops_h200.md)."""
    block = max(pow2(N), 16)
    per = 2048 if R >= 65536 else 1024
    return max(1, min(per // block, pow2(R))), 4 if block <= 1024 else 8


def rms_norm_rope_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
                         inv_freq: torch.Tensor, tile: tuple[int, int] | None = None) -> torch.Tensor:
    T, G, N = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    R = T * G
    if R:
        half = inv_freq.shape[0]
        br, warps = tile or rope_tile(N, R)
        launch(_rms_norm_rope_kernel, (cdiv(R, br),), (x, weight, positions, inv_freq, out, R, G, N, x.stride(0),
                                                       x.stride(1), float(eps), half, max(pow2(N), 16),
                                                       max(pow2(half), 1), br), num_warps=warps)
    return out
