"""Residual add + zero-centred RMSNorm folded into the one-row GEMV that consumes it (issue 29): at one token the
MoE block's post-attention norm and its router GEMM as ONE launch.

    s = round(h + residual)                              the residual stream (program 0 stores it)
    x = round(s * rsqrt(mean(s²) + eps) * (1 + w))       the normed row (program 0 stores it: the experts' input)
    y = x Wᵀ                                             each program its BN rows, fp32 products summed per K step

Every program first reduces the whole row (K values: the router's 257 x 2048 GEMV has 33 programs of 8 rows, so
the row is read 33 times from L2, ~0.3 MB), then streams its W rows, rebuilding x per K step from h and residual
(L1 hits) with the same rstd: the roundings of ``rmsnorm_triton._add_rms_norm_kernel`` and the sums of
``skinny_triton._gemv_kernel`` (the CUDA-core M = 1 GEMV).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdnserve.ops.launch import cdiv, launch, pow2
from gdnserve.ops.moe.align import Alignment, padded_rows
from gdnserve.ops.moe.grouped_triton import block_rows
from gdnserve.ops.moe.router import Routing
from gdnserve.ops.moe.router_triton import _router_small_kernel
from gdnserve.ops.tl_compat import cast

BN, BK_MAX, WARPS = 8, 1024, 8     # the router's M = 1 config in ops.gemv.TABLE (_FMA_8x1024)


@triton.jit
def _norm_gemv_kernel(h, res, nw, x_out, s_out, w, y, N, K, stride_w, eps,
                      BN: tl.constexpr, BK: tl.constexpr, KP: tl.constexpr, EVEN_K: tl.constexpr):
    _norm_gemv(h, res, nw, x_out, s_out, w, y, N, K, stride_w, eps, BN, BK, KP, EVEN_K)


@triton.jit
def _norm_gemv_route_kernel(h, res, nw, x_out, s_out, w, y, N, K, stride_w, eps, counter,
                            weights, ids, rows, block_expert, NP, P, NB,
                            BN: tl.constexpr, BK: tl.constexpr, KP: tl.constexpr, EVEN_K: tl.constexpr,
                            NPROG: tl.constexpr, TOP_K: tl.constexpr, RENORM: tl.constexpr, BE: tl.constexpr,
                            BKR: tl.constexpr, SHARED: tl.constexpr, EA: tl.constexpr, BM: tl.constexpr,
                            BLOCK_P: tl.constexpr, BLOCK_B: tl.constexpr):
    """``_norm_gemv_kernel`` + the router: the last of the NPROG programs to store its logits (an arrival counter,
    reset to 0 by that program) routes the row and aligns its pairs (``router_triton._router_small_kernel``'s body,
    T = 1), reading the logits the others stored (never read by this SM before: no stale L1 lines)."""
    _norm_gemv(h, res, nw, x_out, s_out, w, y, N, K, stride_w, eps, BN, BK, KP, EVEN_K)
    tl.debug_barrier()
    done = tl.atomic_add(counter, 1, sem="acq_rel")
    if done == NPROG - 1:
        _router_small_kernel(y, weights, ids, rows, block_expert, 1, N, NP, P, NB, TOP_K, RENORM, 1, BE, BKR,
                             SHARED, False, EA, BM, BLOCK_P, BLOCK_B)
        tl.atomic_xchg(counter, 0, sem="relaxed")


@triton.jit
def _norm_gemv(h, res, nw, x_out, s_out, w, y, N, K, stride_w, eps,
               BN: tl.constexpr, BK: tl.constexpr, KP: tl.constexpr, EVEN_K: tl.constexpr):
    pid = tl.program_id(0)
    ACT = x_out.dtype.element_ty
    o = tl.arange(0, KP)
    m = o < K
    sv = cast(tl.load(h + o, mask=m, other=0.0).to(tl.float32) + tl.load(res + o, mask=m, other=0.0).to(tl.float32),
              ACT)
    v = sv.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(v * v, axis=0) / K + eps)
    if pid == 0:
        tl.store(s_out + o, sv, mask=m)
        tl.store(x_out + o, cast((v * rstd) * (1.0 + tl.load(nw + o, mask=m, other=0.0).to(tl.float32)), ACT), mask=m)
    rn = pid * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    nm = rn < N
    wp = w + rn[:, None].to(tl.int64) * stride_w + rk[None, :]
    acc = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        km = (k0 + rk) < K
        if EVEN_K:
            b = tl.load(wp, mask=nm[:, None], other=0.0)
        else:
            b = tl.load(wp, mask=nm[:, None] & km[None, :], other=0.0)
        hs = cast(tl.load(h + k0 + rk, mask=km, other=0.0).to(tl.float32)
                  + tl.load(res + k0 + rk, mask=km, other=0.0).to(tl.float32), ACT).to(tl.float32)
        a = cast((hs * rstd) * (1.0 + tl.load(nw + k0 + rk, mask=km, other=0.0).to(tl.float32)), ACT)
        acc += tl.sum(b.to(tl.float32) * a.to(tl.float32)[None, :], axis=1)
        wp += BK
    tl.store(y + rn, cast(acc, y.dtype.element_ty), mask=nm)


def norm_gemv_triton(h: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                     w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validated one-row arguments (``norm_gemv.add_rms_norm_gemv``); returns (y [1, N], x [1, K], s [1, K])."""
    K = h.shape[1]
    N = w.shape[0]
    x = torch.empty_like(h, memory_format=torch.contiguous_format)
    s = torch.empty_like(x)
    y = torch.empty(1, N, dtype=h.dtype, device=h.device)
    BK = min(BK_MAX, pow2(K))
    launch(_norm_gemv_kernel, (cdiv(N, BN),), (h, residual, norm_weight, x, s, w, y, N, K, w.stride(0), float(eps), BN,
                                              BK, pow2(K), K % BK == 0), num_warps=WARPS)
    return y, x, s


def norm_gemv_route_triton(h: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                           w: torch.Tensor, counter: torch.Tensor, top_k: int, renormalize: bool, shared: bool
                           ) -> tuple[Routing, torch.Tensor, torch.Tensor]:
    """``norm_gemv_triton`` and ``route_triton(y, ...)``'s one-program path in one launch: (routing, x, s)."""
    K = h.shape[1]
    N = w.shape[0]
    E, KO = N - shared, top_k + shared
    EA = E + shared
    BM = block_rows(KO, EA)
    P = padded_rows(KO, EA, BM)
    dev = h.device
    x = torch.empty_like(h, memory_format=torch.contiguous_format)
    s = torch.empty_like(x)
    y = torch.empty(1, N, dtype=h.dtype, device=dev)
    weights = torch.empty(1, KO, dtype=h.dtype, device=dev)
    ids = torch.empty(1, KO, dtype=torch.int32, device=dev)
    rows = torch.empty(P, dtype=torch.int32, device=dev)
    block_expert = torch.empty(P // BM, dtype=torch.int32, device=dev)
    BK = min(BK_MAX, pow2(K))
    nprog = cdiv(N, BN)
    launch(_norm_gemv_route_kernel, (nprog,),
           (h, residual, norm_weight, x, s, w, y, N, K, w.stride(0), float(eps), counter, weights, ids, rows,
            block_expert, KO, P, P // BM, BN, BK, pow2(K), K % BK == 0, nprog, top_k, renormalize,
            max(pow2(E), 16), max(pow2(KO), 2), shared, EA, BM, min(pow2(P), 1024), min(pow2(P // BM), 256)),
           num_warps=WARPS)
    return Routing(weights, ids, Alignment(rows, block_expert, BM)), x, s
