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

Shared expert folded into the grouped GEMM (``shared=True``, ``layers/moe.py``): the logits have E+1
columns, the last one the shared expert's gate logit (row E of the router weight). It takes no part in the
softmax / top-k; each token gets a (k+1)-th pair, expert E with weight ``sigmoid(logit)`` (fp32, cast to the
logits' dtype: what ``torch.sigmoid`` on the activation-dtype logit gives), after the k weights' renormalisation,
and the alignment counts E+1 experts and k+1 pairs per token.
"""
from __future__ import annotations

import torch

from gdnserve.ops.backend import Backend, resolve
from gdnserve.ops.checks import ACT_DTYPES, check_tensor
from gdnserve.ops.moe.routing import Routing


def route(logits: torch.Tensor, top_k: int, renormalize: bool, backend: Backend = "auto",
          shared: bool = False) -> Routing:
    """logits [T, E] (activation dtype, unit last stride) -> Routing. The Triton path's alignment uses the
    row block the grouped GEMM picks for its pairs (``grouped_triton.block_rows``). ``shared``: logits
    [T, E+1] whose last column is the shared expert's gate logit -> weights / experts [T, top_k + 1] (see
    the module docstring), the alignment over E+1 experts."""
    check_tensor("route: logits", logits, (None, None), ACT_DTYPES)
    E = logits.shape[1] - shared
    if not 1 <= top_k <= E:
        raise ValueError(f"route: top_k must be in [1, num_experts={E}], got {top_k}")
    if resolve(backend, logits) == "torch":
        w, idx = route_torch(logits[:, :E], top_k, renormalize)
        if shared:
            w = torch.cat([w, torch.sigmoid(logits[:, E:])], 1)
            idx = torch.cat([idx, torch.full_like(idx[:, :1], E)], 1)
        return Routing(w, idx, None)
    from gdnserve.ops.moe.router_triton import route_triton
    return route_triton(logits, top_k, renormalize, shared)


def route_torch(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    w, idx = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype), idx
