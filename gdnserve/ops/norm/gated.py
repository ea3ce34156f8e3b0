"""The GDN output norm, norm before gate, plain weight (gdn_kernels.md §1.2 step 8):
``out = w * (x / rms(x)) * silu(z)`` over the value dim of each (token, value head).

PyTorch path: HF's roundings (normalise in fp32, round to x's dtype, multiply by w in the promoted dtype,
multiply by silu(z) in fp32, round). Triton path (``gated_triton.py``): one launch that reads ``z`` in place
(a strided column slice of the input projection: the PyTorch path copies it), rounding at the same points.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gdnserve.ops.backend import Backend, resolve
from gdnserve.ops.checks import ACT_DTYPES, check_tensor
from gdnserve.ops.norm.rmsnorm import check_rows


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   backend: Backend = "auto", quant: bool = False):
    """x, z [..., V] (Triton: [R, V] or [T, G, V], unit last stride, any row strides; z any float dtype);
    weight [V] -> [..., V] in x's dtype, contiguous. ``quant``: ``(out, (q, s))`` with (q [T, G·V] e4m3,
    s [T, ceil(G·V / 128)] float32) = ``quantize_act_triton(out.view(T, G·V))`` (out_proj's ``xq``; the
    Triton kernel quantizes in its registers where V is a power of two and G·V a multiple of 128)."""
    if resolve(backend, x) == "torch":
        out = gated_rms_norm_torch(x, z, weight, eps)
        if not quant:
            return out
        from gdnserve.ops.quant.quant_out import quantize_out_torch
        return out, quantize_out_torch(out.reshape(x.shape[0] if x.dim() > 1 else 1, -1))
    from gdnserve.ops.norm.gated_triton import gated_rms_norm_triton
    check_rows("gated_rms_norm: x", x)
    check_tensor("gated_rms_norm: z", z, tuple(x.shape), ACT_DTYPES, x.device)
    check_tensor("gated_rms_norm: weight", weight, (x.shape[-1],), ACT_DTYPES, x.device)
    return gated_rms_norm_triton(x, z, weight, eps, quant=quant)


def gated_rms_norm_torch(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    shape, V = x.shape, x.shape[-1]
    x, z = x.reshape(-1, V), z.reshape(-1, V)
    dt = x.dtype
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dt)
    y = weight * y
    return (y * F.silu(z.float())).to(dt).view(shape)
