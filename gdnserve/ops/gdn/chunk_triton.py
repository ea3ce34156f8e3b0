"""Triton kernels of the chunked gated-delta-rule prefill (gdn_kernels.md §2), two launches (+1 for
context-parallel sequences, +1 for the consumers of same-call parents):

1. ``chunk_prep_kernel``   grid (chunk rows, H·split): per chunk and key head, l2-normalise k (stored for the
   state pass), form K Kᵀ, then per value head of the program: gates, chunk-local cumsum, the strictly lower
   𝒜 = diag(β) (Γᵢ/Γₘ ⊙ K Kᵀ), 𝒯 = (I + 𝒜)⁻¹, 𝒲 = 𝒯 diag(βΓ) K, Ũ = 𝒯 diag(β) V and the output's
   state-independent half s·M Ũ (into o) and Q' = s·[diag(Γ) Q − M 𝒲], M = causal ⊙ Γᵢ/Γⱼ ⊙ Q Kᵀ.
   No state is read: producers and consumers of one step run together here. Sequences of <= 32 tokens take
   a 32-row tile.
2. the state pass (``chunk_state_triton.py``): segment transitions of long sequences, then one program per
   (sequence segment, value head, V tile) walking its chunks from pool[src], zeros, its parent's final state
   or its predecessor segment's published start, adding Q' S₀ᵀ to the outputs and writing pool[dst].
Launch configs: ``chunk_configs.py`` (one row per GPU model).

𝒯 by default by the product form ∏ (I + (−𝒜)^(2^j)) (5 factors of 64×64, 4 of 32×32 for the short tile), all on
tensor cores; ``inv_mode`` 0 / 2 build it blockwise: the four 16×16 diagonal blocks of 𝒜 inverted (forward
substitution / a batched product form), then with D = blockdiag(those inverses) and N = D·𝒜_offdiag
(nilpotent, N⁴ = 0): 𝒯 = (I − N + N² − N³)·D.
Exponentials are natural-base and always of non-positive arguments (selected before exp).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdnserve.ops.gdn.chunk_configs import ChunkConfig, chunk_config
from gdnserve.ops.gdn.chunk_state_triton import _l2norm_rows, chunk_seg_kernel, chunk_state_kernel
from gdnserve.ops.gdn.chunk_workspace import ChunkWorkspace
from gdnserve.ops.launch import cdiv, launch, pow2
from gdnserve.ops.tl_compat import cast, mma
from gdnserve.ops.varlen import CHUNK, VarlenMeta, num_chunks


@triton.jit
def _gates(p_a, p_b, o_rows, m_rows, stride_a, stride_b, A_log, dt_bias):
    b_a = tl.load(p_a + o_rows * stride_a, mask=m_rows, other=0.).to(tl.float32) + dt_bias
    sp = tl.where(b_a > 20., b_a, tl.log(1. + tl.exp(tl.minimum(b_a, 20.))))
    b_g = tl.where(m_rows, -tl.exp(A_log) * sp, 0.)
    b_beta = tl.where(m_rows, tl.sigmoid(tl.load(p_b + o_rows * stride_b, mask=m_rows, other=0.).to(tl.float32)), 0.)
    return b_g, b_beta


@triton.jit
def _prep_tile(q, k, v, a, b, A_log, dt_bias, gcum, w, u, kn, qp, o, scale, t0, n_valid, i_h, i_s,
               s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_at, s_ah, s_bt, s_bh,
               R: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
               BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, DOT_PREC: tl.constexpr,
               INV_MODE: tl.constexpr, PREP_BF16: tl.constexpr, SPLIT: tl.constexpr, INV_BF16: tl.constexpr,
               NIT: tl.constexpr):
    """One key head's programs' share of a chunk tile of C rows (t0 .. t0 + n_valid valid)."""
    DT: tl.constexpr = w.dtype.element_ty
    o_c = tl.arange(0, C)
    m_rows = o_c < n_valid
    o_rows = t0 + o_c
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = tl.arange(0, BV)
    m_v = o_v < V

    b_k = _l2norm_rows(k + i_h * s_kh, o_rows, m_rows, s_kt, o_k, m_k)          # [C, BK] fp32
    if i_s == 0:   # the normalised keys for the state pass (one copy per key head)
        tl.store(kn + (o_rows[:, None].to(tl.int64) * (HV // R) + i_h) * K + o_k[None, :], cast(b_k, DT),
                 mask=m_rows[:, None] & m_k[None, :])
    if PREP_BF16:
        b_kd = cast(b_k, DT)
        b_kk = mma(b_kd, tl.trans(b_kd), DOT_PREC)                              # [C, C]
    else:
        b_kk = mma(b_k, tl.trans(b_k), DOT_PREC)
    strict = o_c[:, None] > o_c[None, :]
    eye = (o_c[:, None] == o_c[None, :]).to(tl.float32)

    RS: tl.constexpr = R // SPLIT
    for jj in range(RS):
        i_hv = i_h * R + i_s * RS + jj
        b_g, b_beta = _gates(a + i_hv * s_ah, b + i_hv * s_bh, o_rows, m_rows, s_at, s_bt,
                             tl.load(A_log + i_hv), tl.load(dt_bias + i_hv).to(tl.float32))
        b_gc = tl.cumsum(b_g, 0)
        tl.store(gcum + o_rows * HV + i_hv, b_gc, mask=m_rows)
        diff = tl.where(strict, b_gc[:, None] - b_gc[None, :], 0.)
        b_A = tl.where(strict, b_kk * b_beta[:, None] * tl.exp(diff), 0.)       # strictly lower [C, C]
        b_T = _inverse(b_A, eye, C, DOT_PREC, INV_MODE, INV_BF16, NIT, DT)

        b_kb = b_k * (b_beta * tl.exp(b_gc))[:, None]
        if PREP_BF16:
            b_Td = cast(b_T, DT)
            b_w = cast(mma(b_Td, cast(b_kb, DT), DOT_PREC), DT)
        else:
            b_w = cast(mma(b_T, b_kb, DOT_PREC), DT)
        m_rk = m_rows[:, None] & m_k[None, :]
        p_w = (o_rows[:, None].to(tl.int64) * HV + i_hv) * K + o_k[None, :]
        tl.store(w + p_w, b_w, mask=m_rk)
        b_v = tl.load(v + o_rows[:, None].to(tl.int64) * s_vt + i_hv * s_vh + o_v[None, :],
                      mask=m_rows[:, None] & m_v[None, :], other=0.).to(tl.float32)
        if PREP_BF16:
            b_u = cast(mma(b_Td, cast(b_v * b_beta[:, None], DT), DOT_PREC), DT)
        else:
            b_u = cast(mma(b_T, b_v * b_beta[:, None], DOT_PREC), DT)
        p_u = (o_rows[:, None].to(tl.int64) * HV + i_hv) * V + o_v[None, :]
        m_rv = m_rows[:, None] & m_v[None, :]
        tl.store(u + p_u, b_u, mask=m_rv)
        # O = s·[(M ⊙ Q Kᵀ) Ũ + Q' S₀ᵀ],  Q' = diag(Γ) Q − (M ⊙ Q Kᵀ) 𝒲  (M: causal, decayed)
        # the state-independent halves here; the state pass adds Q' S₀ᵀ to o in place. Q Kᵀ is formed per
        # value head, where it is used (short live ranges; one program per value head when split); with
        # PREP_BF16 q and k rounded to the activation dtype, as fla's output stage does
        b_q = _l2norm_rows(q + i_h * s_qh, o_rows, m_rows, s_qt, o_k, m_k)
        if PREP_BF16:
            b_q = cast(b_q, DT)
            b_qk = mma(b_q, tl.trans(b_kd), DOT_PREC)
        else:
            b_qk = mma(b_q, tl.trans(b_k), DOT_PREC)
        incl = (o_c[:, None] >= o_c[None, :]) & m_rows[:, None]
        b_M = tl.where(incl, b_qk * tl.exp(tl.where(incl, b_gc[:, None] - b_gc[None, :], 0.)), 0.)
        b_Md = cast(b_M, DT)
        b_oi = mma(b_Md, b_u, DOT_PREC)
        tl.store(o + p_u, cast(b_oi * scale, o.dtype.element_ty), mask=m_rv)
        b_qp = b_q.to(tl.float32) * tl.exp(b_gc)[:, None] - mma(b_Md, b_w, DOT_PREC)
        tl.store(qp + p_w, cast(b_qp * scale, DT), mask=m_rk)


@triton.jit
def _inverse(b_A, eye, C: tl.constexpr, DOT_PREC: tl.constexpr, INV_MODE: tl.constexpr, INV_BF16: tl.constexpr,
             NIT: tl.constexpr, DT: tl.constexpr):
    """(I + A)⁻¹ of a strictly lower [C, C] A."""
    if INV_MODE != 1:   # C = 64 only
        o_blk = tl.arange(0, 4)
        o_16 = tl.arange(0, 16)
        eye16 = (o_16[:, None] == o_16[None, :]).to(tl.float32)
        same_blk = (o_blk[:, None, None, None] == o_blk[None, None, :, None])     # [4,1,4,1]
        b_A4 = tl.reshape(b_A, (4, 16, 4, 16))
        b_Ad = tl.sum(tl.where(same_blk, b_A4, 0.), 2)                     # diagonal blocks [4, 16, 16]
        if INV_MODE == 0:   # forward substitution, batched over the four blocks
            b_Ti = tl.broadcast_to(eye16[None, :, :], (4, 16, 16))
            for i in tl.static_range(1, 16):
                sel = (o_16 == i)[None, :, None]
                row = tl.sum(tl.where(sel, b_Ad, 0.), 1)                    # [4, 16] = A[blk, i, :]
                upd = tl.sum(row[:, :, None] * b_Ti, 1)                     # [4, 16]
                b_Ti = tl.where(sel, b_Ti - upd[:, None, :], b_Ti)
        else:               # product form on the blocks: 6 batched 16x16 products (A_d^16 = 0)
            b_Pd = -b_Ad
            b_Ti = eye16[None, :, :] + b_Pd
            for _ in tl.static_range(3):
                b_Pd = mma(b_Pd, b_Pd, DOT_PREC)
                b_Ti = b_Ti + mma(b_Ti, b_Pd, DOT_PREC)
        b_D = tl.reshape(tl.where(same_blk, tl.expand_dims(b_Ti, 2), 0.), (C, C))   # blockdiag
        b_Ao = tl.reshape(tl.where(same_blk, 0., b_A4), (C, C))            # block-strictly-lower part
        b_N = mma(b_D, b_Ao, DOT_PREC)
        b_X = eye - b_N
        b_X = eye - mma(b_N, b_X, DOT_PREC)
        b_X = eye - mma(b_N, b_X, DOT_PREC)
        b_T = mma(b_X, b_D, DOT_PREC)
    else:
        # product form: (I + A)^-1 = prod_j (I + (-A)^(2^j)), A nilpotent (A^C = 0): NIT = log2(C) - 1 factors
        b_P = -b_A
        b_T = eye + b_P
        for _ in tl.static_range(NIT):
            if INV_BF16:   # bf16 operands, fp32 accumulation
                b_P = mma(cast(b_P, DT), cast(b_P, DT), DOT_PREC)
                b_T = b_T + mma(cast(b_T, DT), cast(b_P, DT), DOT_PREC)
            else:
                b_P = mma(b_P, b_P, DOT_PREC)
                b_T = b_T + mma(b_T, b_P, DOT_PREC)
    return b_T


@triton.jit
def chunk_prep_kernel(q, k, v, a, b, A_log, dt_bias, cu_seqlens, chunk_indices, gcum, w, u, kn, qp, o, scale,
                      s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_at, s_ah, s_bt, s_bh,
                      R: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, DOT_PREC: tl.constexpr,
                      INV_MODE: tl.constexpr, PREP_BF16: tl.constexpr, SPLIT: tl.constexpr, INV_BF16: tl.constexpr,
                      SHORT: tl.constexpr, SHORT_NIT: tl.constexpr):
    # SPLIT programs per key head, each taking R // SPLIT of its value heads (more programs for small grids).
    # A sequence of at most SHORT tokens (> 0) takes a SHORT-row tile (one chunk; the choice depends only on
    # the sequence's own length, so varlen results equal per-sequence results bit for bit).
    i_row, i_hs = tl.program_id(0), tl.program_id(1)
    i_h, i_s = i_hs // SPLIT, i_hs % SPLIT
    i_n = tl.load(chunk_indices + 2 * i_row)
    if i_n < 0:
        return
    i_c = tl.load(chunk_indices + 2 * i_row + 1)
    bos = tl.load(cu_seqlens + i_n)
    L = tl.load(cu_seqlens + i_n + 1) - bos
    if SHORT > 0 and L <= SHORT:
        _prep_tile(q, k, v, a, b, A_log, dt_bias, gcum, w, u, kn, qp, o, scale, bos, L, i_h, i_s,
                   s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_at, s_ah, s_bt, s_bh, R, HV, K, V, BK, BV, SHORT, DOT_PREC,
                   1, PREP_BF16, SPLIT, INV_BF16, SHORT_NIT)
    else:
        _prep_tile(q, k, v, a, b, A_log, dt_bias, gcum, w, u, kn, qp, o, scale, bos + i_c * C, L - i_c * C, i_h,
                   i_s, s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_at, s_ah, s_bt, s_bh, R, HV, K, V, BK, BV, C, DOT_PREC,
                   INV_MODE, PREP_BF16, SPLIT, INV_BF16, 5)


def _prec(v: torch.Tensor) -> str:
    return "ieee" if v.dtype == torch.float32 else "tf32"


def launch_prep(q, k, v, a, b, A_log, dt_bias, meta: VarlenMeta, ws: ChunkWorkspace, out: torch.Tensor,
                scale: float = 1.0):
    """The prep; writes the output's state-independent half s·M Ũ into ``out``."""
    cfg = chunk_config(q.device)
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    R = HV // H
    split = R if meta.num_chunk_rows * H < cfg.prep_split_below else 1
    kn, qp = ws.prep_buffers(H)
    short = cfg.short_prep
    launch(chunk_prep_kernel, (meta.num_chunk_rows, H * split), (
        q, k, v, a, b, A_log, dt_bias, meta.cu_seqlens, meta.chunk_indices, ws.gcum, ws.w, ws.u, kn, qp,
        out, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), a.stride(1),
        b.stride(0), b.stride(1),
        R, HV, K, V, max(pow2(K), cfg.prep_min_block), max(pow2(V), cfg.prep_min_block), CHUNK, _prec(v),
        cfg.inv_mode, cfg.prep_bf16 and v.dtype != torch.float32, split, cfg.inv_bf16 and v.dtype != torch.float32,
        short, max(short.bit_length() - 2, 0)),
        cfg.prep_warps, cfg.prep_stages)


