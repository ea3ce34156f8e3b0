"""Tensor-parallel linear layers (the nano-vllm pattern) and the sharding rule every TP-split parameter
follows.

A split parameter is described by a :class:`Shard`: along one dim the full tensor is a concatenation of
blocks (e.g. the GDN in-projection's ``[q | k | v | z | b | a]`` rows), and each block is cut into
``tp_size`` equal contiguous parts, rank ``p`` keeping part ``p`` of every block. Cutting each block
separately is what keeps fused projections correct: rank ``p`` gets its own heads of q, of k and of v,
not a contiguous run of the fused rows. Modules list their split parameters in ``tp_shards`` (plain data,
so it survives building on the meta device); :func:`weight_loader` turns a FULL checkpoint tensor into
this rank's part. Column-parallel layers need no communication; a row-parallel layer sums its partial
outputs with one all-reduce (``reduce_results=False`` leaves that to the caller, e.g. the MoE block).

FP8 block checkpoints (``to_fp8``, called by the loader on the meta device before weights are allocated):
the layer's weight becomes ``qweight`` (float8_e4m3fn) + ``weight_scale_inv`` (float32, one per 128x128
block) and runs ``ops.quant.fp8_linear``. A column-parallel layer may keep its last output blocks dense
(``weight`` then holds only those rows: the "tail", e.g. the GDN ``b`` / ``a`` rows the checkpoints leave
in bf16). Block boundaries must be whole 128-row blocks: every FP8 output block but the last a multiple
of 128 (with tp > 1 every block's per-rank part), a row-parallel layer's per-rank K a multiple of 128;
``fp8_layout_ok`` says whether a layout qualifies (the loader dequantizes a layer that does not).

An FP8 layer's input may come already quantized: ``forward(x, xq=(q, s))`` with ``q, s`` exactly
``quantize_act_triton(x)`` (the producer kernel quantized its own output in registers: the decoder's add +
RMSNorm, the GDN gated norm, attention's sigmoid gate), skipping the Triton path's quantization launch.
``takes_quantized_input(x)`` says whether that saves a launch (shapes, devices and flags only: graph-safe);
``PRODUCER_QUANT = False`` turns the handover off everywhere (the unfused comparison of the tests).
``backend`` (default "auto": Triton on CUDA) is the FP8 op's; tests set "triton" to run it under the
interpreter on CPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gdnserve.layers.parallel import all_reduce, resolve
from gdnserve.ops.backend import Backend
from gdnserve.ops.backend import resolve as resolve_backend
from gdnserve.ops.gating import sigmoid_mul
from gdnserve.ops.gemv import skinny_config
from gdnserve.ops.gemv.skinny_triton import gate_fits, skinny_unchecked
from gdnserve.ops.quant import BLOCK, fp8_linear
from gdnserve.ops.quant.fp8_linear import quantizes_input

FP8 = torch.float8_e4m3fn
PRODUCER_QUANT = True      # producers hand FP8 layers their quantized output where it saves a launch


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dense_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)``; on CUDA, decode-sized x [M <= 16, K] takes the one-launch skinny GEMM of
    ``ops.gemv`` where its table says it beats cuBLAS at this (N, K, M)."""
    if x.is_cuda and x.dim() == 2 and x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16):
        cfg = skinny_config(x.shape[0], w.shape[0], w.shape[1])
        if cfg is not None and x.shape[1] == w.shape[1] and x.stride(1) == 1 and w.stride(1) == 1:
            return skinny_unchecked(x, w, cfg)
    return F.linear(x, w)


@dataclass(frozen=True, slots=True)
class Shard:
    """Along ``dim`` the full tensor is ``blocks`` (full sizes, in order); each is split across ranks."""
    dim: int
    blocks: tuple[int, ...]


