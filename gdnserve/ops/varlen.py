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


ALIGN_INTS = 4
"""Packed int32 vectors start on 16-byte boundaries: Triton specialises a kernel on each pointer's 16-byte
alignment, so views at arbitrary offsets compiled a new variant whenever a step's vector lengths shifted them
(seen on the H200: 1-5 s compiles inside serving passes)."""


def aligned(n: int) -> int:
    """n rounded up to a multiple of ALIGN_INTS."""
    return -(-n // ALIGN_INTS) * ALIGN_INTS


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
    def host_vectors(seqlens: Sequence[int], pad_chunks_to: int | None = None) -> list[int]:
        """The int32 vectors of a meta, flattened on the host: cu_seqlens (N+1), chunk_offsets (N+1),
        chunk_indices (2 * rows). A plan builder concatenates several of these into one staging
        buffer and makes the metas with :meth:`from_device` after a single host-to-device copy."""
        if len(seqlens) == 0:
            raise ValueError("seqlens: need at least one sequence")
        lens = [int(x) for x in seqlens]
        if any(x < 0 for x in lens):
            raise ValueError(f"seqlens: lengths must be >= 0, got {lens}")
        cu, offs, rows = [0], [0], []
        for n, L in enumerate(lens):
            cu.append(cu[-1] + L)
            nc = num_chunks(L)
            offs.append(offs[-1] + nc)
            for c in range(nc):
                rows += [n, c]
        if pad_chunks_to is not None:
            if pad_chunks_to < offs[-1]:
                raise ValueError(f"pad_chunks_to={pad_chunks_to} < needed chunk rows {offs[-1]}")
            rows += [-1, -1] * (pad_chunks_to - offs[-1])
        gap = [0] * (aligned(len(lens) + 1) - len(lens) - 1)   # each of the three vectors starts 16-byte aligned
        return cu + gap + offs + gap + rows

    @staticmethod
    def from_device(vec: torch.Tensor, seqlens: Sequence[int]) -> "VarlenMeta":
        """Views into ``vec``, a device int32 copy of :meth:`host_vectors` (same seqlens and padding)."""
        lens = tuple(int(x) for x in seqlens)
        n = len(lens)
        nt = sum(num_chunks(L) for L in lens)
        m = aligned(n + 1)
        nrows = (vec.numel() - 2 * m) // 2
        return VarlenMeta(
            cu_seqlens=vec[: n + 1],
            chunk_offsets=vec[m: m + n + 1],
            chunk_indices=vec[2 * m: 2 * m + 2 * nrows].view(nrows, 2),
            seqlens=lens,
            num_tokens=sum(lens),
            num_chunks=nt,
            num_chunk_rows=nrows,
            max_len=max(lens),
        )

    @staticmethod
    def build(seqlens: Sequence[int], device: torch.device | str, pad_chunks_to: int | None = None) -> "VarlenMeta":
        """Standalone meta with its own host-to-device copy (ops tests, benchmarks); the engine packs
        every meta of a step into one copy instead (engine/execution/step_plan.py)."""
        host = torch.tensor(VarlenMeta.host_vectors(seqlens, pad_chunks_to), dtype=INDEX_DTYPE)
        if torch.device(device).type == "cuda":
            host = host.pin_memory()
        return VarlenMeta.from_device(host.to(device, non_blocking=True), seqlens)
