"""The Triton kernels of ``gating.py`` (what they compute and where they round is said there): one program per
[BT, BC] tile of rows and columns, fp32 arithmetic, a rounding to the activation dtype after each PyTorch op.

``sigmoid_mul``'s ``QUANT``: its rounded output also quantized per row and group of 128 columns in registers
(an FP8 o_proj's x): the tile viewed as [BT · BC / GROUP, GROUP] groups, GROUP = min(BC, 128) (BC is a power
of two and column tiles start at multiples of BC, so tiles hold whole groups; masked entries are 0, so a
partial last group quantizes as ``quantize_act_triton``'s) with ``tl_fp8.quant_tile``: its numbers bit for bit."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdnserve.ops.launch import cdiv, launch, pow2
from gdnserve.ops.quant.fp8_ref import BLOCK as QGROUP
from gdnserve.ops.quant.quant_out import empty_quant
from gdnserve.ops.quant.tl_fp8 import quant_tile
from gdnserve.ops.tl_compat import cast

TILE = 4096        # elements per program


@triton.jit
def _silu_mul_kernel(h, out, T, I, stride_h, BT: tl.constexpr, BC: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    m = (r < T)[:, None] & (c < I)[None, :]
    src = h + r[:, None] * stride_h + c[None, :]
    g = tl.load(src, mask=m, other=0.0).to(tl.float32)
    u = tl.load(src + I, mask=m, other=0.0).to(tl.float32)
    DT = out.dtype.element_ty
    s = cast(g / (1.0 + tl.exp(-g)), DT).to(tl.float32)
    tl.store(out + r[:, None] * I + c[None, :], cast(s * u, DT), mask=m)


@triton.jit
def _sigmoid_mul_kernel(x, g, add, out, oq, osc, T, C, SG, GD, stride_x, sg_t, sg_h, sg_c, stride_a,
                        HAS_ADD: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, QUANT: tl.constexpr,
                        GROUP: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    m = (r < T)[:, None] & (c < C)[None, :]
    DT = out.dtype.element_ty
    gv = tl.load(g + r[:, None] * sg_t + ((c // GD) * sg_h + (c % GD) * sg_c)[None, :], mask=m, other=0.0)
    s = cast(1.0 / (1.0 + tl.exp(-gv.to(tl.float32))), DT).to(tl.float32)
    xv = tl.load(x + r[:, None] * stride_x + c[None, :], mask=m, other=0.0).to(tl.float32)
    y = cast(xv * s, DT)
    if HAS_ADD:
        av = tl.load(add + r[:, None] * stride_a + c[None, :], mask=m, other=0.0).to(tl.float32)
        y = cast(av + y.to(tl.float32), DT)
    tl.store(out + r[:, None] * C + c[None, :], y, mask=m)
    if QUANT:
        qv, sv = quant_tile(tl.reshape(y.to(tl.float32), (BT * (BC // GROUP), GROUP)))
        tl.store(oq + r[:, None] * C + c[None, :], tl.reshape(qv, (BT, BC)).to(oq.dtype.element_ty), mask=m)
        gi = tl.arange(0, BT * (BC // GROUP))              # group gi: tile row gi // (BC / GROUP)
        gr = tl.program_id(0).to(tl.int64) * BT + gi // (BC // GROUP)
        gc = tl.program_id(1) * (BC // GROUP) + gi % (BC // GROUP)
        tl.store(osc + gr * SG + gc, sv, mask=(gr < T) & (gc < SG))


def _tile(T: int, C: int) -> tuple[int, int]:
    bc = min(pow2(C), 1024)
    return max(1, min(TILE // bc, pow2(T))), bc


def silu_mul_triton(h: torch.Tensor) -> torch.Tensor:
    T, I = h.shape[0], h.shape[1] // 2
    out = torch.empty(T, I, dtype=h.dtype, device=h.device)
    if T and I:
        BT, BC = _tile(T, I)
        launch(_silu_mul_kernel, (cdiv(T, BT), cdiv(I, BC)), (h, out, T, I, h.stride(0), BT, BC), num_warps=4)
    return out


def sigmoid_mul_triton(x: torch.Tensor, g: torch.Tensor, add: torch.Tensor | None, quant: bool = False):
    """``gating.sigmoid_mul``'s output; ``quant``: ``(out, (q [T, C], s [T, ceil(C/128)]))``."""
    T, C = x.shape
    out = torch.empty(T, C, dtype=x.dtype, device=x.device)
    oq, osc = empty_quant(T, C, x.device) if quant else (out, out)
    if not (T and C):
        return (out, (oq, osc)) if quant else out
    if g.dim() == 3:                           # [T, G, GD] per-head view
        GD, sg_t, sg_h, sg_c = g.shape[2], g.stride(0), g.stride(1), 1
    elif g.shape[1] == 1:                      # [T, 1]: one gate per row
        GD, sg_t, sg_h, sg_c = C, g.stride(0), 0, 0
    else:
        GD, sg_t, sg_h, sg_c = C, g.stride(0), 0, 1
    BT, BC = _tile(T, C)
    launch(_sigmoid_mul_kernel, (cdiv(T, BT), cdiv(C, BC)),
           (x, g, x if add is None else add, out, oq, osc, T, C, cdiv(C, QGROUP), GD, x.stride(0), sg_t, sg_h,
            sg_c, 0 if add is None else add.stride(0), add is not None, BT, BC, quant, min(BC, QGROUP)), num_warps=4)
    return (out, (oq, osc)) if quant else out
