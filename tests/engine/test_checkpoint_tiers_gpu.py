"""GPU-only: the GPU <-> host path of the checkpoint tiers (engine/cache/checkpoint_copy.py) with its stream ordering,
and the engine with CUDA graphs on.

- A snapshot is exact although the step that follows overwrites the evicted rows at once (the current stream
  waits on the copy's event); a restore is exact although the destination was written just before (the copier
  stream waits on the current stream), and it is bit for bit what was evicted; the host buffer is pinned.
- The host arena (engine/cache/host_arena.py) is pinned in place by cudaHostRegister (no power-of-two rounding) and
  its blocks are exact both ways; a block released while its copy up is still queued and taken at once by the next
  snapshot is overwritten only after that copy up read it (the stream down waits for it: ``Copier._reads``).
- The two copy streams: a restore runs while a spill (ahead) is still held on the stream down and is exact; a
  restore of a checkpoint whose copy down is still in flight reads it after that copy; a restore into the slot an
  eviction's spill just freed lands after the spill's gathers (both exact); a copy down into the block a queued
  copy up still reads waits for it.
- Extents: a checkpoint cut across two blocks of a fragmented pinned arena is exact both ways (pieces across the
  boundary, several staging batches), and a copy down into its extents waits for their queued copy up.
- The engine (embedded model, bf16, CUDA graphs on) with 6 state slots and a host tier: later turns of conversations
  whose checkpoints were evicted hit from the host and give the greedy tokens of an engine that kept them all on
  the GPU (the same checkpoint state, the same kernels); nothing leaks (state, pages, arena blocks); close unpins.
  With spill ahead (the default watermark) and two requests in flight, restores run while spills are in flight:
  every restored slot is bit for bit the slot copied down.
Run on the H200: ``python -m pytest -q tests/engine/test_checkpoint_tiers_gpu.py`` (well under 60 s)."""
from __future__ import annotations

import random

import pytest
import torch

from gdnserve.engine.cache.checkpoint_copy import Copier
from gdnserve.engine.cache.host_arena import HostArena, block_size
from gdnserve.engine.cache.page_pool import PagePool, PagePoolConfig
from gdnserve.engine.cache.state_pool import StatePool, StatePoolConfig
from gdnserve.engine.sampling_params import SamplingParams
from gdnserve.entrypoints.llm import LLM
from tests.engine.test_checkpoint_tiers import _run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32).clone()


def test_copies_are_ordered_against_the_current_stream_and_exact():
    st = StatePool(StatePoolConfig(num_layers=3, num_slots=6, HV=8, K=64, V=64, conv_dim=96, conv_width=4,
                                   device="cuda"))
    pg = PagePool(PagePoolConfig(num_layers=2, num_pages=64, page_size=16, num_kv_heads=2, head_dim=64,
                                 device="cuda"))
    for t in (st.conv_pools, st.ssm_pools, pg.k_pools, pg.v_pools):
        t.copy_(torch.randn(t.shape, device="cuda").to(t.dtype))
    cp = Copier(st, pg)
    src, dst = [7, 8, 9, 3, 40], [0, 1, 2, 50, 51]
    conv, k, v = bits(st.conv_pools[:, 2]).cpu(), bits(pg.k_pools[:, src]).cpu(), bits(pg.v_pools[:, src]).cpu()
    ssm = bits(st.ssm_pools[:, 2] + 1.0).cpu()
    torch.cuda._sleep(50_000_000)          # the current stream is busy: a copy that did not wait would run early
    st.ssm_pools[:, 2].add_(1.0)           # queued before the snapshot: the snapshot must see it
    hc = cp.snapshot(b"k" * 16, (1, 2), 2, src)
    st.ssm_pools.fill_(float("nan"))       # the next "step" rewrites the freed rows: ordered after the copy
    pg.k_pools.fill_(float("nan"))
    pg.v_pools.fill_(float("nan"))
    hc.wait()
    assert hc.tensors["ssm"].is_pinned()
    got = {n: bits(t) for n, t in hc.tensors.items()}
    assert torch.equal(got["conv"], conv) and torch.equal(got["ssm"], ssm)
    assert torch.equal(got["k"], k) and torch.equal(got["v"], v)
    torch.cuda._sleep(50_000_000)
    st.ssm_pools[:, 4].fill_(3.0)          # queued before the restore into slot 4: the restore must land after it
    pg.k_pools[:, 0:3].fill_(3.0)
    event = cp.restore(hc, 4, dst)
    event.synchronize()
    assert torch.equal(bits(st.ssm_pools[:, 4]).cpu(), ssm) and torch.equal(bits(st.conv_pools[:, 4]).cpu(), conv)
    assert torch.equal(bits(pg.k_pools[:, dst]).cpu(), k) and torch.equal(bits(pg.v_pools[:, dst]).cpu(), v)


