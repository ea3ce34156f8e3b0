"""Checkpoint tiers on CPU tensors: the host copy and its restore are bit-identical (odd page lists, poisoned
destinations, untouched rows compared bit for bit), the eviction order across the GPU -> host -> disk tiers and LRU
within each, the host arena's blocks (reused after an eviction, held while the disk writer or a copy up still reads
them, a spill with no room sent straight to disk or dropped and counted, none leaked), restores that come back READY
with their tier, the disk format (a restart finds the files; corrupt, truncated and another model's files are
ignored with one log line, never a crash; the size bound), the model fingerprint, and the engine: later turns of
conversations evicted from the device hit from the host and the disk tiers with the outputs of an engine that
recomputes them."""
from __future__ import annotations

import logging
import random
import threading
from concurrent.futures import Executor, Future
from itertools import pairwise
from types import SimpleNamespace

import pytest
import torch

from gdnserve.engine.cache import checkpoint_disk
from gdnserve.engine.cache.checkpoint_copy import Copier, Piece, pieces
from gdnserve.engine.cache.checkpoint_disk import DiskTier
from gdnserve.engine.cache.checkpoint_index import CheckpointStatus, checkpoint_key, conversation_prefix
from gdnserve.engine.cache.checkpoint_tiers import (
    CheckpointTiers,
    TierStats,
    model_fingerprint,
)
from gdnserve.engine.cache.host_arena import HostArena, block_size
from gdnserve.engine.cache.kv_cache import KVCache
from gdnserve.engine.cache.page_pool import PagePool, PagePoolConfig
from gdnserve.engine.cache.state_pool import SlotKind, StatePool, StatePoolConfig
from gdnserve.engine.sampling_params import SamplingParams
from gdnserve.entrypoints.llm import LLM

PS = 4


def pools(num_slots: int = 4, num_pages: int = 24) -> tuple[StatePool, PagePool]:
    st = StatePool(StatePoolConfig(num_layers=3, num_slots=num_slots, HV=2, K=4, V=5, conv_dim=7, conv_width=4))
    pg = PagePool(PagePoolConfig(num_layers=2, num_pages=num_pages, page_size=PS, num_kv_heads=1, head_dim=3))
    for t in (st.conv_pools, st.ssm_pools, pg.k_pools, pg.v_pools):      # random, never zeros
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(t.numel())).to(t.dtype))
    return st, pg


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32).clone()


def test_pieces_cut_a_checkpoint_to_the_staging_buffer():
    per, layers = {"conv": 84, "ssm": 160, "k": 192, "v": 192}, {"conv": 3, "ssm": 3, "k": 2, "v": 2}
    whole = pieces(per, layers, 4, 48, 2**20)
    assert whole == [Piece("conv", 0, 3), Piece("ssm", 0, 3), Piece("k", 0, 2, 0, 4), Piece("v", 0, 2, 0, 4)]
    cut = pieces(per, layers, 4, 48, 160)
    assert cut[:4] == [Piece("conv", 0, 1), Piece("conv", 1, 2), Piece("conv", 2, 3), Piece("ssm", 0, 1)]
    assert [p for p in cut if p.name == "k"] == [Piece("k", 0, 1, 0, 3), Piece("k", 0, 1, 3, 4),
                                                 Piece("k", 1, 2, 0, 3), Piece("k", 1, 2, 3, 4)]
    with pytest.raises(ValueError, match="stage_bytes"):
        pieces(per, layers, 4, 48, 100)


# stage None: straight into the host tensors (CPU's default); 160 B: one SSM layer a piece, a layer's 4 pages cut
# into runs of 3 + 1, many staging batches (CUDA's path, whose default is 128 MiB: one batch); 1 MB: one batch
@pytest.mark.parametrize("stage", [None, 160, 2**20])
def test_copy_and_restore_are_bit_identical_and_touch_nothing_else(stage):
    st, pg = pools()
    cp = Copier(st, pg, stage_bytes=stage)
    src_pages, dst_pages = [5, 6, 2, 9], [0, 1, 3, 17]
    want = {"conv": bits(st.conv_pools[:, 1]), "ssm": bits(st.ssm_pools[:, 1]),
            "k": bits(pg.k_pools[:, src_pages]), "v": bits(pg.v_pools[:, src_pages])}
    hc = cp.snapshot(b"k" * 16, (1, 2, 3), 1, src_pages)
    assert hc.event is None and hc.footprint == cp.bytes_of(4) >= hc.nbytes == st.bytes_per_slot + 4 * pg.bytes_per_page
    for name, t in hc.tensors.items():
        assert torch.equal(bits(t), want[name]), name
    before = [bits(t) for t in (st.conv_pools, st.ssm_pools, pg.k_pools, pg.v_pools)]
    for t in (st.conv_pools[:, 3], st.ssm_pools[:, 3], pg.k_pools[:, dst_pages], pg.v_pools[:, dst_pages]):
        t.fill_(float("nan"))                                         # poisoned destinations
    assert cp.restore(hc, 3, dst_pages) is None
    assert torch.equal(bits(st.conv_pools[:, 3]), want["conv"]) and torch.equal(bits(st.ssm_pools[:, 3]), want["ssm"])
    assert torch.equal(bits(pg.k_pools[:, dst_pages]), want["k"]) and torch.equal(bits(pg.v_pools[:, dst_pages]),
                                                                                  want["v"])
    others = [s for s in range(4) if s != 3]
    assert torch.equal(bits(st.ssm_pools[:, others]), before[1][:, others])
    rest = [p for p in range(24) if p not in dst_pages]
    assert torch.equal(bits(pg.k_pools[:, rest]), before[2][:, rest])
    with pytest.raises(ValueError, match="pages"):
        cp.restore(hc, 3, [0, 1])


