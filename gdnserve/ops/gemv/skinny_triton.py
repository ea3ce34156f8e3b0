"""y = x Wᵀ for M <= 16 rows of x (decode steps) in ONE launch: no split-K, no separate reduce kernel.

cuBLAS runs the decode projections at M = 1..16 as split-K GEMMs (a partial-sum kernel + ``splitKreduce``)
where N is small (the 2048-wide output projections) and as 128x8 tiles otherwise. Here every program owns
``BN`` output columns over the WHOLE of K: it streams its ``BN x K`` slab of W once through a ``num_stages``
software pipeline and multiplies it with the (zero-padded) ``16 x BK`` tiles of x on the tensor cores, fp32
accumulation, one bf16 rounding at the end. The reduction order is fixed by the config (K in BK steps, in
order): deterministic, the same bits eager or replayed in a CUDA graph.

At M = 1..4 a CUDA-core variant (``dot=False``) runs more, smaller programs: each streams its ``BN`` rows of W
ONCE per K step and multiplies that tile with every row of x (fp32 products summed per K step, one bf16 rounding
at the end), so M = 2..4 (a speculative verify step's k + 1 rows) reads W as often as M = 1 does. The rows are a
compile-time count (one binary per M) unrolled over the same ``[BN, BK]`` tile: row i's per-step sum is the same
``tl.sum`` of the same tile whatever M is, so for a fixed config row i's result is BIT-IDENTICAL at M = 1, 2, 3, 4
(batch-invariant; ``tests/ops/test_gemv.py`` checks it, on the GPU too). ``dense_linear`` as a whole is
batch-invariant across M only where ``TABLE`` gives those M the same config (the provisional M = 2..4 entries
below reuse the M = 1 config for that reason; the tensor-core variant's sums differ from the CUDA-core one's).

``skinny_config`` picks the config from ``TABLE`` (measured on the H200 against cuBLAS,
``benchmarks/bench_decode_b1.py`` and, for the CUDA-core variant at M = 1..4, ``benchmarks/bench_skinny_m4.py``): per
(N, K), M-ranges where the kernel beat cuBLAS with their config. Shapes and M outside the table return None (the caller keeps ``F.linear``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from gdnserve.ops.checks import check_tensor
from gdnserve.ops.launch import cdiv, launch, pow2
from gdnserve.ops.tl_compat import cast, mma

MAX_M = 16
FMA_MAX_M = 4      # the CUDA-core variant's rows (one binary per M; its W tile is reused for every row)


class SkinnyConfig(NamedTuple):
    BN: int            # output columns per program
    BK: int            # K step
    warps: int
    stages: int
    dot: bool = True   # tensor cores on 16-row tiles of x; False: CUDA-core FMAs, M <= FMA_MAX_M


# (N, K) -> ((largest M, config), ...) ascending in M: M takes the first entry whose bound holds; M past the
# last bound keeps cuBLAS. The H200 sweeps' winners: M = 1 from benchmarks/results/decode_b1_h200.json and
# decode_b1_m1_h200.json (whole-K steps), M = 2..4 (speculative verify steps, k = 1..3 drafts) from
# benchmarks/results/skinny_m4_h200.json (bench_skinny_m4: the CUDA-core variant against cuBLAS; cuBLAS keeps the
# large projections from M = 2 or 3 on, where it streams W as fast). Benchmarks swap the dict to compare.
_FMA_8x1024 = SkinnyConfig(8, 1024, 8, 1, False)
_FMA_2x2048 = SkinnyConfig(2, 2048, 4, 1, False)
_FMA_4x2048 = SkinnyConfig(4, 2048, 4, 1, False)
TABLE: dict[tuple[int, int], tuple[tuple[int, SkinnyConfig], ...]] = {
    (2048, 4096): ((1, SkinnyConfig(2, 4096, 4, 1, False)), (2, SkinnyConfig(2, 2048, 4, 2, False))),  # GDN out / o_proj / MTP fc
    (12352, 2048): ((1, SkinnyConfig(4, 512, 4, 1, False)), (2, SkinnyConfig(32, 256, 4, 4))),   # GDN in_proj
    (9216, 2048): ((1, SkinnyConfig(8, 512, 4, 2, False)),),    # attention qkv_proj (target + MTP layer)
    (257, 2048): ((1, _FMA_8x1024), (3, _FMA_2x2048), (4, _FMA_4x2048),
                  (16, SkinnyConfig(16, 512, 4, 3))),           # router gate + the shared expert's row
    (256, 2048): ((1, _FMA_8x1024), (3, _FMA_2x2048), (4, _FMA_4x2048)),   # router gate alone (FP8 models)
    (1024, 2048): ((1, SkinnyConfig(2, 2048, 8, 1, False)), (3, _FMA_2x2048), (4, _FMA_4x2048)),   # shared expert
    (2048, 512): ((3, SkinnyConfig(4, 512, 4, 1, False)),),     # gate_up / down when not folded
}
# Unmeasured entries (none today): a shape's M range taken on a guess, before bench_skinny_m4 measured it.
PROVISIONAL: dict[tuple[int, int], tuple[int, ...]] = {}


@triton.jit(do_not_specialize=["M"])         # one binary for every M
def _skinny_kernel(x, w, y, g, M, N, K, stride_x, stride_w, stride_y, stride_gt, stride_gh,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                   GATED: tl.constexpr, GD: tl.constexpr):
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    mm, nm = rm < M, rn < N
    xp = x + rm[:, None] * stride_x + rk[None, :]
    wp = w + rn[:, None].to(tl.int64) * stride_w + rk[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        if EVEN_K:
            a = tl.load(xp, mask=mm[:, None], other=0.0)
            b = tl.load(wp, mask=nm[:, None], other=0.0)
        else:
            km = (k0 + rk) < K
            a = tl.load(xp, mask=mm[:, None] & km[None, :], other=0.0)
            b = tl.load(wp, mask=nm[:, None] & km[None, :], other=0.0)
        if GATED:
            kg = k0 + rk
            gv = tl.load(g + rm[:, None] * stride_gt + ((kg // GD) * stride_gh + kg % GD)[None, :],
                         mask=mm[:, None] & (kg < K)[None, :], other=0.0)
            a = _gate(a, gv)
        acc += mma(a, tl.trans(b), "ieee")
        xp += BK
        wp += BK
    tl.store(y + rm[:, None] * stride_y + rn[None, :], cast(acc, y.dtype.element_ty), mask=mm[:, None] & nm[None, :])


@triton.jit
def _gate(a, gv):
    """a * sigmoid(gv) rounded as torch rounds ``a * torch.sigmoid(gv)``: the sigmoid, then the product."""
    s = cast(tl.sigmoid(gv.to(tl.float32)), a.dtype)
    return cast(a.to(tl.float32) * s.to(tl.float32), a.dtype)


@triton.jit
def _gemv_kernel(x, w, y, g, N, K, stride_x, stride_w, stride_y, stride_gt, stride_gh,
                 BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, GATED: tl.constexpr, GD: tl.constexpr,
                 ROWS: tl.constexpr, BM: tl.constexpr):
    """M = ROWS (1..4) on the CUDA cores: each program's BN rows of W (one [BN, BK] tile per K step, loaded once)
    times every row of x, fp32 products summed per K step. ROWS = 1 is the original M = 1 code (its measured
    binary); ROWS > 1 computes each row's step sum exactly as it does (same tile, same ``tl.sum``) and adds it into
    column m of a [BN, BM] accumulator (the other columns add 0.0: exact), so rows match M = 1 bit for bit."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    nm = rn < N
    wp = w + rn[:, None].to(tl.int64) * stride_w + rk[None, :]
    if ROWS == 1:
        acc = tl.zeros([BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            if EVEN_K:
                a = tl.load(x + k0 + rk)
                b = tl.load(wp, mask=nm[:, None], other=0.0)
            else:
                km = (k0 + rk) < K
                a = tl.load(x + k0 + rk, mask=km, other=0.0)
                b = tl.load(wp, mask=nm[:, None] & km[None, :], other=0.0)
            if GATED:
                kg = k0 + rk
                a = _gate(a, tl.load(g + (kg // GD) * stride_gh + kg % GD, mask=kg < K, other=0.0))
            acc += tl.sum(b.to(tl.float32) * a.to(tl.float32)[None, :], axis=1)
            wp += BK
        tl.store(y + rn, cast(acc, y.dtype.element_ty), mask=nm)
    else:
        rm = tl.arange(0, BM)
        acc = tl.zeros([BN, BM], dtype=tl.float32)
        for k0 in range(0, K, BK):
            kg = k0 + rk
            km = kg < K
            if EVEN_K:
                b = tl.load(wp, mask=nm[:, None], other=0.0)
            else:
                b = tl.load(wp, mask=nm[:, None] & km[None, :], other=0.0)
            bf = b.to(tl.float32)
            for m in tl.static_range(ROWS):
                if EVEN_K:
                    a = tl.load(x + m * stride_x + kg)
                else:
                    a = tl.load(x + m * stride_x + kg, mask=km, other=0.0)
                if GATED:
                    a = _gate(a, tl.load(g + m * stride_gt + (kg // GD) * stride_gh + kg % GD, mask=km, other=0.0))
                d = tl.sum(bf * a.to(tl.float32)[None, :], axis=1)
                acc += tl.where(rm[None, :] == m, d[:, None], 0.0)
            wp += BK
        tl.store(y + rm[None, :] * stride_y + rn[:, None], cast(acc, y.dtype.element_ty),
                 mask=nm[:, None] & (rm < ROWS)[None, :])


def skinny_config(M: int, N: int, K: int) -> SkinnyConfig | None:
    """The config for an [M, K] x [N, K]ᵀ product, or None where cuBLAS is the faster (or unmeasured) choice."""
    if not 1 <= M <= MAX_M:
        return None
    for bound, cfg in TABLE.get((N, K), ()):
        if M <= bound:
            return cfg if cfg.dot or M <= FMA_MAX_M else None      # the CUDA-core variant: M <= 4
    return None


def gate_fits(cfg: SkinnyConfig, x: torch.Tensor, gate: torch.Tensor) -> bool:
    """Whether ``skinny_linear(x, w, cfg, gate)`` takes this gate: [M, G, GD] with G * GD = K, unit last stride,
    x's dtype."""
    return (gate.dim() == 3 and gate.shape[0] == x.shape[0] and gate.shape[1] * gate.shape[2] == x.shape[1]
            and gate.dtype == x.dtype and gate.stride(2) == 1)


def skinny_linear(x: torch.Tensor, w: torch.Tensor, cfg: SkinnyConfig,
                  gate: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (M <= 16, dot=False: M <= 4; unit last stride) · w [N, K]ᵀ (unit last stride, same dtype) -> [M, N]
    in x's dtype.
    ``gate`` [M, G, GD] (G * GD = K, see ``gate_fits``): the product of ``x * sigmoid(gate.reshape(M, K))``,
    the gate applied as x's K tiles load (attention's output gate before o_proj, no elementwise launches)."""
    check_tensor("skinny_linear: x", x, (None, None), (torch.bfloat16, torch.float16))
    check_tensor("skinny_linear: w", w, (None, x.shape[1]), (x.dtype,))
    if gate is not None and not gate_fits(cfg, x, gate):
        raise ValueError(f"skinny_linear: gate of shape {list(gate.shape)} / strides {gate.stride()} does not fit x "
                         f"{list(x.shape)}")
    if not 1 <= x.shape[0] <= (MAX_M if cfg.dot else FMA_MAX_M):
        raise ValueError(f"skinny_linear: x has {x.shape[0]} rows, must be in [1, {MAX_M if cfg.dot else FMA_MAX_M}] "
                         f"for {cfg}")
    return skinny_unchecked(x, w, cfg, gate)


def skinny_unchecked(x: torch.Tensor, w: torch.Tensor, cfg: SkinnyConfig,
                     gate: torch.Tensor | None = None) -> torch.Tensor:
    """``skinny_linear`` without its checks (host time per decode projection): for callers that hold x, w, the
    gate and a config from ``skinny_config`` to the same conditions (``layers.linear.dense_linear``)."""
    M, K = x.shape
    N = w.shape[0]
    gp, sgt, sgh, GD = (gate, gate.stride(0), gate.stride(1), gate.shape[2]) if gate is not None else (x, 0, 0, 1)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if not cfg.dot:
        launch(_gemv_kernel, (cdiv(N, cfg.BN),), (x, w, y, gp, N, K, x.stride(0), w.stride(0), y.stride(0), sgt, sgh,
                                                 cfg.BN, cfg.BK, K % cfg.BK == 0, gate is not None, GD, M, pow2(M)),
               num_warps=cfg.warps, num_stages=cfg.stages)
        return y
    launch(_skinny_kernel, (cdiv(N, cfg.BN),), (x, w, y, gp, M, N, K, x.stride(0), w.stride(0), y.stride(0), sgt,
                                                sgh, MAX_M, cfg.BN, cfg.BK, K % cfg.BK == 0, gate is not None, GD),
           num_warps=cfg.warps, num_stages=cfg.stages)
    return y
