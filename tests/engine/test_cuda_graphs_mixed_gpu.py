"""GPU-only: the captured prefill / mixed graphs (engine/execution/cuda_graphs.py, ``mixed_graphs``) on the embedded model.

A replay equals the graph-shaped eager step bit for bit — logits and every byte of state — for prefill and mixed
steps (odd lengths, a continuation, checkpoint groups, READY checkpoints, decodes beside them; dense and MoE); it
is close to the ordinary unpadded eager step; prefill / mixed replays make no host synchronisation. With the MTP
drafter the mixed graph holds the head's feed pass: a replay leaves the head's KV and hidden rows as the graph-shaped
eager step does, bit for bit, and makes no host synchronisation either. A speculative runner's mixed graphs with
verify rows (prefill beside verifies; n-gram and MTP drafts, replay and intermediate): replay == graph-shaped eager
(logits, drafts, every state / scratch / pending / KV byte, live hidden rows), and a prefill + verify replay with
its acceptance makes no host synchronisation. The decode /
verify graphs: test_cuda_graphs_gpu.py; the graph-shaped mixed step on the CPU: test_cuda_graphs_mixed.py.
Run on the H200: ``python -m pytest -q tests/engine/test_cuda_graphs_mixed_gpu.py``."""
from __future__ import annotations

import random

import pytest
import torch

from gdnserve.engine.cache.sequence import PrefillItem
from gdnserve.engine.execution.model_runner import ModelRunner
from gdnserve.ops.numerics import rel_rms
from tests.engine.test_cuda_graphs import same_bits
from tests.engine.test_cuda_graphs_gpu import assert_same_state, make_runner

pytestmark = pytest.mark.gpu


def mixed_lockstep(moe: bool) -> ModelRunner:
    """Captured, graph-shaped eager and plain eager runners through prefill and mixed steps: odd lengths, a
    continuation, a checkpoint group (producer + copy-on-write consumers) beside decodes, READY-checkpoint
    consumers, logits of every token; replay == graph-shaped eager bit for bit, close to plain."""
    rs = [make_runner(None, 0, g, c, moe=moe, mixed=True) for g, c in ((True, None), (True, False), (False, None))]
    seqs = {}

    def new(name):
        seqs[name] = [r.new_seq() for r in rs]

    def step(items, decodes=(), ready=()):
        slots = {seqs[c][0].slot for c in ready}
        outs = []
        for i, r in enumerate(rs):
            pf = [PrefillItem(seqs[n][i], t, producer=p, all_logits=al,
                              start_from=None if c is None else (seqs[c][i].slot, seqs[c][i].pages))
                  for n, t, p, c, al in items]
            outs.append(r.step(pf, [(seqs[n][i], t) for n, t in decodes], ready=slots))
        torch.cuda.synchronize()
        assert torch.equal(outs[0], outs[1]), "replay != graph-shaped eager"
        assert rel_rms(outs[0], outs[2]) < 2e-2, "replay far from the eager step"
        assert_same_state(rs[0], rs[1])

    def it(name, n, producer=-1, checkpoint=None, all_logits=False):
        return (name, [random.randrange(256) for _ in range(n)], producer, checkpoint, all_logits)

    def dec(*names):
        return [(n, random.randrange(256)) for n in names]

    for n in "abcd":
        new(n)
    step([it(n, L) for n, L in zip("abcd", (1, 63, 64, 65))])
    step([it("b", 65), it("d", 1)], dec("a", "c"))
    for n in ("p", "c1", "c2", "c3"):
        new(n)
    step([it("p", 37), it("c1", 1, 0), it("c2", 5, 0), it("c3", 20, 0, all_logits=True)], dec("a", "b", "d"))
    new("r1"), new("r2")
    step([it("r1", 3, checkpoint="p"), it("r2", 66, checkpoint="p")], dec("c1", "c2", "c3"), ready=("p",))
    step([it("a", 7)], dec("b", "c", "d", "c1", "c2", "c3", "r1", "r2"))
    g = rs[0].graphs
    assert g.stats["mixed_replay"] == 5 and g.stats["fallback"] == 0 and g.stats["capture"] == 5
    return rs[0]


