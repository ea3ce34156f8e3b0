"""Static inputs of graph-shaped steps: decode-only and verify-only steps padded to a batch-size bucket.

A CUDA graph reads its inputs from the addresses it was captured with, so every graph-shaped step writes
its index vectors into ONE persistent int32 device buffer (an IndexStager's), in a fixed layout per
(kind, bucket), and the buffer is filled with ONE host-to-device copy of the bucket's span per step.
A step of B requests in bucket Bk fills rows 0..B-1 with its requests and rows B..Bk-1 with padding:

- GDN slot -1 (the conv and recurrent kernels skip the row: zero output, no pool or pending traffic);
  verify scratch / pending rows -1 and num_pending 0;
- attention slot_mapping -1 (store_kv skips it); L query rows at positions 0..L-1 with kv_len L over
  page 0 (the row's first page-table entries are 0): a short attention over finite bytes that nothing
  writes this step, so padded rows stay cheap and finite; token id 0.

Page-table rows have the fixed width ``W`` (max pages per sequence); entries past a row's page count are
left stale in the buffer: the attention ops read only the first ceil(kv_len / page_size) entries.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

from gdnserve.engine.execution.step_plan import IndexStager
from gdnserve.ops.varlen import aligned

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def graph_buckets(cap: int) -> tuple[int, ...]:
    """The batch-size buckets up to ``cap`` (max_num_seqs): BUCKETS below it, then ``cap`` itself when it
    is at most the largest bucket; e.g. 48 -> (1, 2, 4, 8, 16, 32, 48), 1000 -> BUCKETS."""
    if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
        raise ValueError(f"graph_max_batch: expected an int >= 1, got {cap!r}")
    if cap >= BUCKETS[-1]:
        return BUCKETS
    return tuple(b for b in BUCKETS if b < cap) + (cap,)


def pick_bucket(buckets: tuple[int, ...], batch: int) -> int | None:
    """The smallest bucket >= batch, or None when the batch is larger than every bucket (or empty)."""
    if batch < 1:
        return None
    i = bisect.bisect_left(buckets, batch)
    return buckets[i] if i < len(buckets) else None


@dataclass(frozen=True, slots=True)
class StepKind:
    """What a graph-shaped step runs: L tokens per request; ``verify`` None (decode, L = 1) or the spec mode."""
    L: int
    verify: str | None = None

    def row_vectors(self) -> tuple[str, ...]:
        """Vectors with one entry per request (besides the L-per-request ids, positions, slot_mapping)."""
        extra = {None: (), "intermediate": ("rows_out",), "replay": ("rows_out", "rows_in", "num")}[self.verify]
        return ("kv", "slots") + extra


_PAD = {"ids": 0, "smap": -1, "kv": None, "slots": -1, "rows_out": -1, "rows_in": -1, "num": 0}


def _layout(kind: StepKind, Bk: int, W: int) -> tuple[dict[str, tuple[int, int]], int]:
    """Offsets of each vector in the buffer for bucket Bk, and the span."""
    lay, off = {}, 0
    for name, n in [(v, Bk * kind.L) for v in ("ids", "pos", "smap")] + [(v, Bk) for v in kind.row_vectors()]:
        lay[name] = (off, off + n)
        off = aligned(off + n)                          # 16-byte aligned views (step_plan.ALIGN_INTS)
    lay["table"] = (off, off + Bk * W)
    return lay, off + Bk * W


class GraphInputs:
    """The persistent buffer, its per-(kind, bucket) device views, and the per-step fill."""

    def __init__(self, kinds: list[StepKind], max_bucket: int, width: int, page_size: int,
                 device: torch.device | str):
        self.width, self.page_size = width, page_size
        self.stager = IndexStager(max(_layout(k, max_bucket, width)[1] for k in kinds), device)
        self._views: dict[tuple[StepKind, int], dict[str, torch.Tensor]] = {}
        self._cu: dict[tuple[StepKind, int], torch.Tensor] = {}
        self._pos_pad = {k.L: np.tile(np.arange(k.L, dtype=np.int32), max_bucket) for k in kinds}

    def views(self, kind: StepKind, Bk: int) -> dict[str, torch.Tensor]:
        """Device int32 views (fixed addresses for the runner's lifetime): ids, pos, smap [Bk*L]; kv, slots
        (+ rows_out, rows_in, num) [Bk]; table [Bk, W]; cu [Bk+1] (a constant: every row has L queries)."""
        key = (kind, Bk)
        v = self._views.get(key)
        if v is None:
            lay, _ = _layout(kind, Bk, self.width)
            dev = self.stager.dev
            v = {name: dev[a:b] for name, (a, b) in lay.items()}
            v["table"] = v["table"].view(Bk, self.width)
            v["cu"] = torch.arange(0, (Bk + 1) * kind.L, kind.L, dtype=torch.int32, device=dev.device)
            self._views[key] = v
        return v

    def fill(self, kind: StepKind, Bk: int, vecs: dict[str, list[int]], tables: list[list[int]]) -> None:
        """Write the B live requests (``vecs``: ids, pos, smap with B*L entries; the row vectors with B;
        ``tables``: each request's page list, at most W pages) and Bk - B padding rows; one upload."""
        lay, span = _layout(kind, Bk, self.width)
        B = len(tables)
        h = self.stager.stage(span).numpy()
        for name, (a, b) in lay.items():
            if name == "table":
                continue
            live = vecs[name]
            m = len(live)
            h[a:a + m] = live
            if name == "pos":
                h[a + m:b] = self._pos_pad[kind.L][:b - a - m]
            else:
                h[a + m:b] = kind.L if name == "kv" else _PAD[name]
        a, b = lay["table"]
        tab = h[a:b].reshape(Bk, self.width)
        for i, pages in enumerate(tables):
            tab[i, :len(pages)] = pages
        tab[B:, :-(-kind.L // self.page_size)] = 0          # padding rows read page 0 at positions < L
        self.stager.push(span)
