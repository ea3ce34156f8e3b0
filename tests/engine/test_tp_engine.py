"""Tensor parallelism as an engine option: N is checked against the model's heads and the GPUs before anything
starts (errors name the config field and the numbers), the embedded model's shards are its full weights cut per
rank, and a worker that raises ends the engine with its error (every later request too) instead of a hang; close
joins the workers. The TP=2 vs TP=1 outputs through the real server: tests/entrypoints/test_tp_server.py."""
from __future__ import annotations

import time

import pytest
import torch

from gdnserve.engine.config import EngineConfig
from gdnserve.engine.engine_api import EngineDeadError
from gdnserve.engine.sampling_params import SamplingParams
from gdnserve.engine.tp.tp_check import check_tensor_parallel
from gdnserve.models.builtin import build_builtin_model, builtin_config


def test_tensor_parallel_size_is_validated_before_anything_starts():
    from gdnserve.entrypoints.llm import LLM
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
            EngineConfig(tensor_parallel_size=bad)
    with pytest.raises(ValueError, match="cuda_graphs / graph_capture: not with tensor_parallel_size = 2"):
        EngineConfig(tensor_parallel_size=2, cuda_graphs=True)
    assert EngineConfig(tensor_parallel_size=2).runner_config().cuda_graphs is False
    # the embedded model: 2 GDN key heads, 4 value heads, 4 attention heads, 2 KV heads
    with pytest.raises(ValueError, match="tensor_parallel_size = 4 does not divide the model: config "
                                         "linear_num_key_heads = 2 is not divisible by 4"):
        LLM(tensor_parallel_size=4, device="cpu")
    with pytest.raises(ValueError, match="config linear_num_key_heads = 2 is not divisible by 3"):
        check_tensor_parallel(builtin_config(), 3, torch.device("cpu"))
    gpus = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"tensor_parallel_size = 2 needs 2 GPUs \\(one per rank\\), {gpus} visible"
                       if gpus < 2 else "choose them with CUDA_VISIBLE_DEVICES, not device cuda:1"):
        check_tensor_parallel(builtin_config(), 2, torch.device("cuda:1" if gpus >= 2 else "cuda"))


def test_embedded_model_shards_are_the_full_weights_cut_per_rank():
    full = dict(build_builtin_model().named_parameters())
    shards = [dict(build_builtin_model(tp_rank=r, tp_size=2).named_parameters()) for r in range(2)]
    g = builtin_config().gdn
    qkv = [g.num_k_heads * g.head_k_dim] * 2 + [g.num_v_heads * g.head_v_dim]
    conv = [torch.split(shards[r]["layers.0.mixer.conv_weight"], [q // 2 for q in qkv]) for r in range(2)]
    want = torch.cat([torch.cat([conv[0][b], conv[1][b]]) for b in range(3)])
    assert torch.equal(want, full["layers.0.mixer.conv_weight"])
    assert torch.equal(torch.cat([s["layers.3.mixer.o_proj.weight"] for s in shards], 1),
                       full["layers.3.mixer.o_proj.weight"])
    assert torch.equal(shards[1]["embed_tokens.weight"], full["embed_tokens.weight"])
    assert shards[0].keys() == full.keys()


def test_mtp_drafts_in_intermediate_mode_then_a_worker_that_raises_ends_the_engine_and_close_joins():
    """The MTP drafter and intermediate-mode commits ship as acceptance ops (the server test covers n-gram drafts
    in replay mode, whose flushes ship the same way); greedy tokens equal TP = 1's."""
    from gdnserve.entrypoints.llm import LLM
    kw = dict(device="cpu", max_num_seqs=4, num_pages=64, spec_k=2, spec_draft="mtp", spec_mode="intermediate")
    prompts = ["a first prompt", "and another <|state_checkpoint|> one", "and another <|state_checkpoint|> two"]
    params = SamplingParams(temperature=0, max_tokens=6)
    ref = [o.outputs[0].token_ids for o in LLM(cuda_graphs=False, **kw).generate(prompts, params)]
    llm = LLM(tensor_parallel_size=2, **kw)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == ref
        assert llm.engine.counts.spec_drafted > 0
        runner = llm.engine.runner
        runner._ops.append(("bogus", []))      # the next step's message makes rank 1 raise
        params = SamplingParams(temperature=0, max_tokens=4)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"tensor-parallel worker rank 1 exited with exit code 1 after "
                                                  r"raising ValueError: unknown op 'bogus' from rank 0"):
            llm.generate(["this one fails"], params)
        with pytest.raises(EngineDeadError, match="rank 1 exited"):      # and so does every later request
            llm.generate(["so does this"], params)
        assert time.monotonic() - t0 < 120                               # failed, not hung (a generous bound)
        assert llm.engine.has_unfinished() is False
    finally:
        llm.close()
    assert not any(p.is_alive() for p in runner.group.procs)
    assert not torch.distributed.is_initialized()                       # the next engine in this process is TP=1
    llm.close()                                                          # idempotent
