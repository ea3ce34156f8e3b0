"""The router in Triton (``router.py`` says what it computes). Per block of ``BT`` token rows held as a
``[BT, E]`` tile: each logit becomes one integer key that orders as the logit does and holds ``BE-1-id`` in
its low bits (16-bit logits: an int32 key; fp32: int64), so each of the ``k`` top-k rounds is ONE row max
(the largest logit, among equal logits the lowest id; the winning key is then masked out). The k winners'
logits come back from their keys; the weights are ``exp(l - max) / sum(exp(x - max))`` (fp32; max = the
first winner's logit), renormalised over the k and cast. With a shared expert (``SHARED``: the logits'
column E is its gate logit, not routed) each row gets a (k+1)-th pair (expert E, weight sigmoid(logit) in
fp32, cast like the others) after the renormalisation, and the alignment counts E+1 experts.

Three launch shapes, all without a host read:
  - one row block with at most ``SMALL_PAIRS`` key slots (decode, T <= 8 at top-8): ONE program routes the
    rows and aligns the pairs from registers (``_router_small_kernel``: ranks and padded offsets by [F, F]
    comparisons instead of a sort and a histogram over all experts);
  - T <= FUSED_MAX_TOKENS: ONE program routes all rows block by block, then (after a barrier: the ids it
    stored are what it reads back) runs the alignment of ``align_triton.align_body`` on them;
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
from gdnserve.ops.moe.routing import Routing
from gdnserve.ops.tl_compat import cast

FUSED_MAX_TOKENS = 64
SMALL_PAIRS = 128                # key slots (BT * BK) of the one-program in-register alignment
SMALL_WARPS = (1, 2)             # its warps up to 16 key slots (T = 1 at top-8 + shared) / past 16; H200, T = 1:
                                 # 2.3 µs at 1 warp, 2.8 at 2, 3.1 at 8 (benchmarks/bench_decode_b1.py)
TILE = 4096                      # logits per row-block tile (BT * BE)


@triton.jit
def _keys(x, cols, BE: tl.constexpr, WIDE: tl.constexpr):
    """Logits (native dtype) -> keys ordered as the logits, ``BE-1-col`` in the low bits (+0 and -0 equal)."""
    if WIDE:
        b = x.to(tl.int32, bitcast=True)
        k = tl.where(b == -2147483648, 0, tl.where(b >= 0, b, b ^ 0x7FFFFFFF))      # -0 -> the key of +0
        return (k.to(tl.int64) << 32) | (BE - 1 - cols).to(tl.int64)[None, :]
    else:
        b = x.to(tl.int16, bitcast=True).to(tl.int32)
        k = tl.where(b == -32768, 0, tl.where(b >= 0, b, b ^ 0x7FFF))
        return (k << 16) | (BE - 1 - cols)[None, :]


@triton.jit
def _logit(key, DT: tl.constexpr, WIDE: tl.constexpr):
    """A key's logit in fp32 (the inverse of ``_keys``)."""
    if WIDE:
        k = (key >> 32).to(tl.int32)
        return tl.where(k >= 0, k, k ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
    else:
        k = key >> 16
        return tl.where(k >= 0, k, k ^ 0x7FFF).to(tl.int16).to(DT, bitcast=True).to(tl.float32)


@triton.jit
def _route_tile(logits, r0, T, E, stride_l, TOP_K: tl.constexpr, RENORM: tl.constexpr, BT: tl.constexpr,
                BE: tl.constexpr, BK: tl.constexpr, SHARED: tl.constexpr, WIDE: tl.constexpr):
    """Rows r0 .. r0+BT: (rows, row mask, weights [BT, BK] fp32, ids [BT, BK] int32; pairs k+SHARED..BK junk)."""
    rows = r0 + tl.arange(0, BT)
    cols = tl.arange(0, BE)
    rm = rows < T
    x = tl.load(logits + rows[:, None].to(tl.int64) * stride_l + cols[None, :],
                mask=rm[:, None] & (cols < E)[None, :], other=float("-inf"))
    x = tl.where(rm[:, None], x, tl.zeros_like(x))    # rows past T: finite (never stored)
    DT = logits.dtype.element_ty
    s = _keys(x, cols, BE, WIDE)
    if WIDE:
        LOW: tl.constexpr = -9223372036854775808             # below every key
    else:
        LOW: tl.constexpr = -2147483648
    kc = tl.arange(0, BK)
    m = tl.max(s, axis=1)                        # round 0: the row max is also the softmax's max
    mx = _logit(m, DT, WIDE)
    picks = tl.where(kc[None, :] == 0, m[:, None], tl.full([BT, BK], LOW, s.dtype))
    s = tl.where(s == m[:, None], LOW, s)        # keys are unique in a row: exactly the winner
    for j in tl.static_range(1, TOP_K):
        m = tl.max(s, axis=1)
        picks = tl.where(kc[None, :] == j, m[:, None], picks)
        s = tl.where(s == m[:, None], LOW, s)
    ik = (BE - 1 - (picks & 0xFFFF)).to(tl.int32)
    den = tl.sum(tl.exp(x.to(tl.float32) - mx[:, None]), axis=1)
    wk = tl.where(kc[None, :] < TOP_K, tl.exp(_logit(picks, DT, WIDE) - mx[:, None]) / den[:, None], 0.0)
    if RENORM:
        wk = wk / tl.sum(wk, axis=1)[:, None]
    if SHARED:                                   # pair TOP_K: the shared expert E, weight sigmoid(its logit)
        g = tl.load(logits + rows.to(tl.int64) * stride_l + E, mask=rm, other=0.0).to(tl.float32)
        wk = tl.where(kc[None, :] == TOP_K, tl.sigmoid(g)[:, None], wk)
        ik = tl.where(kc[None, :] == TOP_K, E, ik)
    return rows, rm, wk, ik


@triton.jit
def _route_rows(logits, weights, ids, r0, T, E, stride_l, TOP_K: tl.constexpr, RENORM: tl.constexpr,
                BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, SHARED: tl.constexpr, WIDE: tl.constexpr):
    rows, rm, wk, ik = _route_tile(logits, r0, T, E, stride_l, TOP_K, RENORM, BT, BE, BK, SHARED, WIDE)
    kc = tl.arange(0, BK)
    KO = TOP_K + SHARED
    dst = rows[:, None].to(tl.int64) * KO + kc[None, :]
    ok = rm[:, None] & (kc < KO)[None, :]
    tl.store(weights + dst, cast(wk, weights.dtype.element_ty), mask=ok)
    tl.store(ids + dst, ik, mask=ok)


@triton.jit
def _router_kernel(logits, weights, ids, T, E, stride_l, TOP_K: tl.constexpr, RENORM: tl.constexpr,
                   BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, SHARED: tl.constexpr, WIDE: tl.constexpr):
    _route_rows(logits, weights, ids, tl.program_id(0) * BT, T, E, stride_l, TOP_K, RENORM, BT, BE, BK, SHARED,
                WIDE)


@triton.jit
def _router_align_kernel(logits, weights, ids, rows, block_expert, T, stride_l, N, P, NB,
                         TOP_K: tl.constexpr, RENORM: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr,
                         BK: tl.constexpr, SHARED: tl.constexpr, WIDE: tl.constexpr, E: tl.constexpr,
                         BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
                         BLOCK_B: tl.constexpr):
    for r0 in range(0, T, BT):       # E counts the shared expert: the routed ones are E - SHARED
        _route_rows(logits, weights, ids, r0, T, E - SHARED, stride_l, TOP_K, RENORM, BT, BE, BK, SHARED, WIDE)
    tl.debug_barrier()           # the ids stored above are read back by every thread of the program
    align_body(ids, rows, block_expert, N, P, NB, E, BM, BLOCK_N, BLOCK_E, BLOCK_P, BLOCK_B)


@triton.jit
def _router_small_kernel(logits, weights, ids, rows, block_expert, T, stride_l, N, P, NB,
                         TOP_K: tl.constexpr, RENORM: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr,
                         BK: tl.constexpr, SHARED: tl.constexpr, WIDE: tl.constexpr, E: tl.constexpr,
                         BM: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_B: tl.constexpr):
    """T <= BT: route the one row block and align its pairs from registers (the alignment of ``align_body``,
    bit for bit). Flat slot f = row * BK + pair j holds pair q = row * KO + j (valid: row < T, j < KO); slots
    keep pair order, so a pair's rank among the pairs of its expert is a count of earlier equal slots."""
    KO: tl.constexpr = TOP_K + SHARED
    F: tl.constexpr = BT * BK
    r, rm, wk, ik = _route_tile(logits, 0, T, E - SHARED, stride_l, TOP_K, RENORM, BT, BE, BK, SHARED, WIDE)
    kc = tl.arange(0, BK)
    dst = r[:, None] * KO + kc[None, :]
    ok = rm[:, None] & (kc < KO)[None, :]
    tl.store(weights + dst, cast(wk, weights.dtype.element_ty), mask=ok)
    tl.store(ids + dst, ik, mask=ok)
    for p0 in range(0, P, BLOCK_P):          # padding rows and unused blocks first (a barrier before the scatter)
        p = p0 + tl.arange(0, BLOCK_P)
        tl.store(rows + p, tl.full((BLOCK_P,), 0, tl.int32) + N, mask=p < P)
    for b0 in range(0, NB, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        tl.store(block_expert + b, tl.full((BLOCK_B,), -1, tl.int32), mask=b < NB)
    q = tl.reshape(dst, [F])
    v = tl.reshape(ok, [F])
    e = tl.where(v, tl.reshape(ik, [F]), E)                   # sentinel E for empty slots
    f = tl.arange(0, F)
    same = (e[:, None] == e[None, :]) & v[None, :] & v[:, None]
    rank = tl.sum((same & (f[None, :] < f[:, None])).to(tl.int32), axis=1)
    cnt = tl.sum(same.to(tl.int32), axis=1)
    padded = tl.where(v & (rank == 0), (cnt + (BM - 1)) // BM * BM, 0)     # once per expert, at its first pair
    start = tl.sum(tl.where(e[None, :] < e[:, None], padded[None, :], 0), axis=1)
    dest = start + rank
    tl.debug_barrier()
    tl.store(rows + dest, q.to(tl.int32), mask=v)
    tl.store(block_expert + dest // BM, e, mask=v)     # every used block holds a pair: its expert


def route_triton(logits: torch.Tensor, top_k: int, renormalize: bool, shared: bool = False,
                 small_warps: int | None = None) -> Routing:
    """``router.route`` on the Triton path; ``shared``: the logits' last column is the shared expert's gate.
    ``small_warps``: the one-program in-register path's warps (default ``SMALL_WARPS``; benchmarks' sweep)."""
    T, EL = logits.shape
    dev = logits.device
    E, KO = EL - shared, top_k + shared          # routed experts; pairs per token
    EA = E + shared                              # experts of the alignment (the shared one is expert E)
    N = T * KO
    wide = logits.dtype == torch.float32
    weights = torch.empty(T, KO, dtype=logits.dtype, device=dev)
    ids = torch.empty(T, KO, dtype=torch.int32, device=dev)
    BM = block_rows(N, EA)
    BE = max(pow2(E), 16)
    BK = max(pow2(KO), 2)
    BT = max(1, min(pow2(max(T, 1)), TILE // BE))
    if T == 0:
        return Routing(weights, ids, align_pairs(ids, EA, BM))
    if T <= BT and BT * BK <= SMALL_PAIRS:
        P = padded_rows(N, EA, BM)
        rows = torch.empty(P, dtype=torch.int32, device=dev)
        block_expert = torch.empty(P // BM, dtype=torch.int32, device=dev)
        launch(_router_small_kernel, (1,), (logits, weights, ids, rows, block_expert, T, logits.stride(0), N, P,
                                            P // BM, top_k, renormalize, BT, BE, BK, shared, wide, EA, BM,
                                            min(pow2(P), 1024), min(pow2(P // BM), 256)),
               num_warps=small_warps or (SMALL_WARPS[0] if BT * BK <= 16 else SMALL_WARPS[1]))
        return Routing(weights, ids, Alignment(rows, block_expert, BM))
    if T <= FUSED_MAX_TOKENS and N <= MAX_PAIRS:
        P = padded_rows(N, EA, BM)
        rows = torch.empty(P, dtype=torch.int32, device=dev)
        block_expert = torch.empty(P // BM, dtype=torch.int32, device=dev)
        launch(_router_align_kernel, (1,), (logits, weights, ids, rows, block_expert, T, logits.stride(0), N, P,
                                            P // BM, top_k, renormalize, BT, BE, BK, shared, wide,
                                            *align_constexprs(N, EA, BM)),
               num_warps=8)
        return Routing(weights, ids, Alignment(rows, block_expert, BM))
    launch(_router_kernel, (cdiv(T, BT),), (logits, weights, ids, T, E, logits.stride(0), top_k, renormalize,
                                            BT, BE, BK, shared, wide), num_warps=4)
    al = align_pairs_triton(ids, EA, BM)
    return Routing(weights, ids, al)
