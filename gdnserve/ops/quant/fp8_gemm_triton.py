"""Block-scaled FP8 GEMM in Triton: ``y [M, N] = x [M, K] · Wᵀ`` with W stored as e4m3 ``[N, K]`` plus
``weight_scale_inv [ceil(N/128), ceil(K/128)]``.

The K loop steps by 128 (the block) and adds ``dot · sx[m] · sw[n // 128]`` to a float32 accumulator. Two
forms, the same numbers (``tl_fp8``):

* M <= 32 (decode): each step quantizes the x tile per row in registers (``quant_tile``: the token-group
  scale of this 128-column group) and multiplies it with the e4m3 weight tile upcast to bf16 (exact) on the
  bf16 tensor cores: one launch, the weights read as e4m3 bytes (the traffic that decode is bound by).
* M > 32: x is quantized once by ``_quant_kernel`` (stored as e4m3) and the GEMM multiplies e4m3 tiles on
  the fp8 tensor cores (64+-row tiles: Hopper wgmma), the structure of the usual block-FP8 GEMMs.

Output rounded once to x's dtype, written with its own row stride (so a fused projection's dense tail can
share the buffer). Deterministic: no split-K, no atomics. Tile configs: ``config``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdnserve.ops.launch import cdiv, launch
from gdnserve.ops.quant.tl_fp8 import as_fp8_operand, fp8_dot, quant_tile
from gdnserve.ops.tl_compat import cast

BLOCK = 128
PREQUANT_M = 33           # from this many rows x is quantized once by its own kernel (native fp8 dot)


@triton.jit
def _quant_kernel(x, q, s, M, K, stride_xm, SK, BM: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    kk = pid_k * BK + tl.arange(0, BK)
    m_ok = offs_m < M
    mask = m_ok[:, None] & (kk < K)[None, :]
    a = tl.load(x + offs_m[:, None].to(tl.int64) * stride_xm + kk[None, :], mask=mask, other=0.0).to(tl.float32)
    qv, sv = quant_tile(a)
    tl.store(q + offs_m[:, None].to(tl.int64) * K + kk[None, :], qv.to(q.dtype.element_ty), mask=mask)
    tl.store(s + offs_m * SK + pid_k, sv, mask=m_ok)


@triton.jit
def _gemm_kernel(x, xs, w, ws, y, M, N, K, stride_xm, stride_ym, SK, X_FP8: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    gsize = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % gsize
    pid_n = (pid % width) // gsize
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_ok = offs_m < M
    n_ok = offs_n < N
    offs_k = tl.arange(0, BK)
    x_rows = x + offs_m[:, None].to(tl.int64) * stride_xm
    w_cols = w + offs_n[None, :].to(tl.int64) * K
    ws_n = ws + (offs_n // BK) * SK
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + offs_k
        k_ok = kk < K
        b = tl.load(w_cols + kk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        sw = tl.load(ws_n + k0 // BK, mask=n_ok, other=0.0)
        if X_FP8:
            q = as_fp8_operand(tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0))
            sx = tl.load(xs + offs_m * SK + k0 // BK, mask=m_ok, other=0.0)
        else:
            a = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            q, sx = quant_tile(a)
        acc += fp8_dot(q, b, X_FP8) * (sx[:, None] * sw[None, :])
    dst = y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(dst, cast(acc, y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# (BM, BN, num_warps, num_stages, GROUP_M); None = ``config``'s pick. The benchmark sweeps this.
CONFIG_OVERRIDE: tuple[int, int, int, int, int] | None = None


def config(M: int, N: int) -> tuple[int, int, int, int, int]:
    """Decode-sized M: 16/32-row tiles and N tiles narrow enough for ~2 programs per SM (the weights are
    the traffic); M > 32 (native fp8 dot): 64-row tiles, 128-row from 256. Guesses from the usual block-FP8
    configs, to be tuned on the H200 (benchmarks/bench_fp8.py --sweep)."""
    if CONFIG_OVERRIDE is not None:
        return CONFIG_OVERRIDE
    if M < PREQUANT_M:
        bn = 64 if cdiv(N, 64) >= 256 else 32
        return (16 if M <= 16 else 32), bn, 4, 4, 1
    if M < 256:
        return 64, 64 if M <= 64 else 128, 4, 3, 8
    return 128, 128, 8, 3, 8


def quantize_act_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit column stride) -> (q [M, K] float8_e4m3fn, s [M, ceil(K/128)] float32)."""
    M, K = x.shape
    SK = cdiv(K, BLOCK)
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(M, SK, dtype=torch.float32, device=x.device)
    BM = 32
    launch(_quant_kernel, (cdiv(M, BM), SK), (x, q, s, M, K, x.stride(0), SK, BM, BLOCK), num_warps=4)
    return q, s


def fp8_gemm_triton(x: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor, out: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """x [M, K] (unit column stride) · dequant(qw [N, K], sw)ᵀ -> [M, N] in x.dtype (into ``out`` [M, N],
    unit column stride, when given)."""
    M, K = x.shape
    N = qw.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device) if out is None else out
    if M == 0:
        return y
    SK = cdiv(K, BLOCK)
    BM, BN, warps, stages, group = config(M, N)
    pre = M >= PREQUANT_M if CONFIG_OVERRIDE is None else BM >= 64
    xq, xs = quantize_act_triton(x) if pre else (x, sw)        # xs unused when x is quantized in the GEMM
    grid = (cdiv(M, BM) * cdiv(N, BN),)
    launch(_gemm_kernel, grid, (xq, xs, qw, sw, y, M, N, K, xq.stride(0), y.stride(0), SK, pre, BM, BN, BLOCK,
                                group), num_warps=warps, num_stages=stages)
    return y