def test_arena_blocks_are_pinned_in_place_exact_and_reused_in_stream_order():
    st = StatePool(StatePoolConfig(num_layers=3, num_slots=6, HV=8, K=64, V=64, conv_dim=96, conv_width=4,
                                   device="cuda"))
    pg = PagePool(PagePoolConfig(num_layers=2, num_pages=64, page_size=16, num_kv_heads=2, head_dim=64,
                                 device="cuda"))
    for t in (st.conv_pools, st.ssm_pools, pg.k_pools, pg.v_pools):
        t.copy_(torch.randn(t.shape, device="cuda").to(t.dtype))
    per = block_size(Copier(st, pg).layout_bytes(5))
    arena = HostArena(per + 12345, pinned=True)         # room for one checkpoint of 5 pages, not two
    assert arena.how == "cudaHostRegister" and arena.capacity == (per + 12345) // 4096 * 4096
    cp = Copier(st, pg, arena=arena)
    src, dst = [7, 8, 9, 3, 40], [0, 1, 2, 50, 51]
    want = [bits(st.ssm_pools[:, 2]).cpu(), bits(pg.k_pools[:, src]).cpu()]
    hc = cp.empty(b"a" * 16, (1, 2), 5)
    assert hc.tensors["ssm"].is_pinned() and hc.footprint == per and cp.empty(b"b" * 16, (1,), 5) is None
    cp.copy_down(hc, 2, src)
    st.ssm_pools.fill_(float("nan"))       # the next "step" rewrites the freed rows: ordered after the copy
    pg.k_pools.fill_(float("nan"))
    hc.wait()
    assert torch.equal(bits(hc.tensors["ssm"]), want[0]) and torch.equal(bits(hc.tensors["k"]), want[1])
    torch.cuda._sleep(50_000_000)          # the current stream busy: the copy up below waits for it
    event = cp.restore(hc, 4, dst)
    hc.release()                           # (the tiers wait for the event; here the stream order alone is tested)
    other = cp.empty(b"c" * 16, (3,), 5)
    assert other is not None and other.block.offset == 0
    cp.copy_down(other, 1, [10, 11, 12, 13, 14])          # into the block the copy up is still to read
    event.synchronize()
    other.wait()
    assert torch.equal(bits(st.ssm_pools[:, 4]).cpu(), want[0]) and torch.equal(bits(pg.k_pools[:, dst]).cpu(),
                                                                                 want[1])
    other.release()
    assert arena.used == 0
    arena.close()                          # unregistered (a failure would log a warning)
    assert arena.closed


def _pools(num_slots=6):
    st = StatePool(StatePoolConfig(num_layers=3, num_slots=num_slots, HV=8, K=64, V=64, conv_dim=96, conv_width=4,
                                   device="cuda"))
    pg = PagePool(PagePoolConfig(num_layers=2, num_pages=64, page_size=16, num_kv_heads=2, head_dim=64,
                                 device="cuda"))
    for t in (st.conv_pools, st.ssm_pools, pg.k_pools, pg.v_pools):
        t.copy_(torch.randn(t.shape, device="cuda").to(t.dtype))
    return st, pg


