"""The chunked prefill in FlashQLA's shape (``ChunkConfig.fused_main``; docs/kernels.md "Chunked prefill against
FlashQLA"): a small prep, then ONE main kernel that forms the per-chunk values, the output and the state together.

1. ``chunk_prep_tm_kernel`` grid (chunk rows, H·split): per chunk and key head, l2-normalised q and k, K Kᵀ and
   Q Kᵀ once, then per value head the gates, the chunk-local cumsum γ (stored), 𝒯 = (I + 𝒜)⁻¹ (as the other prep:
   product form, bf16 operands per ``inv_bf16``) and stores only two C×C matrices per chunk and value head, in
   the activation dtype: 𝒯' = 𝒯 diag(β) and M' = s·(causal ⊙ Γᵢ/Γⱼ ⊙ Q Kᵀ). No V, no 𝒲/Ũ/Q'/o here: the prep
   writes 2·C + 1 values per token and value head instead of 2·K + 2·V + K/R + 1.
2. ``chunk_main_kernel`` grid (V tiles, N·HV) (two launches with same-call parents: producers, then consumers
   reading their parent's dst slot, as the state pass does): one program per (sequence, value head, V tile) holds
   its [BV, K] fp32 tile of Sᵀ in registers from pool[src] (or zeros, or the parent's final state) and per chunk
     X  = V − diag(Γ) K Sᵀ          U = 𝒯' X   (= Ũ − 𝒲 Sᵀ of the other path)
     O  = s·diag(Γ) Q Sᵀ + M' U     (stored once, rounded once)
     Sᵀ ← Γ_C Sᵀ + (diag(Γ_C/Γ) U)ᵀ K
   q and k are re-read and re-normalised per V tile (the same bits as the prep's: rsqrt in fp32, then the
   activation dtype), so no normalised-key copy crosses HBM; then it stores the final tile to pool[dst].
Context parallelism (``cp_min_chunks``, ``cp_seg_chunks``, ``cp_decay``; docs/kernels.md): a long sequence's
segments run in parallel where their decay makes a segment's start its predecessor's tail run from zeros (to
e^-cp_decay of the state), without flags or extra launches; segment 0's program also runs the last segment.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdnserve.ops.gdn.chunk_configs import ChunkConfig
from gdnserve.ops.gdn.chunk_state_triton import _initial_state, _l2norm_rows, _num_segs
from gdnserve.ops.gdn.chunk_triton import _gates, _inverse, _prec, max_segments
from gdnserve.ops.gdn.chunk_workspace import ChunkWorkspace
from gdnserve.ops.launch import cdiv, launch, pow2
from gdnserve.ops.tl_compat import cast, mma
from gdnserve.ops.varlen import CHUNK, VarlenMeta


@triton.jit
def _prep_tm_tile(q, k, a, b, A_log, dt_bias, gcum, tm_t, tm_m, qn, kn, scale, t0, n_valid, i_h, i_s,
                  s_qt, s_qh, s_kt, s_kh, s_at, s_ah, s_bt, s_bh,
                  R: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr,
                  LD: tl.constexpr, DOT_PREC: tl.constexpr, INV_MODE: tl.constexpr, PREP_BF16: tl.constexpr,
                  SPLIT: tl.constexpr, INV_BF16: tl.constexpr, NIT: tl.constexpr, QK_STORE: tl.constexpr):
    """One key head's programs' share of a chunk tile of C rows (t0 .. t0 + n_valid valid); 𝒯' and M' rows are
    LD (= CHUNK) apart, a C < LD tile fills their first C columns."""
    DT: tl.constexpr = tm_t.dtype.element_ty
    o_c = tl.arange(0, C)
    m_rows = o_c < n_valid
    o_rows = t0 + o_c
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    b_k = _l2norm_rows(k + i_h * s_kh, o_rows, m_rows, s_kt, o_k, m_k)          # [C, BK] fp32
    b_q = _l2norm_rows(q + i_h * s_qh, o_rows, m_rows, s_qt, o_k, m_k)
    if QK_STORE:  # noqa: SIM102 — nested: a constexpr test, then a runtime one
        if i_s == 0:   # the normalised q and k for the main kernel, one copy per key head
            p_qk = (o_rows[:, None].to(tl.int64) * (HV // R) + i_h) * K + o_k[None, :]
            m_qk = m_rows[:, None] & m_k[None, :]
            tl.store(qn + p_qk, cast(b_q, DT), mask=m_qk)
            tl.store(kn + p_qk, cast(b_k, DT), mask=m_qk)
    if PREP_BF16:   # q, k rounded to the activation dtype, as the main kernel's products see them
        b_kd = cast(b_k, DT)
        b_kk = mma(b_kd, tl.trans(b_kd), DOT_PREC)                              # [C, C]
        b_qk = mma(cast(b_q, DT), tl.trans(b_kd), DOT_PREC)
    else:
        b_kk = mma(b_k, tl.trans(b_k), DOT_PREC)
        b_qk = mma(b_q, tl.trans(b_k), DOT_PREC)
    strict = o_c[:, None] > o_c[None, :]
    incl = (o_c[:, None] >= o_c[None, :]) & m_rows[:, None]
    eye = (o_c[:, None] == o_c[None, :]).to(tl.float32)
    p_cc = (o_rows[:, None].to(tl.int64) * HV) * LD + o_c[None, :]
    m_st = m_rows[:, None] & (o_c[None, :] >= 0)
    RS: tl.constexpr = R // SPLIT
    for jj in range(RS):
        i_hv = i_h * R + i_s * RS + jj
        b_g, b_beta = _gates(a + i_hv * s_ah, b + i_hv * s_bh, o_rows, m_rows, s_at, s_bt,
                             tl.load(A_log + i_hv), tl.load(dt_bias + i_hv).to(tl.float32))
        b_gc = tl.cumsum(b_g, 0)
        tl.store(gcum + o_rows * HV + i_hv, b_gc, mask=m_rows)
        b_A = tl.where(strict, b_kk * b_beta[:, None] * tl.exp(tl.where(strict, b_gc[:, None] - b_gc[None, :], 0.)),
                       0.)
        b_T = _inverse(b_A, eye, C, DOT_PREC, INV_MODE, INV_BF16, NIT, DT)
        tl.store(tm_t + p_cc + i_hv * LD, cast(b_T * b_beta[None, :], DT), mask=m_st)
        b_M = tl.where(incl, b_qk * tl.exp(tl.where(incl, b_gc[:, None] - b_gc[None, :], 0.)), 0.)
        tl.store(tm_m + p_cc + i_hv * LD, cast(b_M * scale, DT), mask=m_st)


@triton.jit
def chunk_prep_tm_kernel(q, k, a, b, A_log, dt_bias, cu_seqlens, chunk_indices, gcum, tm_t, tm_m, qn, kn, scale,
                         s_qt, s_qh, s_kt, s_kh, s_at, s_ah, s_bt, s_bh,
                         R: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr,
                         DOT_PREC: tl.constexpr, INV_MODE: tl.constexpr, PREP_BF16: tl.constexpr,
                         SPLIT: tl.constexpr, INV_BF16: tl.constexpr, SHORT: tl.constexpr, SHORT_NIT: tl.constexpr,
                         QK_STORE: tl.constexpr):
    # as chunk_prep_kernel: SPLIT programs per key head; a sequence of <= SHORT tokens takes a SHORT-row tile
    # (chosen from its own length only: varlen == per sequence bit for bit)
    i_row, i_hs = tl.program_id(0), tl.program_id(1)
    i_h, i_s = i_hs // SPLIT, i_hs % SPLIT
    i_n = tl.load(chunk_indices + 2 * i_row)
    if i_n < 0:
        return
    i_c = tl.load(chunk_indices + 2 * i_row + 1)
    bos = tl.load(cu_seqlens + i_n)
    L = tl.load(cu_seqlens + i_n + 1) - bos
    if SHORT > 0 and L <= SHORT:
        _prep_tm_tile(q, k, a, b, A_log, dt_bias, gcum, tm_t, tm_m, qn, kn, scale, bos, L, i_h, i_s,
                      s_qt, s_qh, s_kt, s_kh, s_at, s_ah, s_bt, s_bh, R, HV, K, BK, SHORT, C, DOT_PREC, 1,
                      PREP_BF16, SPLIT, INV_BF16, SHORT_NIT, QK_STORE)
    else:
        _prep_tm_tile(q, k, a, b, A_log, dt_bias, gcum, tm_t, tm_m, qn, kn, scale, bos + i_c * C, L - i_c * C,
                      i_h, i_s, s_qt, s_qh, s_kt, s_kh, s_at, s_ah, s_bt, s_bh, R, HV, K, BK, C, C, DOT_PREC,
                      INV_MODE, PREP_BF16, SPLIT, INV_BF16, 5, QK_STORE)


@triton.jit
def _walk(b_S, q, k, v, gcum, tm_t, tm_m, qn, kn, o, scale, bos, eos, c_beg, c_end, i_h, i_hv, i_vt,
          s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, R: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
          BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, DOT_PREC: tl.constexpr, QK_STORE: tl.constexpr,
          TF32: tl.constexpr, WITH_O: tl.constexpr):
    """Chunks [c_beg, c_end) of a sequence on the [BV, BK] tile b_S of Sᵀ; WITH_O: also form and store O. TF32: the
    two C-wide products (𝒯'X, M'U) take X and U unrounded (tf32 operands) instead of in the activation dtype."""
    DT: tl.constexpr = tm_t.dtype.element_ty
    H: tl.constexpr = HV // R
    L = eos - bos
    o_c = tl.arange(0, C)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_vt * BV + tl.arange(0, BV)
    m_v = o_v < V
    # row bases as 64-bit scalars, in-tile offsets as int32 (q/k, v/o and 𝒯'/M' share theirs)
    o_qk = o_c[:, None] * (H * K) + o_k[None, :]
    o_cc = o_c[:, None] * (HV * C) + o_c[None, :]
    for i_c in range(c_beg, c_end):
        t0 = bos + i_c * C
        n_valid = tl.minimum(C, L - i_c * C)
        m_rows = o_c < n_valid
        t64 = t0.to(tl.int64)
        if QK_STORE:   # the prep's normalised copies: plain loads that feed the products
            m_qk = m_rows[:, None] & m_k[None, :]
            b_k = tl.load(kn + (t64 * H + i_h) * K + o_qk, mask=m_qk, other=0.)
            if WITH_O:
                b_q = tl.load(qn + (t64 * H + i_h) * K + o_qk, mask=m_qk, other=0.)
        else:          # normalised here, per V tile (the same bits as the prep's copies)
            o_rows = t0 + o_c
            b_k = cast(_l2norm_rows(k + i_h * s_kh, o_rows, m_rows, s_kt, o_k, m_k), DT)     # [C, BK]
            if WITH_O:
                b_q = cast(_l2norm_rows(q + i_h * s_qh, o_rows, m_rows, s_qt, o_k, m_k), DT)
        m_rv = m_rows[:, None] & m_v[None, :]
        b_v = tl.load(v + t64 * s_vt + i_hv * s_vh + (o_c[:, None] * s_vt + o_v[None, :]), mask=m_rv,
                      other=0.).to(tl.float32)
        b_gc = tl.load(gcum + (t0 + o_c) * HV + i_hv, mask=m_rows, other=0.)
        g_last = tl.load(gcum + (t0 + n_valid - 1) * HV + i_hv)
        m_cc = m_rows[:, None] & m_rows[None, :]           # a short tile's prep wrote only its own columns
        b_T = tl.load(tm_t + (t64 * HV + i_hv) * C + o_cc, mask=m_cc, other=0.)
        if WITH_O:
            b_M = tl.load(tm_m + (t64 * HV + i_hv) * C + o_cc, mask=m_cc, other=0.)
        b_Sd = cast(b_S, DT)                               # fla's choice: the state rounded for the products
        b_eg = tl.exp(b_gc)
        b_X = b_v - b_eg[:, None] * mma(b_k, tl.trans(b_Sd), DOT_PREC)                     # [C, BV]
        if TF32:
            b_U = mma(b_T.to(tl.float32), b_X, DOT_PREC)
        else:
            b_U = mma(b_T, cast(b_X, DT), DOT_PREC)
        if WITH_O:
            if TF32:
                b_MU = mma(b_M.to(tl.float32), b_U, DOT_PREC)
            else:
                b_MU = mma(b_M, cast(b_U, DT), DOT_PREC)
            b_o = mma(b_q, tl.trans(b_Sd), DOT_PREC) * (scale * b_eg)[:, None] + b_MU
            tl.store(o + (t64 * HV + i_hv) * V + (o_c[:, None] * (HV * V) + o_v[None, :]),
                     cast(b_o, o.dtype.element_ty), mask=m_rv)
        b_Uw = tl.where(m_rows[:, None], b_U * tl.exp(tl.where(m_rows, g_last - b_gc, 0.))[:, None], 0.)
        b_S = b_S * tl.exp(g_last) + mma(tl.trans(cast(b_Uw, DT)), b_k, DOT_PREC)
    return b_S


@triton.jit
def _chunk_decay(gcum, bos, o_cs, m_cs, i_hv, HV: tl.constexpr, C: tl.constexpr):
    """The log decay of whole chunks o_cs (sum of their g: the chunk-local cumsum at the last row)."""
    return tl.load(gcum + (bos + (o_cs + 1) * C - 1) * HV + i_hv, mask=m_cs, other=0.)


@triton.jit
def chunk_main_kernel(q, k, v, gcum, tm_t, tm_m, qn, kn, o, pool, cu_seqlens, src_slots, dst_slots, parents,
                      scale, cp_decay, s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, MS,
                      R: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, DOT_PREC: tl.constexpr,
                      HAS_PARENT: tl.constexpr, PHASE: tl.constexpr, QK_STORE: tl.constexpr,
                      CP: tl.constexpr, CP_MIN: tl.constexpr, SEG: tl.constexpr, TF32: tl.constexpr):
    # PHASE 0: every sequence (no parents in the call); 1: those without a parent; 2: those with one (launched
    # after phase 1: the parents' final states are in their dst slots).
    # CP (some sequence of the call has >= CP_MIN chunks): programs (sequence, segment, head, V tile); see
    # launch_main for the scheme.
    NVT: tl.constexpr = (V + BV - 1) // BV
    i_vt, i_r = tl.program_id(0), tl.program_id(1)
    i_hv = i_r % HV
    i_h = i_hv // R
    if CP:
        i_n, i_s = (i_r // HV) // MS, (i_r // HV) % MS
    else:
        i_n, i_s = i_r // HV, 0
    # nested: the constexpr test compiles the load away in phase 0 (an `and` would evaluate both sides)
    if PHASE == 1:  # noqa: SIM102
        if tl.load(parents + i_n) >= 0:
            return
    if PHASE == 2:  # noqa: SIM102
        if tl.load(parents + i_n) < 0:
            return
    bos = tl.load(cu_seqlens + i_n)
    eos = tl.load(cu_seqlens + i_n + 1)
    nc = tl.cdiv(eos - bos, C)                 # 0 for an empty sequence: src -> dst only
    nseg = nc * 0 + 1
    cp_ok = nc * 0                             # 1: this (sequence, head) runs its segments in parallel
    if CP:
        nseg = _num_segs(eos - bos, C, CP_MIN, SEG)
        if i_s >= tl.maximum(nseg - 1, 1):     # the last segment runs in segment 0's program
            return
        # CP holds for this (sequence, head) iff every segment but the last decays by more than cp_decay: then a
        # segment's start is, to e^-cp_decay of the state, the previous segment's tail run from zeros
        o_sg = tl.arange(0, SEG)
        worst = tl.full([], float("-inf"), tl.float32)
        for i_b in range(nseg - 1):
            worst = tl.maximum(worst, tl.sum(_chunk_decay(gcum, bos, i_b * SEG + o_sg, o_sg >= 0, i_hv, HV, C)))
        cp_ok = ((nseg > 1) & (worst < -cp_decay)).to(tl.int32)
        if i_s > 0:  # noqa: SIM102
            if cp_ok == 0:                     # sequential: segment 0's program walks every chunk
                return
    o_k = tl.arange(0, BK)
    o_v = i_vt * BV + tl.arange(0, BV)
    SLOT: tl.constexpr = HV * V * K
    if i_s == 0:
        b_S = _initial_state(pool, src_slots, dst_slots, parents, src_slots, i_n, i_hv, i_vt,
                             (i_hv * V + o_v[:, None]).to(tl.int64) * K + o_k[None, :],
                             (o_v < V)[:, None] & (o_k < K)[None, :], HV, NVT, SLOT, BV, BK, HAS_PARENT, False)
        c_end = tl.where(cp_ok != 0, SEG, nc)
    else:
        b_S = _warm_start(gcum, q, k, v, tm_t, tm_m, qn, kn, o, scale, bos, eos, i_s, i_h, i_hv, i_vt,
                          s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, R, HV, K, V, BK, BV, C, DOT_PREC, QK_STORE, TF32,
                          SEG, cp_decay)
        c_end = (i_s + 1) * SEG
    b_S = _walk(b_S, q, k, v, gcum, tm_t, tm_m, qn, kn, o, scale, bos, eos, i_s * SEG, c_end, i_h, i_hv, i_vt,
                s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, R, HV, K, V, BK, BV, C, DOT_PREC, QK_STORE, TF32, True)
    if CP:  # noqa: SIM102 — nested: a constexpr test (no second walk compiled without CP), then runtime ones
        if i_s == 0 and cp_ok != 0:   # the last segment, here: the one program reading pool[src] writes pool[dst]
            b_S = _warm_start(gcum, q, k, v, tm_t, tm_m, qn, kn, o, scale, bos, eos, nseg - 1, i_h, i_hv, i_vt,
                              s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, R, HV, K, V, BK, BV, C, DOT_PREC, QK_STORE, TF32,
                              SEG, cp_decay)
            b_S = _walk(b_S, q, k, v, gcum, tm_t, tm_m, qn, kn, o, scale, bos, eos, (nseg - 1) * SEG, nc, i_h, i_hv,
                        i_vt, s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, R, HV, K, V, BK, BV, C, DOT_PREC, QK_STORE, TF32,
                        True)
    if i_s == 0:
        s_dst = tl.load(dst_slots + i_n)
        if s_dst >= 0:   # the slot offsets computed here, not held across the walks
            tl.store(pool + s_dst.to(tl.int64) * SLOT + ((i_hv * V + o_v[:, None]) * K + o_k[None, :]),
                     cast(b_S, pool.dtype.element_ty), mask=(o_v < V)[:, None] & (o_k < K)[None, :])


@triton.jit
def _warm_start(gcum, q, k, v, tm_t, tm_m, qn, kn, o, scale, bos, eos, i_s, i_h, i_hv, i_vt,
                s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, R: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, DOT_PREC: tl.constexpr,
                QK_STORE: tl.constexpr, TF32: tl.constexpr, SEG: tl.constexpr, cp_decay):
    """Segment i_s's start state: the shortest tail of segment i_s - 1 whose decay is below -cp_decay, run from
    zeros (state only); what came before it reaches the start scaled by at most e^-cp_decay (each chunk's map
    (I - β k kᵀ) Γ has norm <= its decay)."""
    o_sg = tl.arange(0, SEG)
    c0 = (i_s - 1) * SEG
    tail = tl.cumsum(_chunk_decay(gcum, bos, c0 + o_sg, o_sg >= 0, i_hv, HV, C), 0, reverse=True)
    j = tl.max(tl.where(tail < -cp_decay, o_sg, -1), 0)        # >= 0: the whole segment decays past it
    # clamped: the caller chose this segment for CP by a decay summed in another order (tl.sum vs this cumsum),
    # and at a decay exactly at the bar the two can round to either side: then start at the segment's first chunk
    j = tl.maximum(j, 0)
    b_S = tl.zeros([BV, BK], dtype=tl.float32)
    return _walk(b_S, q, k, v, gcum, tm_t, tm_m, qn, kn, o, scale, bos, eos, c0 + j, c0 + SEG, i_h, i_hv, i_vt,
                 s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, R, HV, K, V, BK, BV, C, DOT_PREC, QK_STORE, TF32, False)


MIN_TILE = 64
"""The smallest K and V tile of the main kernel (V < 64 pads a 64-wide tile, masked: no result changes). Triton 3.6
lowers the 4-warp bf16 dots below that wrongly on the H200: 𝒯'X and M'U ([64, 64] x [64, BV], the right operand a
bf16 cast of a product in registers) gave rel-RMS 0.75-0.89 at BV 16 and 32 and an illegal address with CP, as the
state pass's fused output did at BV 32 (docs/kernels.md); at K = 16 the prep's dot read shared memory out of bounds
(hence ``prep_min_block``). Right on the same run: fp32 activations (IEEE products, no tensor cores) at BV 32 and
K 16, and main_tf32 (fp32 operands for those two products) at BV 16."""


def main_tiles(K: int, V: int, cfg: ChunkConfig) -> tuple[int, int]:
    """(BK, BV) of the main kernel. BK is the prep's K tile: with ``main_qk_store`` off the main kernel's l2norm
    then sums the same [C, BK] rows as the prep's (the same bits on the GPU too)."""
    if cfg.main_bv < MIN_TILE or cfg.main_bv & (cfg.main_bv - 1):
        raise ValueError(f"main_bv: the fused main kernel needs a power of two >= {MIN_TILE} (Triton 3.6 computes "
                         f"its bf16 products wrongly on smaller V tiles), got {cfg.main_bv}")
    return max(pow2(K), cfg.prep_min_block, MIN_TILE), max(min(cfg.main_bv, pow2(V)), MIN_TILE)


