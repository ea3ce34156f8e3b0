"""The graph-shaped step on the CPU (embedded model): the padded, static-buffer path a CUDA graph captures,
run eagerly. Its live rows equal, bit for bit, an eager step in which the padding rows are real requests
(same GEMM shapes), and are close to the ordinary unpadded step; padding rows touch no pool byte; bucket
choice and fallbacks; engine outputs identical with graphs on and off."""
from __future__ import annotations

import dataclasses
import random
from unittest import mock

import pytest
import torch

from gdnserve.engine.cache.sequence import PrefillItem
from gdnserve.engine.execution.graph_inputs import graph_buckets, pick_bucket
from gdnserve.engine.execution.model_runner import ModelRunner, RunnerConfig
from gdnserve.engine.sampling_params import SamplingParams
from gdnserve.entrypoints.llm import LLM
from gdnserve.models import builtin
from gdnserve.models.builtin import build_builtin_model

S = 16
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
VOCAB = build_builtin_model().cfg.vocab_size


def make_runner(graphs: bool, mode: str | None = None, k: int = 0, backend: str = "torch", **kw) -> ModelRunner:
    """A runner on its own model instance (a runner binds its pools into the model's layers). The Triton
    backend runs where its kernels run: on the GPU when there is one (the interpreter is off there), else
    interpreted on the CPU; the graph-shaped path stays eager (graph_capture=False) on either device."""
    device = DEVICE if backend == "triton" else torch.device("cpu")
    kw.setdefault("mixed_graphs", False)       # prefill steps eager here (test_cuda_graphs_mixed.py: the graph ones)
    rc = RunnerConfig(backend=backend, num_slots=S, num_pages=128, page_size=4, spec_mode=mode,
                      spec_tokens=k + 1 if mode else 0, cuda_graphs=graphs,
                      **({"graph_capture": False} if graphs else {}), **kw)
    return ModelRunner(small_gdn_model(device) if backend == "triton" else build_builtin_model(device=device), rc)


def small_gdn_model(device: torch.device):
    """The embedded model with GDN heads of 16 (not 64) for the Triton tests: the interpreter runs the recurrent
    kernels one program per 16 value rows, head and request, so a quarter of the programs (the skipped padding
    does not depend on head sizes; the kernels at the model's sizes: tests/ops)."""
    cfg = builtin.builtin_config()
    small = dataclasses.replace(cfg, gdn=dataclasses.replace(cfg.gdn, head_k_dim=16, head_v_dim=16))
    with mock.patch.object(builtin, "builtin_config", lambda: small):
        return build_builtin_model(device=device)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(bits(a), bits(b))


def state_buffers(r: ModelRunner) -> dict[str, tuple[torch.Tensor, int]]:
    """Every GDN state buffer of the runner and its row dim (pools: dim 1 = slot; scratch / pending: dim 0)."""
    out = {"conv": (r.state.conv_pools, 1), "ssm": (r.state.ssm_pools, 1)}
    for i, layer in enumerate(r.model.gdn_layers()):
        if layer.conv_scratch is not None:
            out[f"conv_scratch{i}"] = (layer.conv_scratch, 0)
        if layer.ssm_scratch is not None:
            out[f"ssm_scratch{i}"] = (layer.ssm_scratch, 0)
        if layer.pending is not None:
            for f in ("k", "v", "a", "b"):
                out[f"pending_{f}{i}"] = (getattr(layer.pending, f), 0)
    return out


def snapshot(r: ModelRunner) -> dict[str, torch.Tensor]:
    snap = {n: t.clone() for n, (t, _) in state_buffers(r).items()}
    snap["k"], snap["v"] = r.pages.k_pools.clone(), r.pages.v_pools.clone()
    return snap


def written_rows(name: str, seqs, mode: str | None) -> list[int]:
    """Rows a step of ``seqs`` may write in buffer ``name`` (replay: parities as they were before the step)."""
    if name in ("conv", "ssm") or mode == "intermediate":
        return [s.slot for s in seqs]
    return [s.slot + (s.parity ^ 1) * S for s in seqs]           # replay: the pending rows written


def kv_slots(seqs) -> list[int]:
    return [x for s in seqs for x in s.pages.slots(0, s.length)]


