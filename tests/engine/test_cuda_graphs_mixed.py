"""Prefill and mixed graph steps on the CPU (embedded model): the padded, static-buffer path a CUDA graph
captures (mixed_inputs.py), run eagerly ("graph-shaped eager", graph_capture=False), against the ordinary
eager step of a second runner fed the same steps: logits bit for bit, and every byte of every state pool and
KV cache equal after each step (so padding rows wrote nothing). Every exact step has >= 16 rows in both
runners: the CPU GEMM's small-M path (under ~12 rows) rounds differently from its blocked one, so a 5-row eager
step and its 16-row bucket would differ in the last bit there (the Triton test compares to rounding). Odd prefill lengths (1, 63, 64, 65), a
continuation, checkpoint groups (producer + consumers with copy-on-write tails in one step, READY checkpoints),
mixed prefill + decode steps, logits of every token; bucket choice and fallbacks; with the MTP drafter, its feed
pass inside the mixed step (the head's KV and hidden rows as the eager feed leaves them)."""
from __future__ import annotations

import random

import pytest
import torch

from gdnserve.engine.cache.sequence import PrefillItem
from gdnserve.engine.execution.mixed_inputs import MixedKey, MixedStep, pick_mixed, token_buckets
from tests.engine.test_cuda_graphs import make_runner


def toks(n: int) -> list[int]:
    return [random.randrange(256) for _ in range(n)]


def same_state(a, b, exact: bool = True) -> None:
    """Every byte of the state pools and KV caches (exact), or every value close and the same bytes zero."""
    for obj, name in ((a.state, "conv_pools"), (a.state, "ssm_pools"), (a.pages, "k_pools"), (a.pages, "v_pools")):
        x, y = getattr(obj, name), getattr(b.state if obj is a.state else b.pages, name)
        if exact:
            assert torch.equal(x, y), name
        else:
            # on CUDA the padded step's projections are other GEMM shapes (cuBLAS picks other algorithms): the H200
            # saw one KV value of 65,536 1.4e-5 off (fresh seed); the zero pattern stays exact
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5 if x.device.type == "cpu" else 1e-4)
            assert torch.equal(x == 0, y == 0), f"{name}: padding wrote"


class Pair:
    """A graph-shaped runner and an ordinary one, stepped alike (their sequences mirror each other)."""

    def __init__(self, backend: str = "torch", **kw):
        self.g = make_runner(True, backend=backend, mixed_graphs=True, **kw)
        self.e = make_runner(False, backend=backend, **kw)

    def new(self):
        return self.g.new_seq(), self.e.new_seq()

    def step(self, items, decodes=(), ready=frozenset(), exact: bool = True) -> torch.Tensor:
        """items: (seq pair, tokens, producer index, checkpoint pair, all_logits); decodes: (seq pair, token)."""
        out = []
        for side in (0, 1):
            r = (self.g, self.e)[side]
            pf = [PrefillItem(s[side], t, producer=p, all_logits=al,
                              start_from=None if c is None else (c[side].slot, c[side].pages))
                  for s, t, p, c, al in items]
            out.append(r.step(pf, [(s[side], t) for s, t in decodes], ready=ready))
        if exact:
            assert torch.equal(out[0], out[1])
        else:
            torch.testing.assert_close(out[0], out[1], rtol=1e-4, atol=1e-5 if out[0].device.type == "cpu" else 1e-4)
        same_state(self.g, self.e, exact)
        return out[0]


def item(seq, tokens, producer=-1, checkpoint=None, all_logits=False):
    return (seq, tokens, producer, checkpoint, all_logits)


