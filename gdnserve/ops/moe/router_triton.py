"""The router in Triton (``router.py`` says what it computes). Per block of ``BT`` token rows held as a
``[BT, E]`` tile: fp32 softmax (max, exp, sum, divide), then ``k`` rounds of (row max of the remaining
logits, lowest id holding it, its probability, mask it out), the k weights renormalised and cast. With a
shared expert (``SHARED``: the logits' column E is its gate logit, not routed) each row gets a (k+1)-th pair
(expert E, weight sigmoid(logit) in fp32, cast like the others) after the renormalisation, and the alignment
counts E+1 experts.

Two launch shapes, both without a host read:
  - T <= FUSED_MAX_TOKENS (decode): ONE program routes all rows block by block, then (after a barrier: the
    ids it stored are what it reads back) runs the alignment of ``align_triton.align_body`` on them;
  - larger T: one program per row block, then the alignment's own launches (``align_pairs_triton``: one
    program, or the multi-program count + scatter past its size limit), as ``ops.moe.moe_experts`` aligns.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdnserve.ops.launch import cdiv, launch, pow2
from gdnserve.ops.moe.align import Alignment, align_pairs, padded_rows
from gdnserve.ops.moe.align_triton import MAX_PAIRS, align_body, align_constexprs, align_pairs_triton
from gdnserve.ops.moe.grouped_triton import block_rows
from gdnserve.ops.moe.router import Routing
from gdnserve.ops.tl_compat import cast

FUSED_MAX_TOKENS = 64
TILE = 4096                      # logits per row-block tile (BT * BE)


@triton.jit
def _route_rows(logits, weights, ids, r0, T, E, stride_l, TOP_K: tl.constexpr, RENORM: tl.constexpr,
                BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, SHARED: tl.constexpr):
    rows = r0 + tl.arange(0, BT)
    cols = tl.arange(0, BE)
    rm = rows < T
    x = tl.load(logits + rows[:, None].to(tl.int64) * stride_l + cols[None, :],
                mask=rm[:, None] & (cols < E)[None, :], other=float("-inf")).to(tl.float32)
    x = tl.where(rm[:, None], x, 0.0)            # rows past T: finite (never stored)
    mx = tl.max(x, axis=1)
    e = tl.exp(x - mx[:, None])
    p = e / tl.sum(e, axis=1)[:, None]
    kc = tl.arange(0, BK)
    wk = tl.zeros([BT, BK], dtype=tl.float32)
    ik = tl.zeros([BT, BK], dtype=tl.int32)
    sel = x
    for j in tl.static_range(TOP_K):
        m = tl.max(sel, axis=1)
        idx = tl.min(tl.where(sel == m[:, None], cols[None, :], BE), axis=1)
        hit = cols[None, :] == idx[:, None]
        pj = tl.sum(tl.where(hit, p, 0.0), axis=1)
        wk = tl.where(kc[None, :] == j, pj[:, None], wk)
        ik = tl.where(kc[None, :] == j, idx[:, None], ik)
        sel = tl.where(hit, float("-inf"), sel)
    if RENORM:
        wk = wk / tl.sum(wk, axis=1)[:, None]
    if SHARED:                                   # pair TOP_K: the shared expert E, weight sigmoid(its logit)
        g = tl.load(logits + rows.to(tl.int64) * stride_l + E, mask=rm, other=0.0).to(tl.float32)
        wk = tl.where(kc[None, :] == TOP_K, tl.sigmoid(g)[:, None], wk)
        ik = tl.where(kc[None, :] == TOP_K, E, ik)
    KO = TOP_K + SHARED
    dst = rows[:, None].to(tl.int64) * KO + kc[None, :]
    ok = rm[:, None] & (kc < KO)[None, :]
    tl.store(weights + dst, cast(wk, weights.dtype.element_ty), mask=ok)
    tl.store(ids + dst, ik, mask=ok)


@triton.jit
def _router_kernel(logits, weights, ids, T, E, stride_l, TOP_K: tl.constexpr, RENORM: tl.constexpr,
                   BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, SHARED: tl.constexpr):
    _route_rows(logits, weights, ids, tl.program_id(0) * BT, T, E, stride_l, TOP_K, RENORM, BT, BE, BK, SHARED)


@triton.jit
def _router_align_kernel(logits, weights, ids, rows, block_expert, T, stride_l, N, P, NB,
                         TOP_K: tl.constexpr, RENORM: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr,
                         BK: tl.constexpr, SHARED: tl.constexpr, E: tl.constexpr, BM: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_B: tl.constexpr):
    for r0 in range(0, T, BT):       # E counts the shared expert: the routed ones are E - SHARED
        _route_rows(logits, weights, ids, r0, T, E - SHARED, stride_l, TOP_K, RENORM, BT, BE, BK, SHARED)
    tl.debug_barrier()           # the ids stored above are read back by every thread of the program
    align_body(ids, rows, block_expert, N, P, NB, E, BM, BLOCK_N, BLOCK_E, BLOCK_P, BLOCK_B)


def route_triton(logits: torch.Tensor, top_k: int, renormalize: bool, shared: bool = False) -> Routing:
    """``router.route`` on the Triton path; ``shared``: the logits' last column is the shared expert's gate."""
    T, EL = logits.shape
    dev = logits.device
    E, KO = EL - shared, top_k + shared          # routed experts; pairs per token
    EA = E + shared                              # experts of the alignment (the shared one is expert E)
    N = T * KO
    weights = torch.empty(T, KO, dtype=logits.dtype, device=dev)
    ids = torch.empty(T, KO, dtype=torch.int32, device=dev)
    BM = block_rows(N, EA)
    BE = max(pow2(E), 16)
    BK = max(pow2(KO), 2)
    BT = max(1, min(pow2(max(T, 1)), TILE // BE))
    if T == 0:
        return Routing(weights, ids, align_pairs(ids, EA, BM))
    if T <= FUSED_MAX_TOKENS and N <= MAX_PAIRS:
        P = padded_rows(N, EA, BM)
        rows = torch.empty(P, dtype=torch.int32, device=dev)
        block_expert = torch.empty(P // BM, dtype=torch.int32, device=dev)
        launch(_router_align_kernel, (1,), (logits, weights, ids, rows, block_expert, T, logits.stride(0), N, P,
                                            P // BM, top_k, renormalize, BT, BE, BK, shared,
                                            *align_constexprs(N, EA, BM)),
               num_warps=8)
        return Routing(weights, ids, Alignment(rows, block_expert, BM))
    launch(_router_kernel, (cdiv(T, BT),), (logits, weights, ids, T, E, logits.stride(0), top_k, renormalize,
                                            BT, BE, BK, shared), num_warps=4)
    al = align_pairs_triton(ids, EA, BM)
    return Routing(weights, ids, al)
