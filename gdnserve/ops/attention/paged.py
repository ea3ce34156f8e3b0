"""Attention over a paged KV cache: store this step's K/V into page slots, copy pages on write, and varlen
causal attention for prefill chunks and decode rows alike.

Layout per attention layer: ``k_cache, v_cache: [num_pages, page_size, KVH, Dh]`` (activation dtype,
contiguous). Physical slot ``s = page * page_size + offset``; logical position ``p`` of sequence ``n`` lives
in page ``page_table[n, p // page_size]`` at offset ``p % page_size``.

File order: PyTorch path (any device) -> public functions, which validate once (shapes, dtypes, devices;
never contents) and dispatch through ``_IMPLS``. The PyTorch path reads the small index vectors on the
host and checks their contents there (a device sync on CUDA: it is the CPU / reference path). The Triton paths
(``paged_triton.py``: store_kv, copy_pages; ``flash_triton.py``: attention) register in ``_IMPLS``;
``backend="auto"`` runs them on CUDA tensors.
"""
from __future__ import annotations

import torch

from gdnserve.ops.attention.flash_triton import flash_attention_triton
from gdnserve.ops.attention.paged_triton import copy_pages_triton, store_kv_triton
from gdnserve.ops.backend import Backend, resolve
from gdnserve.ops.checks import ACT_DTYPES, check_contiguous, check_index, check_tensor

I64 = torch.int64
Q_BLOCK_ELEMS = 1 << 24  # fp32 score elements per query block (64 MiB) in the PyTorch path


# ------------------------------------------------------------------------------------------ PyTorch path

def _first_bad(bad: torch.Tensor) -> int:
    return int(bad.nonzero()[0, 0])


def store_kv_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, token_index: torch.Tensor | None) -> None:
    T, KVH, Dh = k.shape
    capacity = k_cache.shape[0] * k_cache.shape[1]
    s = slot_mapping
    bad = (s < -1) | (s >= capacity)
    if bad.any():
        i = _first_bad(bad)
        raise ValueError(f"slot_mapping[{i}] = {int(s[i])}: expected -1 or a slot in 0..{capacity - 1}")
    live = (s >= 0).nonzero().squeeze(1)
    if live.numel() == 0:
        return
    slots = s[live]
    toks = live if token_index is None else token_index[live]
    bad = (toks < 0) | (toks >= T)
    if bad.any():
        i = int(live[_first_bad(bad)])
        raise ValueError(f"token_index[{i}] = {int(token_index[i])}: expected a token row in 0..{T - 1}")
    if slots.unique().numel() != slots.numel():  # two writers of one slot: the result would be racy
        u, c = slots.unique(return_counts=True)
        raise ValueError(f"slot_mapping: slot {int(u[_first_bad(c > 1)])} is written more than once")
    k_cache.view(-1, KVH, Dh).index_copy_(0, slots, k.index_select(0, toks))
    v_cache.view(-1, KVH, Dh).index_copy_(0, slots, v.index_select(0, toks))


