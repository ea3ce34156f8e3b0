"""The engine's memory, owned by the scheduler side: the GDN state pool, the KV page pool and the checkpoint
cache over them. The ModelRunner binds the same pools' tensors into the layers (views) and never allocates.

``pages_for`` is the one page-need formula: the pages a sequence takes that starts from a shared prefix of
``shared`` positions (its full pages shared, the partial tail page copied) and appends ``n`` tokens plus the
next decode's one. ``fits`` answers "does it fit" in the spirit of vLLM's ``allocate_slots``: automatic and
explicit READY checkpoints are a cache, evicted (LRU, unreferenced ones) whenever a request needs their slots
or pages, never a reason to refuse.

With checkpoint tiers (checkpoint_tiers.py) an evicted READY checkpoint is copied down to host memory or disk
first, and a lookup that finds its key there starts a restore: the entry is PENDING (admission waits, as for a
producer) until ``poll`` marks it READY; its first hit reports the tier it came from.
"""
from __future__ import annotations

from collections.abc import Callable

from gdnserve.engine.cache.checkpoint_index import (
    Checkpoint,
    CheckpointIndex,
    CheckpointStatus,
    Lookup,
    MissReason,
    checkpoint_key,
)
from gdnserve.engine.cache.checkpoint_tiers import CheckpointTiers
from gdnserve.engine.cache.page_pool import PagePool, PageTable
from gdnserve.engine.cache.sequence import SeqState
from gdnserve.engine.cache.state_pool import StatePool

RESTORING = "restoring"     # search: the longest prefix is on its way up from a lower tier (wait for it)


