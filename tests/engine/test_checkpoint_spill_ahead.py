"""Spill ahead and the two copy streams of the checkpoint tiers (engine/cache/checkpoint_tiers.py, checkpoint_copy.py)
on CPU tensors: the free-slot watermark copies the device's next LRU victims down once (never twice), a hit on such a
checkpoint still hits on the device, its eviction moves the copy into the host tier without a new copy and a later
lookup restores it bit for bit; an ahead copy pushes out the host tier's LRU only for bytes (never for a hole) and
never another ahead copy, an eviction's spill discards them before it drops; random sequences keep the arena's blocks exact (host tier + ahead copies) and the placement across tiers
that of the same sequence without spill ahead (LRU order preserved). The streams are no-ops on CPU: their event
bookkeeping (a restore after its copy down, a copy down into a block after the copies up still reading it, the slot
freed after the gathers) is checked by structure with fake streams and events. The engine: the watermark spills
ahead and later turns give the outputs of an engine that recomputes them. The device side:
tests/engine/test_checkpoint_tiers_gpu.py."""
from __future__ import annotations

import random
from itertools import pairwise
from types import SimpleNamespace

import pytest

from gdnserve.engine.cache import checkpoint_copy
from gdnserve.engine.cache.checkpoint_copy import Copier, HostCheckpoint
from gdnserve.engine.cache.checkpoint_index import checkpoint_key
from gdnserve.engine.cache.host_arena import Block
from gdnserve.entrypoints.llm import LLM
from tests.engine.test_checkpoint_tiers import CONVS, IDS, Rig, _run, pools, same


def ahead_rig(tmp_path, host_ckpts=8, stage=None, **kw) -> Rig:
    r = Rig(tmp_path, host_ckpts=host_ckpts, disk=False, **kw)
    if stage is not None:
        r.copier.stage_bytes = stage        # the staged path (CUDA's), one staging buffer per direction
    return r


def downs(r: Rig, monkeypatch) -> list[tuple[bytes, bool]]:
    """Every copy down from now on: (key, whether the slot is freed now)."""
    calls, real = [], r.copier.copy_down

    def spy(hc, slot, pages, free=True):
        calls.append((hc.key, free))
        return real(hc, slot, pages, free=free)

    monkeypatch.setattr(r.copier, "copy_down", spy)
    return calls


def exact_blocks(r: Rig) -> bool:
    """The arena holds exactly the host tier's and the ahead copies' blocks, none shared."""
    blocks = [b for hc in [*r.tiers.host.values(), *r.tiers.ahead.values()] for b in hc.blocks]
    spans = sorted((b.offset, b.offset + b.size) for b in blocks)
    return r.arena.used == sum(b.size for b in blocks) and all(a[1] <= b[0] for a, b in pairwise(spans))


def test_the_watermark_copies_the_lru_victims_down_once(tmp_path, monkeypatch):
    r = ahead_rig(tmp_path)
    calls = downs(r, monkeypatch)
    r.make(IDS[0])
    r.make(IDS[1])                                   # 2 of 4 slots free: at the watermark, nothing to do
    assert r.ck.spill_ahead(2) == 0 and not r.tiers.ahead
    r.make(IDS[2])                                   # 1 free: the LRU victim is copied down, not freed
    assert r.ck.spill_ahead(2) == 1 and list(r.tiers.ahead) == [checkpoint_key(IDS[0])]
    assert calls == [(checkpoint_key(IDS[0]), False)] and r.where(IDS[0]) == "gpu" and r.st.num_free == 1
    r.make(IDS[3])                                   # 0 free: the next victim too, IDS[0] not again
    assert r.ck.spill_ahead(2) == 1 and [k for k, _ in calls] == [checkpoint_key(IDS[0]), checkpoint_key(IDS[1])]
    assert r.ck.spill_ahead(2) == 0 and r.ck.spill_ahead(2) == 0 and len(calls) == 2       # no double spill
    assert r.stats.spills == r.stats.spills_ahead == 2 and r.stats.evictions_waited == 0 and exact_blocks(r)
    assert r.ck.spill_ahead(4) == 2 and len(calls) == 4          # a higher watermark: every victim


