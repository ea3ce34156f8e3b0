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


def test_sampled_requests_speculate_too(reference):
    """Rejection sampling in the engine: with top_k = 1 the filtered distribution is one-hot, so sampled spec
    decoding must reproduce greedy exactly; with real sampling every request still completes."""
    llm = LLM(device="cpu", spec_k=2)
    topk1 = SamplingParams(temperature=0.7, top_k=1, max_tokens=24, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, topk1)] == reference
    assert llm.engine.counts.spec_drafted > 0
    outs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 10 and o.finished for o in outs)
