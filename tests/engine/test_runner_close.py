"""LLMEngine.close() unbinds the model from its runner's pools: the model outlives its engine (a benchmark or a
test builds engine after engine on one model), and bound layers' views kept a dead engine's pools alive (19.3 GiB on
the H200 when bench_engine_overhead built its next engine). A layer a newer engine bound is left as it is."""
from __future__ import annotations

import gc
import weakref

import torch

from benchmarks.random_model import NullTokenizer, build_random_model, tiny_hf_config
from gdnserve.engine.config import EngineConfig
from gdnserve.engine.llm_engine import LLMEngine
from gdnserve.engine.sampling_params import SamplingParams

CFG = dict(max_num_seqs=4, num_pages=64, num_slots=6)


def engine(model, **kw) -> LLMEngine:
    e = LLMEngine(model, NullTokenizer(), EngineConfig(**CFG, **kw))
    e.add_request(None, [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    while e.has_unfinished():
        e.step()
    return e


def test_a_closed_engines_pools_are_freed_with_it():
    model = build_random_model(tiny_hf_config(), torch.device("cpu"), torch.float32)
    e = engine(model, overlap=True)
    pools = [weakref.ref(t) for t in (e.runner.state.conv_pools, e.runner.state.ssm_pools, e.runner.pages.k_pools,
                                      e.runner.pages.v_pools)]
    e.close()
    e.close()                                                   # idempotent
    assert all(m.ssm_pool is None and m.conv_pool is None for m in model.gdn_layers())
    assert all(m.k_cache is None and m.v_cache is None for m in model.attention_layers())
    del e
    gc.collect()
    assert all(r() is None for r in pools)
    assert engine(model).runner.step is not None               # the model binds again for the next engine


def test_closing_an_older_engine_leaves_a_newer_binding():
    model = build_random_model(tiny_hf_config(), torch.device("cpu"), torch.float32)
    old = engine(model)
    new = engine(model)                                         # binds the model to its own pools
    old.close()
    assert all(m.ssm_pool.data_ptr() == new.runner.state.ssm(i).data_ptr()
               for i, m in enumerate(model.gdn_layers()))
    assert all(m.k_cache is not None for m in model.attention_layers())
    new.add_request(None, [9, 10, 11], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while new.has_unfinished():
        new.step()
