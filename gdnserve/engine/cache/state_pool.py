"""The recurrent-state pool of the GDN layers: slot-indexed conv and SSM state plus a typed slot allocator.

One allocation per kind of state, ``[num_layers, S, ...]``, so ``pool.conv(layer)`` and
``pool.ssm(layer)`` are the contiguous per-layer views the ops take (gdnserve/ops/conv/prefill.py,
gdnserve/ops/gdn/chunk.py). One slot index addresses both pools of every layer; ``-1`` is padding and
is never allocated. A full pool is a normal, recoverable condition: ``try_allocate`` returns None and
``allocate`` raises :class:`PoolFullError` with the occupancy by kind, so the scheduler can queue.

Per-slot tensors owned elsewhere but indexed like the pool (the MTP drafter's hidden after a slot's last token) are
registered here (``register_rows``): a slot's state is its conv and SSM rows plus its row of each of them, and the
checkpoint tiers (checkpoint_copy.py) copy exactly that with a checkpoint's pages.
"""
from __future__ import annotations

import enum
import heapq
import logging
from dataclasses import dataclass, replace

import torch

from gdnserve.ops.checks import ACT_DTYPES, STATE_DTYPES

logger = logging.getLogger(__name__)


class SlotKind(enum.Enum):
    RUNNING = "running"        # committed state of one live request
    CHECKPOINT = "checkpoint"  # a PENDING or READY checkpoint (owned by the CheckpointIndex)
    SCRATCH = "scratch"        # verify rows of a step


class StatePoolError(RuntimeError):
    """Misuse of a slot (double free, unknown slot) or a pool that cannot be built."""


class PoolFullError(StatePoolError):
    """No free slot. Recoverable: free or evict something and retry, or queue the request."""

    def __init__(self, reason: str, *, num_slots: int, usage: dict[SlotKind, int]) -> None:
        super().__init__(reason)
        self.reason = reason
        self.num_slots = num_slots
        self.usage = usage


@dataclass(frozen=True)
class StatePoolConfig:
    """Shapes and dtypes of the pool. conv: ``[S, W-1+num_spec, D]`` per layer (the ops in gdnserve/ops
    keep exactly W-1 rows and put drafted inputs elsewhere, so they need ``num_spec=0``); ssm:
    ``[S, HV, V, K]`` per layer, V-major with K contiguous."""
    num_layers: int
    num_slots: int
    HV: int
    K: int
    V: int
    conv_dim: int
    conv_width: int
    num_spec: int = 0
    ssm_dtype: torch.dtype = torch.float32
    conv_dtype: torch.dtype = torch.bfloat16
    device: torch.device | str = "cpu"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_slots", "HV", "K", "V", "conv_dim"):
            _check_int(name, getattr(self, name), 1)
        _check_int("conv_width", self.conv_width, 2)
        _check_int("num_spec", self.num_spec, 0)
        if self.ssm_dtype not in STATE_DTYPES:
            raise ValueError(f"ssm_dtype: expected one of {[str(d) for d in STATE_DTYPES]}, got {self.ssm_dtype}")
        if self.conv_dtype not in ACT_DTYPES:
            raise ValueError(f"conv_dtype: expected one of {[str(d) for d in ACT_DTYPES]}, got {self.conv_dtype}")
        object.__setattr__(self, "device", torch.device(self.device))

    @property
    def conv_rows(self) -> int:
        return self.conv_width - 1 + self.num_spec

    @property
    def bytes_per_slot(self) -> int:
        """Conv + SSM bytes of one slot over all layers."""
        conv = self.conv_rows * self.conv_dim * self.conv_dtype.itemsize
        ssm = self.HV * self.V * self.K * self.ssm_dtype.itemsize
        return self.num_layers * (conv + ssm)


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")


@dataclass(slots=True)
class SlotRecord:
    kind: SlotKind
    owner: object


