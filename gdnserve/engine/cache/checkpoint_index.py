"""Checkpoints of recurrent state at exact token boundaries, addressed by a hash of the token ids.

A checkpoint is one CHECKPOINT slot of the :class:`StatePool` holding "the state after exactly these
tokens". It is reserved PENDING before the producing step runs (the kernels write it then), becomes
READY only after that step has finished, and from then on is read in place by consumers and never
written again (architecture.md, the state ownership contract; ``is_writable`` is what the step-plan
builder asserts against). Every lookup says why it missed, so a response can report it.
"""
from __future__ import annotations

import enum
import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from gdnserve.engine.cache.state_pool import PoolFullError, SlotKind, StatePool, StatePoolError

INT32 = "i" if array("i").itemsize == 4 else "l"     # the array typecode of native int32


def checkpoint_key(token_ids: Sequence[int]) -> bytes:
    """128-bit blake2b of the length and the int32 token ids. Only an address: a hit is confirmed
    against the stored ids, so a collision costs a miss, never a wrong state."""
    return key_of_i32(len(token_ids), array(INT32, token_ids).tobytes())


def key_of_i32(n: int, i32: bytes) -> bytes:
    """``checkpoint_key`` of ``n`` tokens given as their native int32 bytes (``i32``, 4 n bytes): what a request
    keeps of its prompt from intake, so a key of a prompt prefix costs no per-token conversion."""
    h = hashlib.blake2b(n.to_bytes(8, "little"), digest_size=16)
    h.update(i32)
    return h.digest()


def boundary_prefix(prompt_ids: Sequence[int], checkpoint_at: int | None) -> tuple[int, ...] | None:
    """The tokens a request's checkpoint covers: its prompt up to the marker / ``checkpoint_at``; None
    without one. The engine's admission looks this prefix up; the replica router keys on it."""
    return tuple(prompt_ids[:checkpoint_at]) if checkpoint_at else None


def score_prefix(prefix_ids: Sequence[int]) -> tuple[int, ...]:
    """The checkpoint of a score job: its prefix minus the last token (each candidate is fed
    ``[last prefix token] + candidate``); empty for a one-token prefix (the zero state, no checkpoint)."""
    return tuple(prefix_ids[:-1])


def conversation_prefix(prompt_ids: Sequence[int], output_ids: Sequence[int]) -> list[int]:
    """The tokens of a finished single-sample request's automatic checkpoint: prompt + output minus the last,
    unfed token (the next turn of the conversation starts from it)."""
    return list(prompt_ids) + list(output_ids[:-1])


def conversation_key(req, output_ids: Sequence[int]) -> bytes | None:
    """``checkpoint_key(conversation_prefix(req.prompt_ids, output_ids))`` from the request's intake bytes of its
    prompt (``req.prompt_i32``; None without them)."""
    if req.prompt_i32 is None:
        return None
    n = len(req.prompt_ids) + max(0, len(output_ids) - 1)
    return key_of_i32(n, req.prompt_i32 + array(INT32, output_ids[:-1]).tobytes())


class CheckpointStatus(enum.Enum):
    PENDING = "pending"  # slot reserved, producer not finished: kernels of the producing step write it
    READY = "ready"      # published: read in place by consumers, never a kernel destination
    DROPPED = "dropped"  # evicted or aborted; slot is -1 and the object is no longer in the index


class MissReason(enum.Enum):
    ABSENT = "absent"        # never stored (or aborted)
    PENDING = "pending"      # stored, producer still running
    EVICTED = "evicted"      # stored once and evicted (remembered in a bounded set)
    COLLISION = "collision"  # another token sequence holds this hash


class CheckpointError(RuntimeError):
    """Misuse of a checkpoint: wrong status transition, unknown entry, refcount below zero."""