def test_a_hit_on_a_spilled_ahead_checkpoint_hits_on_the_device(tmp_path):
    r = ahead_rig(tmp_path)
    for ids in IDS[:4]:
        r.make(ids)
    r.ck.spill_ahead(1)
    entry = r.ck.index.lru_victims(1)[0]
    assert entry.token_ids == IDS[0] and checkpoint_key(IDS[0]) in r.tiers.ahead
    look = r.ck.lookup(IDS[0])
    assert look.hit and look.entry is entry and entry.slot >= 0 and r.ck.hit_tier(entry) == "gpu"
    assert r.stats.restores == {"host": 0, "disk": 0} and checkpoint_key(IDS[0]) in r.tiers.ahead   # still copied
    assert r.ck.spill_ahead(1) == 1 and checkpoint_key(IDS[1]) in r.tiers.ahead    # the new LRU victim
    r.ck.evict(1)                                    # IDS[1]: its copy, no new one
    assert r.where(IDS[1]) == "host" and r.stats.spills == 2 and r.stats.evictions_waited == 0


@pytest.mark.parametrize("stage", [None, 160])
def test_evicting_a_spilled_ahead_checkpoint_copies_nothing_and_it_restores_exactly(tmp_path, monkeypatch, stage):
    r = ahead_rig(tmp_path, stage=stage)
    for ids in IDS[:4]:
        r.make(ids)
    assert r.ck.spill_ahead(2) == 2
    calls = downs(r, monkeypatch)
    block = r.tiers.ahead[checkpoint_key(IDS[0])].block
    r.ck.evict(2)                                    # both dropped from the device at once, their copies kept
    assert calls == [] and [r.where(i) for i in IDS[:2]] == ["host", "host"] and not r.tiers.ahead
    assert r.block(IDS[0]) is block and r.stats.spills == 2 and r.stats.evictions_waited == 0
    assert [hc.token_ids for hc in r.tiers.host.values()] == [IDS[0], IDS[1]]        # LRU order kept
    for t in (r.st.conv_pools, r.st.ssm_pools, r.pg.k_pools, r.pg.v_pools):
        t.fill_(float("nan"))                        # the freed slots and pages rewritten
    for ids in IDS[:2]:
        e = r.restore(ids)
        assert e.origin == "host" and same(r.snap(e), r.data[ids])
    assert exact_blocks(r)
    if stage:                                        # a staging buffer per direction: a restore shares none
        assert set(r.copier._stage) == {True, False}
        assert r.copier._stage[True].data_ptr() != r.copier._stage[False].data_ptr()


def test_an_eviction_without_an_ahead_copy_counts_as_waited(tmp_path):
    r = ahead_rig(tmp_path)
    for ids in IDS[:5]:
        r.make(ids)                                  # IDS[0] evicted by make: copied then
    assert r.where(IDS[0]) == "host" and r.stats.evictions_waited == 1 and r.stats.spills_ahead == 0
    from gdnserve.entrypoints.metrics import _TierCollector
    metric = {m.name: m for m in _TierCollector(SimpleNamespace(tier_stats=r.stats)).collect()}
    assert metric["gdnserve:checkpoint_evictions_waited"].samples[0].value == 1
    assert metric["gdnserve:checkpoint_spills_ahead"].samples[0].value == 0


