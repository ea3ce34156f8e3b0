"""Partial rotary embedding (rotate-half style on the first ``rotary_dim`` dims of each head), as the
Qwen3.5 text model applies it (its mrope sections collapse to plain rope for text positions). The math lives
in ``ops/attention/rope.py`` (also fused there with the q/k norm for the Triton backend)."""
from __future__ import annotations

import torch
from torch import nn

from gdnserve.ops.attention.rope import apply_rope, rope_cos_sin


class PartialRotary(nn.Module):
    def __init__(self, head_dim: int, rotary_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.rotary_dim, self.theta = head_dim, rotary_dim, theta
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self, device: torch.device | str | None = None) -> torch.Tensor:
        return 1.0 / (self.theta ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float, device=device)
                                     / self.rotary_dim))

    def reset_buffers(self) -> None:
        """Recompute the (non-persistent) frequencies, e.g. after building on the meta device."""
        self.inv_freq = self._inv_freq(self.inv_freq.device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """-> cos, sin [T, rotary_dim] in ``dtype``."""
        return rope_cos_sin(positions, self.inv_freq, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]; cos, sin: [T, rotary_dim]."""
        return apply_rope(x, cos, sin)
