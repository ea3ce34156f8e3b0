"""The whole GDN decode chain of one layer as one launch (issue 29): from the in-projection's output row to
out_proj's input row, for one token per request.

One program owns (value head j, request n) with the whole [V, K] fp32 state tile in registers. It
  1. reads q, k (key head i = j // r), v (head j), z, a, b in place from the in_proj row (strided views);
  2. runs the causal conv update on its q, k, v channels (window = the slot's W-1 history rows + x), SiLU,
     rounded to the activation dtype as ``conv_update`` rounds its output;
  3. g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), l2-normalises q (times scale) and k, does the
     delta-rule update of the slot's state in place and o = St q̂, rounded to the activation dtype as the
     recurrent kernel's ``out``;
  4. applies the gated RMSNorm (``gated_triton``'s roundings) and writes y, optionally its FP8 quantization
     for out_proj (V a multiple of 128 and a power of two: whole 128-groups per head).

The v channels' conv history belongs to this program alone and is written in place after it is read. The q/k
channels' history is read by the r programs of the key head's value heads: the last of them to finish (an
atomic counter per (slot, key head), reset to 0 by that program, so a graph replay finds it at 0) writes the
shifted history, after every reader has read it. A padded request (slot -1) writes zeros and touches no state.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from gdnserve.ops.gdn.recurrent_jit import _decay, _delta_step, _l2norm
from gdnserve.ops.launch import launch, pow2
from gdnserve.ops.quant.tl_fp8 import quant_tile
from gdnserve.ops.tl_compat import cast


@triton.jit
def _conv_window(x_row, conv_w, p_hist, o_c, mask_c, D: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
                 ACT: tl.constexpr):
    """(silu(conv) rounded to ACT as fp32 [BC], the new history tile [WP, BC] (rows 0..W-2 valid)) of channels
    o_c; p_hist points at the slot's history row 0 (+ o_c added here)."""
    o_w = tl.arange(0, WP)
    b_x = tl.load(x_row + o_c, mask=mask_c, other=0.)
    m_h = (o_w[:, None] < W - 1) & mask_c[None, :]
    b_hist = tl.load(p_hist + o_w[:, None] * D + o_c[None, :], mask=m_h, other=0.)
    b_win = tl.where(o_w[:, None] == W - 1, b_x[None, :].to(b_hist.dtype), b_hist)
    b_wt = tl.load(conv_w + o_c[None, :] * W + o_w[:, None], mask=(o_w[:, None] < W) & mask_c[None, :],
                   other=0.).to(tl.float32)
    b_acc = tl.sum(b_win.to(tl.float32) * b_wt, 0)
    b_acc = b_acc * tl.sigmoid(b_acc)
    # the new history: row w <- old row w+1 (the last one <- x)
    m_s = (o_w[:, None] + 1 < W - 1) & mask_c[None, :]
    b_next = tl.load(p_hist + (o_w[:, None] + 1) * D + o_c[None, :], mask=m_s, other=0.)
    b_next = tl.where(o_w[:, None] == W - 2, b_x[None, :].to(b_hist.dtype), b_next)
    return cast(b_acc, ACT).to(tl.float32), b_next