@dataclass(slots=True, eq=False, repr=False)
class Checkpoint:
    key: bytes
    token_ids: tuple[int, ...]
    length: int
    slot: int
    status: CheckpointStatus = CheckpointStatus.PENDING
    refcount: int = 0
    last_use: int = 0  # the index's use counter, not wall time
    origin: str = "gpu"  # the tier it was restored from ("host", "disk") until its first hit reports it
    continued: bool = False  # an automatic hit continued it (its request's own checkpoint will extend it)

    def __repr__(self) -> str:
        return (f"Checkpoint(slot={self.slot}, length={self.length}, status={self.status.name}, "
                f"refcount={self.refcount}, key={self.key.hex()[:12]})")


@dataclass(frozen=True, slots=True)
class Lookup:
    entry: Checkpoint | None   # the READY entry on a hit; the PENDING entry when reason is PENDING
    reason: MissReason | None  # None on a hit
    hit_length: int            # tokens covered by the checkpoint; 0 on a miss

    @property
    def hit(self) -> bool:
        return self.reason is None


class CheckpointIndex:
    """Key -> checkpoint entry, kept in least-recently-used-first order. Owns its CHECKPOINT slots."""

    def __init__(self, pool: StatePool, *, max_evicted_keys: int = 16384) -> None:
        self.pool = pool
        self.max_evicted_keys = max_evicted_keys
        self._entries: OrderedDict[bytes, Checkpoint] = OrderedDict()  # LRU first
        self._by_slot: dict[int, Checkpoint] = {}
        self._evicted: OrderedDict[bytes, None] = OrderedDict()  # bounded, oldest first
        self._clock = 0
        self._hits = self._evictions = self._aborts = 0
        self._misses = dict.fromkeys(MissReason, 0)

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, token_ids: Sequence[int], key: bytes | None = None, *, count: bool = True) -> Lookup:
        """Find the READY checkpoint of exactly ``token_ids``. Mutates only the LRU order and the stats;
        takes no reference (``acquire`` before reading the slot). ``key``: ``checkpoint_key(token_ids)`` when the
        caller has it (every method taking ``key`` trusts it). ``count=False``: the stats are left to the caller
        (``count``), which may still serve the lookup from a lower tier (kv_cache.CheckpointCache.lookup)."""
        ids = tuple(token_ids)
        key = checkpoint_key(ids) if key is None else key
        e = self._entries.get(key)
        if e is None:
            look = Lookup(None, MissReason.EVICTED if key in self._evicted else MissReason.ABSENT, 0)
        elif e.token_ids != ids:
            look = Lookup(None, MissReason.COLLISION, 0)
        elif e.status is CheckpointStatus.PENDING:
            look = Lookup(e, MissReason.PENDING, 0)
        else:
            self._touch(e)
            look = Lookup(e, None, e.length)
        if count:
            self.count(look)
        return look

    def count(self, look: Lookup) -> None:
        """Count one lookup's answer in the stats: a hit, or a miss by its reason."""
        if look.hit:
            self._hits += 1
        else:
            self._misses[look.reason] += 1

    def reserve(self, token_ids: Sequence[int], key: bytes | None = None) -> Checkpoint:
        """Create a PENDING entry on a fresh CHECKPOINT slot, evicting the LRU unreferenced READY entry if
        the pool is full. Raises CheckpointError if the key exists (look up first) and PoolFullError if
        nothing can be evicted."""
        ids = tuple(token_ids)
        if not ids:
            raise ValueError("token_ids: a checkpoint needs at least one token (length 0 is the zero state)")
        key = checkpoint_key(ids) if key is None else key
        old = self._entries.get(key)
        if old is not None:
            what = "these tokens" if old.token_ids == ids else "other tokens with the same hash"
            raise CheckpointError(f"reserve: a checkpoint of {what} already exists ({old!r}); look up first")
        slot = self.pool.try_allocate(SlotKind.CHECKPOINT, self)
        if slot is None and self.evict_lru(1):
            slot = self.pool.try_allocate(SlotKind.CHECKPOINT, self)
        if slot is None:
            pending = sum(e.status is CheckpointStatus.PENDING for e in self._entries.values())
            raise PoolFullError(
                f"state pool full: {self.pool.describe()}; no checkpoint is evictable "
                f"({pending} pending, {len(self._entries) - pending} ready and referenced)",
                num_slots=self.pool.num_slots, usage=self.pool.usage())
        e = Checkpoint(key, ids, len(ids), slot)
        self._entries[key] = e
        self._by_slot[slot] = e
        self._evicted.pop(key, None)
        self._touch(e)
        return e

    def adopt(self, token_ids: Sequence[int], slot: int, key: bytes | None = None) -> Checkpoint | None:
        """Publish the state already in ``slot`` (a RUNNING slot whose sequence has consumed exactly
        ``token_ids``) as a READY checkpoint, taking the slot over. None, changing nothing, if a checkpoint
        of that key exists (the caller keeps and frees its slot)."""
        ids = tuple(token_ids)
        if not ids:
            raise ValueError("token_ids: a checkpoint needs at least one token (length 0 is the zero state)")
        key = checkpoint_key(ids) if key is None else key
        if key in self._entries:
            return None
        self.pool.transfer(slot, SlotKind.CHECKPOINT, self)
        e = Checkpoint(key, ids, len(ids), slot, status=CheckpointStatus.READY)
        self._entries[key] = e
        self._by_slot[slot] = e
        self._evicted.pop(key, None)
        self._touch(e)
        return e

    def mark_ready(self, entry: Checkpoint) -> None:
        """PENDING -> READY. Call only after the step that produced the slot has finished."""
        self._expect(entry, CheckpointStatus.PENDING, "mark_ready")
        entry.status = CheckpointStatus.READY
        self._touch(entry)

    def abort(self, entry: Checkpoint) -> None:
        """Drop a PENDING entry whose producer failed: frees its slot and forgets its key."""
        self._expect(entry, CheckpointStatus.PENDING, "abort")
        self._drop(entry)
        self._aborts += 1

    def acquire(self, entry: Checkpoint) -> None:
        """Take a reference on a READY entry (a consumer reading its slot); pins it against eviction.
        PENDING entries cannot be acquired: same-step consumers read the producer segment instead."""
        self._expect(entry, CheckpointStatus.READY, "acquire")
        entry.refcount += 1
        self._touch(entry)

    def release(self, entry: Checkpoint) -> None:
        self._expect(entry, CheckpointStatus.READY, "release")
        if entry.refcount <= 0:
            raise CheckpointError(f"release: {entry!r} has no reference to release")
        entry.refcount -= 1
        self._touch(entry)

    def lru_victims(self, n: int) -> list[Checkpoint]:
        """The entries ``evict_lru(n)`` would evict, in that order, changing nothing (a lower tier copies them
        before their slots are freed)."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n: expected an int >= 0, got {n!r}")
        victims: list[Checkpoint] = []
        for e in self.victims():
            if len(victims) == n:
                break
            victims.append(e)
        return victims

    def victims(self):
        """The unreferenced READY entries, least recently used first: the eviction order (a generator: the caller
        stops early; do not change the index while iterating)."""
        return (e for e in self._entries.values() if e.status is CheckpointStatus.READY and e.refcount == 0)

    def evict_lru(self, n: int = 1) -> list[Checkpoint]:
        """Evict up to ``n`` READY entries with refcount 0, least recently used first, freeing their slots.
        Returns the evicted entries (now DROPPED, slot -1)."""
        victims = self.lru_victims(n)
        for e in victims:
            key = e.key
            self._drop(e)
            self._evicted[key] = None
            if len(self._evicted) > self.max_evicted_keys:
                self._evicted.popitem(last=False)
        self._evictions += len(victims)
        return victims

    def keys(self) -> tuple[list[bytes], list[bytes], list[int]]:
        """(READY keys, PENDING keys, distinct READY lengths): what a replica reports to its router. Safe to
        call from another thread than the engine's (a copy taken in one C-level pass; retried if the engine
        resized the index meanwhile)."""
        while True:
            try:
                entries = list(self._entries.values())
                break
            except RuntimeError:  # "changed size during iteration": take it again
                continue
        ready = [e for e in entries if e.status is CheckpointStatus.READY]
        return ([e.key for e in ready], [e.key for e in entries if e.status is CheckpointStatus.PENDING],
                sorted({e.length for e in ready}))

    def ready_entries(self) -> list[Checkpoint]:
        """The READY entries, least recently used first (a copy)."""
        return [e for e in self._entries.values() if e.status is CheckpointStatus.READY]

    def is_writable(self, slot: int) -> bool:
        """False iff ``slot`` holds a READY checkpoint of this index (never a kernel destination)."""
        e = self._by_slot.get(slot)
        return e is None or e.status is not CheckpointStatus.READY

    def stats(self) -> dict[str, int]:
        """Counters for /metrics: entries by status, hits, misses by reason, evictions, aborts."""
        pending = sum(e.status is CheckpointStatus.PENDING for e in self._entries.values())
        out = {"entries_pending": pending, "entries_ready": len(self._entries) - pending, "hits": self._hits}
        out.update({f"misses_{r.value}": n for r, n in self._misses.items()})
        out.update(evictions=self._evictions, aborts=self._aborts)
        return out

    # ---- internals ----
    def _touch(self, e: Checkpoint) -> None:
        self._clock += 1
        e.last_use = self._clock
        self._entries.move_to_end(e.key)

    def _expect(self, e: Checkpoint, status: CheckpointStatus, op: str) -> None:
        if self._entries.get(e.key) is not e:
            raise CheckpointError(f"{op}: {e!r} is not in this index (evicted, aborted or another index's)")
        if e.status is not status:
            raise CheckpointError(f"{op}: {e!r} is {e.status.name}, expected {status.name}")

    def _drop(self, e: Checkpoint) -> None:
        del self._entries[e.key]
        del self._by_slot[e.slot]
        self.pool.free(e.slot)
        e.slot, e.status = -1, CheckpointStatus.DROPPED

    # ---- integrity (run when idle and in tests; rehashes every entry) ----
    def check_integrity(self) -> list[str]:
        """Problems found; empty when healthy."""
        problems: list[str] = []
        slots: dict[int, Checkpoint] = {}
        prev_use = 0
        for key, e in self._entries.items():
            if e.key != key or checkpoint_key(e.token_ids) != key:
                problems.append(f"{e!r}: key does not match its token ids")
            if e.length != len(e.token_ids) or e.length < 1:
                problems.append(f"{e!r}: length != len(token_ids) = {len(e.token_ids)}")
            if e.status not in (CheckpointStatus.PENDING, CheckpointStatus.READY):
                problems.append(f"{e!r}: a {e.status.name} entry is still indexed")
            if e.refcount < 0 or (e.refcount and e.status is not CheckpointStatus.READY):
                problems.append(f"{e!r}: bad refcount for its status")
            if e.last_use <= prev_use:
                problems.append(f"{e!r}: LRU order broken (last_use {e.last_use} after {prev_use})")
            prev_use = e.last_use
            if e.slot in slots:
                problems.append(f"{e!r} and {slots[e.slot]!r} share slot {e.slot}")
            slots[e.slot] = e
            try:
                kind, owner = self.pool.kind_of(e.slot), self.pool.owner_of(e.slot)
            except StatePoolError as err:
                problems.append(f"{e!r}: {err}")
                continue
            if kind is not SlotKind.CHECKPOINT or owner is not self:
                problems.append(f"{e!r}: pool slot {e.slot} is {kind}, owner {owner!r}, not this index's checkpoint")
        if self._by_slot != slots:
            problems.append(f"slot map {sorted(self._by_slot)} != entry slots {sorted(slots)}")
        leaked = sorted(set(self.pool.slots_of(self)) - slots.keys())
        if leaked:
            problems.append(f"checkpoint slots owned by the index without an entry: {leaked}")
        if len(self._evicted) > self.max_evicted_keys:
            problems.append(f"evicted-key memory {len(self._evicted)} > bound {self.max_evicted_keys}")
        if any(k in self._entries for k in self._evicted):
            problems.append("a live key is also remembered as evicted")
        return problems

    def assert_integrity(self) -> None:
        problems = self.check_integrity()
        if problems:
            raise CheckpointError("checkpoint index integrity: " + "; ".join(problems))
