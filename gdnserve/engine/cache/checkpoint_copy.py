"""Copies of one checkpoint between the device pools and host memory: every GDN layer's state of its slot, the
slot's row of every per-slot tensor registered with the state pool, and its prefix's attention KV pages, as a
:class:`HostCheckpoint`. This module is the one place that says what a checkpoint holds (``Copier.names``,
``Copier.layout``): the disk tier writes and checks what it is given, the fingerprint names the registered rows.

Layout on the host: ``conv [L, W-1, D]``, ``ssm [L, HV, V, K]`` (the slot's row of every layer of the state pool),
one ``[1, ...]`` per registered row tensor (``StatePool.register_rows``: with ``spec_draft="mtp"`` the MTP
drafter's ``mtp_hidden [1, hidden]``, the hidden after the checkpoint's last token, which a consumer's first MTP
pair reads: without it a restored checkpoint drafts from the new slot's stale row), ``k, v [La, n, page_size, KVH,
Dh]`` (the table's ``n`` pages of every attention layer, in table order, the MTP head's KV layer included), in one
host buffer (pinned on CUDA), each tensor 64-byte aligned in it.

The copies go through staging buffers on the device (``STAGE_BYTES``, 128 MiB per direction, each allocated at
its direction's first copy; the memory plan counts both when a tier is on: memory_budget.py): a checkpoint is cut
into a few pieces (a range of layers of one tensor, or a range of pages of one attention layer where one layer's
pages do not fit), packed into the staging buffer, and each piece crosses PCIe as ONE transfer. Gathering the
slot's rows and the scattered pages happens on the device (``copy_`` of the strided rows, ``index_select`` /
``index_copy_`` of the pages). The first version copied per layer and per run of consecutive pages: for a
1,343-token checkpoint of the full-size model that was ~1,700 transfers of ~16 KB, which moved 92 MB at 1-22 GB/s
on the H200 (f0112af:benchmarks/results/checkpoint_tier_h200.md, code of a2f5a26): slower than recomputing.

Two CUDA streams, one per direction (PCIe is full duplex), each with its own staging buffer: a restore never
queues behind a spill's transfers (on one stream the H200 hit at 6,448 tokens waited 4.7 ms for the spill that
freed its slot). The exact scheme (docs/architecture.md "Checkpoint tiers"), each copy after
``stream.wait_stream(current)`` (it reads what the steps already queued wrote, and writes after what they read):

- device -> host (``copy_down`` on ``down``, ``snapshot``: a GPU eviction or a spill ahead): per batch of pieces
  that fits the staging buffer, gather them all, then issue their transfers down (the staging buffer is reused
  in stream order). ``hc.gathered`` marks the last gathers: a slot and pages may be written again only after it.
  An eviction (``free=True``) makes the current stream wait on it at once, so the slot and pages go back to the
  free lists now and any later kernel that could write them (or a restore: its stream waits on the current one)
  is ordered after the gather, while the transfers run on behind the steps; a spill ahead (``free=False``) does
  not (the slot stays READY, never written) and ``freeing(hc)`` orders the current stream when the slot is
  freed later. ``hc.event`` marks the last transfer: readers of the host copy wait on it (a restore's stream,
  the disk writer). A copy down into an arena block waits on the copies up still queued that read those bytes
  (a block goes back to the arena once its restore is queued: ``_reads``).
- host -> device (``restore`` on ``up``, a lookup that found the key below): after ``hc.event`` (its copy down
  may still be in flight), per batch the transfers up, then the scatters into the freshly allocated slot and
  pages; the current stream waits on the copy's event, so the restored checkpoint is READY at once (no kernel
  that reads it runs earlier).

On CPU the copies are synchronous (events None) and the host tensors are ordinary memory.

Host memory (``empty``): with an arena (host_arena.py, the host tier's one buffer pinned at start-up) a checkpoint's
buffer is a block of it, None when it has no room: no allocation in the step loop. Where no one hole holds it (a
chat's checkpoints grow each turn: the holes older ones leave are a few pages short) the buffer is cut across up to
``MAX_EXTENTS`` blocks (``HostArena.alloc_extents``), its bytes laid end to end (``HostCheckpoint.spans``); the
pieces are the same, and a piece that crosses an extent boundary crosses PCIe as one transfer per extent
(``_segments``; the staging batches unchanged), so a checkpoint in one block is copied exactly as before. Without
one (a Copier of its own, ``snapshot``, the shutdown flush) a fresh allocation, pinned on CUDA.
``HostCheckpoint.release`` gives the block back, once, when no CPU thread reads it any more: GPU copies into a
reused block are ordered after the earlier GPU copies out of it (one stream down, ``_reads`` against the stream up);
threads that read the tensors (the disk writer) release it when they are done (the release rules:
checkpoint_tiers.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from gdnserve.engine.cache.host_arena import Block, HostArena, block_size
from gdnserve.engine.cache.page_pool import PagePool
from gdnserve.engine.cache.state_pool import StatePool

TENSORS = ("conv", "ssm", "k", "v")        # every checkpoint's; the registered rows go between ssm and k
PAGED = ("k", "v")
STAGE_BYTES = 128 * 2**20       # the device staging buffer of each direction of the copies (CUDA only)
MAX_EXTENTS = 8                 # arena blocks one checkpoint may take (host_arena.py ``alloc_extents``)


@dataclass(slots=True, eq=False)
class HostCheckpoint:
    """One checkpoint off the device. ``length``: tokens it covers (= its page table's positions);
    ``tensors``: name -> host tensor (module docstring; for a checkpoint held in several arena extents, tensors on
    the ``meta`` device that only say the shapes and dtypes: its bytes are ``spans``, read them with
    ``host_tensors``); ``event``: the device -> host copy (None: complete); ``gathered``: its last gathers on the
    device (None: complete, or the current stream already waits on it); ``blocks``: its buffer's blocks of ``arena``
    (empty: a plain allocation, or released); ``spans``: with more than one block, their views in order, which
    hold the checkpoint's one buffer (``Copier._layout``) end to end."""
    key: bytes
    token_ids: tuple[int, ...]
    tensors: dict[str, torch.Tensor]
    event: object | None = None
    footprint: int = field(default=0)     # host bytes it holds (its blocks, or its allocation as the allocator rounds)
    blocks: tuple[Block, ...] = ()
    arena: HostArena | None = None
    gathered: object | None = None
    spans: tuple[torch.Tensor, ...] = ()
    offsets: dict[str, int] = field(default_factory=dict)   # with spans: name -> byte offset in the buffer

    @property
    def block(self) -> Block | None:
        """Its one block (None: a plain allocation, released, or held in several extents: ``blocks``)."""
        return self.blocks[0] if len(self.blocks) == 1 else None

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def num_pages(self) -> int:
        return self.tensors["k"].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def read(self, start: int, end: int) -> list[tuple[int, int, torch.Tensor]]:
        """Bytes ``[start, end)`` of the buffer (with ``spans``) as (from, to, uint8 host view) per span crossed,
        ``from``/``to`` relative to ``start``."""
        out, base = [], 0
        for span in self.spans:
            n = span.numel()
            a, b = max(start, base), min(end, base + n)
            if a < b:
                out.append((a - start, b - start, span[a - base:b - base]))
            base += n
            if base >= end:
                break
        return out

    def host_tensors(self) -> dict[str, torch.Tensor]:
        """name -> host tensor with the checkpoint's values: ``tensors`` itself, or (several extents) each tensor
        put together from its spans (a copy; the disk writer's, tests')."""
        if not self.spans:
            return self.tensors
        out = {}
        for name, meta in self.tensors.items():
            n = meta.numel() * meta.element_size()
            flat = torch.empty(n, dtype=torch.uint8)
            for a, b, view in self.read(self.offsets[name], self.offsets[name] + n):
                flat[a:b].copy_(view)
            out[name] = flat.view(meta.dtype).view(meta.shape)
        return out

    def copied(self) -> bool:
        """Whether the device -> host copy is done (a non-blocking query)."""
        return self.event is None or self.event.query()

    def wait(self) -> None:
        """Block until the device -> host copy is done (off the step loop only: the disk writer)."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None

    def release(self) -> None:
        """Give the arena blocks back (once; nothing for a plain allocation). Only when nothing will read or write
        the tensors any more: the next checkpoint copied down may take the blocks."""
        blocks, self.blocks = self.blocks, ()
        for block in blocks:
            self.arena.free(block)


def footprint(nbytes: int, pinned: bool) -> int:
    """Host bytes an allocation of ``nbytes`` holds: torch's pinned caching allocator rounds up to a power of two."""
    return 1 << max(nbytes - 1, 0).bit_length() if pinned else nbytes


@dataclass(frozen=True, slots=True)
class Piece:
    """One transfer: layers ``[l0, l1)`` of tensor ``name``, and for ``k`` / ``v`` the table's pages ``[i0, i1)``
    (all of them unless one layer's pages do not fit the staging buffer). Contiguous in the host buffer."""
    name: str
    l0: int
    l1: int
    i0: int = 0
    i1: int = 0


def pieces(layer_bytes: dict[str, int], num_layers: dict[str, int], num_pages: int, page_bytes: int,
           stage: int) -> list[Piece]:
    """The checkpoint cut into pieces of at most ``stage`` bytes: whole layers where they fit, else (attention
    KV of a long prefix) runs of pages of one layer."""
    out: list[Piece] = []
    for name, per in layer_bytes.items():
        L = num_layers[name]
        if per == 0 or L == 0:
            continue
        paged = name in PAGED
        if per <= stage:
            step = min(stage // per, L)
            out += [Piece(name, a, min(a + step, L), 0, num_pages if paged else 0) for a in range(0, L, step)]
        elif paged and page_bytes <= stage:
            step = min(stage // page_bytes, num_pages)
            out += [Piece(name, layer, layer + 1, i, min(i + step, num_pages))
                    for layer in range(L) for i in range(0, num_pages, step)]
        else:
            raise ValueError(f"stage_bytes: {stage} bytes hold no layer of {name!r} ({per} bytes)")
    return out


class Copier:
    """The device <-> host copies of checkpoints, on two CUDA streams, ``down`` (device -> host) and ``up`` (host ->
    device; synchronous on CPU), each through its own device staging buffer of ``stage_bytes`` (CUDA default
    ``STAGE_BYTES``; on CPU none unless given, which tests use to run the piece logic). ``arena``: the host tier's
    memory, which ``empty`` carves checkpoints from."""

    def __init__(self, state: StatePool, kv: PagePool, stage_bytes: int | None = None,
                 arena: HostArena | None = None) -> None:
        self.state, self.kv, self.arena = state, kv, arena
        self.device = state.config.device
        self.cuda = self.device.type == "cuda"
        self.down = torch.cuda.Stream(self.device) if self.cuda else None
        self.up = torch.cuda.Stream(self.device) if self.cuda else None
        self.stage_bytes = stage_bytes if stage_bytes is not None else (STAGE_BYTES if self.cuda else 0)
        self._stage: dict[bool, torch.Tensor] = {}     # to_host -> that direction's staging buffer
        self._reads: list[tuple[int, int, object]] = []  # (start, end, event): arena bytes a queued copy up reads

    def synchronize(self) -> None:
        """Wait for every copy queued in either direction (shutdown, off the step loop)."""
        for s in (self.down, self.up):
            if s is not None:
                s.synchronize()

    @property
    def names(self) -> tuple[str, ...]:
        """A checkpoint's tensors, in their order in the host buffer and in a file."""
        return ("conv", "ssm", *self.state.slot_rows, "k", "v")

    def layout(self, num_pages: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (shape, dtype) of the host tensors of a checkpoint of ``num_pages`` pages."""
        s, k = self.state.config, self.kv.config
        page = (k.num_layers, num_pages, k.page_size, k.num_kv_heads, k.head_dim)
        rows = {n: ((1, *t.shape[1:]), t.dtype) for n, t in self.state.slot_rows.items()}
        return {"conv": ((s.num_layers, s.conv_rows, s.conv_dim), s.conv_dtype),
                "ssm": ((s.num_layers, s.HV, s.V, s.K), s.ssm_dtype), **rows, "k": (page, k.dtype),
                "v": (page, k.dtype)}

    def fits(self, hc: HostCheckpoint) -> bool:
        """``hc`` holds exactly this copier's tensors (names, shapes, dtypes) for its page count: a copy taken
        before a tensor was registered, or a file of another layout, is never restored."""
        t = hc.tensors
        want = self.layout(t["k"].shape[1]) if "k" in t else None
        return want is not None and {n: (tuple(x.shape), x.dtype) for n, x in t.items()} == want

    def _layout(self, num_pages: int) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype, int]], int]:
        """name -> (shape, dtype, byte offset) of a checkpoint's tensors in its one host buffer, and its bytes."""
        out, total = {}, 0
        for name, (shape, dt) in self.layout(num_pages).items():
            out[name] = (shape, dt, total)
            total += -(-math.prod(shape) * dt.itemsize // 64) * 64
        return out, total

    def empty(self, key: bytes, token_ids: tuple[int, ...], num_pages: int, pooled: bool = True
              ) -> HostCheckpoint | None:
        """Host tensors for a checkpoint of ``num_pages`` pages, contents undefined, views into one buffer: blocks
        of the arena (``pooled`` and an arena given; None when it has no room; one block where a hole fits it, else
        up to ``MAX_EXTENTS``, its buffer cut across them: ``spans``), else a fresh allocation (pinned on CUDA; one
        per checkpoint, not four: the pinned caching allocator rounds each up to a power of two)."""
        layout, total = self._layout(num_pages)
        blocks: list[Block] = []
        if pooled and self.arena is not None:
            blocks = self.arena.alloc_extents(total, MAX_EXTENTS)
            if blocks is None:
                return None
            held = sum(b.size for b in blocks)
            if len(blocks) > 1:     # no one buffer to view: the tensors say shapes, the spans hold the bytes
                tensors = {n: torch.empty(shape, dtype=dt, device="meta") for n, (shape, dt, _) in layout.items()}
                return HostCheckpoint(key, token_ids, tensors, footprint=held, blocks=tuple(blocks), arena=self.arena,
                                      spans=tuple(self.arena.view(b) for b in blocks),
                                      offsets={n: o for n, (_, _, o) in layout.items()})
            buf = self.arena.view(blocks[0])
        else:
            buf, held = torch.empty(total, dtype=torch.uint8, pin_memory=self.cuda), footprint(total, self.cuda)
        tensors = {n: buf[o:o + math.prod(shape) * dt.itemsize].view(dt).view(shape)
                   for n, (shape, dt, o) in layout.items()}
        return HostCheckpoint(key, token_ids, tensors, footprint=held, blocks=tuple(blocks),
                              arena=self.arena if blocks else None)

    def layout_bytes(self, num_pages: int) -> int:
        """Bytes of the one buffer of a checkpoint of ``num_pages`` pages (its tensors, each 64-byte aligned)."""
        return self._layout(num_pages)[1]

    def bytes_of(self, num_pages: int) -> int:
        """Host bytes a checkpoint of ``num_pages`` pages holds: its arena block (4 KiB rounded) with an arena, else
        its allocation (with the pinned rounding)."""
        total = self.layout_bytes(num_pages)
        return block_size(total) if self.arena is not None else footprint(total, self.cuda)

    def snapshot(self, key: bytes, token_ids: tuple[int, ...], slot: int, pages: list[int]) -> HostCheckpoint:
        """Device -> host copy of ``slot``'s state (its registered rows included) and ``pages`` into a fresh
        allocation (issued, not waited for on CUDA)."""
        hc = self.empty(key, token_ids, len(pages), pooled=False)
        self.copy_down(hc, slot, pages)
        return hc

    def copy_down(self, hc: HostCheckpoint, slot: int, pages: list[int], free: bool = True) -> None:
        """Device -> host copy of ``slot``'s state and ``pages`` into ``hc`` (from ``empty``; issued, not waited
        for on CUDA: ``hc.event``). ``free``: the slot and pages are freed now (an eviction): the current stream
        waits for the gathers at once; False (a spill ahead, the slot stays READY): ``freeing`` when it is freed."""
        if len(pages) != hc.num_pages:
            raise ValueError(f"pages: the checkpoint holds {hc.num_pages} pages, got {len(pages)}")
        self._copy(hc, slot, pages, to_host=True)
        if free:
            self.freeing(hc)

    def freeing(self, hc: HostCheckpoint) -> None:
        """The slot and pages ``hc`` was copied from are about to be freed: every kernel queued from now on on the
        current stream (and every copy up: its stream waits on the current one) runs after the copy's gathers."""
        if hc.gathered is not None:
            torch.cuda.current_stream(self.device).wait_event(hc.gathered)
            hc.gathered = None

    def restore(self, hc: HostCheckpoint, slot: int, pages: list[int]) -> object | None:
        """Host -> device copy of ``hc`` into ``slot`` and ``pages`` (as many as ``hc`` has); returns the copy's
        event (None on CPU: done). ValueError when ``hc`` is not of this copier's layout (``fits``)."""
        if len(pages) != hc.num_pages:
            raise ValueError(f"pages: the checkpoint holds {hc.num_pages} pages, got {len(pages)}")
        if not self.fits(hc):
            raise ValueError(f"tensors: the checkpoint holds {list(hc.tensors)}, this layout is {list(self.names)}")
        return self._copy(hc, slot, pages, to_host=False)

    # ---------------------------------------------------------------- the pieces
    def _pieces(self, hc: HostCheckpoint) -> list[Piece]:
        t = hc.tensors
        per = {n: x[0].numel() * x.element_size() if x.shape[0] else 0 for n, x in t.items()}
        layers = {n: x.shape[0] for n, x in t.items()}
        page_bytes = t["k"][0, :1].numel() * t["k"].element_size() if t["k"].shape[0] else 0
        return pieces(per, layers, hc.num_pages, page_bytes, self.stage_bytes or 1 << 62)   # no stage: whole tensors

    def _host(self, hc: HostCheckpoint, p: Piece) -> torch.Tensor:
        """Piece ``p``'s host tensor (a ``meta`` one, shape and dtype only, for a checkpoint in spans)."""
        t = hc.tensors[p.name][p.l0:p.l1]
        return t if p.name not in PAGED or (p.i0 == 0 and p.i1 == hc.num_pages) else t[:, p.i0:p.i1]

    def _segments(self, hc: HostCheckpoint, p: Piece) -> list[tuple[int, int, torch.Tensor]]:
        """Piece ``p``'s host bytes as (from, to, uint8 host view), from / to relative to the piece: one segment,
        or one per arena extent the piece crosses (a checkpoint in spans). Each is one transfer."""
        host = self._host(hc, p)
        n = host.numel() * host.element_size()
        if not n:
            return []
        if not hc.spans:
            return [(0, n, host.view(-1).view(torch.uint8))]     # (a view: pieces are contiguous)
        start = hc.offsets[p.name] + host.storage_offset() * host.element_size()
        return hc.read(start, start + n)

    def _device(self, p: Piece, slot: int, idx: torch.Tensor):
        """(read, write) of piece ``p`` on the device (``idx``: the checkpoint's pages, on the device): ``read(out)``
        gathers it into ``out``, ``write(src)`` scatters ``src`` into the pools."""
        st, kv = self.state, self.kv
        if p.name not in PAGED:         # the slot's row of each layer: [L, ...] (a registered tensor: L = 1)
            if p.name in ("conv", "ssm"):
                rows = (st.conv_pools if p.name == "conv" else st.ssm_pools)[p.l0:p.l1, slot]
            else:
                rows = st.slot_rows[p.name][slot:slot + 1][p.l0:p.l1]
            return (lambda out: out.copy_(rows)), (lambda src: rows.copy_(src))
        pool = (kv.k_pools if p.name == "k" else kv.v_pools)[p.l0:p.l1]
        run = idx[p.i0:p.i1]
        return ((lambda out: torch.index_select(pool, 1, run, out=out)),
                (lambda src: pool.index_copy_(1, run, src)))

    def _page_index(self, pages: list[int]) -> torch.Tensor:
        idx = torch.tensor(pages, dtype=torch.long)
        if not self.cuda:
            return idx
        # pinned + non_blocking: no host wait (the pinned allocator keeps the block until the copy's event)
        return idx.pin_memory().to(self.device, non_blocking=True)

    def _batches(self, items: list[Piece], hc: HostCheckpoint, to_host: bool
                 ) -> list[list[tuple[Piece, torch.Tensor]]]:
        """Pieces packed into the staging buffer of the direction: batches of (piece, its staging view)."""
        stage = self._stage.get(to_host)
        if stage is None:
            stage = self._stage[to_host] = torch.empty(self.stage_bytes, dtype=torch.uint8, device=self.device)
        out: list[list[tuple[Piece, torch.Tensor]]] = [[]]
        off = 0
        for p in items:
            host = self._host(hc, p)
            n = host.numel() * host.element_size()
            if off + n > self.stage_bytes:
                out.append([])
                off = 0
            view = stage[off:off + n].view(host.dtype).view(host.shape)
            out[-1].append((p, view))
            off += -(-n // 256) * 256
        return out

    def _fence(self, stream, hc: HostCheckpoint, to_host: bool) -> None:
        """Cross-stream dependencies of a copy (CUDA), on its ``stream`` before it is issued: a copy up reads
        ``hc`` only after its copy down wrote it; a copy down into an arena block only after the copies up still
        queued that read those bytes (their blocks went back to the arena once queued)."""
        self._reads = [r for r in self._reads if not r[2].query()]      # (non-blocking queries)
        if not to_host:
            if hc.event is not None:
                stream.wait_event(hc.event)
        else:
            for block in hc.blocks:
                a, b = block.offset, block.offset + block.size
                for start, end, event in self._reads:
                    if start < b and a < end:
                        stream.wait_event(event)

    def _copy(self, hc: HostCheckpoint, slot: int, pages: list[int], to_host: bool) -> object | None:
        if not self.stage_bytes:            # CPU: gather / scatter straight into / out of the host tensors
            idx = self._page_index(pages)
            for p in self._pieces(hc):
                read, write = self._device(p, slot, idx)
                host, segs = self._host(hc, p), self._segments(hc, p)
                if not hc.spans:
                    read(host) if to_host else write(host)
                    continue
                tmp = torch.empty(host.shape, dtype=host.dtype)     # a piece across extents (CPU only)
                raw = tmp.reshape(-1).view(torch.uint8)
                if to_host:
                    read(tmp)
                    for a, b, view in segs:
                        view.copy_(raw[a:b])
                else:
                    for a, b, view in segs:
                        raw[a:b].copy_(view)
                    write(tmp)
            return None
        items = self._pieces(hc)
        if not self.cuda:                   # CPU with a staging buffer (tests): the same batches, synchronous
            idx = self._page_index(pages)
            for batch in self._batches(items, hc, to_host):
                self._run_batch(hc, batch, slot, idx, to_host)
            return None
        current = torch.cuda.current_stream(self.device)
        stream = self.down if to_host else self.up
        stream.wait_stream(current)         # after every kernel already queued that reads or writes these rows
        self._fence(stream, hc, to_host)
        with torch.cuda.stream(stream):
            idx = self._page_index(pages)
            gathered = None
            for batch in self._batches(items, hc, to_host):
                gathered = self._run_batch(hc, batch, slot, idx, to_host)
            event = torch.cuda.Event()
            event.record(stream)
        if to_host:
            hc.event, hc.gathered = event, gathered or event    # the caller orders the current stream (freeing)
        else:
            current.wait_event(event)       # the restored rows are read only after the scatter
            for block in hc.blocks:         # its blocks may go back to the arena now: a copy down into them waits
                self._reads.append((block.offset, block.offset + block.size, event))
        return event

    def _run_batch(self, hc: HostCheckpoint, batch: list[tuple[Piece, torch.Tensor]], slot: int, idx: torch.Tensor,
                   to_host: bool) -> object | None:
        """One staging batch: gathers then transfers down, or transfers up then scatters. Returns (CUDA, down)
        the event after the gathers."""
        nb = self.cuda
        if to_host:
            for p, view in batch:
                self._device(p, slot, idx)[0](view)
            gathered = None
            if self.cuda:
                gathered = torch.cuda.Event()
                gathered.record(self.down)
            for p, view in batch:
                raw = view.view(-1).view(torch.uint8)
                for a, b, host in self._segments(hc, p):
                    host.copy_(raw[a:b], non_blocking=nb)
            return gathered
        for p, view in batch:
            raw = view.view(-1).view(torch.uint8)
            for a, b, host in self._segments(hc, p):
                raw[a:b].copy_(host, non_blocking=nb)
        for p, view in batch:
            self._device(p, slot, idx)[1](view)
        return None
