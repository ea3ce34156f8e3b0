"""Chunked checkpoint producers: a checkpoint prefix longer than the step budget is prefilled chunk by chunk into
its PENDING checkpoint; requests naming the same prefix meanwhile wait (without blocking requests behind them) and
run as READY hits once it is published; an aborted, failed or preempted producer hands the prefix to a waiter, and
page starvation never leaves a waiter hanging. Greedy outputs equal the same prompts without checkpoints in one
big-budget run, in every prefill executor."""
from __future__ import annotations

import random

import pytest

from gdnserve.engine.cache.checkpoint_index import CheckpointStatus
from gdnserve.engine.sampling_params import SamplingParams
from gdnserve.entrypoints.llm import LLM

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
TWO = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, n=2)
QUICK = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
BUDGET = 64
_rng = random.Random(1234)
PRE = [_rng.randrange(3, 250) for _ in range(300)]          # the shared prefix: 300 tokens, > 4 step budgets
C = len(PRE)
TAILS = {name: [_rng.randrange(3, 250) for _ in range(k)] for name, k in
         (("p", 7), ("w1", 5), ("w2", 9), ("w3", 3), ("late", 6))}
SHORT = [_rng.randrange(3, 250) for _ in range(10)]         # an unrelated request
XS = [[_rng.randrange(3, 250) for _ in range(31)] for _ in range(6)]   # unrelated requests (page pressure)
EIGHT = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
CHUNKS = [64, 64, 64, 64, 44]                                # the prefix's chunks alone in a 64-token budget


def engine(mode: str = "fused", budget: int = BUDGET, num_pages: int = 256):
    return LLM(device="cpu", max_num_seqs=16, num_pages=num_pages, auto_checkpoints=False, max_step_tokens=budget,
               prefill_mode=mode).engine


@pytest.fixture(scope="module")
def want():
    """Greedy tokens of every prompt without a checkpoint, all in one big-budget step (nothing chunked)."""
    e = engine(budget=4096)
    ids = {name: e.add_request(name, PRE + t, GREEDY) for name, t in TAILS.items()}
    ids["short"] = e.add_request("short", SHORT, QUICK)
    ids["p2"] = e.add_request("p2", PRE + TAILS["p"], TWO)
    for i, x in enumerate(XS):
        ids[f"x{i}"] = e.add_request(f"x{i}", x, EIGHT)
    out = {}
    while e.has_unfinished():
        out.update({o.request_id: [c.token_ids for c in o.outputs] for o in e.step() if o.finished})
    assert out["p2"] == [out["p"][0]] * 2
    return out


class Driver:
    """Steps an engine, recording per step its prefill tokens and decode/verify rows, each request's first-token
    step and its final output."""

    def __init__(self, e):
        self.e, self.steps, self.done, self.first_token = e, [], {}, {}
        real = e.runner.step

        def spy(prefills, decodes, verifies=(), ready=frozenset()):
            self.steps.append((sum(len(it.tokens) for it in prefills), len(decodes) + sum(len(v) for _, v in verifies)))
            return real(prefills, decodes, verifies=verifies, ready=ready)
        e.runner.step = spy

    def add(self, name, prompt, params=GREEDY, at=C):
        return self.e.add_request(name, prompt, params, checkpoint_at=at)

    def step(self):
        for o in self.e.step():
            if o.outputs[0].token_ids:
                self.first_token.setdefault(o.request_id, len(self.steps))
            if o.finished:
                self.done[o.request_id] = o

    def pending(self) -> bool:
        return tuple(PRE) in self.e.scheduler.producing

    def drain(self):
        while self.e.has_unfinished():
            self.step()

    def check_budget(self):
        for prefill, rows in self.steps:        # a step exceeds the budget by its decode/verify rows at most
            assert prefill <= BUDGET, self.steps


