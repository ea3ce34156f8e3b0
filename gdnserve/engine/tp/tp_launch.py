"""Start a tensor-parallel engine: validate N against the model and the GPUs (tp_check.py), spawn the workers,
load rank 0's shard while they load theirs, and build the LLMEngine over a TPRunner (tp_workers.py,
tp_runner.py)."""
from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from gdnserve.engine.config import EngineConfig
from gdnserve.engine.llm_engine import LLMEngine
from gdnserve.engine.tp.tp_check import check_tensor_parallel
from gdnserve.engine.tp.tp_runner import TPRunner
from gdnserve.engine.tp.tp_workers import ModelSpec, TPGroup


def start_tp_engine(model: str | None, dtype: torch.dtype, device: torch.device, cfg: EngineConfig) -> LLMEngine:
    from gdnserve.models.builtin import builtin_config
    from gdnserve.models.config import ModelConfig
    from gdnserve.models.tokenizer import load_tokenizer
    n = cfg.tensor_parallel_size
    check_tensor_parallel(builtin_config() if model is None else ModelConfig.from_hf(Path(model)), n, device)
    spec = ModelSpec(model, str(dtype).removeprefix("torch."), device.type)
    group = TPGroup(spec, n, cfg.runner_config())
    try:
        group.start()
        net = spec.load(0, n)              # rank 0's shard, while the workers load theirs
        engine = LLMEngine(net, load_tokenizer(model), cfg, runner_factory=partial(TPRunner, group=group))
        group.wait_ready()
    except BaseException:
        group.close()
        raise
    return engine
