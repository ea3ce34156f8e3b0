"""Gated full attention of the hybrid decoder (Qwen3-Next / Qwen3.5): q_proj of twice the width
gives per head ``[q | gate]``; zero-centred RMSNorm on q and k per head; partial rotary; paged KV
cache; output multiplied by sigmoid(gate) before o_proj (``RowParallelLinear.forward_gated``: at decode sizes on
CUDA the skinny GEMM applies the gate as it loads its x tiles; else ``ops.gating.sigmoid_mul``, on the Triton
backend one launch reading the gate in place, else HF's copy, sigmoid and product). One fused q/k/v projection.

Tensor parallel: a rank holds num_heads / tp query heads and num_kv_heads / tp KV heads (the fused
projection's three blocks each split by heads; q_proj's per-head ``[q | gate]`` rows keep a head's q and
gate together), q/k norms replicated, o_proj row-parallel (one all-reduce); the paged KV cache it is bound
to holds the local KV heads. ``QH``, ``KVH`` below are local."""
from __future__ import annotations

import torch
from torch import nn

from gdnserve.layers.forward_context import get_forward_context
from gdnserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from gdnserve.layers.norm import RMSNorm
from gdnserve.layers.parallel import resolve
from gdnserve.layers.rank_shapes import attn_heads
from gdnserve.layers.rotary import PartialRotary
from gdnserve.ops.attention import paged_attention, store_kv
from gdnserve.ops.attention.qk_rope_store import fused_qk_store_default, qk_rope_store
from gdnserve.ops.attention.rope import rms_norm_rope
from gdnserve.ops.backend import resolve as resolve_backend


class GatedAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int,
                 rope_theta: float, eps: float, *, tp_rank: int | None = None, tp_size: int | None = None):
        super().__init__()
        self.tp_rank, self.tp_size = resolve(tp_rank, tp_size)
        tp = self.tp_size
        if num_heads % tp or num_kv_heads % tp:
            raise ValueError(f"GatedAttention: num_heads={num_heads} and num_kv_heads={num_kv_heads} must be "
                             f"divisible by tp_size={tp}")
        (self.QH, self.KVH), self.Dh = attn_heads(num_heads, num_kv_heads, tp), head_dim
        self.qkv_proj = MergedColumnParallelLinear(
            hidden, (num_heads * head_dim * 2, num_kv_heads * head_dim, num_kv_heads * head_dim),
            tp_rank=self.tp_rank, tp_size=tp)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, tp_rank=self.tp_rank, tp_size=tp)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)
        self.rotary = PartialRotary(head_dim, rotary_dim, rope_theta)
        self.k_cache: torch.Tensor | None = None      # [pages, page_size, KVH, Dh], bound by the runner
        self.v_cache: torch.Tensor | None = None
        self.backend = "auto"
        self.fused = True        # the Triton backend's q/k norm + rotary prologue (models.set_fused)
        # q and k norm + rotary and the K/V store as one launch (ops/attention/qk_rope_store; Triton backend, with
        # ``fused``, steps whose slot mapping is one entry per token). Off unless GDNSERVE_FUSED_QK_STORE=1.
        self.fused_qk_store = fused_qk_store_default()

    def bind_cache(self, k_cache: torch.Tensor | None, v_cache: torch.Tensor | None) -> None:
        """The KV cache this layer reads and writes (None, None: unbound, e.g. after its runner closed)."""
        self.k_cache, self.v_cache = k_cache, v_cache

    def takes_quantized_input(self, h: torch.Tensor) -> bool:
        """Whether ``forward`` wants h's FP8 quantization (its qkv_proj would quantize h by its own launch)."""
        return self.qkv_proj.takes_quantized_input(h)

    def forward(self, h: torch.Tensor, xq: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """h [T, hidden] -> [T, hidden]; ``xq``: h's FP8 quantization for qkv_proj (its producer's, or None)."""
        ctx = get_forward_context()
        T = h.shape[0]
        QH, KVH, Dh = self.QH, self.KVH, self.Dh
        qkv = self.qkv_proj(h, xq=xq)
        qg = qkv[:, :2 * QH * Dh].view(T, QH, 2 * Dh)
        q, gate = qg[..., :Dh], qg[..., Dh:]            # gate: [T, QH, Dh] view, read in place when fused
        k = qkv[:, 2 * QH * Dh:2 * QH * Dh + KVH * Dh].view(T, KVH, Dh)
        v = qkv[:, 2 * QH * Dh + KVH * Dh:].view(T, KVH, Dh)
        m = ctx.attn
        if (self.fused_qk_store and self.fused and m.token_index is None and m.slot_mapping.shape[0] == T
                and self.q_norm.eps == self.k_norm.eps and resolve_backend(self.backend, q) == "triton"):
            q = qk_rope_store(q, k, v, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, ctx.positions,
                              self.rotary.inv_freq, self.k_cache, self.v_cache, m.slot_mapping)
        else:
            q, k = self._norm_rope(q, k, ctx.positions)
            store_kv(k, v, self.k_cache, self.v_cache, m.slot_mapping, m.token_index, backend=self.backend)  # v: a view
        o = paged_attention(q.contiguous(), self.k_cache, self.v_cache, m.cu_seqlens_q, m.kv_lens, m.page_table,
                            scale=Dh ** -0.5, kv_start=m.kv_start, max_q_len=m.max_q_len,
                            out=torch.zeros(T, QH, Dh, dtype=q.dtype, device=q.device) if m.zero_out else None,
                            backend=self.backend)
        be = self.backend if self.fused else "torch"    # o * sigmoid(gate): one launch on the Triton backend
        return self.o_proj.forward_gated(o.reshape(T, QH * Dh), gate, backend=be)    # decode: gate folded in

    def _norm_rope(self, q: torch.Tensor, k: torch.Tensor,
                   positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The prologue: q/k RMSNorm then rotary. Fused on the Triton backend (one launch per tensor, angles
        computed in the kernel); else the PyTorch ops (HF's: cos/sin tables, rotate-half, concatenations)."""
        if self.fused and resolve_backend(self.backend, q) == "triton":
            f = self.rotary.inv_freq
            return (rms_norm_rope(q, self.q_norm.weight, self.q_norm.eps, positions, f, backend="triton"),
                    rms_norm_rope(k, self.k_norm.weight, self.k_norm.eps, positions, f, backend="triton"))
        cos, sin = self.rotary.cos_sin(positions, q.dtype)
        return self.rotary(self.q_norm(q), cos, sin), self.rotary(self.k_norm(k), cos, sin)

    def store(self, h: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
              token_index: torch.Tensor | None = None) -> None:
        """K/V of ``h: [T, hidden]`` at rotary ``positions: [T]`` into the bound cache (``slot_mapping`` /
        ``token_index`` as in ``store_kv``), with no attention and no output: the MTP layer's feed pass.
        Only the k and v rows of the fused projection are multiplied."""
        T, KVH, Dh = h.shape[0], self.KVH, self.Dh
        kv = self.qkv_proj.forward_rows(h, 2 * self.QH * Dh)
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        k = self.rotary(self.k_norm(kv[:, :KVH * Dh].view(T, KVH, Dh)), cos, sin)
        v = kv[:, KVH * Dh:].reshape(T, KVH, Dh).contiguous()
        store_kv(k, v, self.k_cache, self.v_cache, slot_mapping, token_index)
