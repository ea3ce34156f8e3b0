"""Partial rotary embedding (rotate-half on the first ``rotary_dim`` dims of each head), and the attention
prologue that fuses it with the zero-centred q/k RMSNorm: ``rope(rms_norm(x))`` per (token, head).

PyTorch path: Qwen3.5's ops (cos/sin of ``position * inv_freq`` in fp32, rounded to the activation dtype;
``x * cos + rotate_half(x) * sin`` in the activation dtype). Triton path (``rope_triton.py``): one launch per
tensor (q or k) for the norm, the angles and the rotation, rounding at the same points as the PyTorch path
(cos/sin and the mean square may differ by an fp32 ulp, so outputs by at most one rounding).
"""
from __future__ import annotations

import torch

from gdnserve.ops.backend import Backend, resolve
from gdnserve.ops.checks import ACT_DTYPES, check_tensor
from gdnserve.ops.norm.rmsnorm import check_rows, rms_norm_torch


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] int -> (cos, sin) [T, rotary_dim] in ``dtype`` (angles ``position * inv_freq`` twice)."""
    f = positions[:, None].float() * inv_freq.to(positions.device)[None, :]
    emb = torch.cat([f, f], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos, sin [T, rotary_dim] -> the first rotary_dim dims rotated (rotate-half)."""
    rd = cos.shape[-1]
    xr, xp = x[..., :rd], x[..., rd:]
    x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
    rot = torch.cat([-x2, x1], dim=-1)
    out = xr * cos[:, None, :] + rot * sin[:, None, :]
    return torch.cat([out, xp], dim=-1)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
                  inv_freq: torch.Tensor, backend: Backend = "auto") -> torch.Tensor:
    """x [T, G, Dh] (unit last stride, any row strides); weight [Dh] (zero-centred); positions [T] int64;
    inv_freq [rotary_dim / 2] (read in fp32) -> ``rope(rms_norm(x))`` [T, G, Dh] contiguous, in x's dtype."""
    if resolve(backend, x) == "torch":
        cos, sin = rope_cos_sin(positions, inv_freq, x.dtype)
        return apply_rope(rms_norm_torch(x, weight, eps), cos, sin)
    from gdnserve.ops.attention.rope_triton import rms_norm_rope_triton
    check_rows("rms_norm_rope: x", x)
    if x.dim() != 3:
        raise ValueError(f"rms_norm_rope: x must be [T, G, Dh], got {list(x.shape)}")
    T, _, Dh = x.shape
    check_tensor("rms_norm_rope: weight", weight, (Dh,), ACT_DTYPES, x.device)
    check_tensor("rms_norm_rope: positions", positions, (T,), (torch.int64, torch.int32), x.device)
    half = inv_freq.shape[0] if inv_freq.dim() == 1 else -1
    check_tensor("rms_norm_rope: inv_freq", inv_freq, (half,), ACT_DTYPES, x.device)
    if not 1 <= 2 * half <= Dh:
        raise ValueError(f"rms_norm_rope: rotary_dim = 2 * {half} must be in [2, head_dim={Dh}]")
    return rms_norm_rope_triton(x, weight, eps, positions, inv_freq)
