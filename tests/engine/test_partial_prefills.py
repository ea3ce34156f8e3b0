"""Chunked prefill without head-of-line blocking (docs/serving.md "Chunked prefill"): a short request queued behind
many long prompts is admitted in the very next step, however many long prompts wait; running decodes get their token
every step; at most ``max_partial_prefills`` prompts are in partial prefill at once; a stream of short requests does
not starve a waiting long prompt; every greedy output equals the request's solo run."""
from __future__ import annotations

import random
from itertools import pairwise

import pytest

from gdnserve.engine.sampling_params import SamplingParams
from gdnserve.entrypoints.llm import LLM

BUDGET = 64
_rng = random.Random(31)
LONGS = [[_rng.randrange(3, 250) for _ in range(_rng.randint(150, 220))] for _ in range(6)]   # 3-4 step budgets
SHORTS = [[_rng.randrange(3, 250) for _ in range(k)] for k in (10, 24, 23, 25)]
DECODER = [_rng.randrange(3, 250) for _ in range(12)]
LONG_P = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
SHORT_P = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
DECODE_P = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


def engine(**kw):
    return LLM(device="cpu", max_num_seqs=16, num_pages=256, **{"auto_checkpoints": False, "max_step_tokens": BUDGET,
                                                                **kw}).engine


@pytest.fixture(scope="module")
def solo():
    """Greedy tokens of a prompt run alone on an engine whose budget chunks nothing."""
    ref, cache = engine(max_step_tokens=4096), {}

    def run(prompt, params):
        key = (tuple(prompt), params.max_tokens)
        if key not in cache:
            rid = ref.add_request(None, prompt, params)
            while ref.has_unfinished():
                for o in ref.step():
                    if o.request_id == rid and o.finished:
                        cache[key] = o.outputs[0].token_ids
        return cache[key]
    return run


class Driver:
    """Steps an engine, recording per step its prefill tokens + decode rows, the prompts in partial prefill after
    it, each request's first-token step and final output."""

    def __init__(self, e):
        self.e, self.steps, self.partial, self.first, self.done = e, [], [], {}, {}
        real = e.runner.step

        def spy(prefills, decodes, verifies=(), ready=frozenset()):
            self.steps.append(sum(len(it.tokens) for it in prefills) + len(decodes))
            return real(prefills, decodes, verifies=verifies, ready=ready)
        e.runner.step = spy

    def step(self):
        for o in self.e.step():
            if o.outputs[0].token_ids:
                self.first.setdefault(o.request_id, len(self.steps))
            if o.finished:
                self.done[o.request_id] = (len(self.steps), o.outputs[0].token_ids)
        self.partial.append([r.request_id for r in self.e.running if r.num_computed < len(r.prompt_ids)])


@pytest.mark.parametrize("n_long,limit,budget", [(2, 1, BUDGET), (6, 1, BUDGET), (6, 2, 2 * BUDGET)])
def test_a_short_request_passes_waiting_long_prompts(solo, n_long, limit, budget):
    """A decoding request runs; n long prompts (3-4 step budgets each) queue, then a short one: the short one gets its
    first token in the step after it arrives (it used to wait until every long prompt ahead of it had started: 2 and
    6 steps here, 67 s behind 16 x 4,000 tokens on the server), the decode advances every step, the long prompts
    are chunked, at most ``limit`` at once, and every output is the solo one. (Two chunks of MIN_CHUNK = 32 and the
    short prompt do not fit a 64-token step: limit 2 runs with twice the budget.)"""
    d = Driver(engine(max_partial_prefills=limit, max_step_tokens=budget))
    e = d.e
    e.add_request("d", DECODER, DECODE_P)
    d.step()
    for i in range(n_long):
        e.add_request(f"L{i}", LONGS[i], LONG_P)
    d.step()
    e.add_request("s", SHORTS[0], SHORT_P)
    arrival = len(d.steps)
    decoded = [len(e.requests["d"].samples[0].token_ids)]
    while e.has_unfinished():
        d.step()
        if "d" in e.requests:
            decoded.append(len(e.requests["d"].samples[0].token_ids))
    assert d.first["s"] == arrival + 1 and d.done["s"][0] == arrival + SHORT_P.max_tokens
    assert all(b == a + 1 for a, b in pairwise(decoded)), decoded           # one token every step
    assert max(d.steps) <= budget and max(map(len, d.partial)) == limit, (d.steps, d.partial)
    assert all(any(f"L{i}" in ids for ids in d.partial) for i in range(n_long)), d.partial   # each one chunked
    ends = [d.done[f"L{i}"][0] for i in range(n_long)]
    if limit == 1:
        assert ends == sorted(ends)                      # one at a time, in arrival order
    for rid, prompt, p in [("d", DECODER, DECODE_P), ("s", SHORTS[0], SHORT_P)] + [
            (f"L{i}", LONGS[i], LONG_P) for i in range(n_long)]:
        assert d.done[rid][1] == solo(prompt, p), rid
    assert e.runner.state.num_free == e.runner.state.num_slots and e.runner.pages.num_free == e.runner.pages.num_pages