# ------------------------------------------------------------------ tiers over bare pools (no model)
class Inline(Executor):
    """The disk tier's I/O thread replaced by the caller: a writer that keeps up (each write done, its host copy's
    block released, inside ``put``), for tests of where checkpoints go; the real thread's lag: ``held_writer``."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        f = Future()
        try:
            f.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001
            f.set_exception(e)
        return f


class Rig:
    """A KVCache with tiers over small random pools; checkpoints made directly (reserve -> pages -> ready). The host
    tier: an arena of ``host_ckpts`` checkpoints of 2 pages. ``hidden``: a per-slot tensor of that width registered
    with the state pool, as the MTP drafter's (a row per slot and a scratch row)."""

    def __init__(self, tmp_path, host_ckpts: int = 0, disk: bool = True, fp: str = "f" * 64, max_bytes=2**30,
                 inline_disk: bool = False, num_pages: int = 24, hidden: int = 0):
        self.st, self.pg = pools(num_pages=num_pages)
        if hidden:
            self.st.register_rows("mtp_hidden", torch.randn(self.st.num_slots + 1, hidden))
        self.per = block_size(Copier(self.st, self.pg).layout_bytes(2))   # every checkpoint here: 6 tokens = 2 pages
        self.arena = HostArena(host_ckpts * self.per, pinned=False) if host_ckpts else None
        self.copier = Copier(self.st, self.pg, arena=self.arena)
        assert self.arena is None or self.copier.bytes_of(2) == self.per
        self.stats = TierStats()
        self.disk = DiskTier(tmp_path, max_bytes, fp, on_bytes=self.stats.add_bytes,
                             names=self.copier.names) if disk else None
        if inline_disk:
            self.disk._io = Inline()
        self.tiers = CheckpointTiers(self.copier, self.disk, self.stats)
        self.kv = KVCache(self.st, self.pg, self.tiers)
        self.ck = self.kv.checkpoint_cache
        self.data: dict[tuple, list[torch.Tensor]] = {}

    def make(self, ids: tuple[int, ...]):
        if self.st.num_free == 0:
            self.ck.evict(1)
        entry, seq = self.ck.reserve(ids, self.pg)
        seq.pages.append_tokens(len(ids))
        rows = [r[entry.slot] for r in self.st.slot_rows.values()]
        for t in (self.st.conv_pools[:, entry.slot], self.st.ssm_pools[:, entry.slot], *rows):
            t.copy_(torch.randn(t.shape).to(t.dtype))
        self.ck.ready(entry, seq.pages)
        self.data[ids] = self.snap(entry)
        return entry

    def snap(self, entry):
        pages = self.ck.pages[entry.key].pages
        return [bits(self.st.conv_pools[:, entry.slot]), bits(self.st.ssm_pools[:, entry.slot]),
                bits(self.pg.k_pools[:, pages]), bits(self.pg.v_pools[:, pages]),
                *[bits(r[entry.slot]) for r in self.st.slot_rows.values()]]

    def block(self, ids):
        return self.tiers.host[checkpoint_key(ids)].block

    def no_leak(self) -> bool:
        """The arena holds exactly the host tier's blocks (none lost, none shared)."""
        blocks = [b for hc in self.tiers.host.values() for b in hc.blocks]
        spans = sorted((b.offset, b.offset + b.size) for b in blocks)
        return self.arena.used == sum(b.size for b in blocks) and all(a[1] <= b[0] for a, b in pairwise(spans))

    def where(self, ids) -> str:
        key = checkpoint_key(ids)
        if key in self.ck.pages:
            return "gpu"
        if key in self.tiers.host:
            return "host"
        return "disk" if self.disk is not None and key in self.disk else "-"

    def restore(self, ids):
        """A lookup that restores: from the host tier a hit at once (the copy up queued in stream order), from disk
        PENDING until the file is read."""
        tier = self.where(ids)
        look = self.ck.lookup(ids)
        if tier == "host":
            assert look.hit and look.entry.status is CheckpointStatus.READY and not self.ck.restoring()
        else:
            assert look.entry is not None and look.entry.status is CheckpointStatus.PENDING and self.ck.restoring()
        self.ck.poll(wait=True)
        assert look.entry.status is CheckpointStatus.READY and not self.tiers.landing
        return look.entry


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


IDS = [tuple(range(10 * i, 10 * i + 6)) for i in range(8)]


def test_eviction_order_gpu_then_host_then_disk_lru_in_each(tmp_path):
    r = Rig(tmp_path, host_ckpts=2, inline_disk=True)         # a writer that keeps up: B's block is back for D
    for ids in IDS[:4]:
        r.make(ids)                                    # the 4 slots full
    r.ck.acquire(r.ck.lookup(IDS[0]).entry)            # A is pinned: B is the device's LRU unreferenced entry
    r.make(IDS[4])
    assert r.where(IDS[1]) == "host"
    r.make(IDS[5])
    r.make(IDS[6])                                     # C, D down; the host tier holds 2: B goes to disk
    r.disk.flush()
    assert [r.where(i) for i in IDS[:7]] == ["gpu", "disk", "host", "host", "gpu", "gpu", "gpu"]
    assert r.stats.spills == 3 and r.tiers.host_used == 2 * r.per
    e = r.restore(IDS[2])                              # from the host (room made: E, the LRU, copied down)
    assert e.origin == "host" and r.ck.hit_tier(e) == "host" and r.ck.hit_tier(e) == "gpu"
    assert same(r.snap(e), r.data[IDS[2]])
    assert r.where(IDS[4]) == "host" and IDS[2] not in [hc.token_ids for hc in r.tiers.host.values()]
    e = r.restore(IDS[1])                              # from the disk: the file stays
    assert e.origin == "disk" and same(r.snap(e), r.data[IDS[1]])
    assert r.stats.restores == {"host": 1, "disk": 1} and r.where(IDS[1]) == "gpu"
    assert checkpoint_key(IDS[1]) in r.disk
    r.disk.flush()
    assert r.ck.index.check_integrity() == [] and r.st.check_integrity() == [] and r.pg.check_integrity() == []
    r.ck.release(r.ck.lookup(IDS[0]).entry)
    r.ck.evict(len(r.ck))
    assert r.st.num_free == r.st.num_slots and r.pg.num_free == r.pg.num_pages and r.no_leak()