def test_buckets_and_pick():
    assert token_buckets(2048)[-3:] == (1024, 1536, 2048) and token_buckets(100) == (16, 32, 64, 100)
    tb, sb, db = token_buckets(4096), (1, 2, 4, 8, 16), (1, 2, 4, 8)
    assert pick_mixed(tb, sb, db, 193, 3, 65, 0) == MixedKey(256, 4, 128, 0)
    assert pick_mixed(tb, sb, db, 1, 1, 1, 5) == MixedKey(16, 1, 16, 8)
    assert pick_mixed(tb, sb, db, 5000, 1, 5000, 0) is None          # over the largest token bucket
    assert pick_mixed(tb, sb, db, 100, 17, 10, 0) is None            # more segments than the largest bucket
    assert pick_mixed(tb, sb, db, 100, 2, 50, 9) is None             # more decodes
    assert pick_mixed(tb, sb, db, 20, 2, 19, 3, 4) == MixedKey(32, 2, 32, 4, 4)    # 3 verifies of 4 rows
    assert pick_mixed(tb, sb, db, 20, 2, 19, 0, 4) == MixedKey(32, 2, 32, 0)       # none: the prefill-only key
    assert MixedKey(32, 2, 32, 4, 4).rows == 32 + 16 and MixedKey(32, 2, 32, 4, 4).attn_seqs == 2 + 1 + 4
    with pytest.raises(ValueError, match="graph_max_tokens"):
        token_buckets(0)


def test_steady_keys_cover_a_full_step_beside_every_decode_bucket():
    """The start-up warm-up's mixed keys (StepGraphs.steady_keys): the largest token bucket, one or two segments,
    beside no decodes and each decode bucket, largest first, no duplicates; none without mixed graphs. What a step
    of a chunked prompt filling the budget beside B decodes picks is among them."""
    g = make_runner(True, mixed_graphs=True, graph_max_tokens=512, graph_max_batch=8).graphs
    keys = g.steady_keys()
    assert len(keys) == len(set(keys)) == 2 * (len(g.buckets) + 1)
    assert all(k.T == 512 and k.Q == 512 and k.N in (1, 2) for k in keys) and keys[0].B == g.buckets[-1]
    for B in range(0, g.buckets[-1] + 1):
        for n in (1, 2):
            assert pick_mixed(g.tok_buckets, g.seq_buckets, g.buckets, 512 - B, n, 512 - B - n + 1, B) in keys
    assert make_runner(True).graphs.steady_keys() == []
    spec = make_runner(True, "replay", 3, mixed_graphs=True, graph_max_tokens=512, graph_max_batch=8).graphs
    assert {k.L for k in spec.steady_keys() if k.B} == {4}        # a speculative runner's requests verify


def test_prefill_odd_lengths_then_decode_and_continue(seed):
    p = Pair()
    seqs = [p.new() for _ in range(4)]
    p.step([item(s, toks(n)) for s, n in zip(seqs, (1, 63, 64, 65))])
    assert p.g.graphs.stats["mixed_eager"] == 1 and p.g.graphs.stats["fallback"] == 0
    for _ in range(2):                                             # decode graphs on the prefilled state
        p.step([], [(s, random.randrange(256)) for s in seqs])
    p.step([item(seqs[1], toks(65)), item(seqs[3], toks(1))])      # continuations of their own slots
    p.step([item(seqs[0], toks(64), all_logits=True)], [(s, random.randrange(256)) for s in seqs[1:]])
    assert p.g.graphs.stats["mixed_eager"] == 3 and p.g.graphs.stats["eager"] == 2
    keys = [k for k in p.g.graphs.mixed._views]
    assert MixedKey(256, 4, 128, 0) in keys and MixedKey(64, 1, 64, 4) in keys


def test_checkpoint_group_in_one_mixed_step(seed):
    """A producer and its consumers in one step (page_size 4: the consumers' tail pages are copy-on-write, the
    producer's rows stored twice), beside decodes; then consumers of the READY checkpoint it left."""
    p = Pair()
    old = [p.new() for _ in range(2)]
    p.step([item(s, toks(n)) for s, n in zip(old, (9, 30))])
    prod, c1, c2, c3 = (p.new() for _ in range(4))
    p.step([item(prod, toks(37)), item(c1, toks(1), producer=0), item(c2, toks(5), producer=0),
            item(c3, toks(20), producer=0, all_logits=True)], [(s, random.randrange(256)) for s in old])
    ready = {prod[0].slot}
    assert prod[0].slot == prod[1].slot
    d1, d2 = p.new(), p.new()
    p.step([item(d1, toks(3), checkpoint=prod), item(d2, toks(66), checkpoint=prod)],
           [(s, random.randrange(256)) for s in (c1, c2, c3)], ready=ready)
    assert p.g.graphs.stats["mixed_eager"] == 3 and p.g.graphs.stats["fallback"] == 0


