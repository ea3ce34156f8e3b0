"""Prefill-sized block-FP8 linear on cuBLAS: ``torch._scaled_mm`` with DeepSeek-style block scales (x per
token-group of 128 — ``BlockWise1x128`` — and W per 128x128 block — ``BlockWise128x128``; CUDA >= 12.9,
Hopper). Same math as the Triton GEMM (x quantized by ``quantize_act_triton``, fp32 accumulation; cuBLAS
refuses fast accumulation with these scales).

Layouts cuBLAS wants: x e4m3 ``[M, K]`` row-major, W as ``qw.t()`` (``[K, N]`` column-major: the checkpoint's
``[N, K]`` row-major as is), the activation scales outer-dim-major (``[M, K/128]`` with stride ``(1, M)``:
the quantization kernel writes them transposed), the weight scales ``sw.t()`` (``[K/128, N/128]``).

``available(device)`` probes it once per device (a small call held to the float32 reference of the same math); the
probe never runs during CUDA-graph capture (it syncs): until a probe has run there, callers take the Triton GEMM.
Used for ``M >= MIN_M`` when the dispatch's ``scaled_mm`` is on (``fp8_linear``); M and the K-block count must be
multiples of 4 (the scale vectors' 16-byte alignment), N a multiple of 128 — other shapes take the Triton GEMM.
"""
from __future__ import annotations

import torch

from gdnserve.ops.quant.fp8_ref import BLOCK

MIN_M = 512
_probed: dict[int, bool] = {}


def shape_ok(M: int, N: int, K: int) -> bool:
    return M % 4 == 0 and N % BLOCK == 0 and K % (4 * BLOCK) == 0


def scaled_mm_linear(x: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor, out: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """x [M, K] (bf16, unit column stride) · dequant(qw [N, K], sw)ᵀ -> [M, N] bf16 (into ``out``, unit
    column stride, when given)."""
    from gdnserve.ops.quant.fp8_gemm_triton import quantize_act_triton
    M, K = x.shape
    xq, xs_t = quantize_act_triton(x, scales_transposed=True)      # xs_t [K/128, M]
    kw = {} if out is None else {"out": out}
    return torch._scaled_mm(xq, qw.t(), xs_t.t(), sw.t(), out_dtype=x.dtype, **kw)


def _probe(dev: torch.device) -> tuple[bool, str]:
    if not hasattr(torch, "_scaled_mm") or torch.cuda.get_device_capability(dev) < (9, 0):
        return False, "no torch._scaled_mm or not Hopper"
    from gdnserve.ops.quant.fp8_ref import fp8_linear_torch, quantize_weight
    try:
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(260, 512, device=dev, generator=g).bfloat16()
        q, s = quantize_weight(torch.randn(256, 512, device=dev, generator=g))
        out = torch.empty(260, 256 + 8, dtype=torch.bfloat16, device=dev)[:, :256]    # a strided output too
        y = scaled_mm_linear(x, q, s, out=out)
        ref = fp8_linear_torch(x.float(), q, s)
        err = ((y.float() - ref).norm() / ref.norm()).item()
        same = y.data_ptr() == out.data_ptr() and torch.equal(y, out)
        return err < 1e-2 and same, f"rel_err {err:.1e}, wrote into the strided out: {same}"
    except Exception as e:                       # noqa: BLE001 — an older torch / CUDA: not available
        return False, f"{type(e).__name__}: {e}"[:300]


PROBE_RESULT: dict[int, str] = {}


def available(dev: torch.device) -> bool:
    """Whether block-scaled ``torch._scaled_mm`` works on ``dev`` (probed once; False while a CUDA graph
    is being captured and no probe has run)."""
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    ok = _probed.get(idx)
    if ok is None:
        if torch.cuda.is_current_stream_capturing():
            return False
        ok, PROBE_RESULT[idx] = _probe(torch.device("cuda", idx))
        _probed[idx] = ok
    return ok


def use_scaled_mm(x: torch.Tensor, N: int) -> bool:
    M, K = x.shape
    return (x.is_cuda and x.dtype == torch.bfloat16 and M >= MIN_M and shape_ok(M, N, K)
            and available(x.device))

