"""Device-side grouping of the T*k (token, expert) pairs for the grouped GEMM, with no host read.

The pairs are sorted by expert and each expert's run is padded to a multiple of the row block ``BM``, so
every block of ``BM`` sorted rows belongs to one expert. The number of blocks is bounded on the host from
shapes alone (at most min(T*k, E) experts are non-empty, each wasting < BM rows), so the grid is fixed and a
CUDA graph can capture it; blocks past the end carry expert -1 and exit at once.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class Alignment(NamedTuple):
    rows: torch.Tensor          # [P] int32: the pair (token * k + j) in each padded sorted row; T*k = padding
    block_expert: torch.Tensor  # [P // BM] int32: the expert of each row block, -1 for unused blocks
    BM: int


def padded_rows(num_pairs: int, num_experts: int, BM: int) -> int:
    """Host bound on the padded row count (a multiple of BM)."""
    bound = num_pairs + min(num_pairs, num_experts) * (BM - 1)
    return -(-bound // BM) * BM


def align_pairs(experts: torch.Tensor, num_experts: int, BM: int) -> Alignment:
    """experts [T, k] (any int dtype) -> Alignment. Within an expert the pairs keep token order."""
    dev = experts.device
    flat = experts.flatten().long()
    N = flat.numel()
    P = padded_rows(N, num_experts, BM)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + (BM - 1)) // BM * BM
    pad_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts
    sorted_e = flat[order]
    dest = (pad_end - padded)[sorted_e] + torch.arange(N, device=dev) - start[sorted_e]
    rows = torch.full((P,), N, dtype=torch.int32, device=dev)
    rows[dest] = order.to(torch.int32)
    block_start = torch.arange(0, P, BM, device=dev)
    be = torch.searchsorted(pad_end, block_start, right=True)
    block_expert = torch.where(be < num_experts, be, -1).to(torch.int32)
    return Alignment(rows, block_expert, BM)
