"""Residual add + zero-centred RMSNorm + the one-row GEMV that consumes it, one launch (``norm_gemv_triton.py``).
Switch: ``GDNSERVE_FUSED_NORM_ROUTER=1`` (``SparseMoE.fused_norm_router``: the post-attention norm folded into the
router GEMM at one token; off by default until the H200 has timed it, ``benchmarks/bench_decode_fused.py``)."""
from __future__ import annotations

import os

import torch

from gdnserve.ops.checks import check_tensor

MAX_K = 8192            # the whole row is reduced in one register tile per program


def fused_norm_router_default() -> bool:
    return os.environ.get("GDNSERVE_FUSED_NORM_ROUTER", "0") == "1"


def new_counter(device) -> torch.Tensor:
    """The routing launch's arrival counter, zeroed (every launch leaves it at 0)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def add_rms_norm_gemv_route(h: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                            w: torch.Tensor, counter: torch.Tensor, top_k: int, renormalize: bool, shared: bool):
    """``add_rms_norm_gemv`` with the router's weights ``w`` [E (+1 shared), K] and ``route(y, top_k, renormalize,
    "triton", shared)`` in the same launch (its last program routes and aligns the row): (Routing, x, s).
    ``counter``: ``new_counter(device)``, one per call site, left at 0."""
    from gdnserve.ops.gemv.norm_gemv_triton import norm_gemv_route_triton
    _check(h, residual, norm_weight, w)
    check_tensor("counter", counter, (1,), (torch.int32,), h.device)
    E = w.shape[0] - shared
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k: must be in [1, {E}], got {top_k}")
    return norm_gemv_route_triton(h, residual, norm_weight, eps, w, counter, top_k, renormalize, shared)


def _check(h, residual, norm_weight, w) -> None:
    dt = (torch.bfloat16, torch.float16)
    check_tensor("h", h, (1, None), dt)
    K = h.shape[1]
    if not 1 <= K <= MAX_K:
        raise ValueError(f"h: K = {K} must be in 1..{MAX_K}")
    check_tensor("residual", residual, (1, K), (h.dtype,), h.device)
    check_tensor("norm_weight", norm_weight, (K,), (torch.float32, *dt), h.device)
    check_tensor("w", w, (None, K), (h.dtype,), h.device)


def add_rms_norm_gemv(h: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h, residual [1, K] (bf16/fp16, unit last stride); norm_weight [K] (zero-centred); w [N, K] (h's dtype, unit
    last stride) -> (y = x wᵀ [1, N], x = rms_norm(s) [1, K], s = h + residual [1, K]): ``rms_norm(h, weight, eps,
    residual)`` and ``dense_linear(x, w)``'s CUDA-core GEMV in one launch. Triton only (CUDA, or the interpreter)."""
    from gdnserve.ops.gemv.norm_gemv_triton import norm_gemv_triton
    _check(h, residual, norm_weight, w)
    return norm_gemv_triton(h, residual, norm_weight, eps, w)
