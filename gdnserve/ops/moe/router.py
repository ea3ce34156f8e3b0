"""The MoE router after its logits GEMM: softmax over the experts (fp32), top-k, optional renormalisation of
the k weights, weights cast to the logits' dtype, and (Triton path) the grouped GEMM's expert alignment.

PyTorch path (``route_torch``): HF's ``Qwen3NextSparseMoeBlock`` / ``Qwen3_5MoeSparseMoeBlock`` ops
(``torch.topk``, int64 ids, no alignment: the per-expert loop does its own grouping). Triton path
(``router_triton.py``): one launch for decode-sized steps (softmax, top-k, renormalisation and the alignment
of ``align.py`` in one program), a row-parallel router launch + the alignment launch above that.

Top-k order: descending weight; among equal logits the lower expert id first (at the k-th place too, so the
chosen set is the one CUDA's ``torch.topk`` picks). ``torch.topk`` on the CPU leaves the order of equal values
unspecified (a partial sort), so the two paths agree exactly on logits without ties and on the set of
weights otherwise. Selection runs on the logits (softmax is monotone), the weights are
``exp(l - max) / sum`` as the PyTorch path computes them.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from gdnserve.ops.backend import Backend, resolve
from gdnserve.ops.checks import ACT_DTYPES, check_tensor
from gdnserve.ops.moe.align import Alignment


class Routing(NamedTuple):
    weights: torch.Tensor                # [T, k] in the logits' dtype
    experts: torch.Tensor                # [T, k] expert ids: int32 (Triton) / int64 (PyTorch)
    alignment: Alignment | None          # the grouped GEMM's alignment (Triton path), None on the PyTorch path


def route(logits: torch.Tensor, top_k: int, renormalize: bool, backend: Backend = "auto") -> Routing:
    """logits [T, E] (activation dtype, unit last stride) -> Routing. The Triton path's alignment uses the
    row block the grouped GEMM picks for T * top_k pairs (``grouped_triton.block_rows``)."""
    check_tensor("route: logits", logits, (None, None), ACT_DTYPES)
    E = logits.shape[1]
    if not 1 <= top_k <= E:
        raise ValueError(f"route: top_k must be in [1, num_experts={E}], got {top_k}")
    if resolve(backend, logits) == "torch":
        w, idx = route_torch(logits, top_k, renormalize)
        return Routing(w, idx, None)
    from gdnserve.ops.moe.router_triton import route_triton
    return route_triton(logits, top_k, renormalize)


def route_torch(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    w, idx = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype), idx