def no_leaks(e):
    assert e.runner.state.check_integrity() == [] and e.runner.pages.check_integrity() == []
    assert e.index.check_integrity() == [] and e.index.stats()["entries_pending"] == 0
    assert not e.scheduler.producing and not e.waiting and not e.running
    e.evict_checkpoints(len(e.index))                                   # every READY checkpoint gone: every slot and page free
    assert len(e.index) == 0 and not e.ckpt_pages
    assert e.runner.state.num_free == e.runner.state.num_slots and e.runner.pages.num_free == e.runner.pages.num_pages


@pytest.mark.parametrize("mode", ["fused", "two_phase", "two_phase_indexed", "serial"])
def test_producer_is_chunked_and_waiters_hit_it(want, mode):
    """P (n=2) and W1 in the first pass, W2 while the prefix is chunked, W3 once it is READY: the prefix runs in
    ceil(300/64) steps into the PENDING checkpoint, nobody waits on it for more, every output is exact."""
    d = Driver(engine(mode))
    e = d.e
    d.add("p2", PRE + TAILS["p"], TWO)
    d.add("w1", PRE + TAILS["w1"])
    d.step()
    entry = e.running[0].prod.entry
    assert entry.status is CheckpointStatus.PENDING and d.pending() and [r.request_id for r in e.waiting] == ["w1"]
    d.add("w2", PRE + TAILS["w2"])
    for _ in range(len(CHUNKS) - 1):
        assert d.pending() and entry.status is CheckpointStatus.PENDING
        d.step()
    assert entry.status is CheckpointStatus.READY and not d.pending() and entry.refcount == 1   # pinned by P
    assert [p for p, _ in d.steps] == CHUNKS and not d.first_token      # the prefix alone, chunk by chunk
    d.add("w3", PRE + TAILS["w3"])
    d.step()                       # P's samples and every waiter start from the READY checkpoint in one step
    assert {"p2", "w1", "w2", "w3"} <= d.first_token.keys() and d.steps[-1][0] == 2 * 7 + 5 + 9 + 3
    d.add("late", PRE + TAILS["late"])
    d.drain()
    d.check_budget()
    assert [c.token_ids for c in d.done["p2"].outputs] == want["p2"]
    for name in ("w1", "w2", "w3", "late"):
        assert [c.token_ids for c in d.done[name].outputs] == want[name], name
        ck = d.done[name].checkpoint
        assert ck.hit_length == C and ck.miss_reason is None and not ck.published
    ck = d.done["p2"].checkpoint
    assert ck.hit_length == 0 and ck.miss_reason == "absent" and ck.published
    assert e.counts.checkpoints_published == 1 and e.counts.checkpoint_hits == 4
    assert e.counts.checkpoint_misses == {"absent": 1}
    assert len(e.index) == 1 and entry.refcount == 0
    no_leaks(e)


def test_waiters_do_not_block_requests_behind_them(want):
    """An unrelated short request queued behind a long producer and a waiting consumer is admitted in the first
    step (a chunked start goes after the jobs that fit whole) while the prefix is still PENDING, and finishes
    before the waiter gets a token; the producer's first chunk shrinks to make room for it."""
    d = Driver(engine())
    d.add("p", PRE + TAILS["p"])
    d.add("w1", PRE + TAILS["w1"])
    d.add("short", SHORT, QUICK, at=None)
    d.step()
    assert [r.request_id for r in d.e.waiting] == ["w1"]                # short passed the long producer
    while "short" not in d.done:
        d.step()
        assert "w1" not in d.first_token
    assert d.pending()                                     # done before the producer's prefix is
    d.drain()
    d.check_budget()
    assert d.steps[0][0] == BUDGET                         # short (10) + the prefix's first chunk (54) share step 1
    for name in ("p", "w1", "short"):
        assert [c.token_ids for c in d.done[name].outputs] == want[name], name
    assert d.first_token["short"] < d.first_token["p"] and d.first_token["w1"] == d.first_token["p"]
    no_leaks(d.e)


