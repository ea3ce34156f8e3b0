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

from dataclasses import dataclass, field

import torch

from gdnserve.engine.page_pool import PagePool
from gdnserve.engine.state_pool import StatePool

TENSORS = ("conv", "ssm", "k", "v")


@dataclass(slots=True, eq=False)
class HostCheckpoint:
    """One checkpoint off the device. ``length``: tokens it covers (= its page table's positions);
    ``tensors``: name -> host tensor (module docstring); ``event``: the device -> host copy (None: complete)."""
    key: bytes
    token_ids: tuple[int, ...]
    tensors: dict[str, torch.Tensor]
    event: object | None = None
    last_use: int = field(default=0)

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

    def empty(self, key: bytes, token_ids: tuple[int, ...], num_pages: int) -> HostCheckpoint:
        """Host tensors for a checkpoint of ``num_pages`` pages (pinned on CUDA), contents undefined."""
        s, k = self.state.config, self.kv.config
        pin = self.cuda
        shapes = {"conv": ((s.num_layers, s.conv_rows, s.conv_dim), s.conv_dtype),
                  "ssm": ((s.num_layers, s.HV, s.V, s.K), s.ssm_dtype),
                  "k": ((k.num_layers, num_pages, k.page_size, k.num_kv_heads, k.head_dim), k.dtype),
                  "v": ((k.num_layers, num_pages, k.page_size, k.num_kv_heads, k.head_dim), k.dtype)}
        return HostCheckpoint(key, token_ids, {n: torch.empty(shape, dtype=dt, pin_memory=pin)
                                               for n, (shape, dt) in shapes.items()})

    def bytes_of(self, num_pages: int) -> int:
        """Host bytes of a checkpoint of ``num_pages`` pages."""
        return self.state.bytes_per_slot + num_pages * self.kv.bytes_per_page

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
            current.wait_event(event)         # the freed slot and pages are rewritten only after the copy
        return event
