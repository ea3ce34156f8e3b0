"""Causal depthwise conv1d over packed varlen prefill segments, history read from and written to a
slot-indexed conv pool (gdn_kernels.md §4.2).

Each sequence's history (the W-1 raw inputs before its first token) comes from, in order:
a same-call parent sequence (its last W-1 inputs, reaching into the parent's own source slot when
the parent is shorter than W-1), a pool slot, or zeros. Resolving a parent's history through token
offsets into ``x`` (§2.5 step 1) lets producer and consumers share one launch with no dependency.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from gdnserve.ops.backend import Backend, interpreting, resolve
from gdnserve.ops.checks import ACT_DTYPES, check_contiguous, check_index, check_tensor
from gdnserve.ops.launch import cdiv, launch, pow2
from gdnserve.ops.tl_compat import cast
from gdnserve.ops.varlen import CHUNK, VarlenMeta

ACTIVATIONS = ("silu", None)


@triton.jit
def conv_load_ext(x, conv_pool, pos, bos, L, hx_end, hlen, hsrc, o_d, mask_d, stride_x,
                  D: tl.constexpr, W: tl.constexpr):
    """Rows `pos` (relative to the sequence start, >= -(W-1)) of ext = history ++ x_seq, raw dtype.
    The history's last `hlen` rows are x rows ending before `hx_end` (a parent's tail); the rows
    before those are pool[hsrc] rows shifted by hlen, or zeros when hsrc < 0."""
    m_x = ((pos >= 0) & (pos < L)) | ((pos < 0) & (pos >= -hlen))
    row = tl.where(pos >= 0, bos + pos, hx_end + pos)
    # `!= 0`: a block predicate combined with a scalar one must stay boolean on every Triton (3.9's
    # interpreter keeps int32 data for block & scalar, which tl.load refuses as a mask).
    m_h = ((pos < -hlen) & (hsrc >= 0)) != 0
    p_x = x + row.to(tl.int64)[:, None] * stride_x + o_d[None, :]
    p_h = conv_pool + (hsrc.to(tl.int64) * (W - 1) + (W - 1 + hlen + pos))[:, None] * D + o_d[None, :]
    # One load through a per-row pointer select (both sources are contiguous along d).
    return tl.load(tl.where(m_x[:, None], p_x, p_h), mask=(m_x | m_h)[:, None] & mask_d[None, :], other=0.)


@triton.jit
def conv_load_row(x, conv_pool, pos, bos, hx_end, hlen, hsrc, o_d, mask_d, stride_x, D: tl.constexpr,
                  W: tl.constexpr):
    """Row `pos` (a scalar, >= -(W-1)) of ext = history ++ x_seq as fp32 [BD]: ``conv_load_ext`` for one row."""
    in_x = pos >= -hlen
    row = tl.where(pos >= 0, bos + pos, hx_end + pos)
    p_x = x + row.to(tl.int64) * stride_x + o_d
    p_h = conv_pool + (hsrc.to(tl.int64) * (W - 1) + (W - 1 + hlen + pos)) * D + o_d
    return tl.load(tl.where(in_x, p_x, p_h), mask=(mask_d & (in_x | (hsrc >= 0))) != 0, other=0.).to(tl.float32)


@triton.jit
def _sequence_history(cu_seqlens, src_slots, parents, i_n, W: tl.constexpr, HAS_PARENTS: tl.constexpr):
    """Sequence i_n's start and length, and where its W-1 history inputs come from, resolved once per program
    (branch-free; parents are one level deep): (bos, L, history slot, history rows taken from the parent's
    inputs of this call, the end of those rows in x)."""
    bos = tl.load(cu_seqlens + i_n)
    L = tl.load(cu_seqlens + i_n + 1) - bos
    hsrc = tl.load(src_slots + i_n)
    hlen = bos * 0
    hx_end = bos
    if HAS_PARENTS:
        i_p = tl.load(parents + i_n)
        i_pc = tl.maximum(i_p, 0)
        p_bos = tl.load(cu_seqlens + i_pc)
        p_eos = tl.load(cu_seqlens + i_pc + 1)
        hsrc = tl.where(i_p >= 0, tl.load(src_slots + i_pc), hsrc)
        hlen = tl.where(i_p >= 0, tl.minimum(p_eos - p_bos, W - 1), hlen)
        hx_end = tl.where(i_p >= 0, p_eos, hx_end)
    return bos, L, hsrc, hlen, hx_end


@triton.jit
def _write_history(x, conv_pool, dst_slots, i_n, bos, L, hx_end, hlen, hsrc, o_d, mask_d, stride_x,
                   D: tl.constexpr, W: tl.constexpr, BH: tl.constexpr):
    """The sequence's last W - 1 ext rows (its channels o_d) into pool slot dst_slots[i_n] (-1: none)."""
    i_dst = tl.load(dst_slots + i_n)
    if i_dst >= 0:
        o_h = tl.arange(0, BH)
        b_s = conv_load_ext(x, conv_pool, L - (W - 1) + o_h, bos, L, hx_end, hlen, hsrc, o_d, mask_d,
                            stride_x, D, W)
        # src == dst: every thread must have read the old history before any thread overwrites it.
        tl.debug_barrier()
        p_s = conv_pool + (i_dst.to(tl.int64) * (W - 1) + o_h)[:, None] * D + o_d[None, :]
        tl.store(p_s, b_s, mask=(o_h < W - 1)[:, None] & mask_d[None, :])


