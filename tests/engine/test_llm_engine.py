"""The engine loop on the embedded model: checkpoints and same-step pairing never change greedy outputs."""
from __future__ import annotations

import random

import pytest

from gdnserve.engine.engine_api import CheckpointInfo
from gdnserve.engine.llm_engine import RequestError
from gdnserve.engine.sampling_params import SamplingParams
from gdnserve.entrypoints.llm import LLM

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PREFIX = "You are ranking products. Context: a long shared document about hybrid models. "
SUFFIXES = ["Candidate A: fast", "Candidate B: exact and batched", "C", "Candidate D: other words entirely"]


@pytest.fixture(scope="module")
def llm():   # explicit checkpoints only; automatic ones have their own test
    return LLM(device="cpu", max_num_seqs=16, num_pages=256, auto_checkpoints=False)


def texts(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_checkpoint_groups_equal_plain_runs(llm):
    plain = texts(llm.generate([PREFIX + s for s in SUFFIXES], GREEDY))
    alone = [texts(llm.generate(PREFIX + s, GREEDY))[0] for s in SUFFIXES]
    assert plain == alone                                       # batching does not change greedy outputs
    marked = llm.generate([PREFIX + "<|state_checkpoint|>" + s for s in SUFFIXES], GREEDY)
    assert texts(marked) == plain                               # one producer, four same-step consumers
    assert marked[0].checkpoint.published and all(o.checkpoint.hit_length > 0 for o in marked[1:])
    e = llm.engine
    assert e.runner.state.check_integrity() == [] and e.runner.pages.check_integrity() == []
    assert e.index.check_integrity() == [] and len(e.index) == 1      # the prefix stays as a READY checkpoint
    # later requests hit it: state read in place, KV pages shared (tail page copied), same greedy output
    later = llm.generate([PREFIX + "<|state_checkpoint|>" + s for s in reversed(SUFFIXES)], GREEDY)
    assert texts(later) == plain[::-1]
    assert all(o.checkpoint.hit_length > 0 and o.checkpoint.miss_reason is None and not o.checkpoint.published
               for o in later)
    assert e.evict_checkpoints(len(e.index)) and len(e.index) == 0              # eviction frees slot and pages
    assert e.runner.state.num_free == e.runner.state.num_slots and e.runner.pages.num_free == e.runner.pages.num_pages
    again = llm.generate(PREFIX + "<|state_checkpoint|>" + SUFFIXES[0], GREEDY)[0]
    assert again.checkpoint.miss_reason == "evicted" and texts([again]) == plain[:1]


@pytest.mark.parametrize("mode", ["serial", "two_phase", "two_phase_indexed"])
def test_executors_give_identical_outputs(llm, mode):
    ref = texts(llm.generate([PREFIX + "<|state_checkpoint|>" + s for s in SUFFIXES], GREEDY))
    other = LLM(device="cpu", max_num_seqs=16, num_pages=256, prefill_mode=mode, auto_checkpoints=False)
    assert texts(other.generate([PREFIX + "<|state_checkpoint|>" + s for s in SUFFIXES], GREEDY)) == ref


def test_n_samples_fork_from_the_prompt(llm):
    one = llm.generate("Hello there", GREEDY)[0].outputs[0].token_ids
    many = llm.generate("Hello there", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=3))[0]
    assert [o.token_ids for o in many.outputs] == [one] * 3
    seeded = SamplingParams(temperature=0.8, max_tokens=8, seed=7, n=2, ignore_eos=True, logprobs=2)
    a, b = llm.generate("Hi", seeded)[0], llm.generate("Hi", seeded)[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert all(len(o.logprobs) == 8 and all(len(d) >= 1 for d in o.logprobs) for o in a.outputs)


def test_stop_strings_and_lengths(llm):
    out = llm.generate("abc", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    full = out.text
    if len(full) > 2:
        stop = full[2:4]
        cut = llm.generate("abc", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, stop=[stop]))[0]
        assert cut.outputs[0].finish_reason == "stop" and stop not in cut.outputs[0].text


def test_bad_requests_are_refused_and_nothing_leaks(llm):
    e = llm.engine
    with pytest.raises(RequestError, match="empty"):
        e.add_request(None, "", GREEDY)
    with pytest.raises(ValueError, match="marker"):
        e.add_request(None, "<|state_checkpoint|>abc", GREEDY)
    with pytest.raises(RequestError, match="context length"):
        e.add_request(None, "x" * 5000, GREEDY)
    for bad in ([1, 2, 10 ** 6], [-1, 3], [1, 2.0], [1, "2"], [1, 2 ** 70]):
        with pytest.raises(RequestError, match="vocabulary"):
            e.add_request(None, bad, GREEDY)
    rid = e.add_request(None, "to be aborted", SamplingParams(max_tokens=50))
    e.step()
    e.abort(rid)
    assert not e.has_unfinished()
    e.evict_checkpoints(len(e.index))
    assert e.runner.state.num_free == e.runner.state.num_slots and e.runner.pages.num_free == e.runner.pages.num_pages


def test_score_equals_full_sequence_logprobs(llm):
    """score(prefix, candidates): each candidate's log-probability equals the one computed from a plain
    forward over prefix + candidate (the prefix computed once, consumers in the same step)."""
    from gdnserve.engine.cache.sequence import PrefillItem
    e = llm.engine
    e.evict_checkpoints(len(e.index))            # the module's engine: whatever ran before in this process
    tok = e.tokenizer
    prefix, cands = "Question: which is best? Answer:", [" yes", " no", " maybe not"]
    res = e.score(prefix, cands, label_token_ids=[1, 2])
    p = tok.encode(prefix)
    for i, c in enumerate(cands):
        ids = p + tok.encode(c)
        seq = e.runner.new_seq()
        logits = e.runner.step([PrefillItem(seq, ids, all_logits=True)], [])
        e.runner.free_seq(seq)
        lp = logits.log_softmax(-1)
        want = sum(float(lp[j - 1, ids[j]]) for j in range(len(p), len(ids)))
        got = res.candidates[i]
        assert abs(got.sum_logprob - want) < 1e-4 and got.num_tokens == len(ids) - len(p)
        probs = logits[-1].softmax(-1)
        assert abs(got.label_probs[2] - float(probs[2])) < 1e-5
        assert got.checkpoint == (CheckpointInfo(0, "absent", True) if i == 0 else CheckpointInfo(len(p)))
    with pytest.raises(RequestError, match="candidates\\[1\\] is empty"):
        e.score(prefix, ["a", ""])
    with pytest.raises(RequestError, match="context length") as err:   # the context must hold the next token too
        e.score(prefix, ["a", "b" * (e.max_model_len - len(p))])
    assert err.value.param == "candidates[1]"
    with pytest.raises(RequestError, match="twice") as err:
        e.score(prefix, ["a"], label_token_ids=[3, 5, 3])
    assert err.value.param == "label_token_ids"
    assert len(e.index) == 1                     # the prefix stays cached as a READY checkpoint, evictable
    e.evict_checkpoints(len(e.index))
    assert e.runner.state.num_free == e.runner.state.num_slots


def test_a_failed_step_publishes_nothing(llm):
    e = llm.engine
    e.evict_checkpoints(len(e.index))
    real = e.runner.step
    e.runner.step = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected"))
    rid = e.add_request(None, PREFIX + "<|state_checkpoint|>tail", GREEDY)
    with pytest.raises(RuntimeError, match="injected"):
        e.step()
    e.runner.step = real
    assert len(e.index) == 0 and e.index.check_integrity() == []   # the PENDING checkpoint was dropped
    e.abort(rid)
    assert e.runner.state.num_free == e.runner.state.num_slots and e.runner.pages.num_free == e.runner.pages.num_pages
    assert texts(llm.generate(PREFIX + "<|state_checkpoint|>tail", GREEDY))    # and the engine goes on


def test_prompt_logprobs_plain_grouped_and_from_checkpoint(llm):
    """prompt_logprobs equal a plain full-prompt forward: for a plain prompt, for a same-step group (prefix rows
    from the producer), and for a prompt whose marked prefix is READY (a checkpoint keeps no logits: the request
    ignores it and computes the whole prompt)."""
    from gdnserve.engine.cache.sequence import PrefillItem
    e = llm.engine
    e.evict_checkpoints(len(e.index))
    p = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    text = PREFIX + "tail words"
    ids = e.tokenizer.encode(text)
    seq = e.runner.new_seq()
    lp = e.runner.step([PrefillItem(seq, ids, all_logits=True)], []).log_softmax(-1)
    e.runner.free_seq(seq)
    want = [None] + [float(lp[j - 1, ids[j]]) for j in range(1, len(ids))]

    def check(out, covered=0):
        got = out.prompt_logprobs
        assert len(got) == len(ids) and all(x is None for x in got[:covered + 1])
        for j in range(covered + 1, len(ids)):
            assert abs(got[j][ids[j]] - want[j]) < 1e-4 and len(got[j]) >= 2
    check(llm.generate(text, p)[0])
    marked = llm.generate([PREFIX + "<|state_checkpoint|>tail words"] * 2, p)     # producer + consumers
    check(marked[0])
    check(marked[1])
    again = llm.generate(PREFIX + "<|state_checkpoint|>tail words", p)[0]          # READY checkpoint: not used
    assert (again.checkpoint.hit_length, again.checkpoint.miss_reason, again.checkpoint.published) == \
        (0, "prompt_logprobs", False)
    check(again)
    hit = llm.generate(PREFIX + "<|state_checkpoint|>tail words", GREEDY)[0]       # without prompt logprobs: a hit
    assert hit.checkpoint.hit_length == len(e.tokenizer.encode(PREFIX))


def test_score_provenance_as_completions_report_it(llm):
    """A score job reports its prefix checkpoint as a request reports its marker's: the first candidate scored
    after the job published the prefix says so (hit_length 0, miss_reason "absent", published, like the marked
    request that publishes), the others started from it (like same-step consumers), also across waves and for a
    prefix produced chunk by chunk; a later job hits it with every candidate; the counters count the publication,
    its miss and the hits. (Every candidate said hit_length = the prefix and published false.)"""
    e = llm.engine
    e.evict_checkpoints(len(e.index))
    prefix = "Provenance check: which one fits best? Answer:"
    p = len(e.tokenizer.encode(prefix))
    c0 = e.counts.as_dict()
    first = e.score(prefix, [f" c{i}" for i in range(40)])            # 40 candidates > 34 slots: two waves or more
    assert [c.checkpoint for c in first.candidates] == [CheckpointInfo(0, "absent", True)] + [CheckpointInfo(p)] * 39
    assert e.counts.checkpoints_published == c0["checkpoints_published"] + 1
    assert e.counts.checkpoint_misses["absent"] == c0["checkpoint_misses"].get("absent", 0) + 1
    assert e.counts.checkpoint_hits == c0["checkpoint_hits"] + 39
    again = e.score(prefix, [" a", " b"])
    assert [c.checkpoint for c in again.candidates] == [CheckpointInfo(p)] * 2
    marked = llm.generate("Provenance of a marked prompt: <|state_checkpoint|>tail", GREEDY)[0].checkpoint
    assert marked == CheckpointInfo(0, "absent", True) == first.candidates[0].checkpoint
    assert [c.checkpoint for c in e.score("Q", [" a", " b"]).candidates] == [CheckpointInfo()] * 2   # zeros
    chunked = LLM(device="cpu", max_num_seqs=4, num_pages=128, max_step_tokens=64, auto_checkpoints=False).engine
    long_prefix = "A long prefix, produced chunk by chunk over several steps. " * 3
    got = chunked.score(long_prefix, [" x", " y", " z"])
    q = len(chunked.tokenizer.encode(long_prefix))
    assert [c.checkpoint for c in got.candidates] == [CheckpointInfo(0, "absent", True)] + [CheckpointInfo(q)] * 2
    assert chunked.counts.checkpoints_published == 1 and chunked.index.check_integrity() == []


def full_prompt_logprobs(e, ids: list[int]) -> list[float | None]:
    """The reference: one plain forward of the whole prompt, every row's logits."""
    from gdnserve.engine.cache.sequence import PrefillItem
    seq = e.runner.new_seq()
    lp = e.runner.step([PrefillItem(seq, ids, all_logits=True)], []).log_softmax(-1)
    e.runner.free_seq(seq)
    return [None] + [float(lp[j - 1, ids[j]]) for j in range(1, len(ids))]


def test_prompt_logprobs_skip_automatic_and_marker_checkpoints():
    """A request that asks for prompt logprobs (echo + logprobs in /v1/completions) gets one at every position but
    the first, also when an earlier prompt's automatic checkpoint covers its prefix (it was 11 None's after
    "Hello world") or its marker's checkpoint is READY; it still publishes a marker checkpoint that was absent."""
    llm = LLM(device="cpu", max_num_seqs=8, num_pages=256)         # automatic checkpoints on
    e = llm.engine
    p = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)

    def check(out):
        ids = out.prompt_token_ids
        want, got = full_prompt_logprobs(e, ids), out.prompt_logprobs
        assert len(got) == len(ids) and got[0] is None and all(got[1:]), got
        assert all(abs(got[j][ids[j]] - want[j]) < 1e-4 for j in range(1, len(ids)))
    first = llm.generate("Hello world", SamplingParams(temperature=0.0, max_tokens=1))[0]
    assert first.checkpoint.published and len(e.index) == 1           # the automatic checkpoint of "Hello world"
    again = llm.generate("Hello world, again", p)[0]
    assert (again.checkpoint.hit_length, again.checkpoint.miss_reason) == (0, "prompt_logprobs")
    check(again)
    assert llm.generate("Hello world, again", GREEDY)[0].checkpoint.hit_length == 11   # the cache is still there
    marked = PREFIX + "<|state_checkpoint|>tail words"
    a = llm.generate(marked, p)[0]                                     # absent: computed and published
    assert a.checkpoint.published and a.checkpoint.miss_reason == "absent"
    check(a)
    for n in (1, 3):                                                   # READY: ignored, for a fork of n too
        b = llm.generate(marked, SamplingParams(temperature=0.0, max_tokens=1, n=n, prompt_logprobs=1))[0]
        assert (b.checkpoint.hit_length, b.checkpoint.miss_reason, b.checkpoint.published) == \
            (0, "prompt_logprobs", False)
        check(b)
    assert e.index.check_integrity() == [] and e.runner.state.check_integrity() == []
    assert all(c.refcount == 0 for c in e.index._entries.values())