def test_fallbacks_and_modes(seed):
    p = Pair(graph_max_tokens=40)
    a, b = p.new(), p.new()
    p.step([item(a, toks(41))])                                    # over the largest token bucket: eager
    st = p.g.graphs.stats
    assert st["fallback"] == 1 and st["mixed_eager"] == 0
    p.step([item(b, toks(40))], [(a, 3)])
    assert st["mixed_eager"] == 1
    for mode in ("serial", "two_phase", "two_phase_indexed"):      # only the fused plan has one launch group
        assert make_runner(True, prefill_mode=mode, mixed_graphs=True).graphs.mixed is None
    assert make_runner(True, mixed_graphs=False).graphs.mixed is None
    r = make_runner(True, "replay", 2, mixed_graphs=True)
    s, t, u = r.new_seq(), r.new_seq(), r.new_seq()
    r.step([PrefillItem(s, toks(7)), PrefillItem(u, toks(4))], [])
    r.step([PrefillItem(t, toks(5))], [], verifies=[(s, toks(3))])                 # a verify beside a prefill: graph
    r.accept([(s, 2)])
    assert r.graphs.stats["mixed_verify"] == 1 and r.graphs.stats["mixed_eager"] == 2
    assert MixedKey(16, 1, 16, 1, 3) in r.graphs.mixed._views
    r.step([PrefillItem(t, toks(5))], [(u, 1)], verifies=[(s, toks(3))])          # decodes AND verifies: eager
    assert r.graphs.stats["fallback"] == 1 and r.graphs.stats["mixed_eager"] == 2


def test_long_sequence_over_the_table_width_steps_eagerly(seed):
    p = Pair(max_model_len=24, graph_max_tokens=64)                # width ceil(25 / 4) = 7 pages = 28 tokens
    a = p.new()
    p.step([item(a, toks(28))])
    p.step([item(a, toks(1))])                                     # 29 tokens: over the width
    assert p.g.graphs.stats["mixed_eager"] == 1 and p.g.graphs.stats["fallback"] == 1


def triton_mixed_step(p: Pair, layers: list) -> None:
    """A first prefill with ``layers`` on the PyTorch path (faster than interpreted), then a padded mixed step (a
    prefill, a same-step consumer of it, a decode) through their Triton kernels, both runners compared (close)."""
    a, b = p.new(), p.new()
    for m in layers:
        m.backend = "torch"
    p.step([item(a, toks(5))], exact=False)
    for m in layers:
        m.backend = "triton"
    p.step([item(b, toks(3)), item(p.new(), toks(2), producer=0)], [(a, 7)], exact=False)


def test_triton_kernels_mixed_step(seed):
    """The Triton kernels (interpreted on the CPU) on a padded mixed step: sentinel chunk rows, zero-length and
    padding GDN sequences, kv_len-0 attention padding, parents; live rows and every pool byte as the eager
    Triton step (close: the kernels take other launch shapes), nothing else written."""
    p = Pair(backend="triton")
    triton_mixed_step(p, [m for r in (p.g, p.e) for m in r.model.gdn_layers() + r.model.attention_layers()])
    assert p.g.graphs.stats["mixed_eager"] == 2