@triton.jit
def conv_prefill_tile_kernel(x, weight, conv_pool, y, cu_seqlens, chunk_indices, src_slots, dst_slots, parents,
                        stride_x, stride_w, stride_y, D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr,
                        BD: tl.constexpr, BH: tl.constexpr, HAS_PARENTS: tl.constexpr, SILU: tl.constexpr):
    """One program per (chunk row, BD channels): the W shifted [BT, BD] tiles of ext loaded one by one (each
    input read W times, mostly from cache). Cheap to interpret: what the CPU interpreter runs by default."""
    i_r, i_d = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_indices + i_r * 2)
    i_c = tl.load(chunk_indices + i_r * 2 + 1)
    if i_n < 0:  # sentinel row of a padded grid
        return
    bos, L, hsrc, hlen, hx_end = _sequence_history(cu_seqlens, src_slots, parents, i_n, W, HAS_PARENTS)

    o_t = i_c * BT + tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    mask_d = o_d < D
    b_acc = tl.zeros([BT, BD], dtype=tl.float32)
    for m in tl.static_range(W):
        b_w = tl.load(weight + o_d * stride_w + m, mask=mask_d, other=0.).to(tl.float32)
        b_e = conv_load_ext(x, conv_pool, o_t + (m - (W - 1)), bos, L, hx_end, hlen, hsrc, o_d, mask_d,
                            stride_x, D, W)
        b_acc += b_e.to(tl.float32) * b_w[None, :]
    if SILU:
        b_acc = b_acc * tl.sigmoid(b_acc)
    p_y = y + (bos + o_t).to(tl.int64)[:, None] * stride_y + o_d[None, :]
    tl.store(p_y, cast(b_acc, y.dtype.element_ty), mask=(o_t < L)[:, None] & mask_d[None, :])

    # Only the chunk-0 program writes the new history, so a zero-length sequence still copies src -> dst.
    if i_c == 0:
        _write_history(x, conv_pool, dst_slots, i_n, bos, L, hx_end, hlen, hsrc, o_d, mask_d, stride_x, D, W, BH)


