"""The KV pages of the attention layers: one allocation per kind, refcounted pages, per-sequence page tables.

``k_pools, v_pools: [L, num_pages, page_size, KVH, Dh]``, so ``pool.k_cache(layer)`` and
``pool.v_cache(layer)`` are the contiguous per-layer views the ops in gdnserve/ops/attention take
(``layer`` counts attention layers only). A page is free (refcount 0) or used by 1+ holders (page tables,
checkpoints). Full prefix pages are shared between a checkpoint's consumers; a prefix that ends inside a
page cannot share that page, because the producer and every consumer each write their own next tokens into
it, so :meth:`PageTable.fork` gives each consumer a private copy-on-write page for the tail. A full pool is
a normal, recoverable condition: ``try_allocate`` returns None and ``allocate`` raises
:class:`PagePoolFullError` with the counts, so the scheduler can queue.
"""
from __future__ import annotations

import heapq
import logging
from collections import Counter
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

import torch

from gdnserve.engine.cache.state_pool import _check_int, _mib
from gdnserve.ops.attention import copy_pages
from gdnserve.ops.checks import ACT_DTYPES

logger = logging.getLogger(__name__)


class PagePoolError(RuntimeError):
    """Misuse of a page (refcount underflow, unknown or free page) or a pool that cannot be built."""


class PagePoolFullError(PagePoolError):
    """Not enough free pages. Recoverable: release or evict something and retry, or queue the request."""

    def __init__(self, reason: str, *, requested: int, num_free: int, num_pages: int) -> None:
        super().__init__(reason)
        self.requested, self.num_free, self.num_pages = requested, num_free, num_pages


@dataclass(frozen=True)
class PagePoolConfig:
    """Shapes of the KV cache: per layer ``[num_pages, page_size, num_kv_heads, head_dim]`` for K and for V."""
    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    device: torch.device | str = "cpu"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_pages", "page_size", "num_kv_heads", "head_dim"):
            _check_int(name, getattr(self, name), 1)
        if self.dtype not in ACT_DTYPES:
            raise ValueError(f"dtype: expected one of {[str(d) for d in ACT_DTYPES]}, got {self.dtype}")
        object.__setattr__(self, "device", torch.device(self.device))

    @property
    def bytes_per_page(self) -> int:
        """K + V bytes of one page over all layers."""
        return 2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize


