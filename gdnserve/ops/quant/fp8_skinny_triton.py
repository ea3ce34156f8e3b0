"""Decode-sized block-FP8 linear (M <= 16 tokens) in ONE Triton launch: ``y [M, N (+ N2)] = x · [W | tail]ᵀ``,
W e4m3 ``[N, K]`` with ``weight_scale_inv [ceil(N/128), ceil(K/128)]``, tail an optional dense ``[N2, K]``.

A decode GEMV reads every weight byte once and does little else, so the kernel is a weight stream: one
program = ``BN`` weight rows x all tokens (``BM`` >= M), the K loop over whole 128-wide scale blocks, ``KG``
of them per iteration (their loads are independent, so they are in flight together). No separate
activation-quantization launch, no split-K partials, no reduce kernel, no copy of a dense tail:

* ``QUANT`` (the default, the block scheme's math — ``fp8_ref.fp8_linear_torch``): each program quantizes
  the x group it needs in registers (``tl_fp8.quant_tile``: per token and group of 128, the e4m3 grid by
  arithmetic) — x is a few KB and stays in L2, so re-reading it per program costs no HBM bytes;
  ``acc += (W-tile · qᵀ) · sw · sx``. Else weight-only (``fp8_ref.fp8_linear_torch(quant_act=False)``):
  x in its own precision, ``acc += (W-tile · xᵀ) · sw`` — no activation rounding at all.
* ``DOT``: the tile product on the tensor cores (W-tile upcast to bf16 — exact, e4m3 ⊂ bf16 — times the
  quantized x, also exact in bf16; fp32 accumulation; weight rows on the MMA's M side), or (``DOT`` off,
  M = 1) on the CUDA cores: ``Σ_k w · x`` in float32. Float32 x entering unquantized (the tail, weight-only;
  reference models) takes IEEE fp32 dots.
* Programs past the FP8 rows' tiles compute the dense tail (``x · tailᵀ`` in x's precision, unquantized —
  the checkpoints keep those rows in bf16) into the output columns after W's.

Deterministic (fixed summation order, no atomics); the grid depends on shapes only (CUDA-graph safe).
Configs: ``config`` (H200: benchmarks/bench_fp8.py; ``fp8_skinny(config=...)`` for sweeps).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdnserve.ops.launch import cdiv, launch
from gdnserve.ops.quant.tl_fp8 import quant_tile
from gdnserve.ops.tl_compat import INTERPRET, cast

BLOCK = 128
MAX_M = 16


@triton.jit
def _tile_dot(a, b, DOT: tl.constexpr, WIDE: tl.constexpr):
    """a [BN, BK] weight tile (any float dtype), b [BM, BK] float32 activations -> a · bᵀ [BN, BM] float32.
    WIDE: b is not bf16-exact (float32 x, no quantization): IEEE fp32."""
    if DOT:
        if INTERPRET:
            return tl.dot(a.to(tl.float32), tl.trans(b), input_precision="ieee")
        elif WIDE:
            return tl.dot(a.to(tl.float32), tl.trans(b), input_precision="ieee")
        else:
            return tl.dot(a.to(tl.bfloat16), tl.trans(b.to(tl.bfloat16)))
    else:
        return tl.sum(a.to(tl.float32)[:, None, :] * b[None, :, :], axis=2)


@triton.jit
def _skinny_kernel(x, w, ws, tail, y, M, N, N2, K, SK, stride_xm, stride_ym,
                   BM: tl.constexpr, BN: tl.constexpr, KG: tl.constexpr, DOT: tl.constexpr,
                   QUANT: tl.constexpr, WIDE: tl.constexpr):
    pid = tl.program_id(0)
    pid_m = tl.program_id(1)
    NT = tl.cdiv(N, BN)
    offs_m = pid_m * BM + tl.arange(0, BM)
    m_ok = offs_m < M
    offs_k = tl.arange(0, 128)
    x_rows = x + offs_m[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    if pid < NT:                                    # FP8 rows
        offs_n = pid * BN + tl.arange(0, BN)
        n_ok = offs_n < N
        w_rows = w + offs_n[:, None].to(tl.int64) * K
        ws_n = ws + (offs_n // 128) * SK
        for kb0 in range(0, SK, KG):
            for g in tl.static_range(KG):
                kb = kb0 + g
                kk = kb * 128 + offs_k
                k_ok = kk < K                       # also false for every column of a block past SK
                a = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                xt = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
                sw = tl.load(ws_n + tl.minimum(kb, SK - 1), mask=n_ok, other=0.0)   # (a block past SK: zeros)
                if QUANT:
                    q, sx = quant_tile(xt)
                    acc += _tile_dot(a, q, DOT, False) * (sw[:, None] * sx[None, :])
                else:
                    acc += _tile_dot(a, xt, DOT, WIDE) * sw[:, None]
        col = offs_n
    else:                                           # the dense tail's rows, x unquantized
        offs_n = (pid - NT) * BN + tl.arange(0, BN)
        n_ok = offs_n < N2
        t_rows = tail + offs_n[:, None].to(tl.int64) * K
        for kb0 in range(0, SK, KG):
            for g in tl.static_range(KG):
                kk = (kb0 + g) * 128 + offs_k
                k_ok = kk < K
                a = tl.load(t_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                xt = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
                acc += _tile_dot(a, xt, DOT, WIDE)
        col = N + offs_n
    dst = y + offs_m[None, :].to(tl.int64) * stride_ym + col[:, None]
    tl.store(dst, cast(acc, y.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


# (BN weight rows, KG K blocks per iteration, num_warps, num_stages, DOT): ``config``'s pick, or ``fp8_skinny``'s
# ``config=`` for one call (benchmarks' sweeps).


def config(M: int, N: int, K: int) -> tuple[int, int, int, int, bool]:
    """(BN, KG, warps, stages, DOT) from the shapes: M = 1 on the CUDA cores, else tensor-core dots; weight
    tiles narrow enough that the FP8 rows alone give ~1 program per SM or more (out_proj's 2048 rows: 16-row
    tiles), 4 K blocks in flight per program."""
    bn = 64 if N >= 64 * 132 else (32 if N >= 32 * 132 else 16)
    if M == 1:
        return bn, 4, 4, 1, False
    return bn, 4, 4, 2, True


_pick = config   # the entry point's ``config=`` keyword shadows the name


def fp8_skinny(x: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor, y: torch.Tensor,
               tail: torch.Tensor | None = None, quant_act: bool = True,
               config: tuple[int, int, int, int, bool] | None = None) -> torch.Tensor:
    """x [M, K] (unit column stride, M <= 16) · [dequant(qw [N, K], sw) | tail [N2, K]]ᵀ into y [M, N + N2]
    (unit column stride; rounded once to y's dtype). ``quant_act``: quantize x per token-group of 128 (the
    block scheme) or use it as is (weight-only). ``config``: overrides the shape rule's pick for this call."""
    M, K = x.shape
    N = qw.shape[0]
    N2 = 0 if tail is None else tail.shape[0]
    if M == 0:
        return y
    BN, KG, warps, stages, dot = config if config is not None else _pick(M, N, K)
    BM = 1 if not dot else max(16, 1 << (min(M, MAX_M) - 1).bit_length())
    wide = x.dtype == torch.float32             # IEEE dots wherever x enters unquantized (tail, weight-only)
    grid = (cdiv(N, BN) + cdiv(N2, BN), cdiv(M, BM))
    launch(_skinny_kernel, grid, (x, qw, sw, qw if tail is None else tail, y, M, N, N2, K, cdiv(K, BLOCK),
                                  x.stride(0), y.stride(0), BM, BN, KG, dot, quant_act, wide),
           num_warps=warps, num_stages=stages)
    return y
