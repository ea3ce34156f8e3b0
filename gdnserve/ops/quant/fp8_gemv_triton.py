"""Decode-sized block-FP8 linear (M <= ``MAX_M`` tokens) on the CUDA cores: ``y [M, N (+ N2)] = x · [W | tail]ᵀ``
with W e4m3 ``[N, K]``, ``weight_scale_inv [ceil(N/128), ceil(K/128)]``, tail an optional dense ``[N2, K]``.

A decode GEMV reads every weight byte once and does little else, so this is a weight stream shaped like the
bf16 one (``ops/gemv``, 68-89 % of the copy rate on the H200): one program = ``BN`` weight rows (2-16) over
the whole of K in ``BK``-wide steps, thousands of programs, so each SM keeps many independent weight loads in
flight. x is quantized ONCE per call by its own launch (``quantize_act_triton``: e4m3 + one float32 scale per
token and group of 128 — the block scheme), never per program: re-quantizing x in every program's registers
(the one-launch ``fp8_skinny_triton``) costs more arithmetic than the dot itself and measured 2.5-6x slower.

Per K step: the e4m3 weight tile ``[BN, BK]`` and the e4m3 x tile ``[BM, BK]`` upcast to float32 (exact), their
products (exact: 4 x 4 significant bits) summed per 128-wide group in float32, then each group's sum times
``sw[row block, group] · sx[token, group]`` — the block scheme's ``Σ_groups (qw · qx) · sw · sx``, float32
accumulation throughout (the dequantizing reference ``fp8_ref.fp8_linear_torch`` up to summation order).
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
from gdnserve.ops.tl_compat import cast

BLOCK = 128
MAX_M = 4          # tokens per call on the CUDA cores (M = 1 ... 4: one program holds all of them)


@triton.jit
def _group_dot(b, a, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """b [BN, BK], a [BM, BK] float32 -> Σ over each 128-wide group of b·a: [BN, BM, BK // 128]."""
    p = b[:, None, :] * a[None, :, :]
    return tl.sum(tl.reshape(p, (BN, BM, BK // 128, 128)), axis=3)


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(x, xq, xs, w, ws, tail, y, M, N, N2, K, SK, stride_xm, stride_ym,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                 RESHAPE: tl.constexpr):
    pid = tl.program_id(0)
    NT = tl.cdiv(N, BN)
    G: tl.constexpr = BK // 128
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    rg = tl.arange(0, G)
    mm = rm < M
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    if pid < NT:                                    # FP8 rows
        rn = pid * BN + tl.arange(0, BN)
        nm = rn < N
        wrow = w + rn[:, None].to(tl.int64) * K                     # [BN, 1]
        qrow = xq + rm[:, None] * K                                 # [BM, 1]
        wp = wrow + rk[None, :]
        qp = qrow + rk[None, :]
        sp = ws + (rn // 128)[:, None] * SK + rg[None, :]          # [BN, G]
        xsp = xs + rm[:, None] * SK + rg[None, :]                  # [BM, G]
        for k0 in range(0, K, BK):
            kb = k0 // 128
            if RESHAPE:                             # one [BN, BK] load, group sums by a reshape
                if EVEN_K:
                    b = tl.load(wp, mask=nm[:, None], other=0.0)
                    a = tl.load(qp, mask=mm[:, None], other=0.0)
                    sw = tl.load(sp + kb, mask=nm[:, None], other=0.0)
                    sx = tl.load(xsp + kb, mask=mm[:, None], other=0.0)
                else:
                    km = (k0 + rk) < K
                    gm = (kb + rg) < SK
                    b = tl.load(wp, mask=nm[:, None] & km[None, :], other=0.0)
                    a = tl.load(qp, mask=mm[:, None] & km[None, :], other=0.0)
                    sw = tl.load(sp + kb, mask=nm[:, None] & gm[None, :], other=0.0)
                    sx = tl.load(xsp + kb, mask=mm[:, None] & gm[None, :], other=0.0)
                g = _group_dot(b.to(tl.float32), a.to(tl.float32), BN, BM, BK)
                acc += tl.sum(g * (sw[:, None, :] * sx[None, :, :]), axis=2)
            else:                                   # G separate [BN, 128] loads per step, unrolled
                for j in tl.static_range(G):
                    r1 = tl.arange(0, 128)
                    km = (k0 + j * 128 + r1) < K
                    gok = (rn * 0 + k0 + j * 128) < K           # (a vector: the interpreter has no bool scalars)
                    gom = (rm * 0 + k0 + j * 128) < K
                    kk = (k0 + j * 128 + r1)[None, :]
                    b = tl.load(wrow + kk, mask=nm[:, None] & km[None, :], other=0.0)
                    a = tl.load(qrow + kk, mask=mm[:, None] & km[None, :], other=0.0)
                    sw = tl.load(ws + (rn // 128) * SK + kb + j, mask=nm & gok, other=0.0)
                    sx = tl.load(xs + rm * SK + kb + j, mask=mm & gom, other=0.0)
                    d = tl.sum(b.to(tl.float32)[:, None, :] * a.to(tl.float32)[None, :, :], axis=2)
                    acc += d * (sw[:, None] * sx[None, :])
            wp += BK
            qp += BK
        col = rn
    else:                                           # the dense tail's rows, x unquantized
        rn = (pid - NT) * BN + tl.arange(0, BN)
        nm = rn < N2
        tp = tail + rn[:, None].to(tl.int64) * K + rk[None, :]
        xp = x + rm[:, None] * stride_xm + rk[None, :]
        for k0 in range(0, K, BK):
            if EVEN_K:
                b = tl.load(tp, mask=nm[:, None], other=0.0)
                a = tl.load(xp, mask=mm[:, None], other=0.0)
            else:
                km = (k0 + rk) < K
                b = tl.load(tp, mask=nm[:, None] & km[None, :], other=0.0)
                a = tl.load(xp, mask=mm[:, None] & km[None, :], other=0.0)
            acc += tl.sum(b.to(tl.float32)[:, None, :] * a.to(tl.float32)[None, :, :], axis=2)
            tp += BK
            xp += BK
        col = N + rn
    dst = y + rm[None, :] * stride_ym + col[:, None]
    tl.store(dst, cast(acc, y.dtype.element_ty), mask=nm[:, None] & mm[None, :])


class GemvConfig(NamedTuple):
    BN: int            # weight rows per program
    BK: int            # K step (a multiple of 128)
    warps: int
    stages: int
    reshape: bool = True   # one [BN, BK] load per step (group sums by a reshape); False: BK/128 loads of [BN, 128]


# (N, K) -> config at M = 1 (the H200 sweep's winners, benchmarks/results/fp8_h200.md); other shapes: ``config``'s
# rule. ``CONFIG_OVERRIDE`` (benchmarks) replaces every pick.
TABLE: dict[tuple[int, int], GemvConfig] = {}
CONFIG_OVERRIDE: GemvConfig | None = None


def config(M: int, N: int, K: int) -> GemvConfig:
    """The table's entry, else: 4 rows per program, K in steps of up to 1024 (whole K when it is smaller)."""
    if CONFIG_OVERRIDE is not None:
        return CONFIG_OVERRIDE
    cfg = TABLE.get((N, K))
    if cfg is not None and M == 1:
        return cfg
    return GemvConfig(4 if M == 1 else 2, min(1024, max(BLOCK, pow2(K))), 4, 2)


def fp8_gemv(x: torch.Tensor, xq: torch.Tensor, xs: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor,
             y: torch.Tensor, tail: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_M, unit column stride; read only by the tail), its quantization xq [M, K] e4m3
    (contiguous) / xs [M, ceil(K/128)] float32 (contiguous: ``quantize_act_triton``) · [dequant(qw [N, K], sw) |
    tail [N2, K]]ᵀ into y [M, N + N2] (unit column stride), rounded once to y's dtype."""
    M, K = x.shape
    N = qw.shape[0]
    N2 = 0 if tail is None else tail.shape[0]
    if not 1 <= M <= MAX_M:
        raise ValueError(f"fp8_gemv: x has {M} rows, must be in [1, {MAX_M}]")
    BN, BK, warps, stages, reshape = config(M, N, K)
    if BK % BLOCK or BK & (BK - 1):
        raise ValueError(f"fp8_gemv: BK {BK} must be a power-of-two multiple of {BLOCK}")
    launch(_gemv_kernel, (cdiv(N, BN) + cdiv(N2, BN),),
           (x, xq, xs, qw, sw, qw if tail is None else tail, y, M, N, N2, K, cdiv(K, BLOCK), x.stride(0),
            y.stride(0), pow2(M), BN, BK, K % BK == 0, reshape), num_warps=warps, num_stages=stages)
    return y
