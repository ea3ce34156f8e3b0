"""Prefill / mixed graph steps with VERIFY rows on the CPU (embedded model): a speculative runner's mixed bucket
(Tb, Nb, Qb, Bb, L = k + 1) holds verify requests of L rows in its row region (mixed_inputs.py). Run graph-shaped
eager (graph_capture=False), in lockstep with the ordinary eager step of a second runner fed the same steps:
logits, drafts, every byte of the state pools, the verify scratch / pending buffers and the KV caches (the MTP
head's layer included), and every live hidden row of the MTP drafter equal after each step and each acceptance,
for n-gram drafts (the L tokens come with the step) and MTP drafts (drafted inside the step: ``graph_draft`` on
the row region), in both spec modes. The steps: odd prefill lengths, continuations, a checkpoint group with
copy-on-write consumers, READY-checkpoint consumers, each beside verifies; decodes beside prefill (the L = 1
bucket of the same runner); verify-only steps between. Every prefill + verify step goes through a mixed bucket
(no eager fallback). Verify counts are bucket sizes (1, 2, 4, 8): the MTP draft's GEMMs then have the same rows in
both runners (the CPU GEMM's small-M path rounds differently per M); every step has >= 16 rows in both.
Engine level: greedy outputs with staggered arrivals (prefill beside verifies) equal the non-speculative run."""
from __future__ import annotations

import random

import pytest
import torch

from gdnserve.engine.cache.sequence import PrefillItem
from gdnserve.engine.execution.mixed_inputs import MixedKey, MixedStep
from gdnserve.engine.sampling_params import SamplingParams
from gdnserve.entrypoints.llm import LLM
from tests.engine.test_cuda_graphs import state_buffers
from tests.engine.test_cuda_graphs_mixed import Pair, item, same_state, toks
from tests.engine.test_spec_mtp import _copy_head

K = 3
L = K + 1


class SpecPair(Pair):
    """A graph-shaped speculative runner and an ordinary one in lockstep, verifies included."""

    def __init__(self, mode: str, draft: str, backend: str = "torch"):
        super().__init__(backend=backend, mode=mode, k=K, spec_draft=draft)
        self.mtp = draft == "mtp"
        for r in (self.g, self.e):                    # the pending buffers start uninitialised (torch.empty)
            for t, _ in state_buffers(r).values():
                t.zero_()

    def same(self, exact: bool = True) -> None:
        same_state(self.g, self.e, exact)
        ref = state_buffers(self.e)
        for name, (t, _) in state_buffers(self.g).items():          # verify scratch / pending buffers
            if exact:
                assert torch.equal(t, ref[name][0]), name
            else:
                torch.testing.assert_close(t, ref[name][0], rtol=1e-4, atol=1e-5)
        if self.mtp:
            if exact:
                assert torch.equal(self.g.mtp.hidden[:-1], self.e.mtp.hidden[:-1]), "MTP hidden rows"
            else:
                torch.testing.assert_close(self.g.mtp.hidden[:-1], self.e.mtp.hidden[:-1], rtol=1e-4, atol=1e-5)

    def vstep(self, items=(), decodes=(), verifies=(), ready=frozenset(), exact: bool = True) -> torch.Tensor:
        """items / decodes as ``Pair.step``; verifies: seq pairs (their tokens made here: the last sampled token,
        and with n-gram drafts k more)."""
        vt = [[random.randrange(256) for _ in range(1 if self.mtp else L)] for _ in verifies]
        out = []
        for side, r in enumerate((self.g, self.e)):
            pf = [PrefillItem(s[side], t, producer=p, all_logits=al,
                              start_from=None if c is None else (c[side].slot, c[side].pages))
                  for s, t, p, c, al in items]
            out.append(r.step(pf, [(s[side], t) for s, t in decodes], verifies=[(s[side], t) for s, t in
                                                                                  zip(verifies, vt)], ready=ready))
        if exact:
            assert torch.equal(out[0], out[1])
        else:
            torch.testing.assert_close(out[0], out[1], rtol=1e-4, atol=1e-5)
        if verifies:
            assert torch.equal(self.g.drafts, self.e.drafts)
            assert torch.equal(self.g.verify_slots, self.e.verify_slots)
        self.same(exact)
        return out[0]

    def accept(self, seqs, counts, device: bool = False, exact: bool = True) -> None:
        """Both runners keep ``counts``; ``device``: the counts as the engine passes them (a device tensor: the
        commit reads the step's own verify-slot vector, no upload)."""
        for side, r in enumerate((self.g, self.e)):
            r.accept([(s[side], a) for s, a in zip(seqs, counts)], torch.tensor(counts) if device else None)
        self.same(exact)


