"""The attention prologue as one launch: ``rms_norm_rope`` on q and on k and ``store_kv`` of k and v
(``qk_rope_store_triton.py``). Switch: ``GDNSERVE_FUSED_QK_STORE=1`` (``GatedAttention.fused_qk_store``; off by
default until the H200 has timed it, ``benchmarks/bench_decode_fused.py``)."""
from __future__ import annotations

import os

import torch

from gdnserve.ops.attention.paged import _check_caches, _check_index64
from gdnserve.ops.checks import ACT_DTYPES, check_tensor


def fused_qk_store_default() -> bool:
    return os.environ.get("GDNSERVE_FUSED_QK_STORE", "0") == "1"


def qk_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                  eps: float, positions: torch.Tensor, inv_freq: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """q [T, QH, Dh], k and v [T, KVH, Dh] (unit last strides, any row / head strides: views of the fused
    projection); q_weight, k_weight [Dh] (zero-centred); positions [T]; inv_freq [rotary_dim / 2]; caches
    [pages, page_size, KVH, Dh]; slot_mapping [T] int64 (-1: the token's k and v are not stored). Returns
    ``rms_norm_rope(q)`` [T, QH, Dh] contiguous; the caches get ``rms_norm_rope(k)`` and v at the tokens' slots
    (``store_kv`` with ``token_index=None``). Triton only (CUDA, or the interpreter)."""
    from gdnserve.ops.attention.qk_rope_store_triton import qk_rope_store_triton
    check_tensor("q", q, [None, None, None], ACT_DTYPES)
    T, _, Dh = q.shape
    dev = q.device
    check_tensor("k", k, [T, None, Dh], [q.dtype], dev)
    KVH = k.shape[1]
    check_tensor("v", v, [T, KVH, Dh], [q.dtype], dev)
    check_tensor("q_weight", q_weight, [Dh], ACT_DTYPES, dev)
    check_tensor("k_weight", k_weight, [Dh], ACT_DTYPES, dev)
    check_tensor("positions", positions, [T], [torch.int64, torch.int32], dev)
    half = inv_freq.shape[0] if inv_freq.dim() == 1 else -1
    check_tensor("inv_freq", inv_freq, [half], ACT_DTYPES, dev)
    if not 1 <= 2 * half <= Dh:
        raise ValueError(f"inv_freq: rotary_dim = 2 * {half} must be in [2, head_dim={Dh}]")
    _check_caches(k_cache, v_cache, KVH, Dh, q.dtype, dev)
    _check_index64("slot_mapping", slot_mapping, T, dev)
    return qk_rope_store_triton(q, k, v, q_weight, k_weight, eps, positions, inv_freq, k_cache, v_cache, slot_mapping)
