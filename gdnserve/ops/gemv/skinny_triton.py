"""y = x Wᵀ for M <= 16 rows of x (decode steps) in ONE launch: no split-K, no separate reduce kernel.

cuBLAS runs the decode projections at M = 1..16 as split-K GEMMs (a partial-sum kernel + ``splitKreduce``)
where N is small (the 2048-wide output projections) and as 128x8 tiles otherwise. Here every program owns
``BN`` output columns over the WHOLE of K: it streams its ``BN x K`` slab of W once through a ``num_stages``
software pipeline and multiplies it with the (zero-padded) ``16 x BK`` tiles of x on the tensor cores, fp32
accumulation, one bf16 rounding at the end. The reduction order is fixed by the config (K in BK steps, in
order): deterministic, the same bits eager or replayed in a CUDA graph.

``skinny_config`` picks the config from ``TABLE`` (measured on the H200 against cuBLAS,
``benchmarks/bench_decode_b1.py``): (N, K) -> the largest M where the kernel beat cuBLAS and its config.
Shapes not in the table return None (the caller keeps ``F.linear``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from gdnserve.ops.checks import check_tensor
from gdnserve.ops.launch import cdiv, launch
from gdnserve.ops.tl_compat import cast, mma

MAX_M = 16


class SkinnyConfig(NamedTuple):
    BN: int            # output columns per program
    BK: int            # K step
    warps: int
    stages: int


# (N, K) -> (largest M the kernel serves, config); filled from the H200 sweep (see the module docstring)
TABLE: dict[tuple[int, int], tuple[int, SkinnyConfig]] = {}


@triton.jit(do_not_specialize=["M"])         # one binary for every M
def _skinny_kernel(x, w, y, M, N, K, stride_x, stride_w, stride_y,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr):
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    mm, nm = rm < M, rn < N
    xp = x + rm[:, None] * stride_x + rk[None, :]
    wp = w + rn[:, None].to(tl.int64) * stride_w + rk[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        if EVEN_K:
            a = tl.load(xp, mask=mm[:, None], other=0.0)
            b = tl.load(wp, mask=nm[:, None], other=0.0)
        else:
            km = (k0 + rk) < K
            a = tl.load(xp, mask=mm[:, None] & km[None, :], other=0.0)
            b = tl.load(wp, mask=nm[:, None] & km[None, :], other=0.0)
        acc += mma(a, tl.trans(b), "ieee")
        xp += BK
        wp += BK
    tl.store(y + rm[:, None] * stride_y + rn[None, :], cast(acc, y.dtype.element_ty), mask=mm[:, None] & nm[None, :])


def skinny_config(M: int, N: int, K: int) -> SkinnyConfig | None:
    """The config for an [M, K] x [N, K]ᵀ product, or None where cuBLAS is the faster (or unmeasured) choice."""
    hit = TABLE.get((N, K))
    if hit is None or not 1 <= M <= min(hit[0], MAX_M):
        return None
    return hit[1]


def skinny_linear(x: torch.Tensor, w: torch.Tensor, cfg: SkinnyConfig) -> torch.Tensor:
    """x [M, K] (M <= 16, unit last stride) · w [N, K]ᵀ (unit last stride, same dtype) -> [M, N] in x's dtype."""
    check_tensor("skinny_linear: x", x, (None, None), (torch.bfloat16, torch.float16))
    check_tensor("skinny_linear: w", w, (None, x.shape[1]), (x.dtype,))
    M, K = x.shape
    N = w.shape[0]
    if not 1 <= M <= MAX_M:
        raise ValueError(f"skinny_linear: x has {M} rows, must be in [1, {MAX_M}]")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    launch(_skinny_kernel, (cdiv(N, cfg.BN),), (x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
                                                MAX_M, cfg.BN, cfg.BK, K % cfg.BK == 0),
           num_warps=cfg.warps, num_stages=cfg.stages)
    return y
