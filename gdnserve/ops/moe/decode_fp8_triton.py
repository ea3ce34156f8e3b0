"""FP8 routed experts at decode sizes (a few (token, expert) pairs) in Triton: two weight-streaming GEMV
launches on the CUDA cores, no alignment, no k-sum launch.

At T = 1 the grouped GEMM (``grouped_fp8_triton``) spends its time in launches and in too few programs:
aligning the pairs, quantizing x, gate_up, quantizing the intermediate, down, the k-sum — 34.5 µs on the
H200 for ~25 MB of FP8 weights (~6 µs at the copy rate). Here, for ``T·k <= DECODE_MAX_PAIRS``:

1. ``_gate_up_kernel``: one program = one pair (read straight from ``experts [T, k]``) x ``BR`` intermediate
   columns: its ``BR`` gate rows and ``BR`` up rows of the expert over the whole of K, ``KG`` scale blocks of
   128 per step (the loads of a step are independent: in flight together). x per token and group of 128 is
   quantized in the program's registers (``QX``: ``tl_fp8.quant_tile``, the numbers of
   ``quantize_act_triton``; x is a few KB, L2-resident) or read from one ``quantize_act_triton`` launch.
   Products ``e4m3 · e4m3-grid`` are exact in float32, summed per block, ``· sw · sx``, summed over blocks.
   Epilogue ``h = silu(g) · u`` rounded to x's dtype into ``inter [T·k, I]`` (pair-major, L2-resident).
2. ``_down_kernel``: one program = one token x ``BR2`` output columns: for its k pairs in order
   (j = 0..k-1) the pair's intermediate, quantized per group of 128 in registers (``QH``; else read from one
   ``quantize_act_triton`` launch over ``inter``), times the expert's ``BR2`` down rows, ``· w(pair)``,
   rounded to x's dtype as the reference rounds each pair output, summed in float32 in that fixed order and
   rounded once: the k-sum without its launch and without atomics.

The grid puts the pair (token) on its fastest axis, so the programs that share an expert's rows (two tokens
routed to one expert) run close together and the second read hits L2. The numbers are the grouped kernels'
and ``fp8_torch``'s (same quantization, same roundings; only the float32 summation order differs).
Deterministic; the grid is fixed by shapes (CUDA-graph safe); float32 activations work unchanged (the
products are exact). Configs: ``config``, from ``python -m benchmarks.sweep_moe_fp8_decode`` on the H200
(benchmarks/results/moe_fp8_decode_sweep_h200.md: T = 1 16.1 µs against 34.1 for the grouped kernels and
24.8 for bf16; T = 8 65.1 / 76.1 / 96.6; T = 16 a tie, so ``DECODE_MAX_PAIRS`` stops at 64). The loop down
kernel runs a token's k pairs one after the other (11.2 µs for 8 MB at T = 1); ``PAR`` puts them on a tile axis
(6.1 µs), the default up to 16 pairs.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from gdnserve.ops.launch import cdiv, launch, pow2
from gdnserve.ops.quant.fp8_gemm_triton import quantize_act_triton
from gdnserve.ops.quant.tl_fp8 import ACT_EPS, FP8_MAX, _rne_e4m3, quant_tile
from gdnserve.ops.tl_compat import INTERPRET, cast

DECODE_MAX_PAIRS = 64           # T·k at or below which ``moe_experts`` takes this path (0: never)


class DecodeConfig(NamedTuple):
    BR: int = 4          # gate_up: intermediate columns per program (BR gate + BR up weight rows)
    KG: int = 4          # gate_up: 128-wide K blocks per step
    warps: int = 4
    QX: bool = True      # quantize x in the gate_up programs (else one quantize_act_triton launch)
    BR2: int = 8         # down: output columns per program
    warps2: int = 4
    QH: bool = True      # quantize the intermediate in the down programs (else one launch)
    stages: int = 1
    PAR: bool = False    # down: the token's k pairs as one [k, BR2, I] tile (all loads in flight together;
                         # H200 at T = 1: down 6.1 vs 11.2 µs; at T = 16 slower: benchmarks/sweep_moe_fp8_decode.py)


@triton.jit
def _act_groups(raw, q, s, kk, kb, k_ok, SK, QUANT: tl.constexpr):
    """One activation row's ``[KG, 128]`` column groups ``kk`` (blocks ``kb``) as (values on the e4m3 grid in float32,
    their scales ``[KG]``): quantized here from the row ``raw`` (``quant_tile``) or loaded from its quantization
    (``q`` e4m3, ``s`` the scales, ``SK`` of them per row)."""
    if QUANT:
        return quant_tile(tl.load(raw + kk, mask=k_ok, other=0.0).to(tl.float32))
    else:
        return tl.load(q + kk, mask=k_ok, other=0.0).to(tl.float32), tl.load(s + kb, mask=kb < SK, other=0.0)


@triton.jit
def _gate_up_kernel(x, xq, xs, experts, w, ws, inter, H, I, SG, SKH, stride_x,
                    TOP_K: tl.constexpr, BR: tl.constexpr, KG: tl.constexpr, QX: tl.constexpr):
    pair = tl.program_id(0)
    tok = (pair // TOP_K).to(tl.int64)
    e = tl.load(experts + pair).to(tl.int64)
    n = tl.program_id(1) * BR + tl.arange(0, BR)
    n_ok = n < I
    g_rows = w + e * (2 * I) * H + n.to(tl.int64) * H                 # [BR] the gate rows, up rows I further
    sg_rows = ws + e * (2 * SG) * SKH + (n // 128) * SKH
    grp = tl.arange(0, KG)
    col = tl.arange(0, 128)
    acc_g = tl.zeros((BR,), dtype=tl.float32)
    acc_u = tl.zeros((BR,), dtype=tl.float32)
    for kb0 in range(0, SKH, KG):
        kb = kb0 + grp
        kk = kb[:, None] * 128 + col[None, :]                          # [KG, 128]
        k_ok = kk < H
        q, sx = _act_groups(x + tok * stride_x, xq + tok * H, xs + tok * SKH, kk, kb, k_ok, SKH, QX)
        m3 = n_ok[:, None, None] & k_ok[None, :, :]
        a_g = tl.load(g_rows[:, None, None] + kk[None, :, :], mask=m3, other=0.0).to(tl.float32)
        a_u = tl.load(g_rows[:, None, None] + I * H + kk[None, :, :], mask=m3, other=0.0).to(tl.float32)
        s_ok = n_ok[:, None] & (kb < SKH)[None, :]
        s_g = tl.load(sg_rows[:, None] + kb[None, :], mask=s_ok, other=0.0)
        s_u = tl.load(sg_rows[:, None] + SG * SKH + kb[None, :], mask=s_ok, other=0.0)
        acc_g += tl.sum(tl.sum(a_g * q[None, :, :], axis=2) * (s_g * sx[None, :]), axis=1)
        acc_u += tl.sum(tl.sum(a_u * q[None, :, :], axis=2) * (s_u * sx[None, :]), axis=1)
    h = cast(acc_g * tl.sigmoid(acc_g) * acc_u, inter.dtype.element_ty)       # rounded as the reference
    tl.store(inter + pair.to(tl.int64) * I + n, h, mask=n_ok)


@triton.jit
def _down_kernel(inter, iq, isc, experts, pair_w, w, ws, out, H, I, SKI, stride_o,
                 TOP_K: tl.constexpr, BR2: tl.constexpr, KGI: tl.constexpr, QH: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BR2 + tl.arange(0, BR2)
    n_ok = n < H
    grp = tl.arange(0, KGI)
    col = tl.arange(0, 128)
    w_rows = n.to(tl.int64) * I
    s_rows = (n // 128) * SKI
    total = tl.zeros((BR2,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = t * TOP_K + j
        e = tl.load(experts + pair).to(tl.int64)
        acc = tl.zeros((BR2,), dtype=tl.float32)
        for kb0 in range(0, SKI, KGI):
            kb = kb0 + grp
            kk = kb[:, None] * 128 + col[None, :]
            k_ok = kk < I
            q, sh = _act_groups(inter + pair * I, iq + pair * I, isc + pair * SKI, kk, kb, k_ok, SKI, QH)
            a = tl.load(w + e * H * I + w_rows[:, None, None] + kk[None, :, :],
                        mask=n_ok[:, None, None] & k_ok[None, :, :], other=0.0).to(tl.float32)
            s = tl.load(ws + e * tl.cdiv(H, 128) * SKI + s_rows[:, None] + kb[None, :],
                        mask=n_ok[:, None] & (kb < SKI)[None, :], other=0.0)
            acc += tl.sum(tl.sum(a * q[None, :, :], axis=2) * (s * sh[None, :]), axis=1)
        pw = tl.load(pair_w + pair).to(tl.float32)
        total += cast(acc * pw, out.dtype.element_ty).to(tl.float32)      # each pair rounded, as the reference
    tl.store(out + t * stride_o + n, cast(total, out.dtype.element_ty), mask=n_ok)


@triton.jit
def _down_pairs(inter, iq, isc, experts, pair_w, w, ws, out, t, n, n_ok, H, I, SKI, J0: tl.constexpr, NP: tl.constexpr,
                KP: tl.constexpr, TOP_K: tl.constexpr, BR2: tl.constexpr, KGI: tl.constexpr, QH: tl.constexpr):
    """Pairs ``J0 .. J0+NP-1`` of token t (NP <= KP, a power of two) as one ``[KP, BR2, KGI, 128]`` tile per K
    step: each pair's output ``[BR2]`` rounded to the output dtype (absent pairs: 0), returned as float32
    ``[KP, BR2]``."""
    jj = tl.arange(0, KP)
    j_ok = jj < NP
    pair = t * TOP_K + J0 + jj
    e = tl.load(experts + pair, mask=j_ok, other=0).to(tl.int64)
    pw = tl.load(pair_w + pair, mask=j_ok, other=0.0).to(tl.float32)
    grp = tl.arange(0, KGI)
    col = tl.arange(0, 128)
    acc = tl.zeros((KP, BR2), dtype=tl.float32)
    for kb0 in range(0, SKI, KGI):
        kb = kb0 + grp
        kk = kb[:, None] * 128 + col[None, :]
        k_ok = kk < I
        hp = pair[:, None, None] * I + kk[None, :, :]                           # [KP, KGI, 128]
        hm = j_ok[:, None, None] & k_ok[None, :, :]
        if QH:              # quant_tile's formula along the last axis
            ht = tl.load(inter + hp, mask=hm, other=0.0).to(tl.float32)
            amax = tl.max(tl.abs(ht), axis=2)
            sh = tl.math.div_rn(tl.maximum(amax, ACT_EPS), tl.full(amax.shape, FP8_MAX, tl.float32))
            v = tl.math.div_rn(ht, tl.broadcast_to(sh[:, :, None], ht.shape))
            q = _rne_e4m3(tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX))
        else:
            q = tl.load(iq + hp, mask=hm, other=0.0).to(tl.float32)
            sh = tl.load(isc + pair[:, None] * SKI + kb[None, :], mask=j_ok[:, None] & (kb < SKI)[None, :], other=0.0)
        w_off = e[:, None, None, None] * H * I + (n.to(tl.int64) * I)[None, :, None, None] + kk[None, None, :, :]
        wm = j_ok[:, None, None, None] & n_ok[None, :, None, None] & k_ok[None, None, :, :]
        a = tl.load(w + w_off, mask=wm, other=0.0).to(tl.float32)                 # [KP, BR2, KGI, 128]
        s_off = e[:, None, None] * tl.cdiv(H, 128) * SKI + ((n // 128) * SKI)[None, :, None] + kb[None, None, :]
        sm = j_ok[:, None, None] & n_ok[None, :, None] & (kb < SKI)[None, None, :]
        s = tl.load(ws + s_off, mask=sm, other=0.0)                                # [KP, BR2, KGI]
        acc += tl.sum(tl.sum(a * q[:, None, :, :], axis=3) * (s * sh[:, None, :]), axis=2)
    return cast(acc * pw[:, None], out.dtype.element_ty).to(tl.float32)


@triton.jit
def _down_par_kernel(inter, iq, isc, experts, pair_w, w, ws, out, H, I, SKI, stride_o,
                     TOP_K: tl.constexpr, KP: tl.constexpr, KP2: tl.constexpr, BR2: tl.constexpr, KGI: tl.constexpr,
                     QH: tl.constexpr):
    """``_down_kernel`` with the k pairs on a tile axis instead of a loop: the first ``KP`` (the largest power of
    two <= k) in one ``[KP, BR2, KGI, 128]`` tile, the other k - KP (a folded shared expert's pair: k + 1 = 9) in
    a second of ``KP2`` rows, so no tile is padded to twice its pairs; each pair's output rounded as there, then a
    fixed-order reduction over the pairs (deterministic; another order than the loop's: fp32, then one
    rounding)."""
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BR2 + tl.arange(0, BR2)
    n_ok = n < H
    y = tl.sum(_down_pairs(inter, iq, isc, experts, pair_w, w, ws, out, t, n, n_ok, H, I, SKI, 0, KP, KP, TOP_K, BR2,
                           KGI, QH), axis=0)
    if KP < TOP_K:
        y += tl.sum(_down_pairs(inter, iq, isc, experts, pair_w, w, ws, out, t, n, n_ok, H, I, SKI, KP, TOP_K - KP, KP2,
                                TOP_K, BR2, KGI, QH), axis=0)
    tl.store(out + t * stride_o + n, cast(y, out.dtype.element_ty), mask=n_ok)




def config(num_pairs: int, H: int, I: int) -> DecodeConfig:
    """The decode kernels' config from the shapes: the H200 sweep's best at T = 1 and at T = 16 (top-8, H 2048,
    I 512; benchmarks/results/moe_fp8_decode_sweep_h200.md). A few pairs: narrow programs (the most of them),
    both quantizations in registers (a launch costs more than the recomputation); more: 16 / 32-row programs
    and x and the intermediate quantized once by their own launches (the per-program re-quantization grows
    with the pairs)."""
    if INTERPRET:                   # Triton's CPU interpreter: few wide programs (its cost is per program)
        return DecodeConfig(BR=32, BR2=64)
    if num_pairs <= 16:             # T <= 2 at top-8 (T = 1 folded: 9 pairs); H200, PAR down: 16.1 vs 21.4 µs at T = 1
        return DecodeConfig(BR=4, KG=4, warps=4, QX=True, BR2=8, warps2=8, QH=True, PAR=True)
    return DecodeConfig(BR=16, KG=4, QX=False, BR2=32, QH=False)


_pick = config   # the entry point's ``config=`` keyword shadows the name


def uses_decode(num_pairs: int) -> bool:
    """Whether ``moe_experts`` sends ``num_pairs`` (token, expert) pairs to this path."""
    return bool(DECODE_MAX_PAIRS) and 0 < num_pairs <= DECODE_MAX_PAIRS


def moe_experts_fp8_decode(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w_gate_up: torch.Tensor,
                           w_down: torch.Tensor, s_gate_up: torch.Tensor, s_down: torch.Tensor,
                           config: DecodeConfig | None = None) -> torch.Tensor:
    """x [T, H] (unit column stride), weights [T, k] (contiguous), experts [T, k] (contiguous, any int dtype),
    w_gate_up [E, 2I, H] / w_down [E, H, I] e4m3 and their block scales (float32, contiguous) -> [T, H] in
    x.dtype. ``config``: overrides ``config``'s pick for this call (benchmarks' sweeps)."""
    c = config if config is not None else _pick(experts.numel(), x.shape[1], w_down.shape[2])
    inter = gate_up_decode(x, experts, w_gate_up, s_gate_up, c)
    return down_decode(inter, weights, experts, w_down, s_down, c)


def gate_up_decode(x: torch.Tensor, experts: torch.Tensor, w_gate_up: torch.Tensor, s_gate_up: torch.Tensor,
                   c: DecodeConfig) -> torch.Tensor:
    """The first launch(es): -> the intermediate [T·k, I] in x.dtype, pair-major."""
    T, H = x.shape
    k = experts.shape[1]
    I = w_gate_up.shape[1] // 2
    SG, SKH = cdiv(I, 128), cdiv(H, 128)
    xq, xs = (x, x) if c.QX else quantize_act_triton(x)         # unused pointers when QX
    inter = torch.empty(T * k, I, dtype=x.dtype, device=x.device)
    launch(_gate_up_kernel, (T * k, cdiv(I, c.BR)),
           (x, xq, xs, experts, w_gate_up, s_gate_up, inter, H, I, SG, SKH, x.stride(0), k, c.BR,
            min(c.KG, pow2(SKH)), c.QX), num_warps=c.warps, num_stages=c.stages)
    return inter


def down_decode(inter: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w_down: torch.Tensor,
                s_down: torch.Tensor, c: DecodeConfig) -> torch.Tensor:
    """The last launch(es): the intermediate [T·k, I] -> [T, H] (the k pairs of a token summed)."""
    T, k = experts.shape
    H, I = w_down.shape[1], w_down.shape[2]
    SKI = cdiv(I, 128)
    iq, isc = (inter, inter) if c.QH else quantize_act_triton(inter)
    out = torch.empty(T, H, dtype=inter.dtype, device=inter.device)
    if c.PAR:
        kp = 1 << (k.bit_length() - 1)                  # the largest power of two <= k
        launch(_down_par_kernel, (T, cdiv(H, c.BR2)),
               (inter, iq, isc, experts, weights, w_down, s_down, out, H, I, SKI, out.stride(0), k, kp,
                pow2(max(k - kp, 1)), c.BR2, min(pow2(SKI), 4), c.QH), num_warps=c.warps2, num_stages=c.stages)
        return out
    launch(_down_kernel, (T, cdiv(H, c.BR2)),
           (inter, iq, isc, experts, weights, w_down, s_down, out, H, I, SKI, out.stride(0), k, c.BR2,
            min(pow2(SKI), 8), c.QH), num_warps=c.warps2, num_stages=c.stages)
    return out