def check_step(shaped: ModelRunner, ref: ModelRunner, snap: dict, live, ref_live, mode: str | None,
               parity_before: list[int]) -> None:
    """Rows of the live requests: bit-identical to the reference runner's; every other byte of every pool,
    scratch and pending buffer and KV cache: bit-identical to before the step."""
    for s, p in zip(live, parity_before):
        s.parity = p                                             # written_rows wants the step's parities
    ref_bufs = state_buffers(ref)
    for name, (t, dim) in state_buffers(shaped).items():
        rows = torch.tensor(written_rows(name, live, mode), device=t.device)
        assert same_bits(t.index_select(dim, rows), ref_bufs[name][0].index_select(dim, rows)), name
        keep = torch.ones(t.shape[dim], dtype=torch.bool, device=t.device)
        keep[rows] = False
        idx = keep.nonzero().squeeze(1)
        assert same_bits(t.index_select(dim, idx), snap[name].index_select(dim, idx)), f"{name}: padding wrote"
    for kv in ("k", "v"):
        got, want = getattr(shaped.pages, f"{kv}_pools").flatten(1, 2), getattr(ref.pages, f"{kv}_pools").flatten(1, 2)
        assert same_bits(got[:, kv_slots(live)], want[:, kv_slots(ref_live)]), kv
        keep = torch.ones(got.shape[1], dtype=torch.bool, device=got.device)
        keep[kv_slots(live)] = False
        assert same_bits(got[:, keep], snap[kv].flatten(1, 2)[:, keep]), f"{kv} cache: padding wrote"


def test_buckets_and_pick():
    assert graph_buckets(256) == (1, 2, 4, 8, 16, 32, 64, 128, 256) == graph_buckets(1000)
    assert graph_buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    assert graph_buckets(1) == (1,)
    b = graph_buckets(48)
    assert [pick_bucket(b, n) for n in (0, 1, 2, 3, 5, 33, 48, 49)] == [None, 1, 2, 4, 8, 48, 48, None]
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="graph_max_batch"):
            graph_buckets(bad)


def last_norm(r: ModelRunner) -> list[torch.Tensor]:
    """Records the final norm's output of each forward: the reference's logits of the live rows are then
    the lm head on those rows alone (the graph path runs the lm head on the live rows only)."""
    seen: list[torch.Tensor] = []
    r.model.norm.register_forward_hook(lambda mod, args, out: seen.append(out))
    return seen


@torch.inference_mode()
def head(r: ModelRunner, h: torch.Tensor) -> torch.Tensor:
    return r.model.logits(h)


def _prefill_all(runners, prompts):
    seqs = []
    for r in runners:
        ss = [r.new_seq() for _ in prompts]
        r.step([PrefillItem(s, p) for s, p in zip(ss, prompts)], [])
        seqs.append(ss)
    return seqs


@pytest.mark.parametrize("B", [1, 3, 6])
def test_graph_shaped_decode_equals_eager(B, seed):
    Bk = pick_bucket(graph_buckets(S), B)
    shaped, full, plain = make_runner(True), make_runner(False), make_runner(False)
    prompts = [[random.randrange(256) for _ in range(5 + 3 * i)] for i in range(Bk)]
    s_seqs, f_seqs, p_seqs = _prefill_all([shaped, full, plain], prompts)
    normed = last_norm(full)
    for step in range(5):                                        # page_size 4: tables grow across steps
        toks = [random.randrange(256) for _ in range(Bk)]
        snap = snapshot(shaped)
        got = shaped.step([], list(zip(s_seqs[:B], toks[:B])))
        want = full.step([], list(zip(f_seqs, toks)))             # the padding rows as real requests
        close = plain.step([], list(zip(p_seqs[:B], toks[:B])))  # the ordinary step: other GEMM shapes
        assert shaped.graphs.stats["eager"] == step + 1 and shaped.graphs.stats["fallback"] == 0
        assert list(shaped.graphs.inputs._views) == [(shaped.graphs.decode, Bk)]
        assert got.shape == (B, VOCAB) and torch.equal(got, head(full, normed[-1][:B]))
        torch.testing.assert_close(got, want[:B], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got, close, rtol=1e-4, atol=1e-5)
        check_step(shaped, full, snap, s_seqs[:B], f_seqs[:B], None, [0] * B)
        assert [s.length for s in s_seqs[:B]] == [s.length for s in p_seqs[:B]]


