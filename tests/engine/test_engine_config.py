"""EngineConfig: every default once, frozen, validated with the field's name; the engine derives the runner's
config without touching the caller's; the CLI's defaults are EngineConfig's."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from gdnserve.engine.config import EngineConfig
from gdnserve.engine.execution.model_runner import RunnerConfig
from gdnserve.engine.llm_engine import LLMEngine
from gdnserve.entrypoints.serve import add_serve_arguments
from gdnserve.models.builtin import build_builtin_model
from gdnserve.models.tokenizer import ByteTokenizer


def test_the_callers_runner_config_is_not_mutated():
    rc = RunnerConfig(num_slots=7, num_pages=33, page_size=8)
    before = dataclasses.replace(rc)
    e = LLMEngine(build_builtin_model(), ByteTokenizer(), runner=rc, max_num_seqs=3, spec_k=2, max_model_len=512)
    assert rc == before
    assert e.runner.rc is not rc and e.runner.rc.spec_tokens == 3 and e.runner.rc.graph_max_batch == 3
    assert e.kv.state.num_slots == 7 and e.kv.pages.num_pages == 33 and e.runner.state is e.kv.state


def test_frozen_validated_and_the_cli_defaults_are_its_own():
    c = EngineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.max_num_seqs = 3
    for field, bad in [("max_num_seqs", 0), ("prefill_mode", "x"), ("spec_k", -1), ("spec_draft", "eagle"),
                       ("max_partial_prefills", 0), ("max_partial_prefills", True)]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(**{field: bad})
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    args = p.parse_args([])
    for name in ("max_num_seqs", "max_model_len", "num_pages", "num_slots", "prefill_mode", "spec_k", "spec_mode",
                 "spec_draft", "gpu_memory_utilization", "memory_budget_gb"):
        assert getattr(args, name) == getattr(c, name), name


def test_prefill_graph_buckets_reach_the_step_token_budget():
    """A step may hold max_step_tokens prefill tokens (many sequences), more than one sequence's max_model_len:
    the prefill / mixed graph buckets must reach it, or every large grouped step falls back to eager (it did,
    capped at min(max_model_len, 8192), before the engine passed max_step_tokens on)."""
    assert EngineConfig(max_step_tokens=8192, max_model_len=4096).runner_config().graph_max_tokens == 8192
    e = LLMEngine(build_builtin_model(), ByteTokenizer(), runner=RunnerConfig(num_slots=9, num_pages=64, page_size=8),
                  max_num_seqs=4, max_step_tokens=300, max_model_len=128)
    assert e.runner.rc.graph_max_tokens == 300
