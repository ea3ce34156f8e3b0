"""Sparse MoE block of Qwen3-Next / Qwen3.5-MoE: softmax top-k router, SwiGLU experts stored as stacked 3-D
weights, and a dense shared expert scaled by a sigmoid gate.

Rounding follows HF's ``Qwen3NextSparseMoeBlock`` / ``Qwen3_5MoeSparseMoeBlock``: router logits in the
activation dtype, softmax and the top-k renormalisation in fp32, routing weights cast back to the activation
dtype. The routed experts are ``ops.moe.moe_experts`` on ``self.backend`` (set by the model runner; "auto":
Triton on CUDA tensors): the PyTorch path keeps HF's order of roundings exactly (per-expert loop, host-read
counts); the Triton path is a grouped GEMM with device-side offsets (fp32 accumulation, no host read, so the
block can be captured in a CUDA graph).

Tensor parallel: every expert's intermediate dim is split across ranks (gate and up rows each split, down's
input columns split), the shared expert likewise (an ``MLP`` without its own reduction); router and shared
expert gate are replicated, so every rank routes identically. Each rank's output is a partial sum; the
block ends with ONE all-reduce of routed + shared partials (the sigmoid gate scales per token, so it
commutes with the sum).

Shared expert folded into the routed weights (``fold_shared``, done by ``load_moe_from_hf``): when the
shared expert's intermediate size equals the experts' (Qwen3.5-35B-A3B, Qwen3-Next: 512) and both are dense
in one dtype or both FP8, it is stored as expert number E: ``experts_gate_up [E+1, 2I, hidden]``, ``experts_down [E+1, hidden, I]``,
and its gate as row E of the router, ``gate.weight [E+1, hidden]``; ``shared_expert`` / ``shared_expert_gate``
are then None (no second copy of the weights). Tensor parallel cuts expert E's intermediate like the others'
(the shared MLP's gate / up / down split is the experts'), so folding is per rank. On the Triton path (``fused``
on) a step of at most ``fold_max_tokens`` tokens then runs the whole block as ONE router GEMM (E+1 logits), the
router kernel (column E leaves softmax / top-k and becomes each token's (k+1)-th pair, weight sigmoid(logit)
in the activation dtype; ``ops.moe.router``) and the grouped GEMM over E+1 experts with k+1 pairs per token:
the shared expert's output is rounded like a routed pair's (pair output in the activation dtype, the k+1
sum in fp32, rounded once). Larger steps, and the PyTorch path, compute the shared expert as before (dense
GEMMs, sigmoid gate, add) from views of row E with HF's ops and roundings: on the H200 the folded block is
1.01-1.70x faster from T = 1 to 16 (30 vs 51 µs at T = 1, 11 -> 5 kernels; 183 vs 224 µs at T = 16), even at
T = 24-32; past 16 tokens the shared expert's rows take several 16-row blocks, each re-streaming its weights,
and the extra pair per token enlarges the alignment (docs/kernels.md, ``benchmarks/results/moe_shared_h200.md``).
``unfold_shared`` restores the separate modules (``to_fp8`` and FP8 quantizing call it).

FP8 experts (``to_fp8``, block checkpoints): ``experts_gate_up`` / ``experts_down`` become e4m3 with float32
scales per 128x128 block, ``experts_gate_up_scale_inv [E, 2·ceil(I/128), ceil(hidden/128)]`` (gate blocks
then up blocks) and ``experts_down_scale_inv [E, ceil(hidden/128), ceil(I/128)]``; the router stays dense.
An FP8 shared expert (its two layers FP8, loaded by the model loader after ``load_moe_from_hf``, which then
folds every block: ``fold_shared_experts``) folds the same way, its e4m3 weights and scales as row E of the
experts' (``[E+1, ...]``): at decode the folded step is the router GEMM, the router and the two FP8 decode
GEMVs over k+1 pairs (``ops/moe/decode_fp8_triton``), where the unfolded one also ran the shared expert's two
FP8 GEMVs, silu * up, the gate's two cuBLAS launches and sigmoid * add; larger steps run the shared expert's
FP8 layers' op (``fp8_linear``) on views of row E.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gdnserve.layers.linear import Shard, dense_linear, fill_, load_shard, local_blocks
from gdnserve.layers.mlp import MLP
from gdnserve.layers.parallel import all_reduce, resolve
from gdnserve.ops.backend import resolve as resolve_backend
from gdnserve.ops.gating import sigmoid_mul, silu_mul
from gdnserve.ops.gemv.norm_gemv import (
    add_rms_norm_gemv_route,
    fused_norm_router_default,
    new_counter,
)
from gdnserve.ops.moe import moe_experts
from gdnserve.ops.moe.router import route, route_torch
from gdnserve.ops.quant import fp8_linear

FP8_BLOCK = 128
# Steps of at most this many tokens run the folded block (module docstring). Measured on the H200 (E = 256, the
# grouped GEMM tiles of 34c239f, benchmarks/results/moe_shared_h200.md and moe_shared_fp8_h200.md): folded at least
# as fast at every T from 1 to 16 (bf16 1.70x at T = 1, 1.33x at 4, 1.01x at 8, 1.22x at 16; block FP8 1.41x,
# 1.16x, 1.06x, 1.36x), even from 24 to 32, slower at 64 (0.95x / 0.98x): up to 16 tokens the shared expert's rows
# are one 16-row block, past it each block re-streams its weights. The same in both formats.
FOLD_MAX_TOKENS = 16


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SparseMoE(nn.Module):
    """Parameters: ``gate.weight [E, hidden]`` (router), ``experts_gate_up [E, 2I, hidden]`` (rows
    ``[gate I | up I]``), ``experts_down [E, hidden, I]``, ``shared_expert`` (an ``MLP``) and
    ``shared_expert_gate.weight [1, hidden]``; the last two are None when ``shared_intermediate == 0`` or the
    shared expert is folded (``shared_folded``: expert E of the stacked weights, row E of ``gate.weight``).
    Under tensor parallelism I is this rank's ``moe_intermediate / tp`` (``moe_intermediate`` stays the full
    size, the checkpoint's)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, moe_intermediate: int,
                 shared_intermediate: int, norm_topk_prob: bool, *, tp_rank: int | None = None,
                 tp_size: int | None = None):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        self.tp_rank, self.tp_size = resolve(tp_rank, tp_size)
        self.hidden, self.num_experts, self.top_k = hidden, num_experts, top_k
        self.moe_intermediate, self.shared_intermediate = moe_intermediate, shared_intermediate
        (self.local_intermediate,) = local_blocks((moe_intermediate,), self.tp_size, "SparseMoE.moe_intermediate")
        I = self.local_intermediate
        self.norm_topk_prob = norm_topk_prob
        self.backend = "auto"      # the routed experts' op (ops/moe): Triton grouped GEMM on CUDA, capturable
        self.fused = True          # on the Triton backend: the fused router (ops/moe/router: one launch at decode)
        self.fold_max_tokens = FOLD_MAX_TOKENS   # ... and folded: steps up to this size run it as expert E
        # the decoder's post-attention norm folded into the router GEMM at one token (forward_prenorm); off unless
        # GDNSERVE_FUSED_NORM_ROUTER=1 until the H200 has timed it
        self.fused_norm_router = fused_norm_router_default()
        self._route_counter: torch.Tensor | None = None     # its arrival counter (forward_prenorm)
        self.shared_folded = False         # storage: the shared expert is expert E (fold_shared)
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts_gate_up = nn.Parameter(torch.empty(num_experts, 2 * I, hidden))
        self.experts_down = nn.Parameter(torch.empty(num_experts, hidden, I))
        self.tp_shards = {"experts_gate_up": Shard(1, (moe_intermediate, moe_intermediate)),
                          "experts_down": Shard(2, (moe_intermediate,))}
        self.experts_gate_up_scale_inv: nn.Parameter | None = None      # FP8 experts only (to_fp8)
        self.experts_down_scale_inv: nn.Parameter | None = None
        if shared_intermediate > 0:
            self.shared_expert: MLP | None = MLP(hidden, shared_intermediate, reduce_results=False,
                                                 tp_rank=self.tp_rank, tp_size=self.tp_size)
            self.shared_expert_gate: nn.Linear | None = nn.Linear(hidden, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    @property
    def experts_scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.experts_gate_up_scale_inv is None:
            return None
        return self.experts_gate_up_scale_inv, self.experts_down_scale_inv

    def experts_fp8_ok(self) -> bool:
        """Whether this rank's expert slices fall on whole 128-blocks (always with tp = 1)."""
        return self.tp_size == 1 or self.moe_intermediate % (self.tp_size * FP8_BLOCK) == 0

    def to_fp8(self) -> None:
        """FP8 experts: new empty e4m3 weights and float32 block scales on the weights' device (meta before
        loading); see the module docstring for the layouts. A folded block is unfolded first (the shared expert
        becomes its own dense MLP again, for the caller to quantize; ``fold_shared`` folds the FP8 one)."""
        self.unfold_shared()
        if not self.experts_fp8_ok():
            raise ValueError(f"SparseMoE: moe_intermediate={self.moe_intermediate} / tp={self.tp_size} is not a "
                             f"multiple of {FP8_BLOCK}")
        E, I, H, dev = self.num_experts, self.local_intermediate, self.hidden, self.experts_gate_up.device
        SG, SH, f8 = _cdiv(I, FP8_BLOCK), _cdiv(H, FP8_BLOCK), torch.float8_e4m3fn

        def param(*shape, dtype=torch.float32):
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=dev), requires_grad=False)
        self.experts_gate_up, self.experts_down = param(E, 2 * I, H, dtype=f8), param(E, H, I, dtype=f8)
        self.experts_gate_up_scale_inv, self.experts_down_scale_inv = param(E, 2 * SG, SH), param(E, SH, SG)
        full = (self.moe_intermediate // FP8_BLOCK if self.tp_size > 1 else SG)
        self.tp_shards.update(experts_gate_up_scale_inv=Shard(1, (full, full)), experts_down_scale_inv=Shard(2, (full,)))

    def shared_foldable(self) -> bool:
        """Whether ``fold_shared`` can store the shared expert as expert E: it exists (unfolded), has the
        experts' local intermediate size, and is stored as the experts are: all dense in one dtype, or all FP8
        (its gate_up with no dense tail, the intermediate on whole 128-blocks so its gate and up scale rows
        stack like an expert's)."""
        s, g = self.shared_expert, self.shared_expert_gate
        if s is None or s.intermediate != self.local_intermediate or g.weight.dtype != self.gate.weight.dtype:
            return False
        gu, dn = s.gate_up_proj, s.down_proj
        if self.experts_scales is not None:
            return (gu.qweight is not None and dn.qweight is not None and gu.weight.shape[0] == 0
                    and self.local_intermediate % FP8_BLOCK == 0 and gu.qweight.device == self.experts_gate_up.device)
        return (gu.qweight is None and dn.qweight is None
                and gu.weight.dtype == dn.weight.dtype == self.experts_gate_up.dtype == self.experts_down.dtype)

    @torch.no_grad()
    def fold_shared(self) -> bool:
        """Store the shared expert as expert E and its gate as router row E (module docstring), in place,
        on the weights' device; FP8 experts take its e4m3 weights and block scales as row E of theirs. Returns
        whether the block is folded (False: ``shared_foldable`` is not)."""
        if self.shared_folded or not self.shared_foldable():
            return self.shared_folded
        s, g = self.shared_expert, self.shared_expert_gate
        fp8 = self.experts_scales is not None
        gu, dn = ((s.gate_up_proj.qweight, s.down_proj.qweight) if fp8 else
                  (s.gate_up_proj.weight, s.down_proj.weight))
        self.experts_gate_up.data = torch.cat([self.experts_gate_up.data, gu.data[None]])
        self.experts_down.data = torch.cat([self.experts_down.data, dn.data[None]])
        if fp8:
            self.experts_gate_up_scale_inv.data = torch.cat([self.experts_gate_up_scale_inv.data,
                                                             s.gate_up_proj.weight_scale_inv.data[None]])
            self.experts_down_scale_inv.data = torch.cat([self.experts_down_scale_inv.data,
                                                          s.down_proj.weight_scale_inv.data[None]])
        self.gate.weight.data = torch.cat([self.gate.weight.data, g.weight.data])
        self.gate.out_features = self.num_experts + 1
        self.shared_expert = self.shared_expert_gate = None
        self.shared_folded = True
        return True

    @torch.no_grad()
    def unfold_shared(self) -> None:
        """Undo ``fold_shared`` (no-op when not folded): a separate shared ``MLP`` (FP8 layers when the experts
        are FP8) and gate again."""
        if not self.shared_folded:
            return
        E, sc = self.num_experts, self.experts_scales
        gu, dn, gw = self.experts_gate_up.data, self.experts_down.data, self.gate.weight.data
        with torch.device("meta"):
            mlp = MLP(self.hidden, self.shared_intermediate, reduce_results=False, tp_rank=self.tp_rank,
                      tp_size=self.tp_size)
            gate = nn.Linear(self.hidden, 1, bias=False)
            if sc is not None:
                mlp.gate_up_proj.to_fp8(2)
                mlp.down_proj.to_fp8()
        if sc is None:
            mlp.gate_up_proj.weight = nn.Parameter(gu[E].clone())
            mlp.down_proj.weight = nn.Parameter(dn[E].clone())
        else:
            def frozen(t: torch.Tensor) -> nn.Parameter:
                return nn.Parameter(t.clone(), requires_grad=False)
            mlp.gate_up_proj.qweight, mlp.gate_up_proj.weight_scale_inv = frozen(gu[E]), frozen(sc[0][E])
            mlp.gate_up_proj.weight = nn.Parameter(gw.new_empty(0, self.hidden))
            mlp.down_proj.qweight, mlp.down_proj.weight_scale_inv = frozen(dn[E]), frozen(sc[1][E])
            self.experts_gate_up_scale_inv.data = sc[0][:E].clone()
            self.experts_down_scale_inv.data = sc[1][:E].clone()
        gate.weight = nn.Parameter(gw[E:].clone())
        self.experts_gate_up.data, self.experts_down.data = gu[:E].clone(), dn[:E].clone()
        self.gate.weight.data, self.gate.out_features = gw[:E].clone(), E
        self.shared_expert, self.shared_expert_gate, self.shared_folded = mlp, gate, False

    def routed_scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The routed experts' FP8 scales (a folded block's without row E), None for dense experts."""
        sc = self.experts_scales
        if sc is None or not self.shared_folded:
            return sc
        return sc[0][:self.num_experts], sc[1][:self.num_experts]

    def forward_prenorm(self, h: torch.Tensor, residual: torch.Tensor, norm: nn.Module,
                        backend: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(h + residual)), h + residual): the decoder's post-attention norm and this block. With
        ``fused_norm_router`` at one token on the Triton backend (folded shared expert, bf16/fp16 router) the norm,
        the router GEMM and the routing are one launch (``ops.gemv.norm_gemv``: the same roundings and routing);
        else the norm's own launch, then the block."""
        if self._route_counter is None or self._route_counter.device != h.device:
            # allocated at the first call (a prefill, before any decode graph is captured), kept: left at 0
            self._route_counter = new_counter(h.device)
        if (self.fused_norm_router and self.fused and h.shape[0] == 1 and self.shared_folded
                and self.fold_max_tokens >= 1 and h.dtype in (torch.bfloat16, torch.float16)
                and self.gate.weight.dtype == h.dtype and resolve_backend(self.backend, h) == "triton"):
            r, x, s = add_rms_norm_gemv_route(h, residual, norm.weight, norm.eps, self.gate.weight,
                                              self._route_counter, self.top_k, self.norm_topk_prob, True)
            out = moe_experts(x, r.weights, r.experts, self.experts_gate_up, self.experts_down, backend="triton",
                              scales=self.experts_scales, alignment=r.alignment)
            return all_reduce(out, self.tp_size), s
        x, s = norm(h, residual, backend=backend)
        return self(x), s

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> (weights [T, top_k] in x.dtype, experts [T, top_k] int64): HF's PyTorch ops."""
        return route_torch(F.linear(x, self.gate.weight[:self.num_experts]), self.top_k, self.norm_topk_prob)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x: expected [T, {self.hidden}], got {list(x.shape)}")
        E = self.num_experts
        triton = self.fused and resolve_backend(self.backend, x) == "triton"
        if triton and self.shared_folded and x.shape[0] <= self.fold_max_tokens:   # router GEMM, router, grouped GEMM
            r = route(dense_linear(x, self.gate.weight), self.top_k, self.norm_topk_prob, "triton", shared=True)
            out = moe_experts(x, r.weights, r.experts, self.experts_gate_up, self.experts_down, backend="triton",
                              scales=self.experts_scales, alignment=r.alignment)
            return all_reduce(out, self.tp_size)
        gu, dn, al = self.experts_gate_up, self.experts_down, None
        if self.shared_folded:
            gu, dn = gu[:E], dn[:E]
        if triton:                                        # one fused router launch at decode sizes
            weights, experts, al = route(dense_linear(x, self.gate.weight[:E]), self.top_k, self.norm_topk_prob,
                                         "triton")
        else:
            weights, experts = self.route(x)
        out = moe_experts(x, weights, experts, gu, dn, backend=self.backend, scales=self.routed_scales(), alignment=al)
        if self.shared_folded or self.shared_expert is not None:
            out = self.shared_output(x, out, "triton" if triton else "torch")
        return all_reduce(out, self.tp_size)

    def shared_output(self, x: torch.Tensor, add: torch.Tensor | None = None,
                      backend: str = "torch") -> torch.Tensor:
        """[add +] sigmoid(shared gate(x)) * shared_expert(x) (a folded block reads views of row E): HF's ops
        on the PyTorch backend; on the Triton one silu * up and the gate's sigmoid, product and sum one launch
        each (``ops.gating``, the same roundings)."""
        if not self.shared_folded:           # the MLP's ops, its silu * up through ops.gating
            s = self.shared_expert
            h = s.down_proj(silu_mul(s.gate_up_proj(x), backend=backend))
            return sigmoid_mul(h, self.shared_expert_gate(x), add, backend=backend)
        E, sc = self.num_experts, self.experts_scales
        if sc is None:
            h = F.linear(silu_mul(F.linear(x, self.experts_gate_up[E]), backend=backend), self.experts_down[E])
        else:                                # the unfolded MLP's FP8 layers' op (backend auto) on views of row E
            h = fp8_linear(silu_mul(fp8_linear(x, self.experts_gate_up[E], sc[0][E]), backend=backend),
                           self.experts_down[E], sc[1][E])
        return sigmoid_mul(h, F.linear(x, self.gate.weight[E:]), add, backend=backend)