@pytest.mark.parametrize("mode", ["intermediate", "replay"])
@pytest.mark.parametrize("B,k", [(1, 3), (3, 2)])
def test_graph_shaped_verify_equals_eager(mode, B, k, seed):
    Bk = pick_bucket(graph_buckets(S), B)
    shaped, full, plain = (make_runner(g, mode, k) for g in (True, False, False))
    prompts = [[random.randrange(256) for _ in range(4 + 5 * i)] for i in range(Bk)]
    s_seqs, f_seqs, p_seqs = _prefill_all([shaped, full, plain], prompts)
    normed = last_norm(full)
    for step in range(5):
        toks = [[random.randrange(256) for _ in range(k + 1)] for _ in range(Bk)]
        acc = [random.randint(1, k + 1) for _ in range(Bk)]     # every acceptance count occurs over the run
        snap = snapshot(shaped)
        parity = [s.parity for s in s_seqs[:B]]
        got = shaped.step([], [], verifies=list(zip(s_seqs[:B], toks[:B])))
        want = full.step([], [], verifies=list(zip(f_seqs, toks)))
        close = plain.step([], [], verifies=list(zip(p_seqs[:B], toks[:B])))
        assert shaped.graphs.stats["eager"] == step + 1
        n = B * (k + 1)
        assert got.shape == (n, VOCAB) and torch.equal(got, head(full, normed[-1][:n]))
        torch.testing.assert_close(got, want[:n], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got, close, rtol=1e-4, atol=1e-5)
        check_step(shaped, full, snap, s_seqs[:B], f_seqs[:B], mode, parity)
        for r, ss, n in ((shaped, s_seqs, B), (full, f_seqs, Bk), (plain, p_seqs, B)):
            r.accept(list(zip(ss[:n], acc[:n])))
    # replay: the pending tokens land before a plain decode (eager flush, then the decode graph)
    tok = [random.randrange(256) for _ in range(B)]
    got = shaped.step([], list(zip(s_seqs[:B], tok)))
    torch.testing.assert_close(got, plain.step([], list(zip(p_seqs[:B], tok))), rtol=1e-4, atol=1e-5)
    assert shaped.graphs.stats["eager"] == 6
    assert set(shaped.graphs.inputs._views) == {(shaped.graphs.verify, Bk), (shaped.graphs.decode, Bk)}
    for s in s_seqs:
        shaped.free_seq(s)
    assert shaped.state.check_integrity() == [] and shaped.pages.check_integrity() == []


@pytest.mark.parametrize("mode", [None, "replay", "intermediate"])
def test_graph_shaped_triton_kernels_skip_padding(mode, seed):
    """The Triton kernels (interpreted on the CPU) on padded rows: slot -1, slot_mapping -1, kv_len L over
    page 0, the max_q_len grid; live rows bit-identical to padding-as-real-requests, nothing else written."""
    B, Bk, k = 3, 4, 2
    shaped, full = make_runner(True, mode, k, backend="triton"), make_runner(False, mode, k, backend="triton")
    for r in (shaped, full):                                       # prefill on the PyTorch path (faster)
        for layer in r.model.gdn_layers() + r.model.attention_layers():
            layer.backend = "torch"
    prompts = [[random.randrange(256) for _ in range(3 + 4 * i)] for i in range(Bk)]
    s_seqs, f_seqs = _prefill_all([shaped, full], prompts)
    if mode is not None:                                           # replay: pending tokens for the kernel to apply
        toks = [[random.randrange(256) for _ in range(k + 1)] for _ in range(Bk)]
        for r, ss, n in ((shaped, s_seqs, B), (full, f_seqs, Bk)):
            r.step([], [], verifies=list(zip(ss[:n], toks[:n])))
            r.accept([(s, 1 + i % (k + 1)) for i, s in enumerate(ss[:n])])
    for r in (shaped, full):
        for layer in r.model.gdn_layers() + r.model.attention_layers():
            layer.backend = "triton"
    normed = last_norm(full)
    snap = snapshot(shaped)                                        # one step: the interpreter is slow
    parity = [s.parity for s in s_seqs[:B]]
    if mode is None:
        toks = [random.randrange(256) for _ in range(Bk)]
        got = shaped.step([], list(zip(s_seqs[:B], toks[:B])))
        full.step([], list(zip(f_seqs, toks)))
    else:
        toks = [[random.randrange(256) for _ in range(k + 1)] for _ in range(Bk)]
        got = shaped.step([], [], verifies=list(zip(s_seqs[:B], toks[:B])))
        full.step([], [], verifies=list(zip(f_seqs, toks)))
    assert torch.equal(got, head(full, normed[-1][:got.shape[0]]))
    check_step(shaped, full, snap, s_seqs[:B], f_seqs[:B], mode, parity)
    assert shaped.graphs.stats["eager"] == (1 if mode is None else 2)