@pytest.mark.parametrize("moe", [False, True])
def test_mixed_replay_equals_graph_shaped_eager(moe, seed):
    mixed_lockstep(moe)


def test_mixed_replays_do_not_sync():
    r = make_runner(None, 0, True, None, mixed=True)
    a, b, c = (r.new_seq() for _ in range(3))
    r.step([PrefillItem(a, list(range(40))), PrefillItem(b, list(range(30)))], [])          # captures
    r.step([PrefillItem(c, list(range(9)))], [(a, 1), (b, 2)])                           # captures
    torch.cuda.synchronize()
    d, e = r.new_seq(), r.new_seq()
    torch.cuda.set_sync_debug_mode("error")
    try:
        r.step([PrefillItem(d, list(range(50))), PrefillItem(e, list(range(20)))], [])    # replays
        r.step([PrefillItem(c, list(range(5)))], [(a, 3), (b, 4)])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert r.graphs.stats["mixed_replay"] == 4 and r.graphs.stats["capture"] == 2


def test_mtp_mixed_replay_equals_graph_shaped_eager(seed):
    """With ``spec_draft="mtp"``: captured and graph-shaped eager runners in lockstep through prefill / mixed steps
    (odd lengths, continuations beside decodes, a checkpoint group with copy-on-write consumers, READY-checkpoint
    consumers) and verify steps between them (the MTP draft in the verify graph; the hidden after acceptance feeds
    the next mixed step): logits, drafts, every state and KV byte (the head's KV layer is one more page-pool
    layer) and every live hidden row bit for bit; then a mixed replay without a host synchronisation."""
    rs = [make_runner("replay", 3, True, c, mixed=True, draft="mtp") for c in (None, False)]
    assert rs[0].graphs.capture and not rs[1].graphs.capture and all(r.graphs.mixed.mtp for r in rs)
    for r in rs:
        r.mtp.hidden.zero_()
    seqs = {}

    def new(*names):
        for n in names:
            seqs[n] = [r.new_seq() for r in rs]

    def check(outs):
        torch.cuda.synchronize()
        assert torch.equal(outs[0], outs[1]), "replay != graph-shaped eager"
        assert_same_state(rs[0], rs[1])
        assert same_bits(rs[0].mtp.hidden[:-1], rs[1].mtp.hidden[:-1]), "MTP hidden rows"

    def step(items, decodes=(), ready=()):
        slots = {seqs[c][0].slot for c in ready}
        outs = []
        for i, r in enumerate(rs):
            pf = [PrefillItem(seqs[n][i], t, producer=p, all_logits=al,
                              start_from=None if c is None else (seqs[c][i].slot, seqs[c][i].pages))
                  for n, t, p, c, al in items]
            outs.append(r.step(pf, [(seqs[n][i], t) for n, t in decodes], ready=slots))
        check(outs)

    def verify(names, accepted):
        last = [random.randrange(256) for _ in names]
        outs = [r.step([], [], verifies=[(seqs[n][i], [t]) for n, t in zip(names, last)]) for i, r in enumerate(rs)]
        check(outs)
        assert torch.equal(rs[0].drafts, rs[1].drafts)
        for i, r in enumerate(rs):
            r.accept([(seqs[n][i], a) for n, a in zip(names, accepted)])
        check(outs)

    def it(name, n, producer=-1, checkpoint=None, all_logits=False):
        return (name, [random.randrange(256) for _ in range(n)], producer, checkpoint, all_logits)

    def dec(*names):
        return [(n, random.randrange(256)) for n in names]

    new(*"abcd")
    step([it(n, L) for n, L in zip("abcd", (1, 63, 64, 65))])
    verify("abcd", (4, 1, 2, 3))
    step([it("b", 65), it("d", 1)], dec("a", "c"))
    new("p", "c1", "c2", "c3")
    step([it("p", 37), it("c1", 1, 0), it("c2", 5, 0), it("c3", 20, 0, all_logits=True)], dec("a", "b", "d"))
    new("r1", "r2")
    step([it("r1", 3, checkpoint="p"), it("r2", 66, checkpoint="p")], dec("c1", "c2", "c3"), ready=("p",))
    verify(["c1", "c2", "r1", "r2"], (2, 4, 1, 3))
    step([it("a", 7)], dec("b", "c", "d", "c1", "c2", "c3", "r1", "r2"))
    g = rs[0].graphs
    assert g.stats["mixed_replay"] == 5 and g.stats["replay"] == 2 and g.stats["fallback"] == 0
    assert rs[1].graphs.stats["mixed_eager"] == 5
    r, n = rs[0], g.stats["capture"]
    new("e")
    torch.cuda.set_sync_debug_mode("error")
    try:                                          # the first step's bucket (256, 4, 128, 0): replayed, no capture
        r.step([PrefillItem(seqs[x][0], [random.randrange(256) for _ in range(L)])
                for x, L in zip(("e", "b", "c", "d"), (2, 63, 64, 65))], [])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert g.stats["capture"] == n and g.stats["mixed_replay"] == 6


