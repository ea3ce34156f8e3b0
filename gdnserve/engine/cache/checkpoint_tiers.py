"""Checkpoint tiers below the GPU: host memory (``checkpoint_host_memory_gb``, one arena pinned at start-up:
host_arena.py) and a directory on disk (``checkpoint_dir``, checkpoint_disk.py). A READY checkpoint evicted from
the device's LRU is copied down (to the host tier, else to disk) instead of dropped; a host-tier eviction goes to
disk. A lookup that finds the key in a lower tier restores it into a fresh slot and pages and the request continues
as a hit whose provenance names the tier: from the host tier at once (the copy up is queued before any kernel that
reads it: the current stream waits for its event; ``landing`` keeps the source block until the event), from disk
once the file is read (the entry is PENDING until then: admission waits for it, as for a producer's; ``poll``). LRU
within each tier (a checkpoint a chat's next turn continued enters the host tier at its cold end: ``spill``). The
host tier is exclusive (a restored checkpoint leaves it: it goes back down when evicted again); a disk file stays
after a restore (checkpoints never change, so a second eviction writes nothing). Copies and their ordering:
checkpoint_copy.py.

Spill ahead ("copy down early, free lazily"; ``CheckpointCache.spill_ahead``, the scheduler's free-slot watermark
``checkpoint_spill_ahead``): the device's next LRU victims are copied to host memory before their slots are needed
(issued, not waited for; ``ahead``: key -> its host copy, the checkpoint still READY on the device, where a hit
still finds it). The eviction that later takes the slot moves that copy into the host tier and frees the slot at
once (no copy, no wait but for the copy's gathers, long done). A checkpoint is copied down once: a key in ``ahead``
or in the host tier is not copied again. An ahead copy takes its arena block like a spill (evicting the host
tier's LRU, older than anything on the device, never another ahead copy); an eviction's spill that finds no room
once the host tier is empty discards ahead copies (oldest first: the device still holds them) before it drops.

Host memory: a spill takes a block of the arena (or, where no one hole holds it, up to ``MAX_EXTENTS`` extents:
host_arena.py ``alloc_extents``; "block" below means its blocks), evicting the host tier's LRU until it fits (no
allocation in the step loop). A block goes back to the arena (``HostCheckpoint.release``) only when nothing reads
it any more; GPU copies are ordered by the copier's streams (checkpoint_copy.py), CPU threads are not:

- evicted with no disk tier: at once (a later copy down into the block is queued after the one that filled it,
  on the same stream);
- evicted to disk: by the disk writer once it has read the tensors, also when the write fails. Such a block comes
  back later, not for the spill that evicted it: with a disk tier a spill evicts only until the blocks on their way
  back cover its size (evicting more would push the whole host tier into the write queue for one spill);
- claimed by a restore: once its copy up is queued (``_land``: the next copy down into the block waits for it,
  checkpoint_copy.py ``_reads``; the host tensors stay readable views of the arena); ``unclaim`` keeps it;
- an ahead copy whose device checkpoint left the device another way, or discarded for room: at once (as above);
- no room even so (blocks still with the writer, or a checkpoint larger than the arena): with a disk tier the
  checkpoint is copied into a plain (pinned) allocation and goes straight to disk; without one it is dropped
  (``TierStats.dropped``).
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter, OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, fields

import torch

from gdnserve.engine.cache.checkpoint_copy import Copier, HostCheckpoint
from gdnserve.engine.cache.checkpoint_disk import DiskTier
from gdnserve.engine.cache.host_arena import ALIGN, HostArena
from gdnserve.engine.cache.host_memory import meminfo_available
from gdnserve.engine.cache.page_pool import PagePool, PageTable
from gdnserve.engine.cache.tier_stats import TierStats

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class Restore:
    """A checkpoint on its way up: the PENDING entry, the table of its fresh pages, the source tier, and either the
    disk read (``future``) or the host -> device copy's ``event`` (None on CPU: done)."""
    entry: object
    table: PageTable
    tier: str
    t0: float
    hc: HostCheckpoint | None = None
    future: Future | None = None
    event: object | None = None