def test_ahead_copies_push_out_the_host_lru_for_bytes_never_each_other_and_an_eviction_discards_them(tmp_path):
    r = ahead_rig(tmp_path, host_ckpts=2)
    for ids in IDS[:5]:
        r.make(ids)                                  # IDS[0] in the host tier: one block left
    assert r.ck.spill_ahead(3) == 2                  # IDS[1] into the free block, IDS[2] pushes IDS[0] out;
    assert r.where(IDS[0]) == "-" and [hc.token_ids for hc in r.tiers.ahead.values()] == [IDS[1], IDS[2]]
    assert r.stats.dropped == 0 and exact_blocks(r)  # IDS[3]: no room, no other ahead copy given up for it
    for ids in (IDS[1], IDS[2]):
        r.ck.lookup(ids)                             # hits: IDS[3] is the LRU victim now, with no copy
    r.ck.evict(1)                                    # its spill discards the oldest ahead copy for room
    assert r.where(IDS[3]) == "host" and list(r.tiers.ahead) == [checkpoint_key(IDS[2])]
    assert r.stats.evictions_waited == 2 and r.stats.dropped == 0 and exact_blocks(r)    # IDS[0]'s, IDS[3]'s
    assert same(r.snap(r.restore(IDS[3])), r.data[IDS[3]])


def _two_holes(r):
    """The arena of four one-block checkpoints with blocks 1 and 3 freed (two blocks free, none adjacent), and a
    device checkpoint of two blocks' bytes (a chat's growing checkpoint: no one hole holds it)."""
    hcs = [r.copier.empty(bytes([i]) * 16, (i,), 1) for i in range(4)]
    assert [hc.block.offset for hc in hcs] == [0, r.per, 2 * r.per, 3 * r.per]     # one block each, the arena full
    for hc in hcs:
        r.tiers._host_put(hc)
    for hc in (hcs[1], hcs[3]):
        r.tiers.claim(hc.key, "host").release()
    n = next(n for n in range(2, 72) if r.copier.bytes_of(n) == 2 * r.per)
    big = tuple(range(1000, 1000 + n * 4))
    r.make(big)
    return hcs, big


def test_an_ahead_copy_takes_the_holes_as_extents(tmp_path):
    """Free bytes enough but no hole that fits (the contiguous arena spilled nothing ahead here): the copy ahead
    takes both holes as two extents and evicts nothing; the eviction frees the slot without a copy; the restore
    from the two extents is bit-identical."""
    r = ahead_rig(tmp_path, host_ckpts=4, num_pages=72)
    hcs, big = _two_holes(r)
    assert r.ck.spill_ahead(4) == 1 and len(r.tiers.host) == 2
    hc = r.tiers.ahead[checkpoint_key(big)]
    assert [b.offset for b in hc.blocks] == [r.per, 3 * r.per] and hc.block is None and len(hc.spans) == 2
    assert r.arena.used == r.arena.capacity and exact_blocks(r)
    r.ck.evict(1)
    assert r.where(big) == "host" and r.stats.evictions_waited == 0 and all(h.key in r.tiers.host for h in
                                                                            (hcs[0], hcs[2]))
    assert same(r.snap(r.restore(big)), r.data[big]) and exact_blocks(r)


def test_an_ahead_copy_never_evicts_for_a_hole_only_for_bytes(tmp_path, monkeypatch):
    """Free bytes enough but no room (here: extents not allowed): a spill ahead evicts nothing (the restores
    before the eviction may free a neighbour; evicting for fragmentation early cost later turns' hits), the
    eviction itself does."""
    monkeypatch.setattr(checkpoint_copy, "MAX_EXTENTS", 1)
    r = ahead_rig(tmp_path, host_ckpts=4, num_pages=72)
    hcs, big = _two_holes(r)
    assert r.ck.spill_ahead(4) == 0 and len(r.tiers.host) == 2 and not r.tiers.ahead
    r.ck.evict(1)                                    # the eviction evicts the host LRU: blocks 0 + 1 merge
    assert r.where(big) == "host" and hcs[0].key not in r.tiers.host and exact_blocks(r)
    assert same(r.snap(r.restore(big)), r.data[big])


def test_an_ahead_copy_whose_checkpoint_left_without_a_spill_is_dropped(tmp_path):
    r = ahead_rig(tmp_path)
    for ids in IDS[:4]:
        r.make(ids)
    r.ck.spill_ahead(1)
    gone = r.ck.index.evict_lru(1)[0]                # the index's own eviction (reserve's), past the tiers
    r.ck.pages.pop(gone.key).release()
    assert gone.key in r.tiers.ahead
    r.ck.spill_ahead(0)
    assert gone.key not in r.tiers.ahead and r.where(IDS[0]) == "-" and exact_blocks(r)