@pytest.mark.parametrize("when", ["chunking", "ready"])
def test_aborted_producer_hands_the_prefix_to_a_waiter(want, when):
    """The producer is aborted while waiters wait: mid-chunking the PENDING entry and its pages are dropped and the
    first waiter produces the prefix again; after its last chunk (READY, pinned by it) only its reference goes.
    Either way every waiter completes with exact outputs and nothing leaks."""
    d = Driver(engine())
    e = d.e
    d.add("p", PRE + TAILS["p"])
    d.add("w1", PRE + TAILS["w1"])
    d.add("w2", PRE + TAILS["w2"])
    for _ in range(2 if when == "chunking" else len(CHUNKS)):
        d.step()
    free_pages = e.runner.pages.num_free
    e.abort("p")
    if when == "chunking":
        assert not d.pending() and len(e.index) == 0 and e.runner.pages.num_free > free_pages
        assert e.counts.checkpoints_published == 0
    else:
        assert len(e.index) == 1 and next(iter(e.ckpt_pages.values())).length == C
    d.drain()
    d.check_budget()
    assert "p" not in d.done
    for name in ("w1", "w2"):
        assert [c.token_ids for c in d.done[name].outputs] == want[name], name
    w1, w2 = d.done["w1"].checkpoint, d.done["w2"].checkpoint
    if when == "chunking":
        assert w1.published and w1.miss_reason == "absent" and w1.hit_length == 0
    else:
        assert not w1.published and w1.hit_length == C
    assert w2.hit_length == C and not w2.published
    assert e.counts.checkpoints_published == 1
    no_leaks(e)


def test_a_failed_chunk_step_drops_the_pending_prefix(want):
    """A step that fails while the prefix is chunked drops the PENDING checkpoint (half written) and requeues its
    producer; the engine goes on and produces the same outputs."""
    d = Driver(engine())
    e = d.e
    d.add("p", PRE + TAILS["p"])
    d.add("w1", PRE + TAILS["w1"])
    d.step()
    real = e.runner.step
    e.runner.step = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected"))
    with pytest.raises(RuntimeError, match="injected"):
        e.step()
    e.runner.step = real
    assert not d.pending() and len(e.index) == 0 and [r.request_id for r in e.waiting] == ["p", "w1"]
    d.drain()
    for name in ("p", "w1"):
        assert [c.token_ids for c in d.done[name].outputs] == want[name], name
    assert d.done["p"].checkpoint.published and d.done["w1"].checkpoint.hit_length == C
    assert e.counts.checkpoints_published == 1
    no_leaks(e)


def test_a_preempted_producer_drops_its_pending_prefix(want):
    """Six running requests each need a new KV page while the prefix is chunked: the producer (the newest request)
    is preempted mid-chunking — its PENDING checkpoint and pages dropped, the waiter left waiting — and produces the
    prefix again once there is room (a chunked producer is admitted only when its whole prefix fits). Outputs are
    exact and nothing leaks."""
    d = Driver(engine(budget=256, num_pages=32))          # 16-token pages: the prefix alone takes 19
    e = d.e
    for i, x in enumerate(XS):                            # 31 tokens: their second decode starts a third page
        d.add(f"x{i}", x, EIGHT, at=None)
    d.step()
    assert len(e.running) == len(XS)
    d.add("p", PRE + TAILS["p"])
    d.add("w1", PRE + TAILS["w1"])
    dropped = False
    while e.has_unfinished():
        was = d.pending()
        d.step()
        dropped |= was and not d.pending() and "p" in [r.request_id for r in e.waiting]
    assert dropped and e.counts.preemptions == 1
    for name in ["p", "w1"] + [f"x{i}" for i in range(len(XS))]:
        assert [c.token_ids for c in d.done[name].outputs] == want[name], name
    assert d.done["p"].checkpoint.published and d.done["w1"].checkpoint.hit_length == C
    assert e.counts.checkpoints_published == 1 and e.counts.checkpoint_misses == {"absent": 1}
    no_leaks(e)


