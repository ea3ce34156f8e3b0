"""The Gated DeltaNet token mixer of a hybrid decoder layer (gdn_kernels.md §1.2).

One fused input projection, columns ordered ``[q | k | v | z | b | a]`` (the loader permutes Qwen3-Next's
per-group interleaving into this at load time), so every split is a plain column slice of one GEMM output
and q/k/v reach the kernels as strided views, never copies. Prefill tokens go through the step's
PrefillPlan (any of the four grouped executors); decode tokens through the recurrent ops, both on the
pool views bound at start-up.

Tensor parallel (gdn_kernels.md §1.1): a rank holds H/tp key heads and HV/tp value heads. Each block of
the in-projection (q, k, v, z, b, a), each of the conv's three channel blocks (q, k, v), A_log and dt_bias
are split by heads, so the rank's value head j still reads its local key head j // r; the gated-norm
weight [V] is replicated and out_proj is row-parallel (one all-reduce). ``H``, ``HV`` below are local.
"""
from __future__ import annotations

import torch
from torch import nn

from gdnserve.layers.forward_context import get_forward_context
from gdnserve.layers.gdn_prefill import GDNCoreParams, gdn_prefill_core, split_qkv
from gdnserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear, Shard, local_blocks
from gdnserve.layers.norm import GatedRMSNorm
from gdnserve.layers.parallel import resolve
from gdnserve.layers.rank_shapes import GDNShape
from gdnserve.ops.backend import resolve as resolve_backend
from gdnserve.ops.conv import causal_conv1d_fold, causal_conv1d_update
from gdnserve.ops.gdn.decode_fused import (fused_decode_default, fused_decode_supported, gdn_decode_fused,
                                           new_counters)
