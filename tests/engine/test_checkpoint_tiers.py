"""Checkpoint tiers on CPU tensors: the host copy and its restore are bit-identical (odd page lists, poisoned
destinations, untouched rows compared bit for bit), the eviction order across the GPU -> host -> disk tiers and LRU
within each, restores that come back READY with their tier, the disk format (a restart finds the files; corrupt,
truncated and another model's files are ignored with one log line, never a crash; the size bound), the model
fingerprint, and the engine: later turns of conversations evicted from the device hit from the host and the disk
tiers with the outputs of an engine that recomputes them."""
from __future__ import annotations

import logging
import random

import pytest
import torch

from gdnserve.engine.cache.checkpoint_copy import Copier, Piece, pieces
from gdnserve.engine.cache.checkpoint_disk import DiskTier
from gdnserve.engine.cache.checkpoint_index import CheckpointStatus, checkpoint_key, conversation_prefix
from gdnserve.engine.cache.checkpoint_tiers import (
    CheckpointTiers,
    TierStats,
    model_fingerprint,
)
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
class Rig:
    """A KVCache with tiers over small random pools; checkpoints made directly (reserve -> pages -> ready)."""

    def __init__(self, tmp_path, host_ckpts: int = 0, disk: bool = True, fp: str = "f" * 64, max_bytes=2**30):
        self.st, self.pg = pools()
        self.copier = Copier(self.st, self.pg)
        self.per = self.copier.bytes_of(2)                     # every checkpoint here has 6 tokens = 2 pages
        self.stats = TierStats()
        self.disk = DiskTier(tmp_path, max_bytes, fp, on_bytes=self.stats.add_bytes) if disk else None
        self.tiers = CheckpointTiers(self.copier, host_ckpts * self.per, self.disk, self.stats)
        self.kv = KVCache(self.st, self.pg, self.tiers)
        self.ck = self.kv.checkpoint_cache
        self.data: dict[tuple, list[torch.Tensor]] = {}

    def make(self, ids: tuple[int, ...]):
        if self.st.num_free == 0:
            self.ck.evict(1)
        entry, seq = self.ck.reserve(ids, self.pg)
        seq.pages.append_tokens(len(ids))
        for t in (self.st.conv_pools[:, entry.slot], self.st.ssm_pools[:, entry.slot]):
            t.copy_(torch.randn(t.shape).to(t.dtype))
        self.ck.ready(entry, seq.pages)
        self.data[ids] = self.snap(entry)
        return entry

    def snap(self, entry):
        pages = self.ck.pages[entry.key].pages
        return [bits(self.st.conv_pools[:, entry.slot]), bits(self.st.ssm_pools[:, entry.slot]),
                bits(self.pg.k_pools[:, pages]), bits(self.pg.v_pools[:, pages])]

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
    r = Rig(tmp_path, host_ckpts=2)
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
    assert r.st.num_free == r.st.num_slots and r.pg.num_free == r.pg.num_pages


def _counts(r) -> dict[str, int]:
    """The index's lookup counters that are not zero."""
    return {k: v for k, v in r.ck.index.stats().items() if (k == "hits" or k.startswith("misses")) and v}


def test_a_lookup_served_from_a_lower_tier_counts_one_hit_and_no_miss(tmp_path):
    """Issue 30 leftover: a host-tier restore counted the device's miss (evicted) and then the hit. A lookup a lower
    tier serves is one hit of the index (of its tier in TierStats, at the admission's ``hit_tier``); the lookups
    that start or wait for a disk read count nothing, the one after it the hit; a failed restore one miss."""
    r = Rig(tmp_path, host_ckpts=1)
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
    r.tiers.host_bytes, r.tiers.disk = 0, None
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
    look = r.ck.lookup(IDS[0])                         # in the host tier, but no slot can be freed
    assert not look.hit and look.entry is None and not r.ck.restoring() and r.where(IDS[0]) == "host"


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
    e.close()                                          # every checkpoint written to disk
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
