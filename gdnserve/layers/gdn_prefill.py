"""The GDN layer's recurrent core for prefill: causal conv (pool-indexed) -> split q, k, v ->
gated delta rule with fused gates (pool-indexed), executed group by group from a PrefillPlan.

This is where the four grouped-prefill executors run; they share this one loop and differ only in
the plan (prefill_plan.py). Projections and the gated norm live in the GDN mixer module.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gdnserve.ops.backend import Backend
from gdnserve.ops.conv import causal_conv1d_prefill
from gdnserve.ops.gdn.chunk import ChunkWorkspace, chunk_gated_delta_rule
from gdnserve.layers.prefill_plan import PrefillPlan


@dataclass(frozen=True, slots=True)
class GDNCoreParams:
    conv_weight: torch.Tensor   # [D, W], D = 2*H*K + HV*V, channels ordered [q | k | v]
    A_log: torch.Tensor         # [HV] fp32
    dt_bias: torch.Tensor       # [HV]
    H: int
    HV: int
    K: int
    V: int


def split_qkv(y: torch.Tensor, p: GDNCoreParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views (no copies) of the conv output [T, D] as q, k: [T, H, K] and v: [T, HV, V]."""
    T = y.shape[0]
    hk = p.H * p.K
    return (y[:, :hk].view(T, p.H, p.K), y[:, hk:2 * hk].view(T, p.H, p.K),
            y[:, 2 * hk:2 * hk + p.HV * p.V].view(T, p.HV, p.V))


def gdn_prefill_core(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, p: GDNCoreParams,
                     conv_pool: torch.Tensor, ssm_pool: torch.Tensor, plan: PrefillPlan, *,
                     out: torch.Tensor | None = None, conv_out: torch.Tensor | None = None,
                     workspace: ChunkWorkspace | None = None, backend: Backend = "auto") -> torch.Tensor:
    """x: [T, D] raw conv inputs (the in-projection's qkv columns); a, b: [T, HV] raw gate inputs;
    conv_pool: [S, W-1, D]; ssm_pool: [S, HV, V, K]. Returns o: [T, HV, V] (x.dtype), and updates the
    pools as the plan says. ``conv_out`` ([T, D]) and ``workspace`` may be preallocated."""
    T = x.shape[0]
    if plan.num_tokens != T:
        raise ValueError(f"x: plan covers {plan.num_tokens} tokens, x has {T}")
    if out is None:
        out = torch.empty(T, p.HV, p.V, dtype=x.dtype, device=x.device)
    if conv_out is None:
        conv_out = torch.empty(T, x.shape[1], dtype=x.dtype, device=x.device)
    for gi, g in enumerate(plan.groups):
        if plan.copy is not None and plan.copy.before_group == gi:
            # the reference method: gather the checkpoint rows, scatter them into private slots
            for pool in (ssm_pool, conv_pool):
                pool.index_copy_(0, plan.copy.dst, pool.index_select(0, plan.copy.src))
        sl = slice(g.t0, g.t1)
        y = causal_conv1d_prefill(x[sl], p.conv_weight, conv_pool, g.meta, g.src, g.dst, g.parents,
                                  out=conv_out[sl], backend=backend)
        q, k, v = split_qkv(y, p)
        chunk_gated_delta_rule(q, k, v, a[sl], b[sl], p.A_log, p.dt_bias, ssm_pool, g.meta, g.src, g.dst,
                               g.parents, out=out[sl], workspace=workspace, backend=backend)
    return out
