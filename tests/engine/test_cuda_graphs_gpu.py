"""GPU-only: the captured decode and verify graphs (engine/execution/cuda_graphs.py) on the embedded model.

A replay equals the graph-shaped eager step (same padded static buffers, same kernels, no capture) bit for
bit — logits and every byte of state — at several batch sizes (buckets 1, 4, 16) for decode and (1, 4) for
verify in both spec modes (dense and MoE); it is close to the ordinary unpadded eager step; a graph step,
accept and flush make no host synchronisation (checked on the same runners); the engine's greedy outputs are
identical with captured replays and graph-shaped eager steps. Every capture warms up and compiles: the tests share one draft count and a
few buckets. The prefill / mixed graphs: test_cuda_graphs_mixed_gpu.py (the two were one file of 169 s on the H200,
most of it Triton compiling each dtype / shape / mode's kernels).
Run on the H200: ``python -m pytest -q tests/engine/test_cuda_graphs_gpu.py``."""
from __future__ import annotations

import random

import pytest
import torch

from gdnserve.engine.cache.sequence import PrefillItem
from gdnserve.engine.execution.model_runner import (
    ModelRunner,
    RunnerConfig,
)
from gdnserve.engine.sampling_params import SamplingParams
from gdnserve.entrypoints.llm import LLM
from gdnserve.layers.moe import SparseMoE
from gdnserve.models.builtin import build_builtin_model
from gdnserve.ops.numerics import rel_rms
from tests.engine.test_cuda_graphs import same_bits, state_buffers

pytestmark = pytest.mark.gpu
S = 24


