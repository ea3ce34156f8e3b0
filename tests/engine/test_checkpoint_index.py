"""CheckpointIndex: lookups that say why they missed, collision safety, PENDING -> READY, refcounts, LRU
eviction of unreferenced READY entries, reserve() evicting to make room, and random operation sequences
(hypothesis) that keep both the index's and the pool's integrity checks clean."""
from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gdnserve.engine.cache import checkpoint_index as ci
from gdnserve.engine.cache.checkpoint_index import (
    Checkpoint,
    CheckpointError,
    CheckpointIndex,
    CheckpointStatus,
    MissReason,
    checkpoint_key,
)
from gdnserve.engine.cache.state_pool import PoolFullError, SlotKind, StatePool, StatePoolConfig

READY, PENDING, DROPPED = CheckpointStatus.READY, CheckpointStatus.PENDING, CheckpointStatus.DROPPED


def make_index(num_slots: int = 4, **kw) -> CheckpointIndex:
    cfg = StatePoolConfig(num_layers=2, num_slots=num_slots, HV=2, K=8, V=8, conv_dim=16, conv_width=4)
    return CheckpointIndex(StatePool(cfg), **kw)


def ready(index: CheckpointIndex, ids) -> Checkpoint:
    e = index.reserve(ids)
    index.mark_ready(e)
    return e


def healthy(index: CheckpointIndex) -> bool:
    return index.check_integrity() == [] and index.pool.check_integrity() == []


def test_key_is_deterministic_and_length_aware():
    assert checkpoint_key([1, 2, 3]) == checkpoint_key((1, 2, 3)) and len(checkpoint_key([1])) == 16
    assert len({checkpoint_key(ids) for ids in ([0], [0, 0], [1], [0, 1], [1, 0], [2**31 - 1])}) == 6
    with pytest.raises(OverflowError):
        checkpoint_key([2**31])


def test_lookup_absent_pending_then_hit():
    index = make_index()
    ids = [5, 9, 11, 3, 7]
    miss = index.lookup(ids)
    assert (miss.hit, miss.reason, miss.entry, miss.hit_length) == (False, MissReason.ABSENT, None, 0)
    e = index.reserve(ids)
    assert (e.status, e.refcount, e.length, e.token_ids) == (PENDING, 0, 5, tuple(ids))
    assert index.pool.kind_of(e.slot) is SlotKind.CHECKPOINT and index.pool.owner_of(e.slot) is index
    pend = index.lookup(ids)
    assert (pend.hit, pend.reason, pend.entry, pend.hit_length) == (False, MissReason.PENDING, e, 0)
    index.mark_ready(e)
    hit = index.lookup(tuple(ids))
    assert (hit.hit, hit.reason, hit.entry, hit.hit_length) == (True, None, e, 5)
    assert index.lookup(ids[:4]).reason is MissReason.ABSENT  # exact boundaries only
    assert index.lookup(ids + [1]).reason is MissReason.ABSENT
    assert index.stats() == dict(entries_pending=0, entries_ready=1, hits=1, misses_absent=3, misses_pending=1,
                                 misses_evicted=0, misses_collision=0, evictions=0, aborts=0)
    assert healthy(index)


def test_evicted_reason_is_remembered_and_bounded():
    index = make_index(max_evicted_keys=2)
    entries = [ready(index, [i, i + 1]) for i in range(3)]
    assert index.evict_lru(3) == entries
    assert all(e.status is DROPPED and e.slot == -1 for e in entries)
    assert index.pool.num_free == 4
    # the oldest evicted key fell out of the bounded memory
    assert [index.lookup([i, i + 1]).reason for i in range(3)] == [MissReason.ABSENT, MissReason.EVICTED,
                                                                   MissReason.EVICTED]
    again = index.reserve([1, 2])  # re-reserving forgets the eviction
    assert index.lookup([1, 2]).reason is MissReason.PENDING and again is not entries[1]
    assert index.stats()["evictions"] == 3 and healthy(index)


