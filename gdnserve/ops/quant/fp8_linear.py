"""The FP8 linear op: ``y = x · Wᵀ`` for a block-quantized W, on Triton (CUDA devices with fp8 tensor
cores, compute capability >= 8.9; or Triton's interpreter on CPU tensors with backend="triton") or the
dequantizing PyTorch reference (``fp8_ref.fp8_linear_torch``: CPUs, older GPUs). Both quantize x per
token-group of 128 the same way, so they differ only by accumulation order.

Triton paths by token count M: M <= ``Fp8LinearConfig.gemv_max_m`` (1) ``fp8_gemv_triton`` (the CUDA-core GEMV, the dense tail
in its launch; x quantized inside it for weights of <= ``QX_MAX_WEIGHTS`` elements, else by its own launch:
``Fp8LinearConfig.gemv_quant_inside``); M >= 512 ``fp8_scaled_mm`` (cuBLAS block-scaled ``torch._scaled_mm``)
where the device's torch has it and the shape fits (H200, torch 2.11: 0.72-0.96x bf16's time at M = 4096, 1.9x
faster than the Triton GEMM; ``Fp8LinearConfig.scaled_mm``); otherwise ``fp8_gemm_triton`` (a quantization
launch + the block-scaled GEMM; a dense tail by ``F.linear``). The dispatch is the device's row of ``TABLE``, a
call's ``config=``, or ``override(...)`` on top of the row for every call (benchmarks timing a variant end to end,
tests): no module global to flip. (The one-launch skinny kernel with x quantized in its registers or weight-only,
2.5-5x slower than this path on the H200 (benchmarks/results/fp8_h200.md), and the weight-only mode that only it
served, were deleted: issue 28's one kernel per job.)

``tail``: an optional dense (unquantized) weight [N2, K] whose rows follow W's in the output — a fused
projection whose last blocks the checkpoint keeps in bf16 (Qwen3.5's GDN ``in_proj_b`` / ``in_proj_a``).

``xq``: x's quantization ``(q [M, K] e4m3, s [M, ceil(K/128)] float32)``, both contiguous, exactly what
``quantize_act_triton(x)`` returns — handed over by the kernel that produced x (the decoder's add + RMSNorm,
the GDN gated norm, attention's sigmoid gate quantize their own output in registers: ``quant=True`` of those
ops), so the Triton GEMV and GEMM skip their quantization launch. The cuBLAS path (which wants its scales
transposed), the skinny kernel and the PyTorch reference ignore it (they quantize x themselves: the same
numbers). ``quantizes_input`` says, from shapes and devices alone, whether a call would run that launch (so
a producer quantizes only where it saves one).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from gdnserve.ops.backend import Backend, resolve
from gdnserve.ops.overrides import override_fields
from gdnserve.ops.quant.fp8_ref import BLOCK, cdiv, fp8_linear_torch

if TYPE_CHECKING:
    from gdnserve.ops.quant.fp8_gemm_triton import GemmConfig
    from gdnserve.ops.quant.fp8_gemv_triton import GemvConfig


@dataclass(frozen=True, slots=True)
class Fp8LinearConfig:
    """The Triton dispatch of ``fp8_linear``: one row per GPU model (``TABLE``), or a call's ``config=``."""
    gemv_max_m: int = 1                 # the CUDA-core GEMV (``fp8_gemv_triton``) for M <= this (<= its MAX_M)
    gemv: GemvConfig | None = None      # the GEMV's tiles (None: ``fp8_gemv_triton.config``'s pick)
    gemm: GemmConfig | None = None      # the Triton GEMM's tiles (None: ``fp8_gemm_triton.config``'s pick)
    # M = 1: x quantized inside the GEMV (one launch) or by its own launch; None = by size: inside for weights of
    # at most QX_MAX_WEIGHTS elements (H200, 701784f: the shared expert's gate_up 4.3 vs 7.4 µs, down 3.5 vs 7.1;
    # the large projections lose: in_proj 20.1 vs 14.2, qkv 14.8 vs 12.4, out_proj 10.2 vs 9.9)
    gemv_quant_inside: bool | None = None
    scaled_mm: bool = True              # cuBLAS's block-scaled _scaled_mm where it takes the call (M >= MIN_M)


