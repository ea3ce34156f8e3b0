"""Float64 token-by-token references for the gated delta rule (the spec the kernels are tested
against). Readable, slow, and independent of every fast path: no chunking, no fusion.

Per value head j (key head i = j // r), token t, state S in math convention [K, V]:
    S_t = exp(g_t) S_{t-1} + k_t [beta_t (v_t - exp(g_t) S_{t-1}^T k_t)]^T
    o_t = S_t^T (scale * q_t)
The pool stores S^T per head: pool[slot, j] is [V, K].
"""
from __future__ import annotations

from typing import Sequence

import torch

from gdnserve.ops.gdn.gates import gates, l2norm

F64 = torch.float64


def naive_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor | None,
                    scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence. q, k: [L, H, K]; v: [L, HV, V]; a, b: [L, HV]; state: [HV, V, K] or None (zeros).
    Returns o [L, HV, V] and the final state [HV, V, K], both float64."""
    L, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    r = HV // H
    scale = K ** -0.5 if scale is None else scale
    qn = l2norm(q, F64).repeat_interleave(r, dim=1) * scale  # [L, HV, K]
    kn = l2norm(k, F64).repeat_interleave(r, dim=1)
    g, beta = gates(a, b, A_log, dt_bias, F64)               # [L, HV]
    S = torch.zeros(HV, V, K, dtype=F64) if state is None else state.to(F64).cpu().clone()
    qn, kn, vv, g, beta = qn.cpu(), kn.cpu(), v.to(F64).cpu(), g.cpu(), beta.cpu()
    o = torch.empty(L, HV, V, dtype=F64)
    for t in range(L):
        alpha = torch.exp(g[t])[:, None, None]                     # [HV, 1, 1]
        S = alpha * S
        pred = torch.einsum("jvk,jk->jv", S, kn[t])                # S^T k
        u = beta[t][:, None] * (vv[t] - pred)                      # [HV, V]
        S = S + u[:, :, None] * kn[t][:, None, :]
        o[t] = torch.einsum("jvk,jk->jv", S, qn[t])
    return o, S


def naive_prefill_pool(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       A_log: torch.Tensor, dt_bias: torch.Tensor, pool: torch.Tensor, seqlens: Sequence[int],
                       src: Sequence[int], dst: Sequence[int], parents: Sequence[int] | None = None,
                       scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool semantics of the prefill op, run serially: parents first, each sequence from
    zeros (src = -1), pool[src], or its parent's final state rounded to the pool dtype (exactly
    what a serial run that wrote the parent to its slot and read it back would see).
    Returns o [T, HV, V] float64 (zero rows for sequences whose dst and src are both -1 are still
    computed) and the updated pool (a copy, in the pool's dtype)."""
    n = len(seqlens)
    parents = [-1] * n if parents is None else list(parents)
    cu = [0]
    for L in seqlens:
        cu.append(cu[-1] + L)
    new_pool = pool.detach().cpu().clone()
    finals: dict[int, torch.Tensor] = {}
    o = torch.zeros(cu[-1], v.shape[1], v.shape[2], dtype=F64)
    order = [i for i in range(n) if parents[i] < 0] + [i for i in range(n) if parents[i] >= 0]
    for i in order:
        if parents[i] >= 0:
            init = finals[parents[i]].to(pool.dtype).to(F64)
        elif src[i] >= 0:
            init = pool[src[i]].detach().cpu().to(F64)   # the *old* pool: reads happen before writes
        else:
            init = None
        sl = slice(cu[i], cu[i + 1])
        o_i, s_i = naive_recurrent(q[sl], k[sl], v[sl], a[sl], b[sl], A_log, dt_bias, init, scale)
        o[sl] = o_i
        finals[i] = s_i
        if dst[i] >= 0:
            new_pool[dst[i]] = s_i.to(pool.dtype)
    return o, new_pool
