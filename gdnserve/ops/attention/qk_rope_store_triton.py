"""The attention prologue of one step as one launch (issue 29): q RMSNorm + rotary into a contiguous q, k RMSNorm +
rotary and v written straight into their paged-cache slots. Replaces ``rms_norm_rope`` on q, on k and ``store_kv``
(three launches per attention layer). One program per (token, head row): rows 0..QH-1 are q heads, QH..QH+KVH-1
the KV heads. The norm and rotary are ``rope_triton``'s formulas and roundings (module docstring there), on one
row at a time.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdnserve.ops.attention.rope_triton import _reduce_2pi
from gdnserve.ops.launch import launch, pow2
from gdnserve.ops.tl_compat import cast


@triton.jit
def _norm_rope_row(p_x, w, pos, inv_freq, p_o, N, eps, DT: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
                   BH: tl.constexpr):
    j = tl.arange(0, BLOCK)
    m_j = j < N
    v = tl.load(p_x + j, mask=m_j, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(v * v, axis=0) / N + eps)
    y = cast((v * rstd) * (1.0 + tl.load(w + j, mask=m_j, other=0.0).to(tl.float32)), DT)
    tl.store(p_o + j, y, mask=m_j & (j >= 2 * HALF))
    h = tl.arange(0, BH)
    m_h = h < HALF
    v_lo = tl.load(p_x + h, mask=m_h, other=0.0).to(tl.float32)
    v_hi = tl.load(p_x + h + HALF, mask=m_h, other=0.0).to(tl.float32)
    y_lo = cast((v_lo * rstd) * (1.0 + tl.load(w + h, mask=m_h, other=0.0).to(tl.float32)), DT).to(tl.float32)
    y_hi = cast((v_hi * rstd) * (1.0 + tl.load(w + h + HALF, mask=m_h, other=0.0).to(tl.float32)), DT).to(tl.float32)
    a = _reduce_2pi(pos * tl.load(inv_freq + h, mask=m_h, other=0.0).to(tl.float32))
    c = cast(tl.cos(a), DT).to(tl.float32)
    s = cast(tl.sin(a), DT).to(tl.float32)
    o_lo = cast(y_lo * c, DT).to(tl.float32) + cast(-y_hi * s, DT).to(tl.float32)
    o_hi = cast(y_hi * c, DT).to(tl.float32) + cast(y_lo * s, DT).to(tl.float32)
    tl.store(p_o + h, cast(o_lo, DT), mask=m_h)
    tl.store(p_o + h + HALF, cast(o_hi, DT), mask=m_h)


@triton.jit
def qk_rope_store_kernel(q, k, v, wq, wk, positions, inv_freq, q_out, k_cache, v_cache, slot_mapping,
                         s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, eps,
                         QH: tl.constexpr, KVH: tl.constexpr, Dh: tl.constexpr, HALF: tl.constexpr,
                         BLOCK: tl.constexpr, BH: tl.constexpr):
    t, r = tl.program_id(0).to(tl.int64), tl.program_id(1)
    DT = q_out.dtype.element_ty
    pos = tl.load(positions + t).to(tl.float32)
    if r < QH:
        _norm_rope_row(q + t * s_qt + r * s_qh, wq, pos, inv_freq, q_out + (t * QH + r) * Dh, Dh, eps, DT, HALF,
                       BLOCK, BH)
    else:
        hk = r - QH
        slot = tl.load(slot_mapping + t)
        if slot >= 0:
            dst = (slot * KVH + hk) * Dh
            _norm_rope_row(k + t * s_kt + hk * s_kh, wk, pos, inv_freq, k_cache + dst, Dh, eps, DT, HALF, BLOCK, BH)
            o_d = tl.arange(0, BLOCK)
            m_d = o_d < Dh
            tl.store(v_cache + dst + o_d, tl.load(v + t * s_vt + hk * s_vh + o_d, mask=m_d), mask=m_d)


def qk_rope_store_triton(q, k, v, wq, wk, eps, positions, inv_freq, k_cache, v_cache, slot_mapping) -> torch.Tensor:
    """Validated arguments (``qk_rope_store.qk_rope_store``); returns q normed and rotated, [T, QH, Dh] contiguous."""
    T, QH, Dh = q.shape
    KVH = k.shape[1]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if T:
        half = inv_freq.shape[0]
        launch(qk_rope_store_kernel, (T, QH + KVH),
               (q, k, v, wq, wk, positions, inv_freq, out, k_cache, v_cache, slot_mapping, q.stride(0), q.stride(1),
                k.stride(0), k.stride(1), v.stride(0), v.stride(1), float(eps), QH, KVH, Dh, half,
                max(pow2(Dh), 16), max(pow2(half), 1)), num_warps=1 if Dh <= 128 else 2)
    return out