def test_automatic_checkpoints_serve_the_next_turn():
    """A finished request's state is published at exactly the tokens it consumed; the next turn (its prompt +
    output + more) starts there and produces what a cold run produces."""
    llm = LLM(device="cpu", max_num_seqs=8, num_pages=256)
    e = llm.engine
    first = llm.generate(PREFIX + "turn one", GREEDY)[0]
    assert len(e.index) == 1 and first.checkpoint.hit_length == 0
    turn2 = first.prompt_token_ids + first.outputs[0].token_ids + e.tokenizer.encode(" and turn two")
    warm = llm.generate(turn2, GREEDY)[0]
    assert warm.checkpoint.hit_length == len(first.prompt_token_ids) + len(first.outputs[0].token_ids) - 1
    e.evict_checkpoints(len(e.index))
    cold = llm.generate(turn2, GREEDY)[0]
    assert cold.checkpoint.hit_length == 0 and cold.outputs[0].token_ids == warm.outputs[0].token_ids
    assert e.runner.state.check_integrity() == [] and e.index.check_integrity() == []


def test_long_prompts_are_prefilled_in_chunks_with_identical_outputs(llm):
    """A step budget far below the prompt lengths: prompts are prefilled chunk by chunk across steps (the
    GDN state and KV carried in the running slot), interleaved with other requests' decodes; greedy outputs
    equal the unchunked ones."""
    prompts = [PREFIX * 3 + "first", "short one", PREFIX * 2 + "second"]
    want = texts(llm.generate(prompts, GREEDY))
    small = LLM(device="cpu", max_num_seqs=16, num_pages=256, auto_checkpoints=False, max_step_tokens=40)
    steps = []
    e = small.engine
    ids = [e.add_request(None, p, GREEDY) for p in prompts]
    outs = {}
    while e.has_unfinished():
        got = e.step()
        steps.append(len(got))
        outs.update({o.request_id: o for o in got if o.finished})
    assert [outs[i].outputs[0].token_ids for i in ids] == want
    assert len(steps) > GREEDY.max_tokens + 3            # the long prompts took several steps to prefill
    assert e.runner.state.num_free == e.runner.state.num_slots