def dec(seqs):
    return [(s, random.randrange(256)) for s in seqs]


@pytest.mark.parametrize("draft", ["ngram", "mtp"])
@pytest.mark.parametrize("mode", ["replay", "intermediate"])
def test_verify_rows_in_mixed_steps(mode, draft, seed):
    p = SpecPair(mode, draft)
    g = p.g.graphs
    assert g.mixed is not None and g.mixed.spec_mode == mode and g.mixed.mtp == (draft == "mtp")
    if draft == "mtp":
        for r in (p.g, p.e):
            r.mtp.hidden.zero_()
    old = [p.new() for _ in range(4)]
    p.vstep([item(s, toks(n)) for s, n in zip(old, (1, 63, 64, 65))])
    p.vstep(verifies=old)                                          # a verify graph
    p.accept(old, (4, 1, 2, 3))
    a, b = p.new(), p.new()
    p.vstep([item(a, toks(9)), item(b, toks(20))], verifies=old)   # prefill + 4 verifies: (32, 2, 32, 4, 4)
    assert MixedKey(32, 2, 32, 4, L) in g.mixed._views
    p.accept(old, (2, 4, 1, 1), device=True)
    prod, c1, c2, c3 = (p.new() for _ in range(4))                 # a checkpoint group beside verifies
    p.vstep([item(prod, toks(21)), item(c1, toks(1), producer=0), item(c2, toks(5), producer=0),
             item(c3, toks(20), producer=0, all_logits=True)], verifies=old)
    p.accept(old, (3, 3, 4, 2))
    d1, d2 = p.new(), p.new()                                      # READY-checkpoint consumers beside verifies
    p.vstep([item(d1, toks(3), checkpoint=prod), item(d2, toks(30), checkpoint=prod)], verifies=[c1, c2],
            ready={prod[0].slot})
    p.accept([c1, c2], (1, 4), device=True)
    p.vstep([item(b, toks(13))], decodes=dec([a, c3, d1, d2]))     # decodes beside prefill: the L = 1 bucket
    p.vstep([item(b, toks(12))], verifies=[c1])                   # a continuation beside one verify
    p.accept([c1], (2,))
    group = [*old, a, c1, c2, c3]
    p.vstep([item(d1, toks(8)), item(d2, toks(1))], verifies=group)    # 8 verifies
    p.accept(group, (1, 2, 3, 4, 4, 3, 2, 1), device=True)
    p.vstep(verifies=[*group[:2], b, d1])                          # a verify graph after them
    p.accept([*group[:2], b, d1], (2, 2, 3, 1))
    p.vstep(decodes=dec(group))                                    # flushes the pending tokens (replay)
    st = g.stats
    assert st["mixed_verify"] == 5 and st["mixed_eager"] == 7 and st["fallback"] == 0 and st["eager"] == 3
    # what a capture runs first: every row padding; writes no pool, scratch, KV or live hidden byte
    before = {n: t.clone() for n, (t, _) in state_buffers(p.g).items()}
    kv = p.g.pages.k_pools.clone(), p.g.pages.v_pools.clone()
    hidden = p.g.mtp.hidden[:-1].clone() if p.mtp else None
    for key in [k for k in g.mixed._views if k.verify]:
        g._lens[key] = g.mixed.fill(key, MixedStep([], [], [], [], [0], [], [], [], 0, [], [], [], []))
        g._forward(key)
    for n, (t, _) in state_buffers(p.g).items():
        assert torch.equal(t, before[n]), n
    assert torch.equal(p.g.pages.k_pools, kv[0]) and torch.equal(p.g.pages.v_pools, kv[1])
    if p.mtp:
        assert torch.equal(p.g.mtp.hidden[:-1], hidden)


