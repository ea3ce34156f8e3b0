"""Triton paths of the paged-KV ops (CUDA; CPU tests under TRITON_INTERPRET=1). Same contracts as the
public functions in ``paged.py``; no host reads, so they can be captured in CUDA graphs.

``paged_attention_kernel``: the first attention kernel, kept as the benchmark's baseline and a second opinion in
the tests (``paged_attention`` runs ``flash_triton.py``'s kernel): one program per (sequence, block of 16
queries, query head); online softmax in fp32 over the sequence's kv positions in blocks of 32, each position's
slot looked up through the page table, causal by absolute position; positions below ``KV_START`` are masked.
"""
from __future__ import annotations

import triton
import triton.language as tl

from gdnserve.ops.launch import cdiv, launch, pow2
from gdnserve.ops.tl_compat import cast, mma


@triton.jit
def store_kv_kernel(k, v, k_cache, v_cache, slot_mapping, token_index, s_kt, s_kh, s_vt, s_vh,
                    KVH: tl.constexpr, Dh: tl.constexpr, BD: tl.constexpr, HAS_INDEX: tl.constexpr):
    i, h = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slot_mapping + i)
    if slot < 0:
        return
    t = i.to(tl.int64)
    if HAS_INDEX:
        t = tl.load(token_index + i)
    o_d = tl.arange(0, BD)
    m_d = o_d < Dh
    dst = (slot * KVH + h) * Dh + o_d
    tl.store(k_cache + dst, tl.load(k + t * s_kt + h * s_kh + o_d, mask=m_d), mask=m_d)
    tl.store(v_cache + dst, tl.load(v + t * s_vt + h * s_vh + o_d, mask=m_d), mask=m_d)


@triton.jit
def paged_attention_kernel(q, k_cache, v_cache, o, cu_q, kv_lens, page_table, scale,
                           s_qt, s_qh, s_ot, s_oh, s_pt,
                           G: tl.constexpr, KVH: tl.constexpr, Dh: tl.constexpr, BD: tl.constexpr,
                           PS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, KV_START: tl.constexpr):
    i_n, i_b, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q0 = tl.load(cu_q + i_n)
    Lq = tl.load(cu_q + i_n + 1) - q0
    L = tl.load(kv_lens + i_n)
    if (i_b * BM >= Lq) | (L == 0):
        return
    o_m = i_b * BM + tl.arange(0, BM)
    m_m = o_m < Lq
    pos = L - Lq + o_m                                   # absolute position of each query
    o_d = tl.arange(0, BD)
    m_d = o_d < Dh
    rows = (q0 + o_m).to(tl.int64)
    b_q = tl.load(q + rows[:, None] * s_qt + i_h * s_qh + o_d[None, :], mask=m_m[:, None] & m_d[None, :], other=0.)
    kvh = i_h // G
    m_i = tl.full([BM], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, BD], dtype=tl.float32)
    end = tl.minimum(L, L - Lq + i_b * BM + BM)          # the block's last query sees positions < end
    for j0 in range(0, end, BN):
        o_j = j0 + tl.arange(0, BN)
        m_j = (o_j < end) & (o_j >= KV_START)
        page = tl.load(page_table + i_n * s_pt + o_j // PS, mask=m_j, other=0).to(tl.int64)
        addr = ((page * PS + o_j % PS) * KVH + kvh) * Dh
        b_k = tl.load(k_cache + addr[:, None] + o_d[None, :], mask=m_j[:, None] & m_d[None, :], other=0.)
        b_v = tl.load(v_cache + addr[:, None] + o_d[None, :], mask=m_j[:, None] & m_d[None, :], other=0.)
        s = mma(b_q, tl.trans(b_k), "ieee") * scale
        s = tl.where((o_j[None, :] <= pos[:, None]) & m_j[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + mma(cast(p, b_v.dtype), b_v, "ieee")
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o + rows[:, None] * s_ot + i_h * s_oh + o_d[None, :], cast(out, o.dtype.element_ty),
             mask=m_m[:, None] & m_d[None, :])


def store_kv_triton(k, v, k_cache, v_cache, slot_mapping, token_index) -> None:
    M = slot_mapping.shape[0]
    if M == 0:
        return
    T, KVH, Dh = k.shape
    launch(store_kv_kernel, (M, KVH), (k, v, k_cache, v_cache, slot_mapping, token_index, k.stride(0), k.stride(1),
                                       v.stride(0), v.stride(1), KVH, Dh, pow2(Dh), token_index is not None), 1)


def copy_pages_triton(k_cache, v_cache, src_pages, dst_pages) -> None:
    for c in (k_cache, v_cache):                          # device-side index ops: no host reads
        c.index_copy_(0, dst_pages, c.index_select(0, src_pages))


def paged_attention_rowwise_triton(q, k_cache, v_cache, cu_seqlens_q, kv_lens, page_table, scale, out,
                           max_q_len: int | None = None, kv_start: int = 0) -> None:
    T, QH, Dh = q.shape
    N = kv_lens.shape[0]
    if T == 0 or N == 0:
        return
    KVH, PS = k_cache.shape[2], k_cache.shape[1]
    BM = 16
    nb = cdiv(max_q_len if max_q_len is not None else T, BM)
    if nb == 0:
        return
    launch(paged_attention_kernel, (N, nb, QH), (
        q, k_cache, v_cache, out, cu_seqlens_q, kv_lens, page_table, scale, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), page_table.stride(0), QH // KVH, KVH, Dh, pow2(Dh), PS, BM, 32, kv_start), 4)
