"""The state pass of the chunked prefill (the only sequential stage), context parallel for long sequences.

A sequence of ``nc >= CP_MIN`` chunks is cut into segments of ``SEG`` chunks (the last one shorter). Over a
segment the state map is affine (gdn_kernels.md §2.4): in the pool's V-major form Sᵀ_end = Sᵀ_start·P + B,
P = ∏ M_c with M_c = Γ_C I − 𝒲_cᵀ diag(Γ_C/Γ) K_c, and B = the segment run from a zero state.

1. ``chunk_seg_kernel`` grid (tiles of the V + K rows, N·MS, HV): for every segment but a sequence's last, runs
   the segment's chunks on the augmented state [Bᵀ-rows | P-rows] = [0 | I] (the P rows see Ũ = 0) and stores
   both; independent of any initial state, so all segments of all sequences run at once.
2. ``chunk_state_kernel`` grid (V tiles, N·MS·HV): a segment's program obtains its start state — the source
   slot, zeros or the parent's final state for segment 0, else the start its predecessor published — and at
   once publishes the next segment's start S·P + B (overwriting B in place), then walks its chunks: the output
   rows o += s·Q' S₀ᵀ on the prep's s·(M ⊙ QKᵀ) Ũ (Q' = diag(Γ) Q − (M ⊙ QKᵀ) 𝒲, formed by the prep) and the
   state; a sequence's last segment stores the final state to ``pool[dst]``.
   Programs take tickets from an atomic counter, laid out (sequence, segment, head, tile): whoever a program
   waits for (its parent's tile, its predecessor segment's tile) holds a lower ticket and is already running,
   and never waits for a higher one, so every wait ends. Hand-off: store, bar.sync, release flag; the waiter
   spins on volatile loads, one acquire RMW, bar.sync, then reads past L1.
The segmentation depends only on the sequence's own length: varlen == per-sequence and grouped == serial
stay bit-identical.
"""
from __future__ import annotations

import triton
import triton.language as tl

from gdnserve.ops.tl_compat import cast, mma


@triton.jit
def _l2norm_rows(p_x, o_rows, m_rows, stride_t, o_k, m_k):
    """Load rows [C, BK] of one head and l2-normalise them in fp32 (x * rsqrt(sum x² + 1e-6)); the prep and
    output stages (chunk_triton.py) use it too."""
    b_x = tl.load(p_x + o_rows[:, None].to(tl.int64) * stride_t + o_k[None, :],
                  mask=m_rows[:, None] & m_k[None, :], other=0.).to(tl.float32)
    return b_x * tl.rsqrt(tl.sum(b_x * b_x, 1) + 1e-6)[:, None]


@triton.jit
def _num_segs(L, C: tl.constexpr, CP_MIN: tl.constexpr, SEG: tl.constexpr):
    nc = tl.maximum(tl.cdiv(L, C), 1)
    return tl.where(nc >= CP_MIN, tl.cdiv(nc, SEG), 1)


@triton.jit
def _advance(b_S, b_u, b_w, b_k, b_gc, g_last, m_rows, DT: tl.constexpr, DOT_PREC: tl.constexpr):
    """One chunk on a [BV, BK] tile of Sᵀ: returns (U = Ũ − 𝒲 S  [C, BV] fp32, the state after the chunk).
    fla's choice: the state rounded to the activation dtype for the products."""
    b_U = b_u - mma(b_w, tl.trans(cast(b_S, DT)), DOT_PREC)
    b_Uw = tl.where(m_rows[:, None], b_U * tl.exp(tl.where(m_rows, g_last - b_gc, 0.))[:, None], 0.)
    b_S = b_S * tl.exp(g_last) + mma(tl.trans(cast(b_Uw, DT)), cast(b_k, DT), DOT_PREC)
    return b_U, b_S


@triton.jit
def _load_kw(kn, w, t0, n_valid, i_h, i_hv, o_c, o_k, m_k, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr):
    """A chunk's rows: mask, token offsets, normalised keys (the prep's copy in the activation dtype: the same
    values the 16-bit products see) and 𝒲."""
    m_rows = o_c < n_valid
    o_rows = t0 + o_c
    b_k = tl.load(kn + (o_rows[:, None].to(tl.int64) * H + i_h) * K + o_k[None, :],
                  mask=m_rows[:, None] & m_k[None, :], other=0.)
    b_w = tl.load(w + (o_rows[:, None].to(tl.int64) * HV + i_hv) * K + o_k[None, :],
                  mask=m_rows[:, None] & m_k[None, :], other=0.)
    return m_rows, o_rows, b_k, b_w