def test_decodes_and_verifies_beside_prefill_step_eagerly(seed):
    """No bucket holds decode and verify rows together: such a step is the ordinary eager one (counted)."""
    p = SpecPair("replay", "ngram")
    a, b, c = p.new(), p.new(), p.new()
    p.vstep([item(a, toks(20)), item(b, toks(9))])
    p.vstep([item(c, toks(12))], decodes=dec([a]), verifies=[b])
    p.accept([b], (3,))
    st = p.g.graphs.stats
    assert st["fallback"] == 1 and st["mixed_verify"] == 0 and st["mixed_eager"] == 1


def test_triton_kernels_mixed_verify_step(seed):
    """The Triton kernels (interpreted on the CPU) on a padded mixed step with verify rows (replay mode, MTP drafts:
    the draft, the GDN verify's pending rows, the head's feed): live rows, pools, pending buffers and hidden rows
    as the eager Triton step's (close: the kernels take other launch shapes), padding rows writing nothing."""
    p = SpecPair("replay", "mtp", backend="triton")
    layers = [m for r in (p.g, p.e) for m in [*r.model.gdn_layers(), *r.model.attention_layers(), r.mtp.head.attention]]
    a, b = p.new(), p.new()
    for m in layers:                                               # the first prefill on the PyTorch path (faster)
        m.backend = "torch"
    p.vstep([item(a, toks(5)), item(b, toks(4))], exact=False)
    for m in layers:
        m.backend = "triton"
    p.vstep([item(p.new(), toks(3))], verifies=[a, b], exact=False)
    p.accept([a, b], (3, 1), exact=False)
    assert p.g.graphs.stats["mixed_verify"] == 1


PROMPTS = ["abcabcabcabcabc", "the cat sat on the mat, the cat sat on the", "Shared doc.<|state_checkpoint|>q1",
           "Shared doc.<|state_checkpoint|>q22", "xyz", "hello hello hello", "0123456789"]
MAX_TOKENS = (5, 14, 9, 16, 7, 11, 8)          # requests end at different steps: the next one prefills beside verifies


def run(llm: LLM) -> list[list[int]]:
    """Every prompt with its own max_tokens (greedy), submitted at once; the outputs in prompt order."""
    e = llm.engine
    ids = [e.submit(e.make_request(None, p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)))
           for p, n in zip(PROMPTS, MAX_TOKENS)]
    done = {}
    while len(done) < len(ids):
        done.update({o.request_id: o for o in e.step() if o.finished})
    return [done[i].outputs[0].token_ids for i in ids]


@pytest.fixture(scope="module")
def reference():
    return run(LLM(device="cpu", auto_checkpoints=False, max_num_seqs=3))


@pytest.mark.parametrize("draft,mode", [("ngram", "replay"), ("ngram", "intermediate"), ("mtp", "replay"),
                                        ("mtp", "intermediate")])
def test_engine_prefill_beside_verifies_equals_plain_greedy(reference, draft, mode):
    """Three requests at a time, ending at different steps: each later request prefills beside the running ones'
    verifies, in a mixed bucket with verify rows. Outputs equal the non-speculative run, and the accepted and
    drafted counts equal the same engine's with every step eager (the MTP head rigged to draft well)."""
    seen = []
    for graphs in (True, False):
        llm = LLM(device="cpu", spec_k=K, spec_mode=mode, spec_draft=draft, cuda_graphs=graphs, max_num_seqs=3)
        if draft == "mtp":
            _copy_head(llm)
        assert run(llm) == reference
        e = llm.engine
        seen.append((e.counts.spec_accepted, e.counts.spec_drafted))
        assert e.counts.spec_accepted > 0
        if graphs:
            assert e.runner.graphs.stats["mixed_verify"] > 0
            # a request one token from max_tokens verifies too (keeping one token): no step mixes decodes with
            # verifies, so none falls back to the eager path
            assert e.runner.graphs.stats["fallback"] == 0, e.runner.graphs.stats
        assert e.runner.state.check_integrity() == [] and e.runner.pages.check_integrity() == []
    assert seen[0] == seen[1]
