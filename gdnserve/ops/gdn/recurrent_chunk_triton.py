"""The chunked (WY-form) recurrent kernel: a request's replayed pending tokens and this call's tokens
(at most 16 positions, the verify case) processed as **one small chunk** with the state tile read once and
written at most once (gdn_kernels.md §2.1 with the chunk = those tokens).

Positions: ``0..P0-1`` hold the pending tokens of ``pending_in_rows[n]`` (positions ``>= num_pending[n]`` are
the identity: g = 0, beta = 0, k = 0), ``P0..P0+L-1`` the call's tokens, the rest padding (identity). With
``gamma`` the inclusive cumsum of g over positions, ``Gamma = exp(gamma)``, in the pool's tile layout
``St = S^T [BV, BK]`` (rows i, m are positions):

    A[i, m]  = beta_i exp(gamma_i - gamma_m) (k_i . k_m)       m < i      T = (I + A)^-1
    Ut       = (Vt diag(beta) - (St0 K^T) diag(beta Gamma)) T^T          (the per-token writes u_m)
    St_p     = exp(gamma_{p-1}) St0 + (Ut diag(exp(gamma_{p-1} - gamma_m) [m < p])) K
    Ot       = (St0 Q^T) diag(Gamma) + Ut M^T,  M[i, m] = exp(gamma_i - gamma_m) (q_i . k_m) [m <= i]

so every reduction along K is one small matrix product (``St0 K^T``, ``St0 Q^T``, ``K K^T``, ``Q K^T``,
``Ut' K``) instead of two per token, and every exponent is of a non-positive number. ``T`` is the product
form ``prod_j (I + (-A)^(2^j))`` (A is nilpotent: ``NF`` factors cover ``2^NF >= P0 + L`` positions).
The state products use ``PREC`` (``tf32x3`` on the GPU: fp32-level error on tensor cores; ``ieee`` under
the interpreter); the 16x16 products are IEEE.
"""
from __future__ import annotations

import triton
import triton.language as tl

from gdnserve.ops.gdn.recurrent_jit import L2_EPS, _STRIDES, _decay
from gdnserve.ops.tl_compat import cast, mma


@triton.jit
def _rows_l2norm(b_x):
    return b_x * tl.math.rsqrt(tl.sum(b_x * b_x, 1) + L2_EPS)[:, None]