def _counts(r) -> dict[str, int]:
    """The index's lookup counters that are not zero."""
    return {k: v for k, v in r.ck.index.stats().items() if (k == "hits" or k.startswith("misses")) and v}


def test_a_lookup_served_from_a_lower_tier_counts_one_hit_and_no_miss(tmp_path):
    """Issue 30 leftover: a host-tier restore counted the device's miss (evicted) and then the hit. A lookup a lower
    tier serves is one hit of the index (of its tier in TierStats, at the admission's ``hit_tier``); the lookups
    that start or wait for a disk read count nothing, the one after it the hit; a failed restore one miss."""
    r = Rig(tmp_path, host_ckpts=1, inline_disk=True)
    for ids in IDS[:6]:
        r.make(ids)                                    # IDS[0] to the host tier, then to disk for IDS[1]
    r.disk.flush()
    assert [r.where(i) for i in IDS[:2]] == ["disk", "host"] and _counts(r) == {}
    e = r.restore(IDS[1])                              # from the host tier: READY at the lookup
    assert _counts(r) == {"hits": 1}
    assert r.ck.hit_tier(e) == "host" and r.stats.hits == {"gpu": 0, "host": 1, "disk": 0}
    look = r.ck.lookup(IDS[0])                         # from disk: PENDING until the read lands
    assert look.reason.value == "pending" and r.ck.is_restoring(look.entry)
    assert r.ck.lookup(IDS[0]).entry is look.entry and r.ck.lookup(IDS[0]).entry is look.entry   # waiters
    assert _counts(r) == {"hits": 1}
    r.ck.poll(wait=True)
    again = r.ck.lookup(IDS[0])
    assert again.hit and again.entry is look.entry and _counts(r) == {"hits": 2}
    assert r.ck.hit_tier(again.entry) == "disk" and r.stats.hits == {"gpu": 0, "host": 1, "disk": 1}
    assert r.ck.lookup(IDS[0]).hit and _counts(r) == {"hits": 3}     # on the device now: a plain hit
    victim = r.ck.index.lru_victims(1)[0].token_ids    # a device eviction with the key nowhere below: one miss
    r.copier.arena, r.tiers.disk = None, None
    r.ck.evict(1)
    assert not r.ck.lookup(victim).hit and _counts(r) == {"hits": 3, "misses_evicted": 1}


def test_a_failed_disk_restore_counts_one_miss(tmp_path):
    r = Rig(tmp_path, host_ckpts=0)
    for ids in IDS[:5]:
        r.make(ids)                                    # IDS[0] to disk
    r.disk.flush()
    f = r.disk.dir / f"{checkpoint_key(IDS[0]).hex()}.gck"
    data = bytearray(f.read_bytes())
    data[-100] ^= 0xFF                                 # corrupt: the read fails its checksum
    f.write_bytes(bytes(data))
    look = r.ck.lookup(IDS[0])
    assert r.ck.is_restoring(look.entry) and _counts(r) == {}
    r.ck.poll(wait=True)
    assert not r.ck.lookup(IDS[0]).hit and _counts(r) == {"misses_absent": 1}


def test_a_continued_checkpoint_enters_the_host_tier_cold(tmp_path):
    """A chat's next turn continued A (its longer successor serves the turn after): when A and B come down, B is
    kept and A goes first under pressure, although A was evicted from the device later."""
    r = Rig(tmp_path, host_ckpts=2, disk=False)
    a = [r.make(ids) for ids in IDS[:4]][1]
    assert r.ck.hit_tier(a, continued=True) == "gpu" and a.continued
    r.ck.evict(2)                                      # IDS[0] (plain) then IDS[1] (continued) come down
    assert [hc.token_ids for hc in r.tiers.host.values()] == [IDS[1], IDS[0]]
    r.make(IDS[4])
    r.make(IDS[5])
    r.ck.evict(1)                                      # IDS[2] comes down: the host tier drops the continued one
    assert r.where(IDS[1]) == "-" and r.where(IDS[0]) == "host" and r.where(IDS[2]) == "host"


def test_a_restore_leaves_the_pages_an_admission_pass_promised(tmp_path):
    """Pages promised to running requests and this pass's admissions are allocated only when the step runs: a
    restore started by a lookup in the pass must not take them (it evicts for room, or misses)."""
    r = Rig(tmp_path, host_ckpts=4, disk=False)
    for ids in IDS[:5]:
        r.make(ids)                                     # IDS[0] down in the host tier
    r.ck.evict(1)                                       # and IDS[1]: a slot is free
    promised = r.pg.num_free                            # every free page promised
    r.ck.promised = lambda: promised
    e = r.restore(IDS[0])                               # room made by evicting a device checkpoint
    assert e.origin == "host" and r.pg.num_free >= promised and r.where(IDS[2]) == "host"
    for x in r.ck.index.ready_entries():
        r.ck.acquire(x)                                 # all pinned: no room without the promised pages
    assert r.st.num_free == 1
    r.ck.promised = lambda: r.pg.num_free - 1
    look = r.ck.lookup(IDS[1])
    assert look.entry is None and r.where(IDS[1]) == "host"


def test_no_room_for_a_restore_is_a_plain_miss(tmp_path):
    r = Rig(tmp_path, host_ckpts=4, disk=False)
    for ids in IDS[:5]:
        r.make(ids)
    for ids in IDS[1:5]:
        r.ck.acquire(r.ck.lookup(ids).entry)           # every device checkpoint pinned
    block = r.block(IDS[0])
    look = r.ck.lookup(IDS[0])                         # in the host tier, but no slot can be freed
    assert not look.hit and look.entry is None and not r.ck.restoring() and r.where(IDS[0]) == "host"
    assert r.block(IDS[0]) is block and r.no_leak()    # unclaimed with its block