def test_all_padding_step_is_finite_and_writes_nothing():
    """What a capture's warm-up runs: every row padding. Finite hidden states, no byte of state written."""
    r = make_runner(True, "replay", 2)
    seqs = [r.new_seq() for _ in range(3)]
    r.step([PrefillItem(s, list(range(7 + i))) for i, s in enumerate(seqs)], [])
    r.step([], [], verifies=[(s, [1, 2, 3]) for s in seqs])
    r.accept([(s, 2) for s in seqs])
    g = r.graphs
    for kind in (g.decode, g.verify):
        snap = snapshot(r)
        g.inputs.fill(kind, 8, {n: [] for n in ("ids", "pos", "smap", *kind.row_vectors())}, [])
        h = g._forward((kind, 8))
        assert h.shape == (8 * kind.L, 256) and torch.isfinite(h).all()
        after = snapshot(r)
        assert all(same_bits(after[n], snap[n]) for n in snap)


def test_fallbacks_run_the_eager_step():
    r = make_runner(True, "replay", 2, graph_max_batch=2, max_model_len=24)
    assert r.graphs.buckets == (1, 2) and r.graphs.width == 7     # ceil((24 + 3) / 4)
    seqs = [r.new_seq() for _ in range(3)]
    r.step([PrefillItem(s, list(range(5))) for s in seqs], [])   # prefill: eager, not counted
    st = r.graphs.stats
    assert st["fallback"] == 0 and st["eager"] == 0
    r.step([], [(s, 1) for s in seqs])                            # 3 requests > largest bucket 2
    assert st["fallback"] == 1 and st["eager"] == 0
    r.step([], [(seqs[0], 1)], verifies=[(seqs[1], [1, 2, 3])])  # decode and verify in one step
    assert st["fallback"] == 2
    r.accept([(seqs[1], 3)])
    r.step([], [(seqs[0], 1), (seqs[2], 4)])                      # decode of 2: bucket 2
    assert st["eager"] == 1
    s = seqs[2]
    while len(s.pages.pages) + s.pages.pages_needed(1) <= r.graphs.width:
        r.step([], [(s, 5)])
    n = st["eager"]
    r.step([], [(s, 5)])                                          # the page table outgrew the graphs' width
    assert st["fallback"] == 3 and st["eager"] == n
    with pytest.raises(ValueError, match="spec_tokens = 3"):
        r.step([], [], verifies=[(seqs[0], [1, 2])])


def test_config_resolution_and_errors():
    m = build_builtin_model()
    assert ModelRunner(m, RunnerConfig(backend="torch")).graphs is None        # auto: off on the CPU
    assert ModelRunner(m, RunnerConfig(backend="torch", cuda_graphs=False)).graphs is None
    r = ModelRunner(m, RunnerConfig(backend="torch", cuda_graphs=True, num_slots=5))
    assert r.graphs is not None and not r.graphs.capture and r.graphs.buckets == (1, 2, 4, 5)
    with pytest.raises(ValueError, match="graph_capture"):
        ModelRunner(m, RunnerConfig(backend="torch", cuda_graphs=True, graph_capture=True))
    with pytest.raises(ValueError, match="graph_max_batch"):
        ModelRunner(m, RunnerConfig(backend="torch", cuda_graphs=True, graph_max_batch=0))
    with pytest.raises(ValueError, match="max_model_len"):
        ModelRunner(m, RunnerConfig(backend="torch", cuda_graphs=True, max_model_len=0))
    with pytest.raises(ValueError, match="spec_mode"):
        r.step([], [], verifies=[(r.new_seq(), [1, 2])])


PROMPTS = ["abcabcabcabcabc", "the cat sat on the mat, the cat sat on the", "Shared doc.<|state_checkpoint|>q1",
           "Shared doc.<|state_checkpoint|>q2", "xyz"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.mark.parametrize("spec", [(0, "replay"), (2, "replay"), (3, "intermediate")])
def test_engine_greedy_identical_with_graphs(spec):
    k, mode = spec
    outs = {}
    for graphs in (False, True):
        llm = LLM(device="cpu", cuda_graphs=graphs, spec_k=k, spec_mode=mode, max_num_seqs=6)
        res = llm.generate(PROMPTS, GREEDY)
        res += llm.generate("two samples", SamplingParams(temperature=0.0, max_tokens=8, n=2, ignore_eos=True))
        outs[graphs] = [[c.token_ids for c in o.outputs] for o in res]
        g = llm.engine.runner.graphs
        assert (g is not None) == graphs
        if graphs:
            assert g.stats["eager"] > 0 and g.buckets == (1, 2, 4, 6)
    assert outs[True] == outs[False]