def _snap(st, pg, slot, pages):
    return [bits(st.conv_pools[:, slot]).cpu(), bits(st.ssm_pools[:, slot]).cpu(), bits(pg.k_pools[:, pages]).cpu(),
            bits(pg.v_pools[:, pages]).cpu()]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_restores_run_beside_spills_on_their_own_stream_and_every_ordering_holds():
    st, pg = _pools()
    per = block_size(Copier(st, pg).layout_bytes(5))
    arena = HostArena(4 * per, pinned=True)
    cp = Copier(st, pg, arena=arena)
    assert cp.up is not cp.down
    a_pages, b_pages, c_pages = [7, 8, 9, 3, 40], [10, 11, 12, 13, 14], [20, 21, 22, 23, 24]
    want_a, want_b = _snap(st, pg, 2, a_pages), _snap(st, pg, 3, b_pages)
    a = cp.empty(b"a" * 16, (1,), 5)
    cp.copy_down(a, 2, a_pages)
    a.wait()
    # 1. a restore while a spill ahead is held on the stream down: it does not wait for it
    with torch.cuda.stream(cp.down):
        torch.cuda._sleep(200_000_000)
    b = cp.empty(b"b" * 16, (2,), 5)
    arena.view(b.block).fill_(0xFF)                    # garbage until its copy down lands
    cp.copy_down(b, 3, b_pages, free=False)            # held behind the sleep
    up = cp.restore(a, 4, [30, 31, 32, 33, 34])
    up.synchronize()
    assert not b.copied(), "the restore waited for the spill's stream (or the sleep was too short)"
    assert _same(_snap(st, pg, 4, [30, 31, 32, 33, 34]), want_a)
    # 2. a restore of b, whose copy down is still held: it reads b after that copy
    cp.restore(b, 5, [40, 41, 42, 43, 44]).synchronize()
    assert b.copied() and _same(_snap(st, pg, 5, [40, 41, 42, 43, 44]), want_b)
    # 3. an eviction's spill frees slot 2 and its pages; a restore into them at once lands after the gathers
    with torch.cuda.stream(cp.down):
        torch.cuda._sleep(50_000_000)
    c = cp.empty(b"c" * 16, (3,), 5)
    want_c = _snap(st, pg, 2, a_pages)
    cp.copy_down(c, 2, a_pages)                        # free=True: the current stream waits for its gathers
    cp.restore(b, 2, a_pages).synchronize()            # b into the freed slot and pages
    c.wait()
    assert _same([bits(c.tensors[n]) for n in ("conv", "ssm", "k", "v")], want_c)
    assert _same(_snap(st, pg, 2, a_pages), want_b)
    # 4. a copy down into a block whose copy up is still queued waits for that copy up's reads
    with torch.cuda.stream(cp.up):
        torch.cuda._sleep(200_000_000)
    ev = cp.restore(c, 1, c_pages)                     # held behind the sleep on the stream up
    offset = c.block.offset
    c.release()
    d = cp.empty(b"d" * 16, (4,), 5)
    assert d.block.offset == offset                    # first fit: c's block, the lowest free one
    cp.copy_down(d, 5, [40, 41, 42, 43, 44])           # must not overwrite it before the copy up read it
    ev.synchronize()
    d.wait()
    assert _same(_snap(st, pg, 1, c_pages), want_c)
    torch.cuda.synchronize()
    for hc in (a, b, d):
        hc.release()
    assert arena.used == 0
    arena.close()



def test_engine_with_graphs_restores_exactly_while_spilling_ahead():
    rng = random.Random(7)
    convs = [[rng.randrange(3, 250) for _ in range(300 + 37 * i)] for i in range(10)]
    kw = {"device": "cuda", "max_num_seqs": 2, "page_size": 16, "cuda_graphs": True}
    tiered = LLM(num_slots=6, num_pages=512, checkpoint_host_memory_gb=0.05, checkpoint_spill_ahead=2, **kw).engine
    resident = LLM(num_slots=48, num_pages=2048, **kw).engine     # every checkpoint stays on the GPU
    st = tiered.runner.state
    cp = tiered.kv.checkpoint_cache.tiers.copier
    down, ups = {}, []
    copy_down, restore = cp.copy_down, cp.restore

    def spy_down(hc, slot, pages, free=True):
        down[hc.key] = (bits(st.ssm_pools[:, slot]), bits(st.conv_pools[:, slot]))     # queued before the copy
        return copy_down(hc, slot, pages, free=free)

    def spy_up(hc, slot, pages):
        out = restore(hc, slot, pages)
        ups.append((hc.key, bits(st.ssm_pools[:, slot]), bits(st.conv_pools[:, slot])))   # after the scatter
        return out
    cp.copy_down, cp.restore = spy_down, spy_up
    firsts = [_run(tiered, c, 6).outputs[0].token_ids for c in convs]
    assert firsts == [_run(resident, c, 6).outputs[0].token_ids for c in convs]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for e in (tiered, resident):                       # two next turns in flight at a time
        for c, out in zip(convs, firsts):
            e.add_request(f"t{len(c)}", c + out + [9, 10, 11], params)
    outs = {id(e): {} for e in (tiered, resident)}
    for e in (tiered, resident):
        while e.has_unfinished():
            for o in e.step():
                if o.finished:
                    outs[id(e)][o.request_id] = o.outputs[0].token_ids
    assert outs[id(tiered)] == outs[id(resident)] and len(outs[id(resident)]) == len(convs)
    s = tiered.tier_stats.snapshot()
    assert s["spills_ahead"] > 0 and s["restores"]["host"] >= 2 and len(ups) == s["restores"]["host"]
    torch.cuda.synchronize()
    for key, ssm, conv in ups:
        assert torch.equal(ssm, down[key][0]) and torch.equal(conv, down[key][1])
    tiers = tiered.kv.checkpoint_cache.tiers
    tiered.evict_checkpoints(len(tiered.index))
    torch.cuda.synchronize()
    tiered.kv.checkpoint_cache.poll(wait=True)
    assert not tiers.ahead and tiers.arena.used == sum(hc.block.size for hc in tiers.host.values())
    tiered.close()