def test_the_shutdown_flush_writes_an_ahead_copy_without_a_new_one(tmp_path, monkeypatch):
    r = Rig(tmp_path, host_ckpts=4, inline_disk=True)
    for ids in IDS[:4]:
        r.make(ids)
    r.ck.spill_ahead(1)
    calls = downs(r, monkeypatch)
    r.ck.close()
    assert len(r.disk) == 4 and checkpoint_key(IDS[0]) not in [k for k, _ in calls] and r.arena.used == 0
    assert not r.tiers.ahead


@pytest.mark.parametrize("seed", range(4))
def test_random_sequences_keep_blocks_exact_and_the_placement_of_plain_lru(tmp_path, monkeypatch, seed):
    """The same random operations on two rigs, one with spill ahead between them: the same checkpoints on the
    device and the same host tier in the same order after every operation (no arena pressure), every restore exact,
    no checkpoint copied twice while on the device, the arena holding exactly the host tier and the ahead copies."""
    rng = random.Random(seed)
    a = ahead_rig(tmp_path / "a", host_ckpts=16, stage=rng.choice([None, 160]))
    b = ahead_rig(tmp_path / "b", host_ckpts=16)
    keys = [tuple(range(10 * i, 10 * i + 6)) for i in range(10)]
    copies: dict[bytes, int] = {}
    real = a.copier.copy_down

    def spy(hc, slot, pages, free=True):
        copies[hc.key] = copies.get(hc.key, 0) + 1
        assert copies[hc.key] == 1, "copied down twice while on the device"
        return real(hc, slot, pages, free=free)
    monkeypatch.setattr(a.copier, "copy_down", spy)
    for _ in range(120):
        op, ids = rng.random(), rng.choice(keys)
        if op < 0.45:
            for r in (a, b):
                where = r.where(ids)
                if where == "-":
                    r.make(ids)
                elif where == "gpu":
                    assert r.ck.lookup(ids).hit
                else:
                    e = r.restore(ids)
                    assert same(r.snap(e), r.data[ids])
            copies.pop(checkpoint_key(ids), None)    # on the device again: one copy down allowed
        elif op < 0.6:
            n = rng.randint(1, 2)
            a.ck.evict(n)
            b.ck.evict(n)
        else:
            a.ck.spill_ahead(rng.randint(0, 3), rng.choice([0, 0, 20]))     # 20 pages: binding
        assert set(a.ck.pages) == set(b.ck.pages) and list(a.tiers.host) == list(b.tiers.host)
        assert set(a.tiers.ahead) <= set(a.ck.pages) and not set(a.tiers.ahead) & set(a.tiers.host)
        assert exact_blocks(a) and a.ck.index.check_integrity() == [] and a.st.check_integrity() == []
    a.ck.evict(len(a.ck))
    assert not a.tiers.ahead and exact_blocks(a) and a.st.num_free == a.st.num_slots
    assert a.pg.num_free == a.pg.num_pages and a.stats.dropped == 0


# ------------------------------------------------------------------ the two streams' bookkeeping, by structure
class FakeEvent:
    def __init__(self, done: bool = False) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


class FakeStream:
    def __init__(self) -> None:
        self.waited: list[FakeEvent] = []

    def wait_event(self, event) -> None:
        self.waited.append(event)


def test_a_restore_waits_for_its_copy_down_and_a_copy_down_for_the_copies_up_reading_its_block():
    st, pg = pools()
    cp = Copier(st, pg)
    s = FakeStream()
    down = FakeEvent()
    hc = HostCheckpoint(b"k" * 16, (1,), {}, event=down)
    cp._fence(s, hc, to_host=False)                  # the copy up reads hc after its copy down wrote it
    assert s.waited == [down]
    reading, done = FakeEvent(), FakeEvent(done=True)
    cp._reads = [(0, 8192, reading), (8192, 12288, done), (16384, 20480, FakeEvent())]
    s = FakeStream()
    cp._fence(s, HostCheckpoint(b"a" * 16, (1,), {}, blocks=(Block(4096, 8192),)), to_host=True)
    assert s.waited == [reading]                     # overlapping and still queued: waited; the done one pruned
    assert [r[:2] for r in cp._reads] == [(0, 8192), (16384, 20480)]
    s = FakeStream()
    cp._fence(s, HostCheckpoint(b"p" * 16, (1,), {}), to_host=True)     # a plain allocation: nothing to wait for
    assert s.waited == []


