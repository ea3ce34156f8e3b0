"""Row norms of the decoder (gdn_kernels.md §1.2 step 8 for the gated one).

- ``rmsnorm.py``: the zero-centred RMSNorm ``x / rms(x) * (1 + w)``, optionally fused with the residual add
  before it (``rms_norm(x, w, eps, residual=r)`` returns the normed ``x + r`` and ``x + r`` itself).
- ``gated.py``: the GDN output norm ``w * (o / rms(o)) * silu(z)`` (norm before gate, plain weight).
- ``*_triton.py``: one Triton launch each (one program per row); ``naive.py``: float64 references.

The PyTorch paths are the HF modeling files' exact sequence of roundings; the Triton kernels round at the
same points (so a residual sum is bit-equal, a normed row within one rounding of the PyTorch path).

``quant=True`` (both norms): the output also quantized for an FP8 linear, ``(q, s)`` exactly as
``quantize_act_triton`` of the output gives it — by the Triton kernels in their registers (no launch), by
``fp8_ref`` on the PyTorch path (docs/kernels.md "Where x is quantized").
"""
from gdnserve.ops.norm.gated import gated_rms_norm
from gdnserve.ops.norm.rmsnorm import rms_norm

__all__ = ["rms_norm", "gated_rms_norm"]