class PagePool:
    """K/V caches of every attention layer and the refcounts of their pages.

    Allocation is deterministic (lowest free page first). A newly allocated page holds zeros on first use
    and stale K/V after reuse; attention reads only positions below a sequence's length, all of which its
    owner has stored (or shares from a producer that has).
    """

    def __init__(self, config: PagePoolConfig) -> None:
        c = self.config = config
        shape = (c.num_layers, c.num_pages, c.page_size, c.num_kv_heads, c.head_dim)
        self.k_pools = torch.zeros(shape, dtype=c.dtype, device=c.device)
        self.v_pools = torch.zeros(shape, dtype=c.dtype, device=c.device)
        self._free: list[int] = list(range(c.num_pages))  # a heap; sorted is a valid heap
        self._refs: list[int] = [0] * c.num_pages

    @classmethod
    def from_budget(cls, budget_bytes: int, *, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                    max_pages: int | None = None) -> PagePool:
        """As many pages as fit in ``budget_bytes`` (capped at ``max_pages``); raises PagePoolError naming
        the budget and the bytes of one page when not even one fits."""
        probe = PagePoolConfig(num_layers, 1, page_size, num_kv_heads, head_dim, dtype, device)
        per_page = probe.bytes_per_page
        n = int(budget_bytes) // per_page
        if n < 1:
            raise PagePoolError(
                f"KV page budget of {budget_bytes} bytes ({_mib(budget_bytes)}) fits no page: one page needs "
                f"{per_page} bytes (K+V x {num_layers} layers x {page_size} tokens x {num_kv_heads} heads x "
                f"{head_dim} {dtype})")
        if max_pages is not None:
            _check_int("max_pages", max_pages, 1)
            n = min(n, max_pages)
        logger.info("KV page pool: %d pages x %s = %s of a %s budget", n, _mib(per_page), _mib(n * per_page),
                    _mib(budget_bytes))
        return cls(replace(probe, num_pages=n))

    # ---- views (bound into the attention layers once at start-up) ----
    def k_cache(self, layer: int) -> torch.Tensor:
        """``[num_pages, page_size, KVH, Dh]`` K cache of attention layer ``layer`` (a contiguous view)."""
        return self.k_pools[self._layer(layer)]

    def v_cache(self, layer: int) -> torch.Tensor:
        """``[num_pages, page_size, KVH, Dh]`` V cache of attention layer ``layer`` (a contiguous view)."""
        return self.v_pools[self._layer(layer)]

    def _layer(self, layer: int) -> int:
        if not isinstance(layer, int) or not 0 <= layer < self.config.num_layers:
            raise IndexError(f"layer: expected 0 <= layer < {self.config.num_layers}, got {layer!r}")
        return layer

    def copy_pages(self, src_pages: Sequence[int], dst_pages: Sequence[int]) -> None:
        """Copy-on-write in every layer (e.g. a consumer forked from a READY checkpoint, before its step)."""
        for p in [*src_pages, *dst_pages]:
            self._check_used(p, "copy_pages")
        src = torch.tensor(list(src_pages), dtype=torch.int64, device=self.config.device)
        dst = torch.tensor(list(dst_pages), dtype=torch.int64, device=self.config.device)
        for layer in range(self.config.num_layers):
            copy_pages(self.k_cache(layer), self.v_cache(layer), src, dst)

    # ---- allocator (mutates the free list and the refcounts only; never the tensors) ----
    def try_allocate(self, n: int) -> list[int] | None:
        """Take the ``n`` lowest free pages (refcount 1 each); None, taking nothing, when fewer are free."""
        _check_int("n", n, 0)
        if n > len(self._free):
            return None
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def allocate(self, n: int) -> list[int]:
        """As :meth:`try_allocate`, raising PagePoolFullError with the counts when too few pages are free."""
        pages = self.try_allocate(n)
        if pages is None:
            raise PagePoolFullError(f"KV page pool full: {n} pages requested, {self.describe()}",
                                    requested=n, num_free=self.num_free, num_pages=self.num_pages)
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """One more holder of each page (all must be in use); nothing changes if any is not."""
        pages = list(pages)
        refs = self._refs
        if not self._valid(pages):
            for p in pages:
                self._check_page(p)               # raises, naming the page
        if pages and min(map(refs.__getitem__, pages)) == 0:
            raise PagePoolError(f"incref: page {next(p for p in pages if refs[p] == 0)} is free")
        for p in pages:
            refs[p] += 1

    def decref(self, pages: Iterable[int]) -> None:
        """One holder fewer of each page; pages reaching 0 are freed. A page listed more often than its
        refcount raises PagePoolError naming it, and nothing changes."""
        pages = list(pages)
        refs, free = self._refs, self._free
        if not self._valid(pages):
            for p in pages:
                self._check_page(p)               # raises, naming the page
        if len(set(pages)) == len(pages):         # distinct pages (one table's): no counting needed
            if pages and min(map(refs.__getitem__, pages)) < 1:
                p = next(p for p in pages if refs[p] < 1)
                raise PagePoolError(f"decref: page {p} has refcount 0, cannot drop 1 (double free?)")
            for p in pages:
                refs[p] -= 1
                if not refs[p]:
                    heapq.heappush(free, p)
            return
        counts = Counter(pages)
        for p, c in counts.items():
            if c > refs[p]:
                raise PagePoolError(f"decref: page {p} has refcount {refs[p]}, cannot drop {c} "
                                    f"(double free?)")
        for p, c in counts.items():
            refs[p] -= c
            if refs[p] == 0:
                heapq.heappush(free, p)

    def _valid(self, pages: list) -> bool:
        """Whether every page is an int page number of this pool (C-level passes; the callers then name the bad
        one)."""
        if not pages:
            return True
        return set(map(type, pages)) == {int} and min(pages) >= 0 and max(pages) < self.config.num_pages

    def _check_page(self, page: int) -> None:
        if not isinstance(page, int) or isinstance(page, bool) or not 0 <= page < self.num_pages:
            raise PagePoolError(f"page {page!r} is not a page of this pool (valid: 0..{self.num_pages - 1})")

    def _check_used(self, page: int, what: str) -> None:
        self._check_page(page)
        if self._refs[page] == 0:
            raise PagePoolError(f"{what}: page {page} is free")

    # ---- queries ----
    def refcount(self, page: int) -> int:
        self._check_page(page)
        return self._refs[page]

    @property
    def num_pages(self) -> int:
        return self.config.num_pages

    @property
    def page_size(self) -> int:
        return self.config.page_size

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def bytes_per_page(self) -> int:
        return self.config.bytes_per_page

    def describe(self) -> str:
        """E.g. ``"3 of 64 pages free (61 used, 12 shared)"``."""
        used = self.num_pages - self.num_free
        shared = sum(r > 1 for r in self._refs)
        return f"{self.num_free} of {self.num_pages} pages free ({used} used, {shared} shared)"

    # ---- integrity (run when idle and in tests; O(num_pages)) ----
    def check_integrity(self) -> list[str]:
        """Problems found in the allocator's bookkeeping; empty when healthy."""
        problems: list[str] = []
        free, refs, n = self._free, self._refs, self.num_pages
        used = [p for p in range(n) if refs[p] != 0]
        if len(free) + len(used) != n:
            problems.append(f"free {len(free)} + used {len(used)} != total {n}")
        if len(set(free)) != len(free):
            problems.append(f"free list has duplicates: {sorted(p for p, c in Counter(free).items() if c > 1)}")
        if any(free[(i - 1) // 2] > free[i] for i in range(1, len(free))):
            problems.append("free list is not a heap (allocation order would not be lowest-first)")
        bad = sorted(p for p in free if not (isinstance(p, int) and 0 <= p < n))
        if bad:
            problems.append(f"free pages out of range: {bad}")
        if len(refs) != n:
            problems.append(f"{len(refs)} refcounts for {n} pages")
        negative = [p for p in used if refs[p] < 0]
        if negative:
            problems.append(f"negative refcounts: {negative}")
        both = sorted(set(free) & set(used))
        if both:
            problems.append(f"pages both free and in use: {both}")
        missing = sorted(set(range(n)) - set(free) - set(used))
        if missing:
            problems.append(f"pages neither free nor in use: {missing}")
        return problems

    def assert_integrity(self) -> None:
        problems = self.check_integrity()
        if problems:
            raise PagePoolError("page pool integrity: " + "; ".join(problems))


@dataclass(frozen=True, slots=True)
class CowCopy:
    """A consumer's private copy of a partially filled prefix tail page: offsets ``0 .. num_tokens-1`` of
    ``dst_page`` must receive what ``src_page`` holds (or will hold this step) at the same offsets, i.e.
    the prefix positions ``first_position .. first_position + num_tokens - 1``."""
    src_page: int
    dst_page: int
    num_tokens: int
    first_position: int
    page_size: int

    def slot_pairs(self) -> list[tuple[int, int]]:
        """(src slot, dst slot) per covered offset, for the duplicated-store strategy (see PageTable.fork)."""
        s, d, P = self.src_page, self.dst_page, self.page_size
        return [(s * P + o, d * P + o) for o in range(self.num_tokens)]


class PageTable:
    """The pages of one sequence (or checkpoint) in logical order, and how many positions they hold.

    Constructed with ``pages``, it takes over one reference to each (no incref). Positions ``0 .. length-1``
    have slots; the sequence writes only positions >= the length it had when they were appended.
    """

    def __init__(self, pool: PagePool, pages: Sequence[int] = (), length: int = 0) -> None:
        _check_int("length", length, 0)
        if len(pages) != -(-length // pool.page_size):
            raise ValueError(f"pages: {length} positions need {-(-length // pool.page_size)} pages of "
                             f"{pool.page_size}, got {len(pages)}")
        self.pool, self.pages, self.length = pool, list(pages), length

    def __repr__(self) -> str:
        return f"PageTable(length={self.length}, pages={self.pages})"

    def pages_needed(self, n: int) -> int:
        """New pages that appending ``n`` tokens would allocate (for the scheduler's budget)."""
        return max(0, -(-(self.length + n) // self.pool.page_size) - len(self.pages))

    def append_tokens(self, n: int) -> list[int]:
        """Reserve slots for the next ``n`` positions, allocating pages as needed (all or nothing: raises
        PagePoolFullError and changes nothing when the pool is short). Returns their slot_mapping."""
        _check_int("n", n, 0)
        self.pages += self.pool.allocate(self.pages_needed(n))
        start, self.length = self.length, self.length + n
        return self.slots(start, self.length)

    def slots(self, start: int, end: int) -> list[int]:
        """Physical slots of positions ``start .. end-1`` (all below ``length``)."""
        if not 0 <= start <= end <= self.length:
            raise ValueError(f"positions {start}..{end}: expected 0 <= start <= end <= length = {self.length}")
        P, pages, out = self.pool.page_size, self.pages, []
        first, last = start // P, (end - 1) // P
        for i in range(first, last + 1):          # one range per page, not a Python step per position
            b = pages[i] * P
            out += range(b + (start - i * P if i == first else 0), b + (end - i * P if i == last else P))
        return out

    def page_row(self, width: int, pad: int = -1) -> list[int]:
        """This table as one row of a step's ``page_table [N, width]``, padded with ``pad``."""
        if width < len(self.pages):
            raise ValueError(f"width: {width} < this table's {len(self.pages)} pages")
        return self.pages + [pad] * (width - len(self.pages))

    def fork(self, prefix_len: int) -> tuple[PageTable, CowCopy | None]:
        """A new table for positions ``0 .. prefix_len-1`` of this one (a consumer of the prefix).

        The prefix's full pages are shared (incref). When ``prefix_len`` ends inside a page, the new table
        gets a freshly allocated private tail page and the returned :class:`CowCopy` says what it must hold.
        This table keeps its reference to the source page: keep it alive until the copy has happened.
        The engine fills the copy in one of two ways, per attention layer, before the consumer's attention:

        - producer's tail tokens written in this same step (every src slot of ``slot_pairs()`` is in this
          step's slot_mapping): *duplicated store* -- for each pair add ``(dst slot, producer's token row)``
          to the step's ``slot_mapping`` / ``token_index``; one ``store_kv`` writes both copies, no copy op.
        - otherwise (the producer's tail was stored in an earlier step, at least in part), or by choice:
          *copy* -- ``store_kv`` of the producer's rows, then ``copy_pages([src], [dst])``, then ``store_kv``
          of the consumers' rows. The copy covers the whole page, so it must come before the consumer's own
          tokens land in ``dst`` (offsets >= ``num_tokens``). For a READY checkpoint nothing is written to
          ``src`` any more, so ``PagePool.copy_pages`` once for all layers before the step is enough.
        - both: a producer whose tail page was partly stored in earlier steps: ``PagePool.copy_pages``
          before the step (those positions are final), then the duplicated store for this step's positions.

        Raises PagePoolFullError (changing nothing) when no page is free for the tail.
        """
        if not isinstance(prefix_len, int) or not 0 <= prefix_len <= self.length:
            raise ValueError(f"prefix_len: expected 0 <= prefix_len <= length = {self.length}, got {prefix_len!r}")
        P = self.pool.page_size
        full, tail = divmod(prefix_len, P)
        private = self.pool.allocate(1) if tail else []
        shared = self.pages[:full]
        self.pool.incref(shared)
        child = PageTable(self.pool, shared + private, prefix_len)
        cow = CowCopy(self.pages[full], private[0], tail, full * P, P) if tail else None
        return child, cow

    def release(self) -> None:
        """Drop this table's references (pages reaching refcount 0 are freed); leaves it empty."""
        self.pool.decref(self.pages)
        self.pages, self.length = [], 0