def test_page_pressure_preempts_and_recomputes_with_identical_outputs(llm):
    """A KV page pool too small for every request at once: requests are preempted (state dropped, requeued)
    and recomputed; nothing fails and greedy outputs equal the unconstrained run."""
    prompts = [f"request number {i}: " + "filler " * 4 for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = texts(llm.generate(prompts, params))
    tight = LLM(device="cpu", max_num_seqs=16, num_pages=24, page_size=8, auto_checkpoints=False)
    got = texts(tight.generate(prompts, params))
    assert got == want
    e = tight.engine
    assert e.counts.preemptions > 0
    assert e.runner.state.num_free == e.runner.state.num_slots and e.runner.pages.num_free == e.runner.pages.num_pages


def test_one_config_decides_the_runner_defaults_graphs_and_shapes():
    """RunnerConfig's defaults are EngineConfig's; "tensor parallel => no CUDA graphs" is EngineConfig.graphs (what
    every rank's runner config and the memory plan read); the per-rank head split and conv_dim come from
    layers/rank_shapes.py for the layer, the state pool and the model config alike."""
    from dataclasses import fields

    import torch

    from gdnserve.engine.config import EngineConfig, RunnerConfig
    from gdnserve.engine.execution.model_runner import pool_configs
    from gdnserve.layers.gdn_mixer import GatedDeltaNet
    from gdnserve.layers.rank_shapes import GDNShape
    from gdnserve.models.builtin import builtin_config
    e, r = EngineConfig(), RunnerConfig()
    shared = {f.name for f in fields(RunnerConfig)} & {f.name for f in fields(EngineConfig)}
    assert shared >= {"page_size", "prefill_mode", "backend", "spec_draft", "cuda_graphs", "max_model_len"}
    # spec_mode: the engine's verify mode, the runner's None = no speculative buffers; the pools: a runner alone
    assert [n for n in shared - {"num_slots", "num_pages", "spec_mode"} if getattr(r, n) != getattr(e, n)] == []
    tp2 = EngineConfig(tensor_parallel_size=2)
    assert tp2.graphs is False and tp2.runner_config().cuda_graphs is False
    assert EngineConfig(cuda_graphs=True).runner_config().cuda_graphs is True and e.graphs is None
    with pytest.raises(ValueError, match="cuda_graphs / graph_capture: not with tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=2, cuda_graphs=True)
    cfg = builtin_config()
    g = cfg.gdn
    for tp in (1, 2):
        want = 2 * (g.num_k_heads // tp) * g.head_k_dim + (g.num_v_heads // tp) * g.head_v_dim
        layer = GatedDeltaNet(64, g.num_k_heads, g.num_v_heads, g.head_k_dim, g.head_v_dim, g.conv_kernel, 1e-6,
                              tp_rank=0, tp_size=tp)
        state, _ = pool_configs(cfg, r, torch.float32, tp=tp)
        assert GDNShape.of(g, tp).conv_dim == layer.conv_dim == state.conv_dim == want
    assert g.conv_dim == GDNShape.of(g).conv_dim


def _lookups_counted(e, rid: str, prompt: list[int]) -> dict[str, int]:
    """Run one request to the end; the index stats' change (hits, misses by reason) it made."""
    before = e.index.stats()
    e.add_request(rid, prompt, GREEDY)
    while e.has_unfinished():
        e.step()
    after = e.index.stats()
    return {k: after[k] - before[k] for k in after if k == "hits" or k.startswith("misses_")}


def test_the_automatic_prefix_search_counts_one_lookup():
    """A request's search for its longest READY prefix over N checkpoint lengths is one lookup in the index's
    stats (one miss here), not N misses (it counted one per length tried, inflating /metrics' misses)."""
    e = LLM(device="cpu", max_num_seqs=16, num_pages=256).engine
    rng = random.Random(3)
    for i in range(5):                       # 5 automatic checkpoints of 5 lengths
        _lookups_counted(e, f"r{i}", [rng.randrange(3, 250) for _ in range(10 + 3 * i)])
    delta = _lookups_counted(e, "new", [rng.randrange(3, 250) for _ in range(40)])
    assert sum(v for k, v in delta.items() if k.startswith("misses_")) == 1
    assert delta["hits"] == 0


def test_a_long_prompt_planned_in_both_passes_counts_one_lookup():
    """A plain prompt longer than the step is planned in the first admission pass (set aside) and again in the
    second: its automatic search counts once, when it is admitted."""
    e = LLM(device="cpu", max_num_seqs=16, num_pages=512, max_step_tokens=64).engine
    rng = random.Random(9)
    _lookups_counted(e, "seed", [rng.randrange(3, 250) for _ in range(20)])
    delta = _lookups_counted(e, "long", [rng.randrange(3, 250) for _ in range(300)])
    assert sum(v for k, v in delta.items() if k.startswith("misses_")) == 1


@pytest.mark.parametrize("step_tokens", [64, 100])
def test_prompt_logprobs_of_a_long_prompt_come_chunk_by_chunk(step_tokens):
    """A single-sample prompt longer than max_step_tokens with prompt_logprobs prefills chunk by chunk, each chunk
    keeping its rows' logits (it was refused at intake): its prompt logprobs, tokens and logprobs equal one
    unchunked step's, beside other requests and with a chunk boundary inside the prompt at any position; a middle
    chunk emits no output of its own."""
    text = "A long prompt whose logprobs are scored in several chunks; " * 6
    p = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2, logprobs=1)
    one = LLM(device="cpu", auto_checkpoints=False, max_step_tokens=4096)
    want = one.generate(text, p)[0]
    ids = want.prompt_token_ids
    assert len(ids) > 3 * step_tokens
    chunked = LLM(device="cpu", auto_checkpoints=False, max_step_tokens=step_tokens, max_num_seqs=4)
    e = chunked.engine
    rid = e.add_request(None, text, p)
    other = e.add_request(None, "short one", GREEDY)
    seen, steps = [], 0
    while e.has_unfinished():
        steps += 1
        seen += [o for o in e.step() if o.request_id == rid]
    got = seen[-1]
    assert steps > 3 and all(o.outputs[0].token_ids for o in seen)      # no output before its first token
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert len(got.prompt_logprobs) == len(want.prompt_logprobs) == len(ids) and got.prompt_logprobs[0] is None
    for g, w, tok in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], ids[1:]):
        assert tok in g and set(g) == set(w)
        assert all(abs(g[t] - w[t]) < 1e-4 for t in g)
    assert e.runner.state.check_integrity() == [] and e.runner.pages.check_integrity() == []
    del other
