"""FP8 block quantization in PyTorch: the scheme of the Qwen / DeepSeek FP8 releases, and the dequantizing
reference GEMM (any device).

Weights: ``w [N, K]`` is cut into 128x128 blocks (the last row / column block may be partial); block
``(i, j)`` is stored as ``q = w / s`` in float8_e4m3fn with ``s = amax(|block|) / 448`` kept as
``weight_scale_inv [ceil(N/128), ceil(K/128)]`` (the name is the checkpoints': the factor that *undoes*
the quantization), so ``w ≈ q · s``.

Activations (dynamic, per token and group of 128 columns): ``x [M, K] -> q [M, K]`` e4m3 and
``s [M, ceil(K/128)]`` float32 with ``s = max(amax, 1e-10) / 448`` and ``q = clamp(x / s, ±448)`` rounded to
nearest even — the same formula the Triton kernels evaluate in registers, so both paths see the same
quantized activations (up to the last bit of a division on the GPU).

``fp8_linear_torch`` is the op's reference path: quantize x as above, dequantize both operands to float32
and multiply — mathematically the kernel's ``Σ_k-blocks (qx·qw) · sx · sw`` (fp32 accumulation either way).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 128
FP8_MAX = 448.0             # torch.finfo(torch.float8_e4m3fn).max
ACT_EPS = 1e-10
FP8 = torch.float8_e4m3fn


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _blocks(w: torch.Tensor, block: int) -> torch.Tensor:
    """[N, K] -> [nb, block, kb, block] zero-padded float32 view of the blocks."""
    N, K = w.shape
    nb, kb = cdiv(N, block), cdiv(K, block)
    return F.pad(w.float(), (0, kb * block - K, 0, nb * block - N)).view(nb, block, kb, block)


def quantize_weight(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] (any float dtype) -> (q [..., N, K] float8_e4m3fn, weight_scale_inv [..., ceil(N/block),
    ceil(K/block)] float32), ``w ≈ q · s`` per block. Leading dims (stacked experts) are kept."""
    if w.dim() > 2:
        qs = [quantize_weight(t, block) for t in w.reshape(-1, *w.shape[-2:])]
        return (torch.stack([q for q, _ in qs]).view(w.shape),
                torch.stack([s for _, s in qs]).view(*w.shape[:-2], *qs[0][1].shape))
    N, K = w.shape
    b = _blocks(w, block)
    s = _div448(b.abs().amax(dim=(1, 3)).clamp_min(ACT_EPS))                      # [nb, kb]
    q = (b / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(b.shape[0] * block, -1)[:N, :K].contiguous(), s


def _div448(a: torch.Tensor) -> torch.Tensor:
    """a / 448 correctly rounded on every device: PyTorch's CUDA division by a Python scalar multiplies by its
    reciprocal (an ulp off at times, so it would not match the Triton kernels' div_rn); a tensor divisor is
    true division."""
    return a / torch.full_like(a, FP8_MAX)


def expand_scale(s: torch.Tensor, N: int, K: int, block: int = BLOCK) -> torch.Tensor:
    """Block scales [..., nb, kb] -> per-element [..., N, K] (float32)."""
    return s.float().repeat_interleave(block, -2)[..., :N, :].repeat_interleave(block, -1)[..., :K]


def dequantize_weight(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float32,
                      block: int = BLOCK) -> torch.Tensor:
    """(q [..., N, K] fp8, s [..., ceil(N/block), ceil(K/block)]) -> q · s in ``dtype``."""
    N, K = q.shape[-2:]
    return (q.to(torch.float32) * expand_scale(s, N, K, block)).to(dtype)


def quantize_act(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] float8_e4m3fn, s [M, ceil(K/group)] float32): per token and group of ``group``
    columns, s = max(amax, 1e-10) / 448, q = clamp(x / s, ±448) (round to nearest even)."""
    M, K = x.shape
    G = cdiv(K, group)
    xf = F.pad(x.float(), (0, G * group - K)).view(M, G, group)
    s = _div448(xf.abs().amax(-1).clamp_min(ACT_EPS))
    q = (xf / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(M, G * group)[:, :K], s


def dequantize_act(q: torch.Tensor, s: torch.Tensor, group: int = BLOCK) -> torch.Tensor:
    """(q [M, K], s [M, G]) -> float32 q · s."""
    return q.to(torch.float32) * s.repeat_interleave(group, -1)[:, :q.shape[1]]


def qdq_act(x: torch.Tensor, group: int = BLOCK) -> torch.Tensor:
    """x rounded through the per-token-group FP8 quantization, as float32."""
    return dequantize_act(*quantize_act(x, group), group)


def fp8_linear_torch(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x [M, K] · dequant(q, s)ᵀ with x quantized per token-group first; float32 math (float64 for float64 x: a
    model loaded in float64 is the float64 reference of the quantized math), x.dtype out."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return F.linear(qdq_act(x).to(acc), dequantize_weight(q, s, acc)).to(x.dtype)


def fp8_linear_float64(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Float64 reference of the same quantized math (activations quantized as above)."""
    return F.linear(qdq_act(x).double(), dequantize_weight(q, s, torch.float64))
