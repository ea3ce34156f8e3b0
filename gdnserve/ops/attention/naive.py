"""Float64 reference for paged attention (the spec the fast paths are tested against): one sequence, K/V
contiguous, plain loops over heads and query rows. The queries are the *last* Lq of the sequence's Lk
positions, so query i sits at position Lk - Lq + i and attends causally to keys 0 .. Lk - Lq + i:

    s_ij = scale * q_i . k_j                      (j <= Lk - Lq + i)
    o_i  = sum_j softmax_j(s_ij) v_j

GQA: query head h reads kv head h // g, g = QH / KVH.
"""
from __future__ import annotations

import torch

F64 = torch.float64


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [Lq, QH, Dh], k, v: [Lk, KVH, Dh] with Lk >= Lq and QH a multiple of KVH.
    Returns o: [Lq, QH, Dh] float64 (on the CPU)."""
    q, k, v = q.detach().cpu().to(F64), k.detach().cpu().to(F64), v.detach().cpu().to(F64)
    Lq, QH, Dh = q.shape
    Lk, KVH = k.shape[0], k.shape[1]
    assert Lk >= Lq and QH % KVH == 0, (q.shape, k.shape)
    g = QH // KVH
    o = torch.zeros(Lq, QH, Dh, dtype=F64)
    for h in range(QH):
        kh, vh = k[:, h // g], v[:, h // g]
        for i in range(Lq):
            last = Lk - Lq + i                     # the query's own position
            s = (kh[: last + 1] @ q[i, h]) * scale
            p = torch.exp(s - s.max())
            o[i, h] = (p / p.sum()) @ vh[: last + 1]
    return o