def max_segments(meta: VarlenMeta, cfg: ChunkConfig) -> int:
    """Segments of the longest sequence (the state pass's grid has this many rows per sequence)."""
    nc = num_chunks(meta.max_len)
    return cdiv(nc, cfg.cp_seg_chunks) if nc >= cfg.cp_min_chunks else 1


def launch_state(q, k, v, ssm_pool, meta: VarlenMeta, src_slots, dst_slots, parents, ws: ChunkWorkspace,
                 scale: float, out):
    cfg = chunk_config(k.device)
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    R, BK = HV // H, pow2(K)
    sbv = min(cfg.state_bv, pow2(V))
    nvt = cdiv(V, sbv)
    N = meta.num_seqs
    ms = max_segments(meta, cfg)
    prec = _prec(v)
    seg_b = seg_p = ws.gcum
    kn, qp = ws.prep_buffers(H)
    if ms > 1:
        seg_b, seg_p = ws.seg_buffers(meta.num_chunk_rows // cfg.cp_seg_chunks + 1)
        gbv = min(cfg.seg_bv, pow2(max(K, V)))
        launch(chunk_seg_kernel, (cdiv(V, gbv) + cdiv(K, gbv), N * ms, HV), (
            kn, ws.w, ws.u, ws.gcum, seg_b, seg_p, meta.cu_seqlens, meta.chunk_offsets,
            ms, R, HV, K, V, BK, gbv, CHUNK, cfg.cp_min_chunks, cfg.cp_seg_chunks, prec),
            cfg.seg_warps)
    phases = parents is not None and ms == 1    # producers, then consumers: two launches
    tickets = ms > 1                            # CP: segments (and parents) hand over through tickets and flags
    nflags = N * HV * nvt
    sync = src_slots
    if tickets:   # ticket counter + ready flags (final states, segment starts), zeroed per call
        sync = ws.sync_buffer(1 + nflags * (1 + ms))
        sync.zero_()
    for phase in ((1, 2) if phases else (0,)):
        launch(chunk_state_kernel, (nvt, N * ms * HV), (
            kn, qp, ws.w, ws.u, ws.gcum, out, ssm_pool, seg_b, seg_p,
            meta.cu_seqlens, meta.chunk_offsets, src_slots, dst_slots, parents if parents is not None else src_slots,
            sync, ms, nflags,
            R, HV, K, V, BK, sbv, CHUNK, ms > 1, cfg.cp_min_chunks, cfg.cp_seg_chunks, parents is not None, tickets,
            prec, cfg.comb_prec if prec == "tf32" else "ieee", min(cfg.comb_block, BK), phase),
            cfg.state_warps, cfg.state_stages)


def chunk_gdn_triton(q, k, v, a, b, A_log, dt_bias, ssm_pool, meta: VarlenMeta, src_slots, dst_slots, parents,
                     scale: float, out: torch.Tensor, workspace: ChunkWorkspace | None) -> torch.Tensor:
    """The two-launch path (prep, state pass); ``ops/gdn/chunk.py`` dispatches ``ChunkConfig.fused_main`` to
    ``chunk_fused_triton`` instead."""
    HV, K, V = v.shape[1], q.shape[2], v.shape[2]
    ws = ChunkWorkspace.ensure(workspace, meta, HV, K, V, v.dtype, q.device)
    launch_prep(q, k, v, a, b, A_log, dt_bias, meta, ws, out, scale)
    launch_state(q, k, v, ssm_pool, meta, src_slots, dst_slots, parents, ws, scale, out)
    return out
