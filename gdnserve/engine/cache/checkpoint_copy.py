"""Copies of one checkpoint between the device pools and host memory: every GDN layer's state of its slot and its
prefix's attention KV pages, as a :class:`HostCheckpoint`.

Layout on the host: ``conv [L, W-1, D]``, ``ssm [L, HV, V, K]`` (the slot's row of every layer of the state pool),
``k, v [La, n, page_size, KVH, Dh]`` (the table's ``n`` pages of every attention layer, in table order). The copies go
per layer and per run of consecutive pages, so every source and destination is a contiguous block: no gather
into a temporary on the device (the pools fill the GPU; a 100 MB temporary could be an OOM).

Ordering on CUDA (the exact scheme; docs/architecture.md "Checkpoint tiers"):

- device -> host (``snapshot``, a GPU eviction): the copy runs on the copier's own stream after
  ``stream.wait_stream(current)`` (so it reads what the steps already queued wrote), and the current stream then
  waits on the copy's event: the evicted slot and pages go back to the free lists at once, and any later kernel
  that could write them is ordered after the copy on the GPU. The host never blocks; the GPU's next kernels start
  after the copy (PCIe at ~50 GB/s: ~2 ms per 100 MB). Readers of the host copy (the disk writer) wait on its event.
- host -> device (``restore``, a lookup that found the key below): the copy writes a freshly allocated slot and
  pages on the copier's stream after ``wait_stream(current)`` (their previous owner's queued kernels finish
  first); the entry stays PENDING until ``event.query()`` says the copy is done (``CheckpointTiers.poll``), so no
  kernel reads it earlier and no stream needs to wait.

On CPU the copies are synchronous (``event`` None) and the host tensors are ordinary memory.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from gdnserve.engine.cache.page_pool import PagePool
from gdnserve.engine.cache.state_pool import StatePool

TENSORS = ("conv", "ssm", "k", "v")


@dataclass(slots=True, eq=False)
class HostCheckpoint:
    """One checkpoint off the device. ``length``: tokens it covers (= its page table's positions);
    ``tensors``: name -> host tensor (module docstring); ``event``: the device -> host copy (None: complete)."""
    key: bytes
    token_ids: tuple[int, ...]
    tensors: dict[str, torch.Tensor]
    event: object | None = None
    footprint: int = field(default=0)     # host bytes it holds (its allocation, rounded as the allocator does)

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def num_pages(self) -> int:
        return self.tensors["k"].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def wait(self) -> None:
        """Block until the device -> host copy is done (off the step loop only: the disk writer)."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None


def footprint(nbytes: int, pinned: bool) -> int:
    """Host bytes an allocation of ``nbytes`` holds: torch's pinned caching allocator rounds up to a power of two."""
    return 1 << max(nbytes - 1, 0).bit_length() if pinned else nbytes


def page_runs(pages: list[int]) -> list[tuple[int, int, int]]:
    """``(first page, count, index in the table)`` per run of consecutive page numbers."""
    runs: list[tuple[int, int, int]] = []
    for i, p in enumerate(pages):
        if runs and runs[-1][0] + runs[-1][1] == p:
            a, n, j = runs[-1]
            runs[-1] = (a, n + 1, j)
        else:
            runs.append((p, 1, i))
    return runs


class Copier:
    """The device <-> host copies of checkpoints, on their own CUDA stream (synchronous on CPU)."""

    def __init__(self, state: StatePool, kv: PagePool) -> None:
        self.state, self.kv = state, kv
        self.device = state.config.device
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None

    def _layout(self, num_pages: int) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype, int]], int]:
        """name -> (shape, dtype, byte offset) of a checkpoint's tensors in its one host buffer, and its bytes."""
        s, k = self.state.config, self.kv.config
        page = (k.num_layers, num_pages, k.page_size, k.num_kv_heads, k.head_dim)
        shapes = {"conv": ((s.num_layers, s.conv_rows, s.conv_dim), s.conv_dtype),
                  "ssm": ((s.num_layers, s.HV, s.V, s.K), s.ssm_dtype), "k": (page, k.dtype), "v": (page, k.dtype)}
        out, total = {}, 0
        for name, (shape, dt) in shapes.items():
            out[name] = (shape, dt, total)
            total += -(-math.prod(shape) * dt.itemsize // 64) * 64
        return out, total

    def empty(self, key: bytes, token_ids: tuple[int, ...], num_pages: int) -> HostCheckpoint:
        """Host tensors for a checkpoint of ``num_pages`` pages (pinned on CUDA), contents undefined. One allocation
        per checkpoint, the four tensors views into it: the pinned caching allocator rounds every allocation up to a
        power of two, so four would waste up to four roundings."""
        layout, total = self._layout(num_pages)
        buf = torch.empty(total, dtype=torch.uint8, pin_memory=self.cuda)
        tensors = {n: buf[o:o + math.prod(shape) * dt.itemsize].view(dt).view(shape)
                   for n, (shape, dt, o) in layout.items()}
        return HostCheckpoint(key, token_ids, tensors, footprint=footprint(total, self.cuda))

    def bytes_of(self, num_pages: int) -> int:
        """Host bytes a checkpoint of ``num_pages`` pages holds (its allocation, with the pinned rounding)."""
        return footprint(self._layout(num_pages)[1], self.cuda)

    def snapshot(self, key: bytes, token_ids: tuple[int, ...], slot: int, pages: list[int]) -> HostCheckpoint:
        """Device -> host copy of ``slot``'s state and ``pages`` (issued, not waited for on CUDA)."""
        hc = self.empty(key, token_ids, len(pages))
        self._copy(hc, slot, pages, to_host=True)
        return hc

    def restore(self, hc: HostCheckpoint, slot: int, pages: list[int]) -> object | None:
        """Host -> device copy of ``hc`` into ``slot`` and ``pages`` (as many as ``hc`` has); returns the copy's
        event (None on CPU: done)."""
        if len(pages) != hc.num_pages:
            raise ValueError(f"pages: the checkpoint holds {hc.num_pages} pages, got {len(pages)}")
        return self._copy(hc, slot, pages, to_host=False)

    def _copy(self, hc: HostCheckpoint, slot: int, pages: list[int], to_host: bool) -> object | None:
        st, kv, t = self.state, self.kv, hc.tensors
        pairs = []
        for layer in range(st.config.num_layers):
            pairs.append((t["conv"][layer], st.conv_pools[layer, slot]))
            pairs.append((t["ssm"][layer], st.ssm_pools[layer, slot]))
        for first, n, i in page_runs(pages):
            for layer in range(kv.config.num_layers):
                pairs.append((t["k"][layer, i:i + n], kv.k_pools[layer, first:first + n]))
                pairs.append((t["v"][layer, i:i + n], kv.v_pools[layer, first:first + n]))
        if not self.cuda:
            for host, dev in pairs:
                (host.copy_(dev) if to_host else dev.copy_(host))
            return None
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)      # after every kernel already queued that writes these rows
        with torch.cuda.stream(self.stream):
            for host, dev in pairs:
                (host.copy_(dev, non_blocking=True) if to_host else dev.copy_(host, non_blocking=True))
            event = torch.cuda.Event()
            event.record(self.stream)
        if to_host:
            hc.event = event
        # both ways the current stream waits for the copy: a freed slot and pages are rewritten only after the
        # copy down, and a restored checkpoint is read only after the copy up (so it is READY at once: the host
        # only keeps ``hc``'s pinned memory alive until the event)
        current.wait_event(event)
        return event
