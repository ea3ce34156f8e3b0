"""Causal conv1d for decode (Lq = 1), speculative verify (Lq = K+1) and the fold of accepted
drafted inputs (Lq = 0), over the slot-indexed conv pool (gdn_kernels.md §4.3).

The pool holds exactly W-1 inputs per slot. Verify does not widen it (unlike vLLM's W-1+K window):
drafted inputs go to a separate ``pending_x`` buffer, and the accepted ones are folded into the
history either by ``causal_conv1d_fold`` after acceptance ("intermediate") or at the start of the
next verify through ``pending_in_rows`` ("replay"). Both give the same bits as decoding the accepted
tokens one at a time.
"""
from __future__ import annotations

from typing import Literal

import torch
import triton
import triton.language as tl

from gdnserve.ops.backend import Backend, resolve
from gdnserve.ops.checks import check_contiguous, check_index, check_tensor
from gdnserve.ops.conv.prefill import check_conv_common, silu_fp32
from gdnserve.ops.launch import cdiv, launch, pow2
from gdnserve.ops.tl_compat import cast

WriteState = Literal["final", "after_pending", "none"]
WRITE_STATES = {"none": 0, "final": 1, "after_pending": 2}


@triton.jit
def _store_history(p_pool, b_h1, b_h2, b_h3, mask_d, D: tl.constexpr, W: tl.constexpr):
    """The slot's W-1 rows, oldest first: (h1, h2, h3) for W = 4, (h2, h3) for 3, (h3) for 2."""
    tl.store(p_pool + (W - 2) * D, b_h3, mask=mask_d)
    if W >= 3:
        tl.store(p_pool + (W - 3) * D, b_h2, mask=mask_d)
    if W >= 4:
        tl.store(p_pool + (W - 4) * D, b_h1, mask=mask_d)