def test_a_checkpoint_that_leaves_its_consumer_no_room_never_hangs(want):
    """A page pool that holds the READY prefix and just one consumer's pages beside it (the page need is exact:
    KVCache.pages_for): the waiter runs from the checkpoint instead of waiting forever. (Were it one page short,
    with nothing else running it would drop the checkpoint and compute the prefix itself; with exact needs a
    prefix that fits with one consumer always fits with another of the same size.)"""
    d = Driver(engine(num_pages=21))
    e = d.e
    d.add("p", PRE + TAILS["p"])
    d.add("w1", PRE + TAILS["w1"])
    d.drain()
    for name in ("p", "w1"):
        assert [c.token_ids for c in d.done[name].outputs] == want[name], name
    w1 = d.done["w1"].checkpoint
    assert w1.hit_length == C and w1.miss_reason is None and e.runner.pages.num_pages == 21
    no_leaks(e)


@pytest.mark.parametrize("mode", ["fused", "serial"])
def test_n_samples_of_a_prompt_longer_than_a_step_fork_from_a_chunked_producer(want, mode):
    """n = 2 samples of a 307-token prompt with no marker under a 64-token budget: they fork from the prompt
    minus its last token, which no step holds; it is produced chunk by chunk (published there), every step stays
    within the budget (the activation plan's largest step), and both samples equal the big-budget run's. A second
    such request while the first one's prefix is chunked waits for it and hits it. (Before, the fork ran as one
    306-token step.)"""
    d = Driver(engine(mode))
    d.add("p2", PRE + TAILS["p"], TWO, at=None)
    d.step()
    assert d.e.running[0].prod is not None and d.e.running[0].prod.end == len(PRE + TAILS["p"]) - 1
    d.add("again", PRE + TAILS["p"], TWO, at=None)
    d.drain()
    d.check_budget()
    assert [c.token_ids for c in d.done["p2"].outputs] == want["p2"]
    assert [c.token_ids for c in d.done["again"].outputs] == want["p2"]
    assert d.done["p2"].checkpoint.published and d.done["again"].checkpoint.hit_length == len(PRE + TAILS["p"]) - 1
    no_leaks(d.e)


def test_n_samples_of_a_one_token_prompt_beyond_a_step_run_as_before():
    """n = 9 samples of a 1-token prompt under an 8-token budget: there is no fork point (nothing before the last
    token), so no producer is planned (a checkpoint at 0 tokens crashed admission in every step, review finding);
    the request and one beside it finish."""
    e = LLM(device="cpu", max_num_seqs=16, num_pages=256, auto_checkpoints=False, max_step_tokens=8).engine
    e.add_request("ok", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    e.step()
    e.add_request("x", [5], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, n=9))
    done = {}
    for _ in range(40):
        done.update({o.request_id: o for o in e.step() if o.finished})
        if not e.has_unfinished():
            break
    assert [len(c.token_ids) for c in done["x"].outputs] == [2] * 9 and len(done["ok"].outputs[0].token_ids) == 6


def unchunked(prompt: list[int], params: SamplingParams = EIGHT) -> list[int]:
    """Greedy tokens of ``prompt`` alone in one big-budget step, without a checkpoint."""
    e = engine(budget=4096)
    e.add_request("ref", prompt, params)
    out = []
    while e.has_unfinished():
        out += [o.outputs[0].token_ids for o in e.step() if o.finished]
    return out[0]


