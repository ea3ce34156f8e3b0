"""FlashAttention-2-style paged attention (Triton; CUDA, CPU tests under TRITON_INTERPRET=1): the Triton path of
``paged_attention`` for prefill chunks, verify rows and decode alike. Same contract as the public function in
``paged.py``; no host reads, so it can be captured in CUDA graphs.

One program per (query block, sequence, kv head[, kv split]). **GQA packing**: the program's BM tile rows are
``BQ = BM / GP`` query positions x the ``GP = pow2(G)`` query heads that share the kv head (row ``r``: query
``r // GP``, head ``kvh * G + r % GP``; heads ``>= G`` are padding rows), so every K/V tile is read once per kv
head and even a decode row (BQ = 1 or 2) feeds the tensor cores with M = 16. K/V tiles of BN positions are
gathered through the page table (any page size). Online softmax in fp32 (base 2, the scale folded into
``log2 e``); the key loop runs in two phases: blocks wholly below the block's first query position without any
mask, then the diagonal blocks with the causal mask, up to the last query's causal bound (fully masked blocks are
never visited).

**Flash-decoding** (``Config.split``): for small grids (decode / verify of few sequences) the key range is cut
into ``n_split`` pieces of ``split`` positions (sized from the page-table width, a host int); each piece writes
its fp32 partial (acc, max, sum) to scratch and ``combine_rows_kernel`` merges the pieces that hold keys (counted
on the device from kv_lens): one program per (query block, sequence, query head), all pieces' maxima as one vector,
the partial outputs 8 pieces per load. (The first merge, one program per kv head walking the pieces one dependent
load after another, took 54.7 us against this one's 18.4 at B = 1 over a 8,192-token context on the H200, 72 pieces
on 2 SMs: benchmarks/results/attention_long_decode_h200.md; deleted since.) Pieces past a sequence's length exit at once; a tile whose keys all fall in piece 0
(a short context under a wide page table) is written by that piece directly and skipped by the combine.

Configs are chosen from shapes only (``choose_config``): ``max_q_len``, G, Dh, dtype, the page-table width, N, the
SM count.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gdnserve.ops.launch import cdiv, launch, pow2
from gdnserve.ops.tl_compat import cast, mma

LOG2E = 1.4426950408889634
NEG: tl.constexpr = tl.constexpr(-1.0e30)   # finite "minus infinity" for running maxima: exp2(NEG - NEG) = 1


@dataclass(frozen=True)
class Config:
    BM: int              # tile rows = BQ query positions x GP heads
    BN: int              # key positions per tile
    num_warps: int
    num_stages: int
    split: int = 0       # key positions per flash-decoding piece (0 = one piece, the output written directly)
    n_split: int = 1


_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8                                     # the interpreter: small, so CPU tests see splits
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SM_COUNT:
        _SM_COUNT[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SM_COUNT[i]


def choose_config(max_q: int, G: int, Dh: int, elem_bytes: int, kv_cap: int, N: int, KVH: int, n_sm: int) -> Config:
    """From host ints only. ``kv_cap``: the page-table width x page size (a bound on any kv length)."""
    GP = pow2(G)
    BM = min(128, max(16, pow2(max(max_q, 1) * GP), GP))
    BM = max(BM, GP)
    BD = pow2(Dh)
    if BM >= 128:                                     # prefill: a full tensor-core tile
        if N * KVH * cdiv(max_q, BM // GP) < n_sm:    # a short prefill: smaller blocks fill more SMs
            BM = max(64, GP)
        cfg = Config(BM, 64, 8, 3) if BM >= 128 else Config(BM, 64, 4, 2)
    elif BM == 64:
        cfg = Config(64, 64, 4, 2)
    else:                                             # decode / verify rows
        cfg = Config(BM, 64, 4, 2)
    if elem_bytes >= 4 and BD >= 128:                 # fp32 tiles: half the shared memory per position
        cfg = Config(min(cfg.BM, max(64, GP)), 32, 4, 1)
    if cfg.BM <= 32:                                  # flash-decoding where the grid is small
        progs = N * KVH * cdiv(max_q, cfg.BM // GP)
        if progs < n_sm and kv_cap > 2 * cfg.BN:
            want = min(cdiv(2 * n_sm, progs), cdiv(kv_cap, 2 * cfg.BN))
            split = cdiv(cdiv(kv_cap, want), cfg.BN) * cfg.BN
            n_split = cdiv(kv_cap, split)
            if n_split > 1:
                cfg = Config(cfg.BM, cfg.BN, cfg.num_warps, cfg.num_stages, split, n_split)
    return cfg


@triton.jit
def _kv_block(acc, m_i, l_i, b_q, k_cache, v_cache, pt_row, j0, hi, pos, kvh, qk_scale,
              KVH: tl.constexpr, Dh: tl.constexpr, BD: tl.constexpr, PS: tl.constexpr, BN: tl.constexpr,
              KV_START: tl.constexpr, MASK: tl.constexpr):
    """One tile of BN key positions from j0: scores, online-softmax update, P.V. MASK: positions >= hi, below
    KV_START and past each row's causal bound ``pos`` are masked (else the whole tile is live for every row)."""
    o_j = j0 + tl.arange(0, BN)
    o_d = tl.arange(0, BD)
    if MASK:
        m_j = (o_j < hi) & (o_j >= KV_START)
        page = tl.load(pt_row + o_j // PS, mask=m_j, other=0).to(tl.int64)
    else:
        page = tl.load(pt_row + o_j // PS).to(tl.int64)
    addr = ((page * PS + o_j % PS) * KVH + kvh) * Dh
    ptr = addr[:, None] + o_d[None, :]
    if MASK:
        if BD == Dh:
            mk = m_j[:, None]
        else:
            mk = m_j[:, None] & (o_d[None, :] < Dh)
        b_k = tl.load(k_cache + ptr, mask=mk, other=0.)
        b_v = tl.load(v_cache + ptr, mask=mk, other=0.)
    elif BD == Dh:
        b_k = tl.load(k_cache + ptr)
        b_v = tl.load(v_cache + ptr)
    else:
        mk = o_d[None, :] < Dh
        b_k = tl.load(k_cache + ptr, mask=mk, other=0.)
        b_v = tl.load(v_cache + ptr, mask=mk, other=0.)
    s = mma(b_q, tl.trans(b_k), "ieee") * qk_scale
    if MASK:
        s = tl.where((o_j[None, :] <= pos[:, None]) & m_j[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + mma(cast(p, b_v.dtype), b_v, "ieee")
    return acc, m_new, l_i


@triton.jit
def _rows(cu_q, kv_lens, i_b, i_n, G: tl.constexpr, GP: tl.constexpr, BM: tl.constexpr):
    """The tile's rows: sequence start q0, Lq, L; per row the query index, head offset, validity."""
    BQ: tl.constexpr = BM // GP
    q0 = tl.load(cu_q + i_n)
    Lq = tl.load(cu_q + i_n + 1) - q0
    L = tl.load(kv_lens + i_n)
    r = tl.arange(0, BM)
    qi = i_b * BQ + r // GP
    g = r % GP
    valid = (qi < Lq) & (g < G)
    return q0, Lq, L, qi, g, valid


@triton.jit
def flash_attention_kernel(q, k_cache, v_cache, o, o_part, m_part, l_part, cu_q, kv_lens, page_table, qk_scale,
                           s_qt, s_qh, s_ot, s_oh, s_pt, T, split,
                           G: tl.constexpr, GP: tl.constexpr, QH: tl.constexpr, KVH: tl.constexpr,
                           Dh: tl.constexpr, BD: tl.constexpr, PS: tl.constexpr, BM: tl.constexpr,
                           BN: tl.constexpr, KV_START: tl.constexpr, SPLIT: tl.constexpr):
    BQ: tl.constexpr = BM // GP
    i_b = tl.num_programs(0) - 1 - tl.program_id(0)                 # the longest causal blocks first
    i_n = tl.program_id(1)
    kvh = tl.program_id(2) % KVH
    i_s = tl.program_id(2) // KVH
    q0, Lq, L, qi, g, valid = _rows(cu_q, kv_lens, i_b, i_n, G, GP, BM)
    first = L - Lq + i_b * BQ                          # the block's first query position
    end = tl.minimum(L, first + BQ)                    # its last query sees positions < end
    lo = i_s * split                                   # split: positions per piece (0 without SPLIT)
    if (i_b * BQ >= Lq) | (L == 0) | (lo >= end):      # no rows, padding, or a piece past the keys
        return
    hi = end
    if SPLIT:
        hi = tl.minimum(end, lo + split)
    mid = tl.maximum(tl.minimum((first + 1) // BN * BN, hi), lo)   # below mid: every row sees every key
    pos = L - Lq + qi
    o_d = tl.arange(0, BD)
    h = kvh * G + g
    rows = (q0 + qi).to(tl.int64)
    m_q = valid[:, None] & (o_d[None, :] < Dh)
    b_q = tl.load(q + rows[:, None] * s_qt + h[:, None] * s_qh + o_d[None, :], mask=m_q, other=0.)
    pt_row = page_table + i_n.to(tl.int64) * s_pt
    m_i = tl.full([BM], NEG, dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, BD], dtype=tl.float32)
    for j0 in range(lo, mid, BN):
        acc, m_i, l_i = _kv_block(acc, m_i, l_i, b_q, k_cache, v_cache, pt_row, j0, hi, pos, kvh, qk_scale,
                                  KVH, Dh, BD, PS, BN, KV_START, KV_START > 0)
    for j0 in range(mid, hi, BN):
        acc, m_i, l_i = _kv_block(acc, m_i, l_i, b_q, k_cache, v_cache, pt_row, j0, hi, pos, kvh, qk_scale,
                                  KVH, Dh, BD, PS, BN, KV_START, True)
    direct = True                                      # the only piece: the output itself
    if SPLIT:
        direct = end <= split
    if direct:
        out = acc / l_i[:, None]
        tl.store(o + rows[:, None] * s_ot + h[:, None] * s_oh + o_d[None, :], cast(out, o.dtype.element_ty),
                 mask=m_q)
    else:                                              # several pieces: the fp32 partials for the combine
        prow = (i_s * T + q0 + qi).to(tl.int64) * QH + h          # [n_split, T, QH] row of each tile row
        tl.store(m_part + prow, m_i, mask=valid)
        tl.store(l_part + prow, l_i, mask=valid)
        tl.store(o_part + prow[:, None] * Dh + o_d[None, :], acc, mask=m_q)


@triton.jit
def combine_rows_kernel(o, o_part, m_part, l_part, cu_q, kv_lens, s_ot, s_oh, T, split,
                        G: tl.constexpr, GP: tl.constexpr, QH: tl.constexpr, Dh: tl.constexpr, BD: tl.constexpr,
                        BQ: tl.constexpr, NSP: tl.constexpr, SP: tl.constexpr):
    """Merge the flash-decoding pieces that start below the query block's causal end (each wrote every valid row
    of its tile; weights exp2(m_s - max) in fp32): one program per (query block, sequence, query head), its BQ rows
    one after another; per row the maxima of all pieces in one vector (NSP = pow2(n_split)), then the partial
    outputs SP pieces per load. A block whose keys fit in piece 0 was written by that piece directly."""
    i_b, i_n, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q0 = tl.load(cu_q + i_n)
    Lq = tl.load(cu_q + i_n + 1) - q0
    L = tl.load(kv_lens + i_n)
    if (i_b * BQ >= Lq) | (L == 0):
        return
    end = tl.minimum(L, L - Lq + i_b * BQ + BQ)
    n_act = (end + split - 1) // split
    if n_act <= 1:                                     # piece 0 wrote the output itself
        return
    o_d = tl.arange(0, BD)
    m_d = o_d < Dh
    o_s = tl.arange(0, NSP)
    o_c = tl.arange(0, SP)
    for r in tl.static_range(BQ):
        qi = i_b * BQ + r
        if qi < Lq:
            row = (q0 + qi).to(tl.int64)
            m_v = tl.load(m_part + (o_s.to(tl.int64) * T + row) * QH + h, mask=o_s < n_act, other=NEG)
            m_max = tl.max(m_v, 0)
            l_v = tl.load(l_part + (o_s.to(tl.int64) * T + row) * QH + h, mask=o_s < n_act, other=0.)
            l_sum = tl.sum(l_v * tl.math.exp2(m_v - m_max), 0)
            acc = tl.zeros([BD], dtype=tl.float32)
            for c0 in range(0, n_act, SP):
                s_c = c0 + o_c
                live = s_c < n_act
                prow = (s_c.to(tl.int64) * T + row) * QH + h
                w = tl.math.exp2(tl.load(m_part + prow, mask=live, other=NEG) - m_max)
                a = tl.load(o_part + prow[:, None] * Dh + o_d[None, :], mask=live[:, None] & m_d[None, :], other=0.)
                acc += tl.sum(a * w[:, None], 0)
            tl.store(o + row * s_ot + h * s_oh + o_d, cast(acc / l_sum, o.dtype.element_ty), mask=m_d)


def flash_attention_triton(q, k_cache, v_cache, cu_seqlens_q, kv_lens, page_table, scale, out,
                           max_q_len: int | None = None, kv_start: int = 0, config: Config | None = None) -> None:
    """The launcher (arguments validated by ``paged_attention``). ``config``: None = ``choose_config``."""
    T, QH, Dh = q.shape
    N = kv_lens.shape[0]
    if T == 0 or N == 0:
        return
    KVH, PS = k_cache.shape[2], k_cache.shape[1]
    G = QH // KVH
    GP = pow2(G)
    mq = min(max_q_len if max_q_len is not None else T, T)
    if mq == 0:
        return
    cap = page_table.shape[1] * PS
    cfg = config or choose_config(mq, G, Dh, q.element_size(), cap, N, KVH, sm_count(q.device))
    BD = pow2(Dh)
    nqb = cdiv(mq, cfg.BM // GP)
    split = cfg.split if cfg.n_split > 1 else 0
    if split and (split % cfg.BN or split * cfg.n_split < cap):
        raise ValueError(f"config: split {split} must be a multiple of BN {cfg.BN} and n_split x split must cover "
                         f"the page table's {cap} positions")
    if split:
        o_part = torch.empty(cfg.n_split, T, QH, Dh, dtype=torch.float32, device=q.device)
        m_part = torch.empty(cfg.n_split, T, QH, dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
    else:
        o_part = m_part = l_part = out
    launch(flash_attention_kernel, (nqb, N, KVH * (cfg.n_split if split else 1)), (
        q, k_cache, v_cache, out, o_part, m_part, l_part, cu_seqlens_q, kv_lens, page_table, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), page_table.stride(0), T, split,
        G, GP, QH, KVH, Dh, BD, PS, cfg.BM, cfg.BN, kv_start, split > 0), cfg.num_warps, cfg.num_stages)
    if split:
        launch(combine_rows_kernel, (nqb, N, QH), (
            out, o_part, m_part, l_part, cu_seqlens_q, kv_lens, out.stride(0), out.stride(1), T, split,
            G, GP, QH, Dh, BD, cfg.BM // GP, pow2(cfg.n_split), 8), 4)