def test_hash_collision_is_a_miss_never_a_wrong_state(monkeypatch):
    monkeypatch.setattr(ci, "checkpoint_key", lambda ids: b"\0" * 16)
    index = make_index()
    a = ready(index, [1, 2, 3])
    miss = index.lookup([4, 5, 6])
    assert (miss.hit, miss.reason, miss.entry) == (False, MissReason.COLLISION, None)
    with pytest.raises(CheckpointError, match="other tokens with the same hash"):
        index.reserve([4, 5, 6])
    assert index.lookup([1, 2, 3]).entry is a
    assert index.stats()["misses_collision"] == 1 and healthy(index)


def test_reserve_rejects_existing_key_and_empty_prefix():
    index = make_index()
    e = index.reserve([1, 2])
    with pytest.raises(CheckpointError, match="of these tokens already exists"):
        index.reserve([1, 2])
    index.mark_ready(e)
    with pytest.raises(CheckpointError, match="look up first"):
        index.reserve((1, 2))
    with pytest.raises(ValueError, match="at least one token"):
        index.reserve([])
    assert len(index) == 1 and index.pool.num_free == 3 and healthy(index)


def test_status_moves_pending_to_ready_only():
    index = make_index()
    e = index.reserve([1])
    with pytest.raises(CheckpointError, match="acquire: .* is PENDING, expected READY"):
        index.acquire(e)
    index.mark_ready(e)
    with pytest.raises(CheckpointError, match="mark_ready: .* is READY, expected PENDING"):
        index.mark_ready(e)
    with pytest.raises(CheckpointError, match="abort: .* is READY"):
        index.abort(e)
    index.evict_lru()
    with pytest.raises(CheckpointError, match="not in this index"):
        index.mark_ready(e)
    other = make_index()
    stranger = other.reserve([1])
    with pytest.raises(CheckpointError, match="not in this index"):
        index.mark_ready(stranger)  # same key, another index's entry
    assert healthy(index) and healthy(other)


def test_abort_frees_the_slot_and_forgets_the_key():
    index = make_index()
    e = index.reserve([3, 1, 4])
    slot = e.slot
    index.abort(e)
    assert (e.status, e.slot) == (DROPPED, -1) and index.pool.kind_of(slot) is None
    assert index.lookup([3, 1, 4]).reason is MissReason.ABSENT
    with pytest.raises(CheckpointError, match="not in this index"):
        index.abort(e)
    assert index.reserve([3, 1, 4]).slot == slot
    assert index.stats()["aborts"] == 1 and healthy(index)


def test_refcounts_pin_against_eviction():
    index = make_index()
    e = ready(index, [1, 2])
    index.acquire(e)
    index.acquire(e)
    assert e.refcount == 2 and index.evict_lru() == []
    index.release(e)
    assert index.evict_lru() == []
    index.release(e)
    with pytest.raises(CheckpointError, match="no reference to release"):
        index.release(e)
    assert e.refcount == 0 and healthy(index)
    assert index.evict_lru() == [e]


def test_lru_eviction_order_skips_referenced_and_pending():
    index = make_index(6)
    a, b, c, d = (ready(index, [i]) for i in range(4))
    p = index.reserve([9])                # pending: never evicted
    index.lookup([0])                     # a becomes most recent: order b, c, d, a
    index.acquire(c)                      # c pinned
    assert index.evict_lru(2) == [b, d]
    assert index.pool.num_free == 1 + 2
    assert index.evict_lru(10) == [a]
    assert index.evict_lru(10) == [] and index.evict_lru(0) == []
    assert c.status is READY and p.status is PENDING and len(index) == 2
    with pytest.raises(ValueError, match="n:"):
        index.evict_lru(-1)
    assert healthy(index)


def test_reserve_evicts_lru_to_make_room():
    index = make_index(3)
    a, b = ready(index, [1]), ready(index, [2])
    index.pool.allocate(SlotKind.RUNNING, "req-0")
    index.lookup([1])                     # b is now the least recently used
    b_slot = b.slot
    c = index.reserve([3])
    assert c.slot == b_slot and b.status is DROPPED and a.status is READY
    assert index.lookup([2]).reason is MissReason.EVICTED and index.lookup([1]).hit
    assert index.pool.num_free == 0 and healthy(index)