def test_mtp_feed_in_mixed_steps(seed):
    """With the MTP drafter the prefill / mixed graph runs the head's feed pass (MTPDrafter.mixed_feed, its rows
    from the bucket's static vectors): logits, every pool byte (the head's KV layer included) and every live row
    of the hidden pool equal the eager step's, through odd lengths, continuations, a checkpoint group with
    copy-on-write consumers beside decodes (hidden before a consumer: its producer's last row), READY-checkpoint
    consumers (the checkpoint slot's hidden), and verify steps in between (the hidden after acceptance feeds the
    next mixed step). Padding rows store no MTP entry and commit only into the scratch row, so the hidden rows of
    slots the step does not touch stay as they were."""
    p = Pair(mode="replay", k=3, spec_draft="mtp")
    g, e = p.g, p.e
    assert g.mtp is not None and g.graphs.mixed is not None and g.graphs.mixed.mtp

    def same_hidden():
        assert torch.equal(g.mtp.hidden[:-1], e.mtp.hidden[:-1])

    def verify(pairs, accepted):
        """A verify-only step of the pairs (graph-shaped vs eager: same M, 4 x L = 16 rows) and its acceptance."""
        last = [random.randrange(256) for _ in pairs]
        out = [r.step([], [], verifies=[(s[i], [t]) for s, t in zip(pairs, last)]) for i, r in enumerate((g, e))]
        assert torch.equal(out[0], out[1]) and torch.equal(g.drafts, e.drafts)
        for i, r in enumerate((g, e)):
            r.accept([(s[i], a) for s, a in zip(pairs, accepted)])
        same_state(g, e)
        same_hidden()

    seqs = [p.new() for _ in range(4)]
    untouched = g.mtp.hidden[seqs[3][0].slot + 1:-1].clone()
    p.step([item(s, toks(n)) for s, n in zip(seqs, (1, 63, 64, 65))])
    same_hidden()
    assert torch.equal(g.mtp.hidden[seqs[3][0].slot + 1:-1], untouched)      # padding committed nowhere live
    assert g.mtp.hidden[seqs[0][0].slot].abs().sum() > 0                     # the 1-token segment committed
    verify(seqs, (4, 1, 2, 3))
    p.step([item(seqs[1], toks(65)), item(seqs[3], toks(1))], [(s, random.randrange(256)) for s in (seqs[0], seqs[2])])
    same_hidden()
    prod, c1, c2, c3 = (p.new() for _ in range(4))
    p.step([item(prod, toks(37)), item(c1, toks(1), producer=0), item(c2, toks(5), producer=0),
            item(c3, toks(20), producer=0, all_logits=True)], [(s, random.randrange(256)) for s in seqs])
    same_hidden()
    ready = {prod[0].slot}
    d1, d2 = p.new(), p.new()
    p.step([item(d1, toks(3), checkpoint=prod), item(d2, toks(66), checkpoint=prod)],
           [(s, random.randrange(256)) for s in (c1, c2, c3)], ready=ready)
    same_hidden()
    verify([c1, c2, d1, d2], (2, 4, 1, 3))
    p.step([item(seqs[2], toks(17))], [(s, random.randrange(256)) for s in (c1, c2, d1, d2)])
    same_hidden()
    st = g.graphs.stats
    assert st["mixed_eager"] == 5 and st["fallback"] == 0 and st["eager"] == 2
    before = g.mtp.hidden[:-1].clone(), g.pages.k_pools.clone(), g.state.ssm_pools.clone()
    for key in list(g.graphs.mixed._views):        # what a capture runs first: every row padding (MixedStep empty)
        g.graphs._lens[key] = g.graphs.mixed.fill(key, MixedStep([], [], [], [], [0], [], [], [], 0, [], [], [], []))
        g.graphs._forward(key)
    assert torch.equal(g.mtp.hidden[:-1], before[0]) and torch.equal(g.pages.k_pools, before[1])
    assert torch.equal(g.state.ssm_pools, before[2])


def test_triton_kernels_mtp_mixed_step(seed):
    """The MTP feed of a padded mixed step through the Triton kernels (interpreted on the CPU): the head's KV store
    with a producer's duplicated copy-on-write rows, padding rows skipped; live rows, pools and hidden rows as the
    eager Triton step's (close: other launch shapes)."""
    p = Pair(backend="triton", mode="replay", k=3, spec_draft="mtp")
    triton_mixed_step(p, [m for r in (p.g, p.e)
                          for m in [*r.model.gdn_layers(), *r.model.attention_layers(), r.mtp.head.attention]])
    torch.testing.assert_close(p.g.mtp.hidden[:-1], p.e.mtp.hidden[:-1], rtol=1e-4, atol=1e-5)
    assert p.g.graphs.stats["mixed_eager"] == 2
