"""The routed-experts op: picks the PyTorch loop or the Triton grouped GEMM (ops/backend.py)."""
from __future__ import annotations

import torch

from gdnserve.ops.backend import Backend, resolve
from gdnserve.ops.launch import cdiv
from gdnserve.ops.moe.align import Alignment
from gdnserve.ops.moe.align_triton import align_pairs_triton
from gdnserve.ops.moe.decode_fp8_triton import moe_experts_fp8_decode, uses_decode
from gdnserve.ops.moe.fp8_torch import moe_experts_fp8_torch
from gdnserve.ops.moe.grouped_fp8_triton import moe_experts_fp8_triton
from gdnserve.ops.moe.grouped_triton import block_rows, moe_experts_triton
from gdnserve.ops.moe.torch_path import moe_experts_torch
from gdnserve.ops.quant.fp8_linear import use_triton


def moe_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor, backend: Backend = "auto",
                scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                alignment: Alignment | None = None, config: object | None = None) -> torch.Tensor:
    """Sum over each token's k experts of ``weights[t, j] * down_e(silu(gate_e x) * up_e x)``.

    ``config``: the launch config of the Triton path this call takes, for this call only (benchmarks' sweeps):
    a ``decode_fp8_triton.DecodeConfig``, a ``grouped_fp8_triton`` tile pair or a ``grouped_triton.Config``.

    x [T, H] (activation dtype); weights [T, k] (x.dtype); experts [T, k] int (distinct per row, in
    [0, E)); w_gate_up [E, 2I, H] rows ``[gate I | up I]``; w_down [E, H, I] -> [T, H] in x.dtype.
    The Triton path reads nothing on the host (CUDA-graph safe); the PyTorch path reads expert counts.

    FP8 experts: w_gate_up / w_down float8_e4m3fn and ``scales`` = (gate_up scales [E, 2·ceil(I/128),
    ceil(H/128)], down scales [E, ceil(H/128), ceil(I/128)]) float32; activations are quantized per
    token-group of 128 on the fly (``grouped_fp8_triton``: native fp8 dots, on CUDA devices with fp8 tensor
    cores or Triton's interpreter, else the dequantizing ``fp8_torch`` path; a few pairs, ``decode_fp8_triton``).
    ``alignment``: the Triton path's grouping of ``experts`` when the caller has it already (the fused router,
    ``router.route``); None = aligned here."""
    if x.dim() != 2 or weights.shape != experts.shape or weights.shape[0] != x.shape[0]:
        raise ValueError(f"moe_experts: x [T, H], weights/experts [T, k]; got {list(x.shape)}, "
                         f"{list(weights.shape)}, {list(experts.shape)}")
    E, I2, H = w_gate_up.shape
    if H != x.shape[1] or w_down.shape != (E, H, I2 // 2):
        raise ValueError(f"moe_experts: w_gate_up {list(w_gate_up.shape)} / w_down {list(w_down.shape)} do not "
                         f"match hidden {x.shape[1]}")
    want = x.dtype if scales is None else torch.float8_e4m3fn
    if w_gate_up.dtype != want or w_down.dtype != want:
        raise ValueError(f"moe_experts: expert weights ({w_gate_up.dtype}, {w_down.dtype}) must have dtype {want}"
                         + (" (x's dtype)" if scales is None else " (FP8 experts: scales given)"))
    if scales is not None:
        _check_scales(scales, E, H, I2 // 2)
        if not use_triton(x, backend):
            return moe_experts_fp8_torch(x, weights, experts, w_gate_up, w_down, *scales)
    elif resolve(backend, x) == "torch":
        return moe_experts_torch(x, weights, experts, w_gate_up, w_down)
    if not (w_gate_up.is_contiguous() and w_down.is_contiguous()):   # never copy every expert on every step
        raise ValueError("moe_experts: the Triton path needs contiguous expert weights (make them so at load time)")
    if x.stride(1) != 1:
        x = x.contiguous()
    T, k = experts.shape
    if T == 0:
        return torch.zeros_like(x)
    if scales is not None and uses_decode(T * k):      # decode sizes: two GEMV launches, no alignment
        return moe_experts_fp8_decode(x, weights.contiguous(), experts.contiguous(), w_gate_up, w_down, *scales,
                                      config=config)
    BM = block_rows(T * k, E)
    if alignment is not None and alignment.BM != BM:
        raise ValueError(f"moe_experts: alignment row block {alignment.BM} != the grouped GEMM's {BM}")
    al = alignment
    if al is None:
        al = align_pairs_triton(experts, E, BM)        # any size: one program, or multi-program above MAX_PAIRS
    if scales is not None:
        return moe_experts_fp8_triton(x, weights.contiguous(), al, w_gate_up, w_down, k, *scales, config=config)
    return moe_experts_triton(x, weights.contiguous(), al, w_gate_up, w_down, k, config=config)


def _check_scales(scales: tuple[torch.Tensor, torch.Tensor], E: int, H: int, I: int) -> None:
    s_gu, s_dn = scales
    want_gu, want_dn = [E, 2 * cdiv(I, 128), cdiv(H, 128)], [E, cdiv(H, 128), cdiv(I, 128)]
    if list(s_gu.shape) != want_gu or list(s_dn.shape) != want_dn:
        raise ValueError(f"moe_experts: FP8 scales {list(s_gu.shape)} / {list(s_dn.shape)}, expected {want_gu} / "
                         f"{want_dn}")
    if s_gu.dtype != torch.float32 or s_dn.dtype != torch.float32 or not (s_gu.is_contiguous() and s_dn.is_contiguous()):
        raise ValueError("moe_experts: FP8 scales must be contiguous float32 (convert at load time)")