def test_reserve_full_pool_reports_why_and_recovers():
    index = make_index(3)
    index.pool.allocate(SlotKind.RUNNING, "req-0")
    index.reserve([1])                    # pending
    r = ready(index, [2])
    index.acquire(r)                      # ready but referenced
    with pytest.raises(PoolFullError) as err:
        index.reserve([3])
    assert str(err.value) == ("state pool full: 0 of 3 slots free (running 1, checkpoint 2, scratch 0); "
                              "no checkpoint is evictable (1 pending, 1 ready and referenced)")
    assert index.lookup([3]).reason is MissReason.ABSENT and healthy(index)
    index.release(r)
    r_slot = r.slot
    assert index.reserve([3]).slot == r_slot
    assert r.status is DROPPED and healthy(index)


def test_is_writable_false_only_for_ready_checkpoints():
    index = make_index()
    e = index.reserve([1, 2, 3])
    run = index.pool.allocate(SlotKind.RUNNING, "req")
    assert index.is_writable(e.slot) and index.is_writable(run) and index.is_writable(-1)
    slot = e.slot
    index.mark_ready(e)
    assert not index.is_writable(slot)
    index.acquire(e)
    assert not index.is_writable(slot)
    index.release(e)
    index.evict_lru()
    assert index.is_writable(slot)


def test_check_integrity_detects_corruption():
    index = make_index()
    e = ready(index, [1])
    f = ready(index, [2])
    e.refcount = -1
    assert any("refcount" in p for p in index.check_integrity())
    e.refcount = 0
    index.pool.free(f.slot)               # slot freed behind the index's back
    assert any("not this index's checkpoint" in p for p in index.check_integrity())
    index.pool.allocate(SlotKind.CHECKPOINT, index)  # re-owned, now leaked twice over
    index.pool.allocate(SlotKind.CHECKPOINT, index)
    assert any("without an entry" in p for p in index.check_integrity())
    f.slot = e.slot
    assert any("share slot" in p for p in index.check_integrity())
    with pytest.raises(CheckpointError, match="integrity"):
        index.assert_integrity()


TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=2)  # 12 sequences: keys recur