# ------------------------------------------------------------------ the host arena: blocks and their release
def held_writer(monkeypatch) -> threading.Event:
    """The disk writer thread held before it reads a checkpoint's tensors, until the returned event is set."""
    gate, encode = threading.Event(), checkpoint_disk.encode

    def held(hc, fingerprint):
        assert gate.wait(20), "the test never let the writer go"
        return encode(hc, fingerprint)

    monkeypatch.setattr(checkpoint_disk, "encode", held)
    return gate


class LateEvent:
    """A copy up's event that completes when the test says so (on CPU the copies are synchronous)."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def late_restores(r: Rig, monkeypatch) -> list[LateEvent]:
    """Every copy up from now on reports a LateEvent (the copy itself done, synchronously)."""
    events, restore = [], r.copier.restore

    def late(hc, slot, pages):
        restore(hc, slot, pages)
        events.append(LateEvent())
        return events[-1]

    monkeypatch.setattr(r.copier, "restore", late)
    return events


def _fragmented(st, pg, pages: int):
    """An arena of four one-page blocks with blocks 0 and 2 freed (two one-page holes, not adjacent) and a copier
    over it, for a checkpoint of ``pages`` pages that needs two pages of the arena: no hole holds it whole."""
    assert block_size(Copier(st, pg).layout_bytes(pages)) == 2 * 4096
    arena = HostArena(4 * 4096, pinned=False)
    fill = [arena.alloc(1) for _ in range(4)]
    arena.free(fill[0])
    arena.free(fill[2])
    assert arena.alloc(2 * 4096) is None                # the contiguous allocator finds no hole
    return arena, Copier(st, pg, arena=arena), fill


# pieces straddle the extents' boundary: into the host tensors (None), per piece and page run (160 B), one batch
@pytest.mark.parametrize("stage", [None, 160, 2**20])
def test_a_checkpoint_in_two_extents_of_a_fragmented_arena_restores_bit_identical(stage):
    st, pg = pools(num_pages=72)
    src, dst = list(range(70, 6, -1)), list(range(64))
    arena, cp, fill = _fragmented(st, pg, len(src))
    cp.stage_bytes = stage or 0
    want = [bits(st.conv_pools[:, 1]), bits(st.ssm_pools[:, 1]), bits(pg.k_pools[:, src]), bits(pg.v_pools[:, src])]
    plain = cp.snapshot(b"k" * 16, (1, 2), 1, src)     # the same checkpoint in a plain allocation
    hc = cp.empty(b"k" * 16, (1, 2), len(src))
    assert [(b.offset, b.size) for b in hc.blocks] == [(0, 4096), (2 * 4096, 4096)] and hc.block is None
    assert arena.used == 4 * 4096 and hc.footprint == cp.bytes_of(len(src)) and cp.fits(hc)
    cp.copy_down(hc, 1, src)
    got = hc.host_tensors()
    assert list(got) == list(cp.names) and all(torch.equal(bits(got[n]), bits(plain.tensors[n])) for n in got)
    for t in (st.conv_pools[:, 3], st.ssm_pools[:, 3], pg.k_pools[:, dst], pg.v_pools[:, dst]):
        t.fill_(float("nan"))
    assert cp.restore(hc, 3, dst) is None
    after = [bits(st.conv_pools[:, 3]), bits(st.ssm_pools[:, 3]), bits(pg.k_pools[:, dst]), bits(pg.v_pools[:, dst])]
    assert same(after, want)
    assert checkpoint_disk.encode(hc, "f" * 64) == checkpoint_disk.encode(plain, "f" * 64)   # the same file
    hc.release()
    hc.release()
    assert arena.used == 2 * 4096 and not hc.blocks
    again = cp.empty(b"x" * 16, (1,), len(src))      # the extents go back and are reused
    assert [b.offset for b in again.blocks] == [0, 2 * 4096]
    arena.free(fill[1])
    arena.free(fill[3])
    again.release()
    assert arena.used == 0 and arena.largest_free == arena.capacity


def test_a_checkpoint_in_extents_round_trips_through_the_disk_tier(tmp_path):
    st, pg = pools(num_pages=72)
    src = list(range(64))
    arena, cp, _ = _fragmented(st, pg, len(src))
    hc = cp.empty(b"k" * 16, (5, 6, 7), len(src))
    cp.copy_down(hc, 2, src)
    want = {n: bits(t) for n, t in hc.host_tensors().items()}
    disk = DiskTier(tmp_path, 2**20, "f" * 64, names=cp.names)
    disk._io.shutdown(wait=True)
    disk._io = Inline()
    disk.put(hc)                                       # written, its two blocks released by the writer
    assert arena.used == 2 * 4096 and not hc.blocks and len(disk) == 1
    back = disk.load(b"k" * 16).result()
    assert back is not None and back.token_ids == (5, 6, 7) and cp.fits(back)
    assert all(torch.equal(bits(back.tensors[n]), want[n]) for n in want)


def test_an_arena_copier_carves_checkpoints_and_releases_them_once():
    st, pg = pools()
    per = block_size(Copier(st, pg).layout_bytes(4))
    arena = HostArena(2 * per, pinned=False)
    cp = Copier(st, pg, arena=arena)
    src, dst = [5, 6, 2, 9], [0, 1, 3, 17]
    want = [bits(st.conv_pools[:, 1]), bits(st.ssm_pools[:, 1]), bits(pg.k_pools[:, src]), bits(pg.v_pools[:, src])]
    hc = cp.empty(b"k" * 16, (1, 2, 3), 4)
    assert hc.block is not None and hc.footprint == hc.block.size == cp.bytes_of(4) == per and per % 4096 == 0
    base = arena.view(hc.block).data_ptr()
    assert all(base <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= base + per
               for t in hc.tensors.values())               # the four tensors: views into its block
    cp.copy_down(hc, 1, src)
    assert cp.empty(b"o" * 16, (1,), 4) is not None and cp.empty(b"x" * 16, (1,), 4) is None   # full: None
    for t in (st.conv_pools[:, 3], st.ssm_pools[:, 3], pg.k_pools[:, dst], pg.v_pools[:, dst]):
        t.fill_(float("nan"))
    cp.restore(hc, 3, dst)
    got = [bits(st.conv_pools[:, 3]), bits(st.ssm_pools[:, 3]), bits(pg.k_pools[:, dst]), bits(pg.v_pools[:, dst])]
    assert same(got, want)
    hc.release()
    hc.release()                                       # once: the second is nothing
    assert arena.used == per and hc.block is None
    plain = cp.snapshot(b"p" * 16, (1,), 1, src)       # snapshot: a plain allocation, outside the arena
    assert plain.block is None and plain.footprint == cp.layout_bytes(4) and arena.used == per
    plain.release()


def test_a_full_arena_evicts_the_host_lru_and_reuses_its_block(tmp_path):
    r = Rig(tmp_path, host_ckpts=2, disk=False)
    for ids in IDS[:6]:
        r.make(ids)                                    # IDS[0], IDS[1] down: the arena full
    assert [r.where(i) for i in IDS[:2]] == ["host", "host"] and r.arena.used == r.arena.capacity
    first = r.block(IDS[0])
    r.ck.evict(1)                                      # IDS[2] down: IDS[0], the LRU, dropped; its block taken
    assert r.where(IDS[0]) == "-" and r.block(IDS[2]).offset == first.offset
    assert r.stats.dropped == 0 and r.stats.spills == 3 and r.no_leak()
    for ids in (IDS[2], IDS[1]):                       # bit for bit what was evicted, in a reused block too
        e = r.restore(ids)
        assert e.origin == "host" and same(r.snap(e), r.data[ids])
    assert r.no_leak()


def test_a_block_evicted_to_disk_is_held_until_the_writer_has_read_it(tmp_path, monkeypatch):
    """The writer thread reads a host checkpoint's tensors after the spill that evicted it: its block is not free
    until then (a spill copying into it first would write the other checkpoint's bytes into the file). Meanwhile
    a spill with no room goes to disk in a plain allocation."""
    gate = held_writer(monkeypatch)
    r = Rig(tmp_path, host_ckpts=2)
    for ids in IDS[:6]:
        r.make(ids)                                    # IDS[0], IDS[1] in the host tier: the arena full
    r.ck.evict(1)                                      # IDS[2] down: IDS[0] to disk, its block still the writer's
    assert [r.where(i) for i in IDS[:3]] == ["disk", "host", "disk"]       # IDS[2]: no room now, straight to disk
    assert r.arena.used == 2 * r.per and r.stats.spills == 3 and r.stats.dropped == 0
    r.ck.evict(1)                                      # IDS[3] down: IDS[1] to disk, IDS[3] straight to disk
    assert [r.where(i) for i in IDS[:4]] == ["disk"] * 4 and r.arena.used == 2 * r.per and not r.tiers.host
    gate.set()
    r.disk.flush()
    assert r.arena.used == 0 and len(r.disk) == 4      # both blocks released by the writer, every file written
    r.ck.evict(1)                                      # IDS[4] down: into a released block
    assert r.where(IDS[4]) == "host" and r.no_leak()
    for ids in IDS[:4]:                                # the files hold what was evicted, bit for bit
        e = r.restore(ids)
        assert e.origin == "disk" and same(r.snap(e), r.data[ids])
    r.disk.flush()
    assert r.no_leak()


def test_a_failed_write_releases_the_block(tmp_path, monkeypatch):
    r = Rig(tmp_path, host_ckpts=1)

    def broken(hc, fingerprint):
        raise OSError("disk on fire")
    monkeypatch.setattr(checkpoint_disk, "encode", broken)
    for ids in IDS[:6]:
        r.make(ids)                                    # IDS[0] down, then to disk for IDS[1]: the write fails
    r.disk.flush()
    assert r.where(IDS[0]) == "-" and r.no_leak() and r.arena.used == r.per


def test_a_claimed_block_goes_back_once_its_copy_up_is_queued(tmp_path, monkeypatch):
    """A host restore's block returns to the arena when its copy up is queued (the copier's stream orders the next
    copy into it after; the GPU test checks that on the device), so a later spill reuses it at once; the restore's
    latency is counted when its event completes."""
    r = Rig(tmp_path, host_ckpts=2, disk=False)
    for ids in IDS[:5]:
        r.make(ids)                                    # IDS[0] down
    r.ck.evict(1)                                      # IDS[1] down: a slot free
    block = r.block(IDS[0])
    events = late_restores(r, monkeypatch)
    look = r.ck.lookup(IDS[0])                         # READY at once: the copy up is queued in stream order
    assert look.hit and r.where(IDS[0]) == "gpu" and len(r.tiers.landing) == 1
    assert r.arena.used == r.per                       # IDS[1] in the tier; IDS[0]'s block back already
    r.ck.evict(1)                                      # IDS[2] down: into the free block, IDS[1] stays
    assert r.where(IDS[1]) == "host" and r.block(IDS[2]).offset == block.offset
    r.ck.poll()
    assert r.tiers.landing and r.stats.restores["host"] == 0
    events[0].done = True
    r.ck.poll()                                        # retired: counted
    assert not r.tiers.landing and r.arena.used == 2 * r.per and r.stats.restores["host"] == 1 and r.no_leak()
    assert same(r.snap(look.entry), r.data[IDS[0]])


def test_no_room_without_a_disk_tier_drops_the_checkpoint_and_counts_it(tmp_path, monkeypatch):
    r = Rig(tmp_path, host_ckpts=1, disk=False, num_pages=72)
    big = tuple(range(1000, 1216))                     # 216 tokens, 54 pages: larger than the arena
    r.make(big)
    assert r.copier.bytes_of(54) > r.arena.capacity
    r.ck.evict(1)
    assert r.where(big) == "-" and r.stats.dropped == 1 and r.stats.spills == 0 and r.arena.used == 0
    for ids in IDS[:5]:
        r.make(ids)                                    # IDS[0] in the host tier (the arena's one block)
    late_restores(r, monkeypatch)
    assert r.ck.lookup(IDS[0]).hit                     # IDS[1] evicted for its slot: the one block is IDS[0]'s,
    assert r.where(IDS[1]) == "-" and r.stats.dropped == 2      # held by the copy up, the tier empty: dropped
    r.ck.evict(1)                                      # the copy up queued since: its block takes this one
    assert r.stats.dropped == 2 and len(r.tiers.host) == 1 and r.arena.used == r.per
    from gdnserve.entrypoints.metrics import _TierCollector
    metric = {m.name: m for m in _TierCollector(SimpleNamespace(tier_stats=r.stats)).collect()}
    assert metric["gdnserve:checkpoint_spills_dropped"].samples[0].value == 2        # exported with the spills


def test_no_room_with_a_disk_tier_goes_straight_to_disk(tmp_path):
    r = Rig(tmp_path, host_ckpts=1, num_pages=72)
    big = tuple(range(1000, 1216))                     # larger than the arena: a plain allocation, to disk
    r.make(big)
    r.ck.evict(1)
    r.disk.flush()
    assert r.where(big) == "disk" and r.arena.used == 0 and r.stats.dropped == 0 and r.stats.spills == 1
    e = r.restore(big)
    assert e.origin == "disk" and same(r.snap(e), r.data[big])


def test_restart_finds_the_files_and_the_size_bound_keeps_the_newest(tmp_path):
    r = Rig(tmp_path, host_ckpts=0)
    for ids in IDS[:6]:
        r.make(ids)                                    # two evicted straight to disk (no host tier)
    r.ck.close()                                       # graceful shutdown: the rest follows
    assert len(r.disk) == 6
    r2 = Rig(tmp_path, host_ckpts=0)
    assert len(r2.disk) == 6 and r2.disk.lengths() == {6}
    e = r2.restore(IDS[3])
    assert e.origin == "disk" and same(r2.snap(e), r.data[IDS[3]])
    r2.disk.flush()
    newest = sum(f.stat().st_size for f in sorted(r2.disk.dir.glob("*.gck"), key=lambda f: f.stat().st_mtime_ns)[-3:])
    r3 = Rig(tmp_path, host_ckpts=0, max_bytes=newest)
    assert len(r3.disk) == 3 and sorted(p.name for p in r3.disk.dir.glob("*.gck")).__len__() == 3
    assert checkpoint_key(IDS[3]) in r3.disk          # the restored one was touched: among the newest


def test_corrupt_truncated_and_foreign_files_are_ignored_with_one_line(tmp_path, caplog):
    r = Rig(tmp_path, host_ckpts=0)
    for ids in IDS[:3]:
        r.make(ids)
    r.ck.close()
    files = {f.stem: f for f in r.disk.dir.glob("*.gck")}
    corrupt, cut = files[checkpoint_key(IDS[0]).hex()], files[checkpoint_key(IDS[1]).hex()]
    data = bytearray(corrupt.read_bytes())
    data[-100] ^= 0xFF                                 # a payload byte: only the checksum can tell
    corrupt.write_bytes(bytes(data))
    cut.write_bytes(cut.read_bytes()[:-7])
    (r.disk.dir / "junk.gck").write_bytes(b"not a checkpoint")
    caplog.set_level(logging.WARNING)
    r2 = Rig(tmp_path, host_ckpts=0)
    lines = [m for m in caplog.messages if "ignored" in m]
    assert len(lines) == 2 and any("truncated" in m for m in lines) and any("magic" in m for m in lines)
    assert len(r2.disk) == 2
    caplog.clear()
    look = r2.ck.lookup(IDS[0])                        # the corrupt one: its restore fails, the request misses
    assert look.entry is not None
    r2.ck.poll(wait=True)
    assert look.entry.status is CheckpointStatus.DROPPED and not r2.ck.restoring()
    assert [m for m in caplog.messages if "checksum" in m] and len(caplog.messages) == 1
    assert r2.stats.restore_failures == 1 and not corrupt.exists() and not r2.ck.lookup(IDS[0]).entry
    assert r2.st.check_integrity() == [] and r2.pg.check_integrity() == [] and r2.ck.index.check_integrity() == []
    assert r2.restore(IDS[2]).origin == "disk"          # the intact one still loads


def test_another_models_files_never_load(tmp_path, caplog):
    r = Rig(tmp_path, host_ckpts=0, fp="a" * 64)
    r.make(IDS[0])
    r.ck.close()
    other = Rig(tmp_path, host_ckpts=0, fp="b" * 64)
    assert len(other.disk) == 0 and other.ck.lookup(IDS[0]).entry is None
    f = next(r.disk.dir.glob("*.gck"))                 # even a file copied into its directory
    (other.disk.dir / f.name).write_bytes(f.read_bytes())
    caplog.set_level(logging.WARNING)
    again = Rig(tmp_path, host_ckpts=0, fp="b" * 64)
    assert len(again.disk) == 0 and any("another model" in m for m in caplog.messages)


def test_model_fingerprint_sees_weights_dtype_and_pool_layout():
    from gdnserve.models.builtin import build_builtin_model
    m1, m2 = build_builtin_model(seed=0), build_builtin_model(seed=0)
    st, pg = pools()
    fp = model_fingerprint(m1, torch.float32, 1, st.config, pg.config)
    assert fp == model_fingerprint(m2, torch.float32, 1, st.config, pg.config)
    assert fp != model_fingerprint(m1, torch.bfloat16, 1, st.config, pg.config)
    assert fp != model_fingerprint(m1, torch.float32, 2, st.config, pg.config)
    st2, pg2 = pools(num_pages=8)
    assert fp == model_fingerprint(m1, torch.float32, 1, st2.config, pg2.config)   # pool sizes do not matter
    from dataclasses import replace
    assert fp != model_fingerprint(m1, torch.float32, 1, st.config, replace(pg.config, page_size=8))
    with torch.no_grad():
        next(iter(m2.parameters())).view(-1)[0] += 1.0
    assert fp != model_fingerprint(m2, torch.float32, 1, st.config, pg.config)


# ------------------------------------------------------------------ the engine
def _run(e, ids, max_tokens=4):
    rid = e.add_request(None, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    out = None
    while e.has_unfinished():
        for o in e.step():
            if o.request_id == rid and o.finished:
                out = o
    return out


@pytest.fixture(scope="module")
def ref():
    return LLM(device="cpu", max_num_seqs=2, num_pages=256, auto_checkpoints=False).engine


_rng = random.Random(30)
CONVS = [[_rng.randrange(3, 250) for _ in range(19 + i)] for i in range(6)]


def test_later_turns_hit_from_the_host_tier_with_recomputed_outputs(ref):
    e = LLM(device="cpu", max_num_seqs=2, num_slots=4, num_pages=64, page_size=8,
            checkpoint_host_memory_gb=0.01).engine
    first = [_run(e, c).outputs[0].token_ids for c in CONVS]
    assert len(e.kv.checkpoint_cache.tiers.host) >= 2          # the device holds at most 4 checkpoints
    for c, out in zip(CONVS, first):
        ids = c + out + [7, 8, 9]
        got = _run(e, ids)
        assert got.checkpoint.hit_length == len(c) + len(out) - 1 and got.checkpoint.tier in ("gpu", "host")
        assert got.outputs[0].token_ids == _run(ref, ids).outputs[0].token_ids
    assert e.tier_stats.hits["host"] >= 2 and e.tier_stats.restores["host"] == e.tier_stats.hits["host"]
    # each hit counted once: by the admission (one per tier) and by the index (a host hit is no device miss)
    assert sum(e.tier_stats.hits.values()) == e.stats()["checkpoint_hits"] == e.index.stats()["hits"] == 6
    assert e.index.stats()["misses_evicted"] == 0 and e.stats()["checkpoint_misses"] == {}
    # a host-tier hit costs no step of its own: the restore is queued in stream order and the request runs in the
    # step whose admission found it (it used to wait in the queue for one step)
    held = list(e.kv.checkpoint_cache.tiers.host.values())
    assert held, "no checkpoint in the host tier"
    ids = list(held[-1].token_ids) + [11]
    e.add_request("busy", [3, 4, 5], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    e.step()                                  # a decode in every step: the step never waits for a restore alone
    e.add_request("one-step", ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    done = [o for o in e.step() if o.request_id == "one-step" and o.finished]
    assert done and done[0].checkpoint.tier == "host" and done[0].checkpoint.hit_length == len(ids) - 1
    assert done[0].outputs[0].token_ids == _run(ref, ids, 1).outputs[0].token_ids
    while e.has_unfinished():
        e.step()
    assert e.index.check_integrity() == [] and e.runner.state.check_integrity() == []
    e.evict_checkpoints(len(e.index))
    assert e.runner.state.num_free == e.runner.state.num_slots and e.runner.pages.num_free == e.runner.pages.num_pages
    tiers = e.kv.checkpoint_cache.tiers
    arena = tiers.arena
    assert arena.capacity == int(0.01 * 2**30) // 4096 * 4096 and tiers.host   # the arena is the tier's size
    assert arena_holds_the_host_tier(tiers)            # no block leaked by the spills, evictions and restores
    e.close()                                          # the arena closed with the engine
    assert arena.closed and tiers.arena is None and not tiers.host


def arena_holds_the_host_tier(tiers) -> bool:
    """Arena bytes in use == the host tier's blocks, which do not overlap (nothing with the writer or a copy up)."""
    blocks = sorted((b.offset, b.size) for hc in tiers.host.values() for b in hc.blocks)
    return tiers.arena.used == sum(n for _, n in blocks) and all(o + n <= p for (o, n), (p, _) in pairwise(blocks))