@triton.jit
def conv_prefill_rows_kernel(x, weight, conv_pool, y, cu_seqlens, chunk_indices, src_slots, dst_slots, parents,
                        stride_x, stride_w, stride_y, D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr,
                        BD: tl.constexpr, BH: tl.constexpr, HAS_PARENTS: tl.constexpr, SILU: tl.constexpr,
                        U: tl.constexpr):
    """One program per (chunk row, BD channels): walks the chunk's rows in groups of U, each input row loaded
    once (the W-1 previous inputs kept in registers), so x is read once instead of W times."""
    i_r, i_d = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_indices + i_r * 2)
    i_c = tl.load(chunk_indices + i_r * 2 + 1)
    if i_n < 0:  # sentinel row of a padded grid
        return
    bos, L, hsrc, hlen, hx_end = _sequence_history(cu_seqlens, src_slots, parents, i_n, W, HAS_PARENTS)

    o_d = i_d * BD + tl.arange(0, BD)
    mask_d = o_d < D
    # weights by lag: w_j multiplies the input j rows back (weight[:, W-1-j]); unused lags stay 0
    w0 = tl.load(weight + o_d * stride_w + (W - 1), mask=mask_d, other=0.).to(tl.float32)
    w1 = tl.load(weight + o_d * stride_w + (W - 2), mask=mask_d, other=0.).to(tl.float32)
    w2 = tl.zeros([BD], dtype=tl.float32)
    w3 = tl.zeros([BD], dtype=tl.float32)
    if W >= 3:
        w2 = tl.load(weight + o_d * stride_w + (W - 3), mask=mask_d, other=0.).to(tl.float32)
    if W >= 4:
        w3 = tl.load(weight + o_d * stride_w + (W - 4), mask=mask_d, other=0.).to(tl.float32)
    t0 = i_c * BT
    # the W-1 inputs before the chunk (history rows for chunk 0, x rows otherwise)
    p1 = conv_load_row(x, conv_pool, t0 - 1, bos, hx_end, hlen, hsrc, o_d, mask_d, stride_x, D, W)
    p2 = tl.zeros([BD], dtype=tl.float32)
    p3 = tl.zeros([BD], dtype=tl.float32)
    if W >= 3:
        p2 = conv_load_row(x, conv_pool, t0 - 2, bos, hx_end, hlen, hsrc, o_d, mask_d, stride_x, D, W)
    if W >= 4:
        p3 = conv_load_row(x, conv_pool, t0 - 3, bos, hx_end, hlen, hsrc, o_d, mask_d, stride_x, D, W)
    n = tl.minimum(L - t0, BT)
    p_x = x + (bos + t0).to(tl.int64) * stride_x + o_d
    p_y = y + (bos + t0).to(tl.int64) * stride_y + o_d
    for g in range(0, n, U):
        for u in tl.static_range(U):
            m_t = (mask_d & (g + u < n)) != 0   # `!= 0`: see conv_load_ext
            b_x = tl.load(p_x + (g + u) * stride_x, mask=m_t, other=0.).to(tl.float32)
            # the same accumulation order as the PyTorch path: oldest input first
            b_acc = tl.zeros([BD], dtype=tl.float32)
            if W >= 4:
                b_acc += p3 * w3
            if W >= 3:
                b_acc += p2 * w2
            b_acc += p1 * w1
            b_acc += b_x * w0
            if SILU:
                b_acc = b_acc * (1 / (1 + tl.exp(-b_acc)))   # tl.sigmoid inlined (no jit call per row)
            tl.store(p_y + (g + u) * stride_y, cast(b_acc, y.dtype.element_ty), mask=m_t)
            p3 = p2
            p2 = p1
            p1 = b_x

    # Only the chunk-0 program writes the new history, so a zero-length sequence still copies src -> dst.
    if i_c == 0:
        _write_history(x, conv_pool, dst_slots, i_n, bos, L, hx_end, hlen, hsrc, o_d, mask_d, stride_x, D, W, BH)


ConvTile = tuple[int, int, int]   # (BD channels per program, num_warps, U rows per unrolled group)
KERNELS = ("rows", "tile")
_kernel_override: list[str | None] = [None]


ROWS_MIN_CHUNK_ROWS = 64


def conv_kernel(num_chunk_rows: int) -> str:
    """"rows" on the GPU from 64 chunk rows (4096 tokens) up, "tile" below and under the CPU interpreter.
    H200 (benchmarks/results/prefill_ops_h200.md): rows 55.7 vs tile 81.4 µs at 1x4096, 106.8 vs 160.2 at
    8x1024; but each rows program walks its 64 rows in sequence, a latency the short grids cannot hide: 35.0 vs
    13.3 µs at 512 tokens, 17.7 vs 4.3 at 64 (sizes between 512 and 4096 were not measured). The interpreter
    runs "tile" ~8x faster (a few tile ops per program instead of a dozen per row), so the layer and engine
    tests stay cheap. Same results bit for bit (the same fp32 operations per output, checked on the H200
    too); the tests run both (``use_kernel``)."""
    if _kernel_override[0] is not None:
        return _kernel_override[0]
    return "tile" if interpreting() or num_chunk_rows < ROWS_MIN_CHUNK_ROWS else "rows"