class CheckpointTiers:
    """The host and disk tiers of one engine's checkpoints and the restores in flight. The host tier's memory is
    the copier's arena (None: no host tier)."""

    def __init__(self, copier: Copier, disk: DiskTier | None, stats: TierStats) -> None:
        self.copier, self.disk, self.stats = copier, disk, stats
        self.host: OrderedDict[bytes, HostCheckpoint] = OrderedDict()     # least recently used first
        self._host_lengths: Counter[int] = Counter()
        self.restoring: dict[bytes, Restore] = {}     # disk reads in flight (PENDING entries)
        self.landing: list[Restore] = []               # copies up queued on the device, their sources kept
        self.ahead: dict[bytes, HostCheckpoint] = {}   # spilled ahead: host copies of READY device checkpoints
        self._flying: list[HostCheckpoint] = []        # ahead copies whose transfers down may still be running

    @property
    def arena(self) -> HostArena | None:
        return self.copier.arena

    @property
    def host_bytes(self) -> int:
        """The host tier's size: its arena's capacity."""
        return self.arena.capacity if self.arena is not None else 0

    @property
    def host_used(self) -> int:
        """Arena bytes held: the host tier's checkpoints, the ahead copies, those claimed by restores whose copy up
        is not queued yet and those the disk writer has not read yet."""
        return self.arena.used if self.arena is not None else 0

    # ---- down: an evicted READY checkpoint ----
    def spill(self, key: bytes, token_ids: tuple[int, ...], slot: int, table: PageTable, cold: bool = False) -> None:
        """Copy a READY checkpoint that the device evicts (call before its slot and pages are freed). ``cold``: a
        checkpoint a chat's next turn continued (its longer successor serves the turn after) enters the host tier
        at its least-recently-used end: under pressure it goes first, before any checkpoint not yet continued
        (with plain LRU the host tier of a multi-turn chat needs room for two checkpoints per conversation). A
        checkpoint spilled ahead is not copied again: its copy enters the host tier, the slot freed at once."""
        hc = self.ahead.pop(key, None)
        if hc is not None:
            if hc.token_ids != tuple(token_ids):      # (a key collision: that copy is not this checkpoint's)
                hc.release()
            else:
                self.copier.freeing(hc)     # the slot and pages are written only after its gathers (long done)
                self._host_put(hc, cold)
                return
        on_disk = self.disk is not None and key in self.disk
        if (self.arena is None and (self.disk is None or on_disk)) or key in self.host:
            return
        pages = self._covering(table, len(token_ids))
        hc = self._room(key, token_ids, len(pages)) if self.arena is not None else None
        if hc is not None:
            try:
                self.copier.copy_down(hc, slot, pages)
            except BaseException:
                hc.release()        # a later copy into the block is queued after whatever part of this one was
                raise
            self._copied(hc)
            self.stats.evictions_waited += 1
            self._host_put(hc, cold)
            return
        if on_disk:                     # no room above the disk, which has it
            return
        if self.disk is None:           # no room in the host tier and nothing below it
            self.stats.dropped += 1
            return
        try:
            hc = self.copier.snapshot(key, token_ids, slot, pages)    # a plain allocation, straight to disk
        except RuntimeError as e:       # host memory exhausted (pinned allocation): the checkpoint is dropped
            logger.warning("checkpoint %s not copied down: %s", key.hex()[:12], e)
            self.stats.dropped += 1
            return
        self._copied(hc)
        self.stats.evictions_waited += 1
        self.disk.put(hc)

    def spill_ahead(self, key: bytes, token_ids: tuple[int, ...], slot: int, table: PageTable) -> bool:
        """Copy a READY device checkpoint to the host tier's memory ahead of its eviction (issued, not waited for:
        the slot stays READY and is never written meanwhile). False when it needs none (already copied, in the
        host tier, no host tier) or the arena has no room even after evicting the host tier's LRU."""
        if self.arena is None or key in self.ahead or key in self.host:
            return False
        pages = self._covering(table, len(token_ids))
        hc = self._room(key, token_ids, len(pages), ahead=True)
        if hc is None:
            return False
        try:
            self.copier.copy_down(hc, slot, pages, free=False)
        except BaseException:
            hc.release()
            raise
        self._copied(hc)
        self.stats.spills_ahead += 1
        self.ahead[key] = hc
        self._flying.append(hc)
        return True

    def ahead_in_flight(self) -> int:
        """Ahead copies whose transfers down are still running (non-blocking queries of those not yet seen done)."""
        self._flying = [hc for hc in self._flying if not hc.copied()]
        return len(self._flying)

    def drop_ahead(self, key: bytes) -> None:
        """Forget the ahead copy of ``key`` (its device checkpoint left the device without a spill)."""
        hc = self.ahead.pop(key, None)
        if hc is not None:
            hc.release()    # a later copy down into the block is queued after this one on the same stream

    def _covering(self, table: PageTable, n: int) -> list[int]:
        """The pages that hold a checkpoint's ``n`` tokens: what it is copied down with. A table published after
        speculative decoding keeps, past its length, pages a verify step appended for drafts that were rejected; a
        restore of ``n`` tokens allocates only the pages they need (the host restore of such a copy raised in
        PageTable, a disk one failed)."""
        return list(table.pages[:-(-n // self.copier.kv.page_size)])

    def _copied(self, hc: HostCheckpoint) -> None:
        self.stats.spills += 1
        self.stats.add_bytes("d2h", hc.nbytes)

    def _room(self, key: bytes, token_ids: tuple[int, ...], num_pages: int, ahead: bool = False
              ) -> HostCheckpoint | None:
        """Host tensors in an arena block, evicting the host tier's LRU until one fits, then (an eviction's spill)
        discarding ahead copies, oldest first; None when none fits now. ``ahead`` (a spill ahead): the host tier's
        LRU is evicted only while the arena lacks the bytes, never for a hole that fits: evicting for fragmentation
        early pushed out checkpoints the later eviction would have kept (``benchmarks/bench_checkpoint_tiers.py
        --device cpu``: later turns' hit rate 100 % -> 68 %; evicting only cold, continued, checkpoints for it:
        78 %). Free bytes are room since a checkpoint may take several holes (``alloc_extents``): only a request
        past ``MAX_EXTENTS`` holes finds bytes and no room."""
        need = self.copier.bytes_of(num_pages)
        if need > self.arena.capacity:
            return None
        coming = 0          # bytes of the victims sent to disk here: back once the writer has read them, not now
        hc = self.copier.empty(key, token_ids, num_pages)
        while hc is None and self.host and coming < need and not (ahead and self._free_bytes() >= need):
            _, old = self.host.popitem(last=False)
            self._host_forget(old)
            if self.disk is None:
                old.release()
            else:
                self.disk.put(old)
                coming += old.footprint if old.blocks else 0
            hc = self.copier.empty(key, token_ids, num_pages)
        while hc is None and not ahead and self.ahead and coming < need:
            self.drop_ahead(next(iter(self.ahead)))
            hc = self.copier.empty(key, token_ids, num_pages)
        return hc

    def _free_bytes(self) -> int:
        return self.arena.capacity - self.arena.used

    def _host_put(self, hc: HostCheckpoint, cold: bool = False) -> None:
        """Into the host tier (its block already held)."""
        self.host[hc.key] = hc
        if cold:
            self.host.move_to_end(hc.key, last=False)
        self._host_lengths[hc.length] += 1

    def _host_forget(self, hc: HostCheckpoint) -> None:
        self._host_lengths[hc.length] -= 1
        if not self._host_lengths[hc.length]:
            del self._host_lengths[hc.length]

    # ---- up: a lookup ----
    def lengths(self) -> set[int]:
        """Token lengths held below the device (for the longest-prefix search)."""
        out = set(self._host_lengths)
        if self.disk is not None:
            out |= self.disk.lengths()
        return out

    def keys(self) -> tuple[list[bytes], set[int]]:
        """The keys held below the device (host tier, then disk; a key may also be on the device: a disk file stays
        after its restore) and their token lengths: what a replica reports to its router besides the index's. Read
        from another thread than the engine's: the host tier's dict and lengths taken in C-level passes (retried if
        the engine changed them meanwhile), the disk's under its lock. Only keys and lengths are copied."""
        while True:
            try:
                keys, lengths = list(self.host), set(self._host_lengths)
                break
            except RuntimeError:  # "mutated during iteration": take them again
                continue
        if self.disk is not None:
            dkeys, dlengths = self.disk.keys()
            keys += dkeys
            lengths |= dlengths
        return keys, lengths

    def find(self, key: bytes, token_ids: tuple[int, ...]) -> tuple[str, int] | None:
        """(tier, pages needed) when a lower tier holds exactly ``token_ids`` under ``key``."""
        hc = self.host.get(key)
        if hc is not None and hc.token_ids == token_ids:
            return "host", hc.num_pages
        if self.disk is not None and self.disk.token_ids(key) == token_ids:
            return "disk", -(-len(token_ids) // self.copier.kv.page_size)
        return None

    def claim(self, key: bytes, tier: str) -> HostCheckpoint | None:
        """Take a host-tier checkpoint out of the tier before a restore (None for a disk one)."""
        if tier != "host":
            return None
        hc = self.host.pop(key)
        self._host_forget(hc)
        return hc

    def unclaim(self, hc: HostCheckpoint | None) -> None:
        """Put back what ``claim`` took (no room for the restore), with its block."""
        if hc is not None:
            self._host_put(hc)

    def start(self, entry, table: PageTable, tier: str, hc: HostCheckpoint | None) -> bool:
        """Restore ``entry.key`` from ``tier`` (``hc``: the claimed host copy) into the PENDING ``entry``'s slot and
        ``table``'s pages. True: the copy is queued in stream order (a host restore), the entry may be READY now;
        False: a disk read is in flight (``poll``)."""
        r = Restore(entry, table, tier, time.perf_counter(), hc=hc)
        if tier == "host" and self._copy_up(r):
            self._land(r)
            return True
        if tier != "host":
            r.future = self.disk.load(entry.key)
        self.restoring[entry.key] = r         # a host copy of the wrong shape fails at the next poll
        return False

    def _land(self, r: Restore) -> None:
        """The copy up is queued: its block goes back to the arena now (the next copy down into it waits for this
        copy's reads: ``Copier._reads``; tests/engine/test_checkpoint_tiers_gpu.py checks it on the device), the
        restore's latency is counted when its event completes."""
        r.hc.release()
        if r.event is None:
            self._landed(r)
        else:
            self.landing.append(r)

    def _retire(self, wait: bool) -> None:
        keep = []
        for r in self.landing:
            if wait:
                r.event.synchronize()
            elif not r.event.query():
                keep.append(r)
                continue
            self._landed(r)
        self.landing = keep

    def _landed(self, r: Restore) -> None:
        """The copy up is done: its latency counted (its block went back when it was queued, ``_land``)."""
        self.stats.restored(r.tier, time.perf_counter() - r.t0)
        r.hc.release()      # (idempotent: a no-op after _land's)
        r.hc = None

    def _copy_up(self, r: Restore) -> bool:
        if r.hc.num_pages != len(r.table.pages) or r.hc.length != len(r.entry.token_ids) \
                or not self.copier.fits(r.hc):
            return False
        r.event = self.copier.restore(r.hc, r.entry.slot, list(r.table.pages))
        self.stats.add_bytes("h2d", r.hc.nbytes)
        return True

    def poll(self, wait: bool = False) -> list[tuple[Restore, bool]]:
        """The disk restores whose file was read since the last call, each with whether it succeeded (a corrupt or
        vanished file fails it; a success has its copy up queued in stream order: READY now). ``wait``: block until
        every read in flight is done (nothing else can run), and every copy up with it."""
        done = []
        for key, r in list(self.restoring.items()):
            if r.future is not None:
                if not (wait or r.future.done()):
                    continue
                r.hc, r.future = r.future.result(), None
            del self.restoring[key]
            if r.hc is None or not self._copy_up(r):
                self.stats.restore_failures += 1
                if r.hc is not None:
                    r.hc.release()      # nothing was copied out of it
                done.append((r, False))
                continue
            self._land(r)
            done.append((r, True))
        self._retire(wait)
        return done

    # ---- shutdown ----
    def flush(self, resident) -> None:
        """Write every checkpoint above the disk to it and wait (graceful shutdown: ``resident`` yields the device's
        READY (key, token ids, slot, table)). The host tier is emptied into the disk tier."""
        if self.disk is None:
            return
        for i, (key, token_ids, slot, table) in enumerate(resident):
            ahead = self.ahead.pop(key, None)
            if key in self.disk:
                if ahead is not None:
                    ahead.release()
            elif ahead is not None and ahead.token_ids == tuple(token_ids):
                self.disk.put(ahead)            # copied down already: the writer waits for it, then releases it
            else:
                if ahead is not None:
                    ahead.release()
                hc = self.copier.snapshot(key, token_ids, slot, self._covering(table, len(token_ids)))
                self.stats.add_bytes("d2h", hc.nbytes)
                self.disk.put(hc)
            if i % 8 == 7:          # a few host copies at a time: the device may hold hundreds of checkpoints
                self.disk.flush()
        i = 0
        while self.host:            # the writer releases their blocks; a few at a time (its queue is bounded)
            _, hc = self.host.popitem(last=False)
            self._host_forget(hc)
            self.disk.put(hc)
            i += 1
            if i % 8 == 0:
                self.disk.flush()
        self.disk.flush()

    def close(self) -> None:
        """Engine shutdown (after ``flush``): wait for the copies in flight, give every block back and unpin the
        arena; the host tier is off after (idempotent)."""
        arena = self.arena
        if arena is None:
            return
        self._retire(wait=True)
        self.copier.synchronize()                 # no copy into or out of the arena still queued
        if self.disk is not None:
            self.disk.flush()                     # the writer has read (and released) what it was given
        while self.host:
            _, hc = self.host.popitem(last=False)
            self._host_forget(hc)
            hc.release()
        while self.ahead:
            self.ahead.popitem()[1].release()
        self._flying.clear()
        self.copier.arena = None
        arena.close()

    def capacity(self) -> list[str]:
        """Banner lines: each lower tier's size and how many checkpoints of a 2,048-token prefix it holds."""
        per = self.copier.bytes_of(-(-2048 // self.copier.kv.page_size))
        out = []
        if self.host_bytes:
            out.append(f"host {self.host_bytes / 2**30:.1f} GiB ~ {self.host_bytes // per} checkpoints")
        if self.disk is not None:
            out.append(f"disk {self.disk.dir} {self.disk.max_bytes / 2**30:.1f} GiB ~ "
                       f"{self.disk.max_bytes // per} checkpoints ({len(self.disk)} found)")
        return out


def model_fingerprint(model, dtype: torch.dtype, tp_size: int, state_cfg, page_cfg,
                      rows: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None) -> str:
    """Hex blake2b of what a checkpoint is only valid for: the model config, the dtype, the tensor-parallel layout,
    the pools' row shapes and dtypes (page size, state dtype; not their sizes), the per-slot rows registered with the
    state pool (``rows``: name -> host shape and dtype, e.g. the MTP hidden; none: the fingerprint of an engine
    without them is what it was before they existed), every parameter's name, shape and dtype, and the bytes of
    the first and last 64 elements of every parameter (a sample: hashing 70 GB of weights at start-up would take
    minutes; two models that differ only elsewhere in their weights would share checkpoints)."""
    h = hashlib.blake2b(digest_size=32)
    cfg = getattr(model, "cfg", None)
    def shapes(c) -> dict:
        return {f.name: str(getattr(c, f.name)) for f in fields(c)
                if f.name not in ("device", "num_slots", "num_pages")}    # the pools' sizes may change
    facts = {"version": 1, "config": repr(cfg), "dtype": str(dtype), "tp": tp_size, "state": shapes(state_cfg),
             "pages": shapes(page_cfg)}
    if rows:
        facts["rows"] = {n: [list(shape), str(dt)] for n, (shape, dt) in rows.items()}
    h.update(json.dumps(facts, sort_keys=True).encode())
    samples = []
    for name, p in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
        flat = p.detach().reshape(-1)
        if flat.numel():
            samples.append(torch.cat([flat[:64], flat[-64:]]).contiguous().view(torch.uint8))
    if samples:
        h.update(torch.cat(samples).cpu().numpy().tobytes())
    return h.hexdigest()


def build_tiers(cfg, model, state, pages: PagePool) -> CheckpointTiers | None:
    """The tiers an EngineConfig asks for (None when both are off). Built after the runner: a checkpoint holds the
    per-slot rows it registers with ``state`` (the MTP hidden), and the disk files' fingerprint names them."""
    host = int(cfg.checkpoint_host_memory_gb * 2**30)
    if not host and cfg.checkpoint_dir is None:
        return None
    ram = meminfo_available()
    if host > 0.9 * ram:        # refused at start-up, not an allocation failure in the middle of a step
        raise ValueError(f"checkpoint_host_memory_gb: {cfg.checkpoint_host_memory_gb:g} GiB is more than 0.9 x the "
                         f"{ram / 2**30:.1f} GiB of RAM available")
    if 0 < host < ALIGN:
        raise ValueError(f"checkpoint_host_memory_gb: {cfg.checkpoint_host_memory_gb:g} GiB is less than one "
                         f"{ALIGN}-byte block")
    stats = TierStats()
    arena = None
    if host:        # allocated (and pinned) once, here at start-up: a spill in the step loop only takes a block
        arena = HostArena(host, pinned=state.config.device.type == "cuda")
        logger.info("checkpoint host tier: %.2f GiB arena (%s) in %.2f s", arena.capacity / 2**30, arena.how,
                    arena.seconds)
    copier = Copier(state, pages, arena=arena)
    disk = None
    if cfg.checkpoint_dir is not None:
        layout = copier.layout(1)
        rows = {n: layout[n] for n in state.slot_rows}      # registered by the runner, which is built first
        fp = model_fingerprint(model, pages.config.dtype, cfg.tensor_parallel_size, state.config, pages.config, rows)
        disk = DiskTier(cfg.checkpoint_dir, int(cfg.checkpoint_dir_max_gb * 2**30), fp, pin=copier.cuda,
                        on_bytes=stats.add_bytes, names=copier.names)
    return CheckpointTiers(copier, disk, stats)