DEFAULT = Fp8LinearConfig()
TABLE: dict[str, Fp8LinearConfig] = {   # keyed by ``torch.cuda.get_device_name``; others take DEFAULT
    "NVIDIA H200": DEFAULT,             # GEMV at M = 1 only (benchmarks/results/fp8_h200.md)
}
QX_MAX_WEIGHTS = 1 << 22
_OVERRIDES: dict[str, object] = {}


@lru_cache(maxsize=16)
def _device_row(index: int) -> Fp8LinearConfig:
    return TABLE.get(torch.cuda.get_device_name(index), DEFAULT)


def linear_config(device: torch.device) -> Fp8LinearConfig:
    """The device's row (DEFAULT off CUDA: the interpreter), with ``override``'s fields on top."""
    row = _device_row(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else DEFAULT
    return dataclasses.replace(row, **_OVERRIDES) if _OVERRIDES else row


def override(**fields):
    """Temporarily replace Fp8LinearConfig fields for every call without a ``config=`` (a variant timed end to
    end through a whole model, tests); ValueError for a field the config does not have."""
    return override_fields(Fp8LinearConfig, _OVERRIDES, fields)


@lru_cache(maxsize=None)
def _fp8_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def use_triton(x: torch.Tensor, backend: Backend) -> bool:
    if resolve(backend, x) != "triton":
        return False
    return not x.is_cuda or _fp8_capable(x.device.index or 0)


def check_fp8_weight(qw: torch.Tensor, sw: torch.Tensor, K: int, owner: str = "fp8_linear") -> None:
    """ValueError unless qw is e4m3 [N, K] and sw float [ceil(N/128), ceil(K/128)]."""
    if qw.dtype != torch.float8_e4m3fn or qw.dim() != 2 or qw.shape[1] != K:
        raise ValueError(f"{owner}: weight must be float8_e4m3fn [N, {K}], got {qw.dtype} {list(qw.shape)}")
    want = [cdiv(qw.shape[0], BLOCK), cdiv(K, BLOCK)]
    if list(sw.shape) != want or not sw.is_floating_point():
        raise ValueError(f"{owner}: weight_scale_inv must be float {want}, got {sw.dtype} {list(sw.shape)}")


def gemv_quantizes_inside(M: int, N: int, K: int, cfg: Fp8LinearConfig = DEFAULT) -> bool:
    """Whether the M = 1 GEMV quantizes x inside its programs for an [N, K] weight (``cfg.gemv_quant_inside``;
    None: by size, ``QX_MAX_WEIGHTS``), rather than taking it from a quantization launch or the producer."""
    return M == 1 and (N * K <= QX_MAX_WEIGHTS if cfg.gemv_quant_inside is None else cfg.gemv_quant_inside)


def fp8_linear(x: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor, tail: torch.Tensor | None = None,
               backend: Backend = "auto", xq: tuple[torch.Tensor, torch.Tensor] | None = None,
               config: Fp8LinearConfig | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N (+ N2)] in x.dtype. qw [N, K] float8_e4m3fn, sw [ceil(N/128), ceil(K/128)]
    (float32 on the Triton path), tail [N2, K] in x.dtype or None; x is quantized per token-group of 128.
    ``xq``: None or x's quantization (q [M, K] e4m3,
    s [M, ceil(K/128)] float32, contiguous, M = x's rows: ``quantize_act_triton(x)``'s numbers), used by
    the Triton GEMV / GEMM instead of their own quantization launch. ``config``: the Triton dispatch for this
    call (None: the device's row, ``linear_config``)."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    M, N, N2 = x2.shape[0], qw.shape[0], 0 if tail is None else tail.shape[0]
    if xq is not None:
        check_quantized_input(xq, M, K, x.device)
    if not use_triton(x, backend):
        y = fp8_linear_torch(x2, qw, sw)
        if N2:
            y = torch.cat([y, F.linear(x2, tail)], dim=1)
        return y.view(*lead, N + N2)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    if sw.dtype != torch.float32:
        raise ValueError(f"fp8_linear: the Triton path needs float32 weight_scale_inv (convert at load), got {sw.dtype}")
    y = torch.empty(M, N + N2, dtype=x.dtype, device=x.device)
    cfg = config if config is not None else linear_config(x.device)
    if M <= cfg.gemv_max_m:
        from gdnserve.ops.quant.fp8_gemm_triton import quantize_act_triton
        from gdnserve.ops.quant.fp8_gemv_triton import fp8_gemv
        if xq is None:
            xq = (None, None) if gemv_quantizes_inside(M, N, K, cfg) else quantize_act_triton(x2)
        fp8_gemv(x2, *xq, qw, sw, y, tail=tail, config=cfg.gemv)
        return y.view(*lead, N + N2)
    from gdnserve.ops.quant.fp8_scaled_mm import scaled_mm_linear, use_scaled_mm
    if cfg.scaled_mm and use_scaled_mm(x2, N):
        scaled_mm_linear(x2, qw, sw, out=y[:, :N])
    elif xq is not None:
        from gdnserve.ops.quant.fp8_gemm_triton import fp8_gemm_quantized
        fp8_gemm_quantized(xq[0], xq[1], qw, sw, y[:, :N], cfg.gemm)
    else:
        from gdnserve.ops.quant.fp8_gemm_triton import fp8_gemm_triton
        fp8_gemm_triton(x2, qw, sw, out=y[:, :N], config=cfg.gemm)
    if N2:
        y[:, N:] = F.linear(x2, tail)
    return y.view(*lead, N + N2)


def check_quantized_input(xq: tuple[torch.Tensor, torch.Tensor], M: int, K: int, device: torch.device) -> None:
    """ValueError unless xq is (q [M, K] float8_e4m3fn, s [M, ceil(K/128)] float32), contiguous, on x's device."""
    if not isinstance(xq, (tuple, list)) or len(xq) != 2:
        raise ValueError(f"fp8_linear: xq must be a (q, s) pair, got {type(xq).__name__}")
    q, s = xq
    for name, t, shape, dt in (("q", q, (M, K), torch.float8_e4m3fn), ("s", s, (M, cdiv(K, BLOCK)), torch.float32)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dt or not t.is_contiguous() \
                or t.device != device:
            got = f"{t.dtype} {list(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"fp8_linear: xq's {name} must be contiguous {dt} {list(shape)} on {device}, got {got}")


def quantizes_input(x: torch.Tensor, N: int, backend: Backend = "auto",
                    config: Fp8LinearConfig | None = None) -> bool:
    """Whether ``fp8_linear(x, qw [N, K], ...)`` would quantize x by a launch of its own (the Triton GEMV at
    M = 1 with a weight too large for in-kernel quantization, M = 2 ... gemv_max_m, the Triton GEMM where cuBLAS
    does not take the call), i.e. whether handing it ``xq`` saves a launch. x: a tensor of the shape, dtype
    and device the linear will get (its producer's input serves). Shapes, devices and flags only: no host
    sync, the same answer on every replay of a captured graph."""
    K = x.shape[-1]
    M = x.numel() // K if K else 0
    if M == 0 or K == 0 or not use_triton(x, backend):
        return False
    cfg = config if config is not None else linear_config(x.device)
    if M <= cfg.gemv_max_m:
        return not gemv_quantizes_inside(M, N, K, cfg)
    from gdnserve.ops.quant.fp8_scaled_mm import use_scaled_mm
    return not (cfg.scaled_mm and use_scaled_mm(x.reshape(M, K), N))
