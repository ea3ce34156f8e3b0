"""PyTorch path of the chunked gated-delta-rule prefill (any device; the CPU path of the engine).

The same stages as the Triton kernels (gdn_kernels.md §2.1–2.2), vectorised over chunks and heads
for the state-independent part and over sequences for the state pass; fp32 throughout. It reads
the small per-sequence index vectors on the host, which is fine on CPU (no device to sync with).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gdnserve.ops.gdn.gates import gates, l2norm
from gdnserve.ops.varlen import CHUNK, VarlenMeta

F32 = torch.float32


def _prep(q, k, v, a, b, A_log, dt_bias, r):
    """One sequence -> per-chunk tensors. Returns qn, kn [NC, HV, C, K], gc [NC, HV, C], w, u, valid."""
    L = q.shape[0]
    nc = max(1, -(-L // CHUNK))
    pad = nc * CHUNK - L
    qn = F.pad(l2norm(q, F32), (0, 0, 0, 0, 0, pad)).repeat_interleave(r, 1)   # [Lp, HV, K]
    kn = F.pad(l2norm(k, F32), (0, 0, 0, 0, 0, pad)).repeat_interleave(r, 1)
    vv = F.pad(v.to(F32), (0, 0, 0, 0, 0, pad))
    g, beta = gates(a, b, A_log, dt_bias, F32)
    g, beta = F.pad(g, (0, 0, 0, pad)), F.pad(beta, (0, 0, 0, pad))        # padded rows: g = 0, beta = 0
    HV = vv.shape[1]
    # [NC, HV, C, *]
    qn = qn.view(nc, CHUNK, HV, -1).transpose(1, 2)
    kn = kn.view(nc, CHUNK, HV, -1).transpose(1, 2)
    vv = vv.view(nc, CHUNK, HV, -1).transpose(1, 2)
    gc = g.view(nc, CHUNK, HV).transpose(1, 2).cumsum(-1)                  # chunk-local cumsum
    beta = beta.view(nc, CHUNK, HV).transpose(1, 2)
    diff = gc[..., :, None] - gc[..., None, :]                            # gamma_i - gamma_m
    strict = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril(-1)
    decay = torch.where(strict, torch.exp(torch.where(strict, diff, torch.zeros_like(diff))), 0.0)
    A = beta[..., :, None] * decay * (kn @ kn.transpose(-1, -2))
    eye = torch.eye(CHUNK, dtype=F32, device=q.device)
    T = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
    w = T @ (kn * (beta * torch.exp(gc))[..., None])
    u = T @ (vv * beta[..., None])
    return qn, kn, gc, w, u


def _state_pass_and_output(S, qn, kn, gc, w, u, L, scale, want_out=True):
    """S: [HV, V, K] fp32 (pool layout, S^T per head). Runs the chunks of one sequence."""
    nc = qn.shape[0]
    incl = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=qn.device).tril()
    outs = []
    for c in range(nc):
        g = gc[c]                                                          # [HV, C]
        n_valid = min(CHUNK, L - c * CHUNK)
        U = u[c] - w[c] @ S.transpose(-1, -2)                              # [HV, C, V]
        if want_out:
            diff = g[:, :, None] - g[:, None, :]
            M = torch.where(incl, torch.exp(torch.where(incl, diff, torch.zeros_like(diff))), 0.0)
            o = torch.exp(g)[..., None] * (qn[c] @ S.transpose(-1, -2)) + (M * (qn[c] @ kn[c].transpose(-1, -2))) @ U
            outs.append((o * scale)[:, :max(n_valid, 0)])
        gl = g[:, max(n_valid, 1) - 1] if n_valid > 0 else torch.zeros_like(g[:, 0])
        wdec = torch.exp(gl[:, None] - g)                                  # Gamma_C / Gamma_i
        valid = (torch.arange(CHUNK, device=qn.device) < n_valid)
        Uw = torch.where(valid[None, :, None], U * wdec[..., None], 0.0)
        S = torch.exp(gl)[:, None, None] * S + Uw.transpose(-1, -2) @ kn[c]
    o = torch.cat(outs, dim=1).transpose(0, 1) if want_out else None     # [L, HV, V]
    return S, o


def chunk_gdn_torch(q, k, v, a, b, A_log, dt_bias, ssm_pool, meta: VarlenMeta, src_slots, dst_slots,
                    parents, scale: float, out: torch.Tensor) -> torch.Tensor:
    H, HV = q.shape[1], v.shape[1]
    r = HV // H
    cu = [0]
    for L in meta.seqlens:
        cu.append(cu[-1] + L)
    src = src_slots.tolist()
    dst = dst_slots.tolist()
    par = parents.tolist() if parents is not None else [-1] * meta.num_seqs
    finals: dict[int, torch.Tensor] = {}
    writes: list[tuple[int, torch.Tensor]] = []
    order = [n for n in range(meta.num_seqs) if par[n] < 0] + [n for n in range(meta.num_seqs) if par[n] >= 0]
    for n in order:
        L = meta.seqlens[n]
        if par[n] >= 0:
            # replay of the parent, rounded to the pool dtype as a serial run would store it
            S = finals[par[n]].to(ssm_pool.dtype).to(F32)
        elif src[n] >= 0:
            S = ssm_pool[src[n]].to(F32)
        else:
            S = torch.zeros(ssm_pool.shape[1:], dtype=F32, device=ssm_pool.device)
        sl = slice(cu[n], cu[n + 1])
        if L > 0:
            qn, kn, gc, w, u = _prep(q[sl], k[sl], v[sl], a[sl], b[sl], A_log, dt_bias, r)
            S, o = _state_pass_and_output(S, qn, kn, gc, w, u, L, scale)
            out[sl] = o.to(out.dtype)
        finals[n] = S
        if dst[n] >= 0:
            writes.append((dst[n], S))
    for slot, S in writes:   # all reads happen before any write (src == dst, parents reading src)
        ssm_pool[slot] = S.to(ssm_pool.dtype)
    return out
