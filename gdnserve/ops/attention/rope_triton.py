"""q/k RMSNorm + partial rotary in one launch: one program per (token, head) row of Dh dims.

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

from gdnserve.ops.launch import launch, pow2
from gdnserve.ops.tl_compat import cast


@triton.jit
def _reduce_2pi(a):
    """a - 2πk with k = round(a / 2π), in two steps (2π = C1 + C2, C1 = 6.28125 exact in 8 bits, so k * C1 is
    exact for |a| < 2^16 · 2π): the angle the hardware sin/cos sees stays in [-π, π], where they are accurate."""
    k = tl.floor(a * 0.15915494309189535 + 0.5)
    return (a - k * 6.28125) - k * 0.001935307179586232


@triton.jit
def _rms_norm_rope_kernel(x, w, positions, inv_freq, out, G, N, sx_t, sx_g, eps,
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


def rms_norm_rope_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
                         inv_freq: torch.Tensor) -> torch.Tensor:
    T, G, N = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if T * G:
        block = max(pow2(N), 16)
        launch(_rms_norm_rope_kernel, (T * G,), (x, weight, positions, inv_freq, out, G, N, x.stride(0), x.stride(1),
                                                 float(eps), inv_freq.shape[0], block),
               num_warps=4 if block <= 1024 else 8)
    return out
