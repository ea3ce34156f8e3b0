"""Grouped GEMM for the routed experts (Triton), driven by ``align.Alignment``: block ``b`` of ``BM`` sorted
rows multiplies the rows' tokens by its expert's weights. Two kernels:

  gate_up:  inter[r, n] = silu(x[tok(r)] . Wg[e, n]) * (x[tok(r)] . Wu[e, n])     r: padded sorted row
  down:     pair_out[pair(r), n] = w(pair) * (inter[r] . Wd[e, n])                 written per pair, no atomics

and the k pair outputs of a token are summed afterwards. Matmuls accumulate in fp32; the intermediate and each
pair output are rounded to the activation dtype, the k-sum accumulates in fp32 and rounds once. A token's
result does not depend on the other tokens' values (no atomics, rows of a tile are independent), so it is
deterministic; the tile config (row block BM, K step BK) is chosen from the batch shape T*k and can change its
rounding, so batches of different sizes may differ in the last bits.

FP8 experts (``FP8`` constexpr, from block checkpoints): weights e4m3 with one float32 scale per 128x128
block — ``w_gate_up`` scales ``[E, 2·ceil(I/128), ceil(H/128)]`` (the gate rows' blocks, then the up
rows'), ``w_down`` scales ``[E, ceil(H/128), ceil(I/128)]``. The K step is then exactly 128: each step
quantizes the activation tile (the gathered x rows, or the rounded intermediate) per row and group of 128
on the fly (``ops/quant/tl_fp8.py``), multiplies the tiles (weights upcast from e4m3 to bf16, exact) on
the bf16 tensor cores and adds ``dot · sx · sw``: the weights are read as e4m3 bytes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdnserve.ops.launch import cdiv, launch
from gdnserve.ops.moe.align import Alignment
from gdnserve.ops.quant.tl_fp8 import fp8_dot, quant_tile
from gdnserve.ops.tl_compat import cast, mma


@triton.jit
def _tile(rows, pid_m, pid_n, N, n_out, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """The row block's padded rows, their pairs (N = padding) and the N / K offsets of this program's tile."""
    offs_m = pid_m * BM + tl.arange(0, BM)
    r = tl.load(rows + offs_m)
    offs_n = pid_n * BN + tl.arange(0, BN)
    return offs_m, r, r < N, offs_n, offs_n < n_out, tl.arange(0, BK)


@triton.jit
def _gate_up_kernel(x, w, ws, rows, block_expert, inter, N, H, I, stride_x, SG, SK,
                    TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    PREC: tl.constexpr, FP8: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert + pid_m).to(tl.int64)
    if e >= 0:
        offs_m, r, valid, offs_n, n_ok, offs_k = _tile(rows, pid_m, pid_n, N, I, BM, BN, BK)
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
def _down_kernel(inter, w, ws, rows, block_expert, pair_w, out, N, H, I, SK,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, FP8: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert + pid_m).to(tl.int64)
    if e >= 0:
        offs_m, r, valid, offs_n, n_ok, offs_k = _tile(rows, pid_m, pid_n, N, H, BM, BN, BK)
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


def block_rows(num_pairs: int, num_experts: int) -> int:
    """Row block from the expected rows per expert (shapes only: no host read)."""
    per = num_pairs / num_experts
    return 16 if per <= 16 else (32 if per <= 32 else 64)


# (BN gate_up, BN down, BK, num_warps, num_stages); None = pick from the shapes (``config``).
CONFIG_OVERRIDE: tuple[int, int, int, int, int] | None = None


def config(num_blocks: int, H: int, I: int) -> tuple[int, int, int, int, int]:
    """Tile widths so that the grid has enough programs to stream the weights: with few row blocks (decode)
    narrower N tiles and K steps of 128, else 64 / 128 and K steps of 64 (H200 sweep: moe_sweep_h200_run4.log)."""
    if CONFIG_OVERRIDE is not None:
        return CONFIG_OVERRIDE
    few = num_blocks * cdiv(I, 64) < 256                # decode-sized: narrower N tiles, longer K steps
    bn2 = 128 if num_blocks * cdiv(H, 128) >= 256 else 64
    return (32, bn2, 128, 4, 3) if few else (64, bn2, 64, 4, 3)


def moe_experts_triton(x: torch.Tensor, weights: torch.Tensor, al: Alignment, w_gate_up: torch.Tensor,
                       w_down: torch.Tensor, top_k: int,
                       scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [T, H] (unit column stride), weights [T, k], w_gate_up [E, 2I, H], w_down [E, H, I] (contiguous)
    -> [T, H] in x.dtype. ``scales``: the FP8 experts' block scales (gate_up, down), float32, contiguous."""
    T, H = x.shape
    I = w_down.shape[2]
    N, P, BM = T * top_k, al.rows.numel(), al.BM
    # blocks that can hold rows: every pair alone in its expert's block at worst (the rest exit at once)
    live = min(P // BM, N)
    BN1, BN2, BK, warps, stages = config(live, H, I)
    fp8 = scales is not None
    if fp8:
        BK = 128                                      # one scale block per K step
    s_gu, s_dn = scales if fp8 else (w_gate_up, w_down)          # unused pointers when not FP8
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    inter = torch.empty(P, I, dtype=x.dtype, device=x.device)
    launch(_gate_up_kernel, (P // BM, cdiv(I, BN1)),
           (x, w_gate_up, s_gu, al.rows, al.block_expert, inter, N, H, I, x.stride(0), cdiv(I, 128), cdiv(H, 128),
            top_k, BM, BN1, BK, prec, fp8), num_warps=warps, num_stages=stages)
    pair_out = torch.empty(N, H, dtype=x.dtype, device=x.device)
    launch(_down_kernel, (P // BM, cdiv(H, BN2)),
           (inter, w_down, s_dn, al.rows, al.block_expert, weights.reshape(-1), pair_out, N, H, I, cdiv(I, 128),
            BM, BN2, BK, prec, fp8), num_warps=warps, num_stages=stages)
    return pair_out.view(T, top_k, H).sum(dim=1)
