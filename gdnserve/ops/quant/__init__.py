"""Block-scaled FP8 (e4m3) GEMMs for the checkpoints Qwen ships as FP8: weights in 128x128 blocks with a
float scale per block (``weight ≈ fp8 · weight_scale_inv``), activations quantized on the fly per token and
group of 128 input columns (scale = amax / 448). ``fp8_ref`` is the PyTorch math (quantize / dequantize,
the dequantizing reference linear that CPUs and pre-Hopper GPUs run), ``fp8_gemm_triton`` the Triton GEMM
(fp8 tensor-core dot, scales applied in the K loop), ``fp8_linear`` the op that picks one."""
from gdnserve.ops.quant.fp8_linear import fp8_linear
from gdnserve.ops.quant.fp8_ref import (BLOCK, FP8_MAX, dequantize_weight, quantize_act, quantize_weight)

__all__ = ["BLOCK", "FP8_MAX", "dequantize_weight", "fp8_linear", "quantize_act", "quantize_weight"]
