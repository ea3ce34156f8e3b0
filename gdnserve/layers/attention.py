"""Gated full attention of the hybrid decoder (Qwen3-Next / Qwen3.5): q_proj of twice the width
gives per head ``[q | gate]``; zero-centred RMSNorm on q and k per head; partial rotary; paged KV
cache; output multiplied by sigmoid(gate) before o_proj. One fused q/k/v projection."""
from __future__ import annotations

import torch
from torch import nn

from gdnserve.layers.forward_context import get_forward_context
from gdnserve.layers.norm import RMSNorm
from gdnserve.layers.rotary import PartialRotary
from gdnserve.ops.attention import paged_attention, store_kv


class GatedAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int,
                 rope_theta: float, eps: float):
        super().__init__()
        self.QH, self.KVH, self.Dh = num_heads, num_kv_heads, head_dim
        self.qkv_proj = nn.Linear(hidden, num_heads * head_dim * 2 + 2 * num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)
        self.rotary = PartialRotary(head_dim, rotary_dim, rope_theta)
        self.k_cache: torch.Tensor | None = None      # [pages, page_size, KVH, Dh], bound by the runner
        self.v_cache: torch.Tensor | None = None
        self.backend = "auto"

    def bind_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        T = h.shape[0]
        QH, KVH, Dh = self.QH, self.KVH, self.Dh
        qkv = self.qkv_proj(h)
        qg = qkv[:, :2 * QH * Dh].view(T, QH, 2 * Dh)
        q, gate = qg[..., :Dh], qg[..., Dh:].reshape(T, QH * Dh)
        k = qkv[:, 2 * QH * Dh:2 * QH * Dh + KVH * Dh].view(T, KVH, Dh)
        v = qkv[:, 2 * QH * Dh + KVH * Dh:].view(T, KVH, Dh)
        cos, sin = self.rotary.cos_sin(ctx.positions, h.dtype)
        q = self.rotary(self.q_norm(q), cos, sin)
        k = self.rotary(self.k_norm(k), cos, sin)
        m = ctx.attn
        store_kv(k, v.contiguous(), self.k_cache, self.v_cache, m.slot_mapping, m.token_index)
        o = paged_attention(q.contiguous(), self.k_cache, self.v_cache, m.cu_seqlens_q, m.kv_lens, m.page_table,
                            scale=Dh ** -0.5, backend=self.backend)
        return self.o_proj(o.reshape(T, QH * Dh) * torch.sigmoid(gate))
