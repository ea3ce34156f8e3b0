"""The k-sum of the routed experts (Triton): each token's k pair outputs summed in fp32, rounded once.

``combine``: after the block down GEMM, pair_out [T*k, H] is token-major (pair = token * k + j), so a program
reads its token's k contiguous rows of one H tile. ``down_combine``: for decode-sized batches the down GEMM and
the k-sum in one kernel — a program per (token, H tile) runs the token's k GEMVs (inter row of the pair's
padded row ``pos``, the expert of that row's block), rounds each pair output to the activation dtype as the
block kernel does, and sums them: one launch and no [T*k, H] round trip. Neither uses atomics: a token's sum
runs in a fixed order (j = 0..k-1) over its own pairs only.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from gdnserve.ops.launch import cdiv, launch, pow2
from gdnserve.ops.tl_compat import cast

if TYPE_CHECKING:
    from gdnserve.ops.moe.align import Alignment
    from gdnserve.ops.moe.grouped_triton import Tiles


@triton.jit
def _combine_kernel(pair_out, out, H, TOP_K: tl.constexpr, BH: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BH + tl.arange(0, BH)
    ok = offs < H
    acc = tl.zeros((BH,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(pair_out + (t * TOP_K + j) * H + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out + t * H + offs, cast(acc, out.dtype.element_ty), mask=ok)


@triton.jit
def _down_combine_kernel(inter, w, pos, block_expert, pair_w, out, H, I,
                         TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = offs_n < H
    offs_k = tl.arange(0, BK)
    total = tl.zeros((BN,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):          # unrolled: the k pairs' loads can be in flight together
        p = t * TOP_K + j
        row = tl.load(pos + p).to(tl.int64)
        e = tl.load(block_expert + row // BM).to(tl.int64)
        w_e = w + e * H * I + offs_n[:, None].to(tl.int64) * I
        acc = tl.zeros((BN, BK), dtype=tl.float32)
        for k0 in range(0, I, BK):
            kk = k0 + offs_k
            k_ok = kk < I
            a = tl.load(inter + row * I + kk, mask=k_ok, other=0.0).to(tl.float32)
            b = tl.load(w_e + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc += b * a[None, :]
        y = tl.sum(acc, axis=1) * tl.load(pair_w + p).to(tl.float32)
        total += cast(y, out.dtype.element_ty).to(tl.float32)
    tl.store(out + t * H + offs_n, cast(total, out.dtype.element_ty), mask=n_ok)


def combine(pair_out: torch.Tensor, T: int, top_k: int, block: int = 1024) -> torch.Tensor:
    """pair_out [T*k, H] -> [T, H]: out[t] = sum_j pair_out[t*k + j]."""
    H = pair_out.shape[1]
    out = torch.empty(T, H, dtype=pair_out.dtype, device=pair_out.device)
    BH = min(block, pow2(H))
    launch(_combine_kernel, (T, cdiv(H, BH)), (pair_out, out, H, top_k, BH), num_warps=4)
    return out


def down_combine(inter: torch.Tensor, al: Alignment, pos: torch.Tensor, w_down: torch.Tensor,
                 pair_w: torch.Tensor, T: int, top_k: int, t: Tiles) -> torch.Tensor:
    """inter [P, I] (gate_up's), pos [T*k] (each pair's padded row) -> [T, H]."""
    H, I = w_down.shape[1], w_down.shape[2]
    out = torch.empty(T, H, dtype=inter.dtype, device=inter.device)
    launch(_down_combine_kernel, (T, cdiv(H, t.BN)),
           (inter, w_down, pos, al.block_expert, pair_w, out, H, I, top_k, al.BM, t.BN, min(t.BK, pow2(I))),
           num_warps=t.warps, num_stages=t.stages)
    return out
