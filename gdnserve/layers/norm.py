"""RMSNorms of the Qwen3-Next / Qwen3.5 family (HF modeling files are the reference), as modules over the
ops in ``ops/norm``: the PyTorch path keeps HF's roundings (CPU, parity tests), the Triton path fuses the
residual add into the norm and the gate into the GDN output norm (one launch each). ``backend`` defaults to
"torch" (the unfused ops): the decoder layer and the GDN mixer pass their own backend where they fuse."""
from __future__ import annotations

import torch
from torch import nn

from gdnserve.ops.backend import Backend
from gdnserve.ops.norm import gated_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm of the decoder and q/k norms: y = x / rms(x) * (1 + w), in fp32, cast back.
    With ``residual``: normalises ``s = x + residual`` and returns ``(y, s)`` (the fused residual add)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, backend: Backend = "torch",
                quant: bool = False) -> torch.Tensor | tuple:
        """``quant``: also y's FP8 quantization appended (``ops.norm.rms_norm``: an FP8 linear's ``xq``)."""
        return rms_norm(x, self.weight, self.eps, residual, backend=backend, quant=quant)


class GatedRMSNorm(nn.Module):
    """The GDN output norm, norm before gate, plain weight: y = w * (x / rms(x)) * silu(z).
    Rounding as HF: normalise in fp32, round to the input dtype, multiply by w, then by silu(z) in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor, backend: Backend = "torch", quant: bool = False):
        """``quant``: ``(y, (q, s))``, y's FP8 quantization as the [T, G·V] input of out_proj (its ``xq``)."""
        return gated_rms_norm(x, z, self.weight, self.eps, backend=backend, quant=quant)
