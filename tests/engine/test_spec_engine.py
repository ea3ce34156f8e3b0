"""Speculative decoding through the engine loop (n-gram drafts, embedded model, CPU): greedy outputs are
identical with and without it, for k in {1, 2, 3}, both verify modes, checkpoint groups included."""
from __future__ import annotations

import pytest

from gdnserve.engine.sampling_params import SamplingParams
from gdnserve.entrypoints.llm import LLM

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_checkpoint_after_spec_decode_is_exact():
    """A request whose last verify ends exactly at max_tokens publishes the state of exactly its tokens."""
    llm = LLM(device="cpu", spec_k=1, spec_mode="replay")
    out = llm.generate("abcabcabcabcabc", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
    assert llm.engine.counts.spec_drafted > 0                  # a verify step (replay: pending flushed)
    nxt = out.prompt_token_ids + out.outputs[0].token_ids + list(b" more")
    warm = llm.generate(nxt, GREEDY)[0]
    cold = LLM(device="cpu", auto_checkpoints=False).generate(nxt, GREEDY)[0]
    assert warm.checkpoint.hit_length == len(out.prompt_token_ids) + 2
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
PROMPTS = ["abcabcabcabcabc", "the cat sat on the mat, the cat sat on the", "Shared doc.<|state_checkpoint|>q1",
           "Shared doc.<|state_checkpoint|>q2", "xyz"]


@pytest.fixture(scope="module")
def reference():
    return [o.outputs[0].token_ids for o in LLM(device="cpu", auto_checkpoints=False).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("mode", ["replay", "intermediate"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_spec_decode_equals_plain_greedy(reference, mode, k):
    llm = LLM(device="cpu", spec_k=k, spec_mode=mode)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    e = llm.engine
    assert e.counts.spec_drafted > 0                    # verify steps ran
    # automatic checkpoints published after spec decoding hold exactly their tokens: the next turn matches
    nxt = outs[0].prompt_token_ids + outs[0].outputs[0].token_ids + list(b" more")
    warm = llm.generate(nxt, GREEDY)[0]
    cold = LLM(device="cpu", auto_checkpoints=False).generate(nxt, GREEDY)[0]
    # (a request that hits max_tokens inside a multi-token acceptance consumed more tokens than it returns, so
    # it publishes nothing; whether or not the next turn hits, it must produce the cold run's tokens)
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert e.runner.state.check_integrity() == [] and e.runner.pages.check_integrity() == []


def test_cumulative_logprob_is_none_once_a_token_was_verified_without_logprobs():
    """A speculating request that did not ask for logprobs reports no cumulative logprob (its verified tokens'
    logprobs are not computed) rather than a partial sum; with logprobs, or without speculation, the sum."""
    plain = LLM(device="cpu", auto_checkpoints=False).generate(PROMPTS[:2], GREEDY)
    llm = LLM(device="cpu", spec_k=2)
    spec = llm.generate(PROMPTS[:2], GREEDY)
    assert llm.engine.counts.spec_drafted > 0
    assert all(o.outputs[0].cumulative_logprob is None for o in spec)
    assert all(o.outputs[0].cumulative_logprob < 0 for o in plain)


def test_sampled_requests_speculate_too(reference):
    """Rejection sampling in the engine: with top_k = 1 the filtered distribution is one-hot, so sampled spec
    decoding must reproduce greedy exactly; with real sampling every request still completes."""
    llm = LLM(device="cpu", spec_k=2)
    topk1 = SamplingParams(temperature=0.7, top_k=1, max_tokens=24, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, topk1)] == reference
    assert llm.engine.counts.spec_drafted > 0
    outs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 10 and o.finished for o in outs)


def test_stop_strings_and_logprobs_speculate():
    """Requests with stop strings or logprobs verify drafts too (they decoded one token a step before): the same
    tokens, text, finish reason and logprobs as without speculation, the tokens after a stop string inside an
    accepted run dropped."""
    plain = LLM(device="cpu", auto_checkpoints=False)
    base = plain.generate(PROMPTS, GREEDY)
    # a stop string that each output reaches a few characters in, so it can end the sample in the middle of a
    # multi-token acceptance
    stops = [o.outputs[0].text[5:7] for o in base]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[st] if st.strip() else None,
                             logprobs=2) for st in stops]
    params += [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=n) for n in (0, 1, 3, 5, 2)]
    PROMPTS2 = PROMPTS * 2
    want = [plain.generate([p], sp)[0] for p, sp in zip(PROMPTS2, params)]
    assert {len(w.outputs[0].token_ids) for w in want[:5]} < {1, 2, 3, 4, 5, 6, 7, 8} and all(
        len(w.outputs[0].token_ids) == 24 for w in want[5:])        # the stops end early, the rest run to 24
    for mode in ("replay", "intermediate"):
        llm = LLM(device="cpu", spec_k=3, spec_mode=mode)
        got = [o for p, sp in zip(PROMPTS2, params) for o in llm.generate([p], sp)]
        assert llm.engine.counts.spec_drafted > 0 and llm.engine.counts.spec_accepted > 0
        for g, w in zip(got, want):
            go, wo = g.outputs[0], w.outputs[0]
            assert (go.token_ids, go.text, go.finish_reason) == (wo.token_ids, wo.text, wo.finish_reason)
            assert len(go.logprobs) == len(wo.logprobs) == len(go.token_ids)
            for gd, wd, tok in zip(go.logprobs, wo.logprobs, go.token_ids):
                assert tok in gd and set(gd) == set(wd) and len(gd) <= 6
                assert all(abs(gd[t] - wd[t]) < 1e-4 for t in gd)
            assert abs(go.cumulative_logprob - wo.cumulative_logprob) < 1e-3
        # all ten in one batch (verify steps that mix rows with and without logprobs, and rows that stop)
        e, outs = llm.engine, {}
        rids = [e.add_request(None, w.prompt_token_ids, sp) for w, sp in zip(want, params)]
        while len(outs) < len(rids):
            outs.update((o.request_id, o) for o in e.step() if o.finished)
        for rid, w in zip(rids, want):
            go, wo = outs[rid].outputs[0], w.outputs[0]
            assert (go.token_ids, go.text, go.finish_reason) == (wo.token_ids, wo.text, wo.finish_reason)
            assert [set(d) for d in go.logprobs] == [set(d) for d in wo.logprobs]
        assert llm.engine.runner.state.check_integrity() == [] and llm.engine.runner.pages.check_integrity() == []
