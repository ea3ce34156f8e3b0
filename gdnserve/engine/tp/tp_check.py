"""Does a tensor-parallel size fit: N against the model's heads and experts, and against the GPUs. Its own module
so that the memory plan (memory/memory_budget.py) checks N before anything is loaded without importing the
launcher, which builds an LLMEngine."""
from __future__ import annotations

import torch


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
