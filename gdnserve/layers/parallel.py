"""Tensor-parallel group facts, nano-vllm style: the TP group is the whole ``torch.distributed`` world
(NCCL on GPUs, gloo on CPU). Without an initialised process group the model runs at world size 1 and
every reduction is a no-op, so single-process code needs no set-up."""
from __future__ import annotations

import torch
import torch.distributed as dist


def _initialised() -> bool:
    return dist.is_available() and dist.is_initialized()


def tp_rank() -> int:
    """This process's rank in the TP group (0 without torch.distributed)."""
    return dist.get_rank() if _initialised() else 0


def tp_size() -> int:
    """The TP world size (1 without torch.distributed)."""
    return dist.get_world_size() if _initialised() else 1


def resolve(rank: int | None, size: int | None) -> tuple[int, int]:
    """Explicit (rank, size) where given, else the process group's; validated."""
    rank = tp_rank() if rank is None else rank
    size = tp_size() if size is None else size
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"tensor parallel: need 0 <= tp_rank < tp_size, got tp_rank={rank}, tp_size={size}")
    return rank, size


def all_reduce(x: torch.Tensor, size: int | None = None) -> torch.Tensor:
    """Sum ``x`` in place over the TP group; a no-op at world size 1. ``size`` is the caller's sharding
    (default: the group's): a layer sharded for ``size > 1`` in a process group of another size fails
    instead of silently returning its partial sum."""
    size = tp_size() if size is None else size
    if size == 1:
        return x
    if tp_size() != size:
        raise RuntimeError(f"a layer sharded for tp_size={size} ran in a process group of world size {tp_size()} "
                           "(initialise torch.distributed with that many ranks)")
    dist.all_reduce(x)
    return x
