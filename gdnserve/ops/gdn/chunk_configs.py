"""Launch configs of the chunked prefill, one row per GPU model (keyed by ``torch.cuda.get_device_name``),
chosen offline by ``benchmarks/tune_chunk.py`` and read at launch; no autotuning at call time.

Fields that change results (the context-parallel segmentation, operand precisions) are per device, so a
given GPU always computes the same bits for the same sequence, whatever batch it sits in.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch

from gdnserve.ops.overrides import override_fields


@dataclass(frozen=True, slots=True)
class ChunkConfig:
    # prep (gates, cumsum, K Kᵀ, 𝒯, 𝒲, Ũ)
    prep_warps: int = 4
    prep_min_block: int = 64        # K/V tiles padded to >= 64 (Triton 3.6's 4-warp dot at K=16 read out of bounds)
    prep_split_below: int = 2048    # fewer (chunk row x key head) programs: one program per value head
    inv_mode: int = 1               # 1: product form of (I+𝒜)⁻¹; 0 / 2: diagonal 16x16 blocks by substitution /
                                    # by a batched product form, then the blockwise merge
    inv_bf16: bool = False          # bf16 operands in the product-form inverse
    prep_bf16: bool = True          # bf16 operands for K Kᵀ, 𝒲, Ũ (fp32 accumulation)
    prep_stages: int | None = None  # num_stages of the prep (None: Triton's default)
    short_prep: int = 32            # a sequence of <= this many tokens takes a 32-row prep tile (0: off; 16 or 32)
    # state pass
    state_bv: int = 32
    state_warps: int = 4
    state_stages: int | None = None  # num_stages of the state pass (None: Triton's default)
    # context parallelism: a sequence of >= cp_min_chunks chunks runs as segments of cp_seg_chunks chunks
    cp_min_chunks: int = 1 << 30    # off (see TABLE)
    cp_seg_chunks: int = 16
    seg_bv: int = 32                # row tile of the segment-transition kernel (over the V + K rows)
    seg_warps: int = 4
    comb_prec: str = "tf32"         # precision of the segment combine S·P + B (bf16/fp16 inputs; fp32: ieee);
                                    # finer than the bf16 state the chunk steps multiply with
    comb_block: int = 32            # the combine runs over column blocks of P of this width
    # FlashQLA's structure (chunk_fused_triton.py): the prep stores only 𝒯' = 𝒯 diag(β) and M' (2·C values per token
    # and value head), one main kernel per (sequence, value head, V tile) forms U, O and the state per chunk from
    # q, k, v; the fields above about 𝒲/Ũ/Q' and the state pass do not apply; of CP, cp_min_chunks, cp_seg_chunks
    # (a power of two <= 128 here) and cp_decay do
    fused_main: bool = False
    main_bv: int = 64               # V tile of the main kernel (fixed per device: results never depend on the batch);
                                    # a power of two >= 64 (chunk_fused_triton.MIN_TILE: Triton 3.6's bf16 products
                                    # were wrong at 16 and 32 on the H200), V < 64 pads one 64-wide tile
    main_warps: int = 4
    main_stages: int | None = None
    cp_decay: float = 20.0          # fused_main with CP: a segment starts from its predecessor's tail run from zeros,
                                    # the shortest tail whose log decay is below -cp_decay (e^-20 ≈ 2e-9 of the state)
    main_tf32: bool = False         # 𝒯'X and M'U on tf32 operands (X, U not rounded to bf16; the interpreter's IEEE
                                    # bound: o rel-RMS 4.4e-3 -> 4.0e-3, state 2.85e-3 -> 2.59e-3 at K = 32)
    main_qk_store: bool = True      # the prep stores l2-normalised q, k (activation dtype) for the main kernel, whose
                                    # loads then feed its products directly (else it re-normalises per V tile)


DEFAULT = ChunkConfig()
# Rows chosen by benchmarks/tune_chunk.py (benchmarks/results/tune_chunk_h200*.{json,log}, docs/kernels.md).
# H200, Triton 3.6: the sequential state pass (context parallelism measured slower, the state-pass-formed output
# wrong at BV 32: rel-RMS 0.87); prep_out with one prep program per value head (with the Q' work a program per
# key head, two value heads, was 604 vs 404 µs at 8x1024) and bf16 operands in the inverse (prep 249 -> 198 µs at
# 1x4096, same errors): whole call 444 -> 335 µs at 1x4096 (tune_chunk_stages_h200.json; events, host included).
TABLE: dict[str, ChunkConfig] = {
    "NVIDIA H200": ChunkConfig(prep_split_below=1 << 30, inv_bf16=True),
}
_OVERRIDES: dict[str, object] = {}
ENV = "GDNSERVE_CHUNK_CONFIG"   # "field=value,..." on top of the device's row (a variant measured end to end)


def parse_fields(text: str) -> dict[str, object]:
    """``"fused_main=1,main_bv=64"`` -> typed ChunkConfig fields (the type of each field's default)."""
    types = {f.name: type(f.default) for f in dataclasses.fields(ChunkConfig)}
    out: dict[str, object] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, val = item.partition("=")
        name = name.strip()
        if not sep or name not in types:
            raise ValueError(f"{ENV}: {item!r} is not field=value with a ChunkConfig field")
        t = types[name]
        val = val.strip()
        if t is bool:
            out[name] = val.lower() in ("1", "true", "yes", "on")
        elif t is type(None):       # optional ints (stages)
            out[name] = None if val.lower() in ("", "none") else int(val)
        else:
            out[name] = t(val)
    return out


@functools.lru_cache(maxsize=16)
def _device_row(dev: int) -> ChunkConfig:
    row = TABLE.get(torch.cuda.get_device_name(dev), DEFAULT)
    env = os.environ.get(ENV)
    return dataclasses.replace(row, **parse_fields(env)) if env else row


def chunk_config(device: torch.device) -> ChunkConfig:
    base = _device_row(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else DEFAULT
    return dataclasses.replace(base, **_OVERRIDES) if _OVERRIDES else base


def override(**fields):
    """Temporarily replace config fields on every device (tests, tuning)."""
    return override_fields(ChunkConfig, _OVERRIDES, fields)