def with_moe(model, experts: int = 8, top_k: int = 2):
    """Every layer's MLP replaced by a SparseMoE with fixed-seed weights (the same model on every call)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    dtype = next(model.parameters()).dtype
    for layer in model.layers:
        layer.mlp = SparseMoE(256, experts, top_k, 64, 32, True).to(device="cuda", dtype=dtype)
        with torch.no_grad():
            for p in layer.mlp.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, device="cuda") * p.shape[-1] ** -0.5)
    return model


def make_runner(mode: str | None, k: int, graphs: bool, capture: bool | None, dtype=torch.bfloat16,
                moe: bool = False, mixed: bool = False, max_batch: int | None = None,
                draft: str = "ngram", max_tokens: int | None = None) -> ModelRunner:
    """``mixed``: prefill / mixed steps through graphs too (off: the decode / verify tests' prefills are eager);
    ``draft``: the spec drafter ("mtp": the model's MTP head, its passes inside the graphs)."""
    rc = RunnerConfig(num_slots=S, num_pages=256, page_size=4, spec_mode=mode, spec_tokens=k + 1 if mode else 0,
                      cuda_graphs=graphs, graph_capture=capture, mixed_graphs=mixed, graph_max_batch=max_batch,
                      spec_draft=draft, graph_max_tokens=max_tokens)
    model = build_builtin_model(dtype=dtype, device="cuda")
    r = ModelRunner(with_moe(model) if moe else model, rc)
    for t, _ in state_buffers(r).values():
        t.zero_()                     # pending buffers start uninitialised: make whole-buffer comparison meaningful
    return r


def all_state(r: ModelRunner) -> dict[str, torch.Tensor]:
    out = {n: t for n, (t, _) in state_buffers(r).items()}
    out["k"], out["v"] = r.pages.k_pools, r.pages.v_pools
    return out


def assert_same_state(a: ModelRunner, b: ModelRunner) -> None:
    sa, sb = all_state(a), all_state(b)
    for name in sa:
        assert same_bits(sa[name], sb[name]), name


def lockstep(mode: str | None, k: int, sizes: list[int], steps: int = 4, moe: bool = False):
    """Captured, graph-shaped eager and plain eager runners through the same prefill and decode / verify steps
    (each batch size in ``sizes`` in turn, random tokens and acceptance counts)."""
    graph, shaped, plain = (make_runner(mode, k, g, c, moe=moe) for g, c in ((True, None), (True, False), (False, None)))
    assert graph.graphs.capture and not shaped.graphs.capture and plain.graphs is None
    n = max(sizes)
    prompts = [[random.randrange(256) for _ in range(3 + 7 * i % 23)] for i in range(n)]
    seqs = []
    for r in (graph, shaped, plain):
        ss = [r.new_seq() for _ in range(n)]
        r.step([PrefillItem(s, p) for s, p in zip(ss, prompts)], [])
        seqs.append(ss)
    torch.cuda.synchronize()
    for B in sizes:
        for _ in range(steps):
            if mode is None:
                toks = [random.randrange(256) for _ in range(B)]
                outs = [r.step([], list(zip(ss[:B], toks))) for r, ss in zip((graph, shaped, plain), seqs)]
            else:
                toks = [[random.randrange(256) for _ in range(k + 1)] for _ in range(B)]
                outs = [r.step([], [], verifies=list(zip(ss[:B], toks))) for r, ss in zip((graph, shaped, plain), seqs)]
            torch.cuda.synchronize()
            assert torch.equal(outs[0], outs[1]), f"B={B}: replay != graph-shaped eager"
            assert rel_rms(outs[0], outs[2]) < 2e-2, f"B={B}: replay far from the eager step"
            assert_same_state(graph, shaped)
            if mode is not None:
                acc = [random.randint(1, k + 1) for _ in range(B)]
                for r, ss in zip((graph, shaped, plain), seqs):
                    r.accept(list(zip(ss[:B], acc)))
        if mode == "replay":                                  # land the pending tokens before the next batch size
            for r, ss in zip((graph, shaped, plain), seqs):
                r.flush(ss)
    return graph, seqs[0]


def steps_do_not_sync(r: ModelRunner, seqs: list, mode: str | None, k: int) -> None:
    """With its graphs captured (the decode graph by the first step here), a graph step, accept and flush make no
    host synchronisation: 4 replays under torch's sync debug mode (3 verify steps and a decode in spec modes)."""
    seqs = seqs[:3]
    if mode is not None:
        r.step([], [], verifies=[(s, list(range(1, k + 2))) for s in seqs])
        r.accept([(s, k) for s in seqs])
        r.flush(seqs)
    r.step([], [(s, 4) for s in seqs])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3 if mode is not None else 0):
            r.step([], [], verifies=[(s, list(range(5, k + 6))) for s in seqs])
            r.accept([(s, k + 1) for s in seqs])
        if mode is not None:
            r.flush(seqs)
        r.step([], [(s, 8) for s in seqs])
    finally:
        torch.cuda.set_sync_debug_mode(0)


# batch sizes 1 (exact), 3 and 13 (padded to buckets 4 and 16): the kernels' ==1 / generic / %16 specialisations
def test_decode_replay_equals_graph_shaped_eager_and_does_not_sync(seed):
    g, seqs = lockstep(None, 0, [1, 3, 13])
    assert g.graphs.stats["capture"] == 3 and g.graphs.stats["replay"] == 4 * 3
    steps_do_not_sync(g, seqs, None, 0)
    assert g.graphs.stats["capture"] == 3 and g.graphs.stats["replay"] == 4 * 3 + 2
    assert g.graphs.stats["fallback"] == 0


# each mode at k = 2 (k changes the verify kernels' specialisation: every variant compiles; one k serves every
# test here): replays equal the graph-shaped eager step, then the decode graph's capture and steps without syncs
@pytest.mark.parametrize("mode", ["intermediate", "replay"])
def test_verify_replay_equals_graph_shaped_eager_and_does_not_sync(mode, seed):
    g, seqs = lockstep(mode, 2, [1, 3])
    assert g.graphs.stats["capture"] == 2 and g.graphs.stats["replay"] == 8
    steps_do_not_sync(g, seqs, mode, 2)
    assert g.graphs.stats["capture"] == 3 and g.graphs.stats["replay"] == 8 + 2 + 4


def test_capture_all_then_every_bucket_replays():
    """Buckets 1, 2, 4 (graph_max_batch = 4: each bucket is one more capture, all alike)."""
    r = make_runner("replay", 2, True, None, max_batch=4)
    r.capture_graphs()
    assert r.graphs.buckets == (1, 2, 4) and r.graphs.stats["capture"] == 2 * 3
    seqs = [r.new_seq() for _ in range(4)]
    r.step([PrefillItem(s, [1, 2, 3]) for s in seqs], [])
    for B in (1, 2, 3, 4):
        r.step([], [(s, 7) for s in seqs[:B]])
    assert r.graphs.stats["capture"] == 2 * 3 and r.graphs.stats["replay"] == 4


def test_moe_models_capture():
    """SparseMoE's Triton grouped GEMM reads nothing on the host: MoE models get graphs (auto on), and a
    replay equals the graph-shaped eager step bit for bit for decode and verify."""
    m = with_moe(build_builtin_model(device="cuda"))
    assert ModelRunner(m, RunnerConfig(num_slots=4)).graphs is not None
    g, _ = lockstep(None, 0, [1, 6], moe=True)
    assert g.graphs.stats["replay"] == 8 and g.graphs.stats["fallback"] == 0
    g, _ = lockstep("replay", 2, [3], moe=True)
    assert g.graphs.stats["replay"] == 4


PROMPTS = ["abcabcabcabcabc", "the cat sat on the mat, the cat sat on the", "Shared doc.<|state_checkpoint|>q1",
           "Shared doc.<|state_checkpoint|>q2", "xyz"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("spec", [(0, "replay"), (2, "intermediate")])
def test_engine_greedy_identical_with_captured_and_graph_shaped_eager_steps(spec):
    """Through the engine (continuous batching, prefill / mixed graphs, checkpoints): captured replays give the same
    greedy tokens as the graph-shaped eager steps (same padded buffers and kernels, so bit for bit in bf16).
    Graph-shaped eager == plain eager through the engine: test_cuda_graphs.py (CPU); a replay close to the plain
    eager step on this GPU: the lockstep tests above. (fp32 weights against plain eager here compiled every kernel
    once more in fp32: 118 s of this file's 162 s on the H200.)"""
    k, mode = spec
    outs = {}
    for capture in (False, True):
        llm = LLM(device="cuda", cuda_graphs=True, graph_capture=capture, spec_k=k, spec_mode=mode, max_num_seqs=8)
        res = llm.generate(PROMPTS, GREEDY)
        outs[capture] = [o.outputs[0].token_ids for o in res]
        g = llm.engine.runner.graphs
        assert g is not None and g.capture == capture
        assert g.stats["replay" if capture else "eager"] > 0
    assert outs[True] == outs[False]
