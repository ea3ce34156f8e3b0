"""The Gated DeltaNet token mixer of a hybrid decoder layer (gdn_kernels.md §1.2).

One fused input projection, columns ordered ``[q | k | v | z | b | a]`` (the loader permutes Qwen3-Next's
per-group interleaving into this at load time), so every split is a plain column slice of one GEMM output
and q/k/v reach the kernels as strided views, never copies. Prefill tokens go through the step's
PrefillPlan (any of the four grouped executors); decode tokens through the recurrent ops, both on the
pool views bound at start-up.
"""
from __future__ import annotations

import torch
from torch import nn

from gdnserve.layers.forward_context import get_forward_context
from gdnserve.layers.gdn_prefill import GDNCoreParams, gdn_prefill_core, split_qkv
from gdnserve.layers.norm import GatedRMSNorm
from gdnserve.ops.conv import causal_conv1d_update
from gdnserve.ops.gdn.recurrent import gdn_decode


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden: int, H: int, HV: int, K: int, V: int, W: int, eps: float):
        super().__init__()
        self.H, self.HV, self.K, self.V, self.W = H, HV, K, V, W
        self.conv_dim = 2 * H * K + HV * V
        self.in_proj = nn.Linear(hidden, self.conv_dim + HV * V + 2 * HV, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, W))
        self.A_log = nn.Parameter(torch.empty(HV, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(HV))
        self.norm = GatedRMSNorm(V, eps)
        self.out_proj = nn.Linear(HV * V, hidden, bias=False)
        self.conv_pool: torch.Tensor | None = None   # [S, W-1, D], bound by the runner
        self.ssm_pool: torch.Tensor | None = None    # [S, HV, V, K]
        self.backend = "auto"

    def bind_state(self, conv_pool: torch.Tensor, ssm_pool: torch.Tensor) -> None:
        self.conv_pool, self.ssm_pool = conv_pool, ssm_pool

    def params(self) -> GDNCoreParams:
        return GDNCoreParams(self.conv_weight, self.A_log, self.dt_bias, self.H, self.HV, self.K, self.V)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        T = h.shape[0]
        D, HVV, HV = self.conv_dim, self.HV * self.V, self.HV
        proj = self.in_proj(h)
        x, z = proj[:, :D], proj[:, D:D + HVV]
        b, a = proj[:, D + HVV:D + HVV + HV], proj[:, D + HVV + HV:]
        o = torch.empty(T, HV, self.V, dtype=h.dtype, device=h.device)
        p = self.params()
        tp = ctx.num_prefill
        if tp:
            gdn_prefill_core(x[:tp], a[:tp], b[:tp], p, self.conv_pool, self.ssm_pool, ctx.prefill,
                             out=o[:tp], backend=self.backend)
        if tp < T:
            slots = ctx.decode_slots
            y = causal_conv1d_update(x[tp:], self.conv_weight, self.conv_pool, slots, tokens_per_req=1,
                                     backend=self.backend)
            q, k, v = split_qkv(y, p)
            gdn_decode(q, k, v, a[tp:], b[tp:], self.A_log, self.dt_bias, self.ssm_pool, slots, out=o[tp:],
                       backend=self.backend)
        y = self.norm(o.view(T * HV, self.V), z.reshape(T * HV, self.V)).view(T, HVV)
        return self.out_proj(y)
