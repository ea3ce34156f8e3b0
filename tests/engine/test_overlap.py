"""The overlapped loop (EngineConfig.overlap; issue 26 part 2) on the CPU: step n + 1 is launched with step n's
sampled ids still on the device (a DecodeFeed over placeholders), step n's outputs are processed while it runs,
and come out one call late. Stops are seen one step late: the id decoded past a stop is discarded, never
emitted, and that sample's state (one id past) is not published. Outputs equal the serial loop's: greedy with
stop tokens, seeded sampling with logprobs; aborts of a request in flight leave nothing behind."""
from __future__ import annotations

import random

import pytest

from gdnserve.engine.sampling_params import SamplingParams
from gdnserve.entrypoints.llm import LLM

KW = {"device": "cpu", "max_num_seqs": 6, "num_pages": 48, "page_size": 8, "max_step_tokens": 64}
_rng = random.Random(26)
PROMPTS = [[_rng.randrange(3, 250) for _ in range(_rng.randint(2, 40))] for _ in range(6)]


@pytest.fixture(scope="module")
def engines():
    return LLM(**KW).engine, LLM(overlap=True, **KW).engine


def run(e, params: list[SamplingParams], abort_after: dict[int, int] | None = None):
    ids = [e.add_request(None, p, sp) for p, sp in zip(PROMPTS, params)]
    final, step = {}, 0
    while e.has_unfinished():
        step += 1
        for i, n in (abort_after or {}).items():
            if n == step:
                e.abort(ids[i])
        final.update({o.request_id: o for o in e.step() if o.finished})
    return [final.get(rid) for rid in ids]


def clean(e) -> None:
    assert e.runner.state.check_integrity() == [] and e.runner.pages.check_integrity() == []
    assert e.index.check_integrity() == [] and not e.scheduler.producing and not e.has_unfinished()
    e.evict_checkpoints(len(e.index))
    assert e.runner.state.num_free == e.runner.state.num_slots and e.runner.pages.num_free == e.runner.pages.num_pages


def test_the_next_step_reads_the_ids_on_the_device_and_outputs_come_one_call_late(engines):
    serial, ov = engines
    assert ov.overlap and not serial.overlap
    seen = []
    real = ov.runner.step

    def spy(prefills, decodes, verifies=(), ready=frozenset(), feed=None):
        seen.append(([t for _, t in decodes], feed))
        return real(prefills, decodes, verifies=verifies, ready=ready, feed=feed)
    ov.runner.step = spy
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        s_rid, o_rid = serial.add_request(None, PROMPTS[0], sp), ov.add_request(None, PROMPTS[0], sp)
        assert [o.outputs[0].token_ids for o in serial.step()] and ov.step() == []      # in flight
        first = ov.step()                                # the second step runs; the first one's id lands
        assert [o.outputs[0].token_ids for o in first if o.request_id == o_rid] == [serial.requests[s_rid]
                                                                                   .samples[0].token_ids[:1]]
        while ov.has_unfinished():
            ov.step()
        while serial.has_unfinished():
            serial.step()
    finally:
        ov.runner.step = real
    assert seen[1][0] == [0] and seen[1][1] is not None          # a placeholder, the id fed on the device
    assert len(seen) == 4                                        # the 4th id is the last: not decoded again
    clean(ov)


def test_stop_tokens_are_seen_one_step_late_and_nothing_past_them_is_emitted(engines):
    """Greedy requests stopping at a stop token, and a seeded n = 2 request whose first sample stops while the
    second goes on (the id decoded past the stop must be dropped, not appended to the stopped sample)."""
    serial, ov = engines
    free = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True) for _ in PROMPTS]
    free[2] = SamplingParams(temperature=0.9, seed=7, n=2, max_tokens=12, ignore_eos=True)
    ref = run(serial, free)
    s0, s1 = (c.token_ids for c in ref[2].outputs)
    j = next(j for j in range(1, 8) if s0[j] not in s1[:j + 3])          # sample 1 outlives sample 0's stop
    stops = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                            stop_token_ids=[o.outputs[0].token_ids[1 + i % 4]]) for i, o in enumerate(ref)]
    stops[2] = SamplingParams(temperature=0.9, seed=7, n=2, max_tokens=12, ignore_eos=True, stop_token_ids=[s0[j]])
    want, got = run(serial, stops), run(ov, stops)
    n0, n1 = (len(c.token_ids) for c in want[2].outputs)
    assert n0 < n1                                                        # the path under test ran
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    assert [[c.finish_reason for c in o.outputs] for o in got] == [[c.finish_reason for c in o.outputs]
                                                                   for o in want]
    assert all(c.token_ids[-1] in sp.stop_token_ids for o, sp in zip(got, stops) for c in o.outputs
               if c.finish_reason == "stop")
    clean(ov)
    clean(serial)


def test_seeded_sampling_and_logprobs_equal_the_serial_loop(engines):
    serial, ov = engines
    params = [SamplingParams(temperature=0.8, top_k=20, seed=100 + i, max_tokens=6 + i, logprobs=2, ignore_eos=True)
              for i in range(len(PROMPTS))]
    want, got = run(serial, params), run(ov, params)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert [sorted(d) for d in g.outputs[0].logprobs] == [sorted(d) for d in w.outputs[0].logprobs]
        assert g.outputs[0].cumulative_logprob == pytest.approx(w.outputs[0].cumulative_logprob, abs=1e-5)
    clean(ov)


