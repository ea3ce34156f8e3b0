"""Routed experts of a sparse MoE block: each token's top-k experts (SwiGLU: gate/up, silu, down), scaled by
the routing weights and summed per token. ``naive.py`` is the float64 reference, ``torch_path.py`` the
per-expert loop (reads expert counts on the host: CPU), ``align.py`` + ``grouped_triton.py`` the grouped GEMM
driven by device-side offsets (no host read, CUDA-graph safe)."""
from gdnserve.ops.moe.experts import moe_experts

__all__ = ["moe_experts"]