@pytest.mark.parametrize("draft,mode", [("ngram", "replay"), ("ngram", "intermediate"), ("mtp", "replay"),
                                        ("mtp", "intermediate")])
def test_mixed_verify_replay_equals_graph_shaped_eager(draft, mode, seed):
    """Captured and graph-shaped eager speculative runners (k = 3) in lockstep through prefill steps beside
    verifies (odd lengths, a continuation, a checkpoint group with copy-on-write consumers, READY-checkpoint
    consumers; 3 verifies in bucket 4: one padding request), decodes beside a prefill (the L = 1 bucket), verify
    graphs between, acceptances with device counts: logits, drafts, verify slots, every state / scratch / pending /
    KV byte and every live MTP hidden row bit for bit; then a replayed prefill + verify step and its acceptance
    without a host synchronisation."""
    rs = [make_runner(mode, 3, True, c, mixed=True, draft=draft) for c in (None, False)]
    mtp = draft == "mtp"
    if mtp:
        for r in rs:
            r.mtp.hidden.zero_()
    seqs = {}

    def new(*names):
        for n in names:
            seqs[n] = [r.new_seq() for r in rs]

    def check(outs):
        torch.cuda.synchronize()
        assert torch.equal(outs[0], outs[1]), "replay != graph-shaped eager"
        assert_same_state(rs[0], rs[1])
        if mtp:
            assert same_bits(rs[0].mtp.hidden[:-1], rs[1].mtp.hidden[:-1]), "MTP hidden rows"

    def step(items, decodes=(), verifies=(), ready=()):
        slots = {seqs[c][0].slot for c in ready}
        vt = [[random.randrange(256) for _ in range(1 if mtp else 4)] for _ in verifies]
        outs = []
        for i, r in enumerate(rs):
            pf = [PrefillItem(seqs[n][i], t, producer=p, all_logits=al,
                              start_from=None if c is None else (seqs[c][i].slot, seqs[c][i].pages))
                  for n, t, p, c, al in items]
            outs.append(r.step(pf, [(seqs[n][i], t) for n, t in decodes],
                               verifies=[(seqs[n][i], t) for n, t in zip(verifies, vt)], ready=slots))
        check(outs)
        if verifies:
            assert torch.equal(rs[0].drafts, rs[1].drafts) and torch.equal(rs[0].verify_slots, rs[1].verify_slots)

    def accept(names, counts):
        for i, r in enumerate(rs):
            r.accept([(seqs[n][i], a) for n, a in zip(names, counts)], torch.tensor(counts, device="cuda"))
        torch.cuda.synchronize()
        assert_same_state(rs[0], rs[1])
        if mtp:
            assert same_bits(rs[0].mtp.hidden[:-1], rs[1].mtp.hidden[:-1]), "MTP hidden rows"

    def it(name, n, producer=-1, checkpoint=None, all_logits=False):
        return (name, [random.randrange(256) for _ in range(n)], producer, checkpoint, all_logits)

    def dec(*names):
        return [(n, random.randrange(256)) for n in names]

    new(*"abcd")
    step([it(n, L) for n, L in zip("abcd", (1, 63, 64, 65))])
    step([], verifies="abcd")                                          # a verify graph
    accept("abcd", (4, 1, 2, 3))
    new("e", "f")
    step([it("e", 9), it("f", 30)], verifies="abc")                    # 3 verifies: bucket 4, one padding request
    accept("abc", (2, 4, 1))
    new("p", "c1", "c2", "c3")
    step([it("p", 37), it("c1", 1, 0), it("c2", 5, 0), it("c3", 20, 0, all_logits=True)], verifies="abcd")
    accept("abcd", (3, 3, 4, 2))
    new("r1", "r2")
    step([it("r1", 3, checkpoint="p"), it("r2", 66, checkpoint="p")], verifies=["c1", "c2", "e"], ready=("p",))
    accept(["c1", "c2", "e"], (1, 4, 2))
    step([it("f", 17)], dec("a", "c3", "r1", "r2"))                   # decodes beside prefill: the L = 1 bucket
    step([it("f", 12)], verifies=["c1", "c2", "e"])                    # bucket (16, 1, 16, 4, 4), replayed below
    accept(["c1", "c2", "e"], (2, 2, 3))
    g = rs[0].graphs
    assert g.stats["mixed_verify"] == 4 and g.stats["fallback"] == 0 and g.stats["replay"] == 1
    assert rs[1].graphs.stats["mixed_verify"] == 4
    r, n = rs[0], g.stats["capture"]
    names = ["c1", "c2", "e"]
    torch.cuda.set_sync_debug_mode("error")
    try:                                          # a bucket captured above: replayed, no capture, no sync
        r.step([PrefillItem(seqs["f"][0], [random.randrange(256) for _ in range(11)])], [],
               verifies=[(seqs[x][0], [random.randrange(256) for _ in range(1 if mtp else 4)]) for x in names])
        r.accept([(seqs[x][0], 2) for x in names], torch.full((3,), 2, device="cuda"))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert g.stats["capture"] == n and g.stats["mixed_replay"] == 7 and g.stats["mixed_verify"] == 5


