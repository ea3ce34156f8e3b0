"""Triton kernels for the recurrent gated delta rule over a slot-indexed SSM pool (decode, verify,
pending-token replay) and the commit copy of verify's intermediate states. Contracts and shapes are
documented on the public functions in ``recurrent.py``; the launchers here do no validation.

One program owns (V-tile, value head j, request n): a ``[BV, BK]`` fp32 tile of ``S^T`` (pool
layout ``[S, HV, V, K]``, K contiguous) that stays in registers for the whole call, so a call reads
the state once and writes it at most once per target. This file's kernel goes token by token (two
reductions along K per token, inside the tile); ``recurrent_chunk_triton.py`` takes the calls without
per-token scratch states and with 2..16 positions per request as one WY-form chunk, when asked
(``chunked=True``; slower on the H200 today, see CHUNKED_DEFAULT). ``recurrent_plan`` picks the kernel and builds the launch (also for ``ops/launch.Prepared``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from gdnserve.ops.gdn.recurrent_chunk_triton import gdn_recurrent_chunk_kernel
from gdnserve.ops.gdn.recurrent_jit import _STRIDES, _decay, _delta_step, _l2norm
from gdnserve.ops.launch import cdiv, launch, pow2
from gdnserve.ops.tl_compat import cast

MAX_GRID_Z = 65535  # CUDA grid limit of the request axis


@triton.jit(do_not_specialize=_STRIDES)
def gdn_recurrent_fwd_kernel(
    q, k, v, a, b, A_log, dt_bias, o, pool, slots,
    scratch, scratch_rows,
    pk, pv, pa, pb, pending_in_rows, num_pending, pending_out_rows,
    scale,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_at, s_bt, s_ot, s_oh,
    L: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    LS: tl.constexpr, LP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_SCRATCH: tl.constexpr, PENDING_IN: tl.constexpr, PENDING_OUT: tl.constexpr,
    WRITE_AFTER_PENDING: tl.constexpr, WRITE_FINAL: tl.constexpr, EVICT: tl.constexpr,
):
    i_v, i_hv, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < K
    mask_v = o_v < V
    mask_h = mask_v[:, None] & mask_k[None, :]
    bos = i_n.to(tl.int64) * L
    p_o = o + bos * s_ot + i_hv * s_oh + o_v

    slot = tl.load(slots + i_n).to(tl.int64)
    if slot < 0:  # padding row: zero outputs, touch nothing else
        for t in tl.static_range(L):
            tl.store(p_o + t * s_ot, tl.zeros([BV], dtype=o.dtype.element_ty), mask=mask_v)
        return

    # within one slot offsets fit int32; the slot stride (HV*V*K) times the slot id may not
    o_h = i_hv * (V * K) + o_v[:, None] * K + o_k[None, :]
    p_h = pool + slot * (HV * V * K) + o_h
    b_h = tl.load(p_h, mask=mask_h, other=0, eviction_policy=EVICT).to(tl.float32)
    b_A = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    b_dt = tl.load(dt_bias + i_hv).to(tl.float32)

    if PENDING_IN:
        # replay the accepted tokens of the previous verify (outputs discarded)
        i_pin = tl.load(pending_in_rows + i_n)
        n_pend = tl.where(i_pin >= 0, tl.load(num_pending + i_n), 0)
        # Unrolled over the LP pending rows with predicated loads, not a loop over n_pend: every load is
        # independent of the state, so all of them can be in flight before the first update (a runtime
        # loop serialises load latency per token). The update of a row past n_pend is branched around
        # (n_pend is uniform over the program).
        for t in tl.static_range(LP):
            live = t < n_pend
            i_pt = i_pin.to(tl.int64) * LP + t
            b_k = tl.load(pk + (i_pt * H + i_h) * K + o_k, mask=(mask_k & live) != 0, other=0).to(tl.float32)
            b_v = tl.load(pv + (i_pt * HV + i_hv) * V + o_v, mask=(mask_v & live) != 0, other=0).to(tl.float32)
            b_g = _decay(tl.load(pa + i_pt * HV + i_hv, mask=live, other=0).to(tl.float32), b_dt, b_A)
            b_beta = tl.sigmoid(tl.load(pb + i_pt * HV + i_hv, mask=live, other=0).to(tl.float32))
            if live:
                b_h = _delta_step(b_h, _l2norm(b_k), b_v, b_g, b_beta)
        if WRITE_AFTER_PENDING:
            if n_pend > 0:  # nothing applied: the slot already holds this state bit for bit
                tl.store(p_h, cast(b_h, pool.dtype.element_ty), mask=mask_h)

    if HAS_SCRATCH:
        i_srow = tl.load(scratch_rows + i_n).to(tl.int64)
        p_s = scratch + i_srow * (LS * HV * V * K) + o_h
        mask_s = (mask_h & (i_srow >= 0)) != 0
    if PENDING_OUT:
        # raw-input copies: every program writes its own v tile; a/b go to the V-tile-0 program of
        # each value head and the k row (shared by r value heads) to the first head of the group
        i_pout = tl.load(pending_out_rows + i_n).to(tl.int64)
        own_v = i_pout >= 0
        own_ab = own_v & (i_v == 0)
        own_k = own_ab & (i_hv % (HV // H) == 0)

    for t in tl.static_range(L):  # L is small (decode 1, verify num_spec + 1): unrolled
        i_t = bos + t
        b_q = tl.load(q + i_t * s_qt + i_h * s_qh + o_k, mask=mask_k, other=0)
        b_kr = tl.load(k + i_t * s_kt + i_h * s_kh + o_k, mask=mask_k, other=0)
        b_vr = tl.load(v + i_t * s_vt + i_hv * s_vh + o_v, mask=mask_v, other=0)
        b_ar = tl.load(a + i_t * s_at + i_hv)
        b_br = tl.load(b + i_t * s_bt + i_hv)
        if PENDING_OUT:
            i_pt = i_pout * LP + t
            tl.store(pk + (i_pt * H + i_h) * K + o_k, b_kr, mask=(mask_k & own_k) != 0)
            tl.store(pv + (i_pt * HV + i_hv) * V + o_v, b_vr, mask=(mask_v & own_v) != 0)
            tl.store(pa + i_pt * HV + i_hv, b_ar, mask=own_ab)
            tl.store(pb + i_pt * HV + i_hv, b_br, mask=own_ab)
        b_g = _decay(b_ar.to(tl.float32), b_dt, b_A)
        b_beta = tl.sigmoid(b_br.to(tl.float32))
        b_h = _delta_step(b_h, _l2norm(b_kr.to(tl.float32)), b_vr.to(tl.float32), b_g, b_beta)
        b_q = _l2norm(b_q.to(tl.float32)) * scale
        b_o = tl.sum(b_h * b_q[None, :], 1)
        tl.store(p_o + t * s_ot, cast(b_o, o.dtype.element_ty), mask=mask_v)
        if HAS_SCRATCH:
            tl.store(p_s + t * (HV * V * K), cast(b_h, scratch.dtype.element_ty), mask=mask_s)

    if WRITE_FINAL:
        tl.store(p_h, cast(b_h, pool.dtype.element_ty), mask=mask_h)


def _tile(B: int, HV: int, K: int, V: int, positions: int = 1) -> tuple[int, int, int]:
    """Fixed (BK, BV, num_warps): the whole K row per tile. When the grid fills the GPU: 16 value rows on one
    warp for calls of several positions per request (replay verify: 612 vs 790 µs at B=256 L=4 + 3 pending on
    the H200), on two warps for one position (decode B=256: 272 vs 280 µs; benchmarks/results/ops_tiles_h200.md);
    16 rows and 2 warps for small batches (more programs, shorter latency chains). K > 128 halves the rows to
    keep the fp32 tile at <= 32 registers per thread."""
    BK = pow2(K)
    big = B * HV * cdiv(V, 32) >= 2048
    BV, nw = (16, 1 if positions > 1 else 2) if big else (16, 2)
    if BK > 128:
        BV //= 2
    return BK, min(BV, max(pow2(V), 8)), nw


def _ptr_key(t):  # the specialisation of a pointer argument (see ops/launch.py)
    return None if t is None else (t.dtype, t.data_ptr() % 16 == 0)


MAX_CHUNK_POSITIONS = 16   # pending + new tokens per request that the chunked kernel takes
CHUNK_PREC = "tf32x3"      # its state products: fp32-level error on tensor cores
# The chunked kernel is opt-in (chunked=True): on the H200 at B=256 L=4 replay it took 3,554 µs (best tile
# 1,783) against 801 µs token by token (benchmarks/results/ops_h200.md, code of commit e4ef857), so the default stays
# token by token until the chunked kernel wins.
CHUNKED_DEFAULT = False


def recurrent_plan(q, k, v, a, b, A_log, dt_bias, ssm_pool, slots, tokens_per_req, write_state,
                   scratch, scratch_rows, pending, pending_in_rows, num_pending, pending_out_rows,
                   scale, out, chunked=None, tile=None, prec=None, evict=""):
    """(kernel, grid, args, num_warps, key) of one recurrent call; arguments as ``recurrent.gdn_recurrent``,
    already validated (scale a float, out allocated). ``chunked``: None = the chunked (WY-form) kernel
    when ``chunked`` (or ``chunked=None`` and CHUNKED_DEFAULT), no per-token scratch states are asked for and a
    request has 2..16 positions (pending + new tokens), else the token-by-token kernel; ``tile`` = (BV, num_warps) and ``prec`` override the fixed
    configs, ``evict`` is the state load's eviction policy in the token-by-token kernel (benchmarks compare
    variants through these)."""
    B = slots.shape[0]
    _, HV, V, K = ssm_pool.shape
    H = k.shape[1]
    L = tokens_per_req
    if pending is None:
        pk = pv = pa = pb = None
        LP = 0
    else:
        pk, pv, pa, pb = pending.k, pending.v, pending.a, pending.b
        LP = pk.shape[1]
    P0 = LP if pending_in_rows is not None else 0
    BK, BV, nw = _tile(B, HV, K, V, P0 + L)
    if chunked is None:
        chunked = CHUNKED_DEFAULT and scratch is None and 2 <= P0 + L <= MAX_CHUNK_POSITIONS
    elif chunked and (scratch is not None or P0 + L > MAX_CHUNK_POSITIONS):
        raise ValueError("chunked: the chunked kernel writes no scratch states and takes <= "
                         f"{MAX_CHUNK_POSITIONS} positions per request")
    if tile is not None:
        BV, nw = tile
    strides = (*q.stride()[:2], *k.stride()[:2], *v.stride()[:2], a.stride(0), b.stride(0), *out.stride()[:2])
    if chunked:
        BK, BV = max(BK, 16), max(BV, 16)   # tl.dot operands are >= 16 wide
        NC = max(16, pow2(P0 + L))
        NF = max(1, (P0 + L - 1).bit_length())            # 2^NF >= P0 + L positions
        after = write_state == "after_pending" and pending_in_rows is not None
        PW = P0 if after else (P0 + L if write_state == "final" else 0)
        ptrs = (q, k, v, a, b, A_log, dt_bias, out, ssm_pool, slots,
                pk, pv, pa, pb, pending_in_rows, num_pending, pending_out_rows)
        consts = (L, H, HV, K, V, LP, P0, NC, NF, BK, BV, pending_in_rows is not None,
                  pending_out_rows is not None, PW, after, prec or CHUNK_PREC)
        fn = gdn_recurrent_chunk_kernel
    else:
        LS = 0 if scratch is None else scratch.shape[1]
        ptrs = (q, k, v, a, b, A_log, dt_bias, out, ssm_pool, slots, scratch, scratch_rows,
                pk, pv, pa, pb, pending_in_rows, num_pending, pending_out_rows)
        consts = (L, H, HV, K, V, LS, LP, BK, BV,
                  scratch is not None, pending_in_rows is not None, pending_out_rows is not None,
                  write_state == "after_pending", write_state == "final", evict)
        fn = gdn_recurrent_fwd_kernel
    grid = (cdiv(V, BV), HV, B)
    key = (max(strides) >> 31, *consts, *map(_ptr_key, ptrs))
    return fn, grid, (*ptrs, scale, *strides, *consts), nw, key


def gdn_recurrent_fwd(*args, **kw):
    """Launcher of the recurrent kernels (arguments as ``recurrent_plan``); returns ``out``."""
    fn, grid, targs, nw, key = recurrent_plan(*args, **kw)
    launch(fn, grid, targs, nw, key=key)
    return args[18]


@triton.jit
def gdn_commit_fwd_kernel(pool, scratch, scratch_rows, slots, num_accepted,
                          LS: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr):
    """pool[slot] = scratch[row, num_accepted - 1] for one request; N = HV*V*K elements."""
    i_b, i_n = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slots + i_n).to(tl.int64)
    n_acc = tl.load(num_accepted + i_n).to(tl.int64)
    i_row = tl.load(scratch_rows + i_n).to(tl.int64)
    if (slot < 0) | (n_acc < 1) | (i_row < 0):
        return
    o_x = i_b * BLOCK + tl.arange(0, BLOCK)
    mask = o_x < N
    b_x = tl.load(scratch + (i_row * LS + n_acc - 1) * N + o_x, mask=mask)
    tl.store(pool + slot * N + o_x, cast(b_x, pool.dtype.element_ty), mask=mask)


def gdn_commit_fwd(ssm_pool: torch.Tensor, scratch: torch.Tensor, scratch_rows: torch.Tensor,
                   slots: torch.Tensor, num_accepted: torch.Tensor) -> None:
    """Launcher of ``gdn_commit_fwd_kernel`` (validated arguments)."""
    _, HV, V, K = ssm_pool.shape
    N, BLOCK, LS = HV * V * K, 4096, scratch.shape[1]
    ptrs = (ssm_pool, scratch, scratch_rows, slots, num_accepted)
    key = (LS, N, *map(_ptr_key, ptrs))
    launch(gdn_commit_fwd_kernel, (cdiv(N, BLOCK), slots.shape[0], 1), (*ptrs, LS, N, BLOCK), 4, key=key)

