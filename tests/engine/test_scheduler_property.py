"""Property-based scheduler test (hypothesis): random arrivals, aborts, checkpoint groups, n = 2 forks, score
calls and speculative decoding, serial and overlapped loops, on an engine small enough to chunk long prompts and preempt under page pressure.
Invariants: after the drain no state slot or KV page is leaked (beyond READY checkpoints, which eviction frees),
and every greedy output equals the request run alone."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gdnserve.engine.sampling_params import SamplingParams
from gdnserve.entrypoints.llm import LLM

_rng = random.Random(12)
PREFIX = [_rng.randrange(3, 250) for _ in range(37)]
TAILS = [[_rng.randrange(3, 250) for _ in range(_rng.randint(1, 12))] for _ in range(6)]
PLAIN = [[_rng.randrange(3, 250) for _ in range(_rng.randint(1, 60))] for _ in range(6)]
CANDS = [[_rng.randrange(3, 250) for _ in range(_rng.randint(1, 6))] for _ in range(12)]

_ref_cache: dict = {}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    kw = dict(device="cpu", max_num_seqs=6, num_pages=20, page_size=8, max_step_tokens=64)
    # the spec engine also runs two prompts in partial prefill at once (fair chunk shares), plain one at a time;
    # the tiers engine has 8 state slots, so checkpoints are evicted to a host tier of ~3 of them and on to disk;
    # "overlap": the overlapped loop (step n + 1 launched with step n's ids on the device, outputs one step late)
    tiers = LLM(num_slots=8, checkpoint_host_memory_gb=7e-4, checkpoint_dir=str(tmp_path_factory.mktemp("ckpt")),
                **kw).engine
    return {"plain": LLM(**kw).engine, "spec": LLM(spec_k=2, max_partial_prefills=2, **kw).engine, "tiers": tiers,
            "overlap": LLM(overlap=True, **kw).engine,
            "ref": LLM(device="cpu", max_num_seqs=8, num_pages=512, auto_checkpoints=False).engine}


def reference(ref, ids, max_tokens):
    key = (tuple(ids), max_tokens)
    if key not in _ref_cache:
        rid = ref.add_request(None, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        while ref.has_unfinished():
            for o in ref.step():
                if o.request_id == rid and o.finished:
                    _ref_cache[key] = o.outputs[0].token_ids
    return _ref_cache[key]


def score_ref(ref, cands):
    key = ("score", tuple(map(tuple, cands)))
    if key not in _ref_cache:
        _ref_cache[key] = [c.sum_logprob for c in ref.score(PREFIX, cands).candidates]
    return _ref_cache[key]


op = st.tuples(st.integers(0, 6), st.sampled_from(["plain", "group", "fork", "score", "abort"]),
               st.integers(0, 5), st.integers(1, 16))

# the prefix group again and again, with plain prompts and forks between that push its checkpoint down
tier_op = st.tuples(st.integers(0, 14), st.sampled_from(["group", "score", "plain", "fork", "abort"]),
                    st.integers(0, 5), st.integers(1, 16))


@pytest.mark.parametrize("kind", ["plain", "spec", "overlap"])      # each loop gets its own examples
@settings(max_examples=3, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=1, max_size=10))
def test_random_traffic_drains_clean_with_solo_outputs(engines, kind, ops):
    drive(engines[kind], engines["ref"], ops)


@settings(max_examples=3, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=st.lists(tier_op, min_size=6, max_size=12))
def test_random_traffic_with_checkpoint_tiers(engines, ops):
    """The same with checkpoints copied down to host memory and disk and restored (restores the scheduler waits
    for): no leak, solo outputs."""
    e = engines["tiers"]
    drive(e, engines["ref"], ops)
    assert not e.kv.checkpoint_cache.restoring()
    tiers = e.kv.checkpoint_cache.tiers
    tiers.disk.flush()                  # the writer releases the blocks of what the host tier sent to disk
    assert tiers.arena.used == sum(hc.block.size for hc in tiers.host.values()) and not tiers.landing   # no leak


def drive(e, ref, ops):
    added: list[tuple[str, list[int], int, int]] = []    # (id, prompt, max_tokens, n)
    scores: list[tuple[str, list[list[int]]]] = []
    aborted: set[str] = set()
    final = {}
    for step in range(400):
        for at, what, i, m in ops:
            if at != step:
                continue
            if what == "abort":
                if added:
                    rid = added[i % len(added)][0]
                    aborted.add(rid)
                    e.abort(rid)
                continue
            if what == "score":
                cands = CANDS[i:i + m]
                scores.append((e.add_score(PREFIX, cands), cands))
                continue
            ids = PREFIX + TAILS[i] if what == "group" else PLAIN[i]
            n = 2 if what == "fork" else 1
            p = SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, n=n)
            rid = e.add_request(None, ids, p, len(PREFIX) if what == "group" else None)
            added.append((rid, ids, m, n))
        if step > 6 and not e.has_unfinished():
            break
        final.update({o.request_id: o for o in e.step() if o.finished})
    assert not e.has_unfinished()
    for rid, ids, m, n in added:
        if rid in aborted:
            continue
        want = reference(ref, ids, m)
        assert [c.token_ids for c in final[rid].outputs] == [want] * n, rid
    for rid, cands in scores:
        got = e.take_score(rid)
        assert all(abs(c.sum_logprob - w) < 1e-3 for c, w in zip(got.candidates, score_ref(ref, cands), strict=True))
    assert e.runner.state.check_integrity() == [] and e.runner.pages.check_integrity() == []
    assert e.index.check_integrity() == [] and not e.scheduler.producing
    e.evict_checkpoints(len(e.index))
    assert e.runner.state.num_free == e.runner.state.num_slots and e.runner.pages.num_free == e.runner.pages.num_pages