@contextlib.contextmanager
def use_kernel(kernel: str):
    """Force one prefill kernel inside the block (tests, benchmarks)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {KERNELS}, got {kernel!r}")
    old = _kernel_override[0]
    _kernel_override[0] = kernel
    try:
        yield
    finally:
        _kernel_override[0] = old


def conv_tile(kernel: str, num_chunk_rows: int, D: int) -> ConvTile:
    """rows: 128 channels on one warp, groups of 8 rows (the H200's best of BD 128 / 256 / 512 and 1 / 2 warps
    at 4096 and 8192 tokens); tile: the [64, 128] tiles of the first kernel."""
    if kernel == "tile":
        bd = min(128, max(16, pow2(D)))
        return bd, 8 if CHUNK * bd >= 8192 else 4, 1
    return min(128, max(16, pow2(D))), 1, 8


def conv_prefill(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, y: torch.Tensor,
                 meta: VarlenMeta, src_slots: torch.Tensor, dst_slots: torch.Tensor,
                 parents: torch.Tensor | None, silu: bool, tile: ConvTile | None = None) -> None:
    T, D = x.shape
    W = weight.shape[1]
    kernel = conv_kernel(meta.num_chunk_rows)
    BD, warps, U = tile or conv_tile(kernel, meta.num_chunk_rows, D)
    # A zero-token call still copies histories; substitute a live buffer for empty x/y (never read).
    xa, ya = (x, y) if T > 0 else (conv_pool, conv_pool)
    args = (xa, weight, conv_pool, ya, meta.cu_seqlens, meta.chunk_indices, src_slots, dst_slots, parents,
            x.stride(0), weight.stride(0), y.stride(0), D, W, CHUNK, BD, pow2(W - 1), parents is not None, silu)
    if kernel == "rows":
        launch(conv_prefill_rows_kernel, (meta.num_chunk_rows, cdiv(D, BD)), args + (U,), warps)
    else:
        launch(conv_prefill_tile_kernel, (meta.num_chunk_rows, cdiv(D, BD)), args, warps)


def silu_fp32(v: torch.Tensor) -> torch.Tensor:
    # Not torch.sigmoid: its CPU kernel rounds differently in the vector body and the tail, so the
    # same token would give different bits in a packed batch and alone.
    return v / (1 + torch.exp(-v))


def conv_prefill_torch(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, y: torch.Tensor,
                       meta: VarlenMeta, src_slots: torch.Tensor, dst_slots: torch.Tensor,
                       parents: torch.Tensor | None, silu: bool) -> None:
    """Vectorised gathers; reads only `dst >= 0` on the host (for the scatter)."""
    T, D = x.shape
    W, N, dev = weight.shape[1], meta.num_seqs, x.device
    cu = meta.cu_seqlens.long()
    bos, lens = cu[:-1], cu[1:] - cu[:-1]
    j = torch.arange(W - 1, device=dev)

    def tails(hist: torch.Tensor) -> torch.Tensor:  # last W-1 rows of (hist ++ x_n): [N, W-1, D]
        k = lens[:, None] + j[None, :]                                    # ext index
        b_h = hist.gather(1, k.clamp(max=W - 2)[:, :, None].expand(-1, -1, D))
        if T == 0:
            return b_h
        b_x = x[(bos[:, None] + k - (W - 1)).clamp(0, T - 1)]
        return torch.where((k >= W - 1)[:, :, None], b_x, b_h)

    src = src_slots.long()
    hist = conv_pool[src.clamp(min=0)] if conv_pool.shape[0] > 0 else x.new_zeros(N, W - 1, D)
    hist = torch.where((src >= 0)[:, None, None], hist, 0)
    if parents is not None:
        par = parents.long()
        hist = torch.where((par >= 0)[:, None, None], tails(hist)[par.clamp(min=0)], hist)
    new_hist = tails(hist)

    if T > 0:
        seq = torch.repeat_interleave(torch.arange(N, device=dev), lens, output_size=T)
        t = torch.arange(T, device=dev)
        pos = t - bos[seq]
        acc = torch.zeros(T, D, dtype=torch.float32, device=dev)
        for m in range(W):
            r = pos + (m - (W - 1))                                        # row of x_n; < 0: history
            b_e = torch.where((r >= 0)[:, None], x[(t + (m - (W - 1))).clamp(min=0)],
                              hist[seq, (r + W - 1).clamp(0, W - 2)])
            acc = acc + b_e.float() * weight[:, m].float()
        y.copy_(silu_fp32(acc) if silu else acc)
    rows = (dst_slots >= 0).nonzero().squeeze(1)
    conv_pool[dst_slots[rows].long()] = new_hist[rows]


def check_conv_common(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, activation: str | None,
                      out: torch.Tensor | None, backend: Backend) -> str:
    check_tensor("x", x, [None, None], ACT_DTYPES)
    D = x.shape[1]
    check_tensor("weight", weight, [D, None], ACT_DTYPES, x.device)
    W = weight.shape[1]
    impl = resolve(backend, x)
    if W < 2 or (impl == "triton" and W > 4):
        raise ValueError(f"weight: kernel width W = weight.shape[1] must be in 2..4 (Triton) / >= 2, got {W}")
    check_tensor("conv_pool", conv_pool, [None, W - 1, D], [x.dtype], x.device)
    check_contiguous("conv_pool", conv_pool)
    if out is not None:
        check_tensor("out", out, [x.shape[0], D], [x.dtype], x.device)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected 'silu' or None, got {activation!r}")
    return impl


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, meta: VarlenMeta,
                          src_slots: torch.Tensor, dst_slots: torch.Tensor, parents: torch.Tensor | None = None,
                          *, activation: str | None = "silu", out: torch.Tensor | None = None,
                          backend: Backend = "auto") -> torch.Tensor:
    """Varlen causal conv1d prefill with pooled history.

    x: [T, D] raw inputs (bf16/fp16/fp32), channel stride 1 (row stride may exceed D)
    weight: [D, W], weight[:, W-1] multiplies the current token; no bias
    conv_pool: [S, W-1, D] x.dtype, contiguous; [s, 0] is the oldest input. Updated in place.
    meta: VarlenMeta of the N sequences (cu_seqlens / chunk_indices on x.device)
    src_slots: [N] int32, history slot, -1 = zeros
    dst_slots: [N] int32, slot receiving the last W-1 inputs of (history ++ x_n), -1 = no write
    parents: [N] int32 or None; p >= 0: sequence n continues sequence p of this call (whose own
        parent is -1): its history is the last W-1 rows of (history of p ++ x_p); src_slots[n] is ignored
    out: [T, D] x.dtype, channel stride 1, not overlapping x; or None (fresh contiguous)
    returns y: [T, D] = act(conv) in x.dtype, fp32 accumulation

    src == dst for one sequence (in place) is allowed. Caller's rule: a slot read by one sequence
    (as its src, or through its parent's src, which happens only when the parent is shorter than
    W-1) must not be written by a different sequence of the same call; dst slots are distinct.
    """
    impl = check_conv_common(x, weight, conv_pool, activation, out, backend)
    T, D = x.shape
    if T != meta.num_tokens:
        raise ValueError(f"x: expected {meta.num_tokens} rows (meta.num_tokens), got {T}")
    if meta.cu_seqlens.device != x.device:
        raise ValueError(f"meta: cu_seqlens on {meta.cu_seqlens.device}, x on {x.device}")
    N = meta.num_seqs
    check_index("src_slots", src_slots, N, x.device)
    check_index("dst_slots", dst_slots, N, x.device)
    if parents is not None:
        check_index("parents", parents, N, x.device)
    y = torch.empty(T, D, dtype=x.dtype, device=x.device) if out is None else out
    fn = conv_prefill if impl == "triton" else conv_prefill_torch
    fn(x, weight, conv_pool, y, meta, src_slots, dst_slots, parents, activation == "silu")
    return y
