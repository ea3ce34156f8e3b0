"""Preemption under KV-page pressure, n > 1 samples included: a preempted request frees every sample's state slot
and pages, is requeued first and recomputed (its samples forking from the prompt again, each re-prefilling its own
output), and its outputs — greedy and seeded — are exactly those of a run without pressure."""
from __future__ import annotations

import pytest

from gdnserve.engine.sampling_params import SamplingParams
from gdnserve.entrypoints.llm import LLM

GREEDY3 = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=3, logprobs=0)
SEEDED3 = SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, n=3, seed=7, logprobs=0)
SEEDED1 = SamplingParams(temperature=0.9, top_k=50, max_tokens=24, ignore_eos=True, seed=11, logprobs=0)


def tight(num_pages: int, **kw) -> LLM:
    return LLM(device="cpu", max_num_seqs=16, num_pages=num_pages, page_size=8, **kw)


@pytest.fixture(scope="module")
def roomy():   # the unconstrained reference
    return LLM(device="cpu", max_num_seqs=16, num_pages=256, auto_checkpoints=False)


def drive(llm, reqs, later=(), later_at=0, max_steps=1000):
    """Run (prompt, params) requests to completion (``later`` ones added after ``later_at`` steps). Returns the
    outputs in order and, after every step, which requests wait preempted with which samples finished."""
    e = llm.engine
    ids = [e.add_request(None, p, sp) for p, sp in reqs]
    final, preempted = {}, []
    for step in range(max_steps):
        if step == later_at:
            ids += [e.add_request(None, p, sp) for p, sp in later]
        if not e.has_unfinished():
            break
        final.update({o.request_id: o for o in e.step() if o.finished})
        preempted += [(ids.index(r.request_id), tuple(s.finish_reason is not None for s in r.samples))
                      for r in e.waiting if any(s.token_ids for s in r.samples)]
    assert not e.has_unfinished(), "the engine stopped making progress"
    return [final[i] for i in ids], preempted


def assert_same(got, want):
    """Token ids and finish reasons identical; logprobs equal to rounding (the recompute prefills what was decoded)."""
    for g, w in zip(got, want, strict=True):
        assert [o.token_ids for o in g.outputs] == [o.token_ids for o in w.outputs]
        assert [o.finish_reason for o in g.outputs] == [o.finish_reason for o in w.outputs]
        for a, b in zip(g.outputs, w.outputs):
            assert max(abs(x[t] - y[t]) for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids)) < 1e-4


def assert_nothing_leaks(e):
    assert e.runner.state.check_integrity() == [] and e.runner.pages.check_integrity() == []
    assert e.index.check_integrity() == []
    e.evict_checkpoints(len(e.index))                                   # READY checkpoints hold the only slots and pages left
    assert e.runner.state.num_free == e.runner.state.num_slots and e.runner.pages.num_free == e.runner.pages.num_pages


@pytest.mark.parametrize("order,victims", [((0, 1, 2), {1, 2}), ((2, 1, 0), {0})])
def test_multi_sample_requests_are_preempted_with_identical_outputs(roomy, order, victims):
    """n = 3 greedy, n = 3 seeded and n = 1 seeded requests in a pool too small for all of them: the newest are
    preempted (seeded n = 3 and n = 1 in one order, greedy n = 3 in the other) and recomputed, and their outputs
    equal the unconstrained run's."""
    reqs = [[("first prompt: filler", GREEDY3), ("second prompt: words", SEEDED3), ("third one", SEEDED1)][i]
            for i in order]
    want, _ = drive(roomy, reqs)
    llm = tight(22, auto_checkpoints=False)
    got, preempted = drive(llm, reqs)
    assert_same(got, want)
    assert llm.engine.counts.preemptions > 0
    assert victims <= {order[i] for i, _ in preempted}           # requests that lost their state on the way
    assert_nothing_leaks(llm.engine)


def test_mixed_requests_with_checkpoint_groups_under_pressure_all_complete(roomy):
    """n > 1 and n = 1 requests, same-step checkpoint groups and a later wave that hits the READY checkpoint, with
    automatic checkpoints on, under page pressure: every request completes with the unconstrained outputs, and
    after the drain no state slot or KV page is leaked."""
    doc = "Shared document about hybrid models. <|state_checkpoint|>"
    first = [(doc + "Question A", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, n=2, logprobs=0)),
             (doc + "Question B?", SEEDED1), (doc + "C", SEEDED3),
             ("plain request", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=0)),
             ("another plain one", SamplingParams(temperature=0.7, max_tokens=20, ignore_eos=True, n=2, seed=3,
                                                  logprobs=0))]
    later = [(doc + "Question D", SEEDED3), (doc + "E", GREEDY3), ("plain request, again", SEEDED1),
             ("x", SEEDED3)]                                    # one prompt token: its samples recompute unforked
    want, _ = drive(roomy, first + later)
    llm = tight(40)
    got, preempted = drive(llm, first, later, later_at=4)
    assert_same(got, want)
    e = llm.engine
    assert e.counts.preemptions > 0
    assert {len(first), len(first) + 3} <= {i for i, _ in preempted}    # n = 3 forked and unforked were preempted
    assert any(o.checkpoint.hit_length > 0 for o in got[len(first):])    # the later wave found the prefix READY
    assert_nothing_leaks(e)


def test_partly_finished_samples_keep_their_outputs(roomy):
    """A seeded n = 3 request whose first sample has stopped (a stop token) when it is preempted: the finished
    sample keeps its output and is not recomputed, the other two continue their random streams unchanged."""
    toks = [o.token_ids for o in drive(roomy, [("second prompt: words", SEEDED3)])[0][0].outputs]
    stop = next(t for t in toks[0][1:6] if t not in toks[1] + toks[2])   # ends sample 0 early, only it
    params = SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, n=3, seed=7, logprobs=0,
                            stop_token_ids=(stop,))
    reqs = [("first prompt: filler", GREEDY3), ("second prompt: words", params)]
    want, _ = drive(roomy, reqs)
    assert [o.finish_reason for o in want[1].outputs] == ["stop", "length", "length"]
    llm = tight(18, auto_checkpoints=False)
    got, preempted = drive(llm, reqs)
    assert_same(got, want)
    assert (1, (True, False, False)) in preempted                # preempted with sample 0 finished, 1 and 2 not
    assert_nothing_leaks(llm.engine)
