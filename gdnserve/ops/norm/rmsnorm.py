"""The zero-centred RMSNorm ``y = s / rms(s) * (1 + w)`` of the decoder layers and the q/k norms, optionally
fused with the residual add before it: ``s = x + residual``.

PyTorch path: HF's roundings (the sum in the activation dtype, the norm in fp32, one cast back); used on CPU
and wherever HF parity is checked. Triton path (``rmsnorm_triton.py``): one launch for the add, the norm
and both stores, rounding at the same points: ``s`` is bit-equal to the PyTorch sum, ``y`` differs from the
PyTorch path only by the fp32 reduction order of the mean square (at most one rounding of the output).
"""
from __future__ import annotations

import torch

from gdnserve.ops.backend import Backend, resolve
from gdnserve.ops.checks import ACT_DTYPES, check_tensor


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             backend: Backend = "auto", quant: bool = False) -> torch.Tensor | tuple:
    """x [..., N] (Triton: [R, N] or [T, G, N], unit last stride, any row strides); weight [N]; residual
    None or x's shape and dtype. Returns ``y`` (x's dtype, contiguous) when residual is None, else
    ``(y, s)`` with ``s = x + residual`` in x's dtype (the new residual stream). ``quant``: one more
    element appended, ``(q [R, N] e4m3, s [R, ceil(N/128)] float32)`` = ``quantize_act_triton(y [R, N])``
    (an FP8 linear's ``xq``; the Triton kernel quantizes y in its registers, no extra launch)."""
    if resolve(backend, x) == "torch":
        out = rms_norm_torch(x, weight, eps, residual)
        if not quant:
            return out
        from gdnserve.ops.quant.quant_out import quantize_out_torch
        y = out if residual is None else out[0]
        return (out if residual is not None else (out,)) + (quantize_out_torch(y.reshape(-1, y.shape[-1])),)
    from gdnserve.ops.norm.rmsnorm_triton import rms_norm_triton
    check_rows("rms_norm: x", x)
    N = x.shape[-1]
    check_tensor("rms_norm: weight", weight, (N,), ACT_DTYPES, x.device)
    if residual is not None:
        check_tensor("rms_norm: residual", residual, tuple(x.shape), (x.dtype,), x.device)
    return rms_norm_triton(x, weight, eps, residual, quant)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    s = x if residual is None else x + residual
    sf = s.float()
    y = sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)
    y = (y * (1.0 + weight.float())).type_as(s)
    return y if residual is None else (y, s)


def check_rows(name: str, x: torch.Tensor) -> None:
    """The Triton norms' input layout: [R, N] or [T, G, N] with unit stride in the last dim."""
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3):
        raise ValueError(f"{name}: expected a [R, N] or [T, G, N] tensor, got "
                         f"{list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    check_tensor(name, x, (None,) * x.dim(), ACT_DTYPES)
