"""Small elementwise epilogues of the decoder's gates, each one Triton launch on the Triton backend instead of
two or three PyTorch elementwise kernels (and a copy) per layer:

  - ``silu_mul(h)``: h [T, 2I] (rows ``[gate | up]``) -> silu(h[:, :I]) * h[:, I:]        (the shared expert)
  - ``sigmoid_mul(x, g, add=None)``: [add +] x * sigmoid(g), with g either [T, C] or a per-head strided view
    [T, G, C/G] (the attention output gate, read in place from the q/gate projection) or [T, 1] (the shared
    expert's gate, broadcast over the row); ``add`` the routed experts' sum the gated product is added to.

Rounding: the PyTorch ops' sequence (HF's modeling code), each step computed in fp32 and rounded to the
activation dtype: silu, then the product; sigmoid, then the product, then the sum. The PyTorch path is those
ops themselves; the Triton path rounds at the same points (its exp differs from torch's in the last ulp at
most, so the two agree to one rounding; eager and graph-replayed steps run the same kernel).

``sigmoid_mul(..., quant=True)`` also returns its output quantized for an FP8 linear (attention's o_proj), as the
norms do (``ops/norm``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gdnserve.ops.backend import Backend, resolve
from gdnserve.ops.checks import ACT_DTYPES, check_tensor


def silu_mul(h: torch.Tensor, backend: Backend = "auto") -> torch.Tensor:
    """h [T, 2I] -> [T, I] in h.dtype (Triton path: an activation dtype, unit last stride, any row stride)."""
    if h.dim() != 2 or h.shape[1] % 2:
        raise ValueError(f"silu_mul: h must be [T, 2I] ([gate | up]), got {list(h.shape)}")
    I = h.shape[1] // 2
    if resolve(backend, h) == "torch":
        return F.silu(h[:, :I]) * h[:, I:]
    check_tensor("silu_mul: h", h, (None, None), ACT_DTYPES)
    from gdnserve.ops.gating_triton import silu_mul_triton
    return silu_mul_triton(h)


def sigmoid_mul(x: torch.Tensor, g: torch.Tensor, add: torch.Tensor | None = None,
                backend: Backend = "auto", quant: bool = False):
    """x [T, C] (unit last stride); g [T, C], [T, G, C // G] (any strides, unit last) or [T, 1]; add [T, C] or
    None -> ``add + x * sigmoid(g)`` (``x * sigmoid(g)`` without ``add``) in x.dtype, g as its [T, C] view.
    ``quant``: ``(y, (q [T, C] e4m3, s [T, ceil(C/128)] float32))`` = ``quantize_act_triton(y)`` (an FP8
    o_proj's ``xq``; the Triton kernel quantizes in its registers, no extra launch)."""
    if x.dim() != 2:
        raise ValueError(f"sigmoid_mul: x must be [T, C], got {list(x.shape)}")
    T, C = x.shape
    if g.dim() == 3:
        if g.shape[0] != T or g.shape[1] * g.shape[2] != C:
            raise ValueError(f"sigmoid_mul: g {list(g.shape)} does not cover x's [{T}, {C}]")
    elif g.dim() != 2 or g.shape[0] != T or g.shape[1] not in (1, C):
        raise ValueError(f"sigmoid_mul: g must be [{T}, 1], [{T}, {C}] or [{T}, G, {C}/G], got {list(g.shape)}")
    if add is not None and tuple(add.shape) != (T, C):
        raise ValueError(f"sigmoid_mul: add must be [{T}, {C}], got {list(add.shape)}")
    if resolve(backend, x) == "torch":
        y = x * torch.sigmoid(g if g.dim() == 2 else g.reshape(T, C))
        y = y if add is None else add + y
        if not quant:
            return y
        from gdnserve.ops.quant.quant_out import quantize_out_torch
        return y, quantize_out_torch(y)
    check_tensor("sigmoid_mul: x", x, (T, C), ACT_DTYPES)
    check_tensor("sigmoid_mul: g", g, (T,) + (None,) * (g.dim() - 1), [x.dtype])
    if add is not None:
        check_tensor("sigmoid_mul: add", add, (T, C), [x.dtype])
    from gdnserve.ops.gating_triton import sigmoid_mul_triton
    return sigmoid_mul_triton(x, g, add, quant)