def test_a_stream_of_short_requests_does_not_starve_a_long_prompt(solo):
    """Every step three short requests arrive, more than a step admits: the long prompt queued first still starts
    at once (MIN_CHUNK of the budget is held for it) and is prefilled in a bounded number of steps while short
    requests keep being admitted beside it."""
    d = Driver(engine())
    e = d.e
    e.add_request("L", LONGS[1], LONG_P)
    k = 0
    while "L" not in d.done:
        assert len(d.steps) < 12, d.steps            # 204 tokens at >= 32 a step, then its second token
        for p in SHORTS[1:]:
            e.add_request(f"s{k}", p, ONE)
            k += 1
        before = sum(rid != "L" for rid in d.done)
        d.step()
        assert sum(rid != "L" for rid in d.done) > before        # short ones are admitted (and done) every step
    assert d.first["L"] <= -(-len(LONGS[1]) // 32)
    while e.has_unfinished():
        d.step()
    assert d.done["L"][1] == solo(LONGS[1], LONG_P)
    assert all(d.done[f"s{i}"][1] == solo(SHORTS[1 + i % 3], ONE) for i in range(k))


def test_waiting_long_prompts_are_not_planned_again_every_step():
    """While a long prompt is chunked, the ones waiting behind it are known to be long (a plan looks a prefix up per
    READY checkpoint length): each is planned about twice (on arrival, and when it may start), not in every step."""
    e = engine(auto_checkpoints=True)
    e.add_request("c", SHORTS[0], SHORT_P)           # READY checkpoints exist: plans look them up
    while e.has_unfinished():
        e.step()
    calls = []
    real = e.kv.checkpoint_cache.search                  # admission's automatic prefix search
    e.kv.checkpoint_cache.search = lambda ids: calls.append(len(ids)) or real(ids)
    for i in range(4):
        e.add_request(f"L{i}", LONGS[i], LONG_P)
    steps = 0
    while e.has_unfinished():
        e.step()
        steps += 1
    assert steps > 12 and 4 <= len(calls) <= 3 * 4, (steps, calls)     # each planned at least once, the spy live


def test_a_waiting_long_prompt_hits_a_checkpoint_published_meanwhile(solo):
    """A prompt known to be long waits while another is chunked; a request that finishes meanwhile publishes the
    automatic checkpoint of most of it: the waiting prompt is admitted as a READY hit at once (the memo of long
    prompts checks every checkpoint added since), before the chunked one is done, with the solo output."""
    e = engine(auto_checkpoints=True)
    w_prompt = LONGS[5][:50]
    conv = w_prompt + solo(w_prompt, SHORT_P)[:-1]                     # what w's checkpoint will hold
    y_prompt = conv + SHORTS[0][:6]
    e.add_request("w", w_prompt, SHORT_P)
    e.add_request("x", LONGS[0] + LONGS[1], LONG_P)                   # ~370 tokens: chunked for many steps
    e.step()
    e.add_request("y", y_prompt, LONG_P)
    first, done = {}, {}
    while e.has_unfinished():
        for o in e.step():
            if o.outputs[0].token_ids:
                first.setdefault(o.request_id, o)
            if o.finished:
                done[o.request_id] = o
        if "y" in first:
            assert "x" not in first, "y waited for the chunked prompt"
            break
    assert done["w"].checkpoint.published and first["y"].checkpoint.hit_length == len(conv)
    while e.has_unfinished():
        done.update({o.request_id: o for o in e.step() if o.finished})
    assert done["y"].outputs[0].token_ids == solo(y_prompt, LONG_P)
    assert done["x"].outputs[0].token_ids == solo(LONGS[0] + LONGS[1], LONG_P)


def test_a_score_prefix_in_production_keeps_its_share_under_short_arrivals():
    """A long /v1/score prefix produced chunk by chunk waits in the queue, not among the running requests: the
    first pass must keep its share of the step (half the budget while short requests keep arriving), not leave
    it MIN_CHUNK (32) tokens a step (a 600-token prefix at budget 128 under four 30-token arrivals a step: 20 steps before, at most 12 now)."""
    e = engine(max_step_tokens=128)
    rng = random.Random(3)
    sid = e.add_score([rng.randrange(3, 250) for _ in range(600)], [[1, 2, 3]])
    k = 0
    for step in range(40):
        for _ in range(4):                          # short arrivals every step take what the first pass offers
            e.add_request(f"s{k}", [rng.randrange(3, 250) for _ in range(30)], SamplingParams(max_tokens=2,
                                                                                              temperature=0))
            k += 1
        e.step()
        if sid in e.scores:
            break
    assert sid in e.scores and step < 13, f"score prefix still in production after {step + 1} steps"
