"""The alignment of ``align.py`` in one Triton launch (one program), for decode-sized steps: the ~10 small torch
ops of ``align_pairs`` cost ~47 µs per MoE layer on an H200 at T = 1, more than the expert GEMMs' weight reads.

One program: the (expert, pair) keys sorted in registers (so within an expert the pairs keep token order, as in
``align_pairs``), per-expert counts by histogram, padded offsets by cumsum, each pair's padded row by gather,
the padding rows filled first (a barrier orders the fill before the scatter), and each row block's expert as
the number of experts whose padded run ends at or before the block. Same outputs as ``align_pairs``, bit for
bit; used up to ``MAX_PAIRS`` pairs (the sort lives in one program's registers); ``align_pairs_triton`` hands
larger counts to the two multi-program launches of ``align_multi.py`` (same outputs, no sort).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdnserve.ops.launch import launch, pow2
from gdnserve.ops.moe.align import Alignment, padded_rows
from gdnserve.ops.moe.align_multi import align_pairs_multi

MAX_PAIRS = 4096


@triton.jit
def _align_kernel(experts, rows, block_expert, N, P, NB,
                  E: tl.constexpr, BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_P: tl.constexpr, BLOCK_B: tl.constexpr):
    align_body(experts, rows, block_expert, N, P, NB, E, BM, BLOCK_N, BLOCK_E, BLOCK_P, BLOCK_B)


@triton.jit
def align_body(experts, rows, block_expert, N, P, NB,
               E: tl.constexpr, BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
               BLOCK_P: tl.constexpr, BLOCK_B: tl.constexpr):
    """The whole alignment in the calling program (also the tail of the fused router, ops/moe/router_triton.py)."""
    i = tl.arange(0, BLOCK_N)
    e = tl.load(experts + i, mask=i < N, other=E).to(tl.int32)        # sentinel E: its own bin, sorts last
    eidx = tl.arange(0, BLOCK_E)
    real = eidx < E
    counts = tl.where(real, tl.histogram(e, BLOCK_E), 0)
    padded = (counts + (BM - 1)) // BM * BM
    pad_end = tl.cumsum(padded, 0)
    pad_start = pad_end - padded
    start = tl.cumsum(counts, 0) - counts
    skey = tl.sort(e * BLOCK_N + i, 0)                                 # by expert, then pair index
    se = skey // BLOCK_N
    dest = tl.gather(pad_start, se, 0) + i - tl.gather(start, se, 0)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        tl.store(rows + p, tl.full((BLOCK_P,), 0, tl.int32) + N, mask=p < P)
    tl.debug_barrier()
    tl.store(rows + dest, skey % BLOCK_N, mask=se < E)
    for b0 in range(0, NB, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        ended = (pad_end[None, :] <= (b * BM)[:, None]) & real[None, :]
        cnt = tl.sum(ended.to(tl.int32), axis=1)
        tl.store(block_expert + b, tl.where(cnt < E, cnt, -1), mask=b < NB)


def align_pairs_triton(experts: torch.Tensor, num_experts: int, BM: int) -> Alignment:
    """experts [T, k] int -> the Alignment ``align.align_pairs`` returns: one program up to MAX_PAIRS pairs,
    the multi-program count + scatter launches (``align_multi``) above."""
    N = experts.numel()
    if N > MAX_PAIRS:
        return align_pairs_multi(experts, num_experts, BM)
    P = padded_rows(N, num_experts, BM)
    rows = torch.empty(P, dtype=torch.int32, device=experts.device)
    block_expert = torch.empty(P // BM, dtype=torch.int32, device=experts.device)
    flat = experts.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    launch(_align_kernel, (1,), (flat, rows, block_expert, N, P, P // BM, *align_constexprs(N, num_experts, BM)),
           num_warps=8)
    return Alignment(rows, block_expert, BM)


def align_constexprs(N: int, num_experts: int, BM: int) -> tuple[int, int, int, int, int, int]:
    """(E, BM, BLOCK_N, BLOCK_E, BLOCK_P, BLOCK_B) of ``align_body`` for N pairs."""
    return num_experts, BM, max(pow2(N), 16), max(pow2(num_experts + 1), 16), 1024, 64
