"""Grouped GEMM for the routed experts (Triton), driven by ``align.Alignment``: block ``b`` of ``BM`` sorted
rows multiplies the rows' tokens by its expert's weights. Two kernels, then the k-sum (``combine_triton.py``):

  gate_up:  inter[r, n] = silu(x[tok(r)] . Wg[e, n]) * (x[tok(r)] . Wu[e, n])     r: padded sorted row
  down:     pair_out[pair(r), n] = w(pair) * (inter[r] . Wd[e, n])                 written per pair, no atomics
  k-sum:    out[t] = sum_j pair_out[t * k + j]                                       one kernel, fp32

The row block BM (``block_rows``) and each kernel's tiles (``Tiles``: N width, K step, warps, stages, program
order, gate and up as one MMA or two; ``config``) are picked from the shapes alone. Matmuls accumulate in fp32;
the intermediate and each pair output are rounded to the activation dtype, the k-sum accumulates in fp32 and
rounds once. A token's result does not
depend on the other tokens' values (no atomics, rows of a tile are independent), so it is deterministic; the
row block BM and the tiles are chosen from the batch shape and can change the rounding, so batches of
different sizes may differ in the last bits.

FP8 experts (``FP8`` constexpr, from block checkpoints): weights e4m3 with one float32 scale per 128x128
block — ``w_gate_up`` scales ``[E, 2·ceil(I/128), ceil(H/128)]`` (the gate rows' blocks, then the up
rows'), ``w_down`` scales ``[E, ceil(H/128), ceil(I/128)]``. The K step is then exactly 128: each step
quantizes the activation tile (the gathered x rows, or the rounded intermediate) per row and group of 128
on the fly (``ops/quant/tl_fp8.py``), multiplies the tiles (weights upcast from e4m3 to bf16, exact) on
the bf16 tensor cores and adds ``dot · sx · sw``: the weights are read as e4m3 bytes (always the two-MMA
gate_up kernel).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from gdnserve.ops.launch import cdiv, launch
from gdnserve.ops.moe import grouped_tma_triton as tma
from gdnserve.ops.moe.align import Alignment
from gdnserve.ops.moe.combine_triton import combine
from gdnserve.ops.moe.tile_triton import _tile
from gdnserve.ops.quant.tl_fp8 import fp8_dot, quant_tile
from gdnserve.ops.tl_compat import cast, mma


@triton.jit
def _gate_up_kernel(x, w, ws, rows, block_expert, inter, N, H, I, stride_x, SG, SK,
                    TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    PREC: tl.constexpr, FP8: tl.constexpr, N_FAST: tl.constexpr):
    pid_m, pid_n, offs_m, offs_n, n_ok, offs_k = _tile(I, tl.cdiv(I, BN), BM, BN, BK, N_FAST)
    e = tl.load(block_expert + pid_m).to(tl.int64)
    if e >= 0:
        r = tl.load(rows + offs_m)
        valid = r < N
        tok = (r // TOP_K).to(tl.int64)
        w_e = w + e * (2 * I) * H
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, H, BK):
            kk = k0 + offs_k
            k_ok = kk < H
            a = tl.load(x + tok[:, None] * stride_x + kk[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            bmask = k_ok[:, None] & n_ok[None, :]
            bg = tl.load(w_e + offs_n[None, :].to(tl.int64) * H + kk[:, None], mask=bmask, other=0.0)
            bu = tl.load(w_e + (offs_n[None, :] + I).to(tl.int64) * H + kk[:, None], mask=bmask, other=0.0)
            if FP8:    # BK == 128: this step is one scale block along H
                q, sx = quant_tile(a.to(tl.float32))
                ws_e = ws + e * (2 * SG) * SK + k0 // BK
                sg = tl.load(ws_e + (offs_n // BK) * SK, mask=n_ok, other=0.0)
                su = tl.load(ws_e + (SG + offs_n // BK) * SK, mask=n_ok, other=0.0)
                acc_g += fp8_dot(q, bg, False) * (sx[:, None] * sg[None, :])
                acc_u += fp8_dot(q, bu, False) * (sx[:, None] * su[None, :])
            else:
                acc_g += mma(a, bg, PREC)
                acc_u += mma(a, bu, PREC)
        h = acc_g * tl.sigmoid(acc_g) * acc_u
        dst = inter + offs_m[:, None].to(tl.int64) * I + offs_n[None, :]
        tl.store(dst, cast(h, inter.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _gate_up_one_dot_kernel(x, w, rows, block_expert, inter, N, H, I, stride_x,
                            TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                            PREC: tl.constexpr, N_FAST: tl.constexpr):
    """gate_up (not FP8) as one [BM, BK] x [BK, 2 BN] product per K step: the B tile's columns interleave the gate
    rows and the up rows of this program's BN columns of ``inter`` (wider MMAs than two [BK, BN] products)."""
    pid_m, pid_n, offs_m, offs_n, n_ok, offs_k = _tile(I, tl.cdiv(I, BN), BM, BN, BK, N_FAST)
    e = tl.load(block_expert + pid_m).to(tl.int64)
    if e >= 0:
        r = tl.load(rows + offs_m)
        valid = r < N
        tok = (r // TOP_K).to(tl.int64)
        j = tl.arange(0, 2 * BN)
        col = pid_n * BN + j // 2                                   # even j: gate row col, odd j: up row I + col
        w_cols = w + e * (2 * I) * H + (col + (j % 2) * I).to(tl.int64)[None, :] * H
        col_ok = (col < I)[None, :]
        acc = tl.zeros((BM, 2 * BN), dtype=tl.float32)
        for k0 in range(0, H, BK):
            kk = k0 + offs_k
            k_ok = kk < H
            a = tl.load(x + tok[:, None] * stride_x + kk[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_cols + kk[:, None], mask=k_ok[:, None] & col_ok, other=0.0)
            acc += mma(a, b, PREC)
        g, u = tl.split(tl.reshape(acc, (BM, BN, 2)))
        h = g * tl.sigmoid(g) * u
        dst = inter + offs_m[:, None].to(tl.int64) * I + offs_n[None, :]
        tl.store(dst, cast(h, inter.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(inter, w, ws, rows, block_expert, pair_w, out, N, H, I, SK,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, FP8: tl.constexpr,
                 N_FAST: tl.constexpr):
    pid_m, pid_n, offs_m, offs_n, n_ok, offs_k = _tile(H, tl.cdiv(H, BN), BM, BN, BK, N_FAST)
    e = tl.load(block_expert + pid_m).to(tl.int64)
    if e >= 0:
        r = tl.load(rows + offs_m)
        valid = r < N
        w_e = w + e * H * I
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, I, BK):
            kk = k0 + offs_k
            k_ok = kk < I
            a = tl.load(inter + offs_m[:, None].to(tl.int64) * I + kk[None, :], mask=valid[:, None] & k_ok[None, :],
                        other=0.0)
            b = tl.load(w_e + offs_n[None, :].to(tl.int64) * I + kk[:, None], mask=k_ok[:, None] & n_ok[None, :],
                        other=0.0)
            if FP8:
                q, sx = quant_tile(a.to(tl.float32))
                sw = tl.load(ws + e * tl.cdiv(H, BK) * SK + (offs_n // BK) * SK + k0 // BK, mask=n_ok, other=0.0)
                acc += fp8_dot(q, b, False) * (sx[:, None] * sw[None, :])
            else:
                acc += mma(a, b, PREC)
        pw = tl.load(pair_w + r, mask=valid, other=0.0).to(tl.float32)
        y = acc * pw[:, None]
        dst = out + r[:, None].to(tl.int64) * H + offs_n[None, :]
        tl.store(dst, cast(y, out.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


class Tiles(NamedTuple):
    """One kernel's tiles: N width, K step, warps, pipeline stages, the program order (``_tile``), and for gate_up
    whether gate and up take one MMA of twice the width (``_gate_up_one_dot_kernel``; not FP8), and whether the
    weight tiles come by TMA descriptor (``grouped_tma_triton``; not FP8; where its alignment rules hold, else
    the pointer kernel of the same tiles)."""
    BN: int
    BK: int
    warps: int
    stages: int
    n_fast: bool = False
    one_dot: bool = False
    tma: bool = False


class Config(NamedTuple):
    gate_up: Tiles
    down: Tiles
    sum_block: int = 512   # H columns per program of the k-sum


def block_rows(num_pairs: int, num_experts: int) -> int:
    """Row block from the expected rows per expert (shapes only: no host read). Every caller that aligns pairs
    for the grouped GEMM (``experts.py``, the fused router) takes BM from here. H200 sweep: 64 beats 32 from 32
    rows per expert on, 128 beats 64 from 256 on (not at 128)."""
    per = num_pairs / num_experts
    return 16 if per <= 16 else (32 if per < 32 else (64 if per <= 192 else 128))



_DECODE = Config(Tiles(32, 256, 4, 3), Tiles(64, 128, 4, 3, True))
_ROWS32 = Config(Tiles(64, 64, 4, 4, True, True), Tiles(128, 64, 4, 3, True))
_ROWS64_FEW = Config(Tiles(64, 64, 4, 4, True, True), Tiles(128, 64, 4, 3, True))
_ROWS64 = Config(Tiles(64, 64, 4, 3, True), Tiles(128, 64, 4, 3, True))
# BM 128 gate_up by TMA, one MMA (sweep at commit 14fdb0b, E 256, T 8192: 578 µs alone against 662 for the pointer
# kernel of the same tiles; end to end within the run-to-run spread, docs/benchmarks.md)
_ROWS128 = Config(Tiles(128, 64, 8, 3, True, True, True), Tiles(128, 64, 8, 3, True))


def config(num_pairs: int, BM: int) -> Config:
    """Tiles from the shapes only (H200 sweep, H 2048, I 512: ``benchmarks/results/moe_sweep_h200.log``).
    BM 16 (decode-sized: few rows per expert, the weights streamed once) takes narrow N tiles and K steps of
    256 for gate_up; the larger row blocks wider tiles on the tensor cores, N-tile-major program order (a row
    block's N tiles run together), gate and up as one MMA up to 8192 pairs; BM 128 reads gate_up's weight tiles
    by TMA descriptor (``grouped_tma_triton``)."""
    if BM <= 16:
        return _DECODE
    if BM == 32:
        return _ROWS32
    if BM == 64:
        return _ROWS64_FEW if num_pairs <= 8192 else _ROWS64
    return _ROWS128


def fp8_config(num_blocks: int, BM: int, H: int, I: int) -> Config:
    """FP8 experts keep the tiles they had before the bf16 sweep (commit ff7685e; K step 128 = the scale block),
    on 8 warps at BM = 128. ``num_blocks``: the row blocks that can hold rows."""
    few = num_blocks * cdiv(I, 64) < 256
    warps = 8 if BM >= 128 else 4
    bn2 = 128 if num_blocks * cdiv(H, 128) >= 256 else 64
    return Config(Tiles(32 if few else 64, 128, warps, 3), Tiles(bn2, 128, warps, 3))


_pick = config   # moe_experts_triton's ``config=`` keyword shadows the name

SMEM_BUDGET = 160 * 1024    # bytes of pipelined tiles per program: under the H100/H200's 227 KiB with room to spare


def fit_stages(t: Tiles, BM: int, elem_size: int, gate_up: bool) -> Tiles:
    """``t`` with its pipeline stages cut so they fit ``SMEM_BUDGET`` at ``elem_size`` bytes per element: the tiles
    are tuned for 16-bit operands; float32 operands (``--dtype float32`` on CUDA) double every stage's bytes, and
    BM 128's 3 stages of x + gate + up tiles (294 KB) ran out of shared memory at launch. Unchanged where they fit."""
    per_stage = (BM * t.BK + (2 if gate_up else 1) * t.BN * t.BK) * elem_size
    stages = max(1, min(t.stages, SMEM_BUDGET // per_stage))
    return t if stages == t.stages else t._replace(stages=stages)


def _prec(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def gate_up(x: torch.Tensor, al: Alignment, w_gate_up: torch.Tensor, top_k: int, t: Tiles,
            scales: torch.Tensor | None = None) -> torch.Tensor:
    """-> inter [P, I] (the padding rows unwritten)."""
    H = x.shape[1]
    I = w_gate_up.shape[1] // 2
    N, P, BM = x.shape[0] * top_k, al.rows.numel(), al.BM
    fp8 = scales is not None
    if t.tma and not fp8 and tma.usable(w_gate_up):
        return tma.gate_up_tma(x, al, w_gate_up, top_k, t, _prec(x))
    inter = torch.empty(P, I, dtype=x.dtype, device=x.device)
    grid = ((P // BM) * cdiv(I, t.BN),)
    if t.one_dot and not fp8:
        launch(_gate_up_one_dot_kernel, grid, (x, w_gate_up, al.rows, al.block_expert, inter, N, H, I, x.stride(0),
                                               top_k, BM, t.BN, t.BK, _prec(x), t.n_fast),
               num_warps=t.warps, num_stages=t.stages)
        return inter
    launch(_gate_up_kernel, grid,
           (x, w_gate_up, scales if fp8 else w_gate_up, al.rows, al.block_expert, inter, N, H, I, x.stride(0),
            cdiv(I, 128), cdiv(H, 128), top_k, BM, t.BN, 128 if fp8 else t.BK, _prec(x), fp8, t.n_fast),
           num_warps=t.warps, num_stages=t.stages)           # FP8: one scale block per K step
    return inter


def down(inter: torch.Tensor, al: Alignment, w_down: torch.Tensor, pair_w: torch.Tensor, N: int, t: Tiles,
         scales: torch.Tensor | None = None) -> torch.Tensor:
    """-> pair_out [N, H]: each pair's weighted expert output, in pair (token-major) order."""
    H, I = w_down.shape[1], w_down.shape[2]
    P, BM = al.rows.numel(), al.BM
    fp8 = scales is not None
    if t.tma and not fp8 and tma.usable(inter, w_down):
        return tma.down_tma(inter, al, w_down, pair_w, N, t, _prec(inter))
    out = torch.empty(N, H, dtype=inter.dtype, device=inter.device)
    launch(_down_kernel, ((P // BM) * cdiv(H, t.BN),),
           (inter, w_down, scales if fp8 else w_down, al.rows, al.block_expert, pair_w, out, N, H, I, cdiv(I, 128),
            BM, t.BN, 128 if fp8 else t.BK, _prec(inter), fp8, t.n_fast), num_warps=t.warps, num_stages=t.stages)
    return out


def moe_experts_triton(x: torch.Tensor, weights: torch.Tensor, al: Alignment, w_gate_up: torch.Tensor,
                       w_down: torch.Tensor, top_k: int,
                       scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                       config: Config | None = None) -> torch.Tensor:
    """x [T, H] (unit column stride), weights [T, k] (contiguous), w_gate_up [E, 2I, H], w_down [E, H, I]
    (contiguous) -> [T, H] in x.dtype. ``scales``: the FP8 experts' block scales (gate_up, down), float32,
    contiguous. Any E and top_k (the alignment's rows index pairs token * top_k + j). ``config``: overrides the
    shape rule's tiles (``config`` / ``fp8_config``) for this call (benchmarks' sweeps)."""
    T, H = x.shape
    N = T * top_k
    if config is not None:
        cfg = config
    elif scales is None:
        cfg = _pick(N, al.BM)
    else:
        cfg = fp8_config(min(al.rows.numel() // al.BM, N), al.BM, H, w_down.shape[2])
    if x.element_size() > 2 and config is None:
        cfg = cfg._replace(gate_up=fit_stages(cfg.gate_up, al.BM, x.element_size(), True),
                           down=fit_stages(cfg.down, al.BM, x.element_size(), False))
    s_gu, s_dn = scales if scales is not None else (None, None)
    inter = gate_up(x, al, w_gate_up, top_k, cfg.gate_up, s_gu)
    return combine(down(inter, al, w_down, weights.reshape(-1), N, cfg.down, s_dn), T, top_k, cfg.sum_block)
