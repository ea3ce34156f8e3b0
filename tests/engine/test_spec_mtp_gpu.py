"""GPU-only: speculative decoding with the MTP drafter through captured CUDA graphs (the draft's k head steps, the
target's verify and the head's KV feed in one graph per bucket; engine/execution/cuda_graphs.py).

Through the engine, captured replays give the same greedy tokens and the same accepted / drafted counts as the
graph-shaped eager steps (same padded buffers and kernels); a verify step, its acceptance and a decode step replay
without a host synchronisation; the benchmark's oracle wrapper (a device hash, no generator) captures too.
Run on the H200: ``python -m pytest -q tests/engine/test_spec_mtp_gpu.py``."""
from __future__ import annotations

import pytest
import torch

from benchmarks.oracle_drafter import ChainOracleMTP
from gdnserve.engine.cache.sequence import PrefillItem
from gdnserve.engine.execution.model_runner import ModelRunner, RunnerConfig
from gdnserve.engine.sampling_params import SamplingParams
from gdnserve.entrypoints.llm import LLM
from gdnserve.models.builtin import build_builtin_model
from tests.engine.test_spec_mtp import _copy_head

pytestmark = pytest.mark.gpu
PROMPTS = ["abcabcabcabcabc", "the cat sat on the mat, the cat sat on the", "Shared doc.<|state_checkpoint|>q1",
           "Shared doc.<|state_checkpoint|>q2", "xyz", "hello hello hello hello"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_engine_mtp_captured_equals_graph_shaped_eager():
    seen = {}
    for capture in (False, True):
        llm = LLM(device="cuda", cuda_graphs=True, graph_capture=capture, spec_k=3, spec_mode="replay",
                  spec_draft="mtp", max_num_seqs=8)
        _copy_head(llm)
        res = llm.generate(PROMPTS, GREEDY)
        e = llm.engine
        seen[capture] = ([o.outputs[0].token_ids for o in res], e.counts.spec_accepted, e.counts.spec_drafted)
        g = e.runner.graphs
        assert g.stats["replay" if capture else "eager"] > 0
        assert e.counts.spec_accepted > 0
    assert seen[True] == seen[False]


def test_mtp_graph_steps_do_not_sync_and_the_oracle_captures():
    rc = RunnerConfig(num_slots=8, num_pages=128, page_size=4, spec_mode="replay", spec_tokens=4, spec_draft="mtp",
                      cuda_graphs=True, mixed_graphs=False)
    r = ModelRunner(build_builtin_model(dtype=torch.bfloat16, device="cuda"), rc)
    perm = torch.randperm(r.model.cfg.vocab_size, device="cuda")
    ChainOracleMTP(r.mtp, perm, 3, 1.0)
    seqs = [r.new_seq() for _ in range(3)]
    r.step([PrefillItem(s, [1, 2, 3, 4 + i]) for i, s in enumerate(seqs)], [])
    r.step([], [], verifies=[(s, [5]) for s in seqs])           # captures the verify graph
    r.accept([(s, 4) for s in seqs])
    r.step([], [(s, 6) for s in seqs])                          # and the decode graph
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for t in range(3):
            r.step([], [], verifies=[(s, [7 + t]) for s in seqs])
            drafts = r.drafts.clone()
            r.accept([(s, 2) for s in seqs])
        r.flush(seqs)
        r.step([], [(s, 9) for s in seqs])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert r.graphs.stats["capture"] == 2 and r.graphs.stats["replay"] == 6 and r.graphs.stats["fallback"] == 0
    want = torch.stack([perm[torch.full((3,), 9, device="cuda")], perm[perm[torch.full((3,), 9, device="cuda")]],
                        perm[perm[perm[torch.full((3,), 9, device="cuda")]]]], 1)
    assert torch.equal(drafts, want)                            # the oracle's chain at rate 1.0, from the graph