class CheckpointCache:
    """Checkpoint life cycle over the index: reserve (PENDING) -> ready (with its KV pages) -> acquire /
    release by consumers -> LRU eviction (copied down to ``tiers`` when given); automatic checkpoints adopt a
    finished sample's slot and pages; restores from the tiers (PENDING until ``poll``)."""

    def __init__(self, state: StatePool, page_pool: PagePool | None = None,
                 tiers: CheckpointTiers | None = None) -> None:
        self.index = CheckpointIndex(state)
        self.state, self.page_pool, self.tiers = state, page_pool, tiers
        self.pages: dict[bytes, PageTable] = {}      # READY checkpoint key -> its KV pages
        # during an admission pass: the KV pages it has promised (running requests + admissions so far, allocated
        # only when the step runs); a restore leaves them free (the scheduler sets and clears it)
        self.promised: Callable[[], int] | None = None

    def __len__(self) -> int:
        return len(self.pages)

    def lookup(self, token_ids, key: bytes | None = None, count: bool = True) -> Lookup:
        """The index's lookup; a miss whose key a lower tier holds starts its restore: a hit at once from the host
        tier, PENDING while a disk read is in flight. Counted once in the index's stats: a lookup a lower tier
        serves is one hit (not a miss of the device and then a hit), counted when it answers READY; one that starts
        or waits for a disk read counts nothing (the lookup after the read counts the hit, or the miss when the
        restore failed). ``count=False``: nothing counted (``search``'s caller counts its one answer)."""
        if self.tiers is None:
            return self.index.lookup(token_ids, key, count=count)
        ids = tuple(token_ids)
        key = checkpoint_key(ids) if key is None else key
        look = self.index.lookup(ids, key, count=False)
        if look.reason in (MissReason.ABSENT, MissReason.EVICTED):
            found = self.tiers.find(key, ids)
            entry = None if found is None else self._restore(ids, key, *found)
            if entry is not None and entry.status is not CheckpointStatus.READY:
                return Lookup(entry, MissReason.PENDING, 0)
            if entry is not None:
                look = self.index.lookup(ids, key, count=False)
        elif self.is_restoring(look.entry):
            return look
        if count:
            self.index.count(look)
        return look

    def search(self, ids: list[int]) -> tuple[Checkpoint | str | None, Lookup | None]:
        """The READY checkpoint of the longest proper prefix of ``ids`` (RESTORING when that prefix is being
        restored from a lower tier: the restore starts here; None), and the ONE lookup to count for it: its hit, or
        the miss of the shortest length tried (None: no length tried). Counts nothing: admission counts it when the
        request is admitted (a waiting request is planned again every step; a search over N lengths counted N
        misses before)."""
        lengths = {p.length for p in self.pages.values()}
        if self.tiers is not None:
            lengths |= self.tiers.lengths() | {r.entry.length for r in self.tiers.restoring.values()}
        look = None
        for L in sorted(lengths, reverse=True):
            if L < len(ids):
                look = self.lookup(ids[:L], count=False)
                if self.is_restoring(look.entry):
                    return RESTORING, look
                if look.hit:
                    break
        return (look.entry if look is not None and look.hit else None), look

    def keys(self) -> tuple[list[bytes], list[bytes], list[int]]:
        """(READY keys, PENDING keys, distinct READY lengths), what a replica reports to its router: the index's, and
        the keys the host and disk tiers hold as READY too (a lookup there restores them: a hit, from the host tier
        in the same step), with their lengths. Safe from another thread (index.keys, tiers.keys); a key on the
        device and on disk is listed once."""
        ready, pending, lengths = self.index.keys()
        if self.tiers is None:
            return ready, pending, lengths
        low, low_lengths = self.tiers.keys()
        seen = set(ready)
        seen.update(pending)
        for k in low:
            if k not in seen:
                seen.add(k)
                ready.append(k)
        return ready, pending, sorted(low_lengths.union(lengths))

    # ---- tiers ----
    def is_restoring(self, entry: Checkpoint | None) -> bool:
        return entry is not None and self.tiers is not None and self.tiers.restoring.get(entry.key) is not None \
            and self.tiers.restoring[entry.key].entry is entry

    def _restore(self, ids: tuple[int, ...], key: bytes, tier: str, num_pages: int) -> Checkpoint | None:
        """A PENDING entry on a fresh slot and pages (evicting, i.e. copying down, LRU READY checkpoints for them)
        with the restore from ``tier`` started; None, changing nothing, when no room can be made."""
        hc = self.tiers.claim(key, tier)      # out of the host tier first: the evictions below spill into it
        # a failure from here on (a spill, the copy up) puts the claimed copy back and drops what was reserved:
        # the host tier neither loses the checkpoint nor its arena block, no PENDING entry is left behind
        table = entry = None
        try:
            need = num_pages + (self.promised() if self.promised is not None else 0)
            if self.state.num_free < 1:
                self.evict(1)
            while self.page_pool.num_free < need and self.evict(1):
                pass
            pages = self.page_pool.try_allocate(num_pages) if self.state.num_free and \
                self.page_pool.num_free >= need else None
            if pages is None:
                self.tiers.unclaim(hc)
                return None
            table = PageTable(self.page_pool, pages, len(ids))
            entry = self.index.reserve(ids, key)
            started = self.tiers.start(entry, table, tier, hc)
        except BaseException:
            if entry is not None:
                self.index.abort(entry)
            if table is not None:
                table.release()
            self.tiers.unclaim(hc)
            raise
        if started:                           # a host restore: queued in stream order, READY now
            entry.origin = tier
            self.ready(entry, table)
        return entry

    def poll(self, wait: bool = False) -> bool:
        """Disk restores whose file is read become READY (a failed one, e.g. a corrupt file, is dropped: its
        waiters miss); copies up whose event is done release their host memory. ``wait``: first wait for all of
        them. Whether any restore finished."""
        if self.tiers is None or not (self.tiers.restoring or self.tiers.landing):
            return False
        done = self.tiers.poll(wait)
        for r, ok in done:
            if ok:
                r.entry.origin = r.tier
                self.ready(r.entry, r.table)
            else:
                self.abort(r.entry, r.table)
        return bool(done)

    def restoring(self) -> bool:
        return self.tiers is not None and bool(self.tiers.restoring)

    def hit_tier(self, entry: Checkpoint, continued: bool = False) -> str:
        """The tier a hit on ``entry`` came from (its first hit after a restore names the lower tier), counted.
        ``continued``: an automatic hit (a chat's next turn), whose request publishes a longer checkpoint that
        supersedes this one for the turn after: when evicted, it goes to the cold end of the host tier."""
        tier, entry.origin = entry.origin, "gpu"
        entry.continued = entry.continued or continued
        if self.tiers is not None:
            self.tiers.stats.hit(tier)
        return tier

    def close(self) -> None:
        """Graceful shutdown: every checkpoint in device or host memory written to disk (when a disk tier is on),
        then the host tier's arena unpinned."""
        if self.tiers is None:
            return
        if self.tiers.disk is not None:
            ready = [(e.key, e.token_ids, e.slot, self.pages[e.key]) for e in self.index.ready_entries()]
            self.tiers.flush(ready)
        self.tiers.close()

    def reserve(self, key: tuple[int, ...], page_pool: PagePool, hkey: bytes | None = None
                ) -> tuple[Checkpoint, SeqState]:
        """A PENDING entry and the sequence over its slot that will carry the prefix's KV pages (``hkey``: the
        prefix's ``checkpoint_key`` when the caller has it)."""
        entry = self.index.reserve(key, hkey)
        return entry, SeqState(entry.slot, PageTable(page_pool))

    def ready(self, entry: Checkpoint, pages: PageTable) -> None:
        self.index.mark_ready(entry)
        self.pages[entry.key] = pages

    def abort(self, entry: Checkpoint, pages: PageTable) -> None:
        """Drop a PENDING entry (its producer failed or went away) with its KV pages."""
        self.index.abort(entry)
        pages.release()

    def adopt(self, tokens: list[int], seq: SeqState, key: bytes | None = None) -> Checkpoint | None:
        entry = self.index.adopt(tokens, seq.slot, key)
        if entry is not None:
            self.pages[entry.key] = seq.pages
        return entry

    def acquire(self, entry: Checkpoint) -> None:
        self.index.acquire(entry)

    def release(self, entry: Checkpoint) -> None:
        self.index.release(entry)

    def kv_of(self, entry: Checkpoint) -> tuple[int, PageTable]:
        return entry.slot, self.pages[entry.key]

    def spill_ahead(self, slots: int, pages: int = 0) -> int:
        """The free-slot watermark (a host tier only): while fewer than ``slots`` state slots (or ``pages`` KV
        pages) would be free after evicting the LRU victims already copied down, copy the next victims to host
        memory now (issued, not waited for), so the eviction that takes their slot later costs no copy. Their
        device copies stay READY (a hit still hits on the device): copy down early, free lazily. At most
        ``max(slots, 1)`` copies ahead in flight (they queue on the copier's stream down, before any eviction's
        spill). Ahead copies of checkpoints that left the device without a spill are dropped first. Returns the
        copies issued."""
        t = self.tiers
        if t is None or t.arena is None:
            return 0
        for key in [k for k in t.ahead if k not in self.pages]:
            t.drop_ahead(key)
        free_s, free_p = self.state.num_free, self.page_pool.num_free
        budget = max(slots, 1) - t.ahead_in_flight()
        made = 0
        for e in list(self._victims_until(slots - free_s, pages - free_p)):
            if e.key in t.ahead:
                continue
            if made >= budget or not t.spill_ahead(e.key, e.token_ids, e.slot, self.pages[e.key]):
                break           # enough in flight, or no room in the host tier: the next pass
            made += 1
        return made

    def _victims_until(self, slots: int, pages: int):
        """The LRU victims whose eviction would free ``slots`` slots and ``pages`` pages (a table's pages, shared
        ones included: an estimate)."""
        for e in self.index.victims():
            if slots <= 0 and pages <= 0:
                return
            yield e
            slots -= 1
            pages -= len(self.pages[e.key].pages)

    def evict(self, n: int) -> bool:
        """Evict up to n unreferenced READY checkpoints (LRU), freeing their state slots and KV pages."""
        if self.tiers is not None:          # copied down before the slots and pages are freed (checkpoint_copy.py)
            for e in self.index.lru_victims(n):
                self.tiers.spill(e.key, e.token_ids, e.slot, self.pages[e.key], cold=e.continued)
        gone = self.index.evict_lru(n)
        for entry in gone:
            self.pages.pop(entry.key).release()
        return bool(gone)

    def is_ready_slot(self, slot: int) -> bool:
        return not self.index.is_writable(slot)

    @staticmethod
    def is_pending(entry: Checkpoint) -> bool:
        return entry.status is CheckpointStatus.PENDING


