"""Scratch tensors of the chunked prefill, preallocated once for a (token, chunk-row) bucket so that
steps reuse them (and CUDA graphs capture fixed addresses). Sizes: gdn_kernels.md Appendix A."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class ChunkWorkspace:
    gcum: torch.Tensor   # [T, HV] fp32   chunk-local cumulative log-decay
    w: torch.Tensor      # [T, HV, K]     T (beta Gamma K)   (activation dtype)
    u: torch.Tensor      # [T, HV, V]     T (beta V)
    vnew: torch.Tensor   # [T, HV, V]     U = u - w S0, per chunk
    h: torch.Tensor      # [NT, HV, V, K] state at each chunk start (activation dtype)
    sync: torch.Tensor | None = None   # int32 ticket counter + parent-ready flags of the state pass

    @staticmethod
    def empty(max_tokens: int, max_chunk_rows: int, HV: int, K: int, V: int, dtype: torch.dtype,
              device: torch.device | str) -> "ChunkWorkspace":
        return ChunkWorkspace(
            gcum=torch.empty(max_tokens, HV, dtype=torch.float32, device=device),
            w=torch.empty(max_tokens, HV, K, dtype=dtype, device=device),
            u=torch.empty(max_tokens, HV, V, dtype=dtype, device=device),
            vnew=torch.empty(max_tokens, HV, V, dtype=dtype, device=device),
            h=torch.empty(max_chunk_rows, HV, V, K, dtype=dtype, device=device),
        )

    def sync_buffer(self, n: int) -> torch.Tensor:
        """The first n ints of the state pass's sync buffer (grown on demand; fixed address afterwards)."""
        if self.sync is None or self.sync.numel() < n:
            self.sync = torch.zeros(max(n, 4096), dtype=torch.int32, device=self.w.device)
        return self.sync[:n]

    def fits(self, tokens: int, chunk_rows: int, HV: int, K: int, V: int, dtype: torch.dtype) -> bool:
        return (self.w.shape[0] >= tokens and self.h.shape[0] >= chunk_rows and self.w.shape[1:] == (HV, K)
                and self.u.shape[2] == V and self.w.dtype == dtype)
