"""FP8 block checkpoints (``quantization_config.quant_method = "fp8"``, 128x128 weight blocks): which of our
layers run as FP8 GEMMs, and the checkpoint reads that feed them.

Layout of the official Qwen3.5 / Qwen3-Next FP8 releases: a quantized linear ``X`` stores ``X.weight``
[N, K] as float8_e4m3fn and ``X.weight_scale_inv`` [ceil(N/128), ceil(K/128)] (float32 or bf16), with
``weight ≈ fp8 · scale_inv`` per block; experts per expert (``mlp.experts.{e}.{gate,up,down}_proj``); every
module named in ``modules_to_not_convert`` (embeddings, norms, the router ``mlp.gate``,
``shared_expert_gate``, the GDN ``in_proj_a`` / ``in_proj_b`` / ``in_proj_ba`` / ``A_log`` / ``dt_bias`` /
``conv1d`` / ``norm``, the lm head) stays in bf16.

Our fused projections (``layers.linear``) concatenate several checkpoint linears; a fused layer runs FP8
when its quantized parts come first and fall on whole 128-row blocks (``to_fp8``: the trailing unquantized
parts become its dense tail — Qwen3.5's GDN in_proj ``[qkv | z]`` FP8 + ``[b | a]`` bf16, Qwen3-Next's
``in_proj_qkvz`` FP8 after the de-interleave, which moves whole blocks, + ``in_proj_ba``). A layer whose
quantized parts do not fit that (partial blocks between parts, a tensor-parallel split inside a block, a
quantized part after an unquantized one) and every layer that has no FP8 kernel (router, shared expert
gate, lm head, MTP ``fc``, embeddings) is loaded dequantized (``fp8 · scale_inv`` in the model dtype):
correct, just not smaller. ``Fp8Source.dequantized`` lists those that were quantized in the checkpoint.

Errors name the tensor: a quantized module without its ``weight_scale_inv``, a scale of the wrong shape, a
module the config does not exempt stored unquantized where an FP8 weight is expected.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from gdnserve.models.config import QuantConfig
from gdnserve.ops.quant import BLOCK, dequantize_weight

FP8 = torch.float8_e4m3fn


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Part:
    """One checkpoint linear feeding a fused layer: its module name (without the checkpoint prefix), how
    many of the layer's output blocks it fills, and an optional row permutation ``perm(rows) -> index``
    (Qwen3-Next's de-interleave)."""
    name: str
    blocks: int = 1
    perm: Callable[[int], torch.Tensor] | None = None


class CheckpointError(ValueError):
    pass


@dataclass
class Fp8Source:
    """The checkpoint's tensors as the loader reads them: ``full(name)`` adds the checkpoint prefix,
    ``get`` returns a dense tensor (dequantizing a float8 one with its scales), ``get_fp8`` a quantized
    module's (fp8 weight, float32 scales) with the checks the module docstring lists. ``used`` collects
    every name read."""
    tensors: dict[str, Callable[[], torch.Tensor]]
    prefix: str
    quant: QuantConfig | None
    used: set[str] = field(default_factory=set)
    dequantized: list[str] = field(default_factory=list)

    def full(self, name: str) -> str:
        return name if name.startswith(("lm_head", "mtp.")) else self.prefix + name

    def _read(self, full: str) -> torch.Tensor:
        if full not in self.tensors:
            raise CheckpointError(f"missing tensor {full}")
        self.used.add(full)
        return self.tensors[full]()

    def get(self, name: str) -> torch.Tensor:
        full = self.full(name)
        t = self._read(full)
        if t.dtype != FP8:
            return t
        if not full.endswith(".weight"):
            raise CheckpointError(f"{full}: float8 tensor with no block scales (only *.weight can be quantized)")
        s = self._scale(full, t)
        self.dequantized.append(full.removesuffix(".weight"))
        return dequantize_weight(t, s)

    def is_fp8(self, module: str) -> bool:
        """Whether the config quantizes checkpoint module ``module`` (not listed in modules_to_not_convert)."""
        return self.quant is not None and not self.quant.not_converted(self.full(module))

    def get_fp8(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(float8_e4m3fn weight [N, K], float32 scales [ceil(N/128), ceil(K/128)]) of a quantized module."""
        full = self.full(module + ".weight")
        t = self._read(full)
        if t.dtype != FP8:
            raise CheckpointError(
                f"{full} is {str(t.dtype).removeprefix('torch.')}, expected float8_e4m3fn with "
                f"{module}.weight_scale_inv: {self.full(module)} is not in quantization_config.modules_to_not_convert")
        return t, self._scale(full, t)

    def _scale(self, wfull: str, t: torch.Tensor) -> torch.Tensor:
        sfull = wfull.removesuffix(".weight") + ".weight_scale_inv"
        if sfull not in self.tensors:
            raise CheckpointError(f"missing tensor {sfull} (the block scales of float8 tensor {wfull})")
        s = self._read(sfull)
        want = [cdiv(n, BLOCK) for n in t.shape[-2:]]
        if t.dim() != 2 or list(s.shape) != want:
            raise CheckpointError(f"{sfull}: shape {list(s.shape)}, expected {want} (one scale per "
                                  f"{BLOCK}x{BLOCK} block of {wfull} {list(t.shape)})")
        return s.float()


def block_perm(perm: torch.Tensor) -> torch.Tensor | None:
    """The row-block permutation equivalent to row permutation ``perm``, or None if it moves partial blocks."""
    n = perm.numel()
    if n % BLOCK:
        return None
    rows = perm.view(-1, BLOCK)
    start = rows[:, :1]
    if (start % BLOCK != 0).any() or not torch.equal(rows, start + torch.arange(BLOCK)):
        return None
    return start[:, 0] // BLOCK


def fp8_prefix(src: Fp8Source, module: torch.nn.Module, parts: list[Part]) -> int:
    """How many leading output blocks of ``module`` can run FP8 (0: load it dense): the quantized parts must
    come first, their permutations move whole blocks, and the layer must accept the layout."""
    flags = [src.is_fp8(p.name) for p in parts]
    n = 0
    while n < len(parts) and flags[n]:
        n += 1
    if n == 0 or any(flags[n:]):
        return 0
    for p in parts[:n]:
        if p.perm is not None:
            rows = sum(module.blocks[i] for i in range(_first_block(parts, p), _first_block(parts, p) + p.blocks))
            if block_perm(p.perm(rows)) is None:
                return 0
    nb = sum(p.blocks for p in parts[:n])
    if hasattr(module, "blocks"):
        return nb if module.fp8_layout_ok(nb) else 0
    return nb if module.fp8_layout_ok() else 0


def _first_block(parts: list[Part], part: Part) -> int:
    i = 0
    for p in parts:
        if p is part:
            return i
        i += p.blocks
    raise ValueError(part.name)


def fp8_parts(src: Fp8Source, parts: list[Part], n_fp8_parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenated (fp8 rows, scale rows) of the first ``n_fp8_parts`` parts, permutations applied."""
    qs, ss = [], []
    for p in parts[:n_fp8_parts]:
        q, s = src.get_fp8(p.name)
        if p.perm is not None:
            perm = p.perm(q.shape[0])
            q, s = q[perm], s[block_perm(perm)]
        qs.append(q)
        ss.append(s)
    return torch.cat(qs, 0), torch.cat(ss, 0)


def dense_parts(src: Fp8Source, parts: list[Part]) -> torch.Tensor:
    """Concatenated dense rows of ``parts`` (dequantized where the checkpoint stores them quantized)."""
    ws = []
    for p in parts:
        w = src.get(p.name + ".weight")
        ws.append(w if p.perm is None else w[p.perm(w.shape[0])])
    return torch.cat(ws, 0)


def parts_for_blocks(parts: list[Part], n_blocks: int) -> int:
    """How many leading parts fill the first ``n_blocks`` output blocks."""
    total = 0
    for i, p in enumerate(parts):
        if total == n_blocks:
            return i
        total += p.blocks
    return len(parts)
