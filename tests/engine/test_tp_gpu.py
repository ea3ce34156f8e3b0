"""Tensor parallelism on two GPUs over NCCL (skipped unless 2 are visible; run on nvidia-h200-x2 with
``bash benchmarks/device.sh tp:500``, which sets NCCL_NVLS_ENABLE=0): the embedded model in fp32 at TP=2 gives
TP=1's greedy tokens and logprobs (plain prompts, a checkpoint group, n = 2, n-gram drafts in replay mode, the MTP
drafter in intermediate mode); ``gdnserve serve --tensor-parallel-size 2 --device cuda`` gives the same through
HTTP; a worker that raises ends the engine within a bounded time (NCCL: the group is aborted, the waiting
collective does not hang; last in the file: it leaves an aborted communicator behind). The benchmark model in bf16
at TP=2 (full size) is held to TP=1 by bench_tp's equality section, which the same suite runs first."""
from __future__ import annotations

import os
import time

import pytest
import torch

from gdnserve.engine.engine_api import EngineDeadError
from gdnserve.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (tensor_parallel_size = 2)")]
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

MARK = "<|state_checkpoint|>"
PREFIX = "Shared context for ranking: gdnserve computes a prefix once and forks it. "
PROMPTS = ["Hello there", PREFIX + MARK + " candidate one", PREFIX + MARK + " candidate two",
           "abc abc abc abc abc abc abc"]
TOL = 1e-4          # fp32 on the GPU: the two ranks' partial sums are added in another order than one GPU's


def _tokens_and_logprobs(llm, params):
    outs = llm.generate(PROMPTS, params)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


def _close(a, b):
    for la, lb in zip(a, b):
        for x, y in zip(la, lb):
            assert x.keys() == y.keys() and max(abs(x[t] - y[t]) for t in x) <= TOL


@pytest.mark.parametrize("spec", [dict(spec_k=2), dict(spec_k=2, spec_draft="mtp", spec_mode="intermediate")],
                         ids=["ngram-replay", "mtp-intermediate"])
def test_embedded_model_tp2_equals_tp1_on_two_gpus(spec):
    from gdnserve.entrypoints.llm import LLM
    kw = dict(device="cuda", dtype="float32", max_num_seqs=8, num_pages=256, **spec)
    lp = SamplingParams(temperature=0, max_tokens=10, logprobs=3)
    plain = SamplingParams(temperature=0, max_tokens=16)
    ref_llm = LLM(cuda_graphs=False, **kw)
    ref = _tokens_and_logprobs(ref_llm, lp), _tokens_and_logprobs(ref_llm, plain)[0]
    ref_n2 = sorted(s.token_ids for s in ref_llm.generate("Hello", SamplingParams(temperature=0, max_tokens=6,
                                                                                   n=2))[0].outputs)
    ref_llm.close()
    del ref_llm
    torch.cuda.empty_cache()
    with LLM(tensor_parallel_size=2, **kw) as llm:
        toks, lps = _tokens_and_logprobs(llm, lp)
        assert toks == ref[0][0]
        _close(lps, ref[0][1])
        assert _tokens_and_logprobs(llm, plain)[0] == ref[1]      # speculative: drafts verified at TP=2
        assert llm.engine.counts.spec_drafted > 0
        got = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=6, n=2))[0].outputs
        assert sorted(s.token_ids for s in got) == ref_n2
    assert not torch.distributed.is_initialized()


def test_serve_tp2_on_two_gpus_equals_tp1(tmp_path):
    httpx = pytest.importorskip("httpx")
    from gdnserve.entrypoints.llm import LLM
    from tests.entrypoints.live_server import start_server
    proc, url, log = start_server(["--device", "cuda", "--dtype", "float32", "--tensor-parallel-size", "2",
                                   "--max-num-seqs", "8", "--num-pages", "256"], tmp_path / "serve.log", 300)
    try:
        r = httpx.post(url + "/v1/completions", json={"model": "gdnserve-embedded", "prompt": PROMPTS,
                                                     "max_tokens": 10, "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        got = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
        assert r.json()["gdnserve"]["prompts"][1]["published"]      # the marker made a checkpoint group
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
    with LLM(device="cuda", dtype="float32", cuda_graphs=False, max_num_seqs=8, num_pages=256) as ref:
        want = [o.outputs[0].text for o in ref.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10))]
    assert got == want


def test_a_worker_that_raises_ends_the_engine_on_nccl():
    from gdnserve.entrypoints.llm import LLM
    llm = LLM(tensor_parallel_size=2, device="cuda", max_num_seqs=4, num_pages=64)
    try:
        params = SamplingParams(temperature=0, max_tokens=4)
        assert llm.generate(["warm up"], params)[0].outputs[0].token_ids
        runner = llm.engine.runner
        runner._ops.append(("bogus", []))          # rank 1 raises before its step; rank 0 waits in a collective
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="tensor-parallel worker rank 1 exited with exit code 1"):
            llm.generate(["this one fails"], params)
        with pytest.raises(EngineDeadError, match="rank 1 exited"):
            llm.generate(["so does this"], params)
        assert time.monotonic() - t0 < 120
    finally:
        llm.close()
    assert not any(p.is_alive() for p in runner.group.procs)
