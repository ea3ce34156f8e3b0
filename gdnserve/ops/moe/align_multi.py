"""The alignment of ``align.py`` for any number of pairs, in two multi-program Triton launches and no sort:
counts -> offsets -> scatter. Used above ``align_triton.MAX_PAIRS`` pairs, where the one-program kernel's
register sort ends and ``align.align_pairs`` would take ~10 torch ops (two cub radix sorts among them:
130-175 µs per MoE layer of a 4096-token step on an H200).

The N pairs (flattened [T, k], pair = token * k + j) are cut into S segments of ``SEG`` pairs. Grid (E, S):

  1. count:    program (e, s) counts expert e's pairs in segment s -> counts[s, e] (every entry written:
               no memset);
  2. scatter:  program (e, s) reads the whole [S, E] table, takes expert e's padded start (the padded
               per-expert totals of the experts before e) plus the counts of e in the segments before s, and
               walks its segment in blocks: the pairs holding e, ranked by a cumsum of the match mask, go to
               consecutive rows in pair order (so within an expert the pairs keep token order, as the stable
               sort of ``align_pairs`` leaves them). Program (e, 0) also writes the padding rows of e's run
               (< BM rows of N) and e's row blocks' expert; one extra program (E, 0) fills the rows and blocks
               past the last run (rows N, blocks -1).

Every row and block is written exactly once, by one program, so there is no ordering between programs and the
result equals ``align_pairs``' bit for bit. No host read: the grid and S come from shapes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdnserve.ops.launch import cdiv, launch, pow2
from gdnserve.ops.moe.align import Alignment, padded_rows

BLOCK = 4096          # pairs per scan step of one program
MAX_SEGMENTS = 16     # S <= this: the scatter programs read an [S, E] count table


@triton.jit
def _align_count_kernel(experts, counts, N, SEG, E, BLOCK: tl.constexpr):
    e = tl.program_id(0)
    s = tl.program_id(1)
    lo = s * SEG
    hi = tl.minimum(lo + SEG, N)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i0 in range(lo, hi, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        x = tl.load(experts + i, mask=i < hi, other=-1).to(tl.int32)
        acc += (x == e).to(tl.int32)
    tl.store(counts + s * E + e, tl.sum(acc, 0))


@triton.jit
def _align_scatter_kernel(experts, counts, rows, block_expert, N, P, NB, SEG, S, E, BM: tl.constexpr,
                    BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_F: tl.constexpr):
    e = tl.program_id(0)
    s = tl.program_id(1)
    ss = tl.arange(0, BLOCK_S)
    ee = tl.arange(0, BLOCK_E)
    c = tl.load(counts + ss[:, None] * E + ee[None, :], mask=(ss < S)[:, None] & (ee < E)[None, :], other=0)
    tot = tl.sum(c, axis=0)                                       # [BLOCK_E] pairs per expert
    padded = (tot + (BM - 1)) // BM * BM
    start = tl.sum(tl.where(ee < e, padded, 0), 0)                # e's first padded row (E: the end of all runs)
    if e == E:                                                    # the rows and blocks past the last run
        if s == 0:
            for p0 in range(start, P, BLOCK_F):
                p = p0 + tl.arange(0, BLOCK_F)
                tl.store(rows + p, tl.full([BLOCK_F], 0, tl.int32) + N, mask=p < P)
            for b0 in range(start // BM, NB, BLOCK_F):
                b = b0 + tl.arange(0, BLOCK_F)
                tl.store(block_expert + b, tl.full([BLOCK_F], -1, tl.int32), mask=b < NB)
    else:
        mine = (ee == e)[None, :]
        run = start + tl.sum(tl.sum(tl.where(mine & (ss < s)[:, None], c, 0), axis=1), 0)
        lo = s * SEG
        hi = tl.minimum(lo + SEG, N)
        for i0 in range(lo, hi, BLOCK):
            i = i0 + tl.arange(0, BLOCK)
            m = (tl.load(experts + i, mask=i < hi, other=-1).to(tl.int32) == e).to(tl.int32)
            tl.store(rows + run + tl.cumsum(m, 0) - 1, i, mask=m != 0)
            run += tl.sum(m, 0)
        if s == 0:
            cnt = tl.sum(tl.where(ee == e, tot, 0), 0)
            pe = tl.sum(tl.where(ee == e, padded, 0), 0)
            q = tl.arange(0, BM)
            tl.store(rows + start + cnt + q, tl.full([BM], 0, tl.int32) + N, mask=q < pe - cnt)
            for b0 in range(start // BM, (start + pe) // BM, BLOCK_F):
                b = b0 + tl.arange(0, BLOCK_F)
                tl.store(block_expert + b, tl.full([BLOCK_F], 0, tl.int32) + e, mask=b < (start + pe) // BM)


def segments(N: int, block: int = BLOCK) -> tuple[int, int]:
    """(SEG, S): segments of a multiple of ``block`` pairs (at least two blocks), at most MAX_SEGMENTS of
    them (shapes only)."""
    seg = max(2 * block, cdiv(cdiv(N, MAX_SEGMENTS), block) * block)
    return seg, max(1, cdiv(N, seg))


def align_pairs_multi(experts: torch.Tensor, num_experts: int, BM: int, block: int = BLOCK) -> Alignment:
    """experts [T, k] int (any count) -> the Alignment ``align.align_pairs`` returns, bit for bit. ``block``:
    pairs per scan step (a power of two; tests shrink it to reach several segments at small sizes)."""
    dev = experts.device
    flat = experts.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    N, E = flat.numel(), num_experts
    P = padded_rows(N, E, BM)
    rows = torch.empty(P, dtype=torch.int32, device=dev)
    block_expert = torch.empty(P // BM, dtype=torch.int32, device=dev)
    if N == 0:
        return Alignment(rows, block_expert, BM)
    SEG, S = segments(N, block)
    counts = torch.empty(S * E, dtype=torch.int32, device=dev)
    launch(_align_count_kernel, (E, S), (flat, counts, N, SEG, E, block), num_warps=4)
    launch(_align_scatter_kernel, (E + 1, S), (flat, counts, rows, block_expert, N, P, P // BM, SEG, S, E, BM, block,
                                         max(pow2(S), 2), max(pow2(E), 16), 1024), num_warps=4)
    return Alignment(rows, block_expert, BM)
