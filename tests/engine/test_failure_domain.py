"""Issue 12: the failure domain of one request. A request that makes its step raise (at its prefill, or at a
later decode) is found among ten (the step rolled back, re-run without the new admissions, bisected) and fails
alone with its reason; the nine others give exactly their solo greedy outputs; nothing leaks."""
from __future__ import annotations

import pytest

from gdnserve.engine.sampling_params import SamplingParams
from gdnserve.entrypoints.llm import LLM

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [f"bystander {i}: " + "words " * (i % 4) for i in range(9)]
BAD = "the poisoned request"


@pytest.fixture(scope="module")
def solo():
    llm = LLM(device="cpu", max_num_seqs=16, num_pages=256, auto_checkpoints=False)
    return [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS]


def poison(e, when):
    """Make the runner raise whenever the bad request takes part in a step (``when``: at its prefill, or at
    its decodes once it has 3 tokens)."""
    real = e.runner.step

    def step(prefills, decodes, verifies=(), ready=frozenset(), **kw):
        bad = e.requests.get("bad")
        if bad is not None:
            seqs = [s.seq for s in bad.samples if s.seq is not None]
            if when == "prefill" and any(it.seq in seqs for it in prefills):
                raise RuntimeError("injected prefill failure")
            if when == "decode" and len(bad.samples[0].token_ids) >= 3 and any(s in seqs for s, _ in decodes):
                raise RuntimeError("injected decode failure")
        return real(prefills, decodes, verifies=verifies, ready=ready, **kw)
    e.runner.step = step


@pytest.mark.parametrize("when,auto,overlap", [("prefill", False, False), ("decode", False, False),
                                               ("prefill", True, False), ("decode", True, False),
                                               ("prefill", False, True), ("decode", True, True)])
def test_one_failing_request_among_ten(solo, when, auto, overlap):
    """``overlap``: the overlapped loop (a failing step lands the one in flight before its own rollback)."""
    llm = LLM(device="cpu", max_num_seqs=16, num_pages=256, auto_checkpoints=auto, overlap=overlap)
    e = llm.engine
    poison(e, when)
    ids = [e.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS[:5])]
    ids.insert(3, e.add_request("bad", BAD, GREEDY))
    ids += [e.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS[5:], 5)]
    final, raised = {}, 0
    for _ in range(200):
        if not e.has_unfinished():
            break
        try:
            final.update({o.request_id: o for o in e.step() if o.finished})
        except RuntimeError as err:
            assert "injected" in str(err)
            raised += 1
    assert raised == 1 and not e.has_unfinished()
    bad = final.pop("bad")
    assert bad.finished and "injected" in bad.error and bad.outputs[0].finish_reason == "abort"
    assert [final[f"r{i}"].outputs[0].token_ids for i in range(9)] == solo
    assert all(final[f"r{i}"].error is None for i in range(9))
    assert e.counts.requests_failed == 1
    assert e.runner.state.check_integrity() == [] and e.runner.pages.check_integrity() == []
    assert e.index.check_integrity() == []
    e.evict_checkpoints(len(e.index))
    assert e.runner.state.num_free == e.runner.state.num_slots and e.runner.pages.num_free == e.runner.pages.num_pages


def test_offline_generate_returns_the_failed_request_and_keeps_working(solo):
    llm = LLM(device="cpu", max_num_seqs=16, num_pages=256, auto_checkpoints=False)
    poison(llm.engine, "prefill")
    real = llm.engine.make_request

    def named(rid, prompt, params, checkpoint_at=None):        # the bad prompt gets the id the poison looks for
        return real("bad" if prompt == BAD else rid, prompt, params, checkpoint_at)
    llm.engine.make_request = named
    outs = llm.generate(PROMPTS[:3] + [BAD], GREEDY)
    assert [o.outputs[0].token_ids for o in outs[:3]] == solo[:3] and outs[3].error
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[3:5], GREEDY)] == solo[3:5]