def test_an_abort_while_its_step_is_in_flight(engines):
    serial, ov = engines
    sp = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True) for _ in PROMPTS]
    want = run(serial, sp)
    got = run(ov, sp, abort_after={1: 3, 4: 2})
    for i, (w, g) in enumerate(zip(want, got)):
        if i in (1, 4):
            assert g is None or g.outputs[0].finish_reason == "abort"
        else:
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
    clean(ov)


def test_a_failed_step_behind_a_stop_does_not_bring_the_stopped_request_back(engines):
    """A step fails while the step in which request A hits its stop token is in flight: that step lands first (A
    finishes and leaves), then the failed one (A's decode past its stop among it) is rolled back: A must not be
    requeued; B gives its serial output; nothing leaks."""
    serial, ov = engines
    free = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, seed=3, max_tokens=6, ignore_eos=True)   # (greedy ids repeat here)
    ref = [o.outputs[0].token_ids for o in run(serial, [seeded, free])]
    toks, pa, pb = ref[0], PROMPTS[0], PROMPTS[1]
    j = next(j for j in range(1, 6) if toks[j] not in toks[:j])        # A stops at its token j (call j + 1) ...
    stop = SamplingParams(temperature=0.9, seed=3, max_tokens=6, ignore_eos=True, stop_token_ids=[toks[j]])
    a, b = ov.add_request("A", pa, stop), ov.add_request("B", pb, free)
    real, calls = ov.runner.step, [0]

    def fail_third(*args, **kw):
        calls[0] += 1
        if calls[0] == j + 2:                     # ... and the next call, its decode past the stop in it, fails
            raise RuntimeError("injected")
        return real(*args, **kw)
    ov.runner.step = fail_third
    final, raised = {}, 0
    try:
        for _ in range(60):
            if not ov.has_unfinished():
                break
            try:
                final.update({o.request_id: o for o in ov.step() if o.finished})
            except RuntimeError:
                raised += 1
    finally:
        ov.runner.step = real
    assert raised == 1 and not ov.has_unfinished() and not ov.waiting
    assert final[a].outputs[0].finish_reason == "stop" and final[a].outputs[0].token_ids == toks[:j + 1]
    assert final[b].outputs[0].token_ids == ref[1]
    clean(ov)


def test_a_stopped_sample_of_n_frees_its_slot_and_pages_as_it_lands():
    """n = 2, sample 0 stops at a stop token while the next step is already decoding it: its state slot and KV
    pages go back when its stop lands (one step later than the serial loop sees it), not when the whole request
    ends (the review found them held until then)."""
    kw = {"device": "cpu", "max_num_seqs": 6, "num_pages": 48, "page_size": 8, "max_step_tokens": 64}
    prompt = [random.Random(2).randrange(3, 250) for _ in range(30)]
    sp = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=30, ignore_eos=True)
    e = LLM(overlap=False, **kw).engine
    rid = e.add_request(None, prompt, sp)
    while e.has_unfinished():
        outs = [o for o in e.step() if o.request_id == rid and o.finished]
    stop = outs[0].outputs[0].token_ids[2]
    assert stop not in outs[0].outputs[1].token_ids[:6]
    e = LLM(overlap=True, **kw).engine
    rid = e.add_request(None, prompt, SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=30, ignore_eos=True,
                                                     stop_token_ids=[stop]))
    held = []
    while e.has_unfinished():
        e.step()
        req = e.requests.get(rid)
        if req is not None and req.samples[0].finish_reason == "stop" and req.samples[1].finish_reason is None:
            held.append(req.samples[0].seq is not None)
    assert held and not any(held), held


def test_a_failed_read_back_rolls_back_the_step_launched_behind_it(monkeypatch):
    """The in-flight step's read-back raises while the step behind it (which admitted a new request) is launched:
    both are rolled back, one error surfaces, and every request still gives its solo output (the launched step
    used to be dropped unsettled: its new request ran later with no tokens, an IndexError in the next schedule)."""
    from gdnserve.engine.scheduling import step_batch
    kw = {"device": "cpu", "max_num_seqs": 6, "num_pages": 48, "page_size": 8, "max_step_tokens": 64}
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(20, 40))] for _ in range(3)]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    solo = LLM(overlap=False, **kw).engine
    ref = {}
    for i, p in enumerate(prompts):
        rid = solo.add_request(f"r{i}", p, sp)
        while solo.has_unfinished():
            for o in solo.step():
                if o.finished and o.request_id == rid:
                    ref[rid] = o.outputs[0].token_ids
    e = LLM(overlap=True, **kw).engine
    for i in range(2):
        e.add_request(f"r{i}", prompts[i], sp)
    real, calls = step_batch.Sampled.result, {"n": 0}

    def flaky(self):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected read-back failure")
        return real(self)
    monkeypatch.setattr(step_batch.Sampled, "result", flaky)
    got, errors = {}, []
    for i in range(60):
        if i == 2:
            e.add_request("r2", prompts[2], sp)      # admitted by the step launched as the failing one lands
        if i > 2 and not e.has_unfinished():
            break
        try:
            for o in e.step():
                if o.finished:
                    got[o.request_id] = o.outputs[0].token_ids
        except RuntimeError as err:
            errors.append(str(err))
    assert errors == ["injected read-back failure"] and got == ref
    assert e.runner.state.check_integrity() == [] and e.runner.pages.check_integrity() == []
