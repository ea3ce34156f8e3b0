"""Paged attention, store_kv and copy_pages against the float64 reference on contiguous per-sequence K/V.
Caches are NaN-poisoned except where tokens were stored and pages are placed by random permutations, so a
path that reads an unwritten position or the wrong page fails. Fresh random inputs every run (seed printed)."""
from __future__ import annotations

import math
import random

import pytest
import torch

import gdnserve.ops.attention.paged as paged_mod
from gdnserve.engine.cache.page_pool import PagePool, PagePoolConfig, PageTable
from gdnserve.ops.attention import copy_pages, paged_attention, store_kv
from gdnserve.ops.attention.naive import naive_attention
from gdnserve.ops.numerics import rel_rms

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
I32, I64 = torch.int32, torch.int64
NAN = float("nan")
KVH, DH = 2, 40


pytestmark = pytest.mark.usefixtures("seed")   # fresh, printed seed per test (tests/conftest.py)


def rand(*shape, dtype=torch.float32, device="cpu") -> torch.Tensor:
    return torch.randn(*shape, device=device).to(dtype)


def strided(T: int, H: int, D: int, dtype, device) -> torch.Tensor:
    """[T, H, D] random, a column slice of a wider buffer (row stride > H * D)."""
    return rand(T, H, D + 8, dtype=dtype, device=device)[..., 3:3 + D]