@triton.jit
def conv_update_kernel(x, weight, conv_pool, y, slots, pending_x, pending_in_rows, num_pending, pending_out_rows,
                       stride_x, stride_w, stride_y, D: tl.constexpr, W: tl.constexpr, LQ: tl.constexpr,
                       LP: tl.constexpr, BD: tl.constexpr, HAS_PIN: tl.constexpr, HAS_POUT: tl.constexpr,
                       WRITE: tl.constexpr, SILU: tl.constexpr):
    i_n, i_d = tl.program_id(0), tl.program_id(1)
    o_d = i_d * BD + tl.arange(0, BD)
    mask_d = o_d < D
    i_s = tl.load(slots + i_n)
    if i_s < 0:  # padding request: zero outputs, no state traffic
        for t in range(LQ):
            p_y = y + (i_n * LQ + t).to(tl.int64) * stride_y + o_d
            tl.store(p_y, tl.zeros([BD], dtype=y.dtype.element_ty), mask=mask_d)
        return

    # Window in registers, oldest first: (b_h1, b_h2, b_h3, current); W < 4 leaves the older ones 0.
    p_pool = conv_pool + i_s.to(tl.int64) * ((W - 1) * D) + o_d
    b_h1 = tl.zeros([BD], dtype=conv_pool.dtype.element_ty)
    b_h2 = tl.zeros([BD], dtype=conv_pool.dtype.element_ty)
    b_h3 = tl.load(p_pool + (W - 2) * D, mask=mask_d, other=0.)
    if W >= 3:
        b_h2 = tl.load(p_pool + (W - 3) * D, mask=mask_d, other=0.)
    if W >= 4:
        b_h1 = tl.load(p_pool + (W - 4) * D, mask=mask_d, other=0.)

    if HAS_PIN:  # fold pending inputs; only the last W-1 of them can reach the history
        i_pin = tl.load(pending_in_rows + i_n)
        n_a = tl.where(i_pin >= 0, tl.load(num_pending + i_n), 0)
        p_pin = pending_x + tl.maximum(i_pin, 0).to(tl.int64) * (LP * D) + o_d
        for i in tl.static_range(W - 1):  # shift in pending rows n_a-(W-1)+i that exist
            i_a = n_a - (W - 1) + i
            b_v = tl.load(p_pin + tl.maximum(i_a, 0) * D, mask=(mask_d & (i_a >= 0)) != 0, other=0.)
            b_h1, b_h2, b_h3 = (tl.where(i_a >= 0, b_h2, b_h1), tl.where(i_a >= 0, b_h3, b_h2),
                                tl.where(i_a >= 0, b_v, b_h3))

    if WRITE == 2:
        # In place: all threads must have read the slot before any overwrites it.
        tl.debug_barrier()
        _store_history(p_pool, b_h1, b_h2, b_h3, mask_d, D, W)

    b_w1 = tl.zeros([BD], dtype=tl.float32)
    b_w2 = tl.zeros([BD], dtype=tl.float32)
    b_w3 = tl.zeros([BD], dtype=tl.float32)
    b_w4 = tl.zeros([BD], dtype=tl.float32)
    if LQ > 0:
        b_w4 = tl.load(weight + o_d * stride_w + (W - 1), mask=mask_d, other=0.).to(tl.float32)
        b_w3 = tl.load(weight + o_d * stride_w + (W - 2), mask=mask_d, other=0.).to(tl.float32)
        if W >= 3:
            b_w2 = tl.load(weight + o_d * stride_w + (W - 3), mask=mask_d, other=0.).to(tl.float32)
        if W >= 4:
            b_w1 = tl.load(weight + o_d * stride_w + (W - 4), mask=mask_d, other=0.).to(tl.float32)
    if HAS_POUT:
        i_pout = tl.load(pending_out_rows + i_n)
        p_pout = pending_x + tl.maximum(i_pout, 0).to(tl.int64) * (LP * D) + o_d
    for t in range(LQ):
        b_x = tl.load(x + (i_n * LQ + t).to(tl.int64) * stride_x + o_d, mask=mask_d, other=0.)
        b_acc = b_h1.to(tl.float32) * b_w1
        b_acc += b_h2.to(tl.float32) * b_w2
        b_acc += b_h3.to(tl.float32) * b_w3
        b_acc += b_x.to(tl.float32) * b_w4
        if SILU:
            b_acc = b_acc * tl.sigmoid(b_acc)
        tl.store(y + (i_n * LQ + t).to(tl.int64) * stride_y + o_d, cast(b_acc, y.dtype.element_ty), mask=mask_d)
        if HAS_POUT:
            tl.store(p_pout + t * D, b_x, mask=(mask_d & (i_pout >= 0)) != 0)
        b_h1, b_h2, b_h3 = b_h2, b_h3, b_x

    if WRITE == 1:
        tl.debug_barrier()
        _store_history(p_pool, b_h1, b_h2, b_h3, mask_d, D, W)


def conv_update(x: torch.Tensor, weight: torch.Tensor | None, conv_pool: torch.Tensor, y: torch.Tensor,
                slots: torch.Tensor, Lq: int, write: int, pending_x: torch.Tensor | None,
                pending_in_rows: torch.Tensor | None, num_pending: torch.Tensor | None,
                pending_out_rows: torch.Tensor | None, silu: bool) -> None:
    B, W, D = slots.shape[0], conv_pool.shape[1] + 1, conv_pool.shape[2]
    if B == 0:
        return
    BD = min(256, max(16, pow2(D)))
    # Lq == 0 (fold): x, y and weight are never touched; pass a live buffer for them.
    xa, ya, wa = (x, y, weight) if Lq > 0 else (conv_pool, conv_pool, conv_pool)
    launch(conv_update_kernel, (B, cdiv(D, BD)), (
        xa, wa, conv_pool, ya, slots, pending_x, pending_in_rows, num_pending, pending_out_rows,
        x.stride(0), 0 if weight is None else weight.stride(0), y.stride(0), D, W, Lq,
        0 if pending_x is None else pending_x.shape[1], BD, pending_in_rows is not None,
        pending_out_rows is not None, write, silu), 2)