def test_engine_with_graphs_hits_from_the_host_tier_with_the_resident_outputs():
    rng = random.Random(5)
    convs = [[rng.randrange(3, 250) for _ in range(40 + 7 * i)] for i in range(8)]
    kw = {"device": "cuda", "max_num_seqs": 2, "num_pages": 256, "page_size": 16, "cuda_graphs": True}
    tiered = LLM(num_slots=6, checkpoint_host_memory_gb=0.05, **kw).engine
    resident = LLM(num_slots=32, **kw).engine
    tiers = tiered.kv.checkpoint_cache.tiers
    assert tiers.arena.how == "cudaHostRegister" and tiers.host_bytes == int(0.05 * 2**30) // 4096 * 4096
    firsts = {id(e): [_run(e, c, 6).outputs[0].token_ids for c in convs] for e in (tiered, resident)}
    assert firsts[id(tiered)] == firsts[id(resident)]
    assert len(tiered.kv.checkpoint_cache.tiers.host) >= 2
    for c, out in zip(convs, firsts[id(tiered)]):
        ids = c + out + [9, 10, 11]
        a, b = _run(tiered, ids, 6), _run(resident, ids, 6)
        assert a.checkpoint.hit_length == b.checkpoint.hit_length == len(c) + len(out) - 1
        assert b.checkpoint.tier == "gpu" and a.checkpoint.tier in ("gpu", "host")
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    s = tiered.tier_stats.snapshot()
    assert s["hits"]["host"] >= 2 and s["restores"]["host"] == s["hits"]["host"] and s["bytes"]["h2d"] > 0
    assert tiered.index.check_integrity() == [] and tiered.runner.state.check_integrity() == []
    tiered.evict_checkpoints(len(tiered.index))
    torch.cuda.synchronize()
    assert tiered.runner.state.num_free == tiered.runner.state.num_slots
    assert tiered.runner.pages.num_free == tiered.runner.pages.num_pages
    tiered.kv.checkpoint_cache.poll(wait=True)          # every copy up retired: its block back
    assert not tiers.landing and tiers.host
    assert tiers.arena.used == sum(hc.block.size for hc in tiers.host.values())       # no block leaked
    assert all(hc.tensors["ssm"].is_pinned() for hc in tiers.host.values())
    arena = tiers.arena
    tiered.close()
    assert arena.closed and tiers.arena is None


def test_a_checkpoint_in_extents_is_exact_and_its_extents_are_fenced():
    """A fragmented pinned arena: a checkpoint no one hole holds takes two extents; its copies down and up (pieces
    cut across the extent boundary, small staging buffer: several batches) are bit-exact, and a copy down into one
    of its extents while its copy up is still queued waits for that copy up's reads (``Copier._reads`` per
    extent)."""
    st, pg = _pools()
    per = block_size(Copier(st, pg).layout_bytes(5))
    half = -(-per // 2 // 4096) * 4096
    arena = HostArena(4 * half, pinned=True)
    fill = [arena.alloc(half) for _ in range(4)]
    arena.free(fill[0])
    arena.free(fill[2])                                # two holes of half a checkpoint, not adjacent
    cp = Copier(st, pg, stage_bytes=3 * 2**16 + 4096, arena=arena)
    src = [7, 8, 9, 3, 40]
    want = _snap(st, pg, 2, src)
    hc = cp.empty(b"a" * 16, (1,), 5)
    assert len(hc.blocks) == 2 and hc.block is None and all(s.is_pinned() for s in hc.spans)
    cp.copy_down(hc, 2, src)
    hc.wait()
    got = hc.host_tensors()
    assert _same([bits(got[n]) for n in ("conv", "ssm", "k", "v")], want)
    with torch.cuda.stream(cp.up):
        torch.cuda._sleep(200_000_000)
    ev = cp.restore(hc, 4, [30, 31, 32, 33, 34])       # held behind the sleep on the stream up
    hc.release()
    other = cp.empty(b"o" * 16, (2,), 5)               # the same two extents, at once
    assert [b.offset for b in other.blocks] == [0, 2 * half]
    cp.copy_down(other, 3, [10, 11, 12, 13, 14])       # must not overwrite them before the copy up read them
    ev.synchronize()
    other.wait()
    assert _same(_snap(st, pg, 4, [30, 31, 32, 33, 34]), want)
    torch.cuda.synchronize()
    other.release()
    for b in (fill[1], fill[3]):
        arena.free(b)
    assert arena.used == 0
    arena.close()