def nan_out(T: int, H: int, D: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    buf = torch.full((T, H, D + 3), NAN, dtype=dtype, device=device)
    return buf[..., 1:1 + D], buf


def paged_caches(ks: list[torch.Tensor], vs: list[torch.Tensor], P: int, extra_pages: int = 3):
    """Scatter per-sequence K/V [Lk, KVH, Dh] into NaN-poisoned caches on randomly permuted pages.
    Returns k_cache, v_cache and page_table [N, width] int32 padded with -1."""
    need = [math.ceil(k.shape[0] / P) for k in ks]
    num_pages = sum(need) + extra_pages
    perm = torch.randperm(num_pages).tolist()
    ref = ks[0] if ks else torch.empty(0, KVH, DH)
    kc = torch.full((num_pages, P, *ref.shape[1:]), NAN, dtype=ref.dtype, device=ref.device)
    vc = kc.clone()
    width = max(need, default=0) + 2
    table = torch.full((len(ks), width), -1, dtype=I32)
    for n, (k, v) in enumerate(zip(ks, vs)):
        pages, perm = perm[:need[n]], perm[need[n]:]
        table[n, :need[n]] = torch.tensor(pages, dtype=I32)
        for p in range(k.shape[0]):
            kc[pages[p // P], p % P], vc[pages[p // P], p % P] = k[p], v[p]
    return kc, vc, table.to(ref.device)


def check_rows(o: torch.Tensor, ref: torch.Tensor, dtype, what: str) -> None:
    assert torch.isfinite(o).all(), f"{what}: output rows not fully written (NaN left)"
    err = rel_rms(o, ref)
    assert err <= TOL[dtype], f"{what}: rel-RMS {err:.3g} > {TOL[dtype]}"


# Mixed varlen batch: (Lq, context before the queries); kv_len = context + Lq. (0, 0) and (0, 6) have no
# queries; (1, -1) is a decode-style padding row: one q row, kv_len 0 (skipped, its row stays NaN).
MIXED = [(13, 0), (7, 9), (1, 20), (0, 0), (1, 0), (1, -1), (33, 4), (0, 6), (1, 57), (5, 5)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("g", [1, 2, 4])
@pytest.mark.parametrize("P", [1, 5, 16])
def test_paged_attention_matches_naive(P, g, dtype, device):
    QH, pad_rows = KVH * g, 3
    lq = [Lq for Lq, _ in MIXED]
    kv = [0 if ctx < 0 else ctx + Lq for Lq, ctx in MIXED]
    T = sum(lq) + pad_rows
    cu = [0]
    for L in lq:
        cu.append(cu[-1] + L)
    q = strided(T, QH, DH, dtype, device)
    ks = [rand(L, KVH, DH, dtype=dtype, device=device) for L in kv]
    vs = [rand(L, KVH, DH, dtype=dtype, device=device) for L in kv]
    kc, vc, table = paged_caches(ks, vs, P)
    out, buf = nan_out(T, QH, DH, dtype, device)
    scale = 0.7 * DH ** -0.5
    o = paged_attention(q, kc, vc, torch.tensor(cu, dtype=I32, device=device),
                        torch.tensor(kv, dtype=I32, device=device), table, scale=scale, out=out)
    assert o is out
    for n, (Lq, Lk) in enumerate(zip(lq, kv)):
        rows = slice(cu[n], cu[n + 1])
        if Lq == 0 or Lk == 0:
            assert torch.isnan(o[rows]).all(), f"padding sequence {n}: rows were written"
            continue
        check_rows(o[rows], naive_attention(q[rows], ks[n], vs[n], scale), dtype, f"sequence {n} (Lq {Lq}, kv {Lk})")
    assert torch.isnan(o[cu[-1]:]).all(), "rows past cu_seqlens_q[N] were written"
    assert torch.isnan(buf[..., 0]).all() and torch.isnan(buf[..., 1 + DH:]).all(), "wrote outside the out view"


def test_query_blocks_and_fresh_output(monkeypatch, device):
    """Tiny score blocks (many query blocks per sequence) give the same result; out=None allocates."""
    monkeypatch.setattr(paged_mod, "Q_BLOCK_ELEMS", 50)
    QH, lens, ctx = 4, [9, 1, 12], [3, 30, 0]
    q = rand(sum(lens), QH, DH, device=device)
    ks = [rand(c + L, KVH, DH, device=device) for c, L in zip(ctx, lens)]
    vs = [rand(c + L, KVH, DH, device=device) for c, L in zip(ctx, lens)]
    kc, vc, table = paged_caches(ks, vs, 4)
    cu = torch.tensor([0, 9, 10, 22], dtype=I32, device=device)
    kvl = torch.tensor([c + L for c, L in zip(ctx, lens)], dtype=I32, device=device)
    o = paged_attention(q, kc, vc, cu, kvl, table, scale=DH ** -0.5, backend="torch")
    assert o.shape == q.shape and o.dtype == q.dtype and o.is_contiguous()
    for n in range(3):
        rows = slice(int(cu[n]), int(cu[n + 1]))
        check_rows(o[rows], naive_attention(q[rows], ks[n], vs[n], DH ** -0.5), torch.float32, f"seq {n}")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kv_start_never_reads_the_first_positions(backend, device):
    """kv_start = 1 (the MTP layer's cache, whose position 0 holds nothing): position 0 is NaN-poisoned and
    must not be read; the result is attention over positions 1.. of each sequence."""
    QH, P, lens, ctx = 4, 5, [6, 1, 3], [3, 11, 1]        # query rows, positions before them (>= kv_start)
    q = rand(sum(lens), QH, DH, device=device)
    ks = [rand(c + L, KVH, DH, device=device) for c, L in zip(ctx, lens)]
    vs = [rand(c + L, KVH, DH, device=device) for c, L in zip(ctx, lens)]
    for k, v in zip(ks, vs):
        k[0], v[0] = NAN, NAN
    kc, vc, table = paged_caches(ks, vs, P)
    cu = torch.tensor([0, 6, 7, 10], dtype=I32, device=device)
    kvl = torch.tensor([c + L for c, L in zip(ctx, lens)], dtype=I32, device=device)
    o = paged_attention(q, kc, vc, cu, kvl, table, scale=DH ** -0.5, kv_start=1, backend=backend)
    for n in range(3):
        rows = slice(int(cu[n]), int(cu[n + 1]))
        check_rows(o[rows], naive_attention(q[rows], ks[n][1:], vs[n][1:], DH ** -0.5), torch.float32, f"seq {n}")


def test_empty_batch(device):
    kc = rand(2, 4, KVH, DH, device=device)
    o = paged_attention(rand(0, KVH, DH, device=device), kc, kc.clone(), torch.zeros(1, dtype=I32, device=device),
                        torch.zeros(0, dtype=I32, device=device), torch.zeros(0, 3, dtype=I32, device=device),
                        scale=0.1)
    assert o.shape == (0, KVH, DH)


# ---------------------------------------------------------------------------------------- store / copy

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_slots_skip_and_duplicate_tokens(dtype, device):
    NP, P, T = 7, 5, 9
    kc, vc = rand(NP, P, KVH, DH, dtype=dtype, device=device), rand(NP, P, KVH, DH, dtype=dtype, device=device)
    k0, v0 = kc.clone(), vc.clone()
    k, v = strided(T, KVH, DH, dtype, device), strided(T, KVH, DH, dtype, device)
    slots = random.sample(range(NP * P), 12)
    slots[3] = slots[8] = -1
    toks = [random.randrange(T) for _ in slots]
    toks[5] = toks[6]                                             # one token into two slots
    store_kv(k, v, kc, vc, torch.tensor(slots, dtype=I64, device=device),
             torch.tensor(toks, dtype=I64, device=device))
    ek, ev = k0.view(-1, KVH, DH).clone(), v0.view(-1, KVH, DH).clone()
    for s, t in zip(slots, toks):
        if s >= 0:
            ek[s], ev[s] = k[t], v[t]
    assert torch.equal(kc.view(-1, KVH, DH), ek) and torch.equal(vc.view(-1, KVH, DH), ev)

    # default token_index: token i -> slot_mapping[i]
    slots = random.sample(range(NP * P), T)
    slots[0] = -1
    kc2, vc2 = kc.clone(), vc.clone()
    store_kv(k, v, kc, vc, torch.tensor(slots, dtype=I64, device=device))
    for i, s in enumerate(slots):
        if s >= 0:
            kc2.view(-1, KVH, DH)[s], vc2.view(-1, KVH, DH)[s] = k[i], v[i]
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


def test_copy_pages_bit_exact(device):
    NP, P = 8, 3
    kc, vc = rand(NP, P, KVH, DH, device=device), rand(NP, P, KVH, DH, device=device)
    k0, v0 = kc.clone(), vc.clone()
    src, dst = [5, 1, 5], [0, 7, 2]
    copy_pages(kc, vc, torch.tensor(src, dtype=I64, device=device), torch.tensor(dst, dtype=I64, device=device))
    ek, ev = k0.clone(), v0.clone()
    for s, d in zip(src, dst):
        ek[d], ev[d] = k0[s], v0[s]
    assert torch.equal(kc, ek) and torch.equal(vc, ev)


# ------------------------------------------------------------------------------- shared prefix via fork

def _store(k, v, kc, vc, slots, rows, device):
    store_kv(k, v, kc, vc, torch.tensor(slots, dtype=I64, device=device), torch.tensor(rows, dtype=I64, device=device))


@pytest.mark.parametrize("strategy", ["duplicate", "copy", "earlier_step"])
@pytest.mark.parametrize("P,prefix", [(5, 13), (5, 15), (16, 13), (16, 32), (1, 7)])
def test_shared_prefix_through_fork(P, prefix, strategy, device):
    """A producer's prefix shared by 3 consumers through fork(): each consumer's paged attention equals
    attending to prefix + its own tokens contiguously. The producer also writes 3 tokens of its own past the
    prefix (into the shared tail page when the prefix ends mid-page), which no consumer may see.

    duplicate: same step, the producer's tail tokens also stored into each consumer's CoW page (one store_kv)
    copy: same step, store producer -> copy_pages -> store consumers
    earlier_step: the prefix was stored in an earlier step; PagePool.copy_pages before this step."""
    QH, own, extra = 2 * KVH, [4, 7, 1], 3
    pool = PagePool(PagePoolConfig(num_layers=2, num_pages=40, page_size=P, num_kv_heads=KVH, head_dim=DH,
                                   dtype=torch.float32, device=device))
    pool.k_pools.fill_(NAN)
    pool.v_pools.fill_(NAN)
    kc, vc = pool.k_cache(1), pool.v_cache(1)
    k_pre, v_pre = rand(prefix, KVH, DH, device=device), rand(prefix, KVH, DH, device=device)
    q_pre = rand(prefix, QH, DH, device=device)
    producer = PageTable(pool)
    pre_slots = producer.append_tokens(prefix)
    if strategy == "earlier_step":
        _store(k_pre, v_pre, kc, vc, pre_slots, range(prefix), device)
        pool.k_pools[0].copy_(pool.k_pools[1])  # layer 0 must be copied as well
        pool.v_pools[0].copy_(pool.v_pools[1])
        snapshot = kc.view(-1, KVH, DH)[pre_slots].clone()

    consumers, cows = [], []
    for L in own:
        child, cow = producer.fork(prefix)
        assert (cow is None) == (prefix % P == 0)
        consumers.append(child)
        cows.append(cow)
    own_slots = [c.append_tokens(L) for c, L in zip(consumers, own)]
    extra_slots = producer.append_tokens(extra)  # the producer continues past the prefix (same step)
    for p in producer.pages[: prefix // P]:
        assert pool.refcount(p) == 1 + len(own)
    live = [c for c in cows if c is not None]
    assert all(pool.refcount(c.dst_page) == 1 and pool.refcount(c.src_page) == 1 for c in live)

    # token rows of this step: [prefix (same-step strategies only) | producer extra | consumer 0 | 1 | 2]
    same_step = strategy != "earlier_step"
    segs = ([prefix] if same_step else []) + [extra] + own
    T = sum(segs)
    k, v, q = rand(T, KVH, DH, device=device), rand(T, KVH, DH, device=device), rand(T, QH, DH, device=device)
    starts = [sum(segs[:i]) for i in range(len(segs))]
    if same_step:
        k[:prefix], v[:prefix], q[:prefix] = k_pre, v_pre, q_pre
    b = 1 if same_step else 0                       # index of the producer's extra segment in segs
    prod_slots = (pre_slots if same_step else []) + extra_slots
    prod_rows = list(range(starts[b] + extra))
    cons_slots = [s for ss in own_slots for s in ss]
    cons_rows = list(range(starts[b + 1], T))

    if strategy == "duplicate":
        row_of = dict(zip(prod_slots, prod_rows))
        dup = [(d, row_of[s]) for c in live for s, d in c.slot_pairs()]
        _store(k, v, kc, vc, prod_slots + cons_slots + [d for d, _ in dup],
               prod_rows + cons_rows + [r for _, r in dup], device)
    elif strategy == "copy":
        _store(k, v, kc, vc, prod_slots, prod_rows, device)
        copy_pages(kc, vc, torch.tensor([c.src_page for c in live], dtype=I64, device=device),
                   torch.tensor([c.dst_page for c in live], dtype=I64, device=device))
        _store(k, v, kc, vc, cons_slots, cons_rows, device)
    else:
        pool.copy_pages([c.src_page for c in live], [c.dst_page for c in live])
        _store(k, v, kc, vc, prod_slots + cons_slots, prod_rows + cons_rows, device)
        assert torch.equal(kc.view(-1, KVH, DH)[pre_slots], snapshot), "a consumer wrote into the shared prefix"
        for c in live:  # every layer got the copy
            assert torch.equal(pool.k_cache(0)[c.dst_page, :c.num_tokens], pool.k_cache(0)[c.src_page, :c.num_tokens])

    # one attention call: the producer's rows (prefix if in this step, + extra) and each consumer's own rows
    tables = [producer] + consumers
    width = max(len(t.pages) for t in tables) + 1
    page_table = torch.tensor([t.page_row(width) for t in tables], dtype=I32, device=device)
    lq = [(prefix if same_step else 0) + extra] + own
    cu = torch.tensor([0] + [sum(lq[:i + 1]) for i in range(len(lq))], dtype=I32, device=device)
    kv_lens = torch.tensor([t.length for t in tables], dtype=I32, device=device)
    o = paged_attention(q, kc, vc, cu, kv_lens, page_table, scale=DH ** -0.5)

    kp, vp, qp = k[:starts[b] + extra], v[:starts[b] + extra], q[:starts[b] + extra]
    if not same_step:
        kp, vp = torch.cat([k_pre, kp]), torch.cat([v_pre, vp])
    check_rows(o[:int(cu[1])], naive_attention(qp, kp, vp, DH ** -0.5), torch.float32, "producer")
    for i, L in enumerate(own):
        rows = slice(starts[b + 1 + i], starts[b + 1 + i] + L)
        ref = naive_attention(q[rows], torch.cat([k_pre, k[rows]]), torch.cat([v_pre, v[rows]]), DH ** -0.5)
        check_rows(o[rows], ref, torch.float32, f"consumer {i}")

    for t in tables:
        t.release()
    assert pool.num_free == pool.num_pages and pool.check_integrity() == []


# ---------------------------------------------------------------------------------------------- errors

def _attn_args(device, **over):
    T, QH = 6, 4
    a = dict(q=rand(T, QH, DH, device=device), k_cache=rand(5, 4, KVH, DH, device=device),
             v_cache=rand(5, 4, KVH, DH, device=device), cu_seqlens_q=torch.tensor([0, 2, 6], dtype=I32),
             kv_lens=torch.tensor([3, 4], dtype=I32), page_table=torch.tensor([[0, 1], [2, -1]], dtype=I32))
    a.update(over)
    return a


@pytest.mark.parametrize("over,match", [
    (dict(q=torch.randn(6, 4 * DH)), r"q: expected shape \[\*, \*, \*\]"),
    (dict(q=torch.randn(6, 4, DH).double()), "q: expected dtype"),
    (dict(q=torch.randn(6, 3, DH)), "q: 3 query heads is not a multiple"),
    (dict(q=torch.randn(6, 4, 2 * DH)[..., ::2]), "q: last dim must have stride 1"),
    (dict(k_cache=torch.randn(5, 4, KVH, DH).bfloat16()), "k_cache: expected dtype"),
    (dict(k_cache=torch.randn(5, 4, KVH, DH + 1)), r"k_cache: expected shape \[\*, \*, \*, 40\]"),
    (dict(k_cache=torch.randn(5, KVH, 4, DH).transpose(1, 2)), "k_cache: must be contiguous"),
    (dict(v_cache=torch.randn(5, 4, KVH + 1, DH)), r"v_cache: expected shape \[5, 4, 2, 40\]"),
    (dict(cu_seqlens_q=torch.tensor([0, 2, 6])), "cu_seqlens_q: expected dtype"),
    (dict(cu_seqlens_q=torch.zeros(0, dtype=I32)), "cu_seqlens_q: expected N"),
    (dict(kv_lens=torch.tensor([3], dtype=I32)), r"kv_lens: expected shape \[2\]"),
    (dict(page_table=torch.tensor([[0, 1]], dtype=I32)), r"page_table: expected shape \[2, \*\]"),
    (dict(page_table=torch.tensor([[0, 1], [2, 3]])), "page_table: expected dtype"),
    (dict(out=torch.empty(6, 4, DH).bfloat16()), "out: expected dtype"),
    (dict(out=torch.empty(5, 4, DH)), r"out: expected shape \[6, 4, 40\]"),
    (dict(scale=0.0), "scale: expected a positive float"),
    (dict(backend="bogus"), "backend must be"),
    # contents, checked by the PyTorch path on its host copy
    (dict(kv_lens=torch.tensor([1, 4], dtype=I32)), r"kv_lens\[0\] = 1: expected 2 \(its query rows\) \.\. 8"),
    (dict(kv_lens=torch.tensor([3, 9], dtype=I32)), r"kv_lens\[1\] = 9"),
    (dict(page_table=torch.tensor([[0, 1], [5, -1]], dtype=I32)), r"page_table\[1, 0\] = 5"),
    (dict(kv_lens=torch.tensor([3, 5], dtype=I32)), r"page_table\[1, 1\] = -1"),
    (dict(cu_seqlens_q=torch.tensor([0, 4, 2], dtype=I32)), "cu_seqlens_q: expected non-decreasing"),
    (dict(cu_seqlens_q=torch.tensor([0, 2, 7], dtype=I32)), r"cu_seqlens_q: .* in 0\.\.6"),
    (dict(kv_start=-1), "kv_start: expected an int >= 0"),
    (dict(kv_start=1, kv_lens=torch.tensor([2, 4], dtype=I32)), r"kv_lens\[0\] = 2: expected 3 \(its query rows "
                                                                r"\+ kv_start\)"),
])
def test_paged_attention_validation_names_the_tensor(over, match):
    a = {**_attn_args("cpu"), **over}
    scale = a.pop("scale", 0.1)
    with pytest.raises(ValueError, match=match):
        paged_attention(**a, scale=scale)


def _store_args(**over):
    T = 4
    a = dict(k=torch.randn(T, KVH, DH), v=torch.randn(T, KVH, DH), k_cache=torch.randn(3, 2, KVH, DH),
             v_cache=torch.randn(3, 2, KVH, DH), slot_mapping=torch.tensor([0, 5, -1, 2]), token_index=None)
    a.update(over)
    return a


@pytest.mark.parametrize("over,match", [
    (dict(v=torch.randn(3, KVH, DH)), r"v: expected shape \[4, 2, 40\]"),
    (dict(v=torch.randn(4, KVH, DH).bfloat16()), "v: expected dtype"),
    (dict(k_cache=torch.randn(3, 2, KVH, DH).half()), "k_cache: expected dtype"),
    (dict(k_cache=torch.randn(3, 2, KVH + 1, DH)), r"k_cache: expected shape \[\*, \*, 2, 40\]"),
    (dict(v_cache=torch.randn(4, 2, KVH, DH)), r"v_cache: expected shape \[3, 2, 2, 40\]"),
    (dict(slot_mapping=torch.tensor([0, 5, -1, 2], dtype=I32)), "slot_mapping: expected dtype"),
    (dict(slot_mapping=torch.tensor([0, 5, -1])), "slot_mapping: without token_index expected T = 4"),
    (dict(token_index=torch.tensor([0, 1, 2])), r"token_index: expected shape \[4\]"),
    (dict(slot_mapping=torch.tensor([0, 6, -1, 2])), r"slot_mapping\[1\] = 6: expected -1 or a slot in 0\.\.5"),
    (dict(slot_mapping=torch.tensor([0, -2, -1, 2])), r"slot_mapping\[1\] = -2"),
    (dict(token_index=torch.tensor([0, 4, 9, 1])), r"token_index\[1\] = 4: expected a token row in 0\.\.3"),
    (dict(slot_mapping=torch.tensor([0, 2, -1, 2])), "slot_mapping: slot 2 is written more than once"),
])
def test_store_kv_validation_names_the_tensor(over, match):
    with pytest.raises(ValueError, match=match):
        store_kv(**_store_args(**over))


@pytest.mark.parametrize("src,dst,match", [
    ([0, 1], [2], r"dst_pages: expected shape \[2\]"),
    ([0, 3], [1, 2], r"src_pages\[1\] = 3"),
    ([0, 1], [2, 2], "dst_pages: pages must be distinct"),
    ([0, 1], [1, 2], "dst_pages: must not overlap src_pages"),
])
def test_copy_pages_validation(src, dst, match):
    kc, vc = torch.randn(3, 2, KVH, DH), torch.randn(3, 2, KVH, DH)
    with pytest.raises(ValueError, match=match):
        copy_pages(kc, vc, torch.tensor(src), torch.tensor(dst))
    with pytest.raises(ValueError, match="src_pages: expected dtype"):
        copy_pages(kc, vc, torch.tensor(src, dtype=I32), torch.tensor(dst))