def conv_update_torch(x: torch.Tensor, weight: torch.Tensor | None, conv_pool: torch.Tensor, y: torch.Tensor,
                      slots: torch.Tensor, Lq: int, write: int, pending_x: torch.Tensor | None,
                      pending_in_rows: torch.Tensor | None, num_pending: torch.Tensor | None,
                      pending_out_rows: torch.Tensor | None, silu: bool) -> None:
    """Vectorised gathers; reads which requests are live on the host (for the scatters)."""
    B, W, D = slots.shape[0], conv_pool.shape[1] + 1, conv_pool.shape[2]
    if B == 0:
        return
    s = slots.long()
    live = s >= 0
    hist = conv_pool[s.clamp(min=0)]                                       # [B, W-1, D]
    if pending_in_rows is not None:
        pin = pending_in_rows.long()
        a = torch.where(live & (pin >= 0), num_pending.long(), 0)
        ext = torch.cat([hist, pending_x[pin.clamp(min=0)]], dim=1)        # [B, W-1+LP, D]
        k = a[:, None] + torch.arange(W - 1, device=x.device)[None, :]
        hist = ext.gather(1, k[:, :, None].expand(-1, -1, D))
    ext = torch.cat([hist, x.view(B, Lq, D) if Lq > 0 else hist[:, :0]], dim=1)  # [B, W-1+Lq, D]
    if Lq > 0:
        acc = torch.zeros(B, Lq, D, dtype=torch.float32, device=x.device)
        for m in range(W):
            acc = acc + ext[:, m:m + Lq].float() * weight[:, m].float()
        if silu:
            acc = silu_fp32(acc)
        y.copy_(torch.where(live[:, None, None], acc, 0).view(B * Lq, D))
    rows = live.nonzero().squeeze(1)
    if write:
        conv_pool[s[rows]] = (ext[:, Lq:] if write == 1 else hist)[rows]
    if pending_out_rows is not None and Lq > 0:
        rows = (live & (pending_out_rows >= 0)).nonzero().squeeze(1)
        pending_x[pending_out_rows[rows].long(), :Lq] = x.view(B, Lq, D)[rows]


