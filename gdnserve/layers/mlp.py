"""Dense SwiGLU MLP with one fused gate/up projection: down(silu(gate) * up).

Tensor parallel: gate and up are each split column-parallel (a rank keeps intermediate / tp of each),
down is row-parallel; ``reduce_results=False`` leaves down's all-reduce to the caller (the MoE block
sums its shared expert with the routed experts' partials and reduces once)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gdnserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from gdnserve.layers.parallel import resolve


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, *, reduce_results: bool = True, tp_rank: int | None = None,
                 tp_size: int | None = None):
        super().__init__()
        tp_rank, tp_size = resolve(tp_rank, tp_size)
        self.gate_up_proj = MergedColumnParallelLinear(hidden, (intermediate, intermediate), tp_rank=tp_rank,
                                                       tp_size=tp_size)
        self.intermediate = intermediate // tp_size      # local
        self.down_proj = RowParallelLinear(intermediate, hidden, reduce_results=reduce_results, tp_rank=tp_rank,
                                           tp_size=tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)
        return self.down_proj(F.silu(gu[:, :self.intermediate]) * gu[:, self.intermediate:])
