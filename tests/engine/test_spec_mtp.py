"""Speculative decoding with the MTP drafter through the engine loop (embedded model, CPU): greedy outputs are
identical with and without it, for k in {1, 2, 3} and both verify modes, over prompts that include two
shared-prefix groups (a prefix inside a KV page and one ending on its boundary) whose consumers spec-decode,
and a later consumer of the READY checkpoint. The embedded model's random MTP head is almost never right, so
a second run rigs the head to draft "the last token again" (the embedded model's greedy output repeats a
lot): many drafts are accepted, some rejected part-way."""
from __future__ import annotations

import pytest
import torch

from gdnserve.engine.sampling_params import SamplingParams
from gdnserve.entrypoints.llm import LLM

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
FIRST = ["abcabcabcabcabc", "the cat sat on the mat, the cat sat on the", "Shared doc.<|state_checkpoint|>q1",
         "Shared doc.<|state_checkpoint|>q22", "0123456789abcdef<|state_checkpoint|>xy",
         "0123456789abcdef<|state_checkpoint|>z", "xyz"]
LATER = ["Shared doc.<|state_checkpoint|>q333", "mnopq"]          # a READY-checkpoint consumer, a plain prompt


def _outputs(llm: LLM) -> list[list[int]]:
    first, later = llm.generate(FIRST, GREEDY), llm.generate(LATER, GREEDY)
    assert [o.checkpoint.hit_length for o in first[2:6]] == [0, 11, 0, 16]      # producer + same-step consumer
    assert later[0].checkpoint.hit_length == 11                                  # a READY checkpoint
    return [o.outputs[0].token_ids for o in first + later]


@pytest.fixture(scope="module")
def reference():
    return _outputs(LLM(device="cpu", auto_checkpoints=False))


def _copy_head(llm: LLM) -> None:
    """Rig the MTP head to predict its input token: fc passes the normed embedding through, the layer adds
    nothing (o_proj, down_proj = 0), so the head's logits are embed · embed(x), largest at x itself."""
    h = llm.engine.runner.model.mtp
    H = h.fc.weight.shape[0]
    with torch.no_grad():
        h.fc.weight.zero_()
        h.fc.weight[:, :H] = torch.eye(H, device=h.fc.weight.device)
        h.layers[0].mixer.o_proj.weight.zero_()
        h.layers[0].mlp.down_proj.weight.zero_()


@pytest.mark.parametrize("mode,k,graphs", [("replay", 1, False), ("replay", 2, False), ("replay", 3, False),
                                           ("intermediate", 1, False), ("intermediate", 2, False),
                                           ("intermediate", 3, False), ("replay", 3, True), ("intermediate", 2, True)])
def test_mtp_spec_decode_equals_plain_greedy(reference, mode, k, graphs):
    """``graphs``: decode and verify steps graph-shaped (the padded static-buffer path a CUDA graph captures, run
    eagerly on the CPU), the MTP head's draft and feed passes inside it."""
    llm = LLM(device="cpu", spec_k=k, spec_mode=mode, spec_draft="mtp", cuda_graphs=graphs, max_num_seqs=12)
    if k != 2:
        _copy_head(llm)
    assert _outputs(llm) == reference
    e = llm.engine
    assert e.counts.spec_drafted > 0
    if k != 2:
        assert 0 < e.counts.spec_accepted < e.counts.spec_drafted
    if graphs:                                      # decode / verify and prefill / mixed steps graph-shaped
        assert e.runner.graphs.stats["eager"] > 0 and e.runner.graphs.stats["mixed_eager"] > 0
    assert e.runner.state.check_integrity() == [] and e.runner.pages.check_integrity() == []


def test_next_turn_after_mtp_spec_decode_matches_a_cold_run():
    """An automatic checkpoint published after MTP spec decoding holds exactly its tokens (the MTP entries of
    rejected drafts never reach it): the next turn equals a cold run, and its own drafts start from it."""
    llm = LLM(device="cpu", spec_k=3, spec_mode="replay", spec_draft="mtp")
    _copy_head(llm)
    out = llm.generate("hello hello hello", SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))[0]
    nxt = out.prompt_token_ids + out.outputs[0].token_ids + list(b" again")
    warm = llm.generate(nxt, GREEDY)[0]
    cold = LLM(device="cpu", auto_checkpoints=False).generate(nxt, GREEDY)[0]
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert llm.engine.counts.spec_accepted > 0


def test_graph_shaped_mtp_drafts_as_the_eager_steps():
    """The in-graph draft (its index vectors derived on the device from the static inputs, padding rows included)
    proposes what the eager step's draft proposes, and the prefill / mixed graphs' feed pass leaves the head's KV
    and hidden rows as the eager feed does: the same outputs and the same accepted and drafted counts over the
    same run."""
    seen = []
    for graphs in (False, True):
        llm = LLM(device="cpu", spec_k=3, spec_mode="replay", spec_draft="mtp", cuda_graphs=graphs, max_num_seqs=12)
        _copy_head(llm)
        out = _outputs(llm)
        e = llm.engine
        seen.append((out, e.counts.spec_accepted, e.counts.spec_drafted))
        if graphs:
            st = e.runner.graphs.stats
            assert st["eager"] > 0 and st["mixed_eager"] > 0
    assert seen[0] == seen[1]


def test_warm_up_compiles_without_touching_state(reference):
    """The server's start-up warm-up (every decode / verify bucket captured: all rows padding; no MTP draft at every
    batch size any more, prefill + verify steps draft inside their mixed graph) writes nothing a request reads:
    outputs after it equal the reference, the pools are intact, and the hidden pool's live rows are untouched
    (padding commits only into the scratch row)."""
    llm = LLM(device="cpu", spec_k=3, spec_mode="replay", spec_draft="mtp", cuda_graphs=True, max_num_seqs=12)
    r = llm.engine.runner
    before = r.mtp.hidden[:-1].clone(), r.pages.k_pools.clone(), r.state.ssm_pools.clone()
    line = llm.engine.warm_up()
    assert line.startswith("graphs not captured, in ") and "MTP" not in line
    assert torch.equal(r.mtp.hidden[:-1], before[0]) and torch.equal(r.pages.k_pools, before[1])
    assert torch.equal(r.state.ssm_pools, before[2])
    assert _outputs(llm) == reference
    assert LLM(device="cpu").engine.warm_up() == ""          # no graphs (CPU default): nothing to warm
