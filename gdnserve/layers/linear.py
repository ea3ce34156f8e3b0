"""Tensor-parallel linear layers (the nano-vllm pattern) and the sharding rule every TP-split parameter
follows.

A split parameter is described by a :class:`Shard`: along one dim the full tensor is a concatenation of
blocks (e.g. the GDN in-projection's ``[q | k | v | z | b | a]`` rows), and each block is cut into
``tp_size`` equal contiguous parts, rank ``p`` keeping part ``p`` of every block. Cutting each block
separately is what keeps fused projections correct: rank ``p`` gets its own heads of q, of k and of v,
not a contiguous run of the fused rows. Modules list their split parameters in ``tp_shards`` (plain data,
so it survives building on the meta device); :func:`weight_loader` turns a FULL checkpoint tensor into
this rank's part. Column-parallel layers need no communication; a row-parallel layer sums its partial
outputs with one all-reduce (``reduce_results=False`` leaves that to the caller, e.g. the MoE block).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gdnserve.layers.parallel import all_reduce, resolve


@dataclass(frozen=True, slots=True)
class Shard:
    """Along ``dim`` the full tensor is ``blocks`` (full sizes, in order); each is split across ranks."""
    dim: int
    blocks: tuple[int, ...]


def local_blocks(blocks: tuple[int, ...] | list[int], tp_size: int, owner: str) -> tuple[int, ...]:
    """Per-rank sizes of ``blocks``; ValueError naming ``owner`` when a block does not divide."""
    for i, b in enumerate(blocks):
        if b % tp_size:
            raise ValueError(f"{owner}: block {i} of size {b} is not divisible by tp_size={tp_size}")
    return tuple(b // tp_size for b in blocks)


def take_shard(full: torch.Tensor, shard: Shard, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``full`` (a new contiguous tensor): part ``rank`` of each block along
    ``shard.dim``, concatenated in block order."""
    parts = torch.split(full, list(shard.blocks), dim=shard.dim)
    return torch.cat([p.narrow(shard.dim, rank * (p.shape[shard.dim] // size), p.shape[shard.dim] // size)
                      for p in parts], dim=shard.dim)


def full_shape(module: nn.Module, name: str) -> list[int]:
    """The checkpoint (unsharded) shape of ``module``'s own parameter ``name``."""
    shape = list(getattr(module, name).shape)
    spec = getattr(module, "tp_shards", {}).get(name)
    if spec is not None:
        shape[spec.dim] = sum(spec.blocks)
    return shape


def weight_loader(module: nn.Module, name: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``module``'s parameter ``name`` from the FULL checkpoint tensor (replicated
    parameters: ``full`` itself). ValueError when ``full`` does not have the checkpoint shape."""
    want = full_shape(module, name)
    if list(full.shape) != want:
        raise ValueError(f"checkpoint tensor has shape {list(full.shape)}, expected {want}")
    spec = getattr(module, "tp_shards", {}).get(name)
    if spec is None or module.tp_size == 1:
        return full
    return take_shard(full, spec, module.tp_rank, module.tp_size)


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ with W's output rows split across ranks: x replicated [T, in] -> y local [T, out / tp].
    ``blocks`` (default: one block of ``out_features``) are the output blocks each split separately."""

    def __init__(self, in_features: int, out_features: int, *, blocks: tuple[int, ...] | None = None,
                 tp_rank: int | None = None, tp_size: int | None = None):
        super().__init__()
        self.tp_rank, self.tp_size = resolve(tp_rank, tp_size)
        blocks = (out_features,) if blocks is None else tuple(blocks)
        if sum(blocks) != out_features:
            raise ValueError(f"{type(self).__name__}: blocks {list(blocks)} do not sum to out_features={out_features}")
        self.in_features, self.out_features = in_features, out_features
        self.local_blocks = local_blocks(blocks, self.tp_size, type(self).__name__)
        self.weight = nn.Parameter(torch.empty(sum(self.local_blocks), in_features))
        self.tp_shards = {"weight": Shard(0, blocks)}

    def weight_loader(self, full: torch.Tensor) -> torch.Tensor:
        return weight_loader(self, "weight", full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections fused into one GEMM: the output is ``blocks`` (full sizes),
    each sharded separately, so this rank's output is its part of block 0, then of block 1, ... with
    sizes ``local_blocks``. The GDN in-projection ``[q | k | v | z | b | a]``, attention's
    ``[q+gate per head | k | v]`` and the MLP's ``[gate | up]``."""

    def __init__(self, in_features: int, blocks: tuple[int, ...] | list[int], *, tp_rank: int | None = None,
                 tp_size: int | None = None):
        super().__init__(in_features, sum(blocks), blocks=tuple(blocks), tp_rank=tp_rank, tp_size=tp_size)


class RowParallelLinear(nn.Module):
    """y = x Wᵀ with W's input columns split across ranks: x local [T, in / tp] -> y [T, out], the sum of
    the ranks' partial products: one all-reduce after the GEMM (skipped with ``reduce_results=False``,
    where the caller sums several partials with one all-reduce of its own)."""

    def __init__(self, in_features: int, out_features: int, *, reduce_results: bool = True,
                 tp_rank: int | None = None, tp_size: int | None = None):
        super().__init__()
        self.tp_rank, self.tp_size = resolve(tp_rank, tp_size)
        self.in_features, self.out_features = in_features, out_features
        self.reduce_results = reduce_results
        (in_local,) = local_blocks((in_features,), self.tp_size, type(self).__name__)
        self.weight = nn.Parameter(torch.empty(out_features, in_local))
        self.tp_shards = {"weight": Shard(1, (in_features,))}

    def weight_loader(self, full: torch.Tensor) -> torch.Tensor:
        return weight_loader(self, "weight", full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        return all_reduce(y, self.tp_size) if self.reduce_results else y


def load_shard(root: nn.Module, name: str, full: torch.Tensor) -> torch.Tensor:
    """:func:`weight_loader` for the parameter ``root.<name>`` (a dotted name, e.g. ``"mixer.in_proj.weight"``)."""
    owner, _, attr = name.rpartition(".")
    return weight_loader(root.get_submodule(owner) if owner else root, attr, full)
