"""Packed-varlen metadata, built once on the host from scheduler-known lengths.

Every chunked kernel (conv prefill and the gated-delta-rule chunk stages) maps its program id
through ``chunk_indices`` to a (sequence, chunk) pair, so no kernel ever derives lengths on the
device and no launcher reads device memory. Each sequence owns ``max(1, ceil(L / CHUNK))`` chunk
rows: a zero-length sequence still gets one row so that its history/state is carried from its
source slot to its destination slot.

Padding for CUDA-graph buckets: ``pad_chunks_to`` appends sentinel rows ``(-1, -1)`` (kernels exit)
so one grid size serves every step of a bucket.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from gdnserve.ops.checks import INDEX_DTYPE

CHUNK = 64  # chunk length of the chunked algorithm and token block of the conv prefill kernel


def num_chunks(length: int) -> int:
    return max(1, -(-length // CHUNK))


@dataclass(frozen=True, slots=True)
class VarlenMeta:
    cu_seqlens: torch.Tensor      # [N+1] int32: sequence n owns tokens [cu[n], cu[n+1])
    chunk_indices: torch.Tensor   # [NT_pad, 2] int32: (sequence, chunk within sequence); (-1, -1) = sentinel
    chunk_offsets: torch.Tensor   # [N+1] int32: first chunk row of each sequence (snapshot index)
    seqlens: tuple[int, ...]      # host copy of the lengths
    num_tokens: int
    num_chunks: int               # real chunk rows
    num_chunk_rows: int           # grid size (>= num_chunks when padded)
    max_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seqlens)

    @staticmethod
    def build(seqlens: Sequence[int], device: torch.device | str, pad_chunks_to: int | None = None) -> "VarlenMeta":
        if len(seqlens) == 0:
            raise ValueError("seqlens: need at least one sequence")
        lens = [int(x) for x in seqlens]
        if any(x < 0 for x in lens):
            raise ValueError(f"seqlens: lengths must be >= 0, got {lens}")
        cu = [0]
        offs = [0]
        rows: list[int] = []
        for n, L in enumerate(lens):
            cu.append(cu[-1] + L)
            nc = num_chunks(L)
            offs.append(offs[-1] + nc)
            for c in range(nc):
                rows += [n, c]
        nt = offs[-1]
        nrows = nt
        if pad_chunks_to is not None:
            if pad_chunks_to < nt:
                raise ValueError(f"pad_chunks_to={pad_chunks_to} < needed chunk rows {nt}")
            rows += [-1, -1] * (pad_chunks_to - nt)
            nrows = pad_chunks_to
        # One pinned staging buffer and one host-to-device copy for all three vectors.
        host = torch.tensor(cu + offs + rows, dtype=INDEX_DTYPE)
        if torch.device(device).type == "cuda":
            host = host.pin_memory()
        dev = host.to(device, non_blocking=True)
        n = len(lens)
        return VarlenMeta(
            cu_seqlens=dev[: n + 1],
            chunk_offsets=dev[n + 1: 2 * n + 2],
            chunk_indices=dev[2 * n + 2:].view(nrows, 2),
            seqlens=tuple(lens),
            num_tokens=cu[-1],
            num_chunks=nt,
            num_chunk_rows=nrows,
            max_len=max(lens),
        )
