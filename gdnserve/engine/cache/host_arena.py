"""The host checkpoint tier's memory: ONE host buffer of ``checkpoint_host_memory_gb`` allocated (and pinned, on
CUDA) when the tier is built, and a first-fit allocator of blocks in it.

Why one buffer: a fresh pinned allocation per spilled checkpoint (~128 MB for the full-size model) paid a
cudaHostAlloc inside the engine's step loop (the first turn of a multi-turn benchmark on the H200: TTFT p50
1,042 ms with the tier on), and torch's pinned caching allocator rounds every allocation up to a power of two
(up to 2x of the budget wasted). Here the buffer is an ordinary allocation of exactly ``nbytes`` registered with
``cudaHostRegister`` (no rounding); where registration fails, torch's pinned allocator (which rounds) instead.

Blocks: sizes rounded up to ``ALIGN`` (4 KiB: a page), first fit over a free list sorted by offset, a freed block
merged with its free neighbours. Thread-safe: the disk writer thread frees blocks it has finished reading.

Extents (``alloc_extents``): a checkpoint may be held in a short list of blocks instead of one. A chat's checkpoints
grow every turn, so the hole an evicted older one leaves is a few pages short for the next: with one contiguous
block per checkpoint an arena sized tightly was full and fragmented by turn 3 and a spill ahead (which evicts only
for bytes) found no hole (``benchmarks/bench_checkpoint_tiers.py --device cpu``: 59 of 274 spills ahead). One
block where one fits (first fit, as ``alloc``: the copies stay as few as before), else the largest holes, the last
piece from the smallest hole that covers the rest, at most ``max_extents`` blocks: any free bytes hold a
checkpoint, and moving pinned data to compact the arena (bandwidth) is never needed.
"""
from __future__ import annotations

import bisect
import logging
import threading
import time
import weakref
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

ALIGN = 4096


