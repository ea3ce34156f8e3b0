"""Start a tensor-parallel engine: validate N against the model and the GPUs, spawn the workers, load rank 0's
shard while they load theirs, and build the LLMEngine over a TPRunner (tp_workers.py, tp_runner.py)."""
from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from gdnserve.engine.config import EngineConfig
from gdnserve.engine.llm_engine import LLMEngine
from gdnserve.engine.tp.tp_runner import TPRunner
from gdnserve.engine.tp.tp_workers import ModelSpec, TPGroup


def check_tensor_parallel(model_cfg, n: int, device: torch.device) -> None:
    """ValueError naming the config field that N does not divide, or the GPUs that are missing."""
    from gdnserve.models.qwen3_5 import check_tp
    try:
        check_tp(model_cfg, n)
    except ValueError as e:
        raise ValueError(f"tensor_parallel_size = {n} does not divide the model: "
                         f"{str(e).removeprefix('tensor parallel: ').replace('tp_size = ', '')}") from None
    if device.type == "cuda":
        if device.index not in (None, 0):
            raise ValueError(f"tensor_parallel_size = {n}: ranks use cuda:0..cuda:{n - 1} of the visible GPUs; "
                             f"choose them with CUDA_VISIBLE_DEVICES, not device {device}")
        have = torch.cuda.device_count()
        if n > have:
            raise ValueError(f"tensor_parallel_size = {n} needs {n} GPUs (one per rank), {have} visible")
    elif device.type != "cpu":
        raise ValueError(f"tensor_parallel_size = {n}: device must be cuda or cpu, got {device}")


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