@triton.jit(do_not_specialize=_STRIDES)
def gdn_recurrent_chunk_kernel(
    q, k, v, a, b, A_log, dt_bias, o, pool, slots,
    pk, pv, pa, pb, pending_in_rows, num_pending, pending_out_rows,
    scale,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_at, s_bt, s_ot, s_oh,
    L: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    LP: tl.constexpr, P0: tl.constexpr, NC: tl.constexpr, NF: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PENDING_IN: tl.constexpr, PENDING_OUT: tl.constexpr, PW: tl.constexpr, WRITE_AFTER_PENDING: tl.constexpr,
    PREC: tl.constexpr,
):
    i_v, i_hv, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_c = tl.arange(0, NC)
    mask_k = o_k < K
    mask_v = o_v < V
    mask_h = mask_v[:, None] & mask_k[None, :]
    bos = i_n.to(tl.int64) * L
    is_new = (o_c >= P0) & (o_c < P0 + L)
    i_t = bos + tl.where(is_new, o_c - P0, 0)                       # token row of each new position
    p_o = o + i_t[None, :] * s_ot + i_hv * s_oh + o_v[:, None]      # [BV, NC]
    mask_o = (mask_v[:, None] & is_new[None, :]) != 0

    slot = tl.load(slots + i_n).to(tl.int64)
    if slot < 0:  # padding row: zero outputs, touch nothing else
        tl.store(p_o, tl.zeros([BV, NC], dtype=o.dtype.element_ty), mask=mask_o)
        return

    o_h = i_hv * (V * K) + o_v[:, None] * K + o_k[None, :]
    p_h = pool + slot * (HV * V * K) + o_h
    b_h = tl.load(p_h, mask=mask_h, other=0).to(tl.float32)
    b_A = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    b_dt = tl.load(dt_bias + i_hv).to(tl.float32)

    # the call's tokens, raw (stored as pending below) and as fp32 operands
    m_new_k = (is_new[:, None] & mask_k[None, :]) != 0
    m_new_v = (mask_v[:, None] & is_new[None, :]) != 0
    b_kr = tl.load(k + i_t[:, None] * s_kt + i_h * s_kh + o_k[None, :], mask=m_new_k, other=0)     # [NC, BK]
    b_qr = tl.load(q + i_t[:, None] * s_qt + i_h * s_qh + o_k[None, :], mask=m_new_k, other=0)
    b_vr = tl.load(v + i_t[None, :] * s_vt + i_hv * s_vh + o_v[:, None], mask=m_new_v, other=0)   # [BV, NC]
    b_ar = tl.load(a + i_t * s_at + i_hv, mask=is_new, other=0)
    b_br = tl.load(b + i_t * s_bt + i_hv, mask=is_new, other=0)
    b_k = b_kr.to(tl.float32)
    b_vt = b_vr.to(tl.float32)
    b_af = b_ar.to(tl.float32)
    b_bf = b_br.to(tl.float32)
    live = is_new
    if PENDING_IN:
        i_pin = tl.load(pending_in_rows + i_n)
        n_pend = tl.where(i_pin >= 0, tl.load(num_pending + i_n), 0)
        is_pend = (o_c < n_pend) & (o_c < P0)
        i_pt = tl.maximum(i_pin, 0).to(tl.int64) * LP + tl.where(is_pend, o_c, 0)
        m_p_k = (is_pend[:, None] & mask_k[None, :]) != 0
        m_p_v = (mask_v[:, None] & is_pend[None, :]) != 0
        b_k += tl.load(pk + (i_pt[:, None] * H + i_h) * K + o_k[None, :], mask=m_p_k, other=0).to(tl.float32)
        b_vt += tl.load(pv + (i_pt[None, :] * HV + i_hv) * V + o_v[:, None], mask=m_p_v, other=0).to(tl.float32)
        b_af += tl.load(pa + i_pt * HV + i_hv, mask=is_pend, other=0).to(tl.float32)
        b_bf += tl.load(pb + i_pt * HV + i_hv, mask=is_pend, other=0).to(tl.float32)
        live = live | is_pend
    if PENDING_OUT:
        # raw-input copies, as the sequential kernel: v from every program, a/b from the V-tile-0 program of
        # each value head, k from the first head of the group
        i_pout = tl.load(pending_out_rows + i_n).to(tl.int64)
        own_v = i_pout >= 0
        own_ab = own_v & (i_v == 0)
        own_k = own_ab & (i_hv % (HV // H) == 0)
        i_po = i_pout * LP + tl.where(is_new, o_c - P0, 0)
        tl.store(pk + (i_po[:, None] * H + i_h) * K + o_k[None, :], b_kr, mask=(m_new_k & own_k) != 0)
        tl.store(pv + (i_po[None, :] * HV + i_hv) * V + o_v[:, None], b_vr, mask=(m_new_v & own_v) != 0)
        tl.store(pa + i_po * HV + i_hv, b_ar, mask=(is_new & own_ab) != 0)
        tl.store(pb + i_po * HV + i_hv, b_br, mask=(is_new & own_ab) != 0)

    b_g = tl.where(live, _decay(b_af, b_dt, b_A), 0.)
    b_beta = tl.where(live, tl.sigmoid(b_bf), 0.)
    b_gc = tl.cumsum(b_g, 0)                                          # gamma, inclusive, non-increasing
    b_k = _rows_l2norm(b_k)
    # d_g[i, m] = gamma_i - gamma_m = sum of g over (m, i], summed from the g themselves (a difference of
    # two cumsums would cancel: at |gamma| ~ 1e3 the fp32 ulp is 1e-4, a relative error of every decay)
    d_g = mma(tl.where(o_c[None, :] <= o_c[:, None], b_g[None, :], 0.),
              tl.where(o_c[:, None] > o_c[None, :], 1., 0.), "ieee")
    lower = o_c[None, :] < o_c[:, None]
    # T = (I + A)^-1 = prod_j (I + X^(2^j)), X = -A
    b_x = -tl.where(lower, b_beta[:, None] * tl.exp(tl.where(lower, d_g, 0.)) * mma(b_k, tl.trans(b_k), PREC), 0.)
    b_t = tl.where(o_c[:, None] == o_c[None, :], 1., 0.) + b_x
    for _ in tl.static_range(1, NF):
        b_x = mma(b_x, b_x, "ieee")
        b_t = b_t + mma(b_t, b_x, "ieee")
    # u_m = T (beta v - beta Gamma S0^T k), in the tile layout [BV, NC]
    b_gam = tl.exp(b_gc)
    b_ut = b_vt * b_beta[None, :] - mma(b_h, tl.trans(b_k), PREC) * (b_beta * b_gam)[None, :]
    b_ut = mma(b_ut, tl.trans(b_t), PREC)

    if L > 0:
        b_q = _rows_l2norm(b_qr.to(tl.float32)) * scale
        incl = o_c[None, :] <= o_c[:, None]
        b_m = tl.where(incl, tl.exp(tl.where(incl, d_g, 0.)) * mma(b_q, tl.trans(b_k), PREC), 0.)
        b_ot = mma(b_h, tl.trans(b_q), PREC) * b_gam[None, :] + mma(b_ut, tl.trans(b_m), PREC)
        tl.store(p_o, cast(b_ot, o.dtype.element_ty), mask=mask_o)

    if PW > 0:  # write the state after position PW - 1 (P0: after the pending tokens; P0 + L: final)
        b_gp = tl.sum(tl.where(o_c == PW - 1, b_gc, 0.), 0)                  # gamma_{PW-1}
        b_dp = tl.sum(tl.where(o_c[:, None] == PW - 1, d_g, 0.), 0)          # gamma_{PW-1} - gamma_m
        b_w = tl.where(o_c < PW, tl.exp(tl.where(o_c < PW, b_dp, 0.)), 0.)
        b_s = b_h * tl.exp(b_gp) + mma(b_ut * b_w[None, :], b_k, PREC)
        if WRITE_AFTER_PENDING:
            if n_pend > 0:  # nothing applied: the slot already holds this state bit for bit
                tl.store(p_h, cast(b_s, pool.dtype.element_ty), mask=mask_h)
        else:
            tl.store(p_h, cast(b_s, pool.dtype.element_ty), mask=mask_h)
