"""Block-scaled FP8 GEMM in Triton: ``y [M, N] = x [M, K] · Wᵀ`` with W stored as e4m3 ``[N, K]`` plus
``weight_scale_inv [ceil(N/128), ceil(K/128)]``.

Two kernels per call (three with split-K), all launched from shapes alone (no host read: CUDA-graph safe):

1. ``_quant_kernel`` quantizes x once per call, per token and group of 128 columns (``quant_tile``: the
   e4m3 grid by arithmetic, stored as e4m3 — exact), scales ``[M, ceil(K/128)]`` float32.
2. ``_gemm_kernel`` multiplies e4m3 by e4m3 on the fp8 tensor cores (fp32 accumulation), one 128-wide K
   block per step, adding ``dot · sw[n-block] · sx[m]``. For M <= 64 the tile is **swapped**
   (``acc [BN, BM] = W-tile · x-tileᵀ``): the weight rows are the MMA's M side (64 / 128: Hopper wgmma)
   and the tokens its N side (16 ... 64), so decode-sized M runs native fp8 dots without 16-row MMA tiles.
   Large M uses the usual orientation (``acc [BM, BN]``: measured faster there).
3. Small M (decode, M <= 64) with few weight tiles: the weight read is the whole cost, so the K loop is
   **split** over ``SPLIT`` programs per tile (enough programs to cover the 132 SMs several times); each
   writes a float32 partial ``[SPLIT, M, N]`` and ``_reduce_kernel`` sums them in a fixed order and rounds
   once (deterministic).

Float32 activations (reference models) multiply the e4m3 values as bf16 (exact) with fp32 accumulation:
Hopper's fp8 MMA accumulates with less than fp32 precision (~1e-4 relative; fine for bf16 outputs).

Output rounded once to x's dtype, written with its own row stride (so a fused projection's dense tail can
share the buffer). Tile configs: ``config`` (H200 sweep: benchmarks/bench_fp8.py --sweep).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdnserve.ops.launch import cdiv, launch
from gdnserve.ops.quant.tl_fp8 import as_fp8_operand, fp8_dot, quant_tile
from gdnserve.ops.tl_compat import cast

BLOCK = 128
SMS = 132                 # H200 / H100 SXM multiprocessors: the split-K target is a few programs per SM


@triton.jit
def _quant_kernel(x, q, s, M, K, stride_xm, stride_sm, stride_sk, BM: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    kk = pid_k * BK + tl.arange(0, BK)
    m_ok = offs_m < M
    mask = m_ok[:, None] & (kk < K)[None, :]
    a = tl.load(x + offs_m[:, None].to(tl.int64) * stride_xm + kk[None, :], mask=mask, other=0.0).to(tl.float32)
    qv, sv = quant_tile(a)
    tl.store(q + offs_m[:, None].to(tl.int64) * K + kk[None, :], qv.to(q.dtype.element_ty), mask=mask)
    tl.store(s + offs_m * stride_sm + pid_k * stride_sk, sv, mask=m_ok)


@triton.jit
def _gemm_kernel(xq, xs, w, ws, y, part, M, N, K, stride_ym, SK, KB_PER,
                 NSPLIT, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_N: tl.constexpr,
                 SWAP: tl.constexpr, NATIVE: tl.constexpr):
    """Program (tile, split) over K blocks [split·KB_PER, +KB_PER). SWAP: acc [BN weight rows, BM tokens]
    (weight rows on the MMA's M side: small M); else acc [BM, BN] (large M: the usual orientation)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    width = GROUP_N * num_m                  # GROUP_N weight tiles share the x tiles while they are in L2
    first_n = (pid // width) * GROUP_N
    gsize = tl.minimum(num_n - first_n, GROUP_N)
    pid_n = first_n + (pid % width) % gsize
    pid_m = (pid % width) // gsize
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = pid_m * BM + tl.arange(0, BM)
    n_ok = offs_n < N
    m_ok = offs_m < M
    offs_k = tl.arange(0, BK)
    ws_n = ws + (offs_n // BK) * SK
    xs_m = xs + offs_m * SK
    kb0 = split * KB_PER
    kb1 = tl.minimum(kb0 + KB_PER, SK)
    if SWAP:
        w_rows = w + offs_n[:, None].to(tl.int64) * K            # [BN, 1]: the A operand, K contiguous
        x_cols = xq + offs_m[None, :].to(tl.int64) * K           # [1, BM]: the B operand, K-major
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        for kb in range(kb0, kb1):
            kk = kb * BK + offs_k
            k_ok = kk < K
            a = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            b = as_fp8_operand(tl.load(x_cols + kk[:, None], mask=k_ok[:, None] & m_ok[None, :], other=0.0))
            sw = tl.load(ws_n + kb, mask=n_ok, other=0.0)
            sx = tl.load(xs_m + kb, mask=m_ok, other=0.0)
            acc += fp8_dot(a, b, NATIVE) * (sw[:, None] * sx[None, :])
        out = tl.trans(acc)                                      # [BM, BN]
    else:
        x_rows = xq + offs_m[:, None].to(tl.int64) * K
        w_cols = w + offs_n[None, :].to(tl.int64) * K
        out = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in range(kb0, kb1):
            kk = kb * BK + offs_k
            k_ok = kk < K
            a = as_fp8_operand(tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0))
            b = tl.load(w_cols + kk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            sw = tl.load(ws_n + kb, mask=n_ok, other=0.0)
            sx = tl.load(xs_m + kb, mask=m_ok, other=0.0)
            out += fp8_dot(a, b, NATIVE) * (sx[:, None] * sw[None, :])
    mask = m_ok[:, None] & n_ok[None, :]
    if NSPLIT == 1:                          # (Triton specialises an int argument equal to 1)
        dst_y = y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
        tl.store(dst_y, cast(out, y.dtype.element_ty), mask=mask)
    else:
        dst_p = part + (split * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
        tl.store(dst_p, out, mask=mask)


@triton.jit
def _reduce_kernel(part, y, M, N, stride_ym, SPLIT: tl.constexpr, BLOCK_E: tl.constexpr):
    """y[m, n] = round(Σ_s part[s, m, n]) in split order."""
    offs = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    ok = offs < M * N
    acc = tl.zeros((BLOCK_E,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):                      # unrolled: the SPLIT loads are in flight together
        acc += tl.load(part + s * M * N + offs, mask=ok, other=0.0)
    m = offs // N
    tl.store(y + m.to(tl.int64) * stride_ym + (offs - m * N), cast(acc, y.dtype.element_ty), mask=ok)


# (BM, BN, num_warps, num_stages, GROUP_N, programs target (0 = no split-K), SWAP): ``config``'s pick, or the
# ``config=`` of ``fp8_gemm_quantized`` / ``fp8_gemm_triton`` for one call (benchmarks' sweeps).
GemmConfig = tuple[int, int, int, int, int, int, bool]


def config(M: int, N: int, K: int) -> tuple[int, int, int, int, int, int, bool]:
    """(BM tokens, BN weight rows, warps, stages, GROUP_N, split-K programs target, SWAP) from the shapes
    (H200 sweep, benchmarks/results/fp8_h200.md). M <= 64: swapped tiles, token tile = M rounded up to
    16 / 32 / 64, 64 weight rows; the K loop is split (~4 programs per SM) only when the weight tiles alone
    do not cover the SMs (fewer than 132 tiles of 64 rows: out_proj, o_proj, the shared expert's gate_up;
    splitting in_proj's 192 tiles measured slower: the extra launch costs more than the occupancy gains) and
    at M <= 16 K has more than 4 blocks (the shared expert's down, K = 512: 5.1 µs unsplit vs 6.4 at M = 16); there
    a split K >= 4096 takes 32-row tiles and 3 stages. Larger M: the usual orientation, 64 x 128
    tiles, 4 warps, 4 stages (faster than 128 x 128 at M = 256 and 4096)."""
    if M <= 64:
        bm = 16 if M <= 16 else (32 if M <= 32 else 64)
        tiles = cdiv(N, 64)
        split = 0 if tiles >= SMS or (bm == 16 and K <= 4 * BLOCK) else 4 * SMS
        if bm == 16 and split and K >= 4096:          # out_proj / o_proj: 10.6 vs 12.9 µs at M = 16 (H200 sweep)
            return bm, 32, 4, 3, 1, split, True
        return bm, 64, 4, 5 if bm == 16 else 4, 1, split, True
    return 64, 128, 4, 4, 8, 0, False


_pick = config   # the entry point's ``config=`` keyword shadows the name


def split_k(tiles: int, kb: int, target: int) -> tuple[int, int]:
    """(SPLIT, KB_PER): K blocks per program so that tiles·SPLIT reaches ``target`` programs, >= 2 K blocks
    each (a program must amortise its pipeline prologue)."""
    if target <= tiles or kb < 4:
        return 1, kb
    per = max(2, cdiv(kb * tiles, target))
    return cdiv(kb, per), per


def quantize_act_triton(x: torch.Tensor, scales_transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit column stride) -> (q [M, K] float8_e4m3fn, s [M, ceil(K/128)] float32; with
    ``scales_transposed`` s is returned as its transpose [ceil(K/128), M], contiguous: cuBLAS's layout)."""
    M, K = x.shape
    SK = cdiv(K, BLOCK)
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((SK, M) if scales_transposed else (M, SK), dtype=torch.float32, device=x.device)
    if M:
        BM = 16 if M <= 16 else 32
        st = (1, M) if scales_transposed else (SK, 1)
        launch(_quant_kernel, (cdiv(M, BM), SK), (x, q, s, M, K, x.stride(0), *st, BM, BLOCK), num_warps=4)
    return q, s


def fp8_gemm_quantized(xq: torch.Tensor, xs: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor, y: torch.Tensor,
                       config: GemmConfig | None = None) -> torch.Tensor:
    """Quantized x (``quantize_act_triton``) · dequant(qw [N, K], sw)ᵀ into y [M, N] (unit column stride).
    ``config``: overrides ``config(M, N, K)``'s pick for this call."""
    M, K = xq.shape
    N = qw.shape[0]
    SK = cdiv(K, BLOCK)
    BM, BN, warps, stages, group, target, swap = config if config is not None else _pick(M, N, K)
    tiles = cdiv(M, BM) * cdiv(N, BN)
    split, per = split_k(tiles, SK, target)
    part = torch.empty(split, M, N, dtype=torch.float32, device=xq.device) if split > 1 else y
    native = y.dtype != torch.float32        # float32 models: exact bf16 dots of the e4m3 values (tl_fp8)
    launch(_gemm_kernel, (tiles, split), (xq, xs, qw, sw, y, part, M, N, K, y.stride(0), SK, per, split, BM, BN,
                                          BLOCK, group, swap, native), num_warps=warps, num_stages=stages)
    if split > 1:
        launch(_reduce_kernel, (cdiv(M * N, 1024),), (part, y, M, N, y.stride(0), split, 1024), num_warps=4)
    return y


def fp8_gemm_triton(x: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor, out: torch.Tensor | None = None,
                    config: GemmConfig | None = None) -> torch.Tensor:
    """x [M, K] (unit column stride) · dequant(qw [N, K], sw)ᵀ -> [M, N] in x.dtype (into ``out`` [M, N],
    unit column stride, when given)."""
    M, K = x.shape
    y = torch.empty(M, qw.shape[0], dtype=x.dtype, device=x.device) if out is None else out
    if M == 0:
        return y
    xq, xs = quantize_act_triton(x)
    return fp8_gemm_quantized(xq, xs, qw, sw, y, config)