def test_warm_up_captures_the_steady_mixed_keys(seed):
    """The start-up warm-up captures StepGraphs.steady_keys (a full step of prefill tokens beside each decode
    bucket) on padding only: every state and KV byte unchanged, and a later step of that shape replays without a
    capture, equal to the graph-shaped eager step bit for bit."""
    from tests.engine.test_cuda_graphs_gpu import all_state
    rs = [make_runner(None, 0, True, c, mixed=True, max_tokens=256) for c in (None, False)]
    r = rs[0]
    before = {n: t.clone() for n, t in all_state(r).items()}
    n0 = r.graphs.stats["capture"]
    assert "mixed steps of" in r.warm_up()
    keys = r.graphs.steady_keys()
    assert keys and all(k in r.graphs.graphs for k in keys) and r.graphs.stats["capture"] - n0 >= len(keys)
    for n, t in all_state(r).items():
        assert same_bits(t, before[n]), n
    T = r.graphs.tok_buckets[-1]
    seqs = [[x.new_seq() for x in rs] for _ in range(3)]
    outs = [x.step([PrefillItem(seqs[0][i], list(range(5)))], []) for i, x in enumerate(rs)]
    n1 = r.graphs.stats["capture"]
    toks = [random.randrange(256) for _ in range(T - 1)]          # the same prompt for both runners
    outs = [x.step([PrefillItem(seqs[1][i], toks)], [(seqs[0][i], 7)]) for i, x in enumerate(rs)]
    torch.cuda.synchronize()
    assert r.graphs.stats["capture"] == n1, "a steady-state mixed step captured after the warm-up"
    assert torch.equal(outs[0], outs[1])
    assert_same_state(rs[0], rs[1])