@triton.jit
def _norm_out(b_o, row, norm_w, y, oq, osc, i_n, i_hv, eps, o_v, mask_v, D: tl.constexpr, HV: tl.constexpr,
              V: tl.constexpr, VP: tl.constexpr, MID: tl.constexpr, QUANT: tl.constexpr):
    """The gated RMSNorm (``gated_triton``'s roundings) of one head's whole rounded o row [VP] (fp32, 0 past V);
    stores y and, with QUANT, its FP8 groups (V a power-of-two multiple of 128: V // 128 whole groups)."""
    ACT = y.dtype.element_ty
    ms = tl.sum(b_o * b_o, 0) / V
    b_n = cast(b_o * tl.math.rsqrt(ms + eps), ACT).to(tl.float32)
    b_w = tl.load(norm_w + o_v, mask=mask_v, other=0.).to(tl.float32)
    b_mid = cast(b_w * b_n, MID).to(tl.float32)
    b_z = tl.load(row + D + i_hv * V + o_v, mask=mask_v, other=0.).to(tl.float32)
    b_y = cast(b_mid * (b_z / (1.0 + tl.exp(-b_z))), ACT)
    tl.store(y + i_n.to(tl.int64) * (HV * V) + i_hv * V + o_v, b_y, mask=mask_v)
    if QUANT:
        qv, sv = quant_tile(tl.reshape(b_y.to(tl.float32), (VP // 128, 128)))
        tl.store(oq + i_n.to(tl.int64) * (HV * V) + i_hv * V + o_v, tl.reshape(qv, (VP,)).to(oq.dtype.element_ty))
        tl.store(osc + i_n.to(tl.int64) * ((HV * V) // 128) + i_hv * (V // 128) + tl.arange(0, VP // 128), sv)


@triton.jit
def gdn_decode_fused_kernel(
    proj, conv_w, conv_pool, A_log, dt_bias, pool, slots, norm_w, y, oq, osc, counters,
    s_p, scale, eps,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, NT: tl.constexpr, MID: tl.constexpr, QUANT: tl.constexpr,
):
    i_t, i_hv, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    R: tl.constexpr = HV // H
    VP: tl.constexpr = BV * NT       # pow2(V)
    i_h = i_hv // R
    D: tl.constexpr = 2 * H * K + HV * V
    o_k = tl.arange(0, BK)
    o_v = i_t * BV + tl.arange(0, BV)
    o_vr = tl.arange(0, VP)          # a whole head row (the norm)
    mask_k = o_k < K
    mask_v = o_v < V
    ACT = y.dtype.element_ty
    row = proj + i_n.to(tl.int64) * s_p

    slot = tl.load(slots + i_n).to(tl.int64)
    if slot < 0:  # padding row: zero outputs (the V-tile-0 program), no state traffic
        if i_t == 0:
            _norm_out(tl.zeros([VP], dtype=tl.float32), row, norm_w, y, oq, osc, i_n, i_hv, eps, o_vr,
                      (o_vr < 0) != 0, D, HV, V, VP, MID, QUANT)
            tl.store(y + i_n.to(tl.int64) * (HV * V) + i_hv * V + o_vr, tl.zeros([VP], dtype=ACT), mask=o_vr < V)
        return

    p_hist = conv_pool + slot * ((W - 1) * D)
    o_q = i_h * K + o_k
    o_kc = H * K + i_h * K + o_k
    o_vc = 2 * H * K + i_hv * V + o_v
    b_q, n_q = _conv_window(row, conv_w, p_hist, o_q, mask_k, D, W, WP, ACT)
    b_k, n_k = _conv_window(row, conv_w, p_hist, o_kc, mask_k, D, W, WP, ACT)
    b_v, n_v = _conv_window(row, conv_w, p_hist, o_vc, mask_v, D, W, WP, ACT)
    o_w = tl.arange(0, WP)
    # the v channels are this program's alone: every thread has read them (barrier), then overwrite
    tl.debug_barrier()
    tl.store(p_hist + o_w[:, None] * D + o_vc[None, :], n_v, mask=(o_w[:, None] < W - 1) & mask_v[None, :])

    b_br = tl.load(row + D + HV * V + i_hv)                     # columns [x | z | b | a]
    b_ar = tl.load(row + D + HV * V + HV + i_hv)
    b_A = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    b_dt = tl.load(dt_bias + i_hv).to(tl.float32)
    b_g = _decay(b_ar.to(tl.float32), b_dt, b_A)
    b_beta = tl.sigmoid(b_br.to(tl.float32))

    mask_h = mask_v[:, None] & mask_k[None, :]
    p_h = pool + slot * (HV * V * K) + i_hv * (V * K) + o_v[:, None] * K + o_k[None, :]
    b_h = tl.load(p_h, mask=mask_h, other=0).to(tl.float32)
    b_h = _delta_step(b_h, _l2norm(b_k), b_v, b_g, b_beta)
    b_o = tl.sum(b_h * (_l2norm(b_q) * scale)[None, :], 1)
    tl.store(p_h, cast(b_h, pool.dtype.element_ty), mask=mask_h)
    b_o = tl.where(mask_v, cast(b_o, ACT).to(tl.float32), 0.)   # o rounded as the recurrent kernel's out

    m_s = (o_w[:, None] < W - 1) & mask_k[None, :]
    if NT == 1:
        _norm_out(b_o, row, norm_w, y, oq, osc, i_n, i_hv, eps, o_v, mask_v, D, HV, V, VP, MID, QUANT)
    else:   # the o tile parks in y (rounded: the norm reads the same bits); the last arrival normalises
        tl.store(y + i_n.to(tl.int64) * (HV * V) + i_hv * V + o_v, b_o.to(ACT), mask=mask_v)
    if (R == 1) and (NT == 1):
        tl.debug_barrier()
        tl.store(p_hist + o_w[:, None] * D + o_q[None, :], n_q, mask=m_s)
        tl.store(p_hist + o_w[:, None] * D + o_kc[None, :], n_k, mask=m_s)
    else:
        # the last of the key head's R·NT programs: every one has read the q/k history and parked its o tile
        tl.debug_barrier()
        p_cnt = counters + slot * H + i_h
        done = tl.atomic_add(p_cnt, 1, sem="acq_rel")
        if done == R * NT - 1:
            tl.store(p_hist + o_w[:, None] * D + o_q[None, :], n_q, mask=m_s)
            tl.store(p_hist + o_w[:, None] * D + o_kc[None, :], n_k, mask=m_s)
            if NT > 1:
                for jj in tl.static_range(R):
                    j = i_h * R + jj
                    b_or = tl.load(y + i_n.to(tl.int64) * (HV * V) + j * V + o_vr, mask=o_vr < V, other=0.,
                                   volatile=True).to(tl.float32)
                    _norm_out(b_or, row, norm_w, y, oq, osc, i_n, j, eps, o_vr, o_vr < V, D, HV, V, VP, MID,
                              QUANT)
            tl.atomic_xchg(p_cnt, 0, sem="relaxed")


_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def quant_fusable(V: int) -> bool:
    """Whether the kernel quantizes y in its registers: each head's row whole 128-groups."""
    return V % 128 == 0 and pow2(V) == V


def fused_tile(V: int, K: int) -> tuple[int, int]:
    """(V tiles per head NT, num_warps). Default one tile (the whole [V, K] state of a head per program, 8 warps at
    128²: 32 programs at B = 1 on the real model); ``GDNSERVE_FUSED_DECODE_NT`` splits V in NT tiles (more programs,
    the gated norm then by the key head's last arrival), ``GDNSERVE_FUSED_DECODE_WARPS`` overrides the warps."""
    nt = min(int(os.environ.get("GDNSERVE_FUSED_DECODE_NT", "1")), pow2(V))
    if nt < 1 or pow2(nt) != nt:
        raise ValueError(f"GDNSERVE_FUSED_DECODE_NT: a power of two >= 1, got {nt}")
    cells = pow2(V) * pow2(K) // nt
    nw = int(os.environ.get("GDNSERVE_FUSED_DECODE_WARPS", "0")) or (8 if cells >= 128 * 128 else 4 if cells >= 4096
                                                                       else 2)
    return nt, nw


def gdn_decode_fused_triton(proj, conv_w, conv_pool, A_log, dt_bias, ssm_pool, slots, norm_w, eps, counters,
                            H: int, scale: float, quant: bool, tile: tuple[int, int] | None = None):
    """Validated arguments (``decode_fused.gdn_decode_fused``); returns y [B, HV·V] or (y, (q, s)). ``tile``:
    (NT, num_warps), default ``fused_tile``."""
    B = slots.shape[0]
    _, HV, V, K = ssm_pool.shape
    W = conv_pool.shape[1] + 1
    y = torch.empty(B, HV * V, dtype=proj.dtype, device=proj.device)
    if quant:
        from gdnserve.ops.quant.quant_out import empty_quant
        oq, osc = empty_quant(B, HV * V, proj.device)
    else:
        oq = osc = y
    if B:
        nt, nw = tile or fused_tile(V, K)
        BK, BV = pow2(K), pow2(V) // nt
        mid = _TL[torch.promote_types(norm_w.dtype, proj.dtype)]
        launch(gdn_decode_fused_kernel, (nt, HV, B),
               (proj, conv_w, conv_pool, A_log, dt_bias, ssm_pool, slots, norm_w, y, oq, osc, counters,
                proj.stride(0), float(scale), float(eps), H, HV, K, V, W, pow2(W), BK, BV, nt, mid, quant), nw)
    return (y, (oq, osc)) if quant else y