class KVCache:
    def __init__(self, state: StatePool, pages: PagePool, tiers: CheckpointTiers | None = None) -> None:
        self.state, self.pages = state, pages
        self.checkpoint_cache = CheckpointCache(state, pages, tiers)

    @property
    def page_size(self) -> int:
        return self.pages.page_size

    def pages_for(self, n: int, shared: int = 0) -> int:
        ps = self.pages.page_size
        return -(-(shared + n + 1) // ps) - shared // ps

    def new_seq(self) -> SeqState:
        return SeqState.open(self.state, self.pages)

    def free_seq(self, seq: SeqState) -> None:
        seq.close(self.state)

    def page_room(self, reserved: int) -> int:
        """KV pages left after ``reserved`` (what running requests and this pass's admissions were promised)."""
        return self.pages.num_free - reserved

    def make_room(self, slots: int, pages: int, reserved: int) -> None:
        """Evict unreferenced READY checkpoints (LRU) until ``slots`` slots are free and ``pages`` pages are
        left after ``reserved``, as far as eviction can."""
        if slots > self.state.num_free:
            self.checkpoint_cache.evict(slots - self.state.num_free)
        if pages > self.page_room(reserved):
            self.checkpoint_cache.evict(len(self.checkpoint_cache))

    def fits(self, slots: int, pages: int, reserved: int) -> bool:
        return slots <= self.state.num_free and pages <= self.page_room(reserved)
