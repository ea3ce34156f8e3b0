"""Issue 12, items 1-6: sampling parameters normalised at admission, one-token prompts with prompt logprobs,
requests that can never fit refused at submission with the numbers, automatic checkpoints evicted for score,
score candidates beyond the free slots in waves."""
from __future__ import annotations

import random

import pytest

from gdnserve.engine.sampling_params import MIN_TOP_P, SamplingParams
from gdnserve.engine.scheduling.request import RequestError
from gdnserve.entrypoints.llm import LLM

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", max_num_seqs=4, num_pages=96)


def toks(outs):
    return [o.outputs[0].token_ids for o in outs]


def no_leak(e):
    assert e.runner.state.check_integrity() == [] and e.runner.pages.check_integrity() == []
    assert e.index.check_integrity() == [] and not e.has_unfinished()
    e.evict_checkpoints(len(e.index))
    assert e.runner.state.num_free == e.runner.state.num_slots and e.runner.pages.num_free == e.runner.pages.num_pages


def test_underflowing_top_p_and_temperature_are_their_limits(llm):
    """top_p 1e-50 is 0 in float32 and used to keep no token (the step raised, failing every bystander);
    temperature 1e-40 divided the logits into NaN. Both are normalised to their limits: the top token only,
    greedy."""
    assert SamplingParams(top_p=1e-50).top_p == MIN_TOP_P and SamplingParams(temperature=1e-40).greedy
    prompts = ["x", "bystander one", "bystander two"]
    want = toks(llm.generate(prompts, GREEDY))
    tiny_p = SamplingParams(temperature=1.0, top_p=1e-50, max_tokens=6, ignore_eos=True)
    tiny_t = SamplingParams(temperature=1e-40, max_tokens=6, ignore_eos=True)
    assert toks(llm.generate(prompts, tiny_p)) == want
    assert toks(llm.generate(prompts, tiny_t)) == want
    no_leak(llm.engine)


@pytest.mark.parametrize("kw", [{"prompt_logprobs": 0}, {"prompt_logprobs": 3, "logprobs": 1}])
def test_one_token_prompt_with_prompt_logprobs(llm, kw):
    """A one-token prompt has no prompt token to score: [None], and the requests batched with it are unharmed;
    the offline LLM keeps working afterwards."""
    e = llm.engine
    p = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, **kw)
    outs = llm.generate(["Q", "a longer prompt", "Z"], p)
    assert outs[0].prompt_logprobs == [None] and outs[2].prompt_logprobs == [None]
    assert len(outs[1].prompt_logprobs) == len(outs[1].prompt_token_ids)
    assert all(o.finished and o.error is None and len(o.outputs[0].token_ids) == 4 for o in outs)
    assert toks(llm.generate(["Q"], GREEDY))[0] == toks(llm.generate(["Q"], GREEDY))[0]
    no_leak(e)


def test_requests_that_never_fit_are_refused_with_the_numbers(llm):
    e = llm.engine
    big = SamplingParams(n=4, max_tokens=3000, ignore_eos=True)
    with pytest.raises(RequestError, match=r"4 x \(1 \+ 3000\).*KV pages") as err:
        e.add_request(None, "x", big)
    assert err.value.param == "n"                                     # the server's error names the field
    with pytest.raises(RequestError, match="n: 5 samples exceed max_num_seqs = 4") as err:
        e.add_request(None, "x", SamplingParams(n=5))
    assert err.value.param == "n"
    assert not e.has_unfinished()
    # one that fits later waits without blocking the requests behind it
    rid = e.add_request(None, "a" * 40, SamplingParams(n=4, max_tokens=8, ignore_eos=True, temperature=0.0))
    small = [e.add_request(None, f"small {i}", GREEDY) for i in range(3)]
    done = {}
    while e.has_unfinished():
        done.update({o.request_id: o for o in e.step() if o.finished})
    assert set(done) == {rid, *small}
    no_leak(e)


def test_n_samples_share_their_prompt_pages(llm):
    """n > 1 samples share the prompt's pages below their fork: a 400-token marked prefix with n = 4 needs ~30 of
    the 96 pages, not 4 x 26 = 104 (it was refused); it runs to the end. Without a marker they fork at the prompt
    minus its last token, and an automatic checkpoint of a short prefix is not taken where its fork would
    outgrow the pool while decoding (it would fail the request alone)."""
    e = llm.engine
    p = SamplingParams(n=4, max_tokens=4, ignore_eos=True, temperature=0.0)
    out = llm.generate("d" * 400 + "<|state_checkpoint|>tail.", p)[0]
    assert out.error is None and all(len(c.token_ids) == 4 for c in out.outputs) and out.checkpoint.published
    no_leak(e)
    llm.generate("Hi", SamplingParams(max_tokens=1, temperature=0.0))            # the automatic checkpoint of "Hi"
    assert len(e.index) == 1
    long = SamplingParams(n=4, max_tokens=30, ignore_eos=True, temperature=0.0)  # 4 x 25 pages from "Hi" > 96
    out = llm.generate("Hi" + "y" * 358, long)[0]
    assert out.error is None and all(len(c.token_ids) == 30 for c in out.outputs)
    assert out.checkpoint.hit_length == 0
    no_leak(e)


def test_score_evicts_automatic_checkpoints_and_runs_in_waves(llm):
    """After traffic, automatic checkpoints hold most state slots; a score with more candidates than free
    slots evicts them (a cache, never a reason to refuse) and runs its candidates in waves, with the same
    numbers as a roomy engine."""
    e = llm.engine
    rng = random.Random(7)
    llm.generate([f"turn {i} of a chat" for i in range(6)], GREEDY)
    assert len(e.index) >= 5
    prefix = [rng.randrange(3, 250) for _ in range(23)]
    cands = [[rng.randrange(3, 250) for _ in range(rng.randint(1, 9))] for _ in range(3 * e.runner.state.num_slots)]
    got = e.score(prefix, cands, label_token_ids=[5, 9])
    ref = LLM(device="cpu", max_num_seqs=64, num_pages=1024, auto_checkpoints=False).engine.score(prefix, cands, [5, 9])
    for a, b in zip(got.candidates, ref.candidates, strict=True):
        assert a.index == b.index and a.num_tokens == b.num_tokens
        assert abs(a.sum_logprob - b.sum_logprob) < 1e-3
        assert all(abs(a.label_probs[t] - b.label_probs[t]) < 1e-5 for t in (5, 9))
    no_leak(e)


def test_concurrent_score_jobs_share_steps_with_generation(llm):
    """Score jobs are requests like any other: several of them and generation requests in the same steps."""
    e = llm.engine
    rng = random.Random(3)
    jobs = []
    for _ in range(3):
        prefix = [rng.randrange(3, 250) for _ in range(rng.randint(1, 30))]
        cands = [[rng.randrange(3, 250) for _ in range(rng.randint(1, 5))] for _ in range(rng.randint(1, 6))]
        jobs.append((prefix, cands, e.add_score(prefix, cands)))
    gens = [e.add_request(None, f"generate {i}", GREEDY) for i in range(2)]
    steps, outs = 0, {}
    while e.has_unfinished():
        outs.update({o.request_id: o for o in e.step() if o.finished})
        steps += 1
    assert set(outs) == set(gens)
    ref = LLM(device="cpu", max_num_seqs=64, num_pages=1024, auto_checkpoints=False).engine
    for prefix, cands, rid in jobs:
        got, want = e.take_score(rid), ref.score(prefix, cands)
        assert all(abs(a.sum_logprob - b.sum_logprob) < 1e-3 for a, b in zip(got.candidates, want.candidates, strict=True))
    no_leak(e)
