"""The GDN decode chain of one layer as one launch (``decode_fused_triton.py``): in_proj row -> out_proj row.

Equivalent to ``causal_conv1d_update`` (SiLU) + ``gdn_decode`` + ``gated_rms_norm`` on the same pools, with the
same roundings (conv output and recurrent output rounded to the activation dtype); only the order of the fp32
sums may differ. Switch: ``GDNSERVE_FUSED_DECODE=1`` (the mixers' ``fused_decode`` attribute; off by default until
the H200 has timed it, ``benchmarks/bench_decode_fused.py``).
"""
from __future__ import annotations

import os

import torch

from gdnserve.ops.checks import (
    ACT_DTYPES,
    STATE_DTYPES,
    check_contiguous,
    check_index,
    check_tensor,
)
from gdnserve.ops.gdn.decode_fused_triton import gdn_decode_fused_triton, quant_fusable

MAX_TILE = 128 * 128   # the [V, K] fp32 state tile of one program, in registers


def fused_decode_default() -> bool:
    return os.environ.get("GDNSERVE_FUSED_DECODE", "0") == "1"


def fused_decode_supported(H: int, HV: int, K: int, V: int, W: int) -> bool:
    """Shapes the one-launch kernel takes: the state tile fits registers, conv width 2..4."""
    return K * V <= MAX_TILE and 2 <= W <= 4 and HV % H == 0


def new_counters(num_slots: int, H: int, device) -> torch.Tensor:
    """The kernel's per-(slot, key head) arrival counters, zeroed (each launch leaves them at 0)."""
    return torch.zeros(num_slots, H, dtype=torch.int32, device=device)


def gdn_decode_fused(proj: torch.Tensor, conv_weight: torch.Tensor, conv_pool: torch.Tensor, A_log: torch.Tensor,
                     dt_bias: torch.Tensor, ssm_pool: torch.Tensor, slots: torch.Tensor, norm_weight: torch.Tensor,
                     eps: float, counters: torch.Tensor, H: int, scale: float | None = None, quant: bool = False,
                     tile: tuple[int, int] | None = None):
    """proj [B, D + 2·HV·V... ] the in_proj output rows ``[q | k | v | z | b | a]`` (unit column stride, any row
    stride); conv_weight [D, W] contiguous; conv_pool [S, W-1, D]; ssm_pool [S, HV, V, K]; slots [B] int32 (-1 =
    padding: zero output, no state touched); counters ``new_counters(S, H)``. Returns y [B, HV·V] in proj's dtype,
    with ``quant`` also its FP8 quantization (q [B, HV·V] e4m3, s [B, HV·V/128]) for out_proj's ``xq``. ``tile``:
    (V tiles per head, num_warps), default ``decode_fused_triton.fused_tile`` (environment overrides)."""
    check_tensor("ssm_pool", ssm_pool, [None] * 4, STATE_DTYPES)
    check_contiguous("ssm_pool", ssm_pool)
    S, HV, V, K = ssm_pool.shape
    dev = ssm_pool.device
    if H <= 0 or HV % H:
        raise ValueError(f"H: key heads H={H} must divide the value heads HV={HV} of ssm_pool")
    D = 2 * H * K + HV * V
    check_tensor("conv_weight", conv_weight, [D, None], ACT_DTYPES, dev)
    check_contiguous("conv_weight", conv_weight)
    W = conv_weight.shape[1]
    if not fused_decode_supported(H, HV, K, V, W):
        raise ValueError(f"gdn_decode_fused: K·V <= {MAX_TILE} and conv width 2..4 needed, got K={K} V={V} W={W}")
    check_index("slots", slots, None, dev)
    B = slots.shape[0]
    check_tensor("proj", proj, [B, D + 2 * HV + HV * V], ACT_DTYPES, dev)
    if proj.stride(1) != 1:
        raise ValueError("proj: expected a unit column stride")
    check_tensor("conv_pool", conv_pool, [None, W - 1, D], [proj.dtype], dev)
    check_contiguous("conv_pool", conv_pool)
    check_tensor("A_log", A_log, [HV], [torch.float32], dev)
    check_tensor("dt_bias", dt_bias, [HV], [torch.float32, torch.bfloat16], dev)
    check_tensor("norm_weight", norm_weight, [V], ACT_DTYPES, dev)
    check_tensor("counters", counters, [S, H], [torch.int32], dev)
    if quant and not quant_fusable(V):
        raise ValueError(f"quant: needs V a power-of-two multiple of 128, got V={V}")
    if tile is not None and not (tile[0] >= 1 and tile[0] & (tile[0] - 1) == 0 and tile[0] <= V):
        raise ValueError(f"tile: V tiles per head must be a power of two in 1..V, got {tile[0]}")
    scale = float(K ** -0.5 if scale is None else scale)
    return gdn_decode_fused_triton(proj, conv_weight, conv_pool, A_log, dt_bias, ssm_pool, slots, norm_weight, eps,
                                   counters, H, scale, quant, tile)
