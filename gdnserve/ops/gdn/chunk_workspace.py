"""Scratch tensors of the chunked prefill, preallocated once for a (token, chunk-row) bucket so that
steps reuse them (and CUDA graphs capture fixed addresses). Sizes: gdn_kernels.md Appendix A.

The normalised keys and Q' exist for the two-launch path; the segment buffers only for context-parallel sequences; 𝒯'/M' only with ``fused_main`` (which reads none of
𝒲, Ũ, kn, Q'). Both, like the state pass's sync buffer, are
allocated on first use (warm a bucket before capturing it)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gdnserve.ops.varlen import CHUNK


@dataclass(slots=True)
class ChunkWorkspace:
    gcum: torch.Tensor   # [T, HV] fp32   chunk-local cumulative log-decay
    w: torch.Tensor      # [T, HV, K]     T (beta Gamma K)   (activation dtype)
    u: torch.Tensor      # [T, HV, V]     T (beta V)
    max_chunk_rows: int
    kn: torch.Tensor | None = None     # [T, H, K]       l2-normalised keys (prep -> state pass)
    qp: torch.Tensor | None = None     # [T, HV, K]      Q' = s·[diag(Γ) Q − (M ⊙ Q Kᵀ) 𝒲]
    sync: torch.Tensor | None = None   # int32 ticket counter + ready flags of the state pass
    seg_b: torch.Tensor | None = None  # [rows, HV, V, K] fp32  context-parallel segments: B, then the start state
    seg_p: torch.Tensor | None = None  # [rows, HV, K, K] fp32  a segment's state transition P
    tm: torch.Tensor | None = None     # [2, T, HV, C]   𝒯' = 𝒯 diag(β) and M' (``fused_main``)
    qkn: torch.Tensor | None = None    # [2, T, H, K]    l2-normalised q and k (``fused_main`` + ``main_qk_store``)

    @staticmethod
    def empty(max_tokens: int, max_chunk_rows: int, HV: int, K: int, V: int, dtype: torch.dtype,
              device: torch.device | str) -> "ChunkWorkspace":
        return ChunkWorkspace(
            gcum=torch.empty(max_tokens, HV, dtype=torch.float32, device=device),
            w=torch.empty(max_tokens, HV, K, dtype=dtype, device=device),
            u=torch.empty(max_tokens, HV, V, dtype=dtype, device=device),
            max_chunk_rows=max_chunk_rows,
        )

    def prep_buffers(self, H: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(kn, qp) for the state pass's normalised keys and the prep-formed output operand."""
        if self.kn is None or self.kn.shape[1] != H:
            T, HV, K = self.w.shape
            self.kn = torch.empty(T, H, K, dtype=self.w.dtype, device=self.w.device)
            self.qp = torch.empty_like(self.w)
        return self.kn, self.qp

    def tm_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(𝒯', M') of the fused main kernel (``fused_main``): C = 64 values per token and value head each."""
        if self.tm is None:
            T, HV, _ = self.w.shape
            self.tm = torch.empty(2, T, HV, CHUNK, dtype=self.w.dtype, device=self.w.device)
        return self.tm[0], self.tm[1]

    def qk_buffers(self, H: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(qn, kn): the fused prep's l2-normalised q and k in the activation dtype, one copy per key head."""
        if self.qkn is None or self.qkn.shape[2] != H:
            T, _, K = self.w.shape
            self.qkn = torch.empty(2, T, H, K, dtype=self.w.dtype, device=self.w.device)
        return self.qkn[0], self.qkn[1]

    def sync_buffer(self, n: int) -> torch.Tensor:
        """The first n ints of the state pass's sync buffer (grown on demand; fixed address afterwards)."""
        if self.sync is None or self.sync.numel() < n:
            self.sync = torch.zeros(max(n, 4096), dtype=torch.int32, device=self.w.device)
        return self.sync[:n]

    def seg_buffers(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """B/start and P buffers of the context-parallel state pass for ``rows`` segments (grown on demand)."""
        if self.seg_b is None or self.seg_b.shape[0] < rows:
            T, HV, V = self.u.shape
            K = self.w.shape[2]
            dev = self.w.device
            self.seg_b = torch.empty(rows, HV, V, K, dtype=torch.float32, device=dev)
            self.seg_p = torch.empty(rows, HV, K, K, dtype=torch.float32, device=dev)
        return self.seg_b, self.seg_p

    @staticmethod
    def ensure(ws: "ChunkWorkspace | None", meta, HV: int, K: int, V: int, dtype: torch.dtype,
               device: torch.device) -> "ChunkWorkspace":
        """``ws`` when it fits the call described by ``meta`` (a VarlenMeta), else a fresh one."""
        if ws is None or not ws.fits(meta.num_tokens, meta.num_chunk_rows, HV, K, V, dtype):
            ws = ChunkWorkspace.empty(meta.num_tokens, meta.num_chunk_rows, HV, K, V, dtype, device)
        return ws

    def fits(self, tokens: int, chunk_rows: int, HV: int, K: int, V: int, dtype: torch.dtype) -> bool:
        return (self.w.shape[0] >= tokens and self.max_chunk_rows >= chunk_rows and self.w.shape[1:] == (HV, K)
                and self.u.shape[2] == V and self.w.dtype == dtype)
