"""The engine's memory, owned by the scheduler side: the GDN state pool, the KV page pool and the checkpoint
cache over them. The ModelRunner binds the same pools' tensors into the layers (views) and never allocates.

``pages_for`` is the one page-need formula: the pages a sequence takes that starts from a shared prefix of
``shared`` positions (its full pages shared, the partial tail page copied) and appends ``n`` tokens plus the
next decode's one. ``fits`` answers "does it fit" in the spirit of vLLM's ``allocate_slots``: automatic and
explicit READY checkpoints are a cache, evicted (LRU, unreferenced ones) whenever a request needs their slots
or pages, never a reason to refuse.
"""
from __future__ import annotations

from gdnserve.engine.checkpoint_index import Checkpoint, CheckpointIndex, CheckpointStatus
from gdnserve.engine.model_runner import SeqState
from gdnserve.engine.page_pool import PagePool, PageTable
from gdnserve.engine.state_pool import StatePool


class Checkpoints:
    """Checkpoint life cycle over the index: reserve (PENDING) -> ready (with its KV pages) -> acquire /
    release by consumers -> LRU eviction; automatic checkpoints adopt a finished sample's slot and pages."""

    def __init__(self, state: StatePool) -> None:
        self.index = CheckpointIndex(state)
        self.pages: dict[bytes, PageTable] = {}      # READY checkpoint key -> its KV pages

    def __len__(self) -> int:
        return len(self.pages)

    def lookup(self, token_ids, key: bytes | None = None):
        return self.index.lookup(token_ids, key)

    def longest_hit(self, ids: list[int]) -> Checkpoint | None:
        """The READY checkpoint of the longest proper prefix of ``ids``, or None."""
        for L in sorted({p.length for p in self.pages.values()}, reverse=True):
            if L < len(ids):
                look = self.index.lookup(ids[:L])
                if look.hit:
                    return look.entry
        return None

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

    def evict(self, n: int) -> bool:
        """Evict up to n unreferenced READY checkpoints (LRU), freeing their state slots and KV pages."""
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
    def __init__(self, state: StatePool, pages: PagePool) -> None:
        self.state, self.pages = state, pages
        self.checkpoints = Checkpoints(state)

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
            self.checkpoints.evict(slots - self.state.num_free)
        if pages > self.page_room(reserved):
            self.checkpoints.evict(len(self.checkpoints))

    def fits(self, slots: int, pages: int, reserved: int) -> bool:
        return slots <= self.state.num_free and pages <= self.page_room(reserved)
