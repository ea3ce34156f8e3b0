"""The bf16 grouped GEMM's two kernels with the weight tiles (and the down kernel's intermediate tiles) read
through TMA tensor descriptors (``tl.make_tensor_descriptor``, built on the device: no host-side descriptor,
nothing new to capture in a CUDA graph), for the prefill-sized row blocks. Same products, same order of the
K sum and same roundings as ``grouped_triton``'s pointer kernels (``Tiles.tma`` picks these).

  gate_up: the gathered x rows by pointer (TMA has no row gather on sm90), the gate and up tiles [BN, BK] of
           expert e by descriptor over w viewed [E*2I, H]: rows e*2I + n (gate) and e*2I + I + n (up); or
           (``one_dot``) both as one [2, BN, BK] box of w viewed [E*2, I, H] and one MMA of width 2 BN.
  down:    the sorted intermediate rows [BM, BK] by descriptor over inter [P, I] (a row block is contiguous),
           the weight tile [BN, BK] over w viewed [E*H, I]: rows e*H + n.

A tile that runs past its expert's rows reads the next expert's rows (or zeros past the end): those columns
are masked at the store, like the pointer kernels' masked loads; columns past H / I (the K tail) read zeros.
The padding rows of ``inter`` are unwritten memory: rows of a product are independent, so what they hold
only reaches the padding rows' results, which are never stored.

Device descriptors need a global scratch allocation per launch (``triton.set_allocator``): ``_scratch``
takes it from PyTorch's caching allocator on the launch's stream (graph capture: the graph's pool).
Requirements (``usable``): 16-byte aligned bases and row strides. Kernel names keep the pointer kernels' stems
(``benchmarks/profile_steps.py`` files them under experts by name).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdnserve.ops.launch import cdiv, launch
from gdnserve.ops.moe.tile_triton import _tile
from gdnserve.ops.tl_compat import INTERPRET, cast, mma


@triton.jit
def _gate_up_kernel_tma(x, w, rows, block_expert, inter, N, H, I, NW, stride_x,
                        TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        PREC: tl.constexpr, N_FAST: tl.constexpr):
    pid_m, pid_n, offs_m, offs_n, n_ok, offs_k = _tile(I, tl.cdiv(I, BN), BM, BN, BK, N_FAST)
    e = tl.load(block_expert + pid_m)
    if e >= 0:
        r = tl.load(rows + offs_m)
        valid = r < N
        tok = (r // TOP_K).to(tl.int64)
        wd = tl.make_tensor_descriptor(w, shape=[NW, H], strides=[H, 1], block_shape=[BN, BK])
        row_g = e * (2 * I) + pid_n * BN
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, H, BK):
            kk = k0 + offs_k
            a = tl.load(x + tok[:, None] * stride_x + kk[None, :], mask=valid[:, None] & (kk < H)[None, :],
                        other=0.0)
            bg = wd.load([row_g, k0])
            bu = wd.load([row_g + I, k0])
            acc_g += mma(a, bg.T, PREC)
            acc_u += mma(a, bu.T, PREC)
        h = acc_g * tl.sigmoid(acc_g) * acc_u
        dst = inter + offs_m[:, None].to(tl.int64) * I + offs_n[None, :]
        tl.store(dst, cast(h, inter.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _gate_up_one_dot_kernel_tma(x, w, rows, block_expert, inter, N, H, I, NE2, stride_x,
                                TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                                PREC: tl.constexpr, N_FAST: tl.constexpr):
    """gate and up as one [BM, BK] x [BK, 2 BN] product per K step: one 3-D descriptor over w viewed
    [E*2, I, H] loads the gate and the up tile of these BN columns as one [2, BN, BK] box."""
    pid_m, pid_n, offs_m, offs_n, n_ok, offs_k = _tile(I, tl.cdiv(I, BN), BM, BN, BK, N_FAST)
    e = tl.load(block_expert + pid_m)
    if e >= 0:
        r = tl.load(rows + offs_m)
        valid = r < N
        tok = (r // TOP_K).to(tl.int64)
        wd = tl.make_tensor_descriptor(w, shape=[NE2, I, H], strides=[I * H, H, 1], block_shape=[2, BN, BK])
        acc = tl.zeros((BM, 2 * BN), dtype=tl.float32)
        for k0 in range(0, H, BK):
            kk = k0 + offs_k
            a = tl.load(x + tok[:, None] * stride_x + kk[None, :], mask=valid[:, None] & (kk < H)[None, :],
                        other=0.0)
            b = tl.reshape(wd.load([2 * e, pid_n * BN, k0]), (2 * BN, BK))     # rows: gate BN, then up BN
            acc += mma(a, b.T, PREC)
        g, u = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN)), (0, 2, 1)))
        h = g * tl.sigmoid(g) * u
        dst = inter + offs_m[:, None].to(tl.int64) * I + offs_n[None, :]
        tl.store(dst, cast(h, inter.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel_tma(inter, w, rows, block_expert, pair_w, out, N, H, I, P, NW,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                     N_FAST: tl.constexpr):
    pid_m, pid_n, offs_m, offs_n, n_ok, offs_k = _tile(H, tl.cdiv(H, BN), BM, BN, BK, N_FAST)
    e = tl.load(block_expert + pid_m)
    if e >= 0:
        r = tl.load(rows + offs_m)
        valid = r < N
        ad = tl.make_tensor_descriptor(inter, shape=[P, I], strides=[I, 1], block_shape=[BM, BK])
        wd = tl.make_tensor_descriptor(w, shape=[NW, I], strides=[I, 1], block_shape=[BN, BK])
        row_w = e * H + pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, I, BK):
            a = ad.load([pid_m * BM, k0])
            if INTERPRET:   # padding rows are unwritten memory (never stored): keep numpy's overflow warnings out
                a = tl.where(valid[:, None], a, 0.0)
            b = wd.load([row_w, k0])
            acc += mma(a, b.T, PREC)
        pw = tl.load(pair_w + r, mask=valid, other=0.0).to(tl.float32)
        y = acc * pw[:, None]
        dst = out + r[:, None].to(tl.int64) * H + offs_n[None, :]
        tl.store(dst, cast(y, out.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def usable(*ts: torch.Tensor) -> bool:
    """Whether the descriptors' alignment rules hold for the tensors read by descriptor: 16-byte aligned bases
    and row strides (bf16: H and I multiples of 8); else the pointer kernels run."""
    return all(t.data_ptr() % 16 == 0 and (t.stride(-2) * t.element_size()) % 16 == 0 for t in ts)


def gate_up_tma(x, al, w_gate_up, top_k, t, prec: str) -> torch.Tensor:
    H = x.shape[1]
    I = w_gate_up.shape[1] // 2
    N, P, BM = x.shape[0] * top_k, al.rows.numel(), al.BM
    inter = torch.empty(P, I, dtype=x.dtype, device=x.device)
    triton.set_allocator(_scratch)
    if t.one_dot:
        launch(_gate_up_one_dot_kernel_tma, ((P // BM) * cdiv(I, t.BN),),
               (x, w_gate_up, al.rows, al.block_expert, inter, N, H, I, w_gate_up.shape[0] * 2, x.stride(0),
                top_k, BM, t.BN, t.BK, prec, t.n_fast), num_warps=t.warps, num_stages=t.stages)
        return inter
    launch(_gate_up_kernel_tma, ((P // BM) * cdiv(I, t.BN),),
           (x, w_gate_up, al.rows, al.block_expert, inter, N, H, I, w_gate_up.shape[0] * 2 * I, x.stride(0),
            top_k, BM, t.BN, t.BK, prec, t.n_fast), num_warps=t.warps, num_stages=t.stages)
    return inter


def down_tma(inter, al, w_down, pair_w, N, t, prec: str) -> torch.Tensor:
    H, I = w_down.shape[1], w_down.shape[2]
    P, BM = al.rows.numel(), al.BM
    out = torch.empty(N, H, dtype=inter.dtype, device=inter.device)
    triton.set_allocator(_scratch)
    launch(_down_kernel_tma, ((P // BM) * cdiv(H, t.BN),),
           (inter, w_down, al.rows, al.block_expert, pair_w, out, N, H, I, P, w_down.shape[0] * H,
            BM, t.BN, t.BK, prec, t.n_fast), num_warps=t.warps, num_stages=t.stages)
    return out
