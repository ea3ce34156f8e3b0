"""PagePool and PageTable: per-layer views the attention ops accept, exact sizing, refcount errors that name
the page, full-pool errors with counts, fork/release refcounts, and the allocator's invariants under random
allocate/incref/decref and random fork/append/release trees (hypothesis, check_integrity() after every step)."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gdnserve.engine.cache.page_pool import (
    CowCopy,
    PagePool,
    PagePoolConfig,
    PagePoolError,
    PagePoolFullError,
    PageTable,
)
from gdnserve.ops.attention import store_kv

DIMS = dict(num_layers=2, page_size=4, num_kv_heads=2, head_dim=8)


def make_pool(num_pages: int = 8, **kw) -> PagePool:
    return PagePool(PagePoolConfig(num_pages=num_pages, **{**DIMS, **kw}))


def test_config_rejects_bad_fields():
    with pytest.raises(ValueError, match="num_pages"):
        PagePoolConfig(num_pages=0, **DIMS)
    with pytest.raises(ValueError, match="page_size"):
        PagePoolConfig(num_pages=1, **{**DIMS, "page_size": 0})
    with pytest.raises(ValueError, match="head_dim"):
        PagePoolConfig(num_pages=1, **{**DIMS, "head_dim": 8.0})
    with pytest.raises(ValueError, match="dtype"):
        PagePoolConfig(num_pages=1, dtype=torch.int8, **DIMS)
    cfg = PagePoolConfig(num_pages=1, device="cpu", **DIMS)
    assert cfg.device == torch.device("cpu") and cfg.dtype == torch.bfloat16
    with pytest.raises(AttributeError):
        cfg.num_pages = 2  # frozen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_views_are_contiguous_per_layer_slices(dtype):
    pool = make_pool(5, dtype=dtype)
    assert pool.k_pools.shape == (2, 5, 4, 2, 8)
    for layer in range(2):
        k, v = pool.k_cache(layer), pool.v_cache(layer)
        assert k.shape == v.shape == (5, 4, 2, 8) and k.dtype == dtype and k.is_contiguous() and v.is_contiguous()
        assert k.data_ptr() == pool.k_pools[layer].data_ptr() and v.data_ptr() == pool.v_pools[layer].data_ptr()
        assert not k.any() and not v.any()
    assert pool.k_cache(1).data_ptr() - pool.k_cache(0).data_ptr() == pool.k_cache(0).nbytes
    for bad in (2, -1, "0"):
        with pytest.raises(IndexError, match="layer"):
            pool.v_cache(bad)
    # the views are what store_kv writes through: slot 6 = page 1, offset 2 of layer 1 only
    k = torch.randn(1, 2, 8).to(dtype)
    store_kv(k, k, pool.k_cache(1), pool.v_cache(1), torch.tensor([6]))
    assert torch.equal(pool.k_pools[1, 1, 2], k[0]) and pool.k_pools[1].count_nonzero() == k.count_nonzero()
    assert not pool.k_pools[0].any()


def test_bytes_per_page_and_from_budget():
    pool = make_pool(3, dtype=torch.float16)
    assert pool.bytes_per_page == 2 * 2 * 4 * 2 * 8 * 2
    assert pool.bytes_per_page * 3 == pool.k_pools.nbytes + pool.v_pools.nbytes
    per = pool.bytes_per_page
    sized = PagePool.from_budget(per * 7 + per - 1, dtype=torch.float16, **DIMS)
    assert sized.num_pages == 7 and sized.num_free == 7
    assert PagePool.from_budget(per * 7, dtype=torch.float16, max_pages=3, **DIMS).num_pages == 3
    with pytest.raises(PagePoolError, match=f"fits no page: one page needs {per} bytes"):
        PagePool.from_budget(per - 1, dtype=torch.float16, **DIMS)


def test_allocate_lowest_first_and_full_pool_with_counts():
    pool = make_pool(5)
    assert pool.allocate(2) == [0, 1] and pool.allocate(0) == []
    assert pool.try_allocate(4) is None and pool.num_free == 3      # short: takes nothing
    with pytest.raises(PagePoolFullError, match="4 pages requested, 3 of 5 pages free") as e:
        pool.allocate(4)
    assert (e.value.requested, e.value.num_free, e.value.num_pages) == (4, 3, 5)
    pool.decref([0])
    assert pool.allocate(2) == [0, 2]
    with pytest.raises(ValueError, match="n: expected an int >= 0"):
        pool.allocate(-1)
    assert pool.check_integrity() == []


def test_refcount_errors_name_the_page_and_change_nothing():
    pool = make_pool(4)
    a, b = pool.allocate(2)
    pool.incref([a])
    assert pool.refcount(a) == 2 and pool.describe() == "2 of 4 pages free (2 used, 1 shared)"
    with pytest.raises(PagePoolError, match=f"decref: page {b} has refcount 1, cannot drop 2"):
        pool.decref([a, b, b])
    assert pool.refcount(a) == 2 and pool.refcount(b) == 1           # atomic
    with pytest.raises(PagePoolError, match="incref: page 3 is free"):
        pool.incref([a, 3])
    assert pool.refcount(a) == 2
    for bad in (4, -1, True, "1"):
        with pytest.raises(PagePoolError, match=f"page {bad!r} is not a page of this pool"):
            pool.decref([bad])
    pool.decref([a, a, b])
    assert pool.num_free == 4
    with pytest.raises(PagePoolError, match=f"decref: page {a} has refcount 0"):
        pool.decref([a])
    with pytest.raises(PagePoolError, match="copy_pages: page 0 is free"):
        pool.copy_pages([0], [1])


def test_check_integrity_detects_corruption():
    pool = make_pool(4)
    pool.allocate(2)
    assert pool.check_integrity() == []
    pool._free.append(3)                                   # duplicate free entry
    assert any("duplicates: [3]" in p for p in pool.check_integrity())
    pool._free.pop()
    pool._refs[2] = 1                                      # used and free at once
    assert any("both free and in use: [2]" in p for p in pool.check_integrity())
    pool._refs[2] = 0
    pool._refs[0] = -1
    assert any("negative refcounts: [0]" in p for p in pool.check_integrity())
    pool._refs[0] = 1
    pool._free.remove(3)                                   # lost page
    probs = pool.check_integrity()
    assert any("neither free nor in use: [3]" in p for p in probs) and any("!= total 4" in p for p in probs)
    with pytest.raises(PagePoolError, match="integrity"):
        pool.assert_integrity()


# ------------------------------------------------------------------------------------------ PageTable

def test_append_tokens_slot_mapping_and_atomic_failure():
    pool = make_pool(4)  # page_size 4
    t = PageTable(pool)
    assert t.pages_needed(5) == 2
    assert t.append_tokens(5) == [0, 1, 2, 3, 4] and t.pages == [0, 1] and t.length == 5
    other = PageTable(pool)
    other.append_tokens(1)                                  # page 2
    assert t.append_tokens(4) == [5, 6, 7, 12] and t.pages == [0, 1, 3]
    assert t.pages_needed(3) == 0 and t.pages_needed(4) == 1
    with pytest.raises(PagePoolFullError, match="1 pages requested, 0 of 4 pages free"):
        t.append_tokens(4)
    assert t.length == 9 and t.pages == [0, 1, 3]           # unchanged
    assert t.slots(3, 9) == [3, 4, 5, 6, 7, 12]
    assert t.page_row(5) == [0, 1, 3, -1, -1] and t.page_row(3, pad=0) == [0, 1, 3]
    with pytest.raises(ValueError, match="positions 8..10"):
        t.slots(8, 10)
    with pytest.raises(ValueError, match="width: 2"):
        t.page_row(2)
    with pytest.raises(ValueError, match="pages: 5 positions need 2 pages"):
        PageTable(pool, [0], 5)


def test_fork_shares_full_pages_and_copies_the_tail():
    pool = make_pool(10)
    parent = PageTable(pool)
    parent.append_tokens(10)                                # pages 0, 1, 2 (2 holds positions 8, 9)
    child, cow = parent.fork(10)
    assert child.pages == [0, 1, 3] and child.length == 10
    assert cow == CowCopy(src_page=2, dst_page=3, num_tokens=2, first_position=8, page_size=4)
    assert cow.slot_pairs() == [(8, 12), (9, 13)]
    assert [pool.refcount(p) for p in range(4)] == [2, 2, 1, 1]
    assert child.append_tokens(3) == [14, 15, 16]           # own tokens after the copied tail, then a new page
    mid, cow2 = parent.fork(6)
    assert mid.pages == [0, 5] and cow2.src_page == 1 and cow2.num_tokens == 2 and cow2.first_position == 4
    edge, none = parent.fork(8)                             # page boundary: nothing to copy
    assert none is None and edge.pages == [0, 1] and pool.refcount(1) == 3
    empty, none = parent.fork(0)
    assert none is None and empty.pages == [] and empty.length == 0
    for bad in (11, -1):
        with pytest.raises(ValueError, match="prefix_len"):
            parent.fork(bad)
    for t in (parent, child, mid, edge, empty):
        t.release()
    assert t.pages == [] and t.length == 0
    assert pool.num_free == 10 and pool.check_integrity() == []


def test_fork_on_a_full_pool_changes_nothing():
    pool = make_pool(2)
    parent = PageTable(pool)
    parent.append_tokens(6)
    with pytest.raises(PagePoolFullError, match="1 pages requested, 0 of 2 pages free"):
        parent.fork(5)
    assert [pool.refcount(p) for p in range(2)] == [1, 1]
    child, cow = parent.fork(4)
    assert cow is None and pool.refcount(0) == 2
    child.release()
    parent.release()
    assert pool.num_free == 2


def test_pool_copy_pages_covers_every_layer():
    pool = make_pool(4)
    pool.allocate(3)
    pool.k_pools.normal_()
    pool.v_pools.normal_()
    k0, v0 = pool.k_pools.clone(), pool.v_pools.clone()
    pool.copy_pages([2], [0])
    assert torch.equal(pool.k_pools[:, 0], k0[:, 2]) and torch.equal(pool.v_pools[:, 0], v0[:, 2])
    assert torch.equal(pool.k_pools[:, 1:], k0[:, 1:]) and torch.equal(pool.v_pools[:, 1:], v0[:, 1:])


# ------------------------------------------------------------------------------------------ hypothesis

class RefcountMachine(RuleBasedStateMachine):
    """Random allocate / try_allocate / incref / decref against a dict model of refcounts."""

    @initialize(num_pages=st.integers(1, 8))
    def setup(self, num_pages):
        self.pool = make_pool(num_pages)
        self.model: dict[int, int] = {}

    @rule(n=st.integers(0, 4), raising=st.booleans())
    def allocate(self, n, raising):
        free = sorted(set(range(self.pool.num_pages)) - self.model.keys())
        if n > len(free):
            if raising:
                with pytest.raises(PagePoolFullError, match=f"{n} pages requested, {len(free)} of"):
                    self.pool.allocate(n)
            else:
                assert self.pool.try_allocate(n) is None
            return
        pages = self.pool.allocate(n) if raising else self.pool.try_allocate(n)
        assert pages == free[:n]
        self.model.update(dict.fromkeys(pages, 1))

    @precondition(lambda self: self.model)
    @rule(pick=st.randoms(use_true_random=False), k=st.integers(1, 3))
    def incref(self, pick: random.Random, k):
        pages = [pick.choice(sorted(self.model)) for _ in range(k)]
        self.pool.incref(pages)
        for p in pages:
            self.model[p] += 1

    @precondition(lambda self: self.model)
    @rule(pick=st.randoms(use_true_random=False), k=st.integers(1, 3))
    def decref(self, pick: random.Random, k):
        pages = [pick.choice(sorted(self.model)) for _ in range(k)]
        if any(pages.count(p) > self.model[p] for p in pages):
            with pytest.raises(PagePoolError, match="decref: page"):
                self.pool.decref(pages)
            return
        self.pool.decref(pages)
        for p in pages:
            self.model[p] -= 1
            if not self.model[p]:
                del self.model[p]

    @rule(page=st.integers(-1, 9))
    def touch_free(self, page):
        if page in self.model:
            return
        with pytest.raises(PagePoolError, match=f"page {page}"):
            self.pool.decref([page])
        with pytest.raises(PagePoolError, match=f"page {page}"):
            self.pool.incref([page])

    @invariant()
    def consistent(self):
        if not hasattr(self, "pool"):
            return
        assert self.pool.check_integrity() == []
        assert self.pool.num_free == self.pool.num_pages - len(self.model)
        assert [self.pool.refcount(p) for p in range(self.pool.num_pages)] == \
            [self.model.get(p, 0) for p in range(self.pool.num_pages)]


TestRefcountMachine = RefcountMachine.TestCase
TestRefcountMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


class TableMachine(RuleBasedStateMachine):
    """Random trees of page tables (append, fork at any prefix, release): every page's refcount equals the
    number of live tables holding it, a table's slots are distinct from every other table's writable slots,
    and releasing everything frees every page."""

    @initialize(num_pages=st.integers(2, 12), page_size=st.sampled_from([1, 3, 4]))
    def setup(self, num_pages, page_size):
        self.pool = make_pool(num_pages, page_size=page_size)
        self.tables: list[PageTable] = []

    @rule(n=st.integers(0, 9))
    def new(self, n):
        t = PageTable(self.pool)
        try:
            t.append_tokens(n)
        except PagePoolFullError:
            assert t.pages == [] and t.length == 0
            return
        self.tables.append(t)

    @precondition(lambda self: self.tables)
    @rule(pick=st.randoms(use_true_random=False), n=st.integers(0, 7))
    def append(self, pick: random.Random, n):
        t = pick.choice(self.tables)
        before, free = (list(t.pages), t.length), self.pool.num_free
        try:
            slots = t.append_tokens(n)
        except PagePoolFullError:
            assert (t.pages, t.length) == before and self.pool.num_free == free
            return
        P = self.pool.page_size
        for s in slots:  # a sequence writes only into pages nobody else holds
            assert self.pool.refcount(s // P) == 1

    @precondition(lambda self: self.tables)
    @rule(pick=st.randoms(use_true_random=False))
    def fork(self, pick: random.Random):
        t = pick.choice(self.tables)
        prefix = pick.randint(0, t.length)
        try:
            child, cow = t.fork(prefix)
        except PagePoolFullError:
            return
        P = self.pool.page_size
        assert child.length == prefix and child.pages[: prefix // P] == t.pages[: prefix // P]
        if cow is not None:
            assert cow.src_page == t.pages[prefix // P] and cow.dst_page == child.pages[-1]
            assert cow.num_tokens == prefix % P and self.pool.refcount(cow.dst_page) == 1
        self.tables.append(child)

    @precondition(lambda self: self.tables)
    @rule(pick=st.randoms(use_true_random=False))
    def release(self, pick: random.Random):
        t = self.tables.pop(pick.randrange(len(self.tables)))
        t.release()

    @invariant()
    def consistent(self):
        if not hasattr(self, "pool"):
            return
        assert self.pool.check_integrity() == []
        holders = [sum(t.pages.count(p) for t in self.tables) for p in range(self.pool.num_pages)]
        assert [self.pool.refcount(p) for p in range(self.pool.num_pages)] == holders

    def teardown(self):
        if hasattr(self, "pool"):
            for t in self.tables:
                t.release()
            assert self.pool.num_free == self.pool.num_pages and self.pool.check_integrity() == []


TestTableMachine = TableMachine.TestCase
TestTableMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