def launch_prep_tm(q, k, a, b, A_log, dt_bias, meta: VarlenMeta, ws: ChunkWorkspace, cfg: ChunkConfig,
                   scale: float, f32: bool) -> None:
    H, K = q.shape[1], q.shape[2]
    HV = a.shape[1]
    R = HV // H
    split = R if meta.num_chunk_rows * H < cfg.prep_split_below else 1
    tm_t, tm_m = ws.tm_buffers()
    qn, kn = ws.qk_buffers(H) if cfg.main_qk_store else (tm_t, tm_t)
    short = cfg.short_prep
    launch(chunk_prep_tm_kernel, (meta.num_chunk_rows, H * split), (
        q, k, a, b, A_log, dt_bias, meta.cu_seqlens, meta.chunk_indices, ws.gcum, tm_t, tm_m, qn, kn, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        R, HV, K, main_tiles(K, 1, cfg)[0], CHUNK, "ieee" if f32 else "tf32", cfg.inv_mode,
        cfg.prep_bf16 and not f32, split, cfg.inv_bf16 and not f32, short, max(short.bit_length() - 2, 0),
        cfg.main_qk_store),
        cfg.prep_warps, cfg.prep_stages)


def launch_main(q, k, v, ssm_pool, meta: VarlenMeta, src_slots, dst_slots, parents, ws: ChunkWorkspace,
                cfg: ChunkConfig, scale: float, out) -> None:
    H, K = q.shape[1], q.shape[2]
    HV, V = v.shape[1], v.shape[2]
    bk, bv = main_tiles(K, V, cfg)
    tm_t, tm_m = ws.tm_buffers()
    qn, kn = ws.qk_buffers(H) if cfg.main_qk_store else (tm_t, tm_t)
    ms = max_segments(meta, cfg)
    seg = cfg.cp_seg_chunks
    if ms > 1 and (seg < 2 or seg > 128 or seg & (seg - 1)):
        raise ValueError(f"cp_seg_chunks: the fused main kernel needs a power of two in [2, 128], got {seg}")
    for phase in ((1, 2) if parents is not None else (0,)):
        launch(chunk_main_kernel, (cdiv(V, bv), meta.num_seqs * ms * HV), (
            q, k, v, ws.gcum, tm_t, tm_m, qn, kn, out, ssm_pool, meta.cu_seqlens, src_slots, dst_slots,
            parents if parents is not None else src_slots, scale, float(cfg.cp_decay),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), ms,
            HV // H, HV, K, V, bk, bv, CHUNK, _prec(v), parents is not None, phase, cfg.main_qk_store,
            ms > 1, cfg.cp_min_chunks, cfg.cp_seg_chunks, cfg.main_tf32 and v.dtype != torch.float32),
            cfg.main_warps, cfg.main_stages)


def chunk_gdn_fused(q, k, v, a, b, A_log, dt_bias, ssm_pool, meta: VarlenMeta, src_slots, dst_slots, parents,
                    scale: float, out: torch.Tensor, ws: ChunkWorkspace, cfg: ChunkConfig) -> torch.Tensor:
    launch_prep_tm(q, k, a, b, A_log, dt_bias, meta, ws, cfg, scale, v.dtype == torch.float32)
    launch_main(q, k, v, ssm_pool, meta, src_slots, dst_slots, parents, ws, cfg, scale, out)
    return out