def _check_pending(B: int, ref: torch.Tensor, D: int, pending_x: torch.Tensor | None,
                   pending_in_rows: torch.Tensor | None, num_pending: torch.Tensor | None,
                   pending_out_rows: torch.Tensor | None, Lq: int) -> None:
    if (pending_in_rows is None) != (num_pending is None):
        raise ValueError("pending_in_rows and num_pending: give both or neither")
    if pending_in_rows is None and pending_out_rows is None:
        return
    check_tensor("pending_x", pending_x, [None, None, D], [ref.dtype], ref.device)
    check_contiguous("pending_x", pending_x)
    if pending_in_rows is not None:
        check_index("pending_in_rows", pending_in_rows, B, ref.device)
        check_index("num_pending", num_pending, B, ref.device)
    if pending_out_rows is not None:
        check_index("pending_out_rows", pending_out_rows, B, ref.device)
        if pending_x.shape[1] < Lq:
            raise ValueError(f"pending_x: needs >= tokens_per_req = {Lq} rows per entry, got {list(pending_x.shape)}")


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor, *,
                         tokens_per_req: int, write_state: WriteState = "final",
                         pending_x: torch.Tensor | None = None, pending_in_rows: torch.Tensor | None = None,
                         num_pending: torch.Tensor | None = None, pending_out_rows: torch.Tensor | None = None,
                         activation: str | None = "silu", out: torch.Tensor | None = None,
                         backend: Backend = "auto") -> torch.Tensor:
    """Decode / verify: B requests of Lq = tokens_per_req tokens each; request n owns rows [n*Lq, (n+1)*Lq).

    x: [B*Lq, D] raw inputs (bf16/fp16/fp32), channel stride 1
    weight: [D, W]; conv_pool: [S, W-1, D] x.dtype, contiguous, updated in place
    slots: [B] int32, -1 = padding (zero output rows, no pool/pending reads or writes)
    pending_x: [P, Lmax, D] x.dtype, contiguous: drafted raw inputs per request row
    pending_in_rows: [B] int32, -1 = none; with num_pending [B] int32 (0..Lmax): the history is first
        advanced by pending_x[pending_in_rows[n], :num_pending[n]] (hist1)
    pending_out_rows: [B] int32, -1 = none: pending_x[row, :Lq] = this request's x rows (bit copies);
        must not alias any pending_in row of the same call (callers ping-pong)
    write_state: "final" -> slot = last W-1 of (hist1 ++ x_n); "after_pending" -> slot = hist1;
        "none" -> the pool is not written
    out: [B*Lq, D] x.dtype, channel stride 1, not overlapping x; or None (fresh contiguous)
    returns y: [B*Lq, D] in x.dtype. Slots of live requests must be distinct.
    """
    impl = check_conv_common(x, weight, conv_pool, activation, out, backend)
    Lq = tokens_per_req
    if not isinstance(Lq, int) or Lq < 0:
        raise ValueError(f"tokens_per_req: expected an int >= 0, got {Lq!r}")
    D = x.shape[1]
    check_index("slots", slots, None, x.device)
    B = slots.shape[0]
    if x.shape[0] != B * Lq:
        raise ValueError(f"x: expected {B * Lq} rows (len(slots) * tokens_per_req), got {x.shape[0]}")
    if write_state not in WRITE_STATES:
        raise ValueError(f"write_state: expected one of {list(WRITE_STATES)}, got {write_state!r}")
    _check_pending(B, x, D, pending_x, pending_in_rows, num_pending, pending_out_rows, Lq)
    y = torch.empty(B * Lq, D, dtype=x.dtype, device=x.device) if out is None else out
    fn = conv_update if impl == "triton" else conv_update_torch
    fn(x, weight, conv_pool, y, slots, Lq, WRITE_STATES[write_state], pending_x, pending_in_rows, num_pending,
       pending_out_rows, activation == "silu")
    return y


def causal_conv1d_fold(conv_pool: torch.Tensor, slots: torch.Tensor, pending_x: torch.Tensor,
                       pending_in_rows: torch.Tensor, num_pending: torch.Tensor, *,
                       backend: Backend = "auto") -> None:
    """Commit accepted drafted inputs: conv_pool[slots[n]] = last W-1 rows of
    (conv_pool[slots[n]] ++ pending_x[pending_in_rows[n], :num_pending[n]]); the update op with
    Lq = 0 and write_state="after_pending". Shapes as in causal_conv1d_update; -1 slots/rows skip."""
    check_tensor("conv_pool", conv_pool, [None, None, None], [torch.bfloat16, torch.float16, torch.float32])
    check_contiguous("conv_pool", conv_pool)
    W, D = conv_pool.shape[1] + 1, conv_pool.shape[2]
    impl = resolve(backend, conv_pool)
    if W < 2 or (impl == "triton" and W > 4):
        raise ValueError(f"conv_pool: W-1 = shape[1] must give W in 2..4 (Triton) / >= 2, got W = {W}")
    check_index("slots", slots, None, conv_pool.device)
    B = slots.shape[0]
    if pending_in_rows is None or num_pending is None:
        raise ValueError("pending_in_rows and num_pending: required by the fold")
    _check_pending(B, conv_pool, D, pending_x, pending_in_rows, num_pending, None, 0)
    x = conv_pool.new_empty(0, D)
    fn = conv_update if impl == "triton" else conv_update_torch
    fn(x, None, conv_pool, x, slots, 0, WRITE_STATES["after_pending"], pending_x, pending_in_rows, num_pending,
       None, False)