def test_an_ahead_copy_orders_the_slot_reuse_only_when_it_is_freed(tmp_path, monkeypatch):
    """A spill ahead leaves the current stream alone (the slot stays READY); the eviction that frees the slot makes
    the current stream wait for the copy's gathers, once."""
    current = FakeStream()
    monkeypatch.setattr(checkpoint_copy.torch.cuda, "current_stream", lambda device=None: current)
    r = ahead_rig(tmp_path)
    for ids in IDS[:4]:
        r.make(ids)
    real = r.copier.copy_down
    gathers: dict[bytes, FakeEvent] = {}

    def fake_gathers(hc, slot, pages, free=True):
        real(hc, slot, pages, free=False)
        hc.gathered = gathers[hc.key] = FakeEvent()  # as the CUDA path records it
        if free:
            r.copier.freeing(hc)
    monkeypatch.setattr(r.copier, "copy_down", fake_gathers)
    r.ck.spill_ahead(1)
    assert current.waited == []                      # issued, not ordered against the steps
    r.ck.evict(1)
    g = gathers[checkpoint_key(IDS[0])]
    assert current.waited == [g] and r.tiers.host[checkpoint_key(IDS[0])].gathered is None
    r.ck.evict(1)                                    # an eviction's own spill: ordered at once
    assert current.waited == [g, gathers[checkpoint_key(IDS[1])]]


# ------------------------------------------------------------------ the engine
@pytest.fixture(scope="module")
def ref():
    return LLM(device="cpu", max_num_seqs=2, num_pages=256, auto_checkpoints=False).engine


def test_the_engine_spills_ahead_and_later_turns_match_a_recompute(ref):
    kw = {"device": "cpu", "max_num_seqs": 2, "num_slots": 4, "num_pages": 64, "page_size": 8,
          "checkpoint_host_memory_gb": 0.01}
    on, off = LLM(checkpoint_spill_ahead=2, **kw).engine, LLM(checkpoint_spill_ahead=0, **kw).engine
    for e in (on, off):
        first = [_run(e, c).outputs[0].token_ids for c in CONVS]
        for c, out in zip(CONVS, first):
            ids = c + out + [7, 8, 9]
            got = _run(e, ids)
            assert got.checkpoint.hit_length == len(c) + len(out) - 1
            assert got.outputs[0].token_ids == _run(ref, ids).outputs[0].token_ids
    s_on, s_off = on.tier_stats.snapshot(), off.tier_stats.snapshot()
    assert s_off["spills_ahead"] == 0 and s_off["evictions_waited"] == s_off["spills"] > 0
    assert s_on["spills_ahead"] > 0 and s_on["evictions_waited"] < s_off["evictions_waited"]
    assert s_on["hits"]["host"] >= 2 and s_on["restores"]["host"] == s_on["hits"]["host"]
    tiers = on.kv.checkpoint_cache.tiers
    assert set(tiers.ahead) <= set(on.kv.checkpoint_cache.pages) and on.index.check_integrity() == []
    on.evict_checkpoints(len(on.index))
    assert not tiers.ahead and tiers.arena.used == sum(hc.footprint for hc in tiers.host.values())
    arena = tiers.arena
    on.close()
    off.close()
    assert arena.closed and arena.used == 0


def test_the_config_field():
    from gdnserve.engine.config import EngineConfig
    assert EngineConfig().checkpoint_spill_ahead == 2 and EngineConfig(checkpoint_spill_ahead=0)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="checkpoint_spill_ahead"):
            EngineConfig(checkpoint_spill_ahead=bad)
