"""HostArena (engine/cache/host_arena.py), the host checkpoint tier's one buffer: first-fit blocks of 4 KiB
multiples, freed blocks merged with their neighbours, double frees refused, exhaustion answered with None, random
alloc / free sequences against a page bitmap (the reference: which pages are taken), the pinning path (registered in
place, or torch's pinned allocator when registration fails) and threads freeing while another allocates. Extents
(``alloc_extents``): a growing checkpoint held by holes none of which fits it, one block where one does, the cap
and the free bytes respected, random sequences against the bitmap."""
from __future__ import annotations

import logging
import random
import threading
from types import SimpleNamespace

import pytest
import torch

from gdnserve.engine.cache import host_arena
from gdnserve.engine.cache.host_arena import ALIGN, Block, HostArena, block_size

P = ALIGN


def test_sizes_round_up_to_pages_and_blocks_are_views_of_one_buffer():
    a = HostArena(10 * P + 123, pinned=False)             # the tail beyond whole pages is never handed out
    assert a.capacity == 10 * P and a.used == 0 and a.largest_free == 10 * P
    assert block_size(1) == P and block_size(P) == P and block_size(P + 1) == 2 * P
    b1, b2 = a.alloc(1), a.alloc(P + 1)
    assert (b1.offset, b1.size, b2.offset, b2.size) == (0, P, P, 2 * P)
    assert a.used == 3 * P and a.largest_free == 7 * P
    v1, v2 = a.view(b1), a.view(b2)
    assert v1.dtype == torch.uint8 and v1.numel() == P and v2.numel() == 2 * P
    assert v2.data_ptr() - v1.data_ptr() == P                 # one buffer, in place
    v1.fill_(7)
    v2.fill_(9)
    assert int(a.view(b1).sum()) == 7 * P and int(a.view(b2)[0]) == 9
    with pytest.raises(ValueError, match="nbytes"):
        a.alloc(0)
    with pytest.raises(ValueError, match="nbytes"):
        HostArena(P - 1, pinned=False)


def test_first_fit_takes_the_lowest_hole_that_fits():
    a = HostArena(10 * P, pinned=False)
    b = [a.alloc(P), a.alloc(2 * P), a.alloc(P), a.alloc(3 * P), a.alloc(P)]   # 0, 1-2, 3, 4-6, 7; 8-9 free
    a.free(b[1])                                              # hole of 2 at 1
    a.free(b[3])                                              # hole of 3 at 4
    got = a.alloc(3 * P)
    assert got.offset == 4 * P                                # the first hole too small: the second
    assert a.alloc(P).offset == P                             # the first hole that fits
    assert a.alloc(2 * P).offset == 8 * P and a.alloc(P).offset == 2 * P
    assert a.used == a.capacity and a.largest_free == 0 and a.alloc(1) is None    # exhausted: None, nothing held


def test_free_merges_with_both_neighbours():
    a = HostArena(6 * P, pinned=False)
    b = [a.alloc(P) for _ in range(6)]
    a.free(b[1])
    a.free(b[3])
    assert a.largest_free == P and a.alloc(2 * P) is None     # 2 pages free, not adjacent
    a.free(b[2])                                              # joins 1 and 3: a run of 3
    assert a.largest_free == 3 * P
    a.free(b[0])
    a.free(b[5])
    a.free(b[4])
    assert a.used == 0 and a.largest_free == 6 * P and a.alloc(6 * P).offset == 0


def test_a_double_free_or_a_foreign_block_is_refused():
    a = HostArena(4 * P, pinned=False)
    b = a.alloc(P)
    a.free(b)
    with pytest.raises(ValueError, match="freed twice"):
        a.free(b)
    again = a.alloc(P)                                        # the same offset and size, another block
    assert again.offset == b.offset
    with pytest.raises(ValueError, match="freed twice"):
        a.free(b)                                             # the stale block cannot free its successor
    with pytest.raises(ValueError, match="not allocated"):
        a.free(Block(again.offset, again.size))
    assert a.used == P
    a.free(again)
    assert a.used == 0