def test_disk_tier_across_an_engine_restart(tmp_path, ref):
    kw = {"device": "cpu", "max_num_seqs": 2, "num_slots": 4, "num_pages": 64, "page_size": 8,
          "checkpoint_dir": str(tmp_path)}
    e = LLM(**kw).engine
    first = [_run(e, c).outputs[0].token_ids for c in CONVS[:3]]
    e.close()
    e2 = LLM(**kw).engine
    assert len(e2.kv.checkpoint_cache.tiers.disk) == 3
    for c, out in zip(CONVS[:3], first):
        got = _run(e2, c + out + [5])
        assert got.checkpoint.tier == "disk" and got.checkpoint.hit_length == len(c) + len(out) - 1
        assert got.outputs[0].token_ids == _run(ref, c + out + [5]).outputs[0].token_ids
    assert e2.tier_stats.bytes["disk_read"] > 0


def test_checkpoint_keys_list_the_lower_tiers_as_ready(tmp_path):
    """Issue 30 leftover: a replica's router reads ``checkpoint_keys`` (READY, PENDING, lengths); it listed only the
    device's index, so a conversation whose checkpoint was spilled to the host or disk tier (a hit there, restored
    at 0.075x its recompute on the H200) was routed elsewhere. The lower tiers' keys are READY with their lengths,
    each key once."""
    kw = {"device": "cpu", "max_num_seqs": 2, "num_slots": 4, "num_pages": 64, "page_size": 8,
          "checkpoint_dir": str(tmp_path)}
    e = LLM(checkpoint_host_memory_gb=0.01, **kw).engine
    first = [_run(e, c).outputs[0].token_ids for c in CONVS]
    want = {checkpoint_key(conversation_prefix(c, out)): len(c) + len(out) - 1 for c, out in zip(CONVS, first)}
    on_device = set(e.index.keys()[0])
    below = set(want) - on_device
    assert below and all(k in e.kv.checkpoint_cache.tiers.host for k in below)     # 4 slots: 2 spilled
    ready, pending, lengths = e.checkpoint_keys()
    assert set(want) <= set(ready) and not pending and set(want.values()) <= set(lengths)
    assert len(ready) == len(set(ready)) and lengths == sorted(lengths)
    arena = e.kv.checkpoint_cache.tiers.arena
    e.close()                                          # every checkpoint written to disk
    assert arena.closed and arena.used == 0            # the host tier's blocks went to disk, released by the writer
    e2 = LLM(**kw).engine
    assert len(e2.index) == 0
    ready, pending, lengths = e2.checkpoint_keys()
    assert set(ready) == set(want) and not pending and lengths == sorted(set(want.values()))
    c, out = CONVS[0], first[0]
    assert _run(e2, c + out + [5]).checkpoint.tier == "disk"      # the key the router saw is a hit there
    ready, _, _ = e2.checkpoint_keys()                # on the device and still on disk: listed once
    assert set(ready) >= set(want) and len(ready) == len(set(ready))