@pytest.mark.parametrize("mode", ["fused", "serial"])
def test_a_ready_hit_with_a_long_tail_continues_chunk_by_chunk(mode):
    """A READY checkpoint hit whose tail (200 tokens) is longer than the 64-token budget: its first chunk starts
    from the checkpoint, the rest continue on the request's own slot; no step exceeds the budget (before, the whole
    tail ran as one step, past the activation plan's largest step) and the greedy output equals the unchunked run's
    without a checkpoint."""
    tail = [random.Random(7).randrange(3, 250) for _ in range(200)]
    want_long = unchunked(PRE + tail)
    d = Driver(engine(mode))
    d.add("p", PRE + TAILS["p"])
    d.drain()
    d.steps.clear()
    d.add("long", PRE + tail, EIGHT)
    d.drain()
    d.check_budget()
    assert len(d.steps) > 200 // BUDGET and d.done["long"].checkpoint.hit_length == C
    assert d.done["long"].outputs[0].token_ids == want_long
    no_leaks(d.e)


@pytest.mark.parametrize("mode", ["fused", "serial"])
def test_a_chunked_producers_long_tail_continues_chunk_by_chunk(mode):
    """A marker request whose 300-token prefix is produced in chunks and whose own tail (200 tokens) is longer
    than the 64-token budget: once the prefix is READY the tail runs half a step from the checkpoint, then in
    chunks on the request's slot; no step exceeds the budget (before, the whole tail ran in the READY step) and the
    greedy output equals the unchunked run's without a checkpoint."""
    tail = [random.Random(11).randrange(3, 250) for _ in range(200)]
    want_long = unchunked(PRE + tail)
    d = Driver(engine(mode))
    d.add("long", PRE + tail, EIGHT)
    d.drain()
    d.check_budget()
    assert d.done["long"].outputs[0].token_ids == want_long and d.done["long"].checkpoint.published
    no_leaks(d.e)


def test_n_samples_with_long_tails_after_an_automatic_hit_stay_within_the_budget():
    """n = 2 samples whose prompt extends an automatic checkpoint by 150 tokens under a 64-token budget: the two
    tails from the hit would be one 300-token step; the fork point is produced in chunks instead, every step stays
    within the budget and both samples equal the unchunked run's greedy tokens."""
    e = LLM(device="cpu", max_num_seqs=16, num_pages=256, max_step_tokens=BUDGET).engine
    d = Driver(e)
    first = PRE[:100]
    d.add("first", first, QUICK, at=None)
    d.drain()
    d.steps.clear()
    prompt = first + list(d.done["first"].outputs[0].token_ids) + [random.Random(5).randrange(3, 250)
                                                                    for _ in range(150)]
    d.add("two", prompt, TWO, at=None)
    d.drain()
    d.check_budget()
    assert [c.token_ids for c in d.done["two"].outputs] == [unchunked(prompt, GREEDY)] * 2



def test_a_ready_producers_tail_counts_as_a_partial_prefill_and_shares_the_step():
    """max_partial_prefills = 1: the step in which a chunked producer's long tail starts (from its READY
    checkpoint) counts it as the one chunked prefill, so a long prompt queued meanwhile does not start chunking
    beside it (review finding); and three producers READY in one step share it: no step over the budget."""
    rng = random.Random(3)
    tail, other = [rng.randrange(3, 250) for _ in range(200)], [rng.randrange(3, 250) for _ in range(300)]
    d = Driver(engine())
    d.add("A", PRE + tail, EIGHT)
    d.step()
    d.add("B", other, EIGHT, at=None)
    while d.e.has_unfinished():
        d.step()
        assert sum(r.num_computed < len(r.prompt_ids) for r in d.e.running) <= 1
    d = Driver(LLM(device="cpu", max_num_seqs=16, num_pages=512, auto_checkpoints=False, max_step_tokens=256,
                   max_partial_prefills=3).engine)
    for i in range(3):
        d.e.add_request(f"P{i}", [rng.randrange(3, 250) for _ in range(700)], EIGHT, checkpoint_at=300)
    d.drain()
    assert max(p for p, _ in d.steps) <= 256, d.steps
