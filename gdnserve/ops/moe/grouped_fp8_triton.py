"""FP8 routed experts (block checkpoints) in Triton: the grouped GEMM of ``grouped_triton`` with native
fp8 x fp8 tensor-core dots, driven by the same ``align.Alignment`` (block ``b`` of ``BM`` sorted rows belongs
to one expert; padding rows carry pair ``T*k``; blocks past the end expert -1).

Weights e4m3 with one float32 scale per 128x128 block — ``w_gate_up [E, 2I, H]`` with scales
``[E, 2·ceil(I/128), ceil(H/128)]`` (the gate rows' blocks, then the up rows'), ``w_down [E, H, I]`` with
``[E, ceil(H/128), ceil(I/128)]``. Activations are quantized per row and group of 128 (``ops/quant``'s
scheme, the same numbers as the dequantizing reference ``fp8_torch``):

1. x once per call (``quantize_act_triton``: [T, H] e4m3 + scales), the gate_up kernel gathers its rows.
2. ``_gate_up_kernel``: one program = a row block x ``BNH`` intermediate columns; its MMA tile stacks the
   ``BNH`` gate rows on the ``BNH`` up rows of the expert (``acc [2·BNH, BM] = W-tile · x-tileᵀ``: weight rows
   on the MMA's M side, so 16-row token blocks still run Hopper wgmma), one 128-wide K block per step adding
   ``dot · sw · sx``. Epilogue ``h = silu(g) · u`` rounded to x's dtype, then either — ``BNH = 128``, one
   whole quantization group per program (the larger calls) — quantized right there and stored as e4m3 +
   scales, or (decode-sized calls: narrow tiles, enough programs to stream the weights) stored and quantized
   by one ``quantize_act_triton`` launch. (Quantizing in the down kernel's registers instead measured 17 µs
   for that kernel alone at T = 1 on the H200: the e4m3 operand then cannot be copied asynchronously.)
3. ``_down_kernel``: ``pair_out[pair, n] = w(pair) · (h_q · Wd[e, n])`` on the same swapped tiles, written per
   pair (no atomics); the k pair outputs of a token are summed afterwards in float32 and rounded once.

Float32 activations (reference models) multiply the e4m3 values as bf16 (exact) with fp32 accumulation:
Hopper's fp8 MMA accumulates with less than fp32 precision (~1e-4 relative; fine for bf16 outputs).
Deterministic (no atomics, no split-K). No host reads: the grid is fixed by shapes (CUDA-graph safe).
Tile configs: ``config`` (H200: benchmarks/bench_fp8.py --sweep).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdnserve.ops.launch import cdiv, launch
from gdnserve.ops.moe.align import Alignment
from gdnserve.ops.quant.fp8_gemm_triton import quantize_act_triton
from gdnserve.ops.quant.tl_fp8 import as_fp8_operand, fp8_dot, quant_cols
from gdnserve.ops.tl_compat import cast

BK: tl.constexpr = tl.constexpr(128)      # one scale block per K step
SMS = 132


@triton.jit
def _rows(rows, pid_m, N, BM: tl.constexpr):
    offs_m = pid_m * BM + tl.arange(0, BM)
    r = tl.load(rows + offs_m)
    return offs_m, r, r < N


@triton.jit
def _gate_up_kernel(xq, xs, w, ws, rows, block_expert, inter, iq, isc, N, H, I, SG, SKH, SKI,
                    TOP_K: tl.constexpr, BM: tl.constexpr, BNH: tl.constexpr, QUANT_OUT: tl.constexpr,
                    NATIVE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert + pid_m).to(tl.int64)
    if e >= 0:
        offs_m, r, valid = _rows(rows, pid_m, N, BM)
        tok = (r // TOP_K).to(tl.int64)
        j = tl.arange(0, 2 * BNH)
        up = j >= BNH
        n = pid_n * BNH + j % BNH                                   # intermediate column of MMA row j
        n_ok = n < I
        w_rows = w + e * (2 * I) * H + (n + up.to(tl.int32) * I).to(tl.int64)[:, None] * H
        s_rows = ws + e * (2 * SG) * SKH + (n // BK + up.to(tl.int32) * SG) * SKH
        x_cols = xq + tok[None, :] * H
        xs_m = xs + tok * SKH
        offs_k = tl.arange(0, BK)
        acc = tl.zeros((2 * BNH, BM), dtype=tl.float32)
        for kb in range(0, SKH):
            kk = kb * BK + offs_k
            k_ok = kk < H
            a = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            b = as_fp8_operand(tl.load(x_cols + kk[:, None], mask=k_ok[:, None] & valid[None, :], other=0.0))
            sw = tl.load(s_rows + kb, mask=n_ok, other=0.0)
            sx = tl.load(xs_m + kb, mask=valid, other=0.0)
            acc += fp8_dot(a, b, NATIVE) * (sw[:, None] * sx[None, :])
        g, u = tl.split(tl.permute(tl.reshape(acc, (2, BNH, BM)), (1, 2, 0)))      # [BNH, BM] each
        h = cast(g * tl.sigmoid(g) * u, inter.dtype.element_ty)                 # rounded as the reference
        offs_n = pid_n * BNH + tl.arange(0, BNH)
        if QUANT_OUT:       # BNH == 128: this program holds the whole 128-column group of its rows
            mask = (offs_n < I)[:, None] & valid[None, :]
            hq, hs = quant_cols(h.to(tl.float32))
            tl.store(iq + offs_m[None, :].to(tl.int64) * I + offs_n[:, None], hq.to(iq.dtype.element_ty), mask=mask)
            tl.store(isc + offs_m * SKI + pid_n, hs, mask=valid)
        else:               # every row of the block (padding rows: 0), quantized by ``quantize_act_triton``
            tl.store(inter + offs_m[None, :].to(tl.int64) * I + offs_n[:, None], h, mask=(offs_n < I)[:, None])


@triton.jit
def _down_kernel(iq, isc, w, ws, rows, block_expert, pair_w, out, N, H, I, SKI,
                 BM: tl.constexpr, BN: tl.constexpr, NATIVE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert + pid_m).to(tl.int64)
    if e >= 0:
        offs_m, r, valid = _rows(rows, pid_m, N, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_ok = offs_n < H
        w_rows = w + e * H * I + offs_n[:, None].to(tl.int64) * I
        s_rows = ws + e * tl.cdiv(H, BK) * SKI + (offs_n // BK) * SKI
        h_cols = offs_m[None, :].to(tl.int64) * I
        offs_k = tl.arange(0, BK)
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        for kb in range(0, SKI):
            kk = kb * BK + offs_k
            k_ok = kk < I
            bmask = k_ok[:, None] & valid[None, :]
            b = as_fp8_operand(tl.load(iq + h_cols + kk[:, None], mask=bmask, other=0.0))
            sx = tl.load(isc + offs_m * SKI + kb, mask=valid, other=0.0)
            a = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            sw = tl.load(s_rows + kb, mask=n_ok, other=0.0)
            acc += fp8_dot(a, b, NATIVE) * (sw[:, None] * sx[None, :])
        pw = tl.load(pair_w + r, mask=valid, other=0.0).to(tl.float32)
        dst = out + r[None, :].to(tl.int64) * H + offs_n[:, None]
        tl.store(dst, cast(acc * pw[None, :], out.dtype.element_ty), mask=n_ok[:, None] & valid[None, :])


# ((BNH, warps, stages) gate_up, (BN, warps, stages) down): ``config``'s pick, or ``moe_experts_fp8_triton``'s
# ``config=`` for one call (the benchmark sweeps it).
Fp8GroupedConfig = tuple[tuple[int, int, int], tuple[int, int, int]]


def config(live_blocks: int, H: int, I: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """From the shapes (H200 sweep, benchmarks/results/fp8_h200.md): a handful of live row blocks (T = 1)
    32 + 32-row gate/up tiles, up to ~4 blocks per SM 64 + 64 (both with the intermediate quantized by its own
    launch), beyond 128 + 128 (quantized in the gate_up epilogue); 128-row down tiles."""
    work = live_blocks * cdiv(I, 128)
    if work < 64:
        return (32, 4, 5), (128, 4, 3)
    if work < 4 * SMS:
        return (64, 4, 4), (128, 4, 3)
    return (128, 8, 3), (128, 4, 3)


_pick = config   # the entry point's ``config=`` keyword shadows the name


def moe_experts_fp8_triton(x: torch.Tensor, weights: torch.Tensor, al: Alignment, w_gate_up: torch.Tensor,
                           w_down: torch.Tensor, top_k: int, s_gate_up: torch.Tensor, s_down: torch.Tensor,
                           config: Fp8GroupedConfig | None = None) -> torch.Tensor:
    """x [T, H] (unit column stride), weights [T, k] (contiguous), w_gate_up [E, 2I, H] / w_down [E, H, I]
    e4m3 and their block scales (float32, contiguous) -> [T, H] in x.dtype."""
    T, H = x.shape
    I = w_down.shape[2]
    N, P, BM = T * top_k, al.rows.numel(), al.BM
    if BM < 16 or BM & (BM - 1):
        raise ValueError(f"moe_experts_fp8_triton: the row block must be a power of two >= 16, got {BM}")
    (BNH, w1, st1), (BN2, w2, st2) = config if config is not None else _pick(min(P // BM, N), H, I)
    quant_out = BNH == 128
    SG, SKH, SKI = cdiv(I, 128), cdiv(H, 128), cdiv(I, 128)
    native = x.dtype != torch.float32        # float32 models: exact bf16 dots of the e4m3 values (tl_fp8)
    xq, xs = quantize_act_triton(x)
    if quant_out:
        iq = torch.empty(P, I, dtype=torch.float8_e4m3fn, device=x.device)
        isc = torch.empty(P, SKI, dtype=torch.float32, device=x.device)
        inter = x                                    # unused pointer
    else:
        inter = torch.empty(P, I, dtype=x.dtype, device=x.device)
        iq, isc = inter, xs                          # unused pointers
    launch(_gate_up_kernel, (P // BM, cdiv(I, BNH)),
           (xq, xs, w_gate_up, s_gate_up, al.rows, al.block_expert, inter, iq, isc, N, H, I, SG, SKH, SKI,
            top_k, BM, BNH, quant_out, native), num_warps=w1, num_stages=st1)
    if not quant_out:       # rows of unused blocks hold garbage: quantized too, never read (the down kernel masks)
        iq, isc = quantize_act_triton(inter)
    pair_out = torch.empty(N, H, dtype=x.dtype, device=x.device)
    launch(_down_kernel, (P // BM, cdiv(H, BN2)),
           (iq, isc, w_down, s_down, al.rows, al.block_expert, weights.reshape(-1), pair_out, N, H, I, SKI,
            BM, BN2, native), num_warps=w2, num_stages=st2)
    return pair_out.view(T, top_k, H).sum(dim=1)