def block_size(nbytes: int) -> int:
    """Bytes a request of ``nbytes`` takes in an arena: rounded up to ``ALIGN``."""
    return -(-nbytes // ALIGN) * ALIGN


@dataclass(frozen=True, slots=True, eq=False)
class Block:
    """``size`` bytes at ``offset`` of an arena (identity matters: freeing a stale copy is refused)."""
    offset: int
    size: int


def _pinned_empty(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


PORTABLE = 1    # cudaHostRegisterPortable: pinned for every device's context, not only the current device's


def _register(buf: torch.Tensor) -> str | None:
    """Pin ``buf`` in place with cudaHostRegister; None on success, else why not."""
    try:
        cudart = torch.cuda.cudart()
        err = int(cudart.cudaHostRegister(buf.data_ptr(), buf.numel(), PORTABLE))
    except (RuntimeError, AssertionError, AttributeError) as e:      # no CUDA runtime, no binding
        return f"cudaHostRegister unavailable ({e})"
    if err != 0:
        _clear_cuda_error()
        return f"cudaHostRegister failed with cudaError {err}"
    return None


def _clear_cuda_error() -> None:
    """Reset the runtime's last error after a failed cudaHostRegister: torch checks ``cudaGetLastError`` after
    every kernel launch, so a stale error would fail the next kernel. Best effort: torch's own libcudart (a dlopen
    of the loaded soname returns the loaded instance); a static build's copy cannot be reached."""
    try:
        import ctypes
        ctypes.CDLL(f"libcudart.so.{torch.version.cuda.split('.')[0]}").cudaGetLastError()
    except Exception as e:  # noqa: BLE001  nothing more can be done
        logger.debug("checkpoint host arena: the CUDA error could not be cleared (%s)", e)


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.synchronize()    # no copy into or out of it still queued (an arena dropped without close())
    except Exception:  # noqa: BLE001  no CUDA context (or gone at exit): nothing can be in flight
        pass
    try:
        err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    except Exception as e:  # noqa: BLE001  at interpreter exit the runtime may be gone
        err = str(e)
    if err != 0:
        logger.warning("checkpoint host arena: cudaHostUnregister failed (%s)", err)


class HostArena:
    """One uint8 host tensor of ``nbytes`` (pinned when ``pinned``), carved into blocks: ``alloc`` / ``free`` /
    ``view``; ``capacity``, ``used`` and ``largest_free`` in bytes."""

    def __init__(self, nbytes: int, pinned: bool) -> None:
        if nbytes < ALIGN:
            raise ValueError(f"nbytes: {nbytes}, an arena holds at least one {ALIGN}-byte block")
        self.pinned, self.how = pinned, "pageable"
        t0 = time.perf_counter()
        self._buf = torch.empty(nbytes, dtype=torch.uint8)
        self._unpin = None
        if pinned:
            why = _register(self._buf)
            if why is None:
                self.how = "cudaHostRegister"
                # unregistered before the memory is freed, also when the arena is dropped without close()
                self._unpin = weakref.finalize(self, _unregister, self._buf.data_ptr())
            else:
                logger.warning("checkpoint host arena: %s; pinned by torch's allocator instead, which rounds the "
                               "%d bytes up to a power of two", why, nbytes)
                self._buf, self.how = _pinned_empty(nbytes), "torch pinned allocator"
        self.seconds = time.perf_counter() - t0
        self.capacity = nbytes // ALIGN * ALIGN
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, self.capacity)]    # (offset, size), sorted by offset, disjoint
        self._live: dict[int, Block] = {}                            # offset -> the block allocated there
        self._used = 0
        self.closed = False

    @property
    def used(self) -> int:
        return self._used

    @property
    def largest_free(self) -> int:
        with self._lock:
            return max((size for _, size in self._free), default=0)

    def alloc(self, nbytes: int) -> Block | None:
        """A block of ``block_size(nbytes)`` bytes at the lowest offset where it fits; None when none does."""
        blocks = self._alloc(nbytes, 1, "alloc")
        return blocks[0] if blocks else None

    def alloc_extents(self, nbytes: int, max_extents: int) -> list[Block] | None:
        """Blocks of ``block_size(nbytes)`` bytes in all, sorted by offset: one at the lowest offset where it fits,
        else the largest free holes and the smallest hole that covers the rest (at most ``max_extents`` blocks);
        None when the free bytes, or ``max_extents`` holes, do not hold it."""
        return self._alloc(nbytes, max_extents, "alloc_extents")

    def _alloc(self, nbytes: int, max_extents: int, who: str) -> list[Block] | None:
        if nbytes <= 0:
            raise ValueError(f"nbytes: {nbytes}, must be > 0")
        need = block_size(nbytes)
        with self._lock:
            if self.closed:
                raise RuntimeError(f"HostArena.{who}: the arena is closed")
            if self.capacity - self._used < need:
                return None
            first = next((i for i, (_, size) in enumerate(self._free) if size >= need), None)
            if first is not None:
                return [self._take(first, need)]
            by_size = sorted(range(len(self._free)), key=lambda i: -self._free[i][1])
            picks, rest = [], need
            for i in by_size:
                if len(picks) == max_extents - 1:
                    break
                picks.append((i, self._free[i][1]))
                rest -= self._free[i][1]
                taken = {p for p, _ in picks}
                tail = [j for j in by_size if j not in taken and self._free[j][1] >= rest]
                if tail:            # the smallest hole that covers the rest (keeps the large ones whole)
                    picks.append((min(tail, key=lambda j: self._free[j][1]), rest))
                    break
            else:
                return None
            if sum(n for _, n in picks) != need:      # max_extents - 1 holes taken, none covers the rest
                return None
            # carve from the highest index down: a hole taken whole leaves the list, shifting those after it
            blocks = [self._take(i, n) for i, n in sorted(picks, reverse=True)]
            return sorted(blocks, key=lambda b: b.offset)

    def _take(self, i: int, need: int) -> Block:
        """``need`` bytes from the start of free hole ``i`` (under the lock)."""
        off, size = self._free[i]
        if size == need:
            del self._free[i]
        else:
            self._free[i] = (off + need, size - need)
        block = Block(off, need)
        self._live[off] = block
        self._used += need
        return block

    def free(self, block: Block) -> None:
        """Give ``block`` back, merged with the free space on either side. A block not allocated here (or freed
        already) is refused: freeing it would hand the same bytes to two checkpoints."""
        with self._lock:
            if self._live.get(block.offset) is not block:
                raise ValueError(f"block at offset {block.offset} ({block.size} bytes): not allocated from this "
                                 f"arena, or freed twice")
            del self._live[block.offset]
            self._used -= block.size
            off, size = block.offset, block.size
            i = bisect.bisect_left(self._free, (off, 0))
            if i < len(self._free) and off + size == self._free[i][0]:        # the next free run
                size += self._free.pop(i)[1]
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:  # the previous one
                off, size = self._free[i - 1][0], self._free[i - 1][1] + size
                i -= 1
                self._free[i] = (off, size)
            else:
                self._free.insert(i, (off, size))

    def view(self, block: Block) -> torch.Tensor:
        """The block's bytes: a uint8 view of the arena's buffer."""
        return self._buf[block.offset:block.offset + block.size]

    def close(self) -> None:
        """Unpin and drop the buffer (idempotent; every copy into or out of it must be complete). Blocks still
        held stay readable (views keep the memory) but no longer pinned; ``alloc`` is refused."""
        with self._lock:
            self.closed = True
        if self._unpin is not None:
            self._unpin()
        self._buf = torch.empty(0, dtype=torch.uint8)