@triton.jit
def _load_chunk(kn, w, gcum, t0, n_valid, i_h, i_hv, o_c, o_k, m_k, H: tl.constexpr, HV: tl.constexpr,
                K: tl.constexpr):
    """_load_kw, then the cumulative gates and the last one."""
    m_rows, o_rows, b_k, b_w = _load_kw(kn, w, t0, n_valid, i_h, i_hv, o_c, o_k, m_k, H, HV, K)
    b_gc = tl.load(gcum + o_rows * HV + i_hv, mask=m_rows, other=0.)
    g_last = tl.load(gcum + (t0 + n_valid - 1) * HV + i_hv)
    return m_rows, o_rows, b_k, b_w, b_gc, g_last


@triton.jit
def _load_small(u, o, gcum, t0, n_valid, i_hv, o_c, o_v, m_v, HV: tl.constexpr, V: tl.constexpr):
    """A chunk's Ũ tile, its o tile (the prep's part), both in their storage dtypes (half the registers of fp32
    while prefetched), cumulative gates and the last one; masked off for n_valid <= 0."""
    m_rows = o_c < n_valid
    o_rows = t0 + o_c
    p_rv = (o_rows[:, None].to(tl.int64) * HV + i_hv) * V + o_v[None, :]
    m_rv = m_rows[:, None] & m_v[None, :]
    b_u = tl.load(u + p_rv, mask=m_rv, other=0.)
    b_o = tl.load(o + p_rv, mask=m_rv, other=0.)
    b_gc = tl.load(gcum + o_rows * HV + i_hv, mask=m_rows, other=0.)
    g_last = tl.load(gcum + (t0 + n_valid - 1) * HV + i_hv, mask=n_valid > 0, other=0.)
    return b_u, b_o, b_gc, g_last