def test_tiers_refused_with_tensor_parallel():
    from gdnserve.engine.config import EngineConfig
    with pytest.raises(ValueError, match="checkpoint_host_memory_gb"):
        EngineConfig(tensor_parallel_size=2, checkpoint_host_memory_gb=1)
    with pytest.raises(ValueError, match="checkpoint_dir_max_gb"):
        EngineConfig(checkpoint_dir_max_gb=-1)
    assert SlotKind.CHECKPOINT  # (the tiers use only checkpoint slots)


def test_a_host_tier_beyond_the_ram_is_refused_at_start():
    from gdnserve.engine.cache.host_memory import meminfo_available
    with pytest.raises(ValueError, match="checkpoint_host_memory_gb"):
        LLM(device="cpu", max_num_seqs=2, num_pages=64, checkpoint_host_memory_gb=meminfo_available() / 2**30)


def test_a_full_write_queue_drops_the_checkpoint(tmp_path, monkeypatch):
    from gdnserve.engine.cache import checkpoint_disk
    r = Rig(tmp_path, host_ckpts=0)
    monkeypatch.setattr(checkpoint_disk, "MAX_QUEUED", 0)
    for ids in IDS[:5]:
        r.make(ids)                                      # IDS[0] evicted: its write does not fit the queue
    r.disk.flush()
    assert r.disk.dropped == 1 and len(r.disk) == 0 and r.where(IDS[0]) == "-"