from gdnserve.ops.gdn.decode_fused_triton import quant_fusable
from gdnserve.ops.gdn.recurrent import (GDNPending, gdn_commit_intermediate, gdn_decode, gdn_flush_pending,
                                         gdn_verify)


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden: int, H: int, HV: int, K: int, V: int, W: int, eps: float, *,
                 tp_rank: int | None = None, tp_size: int | None = None):
        """H, HV: the model's (full) head counts; the module keeps this rank's H / tp, HV / tp."""
        super().__init__()
        self.tp_rank, self.tp_size = resolve(tp_rank, tp_size)
        tp = self.tp_size
        if H % tp or HV % tp:
            raise ValueError(f"GatedDeltaNet: key heads H={H} and value heads HV={HV} must be divisible by "
                             f"tp_size={tp}")
        shape = GDNShape.split(H, HV, K, V, tp)
        self.H, self.HV, self.K, self.V, self.W = shape.H, shape.HV, K, V, W
        self.conv_dim = shape.conv_dim
        conv_blocks = (H * K, H * K, HV * V)
        self.in_proj = MergedColumnParallelLinear(hidden, conv_blocks + (HV * V, HV, HV), tp_rank=self.tp_rank,
                                                  tp_size=tp)
        self.conv_weight = nn.Parameter(torch.empty(sum(local_blocks(conv_blocks, tp, "GatedDeltaNet.conv")), W))
        self.A_log = nn.Parameter(torch.empty(self.HV, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(self.HV))
        self.norm = GatedRMSNorm(V, eps)
        self.out_proj = RowParallelLinear(HV * V, hidden, tp_rank=self.tp_rank, tp_size=tp)
        self.tp_shards = {"conv_weight": Shard(0, conv_blocks), "A_log": Shard(0, (HV,)), "dt_bias": Shard(0, (HV,))}
        self.conv_pool: torch.Tensor | None = None   # [S, W-1, D], bound by the runner
        self.conv_scratch = self.ssm_scratch = self.pending = None   # speculative-decoding buffers (bind_spec)
        self.ssm_pool: torch.Tensor | None = None    # [S, HV, V, K]
        self.backend = "auto"
        self.fused = True        # the gated norm as one Triton launch on the Triton backend (models.set_fused)
        # A pure decode step's conv + recurrent + gated norm as one launch (ops/gdn/decode_fused; Triton backend,
        # K·V <= 128², with ``fused``). Off unless GDNSERVE_FUSED_DECODE=1 until the H200 has timed it.
        self.fused_decode = fused_decode_default()
        self.decode_counters: torch.Tensor | None = None   # its per-(slot, key head) counters, with the pools
        self._counters: dict[tuple[int, int], torch.Tensor] = {}

    def bind_state(self, conv_pool: torch.Tensor | None, ssm_pool: torch.Tensor | None) -> None:
        """The pools this mixer reads and writes (None, None: unbound, e.g. after the memory plan's warm-up)."""
        self.conv_pool, self.ssm_pool = conv_pool, ssm_pool
        if ssm_pool is None:
            self.decode_counters = None
            return
        # allocated here, never in a forward (a graph capture must find it): S x H int32, left at 0 by every launch.
        # One per bound pool, kept alive with the mixer: a graph captured with an earlier binding still points at it
        key = (ssm_pool.data_ptr(), ssm_pool.shape[0])
        if key not in self._counters:
            self._counters[key] = new_counters(ssm_pool.shape[0], self.H, ssm_pool.device)
        self.decode_counters = self._counters[key]

    def bind_spec(self, conv_scratch: torch.Tensor | None, ssm_scratch: torch.Tensor | None,
                  pending: GDNPending | None) -> None:
        """Speculative-decoding buffers: conv_scratch [R, L, D] holds drafted raw conv inputs (scratch rows in
        intermediate mode, ping-pong pending rows in replay mode); ssm_scratch [R, L, HV, V, K] per-token
        states (intermediate); pending the drafted k, v, a, b (replay)."""
        self.conv_scratch, self.ssm_scratch, self.pending = conv_scratch, ssm_scratch, pending

    def _verify(self, x, a, b, vf, p: GDNCoreParams, o: torch.Tensor) -> None:
        L = vf.tokens_per_req
        replay = vf.mode == "replay"
        y = causal_conv1d_update(x, self.conv_weight, self.conv_pool, vf.slots, tokens_per_req=L,
                                 write_state="after_pending" if replay else "none", pending_x=self.conv_scratch,
                                 pending_in_rows=vf.rows_in, num_pending=vf.num_pending, pending_out_rows=vf.rows_out,
                                 backend=self.backend)
        q, k, v = split_qkv(y, p)
        if replay:
            gdn_verify(q, k, v, a, b, self.A_log, self.dt_bias, self.ssm_pool, vf.slots, tokens_per_req=L,
                       mode="replay", pending=self.pending, pending_in_rows=vf.rows_in, num_pending=vf.num_pending,
                       pending_out_rows=vf.rows_out, out=o, backend=self.backend)
        else:
            gdn_verify(q, k, v, a, b, self.A_log, self.dt_bias, self.ssm_pool, vf.slots, tokens_per_req=L,
                       mode="intermediate", scratch=self.ssm_scratch, scratch_rows=vf.rows_out, out=o,
                       backend=self.backend)

    def commit(self, slots: torch.Tensor, rows: torch.Tensor, num_accepted: torch.Tensor, mode: str) -> None:
        """Make the first ``num_accepted[n]`` verify tokens of each request the committed state of its slot:
        intermediate copies scratch row num_accepted-1 and folds the conv inputs; replay applies the
        pending tokens (the flush before a slot is read by anything but the next verify)."""
        if mode == "intermediate":
            gdn_commit_intermediate(self.ssm_pool, self.ssm_scratch, rows, slots, num_accepted, backend=self.backend)
        else:
            gdn_flush_pending(self.ssm_pool, slots, self.pending, rows, num_accepted, A_log=self.A_log,
                              dt_bias=self.dt_bias, backend=self.backend)
        causal_conv1d_fold(self.conv_pool, slots, self.conv_scratch, rows, num_accepted, backend=self.backend)

    def _fused_decode_on(self, h: torch.Tensor) -> bool:
        return (self.fused_decode and self.fused and self.decode_counters is not None
                and resolve_backend(self.backend, h) == "triton"
                and fused_decode_supported(self.H, self.HV, self.K, self.V, self.W))

    def params(self) -> GDNCoreParams:
        return GDNCoreParams(self.conv_weight, self.A_log, self.dt_bias, self.H, self.HV, self.K, self.V)

    def takes_quantized_input(self, h: torch.Tensor) -> bool:
        """Whether ``forward`` wants h's FP8 quantization (its in_proj would quantize h by its own launch)."""
        return self.in_proj.takes_quantized_input(h)

    def forward(self, h: torch.Tensor, xq: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """h [T, hidden] -> [T, hidden]; ``xq``: h's FP8 quantization for in_proj (its producer's, or None)."""
        ctx = get_forward_context()
        T = h.shape[0]
        D, HVV, HV = self.conv_dim, self.HV * self.V, self.HV
        proj = self.in_proj(h, xq=xq)
        if T and ctx.num_prefill == 0 and ctx.verify is None and self._fused_decode_on(h):
            quant = quant_fusable(self.V) and self.out_proj.takes_quantized_input(proj[:, D:D + HVV])
            y = gdn_decode_fused(proj, self.conv_weight, self.conv_pool, self.A_log, self.dt_bias, self.ssm_pool,
                                 ctx.decode_slots, self.norm.weight, self.norm.eps, self.decode_counters, self.H,
                                 quant=quant)
            y, yq = y if quant else (y, None)
            return self.out_proj(y, xq=yq)
        x, z = proj[:, :D], proj[:, D:D + HVV]
        b, a = proj[:, D + HVV:D + HVV + HV], proj[:, D + HVV + HV:]
        o = torch.empty(T, HV, self.V, dtype=h.dtype, device=h.device)
        p = self.params()
        tp = ctx.num_prefill
        if tp:
            gdn_prefill_core(x[:tp], a[:tp], b[:tp], p, self.conv_pool, self.ssm_pool, ctx.prefill,
                             out=o[:tp], backend=self.backend)
        vf = ctx.verify
        td = T - (0 if vf is None else vf.slots.shape[0] * vf.tokens_per_req)   # end of the decode tokens
        if tp < td:
            slots = ctx.decode_slots
            y = causal_conv1d_update(x[tp:td], self.conv_weight, self.conv_pool, slots, tokens_per_req=1,
                                     backend=self.backend)
            q, k, v = split_qkv(y, p)
            gdn_decode(q, k, v, a[tp:td], b[tp:td], self.A_log, self.dt_bias, self.ssm_pool, slots, out=o[tp:td],
                       backend=self.backend)
        if td < T:
            self._verify(x[td:], a[td:], b[td:], vf, p, o[td:])
        # fused: one launch reading z in place (its strided view); else the PyTorch ops (HF's, z copied). An FP8
        # out_proj that would quantize y by a launch of its own gets y's quantization from the norm's registers
        be = self.backend if self.fused else "torch"
        quant = resolve_backend(be, o) == "triton" and self.out_proj.takes_quantized_input(o.view(T, HVV))
        y = self.norm(o, z.view(T, HV, self.V), backend=be, quant=quant)
        y, yq = y if quant else (y, None)
        return self.out_proj(y.view(T, HVV), xq=yq)