def load_moe_from_hf(moe: SparseMoE, get: Callable[[str], torch.Tensor], prefix: str,
                     dtype: torch.dtype,
                     get_fp8: Callable[[str], tuple[torch.Tensor, torch.Tensor]] | None = None,
                     in_place: bool = True) -> set[str]:
    """Fill ``moe`` from an HF checkpoint accessor ``get(name)`` (raises KeyError or ValueError when the name
    is absent). ``prefix`` is the MoE block's own prefix, e.g. ``"model.layers.3.mlp."``.

    Experts are read from either layout, chosen per tensor:
    fused (transformers >= 5, and on-disk Qwen3.5-MoE) ``{prefix}experts.gate_up_proj [E, 2I, hidden]`` with
    rows ``[gate | up]`` and ``{prefix}experts.down_proj [E, hidden, I]``; or per expert (on-disk Qwen3-Next)
    ``{prefix}experts.{e}.{gate,up,down}_proj.weight``. Also ``{prefix}gate.weight`` and, when the block has a
    shared expert, ``{prefix}shared_expert.{gate,up,down}_proj.weight`` and ``{prefix}shared_expert_gate.weight``.
    Returns the names consumed; a missing or mis-shaped tensor raises ValueError naming it. Shapes are the
    full (checkpoint) ones; each parameter keeps this rank's part (``layers.linear.weight_loader``).

    FP8 experts (after ``moe.to_fp8()``): per-expert tensors only, each read as (e4m3 weight, float32 block
    scales) by ``get_fp8(module_name)``; gate and up scale rows are stacked like their weights. A shared
    expert's FP8 layers (``qweight`` set) are left to the caller (the model loader plans FP8 layers).
    A dense shared expert of the experts' size is folded afterwards (``SparseMoE.fold_shared``). A block allocated
    folded (``fold_shared`` on the meta device before ``to_empty``: the model loader) is filled in place, the
    shared expert (dense or FP8, read here) as expert E and its gate as router row E: no allocation beside the
    parameters', which on CUDA left the fold's freed blocks as fragments.
    """
    E, I, H, S = moe.num_experts, moe.moe_intermediate, moe.hidden, moe.shared_intermediate
    folded = moe.shared_folded          # allocated folded (the model loader folds on the meta device): the shared
    used: set[str] = set()              # expert's tensors are filled as row E of the experts', in place

    def fetch(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = _try_get(get, name)
        if t is None:
            raise ValueError(f"missing tensor {name} (expected shape {list(shape)})")
        _check(name, t, shape)
        used.add(name)
        return t

    def experts(fused: str, shape: tuple[int, ...], parts: tuple[str, ...], part_shape: tuple[int, ...]):
        t = _try_get(get, prefix + fused)
        if t is not None:
            _check(prefix + fused, t, shape)
            used.add(prefix + fused)
            return t
        first = f"{prefix}experts.0.{parts[0]}.weight"
        if _try_get(get, first) is None:
            raise ValueError(f"missing tensor {prefix + fused} (expected shape {list(shape)}) "
                             f"or per-expert {first} (expected shape {list(part_shape)})")
        return torch.stack([torch.cat([fetch(f"{prefix}experts.{e}.{p}.weight", part_shape) for p in parts], 0)
                            for e in range(E)])

    def shared_fp8(s: str, parts: tuple[str, ...], shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The FP8 shared expert's (e4m3 weight, block scales), its gate and up stacked as an expert's."""
        if get_fp8 is None:
            raise ValueError(f"{s}: an FP8 shared expert needs get_fp8")
        qs = []
        for p in parts:
            q, sc = get_fp8(s + p)
            _check(f"{s}{p}.weight", q, shape)
            used.update({f"{s}{p}.weight", f"{s}{p}.weight_scale_inv"})
            qs.append((q, sc))
        return torch.cat([q for q, _ in qs]), torch.cat([sc for _, sc in qs])

    plan: dict[str, torch.Tensor] = {"gate.weight": fetch(prefix + "gate.weight", (E, H))}
    if moe.experts_scales is None:
        plan["experts_gate_up"] = experts("experts.gate_up_proj", (E, 2 * I, H), ("gate_proj", "up_proj"), (I, H))
        plan["experts_down"] = experts("experts.down_proj", (E, H, I), ("down_proj",), (H, I))
    else:
        if get_fp8 is None:
            raise ValueError(f"{prefix}experts: FP8 experts need get_fp8")

        def fp8(e: int, parts: tuple[str, ...], shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
            qs = []
            for p in parts:
                q, s = get_fp8(f"{prefix}experts.{e}.{p}")
                _check(f"{prefix}experts.{e}.{p}.weight", q, shape)
                used.update({f"{prefix}experts.{e}.{p}.weight", f"{prefix}experts.{e}.{p}.weight_scale_inv"})
                qs.append((q, s))
            return torch.cat([q for q, _ in qs]), torch.cat([s for _, s in qs])
        gu = [fp8(e, ("gate_proj", "up_proj"), (I, H)) for e in range(E)]
        dn = [fp8(e, ("down_proj",), (H, I)) for e in range(E)]
        plan["experts_gate_up"], plan["experts_gate_up_scale_inv"] = (torch.stack(t) for t in zip(*gu))
        plan["experts_down"], plan["experts_down_scale_inv"] = (torch.stack(t) for t in zip(*dn))
    if folded:                                 # the shared expert as expert E, its gate as router row E
        s = prefix + "shared_expert."
        plan["gate.weight"] = torch.cat([plan["gate.weight"], fetch(prefix + "shared_expert_gate.weight", (1, H))])
        if moe.experts_scales is None:
            gu = torch.cat([fetch(s + "gate_proj.weight", (S, H)), fetch(s + "up_proj.weight", (S, H))])
            plan["experts_gate_up"] = torch.cat([plan["experts_gate_up"], gu[None]])
            plan["experts_down"] = torch.cat([plan["experts_down"], fetch(s + "down_proj.weight", (H, S))[None]])
        else:
            (qg, sg), (qd, sd) = shared_fp8(s, ("gate_proj", "up_proj"), (S, H)), shared_fp8(s, ("down_proj",), (H, S))
            for name, t in (("experts_gate_up", qg), ("experts_gate_up_scale_inv", sg), ("experts_down", qd),
                            ("experts_down_scale_inv", sd)):
                plan[name] = torch.cat([plan[name], t[None]])
    elif moe.shared_expert is not None:        # an FP8 layer of the shared expert: planned by the model loader
        s = prefix + "shared_expert."
        if moe.shared_expert.gate_up_proj.qweight is None:
            plan["shared_expert.gate_up_proj.weight"] = torch.cat(
                [fetch(s + "gate_proj.weight", (S, H)), fetch(s + "up_proj.weight", (S, H))], 0)
        if moe.shared_expert.down_proj.qweight is None:
            plan["shared_expert.down_proj.weight"] = fetch(s + "down_proj.weight", (H, S))
        plan["shared_expert_gate.weight"] = fetch(prefix + "shared_expert_gate.weight", (1, H))
    params = dict(moe.named_parameters())
    with torch.no_grad():
        for name, t in plan.items():
            p = params[name]
            keep = p.dtype if moe.experts_scales is not None and name.startswith("experts_") else dtype   # FP8
            fill_(p, load_shard(moe, name, t), keep, in_place)
    moe.fold_shared()                   # unfolded: folded now if it can be (an FP8 shared layer is the caller's)
    return used


def fold_shared_experts(model: nn.Module) -> int:
    """``fold_shared`` on every SparseMoE of ``model`` that allows it (random-weight models built without the
    loader); returns how many are folded."""
    return sum(m.fold_shared() for m in model.modules() if isinstance(m, SparseMoE))


def _try_get(get: Callable[[str], torch.Tensor], name: str) -> torch.Tensor | None:
    try:
        return get(name)
    except (KeyError, ValueError):
        return None


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: checkpoint tensor has shape {list(t.shape)}, expected {list(shape)}")
