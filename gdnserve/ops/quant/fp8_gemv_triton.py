"""Decode-sized block-FP8 linear (M <= ``MAX_M`` tokens) on the CUDA cores: ``y [M, N (+ N2)] = x · [W | tail]ᵀ``
with W e4m3 ``[N, K]``, ``weight_scale_inv [ceil(N/128), ceil(K/128)]``, tail an optional dense ``[N2, K]``.

A decode GEMV reads every weight byte once and does little else, so this is a weight stream shaped like the
bf16 one (``ops/gemv``, 68-89 % of the copy rate on the H200): one program = ``BN`` weight rows (2-16) over
the whole of K in ``BK``-wide steps, thousands of programs, so each SM keeps many independent weight loads in
flight. x is quantized ONCE per call by its own launch (``quantize_act_triton``: e4m3 + one float32 scale per
token and group of 128 — the block scheme), never per program: re-quantizing x in every program's registers
(the one-launch skinny kernel, deleted: docs/kernels.md) cost more arithmetic than the dot itself, 2.5-6x slower.

Per K step: the e4m3 weight tile ``[BN, BK]`` upcast to float32 (exact) times, per token, the column factors
``qx · sx[group] · sw[row block, group]`` (BN divides 128, so the program's rows share one weight-block row and
its scale is a per-column factor: the tile work stays 2-D like the bf16 GEMV's — a first version that summed
per 128-wide group through a reshape ran at 0.6 TB/s on the H200), summed in float32: the block scheme's
``Σ (qw · sw) · (qx · sx)`` (the dequantizing reference ``fp8_ref.fp8_linear_torch`` up to rounding order).
Programs past the FP8 rows' tiles compute the dense tail (x unquantized, in x's precision; the checkpoints keep
those rows in bf16, Qwen3.5's GDN ``in_proj_b`` / ``in_proj_a``) into the output columns after W's.

Deterministic (fixed summation order, no atomics, no split-K); the grid depends on shapes only (CUDA-graph safe).
``config`` picks (BN, BK, warps, stages) from ``TABLE`` (H200 sweep: ``benchmarks/bench_fp8.py --sweep``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from gdnserve.ops.launch import cdiv, launch, pow2
from gdnserve.ops.quant.tl_fp8 import quant_tile
from gdnserve.ops.tl_compat import cast

BLOCK = 128
MAX_M = 4          # tokens per call on the CUDA cores (M = 1 ... 4: one program holds all of them)


@triton.jit
def _row_factors(xq, xs, ws_row, m, k, km, SK):
    """The combined per-column factor of token m at columns k: e4m3 x times its group's scale times the program's
    weight-block scale (all float32), 0 past K."""
    g = k // 128
    q = tl.load(xq + k, mask=km, other=0.0).to(tl.float32)
    sx = tl.load(xs + m * SK + g, mask=km, other=0.0)
    sw = tl.load(ws_row + g, mask=km, other=0.0)
    return q * (sx * sw)


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(x, xq, xs, w, ws, tail, y, M, N, N2, K, SK, stride_xm, stride_ym,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr):
    """BN divides 128, so a program's rows share one weight-block row: its scale is a per-column factor that
    joins x's (``_row_factors``), and the tile work is 2-D like the bf16 GEMV's (no group reshape)."""
    pid = tl.program_id(0)
    NT = tl.cdiv(N, BN)
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    if pid < NT:                                    # FP8 rows
        rn = pid * BN + tl.arange(0, BN)
        nm = rn < N
        wp = w + rn[:, None].to(tl.int64) * K + rk[None, :]
        ws_row = ws + (pid * BN // 128) * SK
        for k0 in range(0, K, BK):
            k = k0 + rk
            km = k < K
            if EVEN_K:
                b = tl.load(wp, mask=nm[:, None], other=0.0).to(tl.float32)
            else:
                b = tl.load(wp, mask=nm[:, None] & km[None, :], other=0.0).to(tl.float32)
            for m in tl.static_range(BM):
                f = _row_factors(xq + m * K, xs, ws_row, m, k, km & ((rk * 0 + m) < M), SK)
                d = tl.sum(b * f[None, :], axis=1)
                acc += tl.where(rm[None, :] == m, d[:, None], 0.0)
            wp += BK
        col = rn
    else:                                           # the dense tail's rows, x unquantized
        rn = (pid - NT) * BN + tl.arange(0, BN)
        nm = rn < N2
        tp = tail + rn[:, None].to(tl.int64) * K + rk[None, :]
        for k0 in range(0, K, BK):
            k = k0 + rk
            km = k < K
            if EVEN_K:
                b = tl.load(tp, mask=nm[:, None], other=0.0).to(tl.float32)
            else:
                b = tl.load(tp, mask=nm[:, None] & km[None, :], other=0.0).to(tl.float32)
            for m in tl.static_range(BM):
                a = tl.load(x + m * stride_xm + k, mask=km & ((rk * 0 + m) < M), other=0.0).to(tl.float32)
                d = tl.sum(b * a[None, :], axis=1)
                acc += tl.where(rm[None, :] == m, d[:, None], 0.0)
            tp += BK
        col = N + rn
    dst = y + rm[None, :] * stride_ym + col[:, None]
    tl.store(dst, cast(acc, y.dtype.element_ty), mask=nm[:, None] & (rm < M)[None, :])


@triton.jit
def _gemv_qx_kernel(x, w, ws, tail, y, N, N2, K, SK, BN: tl.constexpr, G: tl.constexpr, EVEN_K: tl.constexpr):
    """M = 1 in ONE launch: every program quantizes the x groups of its K step in registers (``quant_tile`` on the
    ``[G, 128]`` tile: a group per row, so no reshape) and streams its ``[BN, G, 128]`` weight tile loaded as 3-D
    (the layout the product needs, no conversion); the dense tail's programs read x as is."""
    pid = tl.program_id(0)
    NT = tl.cdiv(N, BN)
    rg = tl.arange(0, G)
    rc = tl.arange(0, 128)
    kk = rg[:, None] * 128 + rc[None, :]                            # [G, 128]: column offsets of a K step
    acc = tl.zeros((BN,), dtype=tl.float32)
    if pid < NT:
        rn = pid * BN + tl.arange(0, BN)
        nm = rn < N
        wp = w + rn[:, None, None].to(tl.int64) * K + kk[None, :, :]
        ws_row = ws + (pid * BN // 128) * SK
        for k0 in range(0, K, G * 128):
            km = (k0 + kk) < K
            if EVEN_K:
                b = tl.load(wp, mask=nm[:, None, None], other=0.0).to(tl.float32)
                a = tl.load(x + k0 + kk).to(tl.float32)
            else:
                b = tl.load(wp, mask=nm[:, None, None] & km[None, :, :], other=0.0).to(tl.float32)
                a = tl.load(x + k0 + kk, mask=km, other=0.0).to(tl.float32)
            q, sx = quant_tile(a)
            sw = tl.load(ws_row + k0 // 128 + rg, mask=(k0 // 128 + rg) < SK, other=0.0)
            f = q * (sx * sw)[:, None]
            acc += tl.sum(tl.sum(b * f[None, :, :], axis=2), axis=1)
            wp += G * 128
        col = rn
    else:
        rn = (pid - NT) * BN + tl.arange(0, BN)
        nm = rn < N2
        tp = tail + rn[:, None, None].to(tl.int64) * K + kk[None, :, :]
        for k0 in range(0, K, G * 128):
            km = (k0 + kk) < K
            b = tl.load(tp, mask=nm[:, None, None] & km[None, :, :], other=0.0).to(tl.float32)
            a = tl.load(x + k0 + kk, mask=km, other=0.0).to(tl.float32)
            acc += tl.sum(tl.sum(b * a[None, :, :], axis=2), axis=1)
            tp += G * 128
        col = N + rn
    tl.store(y + col, cast(acc, y.dtype.element_ty), mask=nm)


class GemvConfig(NamedTuple):
    BN: int            # weight rows per program
    BK: int            # K step (a multiple of 128)
    warps: int
    stages: int


# (N, K) -> config at M = 1 (the H200 sweeps' winners: benchmarks/results/fp8_sweep_h200.md through fp8_linear,
# fp8_gemv_m1_sweep_h200.md the GEMV alone on pre-quantized x); other shapes: ``config``'s rule.
# ``fp8_gemv``'s ``config=`` replaces the pick for one call (benchmarks' sweeps).
TABLE: dict[tuple[int, int], GemvConfig] = {
    (12288, 2048): GemvConfig(8, 2048, 4, 2),     # GDN in_proj (its 64 dense rows: the tail): 10.0 µs alone
    (2048, 4096): GemvConfig(8, 4096, 4, 1),      # GDN out_proj / attention o_proj: 5.3 (4 rows: 5.8)
    (9216, 2048): GemvConfig(16, 512, 4, 1),      # attention qkv_proj: 8.3
    (1024, 2048): GemvConfig(2, 2048, 4, 1),      # shared expert gate_up
    (2048, 512): GemvConfig(16, 1024, 8, 2),      # shared expert down
}


def config(M: int, N: int, K: int) -> GemvConfig:
    """The table's entry, else: 4 rows per program, K in steps of up to 1024 (whole K when it is smaller)."""
    cfg = TABLE.get((N, K))
    if cfg is not None and M == 1:
        return cfg
    return GemvConfig(4 if M == 1 else 2, min(1024, max(BLOCK, pow2(K))), 4, 2)


_pick = config   # the entry point's ``config=`` keyword shadows the name


def fp8_gemv(x: torch.Tensor, xq: torch.Tensor | None, xs: torch.Tensor | None, qw: torch.Tensor,
             sw: torch.Tensor, y: torch.Tensor, tail: torch.Tensor | None = None,
             config: GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_M, unit column stride), its quantization xq [M, K] e4m3 (contiguous) / xs [M,
    ceil(K/128)] float32 (contiguous: ``quantize_act_triton``) · [dequant(qw [N, K], sw) | tail [N2, K]]ᵀ into
    y [M, N + N2] (unit column stride), rounded once to y's dtype. ``xq = xs = None`` (M = 1 only): x is
    quantized inside the GEMV's programs (one launch, ``_gemv_qx_kernel``). ``config``: overrides ``TABLE``'s / the
    rule's pick for this call."""
    M, K = x.shape
    N = qw.shape[0]
    N2 = 0 if tail is None else tail.shape[0]
    if not 1 <= M <= (MAX_M if xq is not None else 1):
        raise ValueError(f"fp8_gemv: x has {M} rows, must be in [1, {MAX_M if xq is not None else 1}]")
    BN, BK, warps, stages = config if config is not None else _pick(M, N, K)
    if BN > BLOCK or BN & (BN - 1) or BK & (BK - 1) or BK < BLOCK:
        raise ValueError(f"fp8_gemv: BN {BN} must be a power of two <= {BLOCK}, BK {BK} a power of two >= {BLOCK}")
    if xq is None:
        launch(_gemv_qx_kernel, (cdiv(N, BN) + cdiv(N2, BN),),
               (x, qw, sw, qw if tail is None else tail, y, N, N2, K, cdiv(K, BLOCK), BN, BK // BLOCK,
                K % BK == 0), num_warps=warps, num_stages=stages)
        return y
    launch(_gemv_kernel, (cdiv(N, BN) + cdiv(N2, BN),),
           (x, xq, xs, qw, sw, qw if tail is None else tail, y, M, N, N2, K, cdiv(K, BLOCK), x.stride(0),
            y.stride(0), pow2(M), BN, BK, K % BK == 0), num_warps=warps, num_stages=stages)
    return y
