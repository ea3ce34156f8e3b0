"""Float64 references for the causal conv1d ops (the spec the fast paths are tested against).
Readable and slow: plain Python loops over sequences and tokens, no gathers, no vectorised tricks.

One channel d, kernel width W, history h (the W-1 raw inputs before the segment, oldest first):
    ext = h ++ x_segment
    y_t = act( sum_{m=0}^{W-1} weight[d, m] * ext[t + m] )
    new history = last W-1 rows of ext
The history holds raw (pre-activation) inputs, so new histories are bit copies of inputs.
"""
from __future__ import annotations

from typing import Sequence

import torch

F64 = torch.float64


def _ints(v: Sequence[int] | torch.Tensor | None, n: int) -> list[int]:
    if v is None:
        return [-1] * n
    return [int(i) for i in (v.tolist() if isinstance(v, torch.Tensor) else v)]


def _act(v: torch.Tensor, activation: str | None) -> torch.Tensor:
    return v * torch.sigmoid(v) if activation == "silu" else v


def naive_conv_segment(hist: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor,
                       activation: str | None = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """hist: [W-1, D], xs: [L, D] (same dtype), weight: [D, W].
    Returns y [L, D] float64 and the new history [W-1, D] (a copy of raw inputs, input dtype)."""
    W = weight.shape[1]
    ext = torch.cat([hist, xs], dim=0)
    w = weight.to(F64)
    y = torch.zeros(xs.shape[0], xs.shape[1], dtype=F64)
    for t in range(xs.shape[0]):
        acc = torch.zeros(xs.shape[1], dtype=F64)
        for m in range(W):
            acc = acc + w[:, m] * ext[t + m].to(F64)
        y[t] = _act(acc, activation)
    return y, ext[ext.shape[0] - (W - 1):].clone()


def naive_conv_prefill(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, seqlens: Sequence[int],
                       src: Sequence[int] | torch.Tensor, dst: Sequence[int] | torch.Tensor,
                       parents: Sequence[int] | torch.Tensor | None = None,
                       activation: str | None = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill semantics run serially, parents first. A child's history is the parent's new history
    (last W-1 rows of the parent's history ++ tokens); all pool reads see the pool as before the call.
    Returns y [T, D] float64 and the updated pool (a CPU copy, pool dtype)."""
    x, weight, old = x.detach().cpu(), weight.detach().cpu(), conv_pool.detach().cpu()
    n = len(seqlens)
    src, dst, parents = _ints(src, n), _ints(dst, n), _ints(parents, n)
    W, D = weight.shape[1], x.shape[1]
    cu = [0]
    for L in seqlens:
        cu.append(cu[-1] + int(L))
    new_pool = old.clone()
    y = torch.zeros(cu[-1], D, dtype=F64)
    tails: dict[int, torch.Tensor] = {}
    order = [i for i in range(n) if parents[i] < 0] + [i for i in range(n) if parents[i] >= 0]
    for i in order:
        if parents[i] >= 0:
            assert parents[parents[i]] < 0, "a parent must not have a parent itself"
            hist = tails[parents[i]]
        elif src[i] >= 0:
            hist = old[src[i]]
        else:
            hist = torch.zeros(W - 1, D, dtype=x.dtype)
        y[cu[i]:cu[i + 1]], tails[i] = naive_conv_segment(hist, x[cu[i]:cu[i + 1]], weight, activation)
        if dst[i] >= 0:
            new_pool[dst[i]] = tails[i]
    return y, new_pool


def naive_conv_update(x: torch.Tensor, weight: torch.Tensor | None, conv_pool: torch.Tensor,
                      slots: Sequence[int] | torch.Tensor, tokens_per_req: int, write_state: str = "final",
                      pending_x: torch.Tensor | None = None,
                      pending_in_rows: Sequence[int] | torch.Tensor | None = None,
                      num_pending: Sequence[int] | torch.Tensor | None = None,
                      pending_out_rows: Sequence[int] | torch.Tensor | None = None,
                      activation: str | None = "silu",
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Decode / verify / fold semantics, one request at a time.
    Returns y [B*Lq, D] float64 (zero rows for slot -1), the updated pool and the updated pending
    buffer (CPU copies; pending is None when none was given). `weight` may be None when Lq == 0."""
    x, old = x.detach().cpu(), conv_pool.detach().cpu()
    slots = _ints(slots, 0)
    B, Lq, W, D = len(slots), tokens_per_req, conv_pool.shape[1] + 1, conv_pool.shape[2]
    weight = torch.zeros(D, W) if weight is None else weight.detach().cpu()
    pin, pout, npend = _ints(pending_in_rows, B), _ints(pending_out_rows, B), _ints(num_pending, B)
    old_pending = None if pending_x is None else pending_x.detach().cpu()
    new_pool = old.clone()
    new_pending = None if old_pending is None else old_pending.clone()
    y = torch.zeros(B * Lq, D, dtype=F64)
    for n, s in enumerate(slots):
        if s < 0:
            continue
        hist1 = old[s]
        if pin[n] >= 0:  # fold the pending (accepted) inputs into the history first
            hist1 = torch.cat([hist1, old_pending[pin[n], :npend[n]]])[npend[n]:]
        rows = x[n * Lq:(n + 1) * Lq]
        y[n * Lq:(n + 1) * Lq], final = naive_conv_segment(hist1, rows, weight, activation)
        if write_state == "final":
            new_pool[s] = final
        elif write_state == "after_pending":
            new_pool[s] = hist1
        if pout[n] >= 0:
            new_pending[pout[n], :Lq] = rows
    return y, new_pool, new_pending