@triton.jit
def chunk_seg_kernel(kn, w, u, gcum, seg_b, seg_p, cu_seqlens, chunk_offsets,
                     MS, R: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, CP_MIN: tl.constexpr, SEG: tl.constexpr,
                     DOT_PREC: tl.constexpr):
    i_t, i_ns, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_s = i_ns // MS, i_ns % MS
    bos = tl.load(cu_seqlens + i_n)
    L = tl.load(cu_seqlens + i_n + 1) - bos
    if i_s >= _num_segs(L, C, CP_MIN, SEG) - 1:    # the last segment needs no transition
        return
    NVT: tl.constexpr = (V + BV - 1) // BV
    i_h = i_hv // R
    o_c = tl.arange(0, C)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    is_p = i_t >= NVT
    o_r = tl.where(is_p, i_t - NVT, i_t) * BV + tl.arange(0, BV)     # rows of Bᵀ (< V) or of P (< K)
    m_r = o_r < tl.where(is_p, K, V)
    # P rows start as the identity and see Ũ = 0; Bᵀ rows start at zero
    b_S = (o_r[:, None] == o_k[None, :]).to(tl.float32) * is_p.to(tl.float32)
    m_u = (m_r & (i_t < NVT)) != 0
    for i_c in range(i_s * SEG, i_s * SEG + SEG):                    # full chunks: not the last segment
        t0 = bos + i_c * C
        m_rows, o_rows, b_k, b_w, b_gc, g_last = _load_chunk(kn, w, gcum, t0, C, i_h, i_hv, o_c, o_k, m_k,
                                                             HV // R, HV, K)
        b_u = tl.load(u + (o_rows[:, None].to(tl.int64) * HV + i_hv) * V + o_r[None, :],
                      mask=m_rows[:, None] & m_u[None, :], other=0.).to(tl.float32)
        b_U, b_S = _advance(b_S, b_u, b_w, b_k, b_gc, g_last, m_rows, w.dtype.element_ty, DOT_PREC)
    i_x = (tl.load(chunk_offsets + i_n) + (i_s + 1) * SEG) // SEG     # compact index of segment i_s + 1
    m_s = m_r[:, None] & m_k[None, :]
    if i_t < NVT:
        tl.store(seg_b + ((i_x * HV + i_hv) * V + o_r[:, None]).to(tl.int64) * K + o_k[None, :], b_S, mask=m_s)
    else:
        tl.store(seg_p + ((i_x * HV + i_hv) * K + o_r[:, None]).to(tl.int64) * K + o_k[None, :], b_S, mask=m_s)


@triton.jit
def _wait(p_flag):
    while tl.load(p_flag, volatile=True) == 0:
        pass
    tl.atomic_add(p_flag, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _publish(p_flag):
    tl.debug_barrier()   # every thread's part of the tile is stored before the flag says so
    tl.atomic_xchg(p_flag, 1, sem="release")


@triton.jit
def _initial_state(pool, src_slots, dst_slots, parents, sync, i_n, i_hv, i_vt, o_s, m_s,
                   HV: tl.constexpr, NVT: tl.constexpr, SLOT: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
                   HAS_PARENT: tl.constexpr, WAIT: tl.constexpr):
    """A sequence's initial tile: its parent's final state (with WAIT, waiting for the parent's program of this
    tile to publish it in the parent's dst slot; else the parent ran in an earlier launch), else pool[src], else
    zeros."""
    i_p = -1
    if HAS_PARENT:
        i_p = tl.load(parents + i_n)
    if i_p >= 0:
        if WAIT:
            _wait(sync + 1 + (i_p * HV + i_hv) * NVT + i_vt)
        s_pd = tl.load(dst_slots + i_p)
        b_S = tl.load(pool + s_pd.to(tl.int64) * SLOT + o_s, mask=m_s, other=0., cache_modifier=".cg").to(tl.float32)
    else:
        s_src = tl.load(src_slots + i_n)
        b_S = tl.zeros([BV, BK], dtype=tl.float32)
        if s_src >= 0:
            b_S = tl.load(pool + s_src.to(tl.int64) * SLOT + o_s, mask=m_s, other=0.).to(tl.float32)
    return b_S


@triton.jit
def chunk_state_kernel(kn, qp, w, u, gcum, o, pool, seg_b, seg_p, cu_seqlens, chunk_offsets,
                       src_slots, dst_slots, parents, sync, MS, NSEQ_FLAGS,
                       R: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, CP: tl.constexpr,
                       CP_MIN: tl.constexpr, SEG: tl.constexpr, HAS_PARENT: tl.constexpr, TICKETS: tl.constexpr,
                       DOT_PREC: tl.constexpr, COMB_PREC: tl.constexpr, CB: tl.constexpr, PHASE: tl.constexpr):
    # CP (a constexpr: some sequence of the call is long enough to be cut) compiles the segment machinery;
    # without it the kernel is the plain sequential walk, one program per (sequence, value head, V tile).
    # PHASE 0: every sequence in one launch (with CP: a consumer waits for its parent's flag); 1: only the sequences
    # without a parent; 2: only those with one (launched after phase 1: the parents' final states are in their
    # dst slots, no waiting, no tickets)
    NVT: tl.constexpr = (V + BV - 1) // BV
    if TICKETS:
        i_t = tl.atomic_add(sync, 1)
        i_vt, i_r = i_t % NVT, i_t // NVT
    else:
        i_vt, i_r = tl.program_id(0), tl.program_id(1)
    i_hv = i_r % HV
    i_h = i_hv // R
    o_c = tl.arange(0, C)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_vt * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_s = m_v[:, None] & m_k[None, :]
    o_s = (i_hv * V + o_v[:, None]).to(tl.int64) * K + o_k[None, :]            # offset inside a slot
    SLOT: tl.constexpr = HV * V * K
    if CP:
        i_n, i_s = (i_r // HV) // MS, (i_r // HV) % MS
    else:
        i_n, i_s = i_r // HV, 0
    if PHASE == 1:
        if tl.load(parents + i_n) >= 0:
            return
    if PHASE == 2:
        if tl.load(parents + i_n) < 0:
            return
    bos = tl.load(cu_seqlens + i_n)
    L = tl.load(cu_seqlens + i_n + 1) - bos
    off = tl.load(chunk_offsets + i_n)
    nc = tl.cdiv(L, C)                      # 0 for an empty sequence: src -> dst only
    if CP:
        nseg = _num_segs(L, C, CP_MIN, SEG)
        if i_s >= nseg:
            return
        # flags: [1, 1 + NSEQ_FLAGS) a sequence's final state is in its dst slot; then segment starts published
        if i_s > 0:
            _wait(sync + 1 + NSEQ_FLAGS + ((i_n * MS + i_s) * HV + i_hv) * NVT + i_vt)
            i_x = (off + i_s * SEG) // SEG
            b_S = tl.load(seg_b + (i_x * HV).to(tl.int64) * V * K + o_s, mask=m_s, other=0., cache_modifier=".cg")
        else:
            b_S = _initial_state(pool, src_slots, dst_slots, parents, sync, i_n, i_hv, i_vt, o_s, m_s,
                                 HV, NVT, SLOT, BV, BK, HAS_PARENT, PHASE == 0)
        if i_s < nseg - 1:
            # publish the next segment's start: S·P + B, written over B (only this tile reads it)
            # in column blocks of P ([BK, CB] operands: the whole fp32 P, split for tf32x3, does not fit in
            # shared memory at BV = K = 128)
            i_x1 = (off + (i_s + 1) * SEG) // SEG
            p_p = seg_p + (i_x1 * HV + i_hv).to(tl.int64) * K * K
            for jb in tl.static_range(0, BK, CB):
                o_j = jb + tl.arange(0, CB)
                m_j = o_j < K
                p_b = seg_b + (i_x1 * HV).to(tl.int64) * V * K + (i_hv * V + o_v[:, None]).to(tl.int64) * K + o_j[None, :]
                m_b = m_v[:, None] & m_j[None, :]
                b_P = tl.load(p_p + o_k[:, None] * K + o_j[None, :], mask=m_k[:, None] & m_j[None, :], other=0.)
                tl.store(p_b, mma(b_S, b_P, COMB_PREC) + tl.load(p_b, mask=m_b, other=0.), mask=m_b)
            _publish(sync + 1 + NSEQ_FLAGS + ((i_n * MS + i_s + 1) * HV + i_hv) * NVT + i_vt)
        c_beg = i_s * SEG
        c_end = tl.where(nseg > 1, tl.minimum(nc, (i_s + 1) * SEG), nc)
        is_last = i_s == nseg - 1
    else:
        b_S = _initial_state(pool, src_slots, dst_slots, parents, sync, i_n, i_hv, i_vt, o_s, m_s,
                             HV, NVT, SLOT, BV, BK, HAS_PARENT, PHASE == 0)
        c_beg = 0
        c_end = nc
        is_last = True

    DT: tl.constexpr = w.dtype.element_ty
    # the small per-chunk operands (Ũ tile, o tile, gates) are loaded one chunk ahead, in registers; the large
    # ones (𝒲, keys, Q') feed the products directly and are left to Triton's pipeliner
    x_u, x_o, x_gc, x_gl = _load_small(u, o, gcum, bos + c_beg * C, tl.minimum(C, L - c_beg * C), i_hv, o_c, o_v, m_v,
                                       HV, V)
    for i_c in range(c_beg, c_end):
        t0 = bos + i_c * C
        n_valid = tl.minimum(C, L - i_c * C)
        b_u, b_oi, b_gc, g_last = x_u.to(tl.float32), x_o.to(tl.float32), x_gc, x_gl
        n_next = tl.where(i_c + 1 < c_end, tl.minimum(C, L - (i_c + 1) * C), 0)
        x_u, x_o, x_gc, x_gl = _load_small(u, o, gcum, t0 + C, n_next, i_hv, o_c, o_v, m_v, HV, V)
        m_rows, o_rows, b_k, b_w = _load_kw(kn, w, t0, n_valid, i_h, i_hv, o_c, o_k, m_k, HV // R, HV, K)
        p_rv = (o_rows[:, None].to(tl.int64) * HV + i_hv) * V + o_v[None, :]
        m_rv = m_rows[:, None] & m_v[None, :]
        # o holds the prep's s·(M ⊙ Q Kᵀ) Ũ; add s·Q' S₀ᵀ (Q' from the prep, scaled), S₀ as the U product sees it
        b_qp = tl.load(qp + (o_rows[:, None].to(tl.int64) * HV + i_hv) * K + o_k[None, :],
                       mask=m_rows[:, None] & m_k[None, :], other=0.)
        b_oi += mma(b_qp, tl.trans(cast(b_S, DT)), DOT_PREC)
        tl.store(o + p_rv, cast(b_oi, o.dtype.element_ty), mask=m_rv)
        b_U, b_S = _advance(b_S, b_u, b_w, b_k, b_gc, g_last, m_rows, DT, DOT_PREC)
    if is_last:
        s_dst = tl.load(dst_slots + i_n)
        if s_dst >= 0:
            tl.store(pool + s_dst.to(tl.int64) * SLOT + o_s, cast(b_S, pool.dtype.element_ty), mask=m_s)
        if HAS_PARENT and PHASE == 0:
            _publish(sync + 1 + (i_n * HV + i_hv) * NVT + i_vt)