@pytest.mark.parametrize("seed", range(6))
def test_random_sequences_match_a_page_bitmap(seed):
    rng = random.Random(seed)
    pages = rng.randint(8, 64)
    a = HostArena(pages * P + rng.randrange(P), pinned=False)
    taken = [False] * pages                                   # the reference
    live: list[Block] = []

    def first_fit(n: int) -> int | None:
        run = 0
        for i, t in enumerate(taken):
            run = 0 if t else run + 1
            if run == n:
                return i - n + 1
        return None

    for _ in range(400):
        if live and rng.random() < 0.45:
            b = live.pop(rng.randrange(len(live)))
            a.free(b)
            for p in range(b.offset // P, (b.offset + b.size) // P):
                taken[p] = False
        else:
            nbytes = rng.randint(1, 6 * P)
            want = first_fit(block_size(nbytes) // P)
            b = a.alloc(nbytes)
            if want is None:
                assert b is None
                continue
            assert b is not None and b.offset == want * P and b.size == block_size(nbytes)
            for p in range(want, want + b.size // P):
                assert not taken[p]
                taken[p] = True
            live.append(b)
        assert a.used == sum(taken) * P
        longest = run = 0
        for t in taken:
            run = 0 if t else run + 1
            longest = max(longest, run)
        assert a.largest_free == longest * P


def test_extents_hold_a_growing_checkpoint_where_no_one_hole_does():
    """A chat's checkpoints grow each turn: the holes the older ones leave are each a page short. ``alloc`` finds
    none; ``alloc_extents`` takes the largest hole and the smallest that covers the rest, sorted by offset."""
    a = HostArena(12 * P, pinned=False)
    b = [a.alloc(3 * P), a.alloc(P), a.alloc(2 * P), a.alloc(P), a.alloc(4 * P), a.alloc(P)]   # 0-2 3 4-5 6 7-10 11
    for i in (0, 2, 4):
        a.free(b[i])                                          # holes of 3 at 0, 2 at 4, 4 at 7
    assert a.alloc(5 * P) is None and a.largest_free == 4 * P
    got = a.alloc_extents(5 * P, 8)
    assert [(x.offset, x.size) for x in got] == [(4 * P, P), (7 * P, 4 * P)]   # the hole of 2 covers the rest
    assert a.used == a.capacity - 4 * P and a.largest_free == 3 * P          # the hole of 3 stays whole
    for x in got:
        a.free(x)
    assert a.used == 3 * P and a.largest_free == 4 * P


def test_extents_prefer_one_block_and_respect_the_cap_and_the_free_bytes():
    a = HostArena(8 * P, pinned=False)
    one = a.alloc_extents(3 * P, 8)
    assert len(one) == 1 and (one[0].offset, one[0].size) == (0, 3 * P)       # a hole fits: one block, first fit
    b = [a.alloc(P) for _ in range(5)]                       # 3..7
    a.free(b[0])
    a.free(b[2])
    a.free(b[4])                                              # three one-page holes at 3, 5, 7
    assert a.alloc_extents(4 * P, 8) is None                  # 3 pages free: never more than the free bytes
    assert a.alloc_extents(3 * P, 2) is None                  # three holes needed, two allowed
    assert a.alloc_extents(2 * P, 1) is None and a.used == 5 * P      # nothing held by a refusal
    got = a.alloc_extents(3 * P, 3)
    assert [(x.offset, x.size) for x in got] == [(3 * P, P), (5 * P, P), (7 * P, P)] and a.used == a.capacity
    for x in got:                                             # extents are ordinary blocks: freed one by one,
        a.free(x)                                             # merged, reused
    with pytest.raises(ValueError, match="freed twice"):
        a.free(got[1])
    a.free(b[1])
    a.free(b[3])
    a.free(one[0])
    assert a.used == 0 and a.alloc_extents(8 * P, 8)[0].size == 8 * P


@pytest.mark.parametrize("seed", range(4))
def test_random_extents_match_a_page_bitmap(seed):
    """Random alloc_extents / free: the blocks never overlap, sum to the rounded size, at most the cap; a request
    is refused only when the free pages (or the cap's largest holes) do not hold it."""
    rng = random.Random(seed)
    pages = rng.randint(8, 48)
    a = HostArena(pages * P, pinned=False)
    taken = [False] * pages
    live: list[list[Block]] = []
    for _ in range(300):
        if live and rng.random() < 0.45:
            for b in live.pop(rng.randrange(len(live))):
                a.free(b)
                for p in range(b.offset // P, (b.offset + b.size) // P):
                    taken[p] = False
        else:
            nbytes, cap = rng.randint(1, 8 * P), rng.randint(1, 4)
            need = block_size(nbytes) // P
            holes, run = [], 0
            for t in [*taken, True]:
                if t and run:
                    holes.append(run)
                run = 0 if t else run + 1
            holes.sort(reverse=True)
            fits = sum(holes[:cap]) >= need
            got = a.alloc_extents(nbytes, cap)
            assert (got is not None) == fits, (need, cap, holes)
            if got is None:
                continue
            assert sum(b.size for b in got) == need * P and len(got) <= cap
            assert [b.offset for b in got] == sorted(b.offset for b in got)
            if need <= holes[0]:
                assert len(got) == 1
            for b in got:
                for p in range(b.offset // P, (b.offset + b.size) // P):
                    assert not taken[p]
                    taken[p] = True
            live.append(got)
        assert a.used == sum(taken) * P


def test_threads_free_while_another_allocates():
    a = HostArena(64 * P, pinned=False)
    held: list[Block] = []
    lock = threading.Lock()
    stop = threading.Event()

    def freer():
        while not stop.is_set() or held:
            with lock:
                b = held.pop() if held else None
            if b is not None:
                a.free(b)

    threads = [threading.Thread(target=freer) for _ in range(2)]
    for t in threads:
        t.start()
    for i in range(3000):
        b = a.alloc((i % 3 + 1) * P)
        if b is not None:
            with lock:
                held.append(b)
    stop.set()
    for t in threads:
        t.join()
    assert a.used == 0 and a.largest_free == a.capacity


def test_pinned_registers_in_place_and_falls_back_with_one_line(monkeypatch, caplog):
    calls = []
    cudart = SimpleNamespace(cudaHostRegister=lambda ptr, n, flags: calls.append(("reg", ptr, n, flags)) or 0,
                             cudaHostUnregister=lambda ptr: calls.append(("unreg", ptr)) or 0)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    a = HostArena(5 * P + 1, pinned=True)
    ptr = a.view(a.alloc(P)).data_ptr()
    assert a.how == "cudaHostRegister" and calls == [("reg", ptr, 5 * P + 1, 1)]    # exactly nbytes, no rounding
    a.close()
    a.close()
    assert calls[1:] == [("unreg", ptr)]                     # once
    with pytest.raises(RuntimeError, match="closed"):
        a.alloc(P)

    cudart.cudaHostRegister = lambda ptr, n, flags: 999      # refused: torch's pinned allocator instead
    monkeypatch.setattr(host_arena, "_pinned_empty", lambda n: torch.zeros(n, dtype=torch.uint8))
    caplog.set_level(logging.WARNING)
    b = HostArena(3 * P, pinned=True)
    assert b.how == "torch pinned allocator" and b.capacity == 3 * P and b.alloc(3 * P) is not None
    assert [m for m in caplog.messages if "cudaError 999" in m] and len(caplog.messages) == 1
    b.close()
    assert len(calls) == 2                                    # nothing registered, nothing to unregister