class IndexMachine(RuleBasedStateMachine):
    """Random reserve / ready / abort / acquire / release / evict / lookup sequences, with RUNNING slots
    competing for the same pool, against a small model of what the index must hold."""

    @initialize(num_slots=st.integers(1, 5))
    def setup(self, num_slots):
        self.index = make_index(num_slots, max_evicted_keys=3)
        self.running: list[int] = []
        self.live: dict[tuple[int, ...], Checkpoint] = {}

    def _pick(self, rnd: random.Random, status: CheckpointStatus, referenced: bool | None = None):
        choices = [e for _, e in sorted(self.live.items()) if e.status is status
                   and (referenced is None or (e.refcount > 0) == referenced)]
        return rnd.choice(choices) if choices else None

    def _evictable(self) -> list[Checkpoint]:
        return [e for e in self.live.values() if e.status is READY and e.refcount == 0]

    def _forget(self, evicted: list[Checkpoint], before: list[Checkpoint]):
        assert all(e in before for e in evicted)  # only unreferenced READY entries
        for e in evicted:
            del self.live[e.token_ids]
        rest = self._evictable()
        if evicted and rest:                      # least recently used first
            assert max(e.last_use for e in evicted) < min(e.last_use for e in rest)

    @rule(ids=TOKENS, publish=st.booleans())
    def reserve(self, ids, publish):
        ids = tuple(ids)
        if ids in self.live:
            with pytest.raises(CheckpointError):
                self.index.reserve(ids)
            return
        before, had_free = self._evictable(), self.index.pool.num_free > 0
        if not had_free and not before:
            with pytest.raises(PoolFullError, match="no checkpoint is evictable"):
                self.index.reserve(ids)
            return
        e = self.index.reserve(ids)
        gone = [x for x in before if x.status is DROPPED]
        assert len(gone) == (0 if had_free else 1)  # evicts only when the pool is full, and then one
        self._forget(gone, before)
        assert e.status is PENDING and index_slot_ok(self.index, e)
        self.live[ids] = e
        if publish:  # the common flow: the producing step finished
            self.index.mark_ready(e)

    @rule(rnd=st.randoms(use_true_random=False))
    def mark_ready(self, rnd):
        e = self._pick(rnd, PENDING)
        if e is not None:
            self.index.mark_ready(e)
            assert e.status is READY

    @rule(rnd=st.randoms(use_true_random=False))
    def abort(self, rnd):
        e = self._pick(rnd, PENDING)
        if e is not None:
            self.index.abort(e)
            del self.live[e.token_ids]

    @rule(rnd=st.randoms(use_true_random=False))
    def acquire(self, rnd):
        e = self._pick(rnd, READY)
        if e is not None:
            self.index.acquire(e)

    @rule(rnd=st.randoms(use_true_random=False))
    def release(self, rnd):
        e = self._pick(rnd, READY, referenced=True)
        if e is not None:
            self.index.release(e)

    @rule(rnd=st.randoms(use_true_random=False))
    def release_unreferenced(self, rnd):
        e = self._pick(rnd, READY, referenced=False)
        if e is not None:
            with pytest.raises(CheckpointError):
                self.index.release(e)

    @rule(n=st.integers(0, 3))
    def evict(self, n):
        before = [*self._evictable()]
        evicted = self.index.evict_lru(n)
        assert len(evicted) == min(n, len(before))
        self._forget(evicted, before)

    @rule(ids=TOKENS)
    def lookup(self, ids):
        ids = tuple(ids)
        res = self.index.lookup(ids)
        e = self.live.get(ids)
        if e is None:
            assert res.reason in (MissReason.ABSENT, MissReason.EVICTED) and res.entry is None
        elif e.status is PENDING:
            assert (res.reason, res.entry) == (MissReason.PENDING, e)
        else:
            assert res.hit and res.entry is e and res.hit_length == len(ids)

    @precondition(lambda self: len(self.running) < 2)
    @rule()
    def run_request(self):
        slot = self.index.pool.try_allocate(SlotKind.RUNNING, "req")
        if slot is not None:
            self.running.append(slot)

    @precondition(lambda self: self.running)
    @rule()
    def finish_request(self):
        self.index.pool.free(self.running.pop(0))

    @invariant()
    def consistent(self):
        if not hasattr(self, "index"):
            return
        index = self.index
        assert index.check_integrity() == [] and index.pool.check_integrity() == []
        assert len(index) == len(self.live)
        for e in self.live.values():
            assert index.is_writable(e.slot) == (e.status is PENDING)
        for s in self.running:
            assert index.is_writable(s)
        stats = index.stats()
        assert stats["entries_pending"] + stats["entries_ready"] == len(self.live)


def index_slot_ok(index: CheckpointIndex, e: Checkpoint) -> bool:
    return index.pool.kind_of(e.slot) is SlotKind.CHECKPOINT and index.pool.owner_of(e.slot) is index


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)


def test_keys_from_intake_bytes_equal_checkpoint_key():
    """A request keeps its prompt's int32 bytes from intake; the keys of its prefixes and of its conversation
    prefix (prompt + output minus the last token) computed from them equal checkpoint_key of the ids."""
    from gdnserve.engine.config import EngineConfig
    from gdnserve.engine.sampling_params import SamplingParams
    from gdnserve.engine.scheduling.intake import make_request
    rng = random.Random(7)
    cfg = EngineConfig()
    for _ in range(20):
        ids = [rng.randrange(1000) for _ in range(rng.randint(2, 97))]
        req = make_request(cfg, None, 1000, "r", ids, SamplingParams(max_tokens=3), None)
        assert req.prompt_ids == ids and all(type(t) is int for t in req.prompt_ids)
        for n in (1, rng.randint(1, len(ids)), len(ids)):
            assert req.prefix_key(n) == checkpoint_key(ids[:n])
        out = [rng.randrange(1000) for _ in range(rng.randint(0, 5))]
        assert ci.conversation_key(req, out) == checkpoint_key(ci.conversation_prefix(ids, out))
    req.prompt_i32 = None                      # a request built without intake: the index hashes the ids
    assert req.prefix_key(1) is None and ci.conversation_key(req, [1]) is None