def local_blocks(blocks: tuple[int, ...] | list[int], tp_size: int, owner: str) -> tuple[int, ...]:
    """Per-rank sizes of ``blocks``; ValueError naming ``owner`` when a block does not divide."""
    for i, b in enumerate(blocks):
        if b % tp_size:
            raise ValueError(f"{owner}: block {i} of size {b} is not divisible by tp_size={tp_size}")
    return tuple(b // tp_size for b in blocks)


def take_shard(full: torch.Tensor, shard: Shard, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``full`` (a new contiguous tensor): part ``rank`` of each block along
    ``shard.dim``, concatenated in block order. No blocks (an FP8 layer's empty dense tail): an empty part."""
    if not shard.blocks:
        return full.narrow(shard.dim, 0, 0).contiguous()
    parts = torch.split(full, list(shard.blocks), dim=shard.dim)
    return torch.cat([p.narrow(shard.dim, rank * (p.shape[shard.dim] // size), p.shape[shard.dim] // size)
                      for p in parts], dim=shard.dim)


def full_shape(module: nn.Module, name: str) -> list[int]:
    """The checkpoint (unsharded) shape of ``module``'s own parameter ``name``."""
    shape = list(getattr(module, name).shape)
    spec = getattr(module, "tp_shards", {}).get(name)
    if spec is not None:
        shape[spec.dim] = sum(spec.blocks)
    return shape


def fill_(p: nn.Parameter, t: torch.Tensor, dtype: torch.dtype, in_place: bool = True) -> None:
    """``p`` := ``t`` in ``dtype``, into the storage ``to_empty`` allocated where shape and dtype match (no second
    allocation: on CUDA each replaced parameter left a freed block that later, smaller allocations split, segments
    the caching allocator cannot return: the "in use" of the memory plan), else (or ``in_place`` False) ``t`` on
    ``p``'s device in ``dtype``: ``t`` itself where it already is."""
    if in_place and p.device.type != "meta" and p.dtype == dtype and p.shape == t.shape and p.is_contiguous():
        p.data.copy_(t)
    else:
        p.data = t.to(device=p.device, dtype=dtype).contiguous()


def weight_loader(module: nn.Module, name: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``module``'s parameter ``name`` from the FULL checkpoint tensor (replicated
    parameters: ``full`` itself). ValueError when ``full`` does not have the checkpoint shape."""
    want = full_shape(module, name)
    if list(full.shape) != want:
        raise ValueError(f"checkpoint tensor has shape {list(full.shape)}, expected {want}")
    spec = getattr(module, "tp_shards", {}).get(name)
    if spec is None or module.tp_size == 1:
        return full
    return take_shard(full, spec, module.tp_rank, module.tp_size)


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ with W's output rows split across ranks: x replicated [T, in] -> y local [T, out / tp].
    ``blocks`` (default: one block of ``out_features``) are the output blocks each split separately."""

    def __init__(self, in_features: int, out_features: int, *, blocks: tuple[int, ...] | None = None,
                 tp_rank: int | None = None, tp_size: int | None = None):
        super().__init__()
        self.tp_rank, self.tp_size = resolve(tp_rank, tp_size)
        blocks = (out_features,) if blocks is None else tuple(blocks)
        if sum(blocks) != out_features:
            raise ValueError(f"{type(self).__name__}: blocks {list(blocks)} do not sum to out_features={out_features}")
        self.in_features, self.out_features = in_features, out_features
        self.local_blocks = local_blocks(blocks, self.tp_size, type(self).__name__)
        self.weight = nn.Parameter(torch.empty(sum(self.local_blocks), in_features))
        self.tp_shards = {"weight": Shard(0, blocks)}

        self.blocks = blocks
        self.qweight: nn.Parameter | None = None          # FP8 layers only (see to_fp8)
        self.weight_scale_inv: nn.Parameter | None = None
        self.num_fp8_blocks = 0
        self.backend: Backend = "auto"                    # the FP8 op's (see the module docstring)

    def weight_loader(self, full: torch.Tensor) -> torch.Tensor:
        return weight_loader(self, "weight", full)

    def fp8_layout_ok(self, num_fp8_blocks: int) -> bool:
        """Whether the first ``num_fp8_blocks`` output blocks can be one block-quantized weight here."""
        fp8 = self.blocks[:num_fp8_blocks]
        if not fp8:
            return False
        if self.tp_size > 1:
            return all(b % (self.tp_size * BLOCK) == 0 for b in fp8) and self.in_features % BLOCK == 0
        return all(b % BLOCK == 0 for b in fp8[:-1])

    def to_fp8(self, num_fp8_blocks: int) -> None:
        """Make the first ``num_fp8_blocks`` output blocks FP8 (``qweight`` + ``weight_scale_inv``), the
        rest a dense tail in ``weight``. New empty parameters on the weight's device (meta before loading)."""
        if not self.fp8_layout_ok(num_fp8_blocks):
            raise ValueError(f"{type(self).__name__}: output blocks {list(self.blocks)} (tp={self.tp_size}) do "
                             f"not allow an FP8 prefix of {num_fp8_blocks} blocks")
        dev, K = self.weight.device, self.in_features
        fp8, rest = self.blocks[:num_fp8_blocks], self.blocks[num_fp8_blocks:]
        n_fp8 = sum(local_blocks(fp8, self.tp_size, type(self).__name__))
        n_rest = sum(local_blocks(rest, self.tp_size, type(self).__name__))
        self.qweight = nn.Parameter(torch.empty(n_fp8, K, dtype=FP8, device=dev), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(_cdiv(n_fp8, BLOCK), _cdiv(K, BLOCK), device=dev),
                                             requires_grad=False)
        self.weight = nn.Parameter(torch.empty(n_rest, K, dtype=self.weight.dtype, device=dev))
        self.num_fp8_blocks = num_fp8_blocks
        scale_blocks = (tuple(b // BLOCK for b in fp8) if self.tp_size > 1 else (_cdiv(sum(fp8), BLOCK),))
        self.tp_shards = {"qweight": Shard(0, fp8), "weight_scale_inv": Shard(0, scale_blocks),
                          "weight": Shard(0, rest)}

    def takes_quantized_input(self, x: torch.Tensor) -> bool:
        """Whether ``forward(x)`` would quantize x by a launch of its own (so a producer's ``xq`` saves it).
        x: a tensor of the input's shape, dtype and device (the producer's input serves)."""
        return PRODUCER_QUANT and self.qweight is not None and quantizes_input(x, self.qweight.shape[0], self.backend)

    def forward(self, x: torch.Tensor, xq: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [..., K] -> [..., local out]; ``xq``: x's quantization (FP8 layers; see the module docstring)."""
        if self.qweight is None:
            return dense_linear(x, self.weight)
        return fp8_linear(x, self.qweight, self.weight_scale_inv, tail=self.weight if self.weight.shape[0] else None,
                          backend=self.backend, xq=xq)

    def forward_rows(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """x · W[start:]ᵀ: only this rank's output rows from ``start`` on (attention's k/v-only pass)."""
        if self.qweight is None:
            return dense_linear(x, self.weight[start:])
        n_fp8 = self.qweight.shape[0]
        if start % BLOCK == 0 and start < n_fp8:
            tail = self.weight if self.weight.shape[0] else None
            return fp8_linear(x, self.qweight[start:], self.weight_scale_inv[start // BLOCK:], tail=tail,
                              backend=self.backend)
        return self.forward(x)[..., start:]


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections fused into one GEMM: the output is ``blocks`` (full sizes),
    each sharded separately, so this rank's output is its part of block 0, then of block 1, ... with
    sizes ``local_blocks``. The GDN in-projection ``[q | k | v | z | b | a]``, attention's
    ``[q+gate per head | k | v]`` and the MLP's ``[gate | up]``."""

    def __init__(self, in_features: int, blocks: tuple[int, ...] | list[int], *, tp_rank: int | None = None,
                 tp_size: int | None = None):
        super().__init__(in_features, sum(blocks), blocks=tuple(blocks), tp_rank=tp_rank, tp_size=tp_size)


class RowParallelLinear(nn.Module):
    """y = x Wᵀ with W's input columns split across ranks: x local [T, in / tp] -> y [T, out], the sum of
    the ranks' partial products: one all-reduce after the GEMM (skipped with ``reduce_results=False``,
    where the caller sums several partials with one all-reduce of its own)."""

    def __init__(self, in_features: int, out_features: int, *, reduce_results: bool = True,
                 tp_rank: int | None = None, tp_size: int | None = None):
        super().__init__()
        self.tp_rank, self.tp_size = resolve(tp_rank, tp_size)
        self.in_features, self.out_features = in_features, out_features
        self.reduce_results = reduce_results
        (in_local,) = local_blocks((in_features,), self.tp_size, type(self).__name__)
        self.weight = nn.Parameter(torch.empty(out_features, in_local))
        self.tp_shards = {"weight": Shard(1, (in_features,))}
        self.qweight: nn.Parameter | None = None          # FP8 layers only (see to_fp8)
        self.weight_scale_inv: nn.Parameter | None = None
        self.num_fp8_blocks = 0
        self.backend: Backend = "auto"                    # the FP8 op's (see the module docstring)

    def weight_loader(self, full: torch.Tensor) -> torch.Tensor:
        return weight_loader(self, "weight", full)

    def fp8_layout_ok(self) -> bool:
        return self.tp_size == 1 or self.in_features % (self.tp_size * BLOCK) == 0

    def to_fp8(self) -> None:
        """The weight becomes ``qweight`` + ``weight_scale_inv`` (new empty parameters, see the column layer)."""
        if not self.fp8_layout_ok():
            raise ValueError(f"{type(self).__name__}: in_features={self.in_features} / tp={self.tp_size} is not a "
                             f"multiple of {BLOCK}")
        dev, (N, K) = self.weight.device, self.weight.shape
        self.qweight = nn.Parameter(torch.empty(N, K, dtype=FP8, device=dev), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(_cdiv(N, BLOCK), _cdiv(K, BLOCK), device=dev),
                                             requires_grad=False)
        del self.weight
        self.weight = None
        self.num_fp8_blocks = 1
        self.tp_shards = {"qweight": Shard(1, (self.in_features,)),
                          "weight_scale_inv": Shard(1, (_cdiv(self.in_features, BLOCK),))}

    def takes_quantized_input(self, x: torch.Tensor) -> bool:
        """Whether ``forward(x)`` (x: this rank's [T, in / tp]) would quantize x by a launch of its own."""
        return PRODUCER_QUANT and self.qweight is not None and quantizes_input(x, self.qweight.shape[0], self.backend)

    def forward(self, x: torch.Tensor, xq: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [T, in / tp] -> [T, out] (summed over ranks); ``xq``: x's quantization (FP8 layers)."""
        if self.qweight is None:
            y = dense_linear(x, self.weight)
        else:
            y = fp8_linear(x, self.qweight, self.weight_scale_inv, backend=self.backend, xq=xq)
        return all_reduce(y, self.tp_size) if self.reduce_results else y

    def forward_gated(self, x: torch.Tensor, gate: torch.Tensor, backend: Backend = "torch") -> torch.Tensor:
        """``self(x * torch.sigmoid(gate.reshape(x.shape)))`` for a gate [T, G, GD] (any strides but a unit last
        one; attention's per-head output gate): on CUDA at decode sizes the skinny GEMM applies the gate as it
        loads x (no copy, sigmoid or multiply launches), elsewhere ``ops.gating.sigmoid_mul`` on ``backend``
        (the same roundings: the sigmoid rounded to x's dtype, then the product) and the projection; an FP8
        layer that would quantize the product by a launch of its own gets it quantized by that kernel."""
        w = self.weight
        if (self.qweight is None and x.is_cuda and x.dim() == 2 and x.dtype == w.dtype
                and x.dtype in (torch.bfloat16, torch.float16)):
            cfg = skinny_config(x.shape[0], w.shape[0], w.shape[1])
            if cfg is not None and x.shape[1] == w.shape[1] and x.stride(1) == 1 and w.stride(1) == 1 \
                    and gate_fits(cfg, x, gate):
                y = skinny_unchecked(x, w, cfg, gate)
                return all_reduce(y, self.tp_size) if self.reduce_results else y
        if resolve_backend(backend, x) == "triton" and self.takes_quantized_input(x):   # FP8: quantized in its kernel
            y, yq = sigmoid_mul(x, gate, backend=backend, quant=True)
            return self.forward(y, xq=yq)
        return self.forward(sigmoid_mul(x, gate, backend=backend))


def load_shard(root: nn.Module, name: str, full: torch.Tensor) -> torch.Tensor:
    """:func:`weight_loader` for the parameter ``root.<name>`` (a dotted name, e.g. ``"mixer.in_proj.weight"``)."""
    owner, _, attr = name.rpartition(".")
    return weight_loader(root.get_submodule(owner) if owner else root, attr, full)