def test_waiting_requests_without_a_seat_start_no_restore():
    """Next turns that arrive together while max_num_seqs = 1 runs one at a time: each restores its checkpoint from
    the host tier once, when it is admitted (the waiters' lookups used to restore theirs every step only for the
    next waiter's restore to evict them again: 44 restores for 6 hits)."""
    e = LLM(device="cpu", max_num_seqs=1, num_slots=4, num_pages=64, page_size=8,
            checkpoint_host_memory_gb=0.01).engine
    rng = random.Random(30)
    convs = [[rng.randrange(3, 250) for _ in range(15 + 3 * i)] for i in range(6)]
    first = [_run(e, c).outputs[0].token_ids for c in convs]
    assert len(e.kv.checkpoint_cache.tiers.host) >= 2
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for c, out in zip(convs, first):
        e.add_request(None, c + out + [7, 8], params)
    while e.has_unfinished():
        e.step()
    hits, restores = e.tier_stats.hits["host"], e.tier_stats.restores["host"]
    assert hits >= 2 and restores == hits, (hits, restores)


def _boom(*a, **k):
    raise RuntimeError("out of memory (the staging buffer)")


def test_a_failed_copy_down_gives_its_block_back(tmp_path):
    """A spill whose copy raises (the staging buffer's allocation, a CUDA error) leaves no arena block behind."""
    r = Rig(tmp_path, host_ckpts=2, disk=False)
    for ids in IDS[:4]:
        r.make(ids)
    r.copier.copy_down = _boom
    with pytest.raises(RuntimeError, match="out of memory"):
        r.ck.evict(1)
    assert r.arena.used == sum(hc.footprint for hc in r.tiers.host.values())


def test_a_failed_restore_puts_the_claimed_copy_back(tmp_path):
    """A restore whose copy up raises after the host copy was claimed: the checkpoint is back in the host tier
    with its block, no PENDING entry or reserved page is left, and a later lookup restores it bit-exactly."""
    r = Rig(tmp_path, host_ckpts=2, disk=False)
    for ids in IDS[:5]:
        r.make(ids)
    assert r.where(IDS[0]) == "host"
    free = r.pg.num_free, r.st.num_free
    real, r.copier.restore = r.copier.restore, _boom
    with pytest.raises(RuntimeError, match="out of memory"):
        r.ck.lookup(IDS[0])
    assert r.where(IDS[0]) == "host" and r.ck.index.stats()["entries_pending"] == 0
    assert r.arena.used == sum(hc.footprint for hc in r.tiers.host.values())
    assert (r.pg.num_free, r.st.num_free) >= free       # what was evicted for it stays free, nothing held
    r.copier.restore = real
    e = r.restore(IDS[0])
    assert e.origin == "host" and all(torch.equal(a, b) for a, b in zip(r.snap(e), r.data[IDS[0]]))