class StatePool:
    """Conv + SSM state for every GDN layer and the free list of their slots.

    Allocation is deterministic (lowest free slot first). A newly allocated slot holds zeros on its first
    use and stale state after reuse: callers initialise it by running with ``src = -1`` (zeros), never by
    reading it.
    """

    def __init__(self, config: StatePoolConfig) -> None:
        c = self.config = config
        L, S = c.num_layers, c.num_slots
        self.conv_pools = torch.zeros(L, S, c.conv_rows, c.conv_dim, dtype=c.conv_dtype, device=c.device)
        self.ssm_pools = torch.zeros(L, S, c.HV, c.V, c.K, dtype=c.ssm_dtype, device=c.device)
        self._free: list[int] = list(range(S))  # a heap; sorted is a valid heap
        self.slot_rows: dict[str, torch.Tensor] = {}    # register_rows: name -> [>= S, ...], row s of slot s
        self._records: dict[int, SlotRecord] = {}
        self._counts = dict.fromkeys(SlotKind, 0)

    @classmethod
    def from_budget(cls, budget_bytes: int, *, num_layers: int, HV: int, K: int, V: int, conv_dim: int,
                    conv_width: int, num_spec: int = 0, ssm_dtype: torch.dtype = torch.float32,
                    conv_dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                    max_slots: int | None = None) -> StatePool:
        """As many slots as fit in ``budget_bytes`` (capped at ``max_slots``); raises StatePoolError
        naming the budget and the bytes of one slot when not even one fits."""
        probe = StatePoolConfig(num_layers, 1, HV, K, V, conv_dim, conv_width, num_spec, ssm_dtype, conv_dtype,
                                device)
        per_slot = probe.bytes_per_slot
        n = int(budget_bytes) // per_slot
        if n < 1:
            raise StatePoolError(
                f"state pool budget of {budget_bytes} bytes ({_mib(budget_bytes)}) fits no slot: one slot needs "
                f"{per_slot} bytes ({_mib(per_slot)}: {num_layers} layers x (conv {probe.conv_rows}x{conv_dim} "
                f"{conv_dtype} + ssm {HV}x{V}x{K} {ssm_dtype}))")
        if max_slots is not None:
            _check_int("max_slots", max_slots, 1)
            n = min(n, max_slots)
        logger.info("state pool: %d slots x %s = %s of a %s budget", n, _mib(per_slot), _mib(n * per_slot),
                    _mib(budget_bytes))
        return cls(replace(probe, num_slots=n))

    # ---- views (read only; bound into the layers once at start-up) ----
    def conv(self, layer: int) -> torch.Tensor:
        """``[S, W-1+num_spec, D]`` conv history of GDN layer ``layer`` (a contiguous view)."""
        return self.conv_pools[self._layer(layer)]

    def ssm(self, layer: int) -> torch.Tensor:
        """``[S, HV, V, K]`` SSM state of GDN layer ``layer`` (a contiguous view)."""
        return self.ssm_pools[self._layer(layer)]

    def register_rows(self, name: str, rows: torch.Tensor) -> None:
        """Make ``rows[s]`` part of slot ``s``'s state for the checkpoint tiers (``rows``: ``[>= num_slots, ...]`` on
        the pool's device, owned and written by the caller; rows past ``num_slots`` are the owner's scratch and
        travel nowhere). Registered by the runner when it builds what owns them, before the tiers are built (their
        disk files' fingerprint names the rows). The same name again replaces the tensor (a new runner)."""
        if not isinstance(name, str) or not name or name in ("conv", "ssm", "k", "v"):
            raise ValueError(f"register_rows: a name other than conv/ssm/k/v is needed, got {name!r}")
        if rows.dim() < 1 or rows.shape[0] < self.num_slots or rows.device != self.config.device:
            raise ValueError(f"register_rows({name!r}): expected [>= {self.num_slots}, ...] on {self.config.device}, "
                             f"got {list(rows.shape)} on {rows.device}")
        self.slot_rows[name] = rows

    def _layer(self, layer: int) -> int:
        if not isinstance(layer, int) or not 0 <= layer < self.config.num_layers:
            raise IndexError(f"layer: expected 0 <= layer < {self.config.num_layers}, got {layer!r}")
        return layer

    # ---- allocator (mutates the free list and the owner records only; never the tensors) ----
    def try_allocate(self, kind: SlotKind, owner: object) -> int | None:
        """Take the lowest free slot for ``owner``; None when the pool is full."""
        if not isinstance(kind, SlotKind):
            raise TypeError(f"kind: expected a SlotKind, got {kind!r}")
        if owner is None:
            raise ValueError("owner: every allocated slot needs an owner, got None")
        if not self._free:
            return None
        slot = heapq.heappop(self._free)
        self._records[slot] = SlotRecord(kind, owner)
        self._counts[kind] += 1
        return slot

    def allocate(self, kind: SlotKind, owner: object) -> int:
        """As :meth:`try_allocate`, raising PoolFullError (with the occupancy by kind) when full."""
        slot = self.try_allocate(kind, owner)
        if slot is None:
            raise PoolFullError(f"state pool full: {self.describe()}", num_slots=self.num_slots, usage=self.usage())
        return slot

    def free(self, slot: int) -> None:
        """Return ``slot`` to the free list; StatePoolError naming the slot if it is not allocated."""
        self._check_slot(slot)
        record = self._records.pop(slot, None)
        if record is None:
            raise StatePoolError(f"free: slot {slot} is not allocated (double free?)")
        self._counts[record.kind] -= 1
        heapq.heappush(self._free, slot)

    def transfer(self, slot: int, kind: SlotKind, owner: object) -> None:
        """Hand an allocated slot to a new owner under a new kind, contents untouched (a finished request's
        running slot becoming a checkpoint). StatePoolError naming the slot if it is not allocated."""
        self._check_slot(slot)
        if owner is None:
            raise StatePoolError(f"transfer: slot {slot} needs an owner")
        record = self._records.get(slot)
        if record is None:
            raise StatePoolError(f"transfer: slot {slot} is not allocated")
        self._counts[record.kind] -= 1
        self._counts[kind] += 1
        self._records[slot] = SlotRecord(kind, owner)

    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < self.num_slots:
            raise StatePoolError(f"slot {slot!r} is not a slot of this pool (valid: 0..{self.num_slots - 1})")

    # ---- queries ----
    def kind_of(self, slot: int) -> SlotKind | None:
        """The kind of an allocated slot, None for a free one."""
        self._check_slot(slot)
        record = self._records.get(slot)
        return None if record is None else record.kind

    def owner_of(self, slot: int) -> object | None:
        """The owner of an allocated slot, None for a free one."""
        self._check_slot(slot)
        record = self._records.get(slot)
        return None if record is None else record.owner

    def slots_of(self, owner: object) -> list[int]:
        """Slots owned by ``owner`` (compared with ``==``), ascending. O(used slots)."""
        return sorted(s for s, r in self._records.items() if r.owner == owner)

    @property
    def num_slots(self) -> int:
        return self.config.num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def bytes_per_slot(self) -> int:
        return self.config.bytes_per_slot

    def usage(self) -> dict[SlotKind, int]:
        """Allocated slots by kind."""
        return dict(self._counts)

    def describe(self) -> str:
        """E.g. ``"0 of 64 slots free (running 40, checkpoint 24, scratch 0)"``."""
        kinds = ", ".join(f"{k.value} {n}" for k, n in self._counts.items())
        return f"{self.num_free} of {self.num_slots} slots free ({kinds})"

    # ---- integrity (run when idle and in tests; O(S)) ----
    def check_integrity(self) -> list[str]:
        """Problems found in the allocator's bookkeeping; empty when healthy."""
        problems: list[str] = []
        S, free, used = self.num_slots, self._free, self._records
        if len(free) + len(used) != S:
            problems.append(f"free {len(free)} + used {len(used)} != total {S}")
        if len(set(free)) != len(free):
            dups = sorted({s for s in free if free.count(s) > 1})
            problems.append(f"free list has duplicates: {dups}")
        if any(free[(i - 1) // 2] > free[i] for i in range(1, len(free))):
            problems.append("free list is not a heap (allocation order would not be lowest-first)")
        both = sorted(set(free) & used.keys())
        if both:
            problems.append(f"slots both free and owned: {both}")
        bad = sorted(s for s in [*free, *used] if not (isinstance(s, int) and 0 <= s < S))
        if bad:
            problems.append(f"slots out of range: {bad}")
        missing = sorted(set(range(S)) - set(free) - used.keys())
        if missing:
            problems.append(f"slots neither free nor owned: {missing}")
        for s, r in sorted(used.items()):
            if not isinstance(r.kind, SlotKind) or r.owner is None:
                problems.append(f"slot {s} has a bad owner record: {r}")
        recount = dict.fromkeys(SlotKind, 0)
        for r in used.values():
            if isinstance(r.kind, SlotKind):
                recount[r.kind] += 1
        if recount != self._counts:
            problems.append(f"usage counters {self._counts} != recount {recount}")
        return problems

    def assert_integrity(self) -> None:
        problems = self.check_integrity()
        if problems:
            raise StatePoolError("state pool integrity: " + "; ".join(problems))


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"
