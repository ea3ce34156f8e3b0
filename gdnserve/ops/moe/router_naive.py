"""Float64 reference of the router (``router.py``): softmax, top-k by (weight descending, expert id
ascending), optional renormalisation; and the alignment ``align.align_pairs`` defines."""
from __future__ import annotations

import torch


def naive_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (float64 weights [T, k], int64 ids [T, k]); ties go to the lower id."""
    lg = logits.double()
    p = torch.softmax(lg, dim=-1)
    # stable sort on the logits: equal logits keep ascending id order
    order = torch.sort(lg, dim=-1, descending=True, stable=True).indices[:, :top_k]
    w = torch.gather(p, 1, order)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, order