def copy_pages_torch(k_cache: torch.Tensor, v_cache: torch.Tensor, src_pages: torch.Tensor,
                     dst_pages: torch.Tensor) -> None:
    NP = k_cache.shape[0]
    for name, t in (("src_pages", src_pages), ("dst_pages", dst_pages)):
        bad = (t < 0) | (t >= NP)
        if bad.any():
            i = _first_bad(bad)
            raise ValueError(f"{name}[{i}] = {int(t[i])}: expected a page in 0..{NP - 1}")
    if dst_pages.unique().numel() != dst_pages.numel():
        raise ValueError(f"dst_pages: pages must be distinct, got {dst_pages.tolist()}")
    if torch.isin(dst_pages, src_pages).any():
        raise ValueError(f"dst_pages: must not overlap src_pages, got src {src_pages.tolist()}, "
                         f"dst {dst_pages.tolist()}")
    k_cache.index_copy_(0, dst_pages, k_cache.index_select(0, src_pages))
    v_cache.index_copy_(0, dst_pages, v_cache.index_select(0, src_pages))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """One sequence: q [Lq, QH, Dh], k/v [Lk, KVH, Dh] contiguous in position; fp32 scores, softmax and
    accumulation; writes out [Lq, QH, Dh]. Query blocks bound the score tensor's memory."""
    Lq, QH, Dh = q.shape
    Lk, KVH = k.shape[0], k.shape[1]
    g = QH // KVH
    kf, vf = k.float(), v.float()
    qf = q.float().reshape(Lq, KVH, g, Dh)
    ctx = Lk - Lq                                   # positions before the first query
    block = max(1, Q_BLOCK_ELEMS // (QH * Lk))
    cols = torch.arange(Lk, device=q.device)
    for b0 in range(0, Lq, block):
        b1 = min(Lq, b0 + block)
        s = torch.einsum("qhgd,khd->hgqk", qf[b0:b1], kf) * scale          # [KVH, g, B, Lk]
        rows = torch.arange(ctx + b0, ctx + b1, device=q.device)
        s.masked_fill_(cols[None, :] > rows[:, None], float("-inf"))      # causal (key 0 is always live)
        p = torch.softmax(s, dim=-1)
        o = torch.einsum("hgqk,khd->qhgd", p, vf).reshape(b1 - b0, QH, Dh)
        out[b0:b1].copy_(o)


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          cu_seqlens_q: torch.Tensor, kv_lens: torch.Tensor, page_table: torch.Tensor,
                          scale: float, out: torch.Tensor, kv_start: int = 0, max_q_len: int | None = None) -> None:
    """Loops over sequences: gathers each one's pages into contiguous K/V (from ``kv_start`` on), then
    :func:`_attend` (``max_q_len`` is a launch-grid hint of the Triton path, not needed here)."""
    T = q.shape[0]
    NP, P, KVH, Dh = k_cache.shape
    max_pages = page_table.shape[1]
    cu, lens = cu_seqlens_q.tolist(), kv_lens.tolist()   # host copies of the small index vectors
    if cu[0] < 0 or cu[-1] > T or any(a > b for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens_q: expected non-decreasing offsets in 0..{T} (T = q.shape[0]), got {cu}")
    for n, Lk in enumerate(lens):
        start, end = cu[n], cu[n + 1]
        Lq = end - start
        if Lq == 0 or Lk == 0:                     # padding sequence: its rows are not written
            continue
        if Lk < Lq + kv_start or Lk > max_pages * P:
            raise ValueError(f"kv_lens[{n}] = {Lk}: expected {Lq + kv_start} (its query rows"
                             f"{' + kv_start' if kv_start else ''}) .. {max_pages * P} (page_table width "
                             f"{max_pages} x page_size {P})")
        pages = page_table[n, : -(-Lk // P)].to(I64)
        bad = (pages < 0) | (pages >= NP)
        if bad.any():
            i = _first_bad(bad)
            raise ValueError(f"page_table[{n}, {i}] = {int(pages[i])}: expected a page in 0..{NP - 1}")
        k = k_cache.index_select(0, pages).view(-1, KVH, Dh)[kv_start:Lk]
        v = v_cache.index_select(0, pages).view(-1, KVH, Dh)[kv_start:Lk]
        _attend(q[start:end], k, v, scale, out[start:end])



_IMPLS = {
    "store_kv": {"torch": store_kv_torch, "triton": store_kv_triton},
    "copy_pages": {"torch": copy_pages_torch, "triton": copy_pages_triton},
    "paged_attention": {"torch": paged_attention_torch, "triton": flash_attention_triton},
}


def _dispatch(op: str, backend: Backend, ref: torch.Tensor):
    impl = resolve(backend, ref)
    fn = _IMPLS[op].get(impl)
    if fn is None:
        if backend != "auto":
            raise ValueError(f"backend={backend!r}: {op} has no {impl} path yet (use 'torch' or 'auto')")
        fn = _IMPLS[op]["torch"]
    return fn


# ------------------------------------------------------------------------------------------ public ops

def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, KVH: int | None, Dh: int,
                  dtype: torch.dtype, device: torch.device) -> None:
    check_tensor("k_cache", k_cache, [None, None, KVH, Dh], [dtype], device)
    check_contiguous("k_cache", k_cache)
    check_tensor("v_cache", v_cache, list(k_cache.shape), [dtype], device)
    check_contiguous("v_cache", v_cache)


def _check_index64(name: str, t: torch.Tensor | None, n: int | None, device: torch.device) -> None:
    check_tensor(name, t, (n,), (I64,), device)
    check_contiguous(name, t)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, token_index: torch.Tensor | None = None, *,
             backend: Backend = "auto") -> None:
    """Write K/V of this step's tokens into their page slots.

    k, v: [T, KVH, Dh] (bf16/fp16/fp32, the caches' dtype), last dim stride 1
    k_cache, v_cache: [num_pages, page_size, KVH, Dh], contiguous, updated in place
    slot_mapping: [M] int64: entry i writes token token_index[i] to slot page * page_size + offset;
        -1 = skip. Live slots must be distinct.
    token_index: [M] int64 token rows in 0..T-1, or None (= 0..M-1, then M must equal T). A token may
        appear several times: that is how a producer's tokens of a partially filled shared tail page are
        also written into each consumer's copy-on-write page in the same step (engine/cache/page_pool.py).
    """
    check_tensor("k", k, [None, None, None], ACT_DTYPES)
    T, KVH, Dh = k.shape
    check_tensor("v", v, [T, KVH, Dh], [k.dtype], k.device)
    _check_caches(k_cache, v_cache, KVH, Dh, k.dtype, k.device)
    _check_index64("slot_mapping", slot_mapping, None, k.device)
    M = slot_mapping.shape[0]
    if token_index is None:
        if M != T:
            raise ValueError(f"slot_mapping: without token_index expected T = {T} entries (one per token), got {M}")
    else:
        _check_index64("token_index", token_index, M, k.device)
    _dispatch("store_kv", backend, k)(k, v, k_cache, v_cache, slot_mapping, token_index)


def copy_pages(k_cache: torch.Tensor, v_cache: torch.Tensor, src_pages: torch.Tensor, dst_pages: torch.Tensor, *,
               backend: Backend = "auto") -> None:
    """Copy-on-write of whole pages: page dst_pages[i] = page src_pages[i] in both caches.

    k_cache, v_cache: [num_pages, page_size, KVH, Dh], contiguous, updated in place
    src_pages, dst_pages: [P] int64; dst pages distinct and not among the src pages
    """
    check_tensor("k_cache", k_cache, [None, None, None, None], ACT_DTYPES)
    _check_caches(k_cache, v_cache, None, k_cache.shape[3], k_cache.dtype, k_cache.device)
    _check_index64("src_pages", src_pages, None, k_cache.device)
    _check_index64("dst_pages", dst_pages, src_pages.shape[0], k_cache.device)
    _dispatch("copy_pages", backend, k_cache)(k_cache, v_cache, src_pages, dst_pages)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    kv_lens: torch.Tensor, page_table: torch.Tensor, *, scale: float,
                    out: torch.Tensor | None = None, kv_start: int = 0, max_q_len: int | None = None,
                    backend: Backend = "auto") -> torch.Tensor:
    """Causal attention of N sequences' new queries over their paged K/V (prefill chunks and decode alike).

    q: [T, QH, Dh] (bf16/fp16/fp32), last dim stride 1; QH = g * KVH (query head h reads kv head h // g)
    k_cache, v_cache: [num_pages, page_size, KVH, Dh] q.dtype, contiguous (this step's K/V already stored)
    cu_seqlens_q: [N+1] int32: sequence n owns q rows [cu[n], cu[n+1]) (Lq rows), cu[N] <= T
    kv_lens: [N] int32: the sequence's length including its Lq new tokens (its queries are the LAST Lq
        positions); query i attends to positions 0 .. kv_lens[n] - Lq + i
    page_table: [N, max_pages] int32: logical page p of sequence n -> physical page (entries past
        ceil(kv_lens[n] / page_size) are not read)
    scale: softmax scale (usually Dh ** -0.5); scores, softmax and accumulation in fp32
    out: [T, QH, Dh] q.dtype, last dim stride 1; or None (fresh, uninitialised)
    kv_start: positions below it are never read (query i attends kv_start .. kv_lens[n] - Lq + i; each
        query must see at least one position). The MTP layer's cache uses 1: its position 0 holds nothing.
    max_q_len: a host int >= every sequence's Lq (None = T); sizes the Triton grid's query-block axis and picks
        its tiles (decode / verify tiles, flash-decoding splits), so decode (1) and verify (k + 1) steps do not
        launch prefill blocks. Must be a true bound.
    returns o: [T, QH, Dh] in q.dtype. Sequences with kv_lens[n] == 0 or Lq == 0 are padding: skipped, and
        rows not covered by a live sequence are not written.
    """
    check_tensor("q", q, [None, None, None], ACT_DTYPES)
    T, QH, Dh = q.shape
    check_tensor("k_cache", k_cache, [None, None, None, Dh], [q.dtype], q.device)
    KVH = k_cache.shape[2]
    _check_caches(k_cache, v_cache, KVH, Dh, q.dtype, q.device)
    if QH % KVH:
        raise ValueError(f"q: {QH} query heads is not a multiple of the caches' {KVH} kv heads")
    check_index("cu_seqlens_q", cu_seqlens_q, None, q.device)
    N = cu_seqlens_q.shape[0] - 1
    if N < 0:
        raise ValueError("cu_seqlens_q: expected N+1 >= 1 entries, got 0")
    check_index("kv_lens", kv_lens, N, q.device)
    check_tensor("page_table", page_table, [N, None], [torch.int32], q.device)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
        raise ValueError(f"scale: expected a positive float, got {scale!r}")
    if not isinstance(kv_start, int) or isinstance(kv_start, bool) or kv_start < 0:
        raise ValueError(f"kv_start: expected an int >= 0, got {kv_start!r}")
    if max_q_len is not None and (not isinstance(max_q_len, int) or isinstance(max_q_len, bool) or max_q_len < 0):
        raise ValueError(f"max_q_len: expected None or an int >= 0, got {max_q_len!r}")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        check_tensor("out", out, [T, QH, Dh], [q.dtype], q.device)
    _dispatch("paged_attention", backend, q)(q, k_cache, v_cache, cu_seqlens_q, kv_lens, page_table,
                                             float(scale), out, kv_start=kv_start, max_q_len=max_q_len)
    return out
