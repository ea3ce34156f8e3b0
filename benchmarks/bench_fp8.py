"""Block-FP8 GEMMs against bf16 at the Qwen3.5-35B-A3B shapes, and the random-weight bench model in FP8 next
to bf16.

    python -m benchmarks.bench_fp8 [--device auto|cpu|cuda[:N]] [--quick] [--out DIR] [--sweep [--sweep-moe]] [--no-model]
        [--full] [--formats bf16,fp8] [--time-budget S]

Sections (each row also checks the FP8 result against the dequantizing float32 reference of the same math):

* **linear**: ``ops.quant.fp8_linear`` (Triton block-scaled GEMM, activations quantized per token-group of
  128 on the fly) vs ``F.linear`` in bf16, at decode (M = 1, 16, 64, 256) and prefill (M = 4096) for every
  dense projection of a Qwen3.5-35B-A3B layer (benchmarks/random_model.py's ``bench_hf_config``: hidden 2048;
  GDN in_proj 12288 FP8 rows (+64 dense b/a rows), out_proj; attention qkv 9216, o_proj; shared expert).
  µs = CUDA-graph replay time per call (benchmarks/timing.py); TB/s = bytes the call must move (weights,
  scales, x, y) / time; the weights rotate over enough copies to exceed L2.
* **moe**: the routed experts (256 experts, top-8, 2048 x 512) FP8 (``moe_experts``' default: ``decode_fp8_triton``
  at T·k <= 64 pairs, with the grouped kernels ``grouped_fp8_triton`` next to it, else those; and the old FP8
  branch of ``grouped_triton``) vs bf16, T = 1 ... 4096 tokens, several random routings rotated per call.
* **model**: the bench model (8 layers, 64 experts, vocab 248320; ``random_model.build_random_model``; ``--full``:
  the full-size 40-layer, 256-expert model), decode steps (CUDA graphs) at B = 1 (``--full``: 1, 16, 64, 256)
  and a 1 x 4096 prefill, bf16 and then quantized in place to FP8 (``models.loader.quantize_model_fp8_``: the
  release's layout), with the decode byte floor of each (bench_model's methodology).
* ``--sweep``: the decode linear kernels' configs on every projection (``fp8_gemv_triton`` at M = 1, 2, 4,
  ``fp8_gemm_triton`` at M = 1, 4, 16), best first; ``--sweep-moe`` adds the FP8 experts' (T = 1, 16, 64, 4096);
  ``--sweep-only`` skips the other sections; ``--sweep-m1`` sweeps only the M = 1 GEMV alone on pre-quantized x.
* Linear rows also time paths the op does not take by default ("alt"): at M <= 4 the two-launch path the
  GEMV replaced (quantization + the Triton GEMM, a dense tail by ``F.linear``); at M >= 512 the
  Triton GEMM next to cuBLAS's block-scaled ``torch._scaled_mm`` (``ops/quant/fp8_scaled_mm``).
* ``--formats``: the model section's formats (default ``bf16,fp8``; ``fp8-qx`` / ``fp8-q2``: FP8 with the M = 1
  GEMV quantizing x in its own programs / by a separate launch for every projection; ``fp8``: by size, the default).

On CPU (``--quick``: seconds) the shapes are tiny and FP8 runs the dequantizing PyTorch path: a smoke run of
the script, not a measurement. Writes ``fp8_<device>.json`` and ``.md`` under ``--out`` (default
benchmarks/results; ``<device>`` is ``h200`` on an H200, else the device type).
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from benchmarks import jsonfmt
from benchmarks.timing import time_call
from gdnserve.ops.numerics import rel_rms
from gdnserve.ops.quant import fp8_linear, quantize_weight
from gdnserve.ops.quant.fp8_ref import fp8_linear_torch

H = 2048
# name -> (FP8 rows N, K, dense tail rows): one Qwen3.5-35B-A3B layer's projections
LINEARS = {"gdn.in_proj": (12288, H, 64), "gdn.out_proj": (H, 4096, 0), "attn.qkv_proj": (9216, H, 0),
           "attn.o_proj": (H, 4096, 0), "shared.gate_up": (1024, H, 0), "shared.down": (H, 512, 0)}
TINY = {"tiny.col": (256, 256, 8), "tiny.row": (128, 384, 0)}
DECODE_M, PREFILL_M = (1, 2, 4, 16, 64, 256), 4096
L2_BYTES = 60 << 20


def _dev(arg: str) -> torch.device:
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if arg == "auto" else arg)


def _tag(dev: torch.device) -> str:
    if dev.type == "cuda":
        return "h200" if "H200" in torch.cuda.get_device_name(dev) else "cuda"
    return dev.type


def _act(dev: torch.device) -> torch.dtype:
    """The activation / dense weight dtype: bf16 on CUDA; float32 on CPU (smoke runs: CPU bf16 GEMMs are slow)."""
    return torch.bfloat16 if dev.type == "cuda" else torch.float32


def _us(fn: Callable[..., Any], rotate: list, dev: torch.device, quick: bool) -> float:
    return _pct(fn, rotate, dev, quick)["p50"]


def _pct(fn: Callable[..., Any], rotate: list, dev: torch.device, quick: bool) -> dict[str, float]:
    """{p10, p50, p90} µs of one call (CUDA-graph replays on CUDA)."""
    cpu = dev.type != "cuda"
    r = time_call(fn, iters=2 if cpu else (5 if quick else 20), warmup=1 if cpu else 2, rotate=rotate, device=dev)
    return r["gpu_us"]


def _timed(row: dict[str, Any], key: str, fn: Callable[..., Any], rotate: list, dev: torch.device, quick: bool
           ) -> None:
    """row[key] = p50 µs, row[key + "_p10_p90"] = [p10, p90]."""
    t = _pct(fn, rotate, dev, quick)
    row[key] = t["p50"]
    row[key + "_p10_p90"] = [t["p10"], t["p90"]]


def _copies(nbytes: int, dev: torch.device) -> int:
    return 1 if dev.type != "cuda" else max(2, min(8, math.ceil(2 * L2_BYTES / max(nbytes, 1))))


def linear_rows(dev: torch.device, quick: bool, log: Callable[[str], None]) -> list[dict[str, Any]]:
    shapes = LINEARS if dev.type == "cuda" else TINY
    ms = (DECODE_M + (PREFILL_M,)) if dev.type == "cuda" else (1, 16)
    rows = []
    for name, (N, K, tail_rows) in shapes.items():
        w = torch.randn(N + tail_rows, K, device=dev) * 0.02
        n_sets = _copies(N * K, dev)
        q, s = quantize_weight(w[:N])
        sets_fp8 = [(q.clone(), s.clone(), w[N:].to(_act(dev)).clone() if tail_rows else None) for _ in range(n_sets)]
        sets_bf16 = [w.to(_act(dev)).clone() for _ in range(_copies(2 * (N + tail_rows) * K, dev))]
        for M in ms:
            x = torch.randn(M, K, device=dev).to(_act(dev))
            row: dict[str, Any] = {"shape": name, "N": N + tail_rows, "K": K, "M": M}
            try:
                y = fp8_linear(x, q, s, tail=sets_fp8[0][2])
                ref = fp8_linear_torch(x.float(), q, s)
                if tail_rows:
                    ref = torch.cat([ref, x.float() @ w[N:].T], 1)
                row["rel_err"] = rel_rms(y, ref)
                _timed(row, "fp8_us", lambda t: fp8_linear(x, t[0], t[1], tail=t[2]), sets_fp8, dev, quick)
                if dev.type == "cuda":
                    _alt_row(row, x, q, s, sets_fp8, dev, quick)
            except Exception as e:               # noqa: BLE001 — a failed case is reported, not fatal
                row["fp8_error"] = f"{type(e).__name__}: {e}"[:300]
            _timed(row, "bf16_us", lambda wt: F.linear(x, wt), sets_bf16, dev, quick)
            io = M * K * 2 + M * (N + tail_rows) * 2
            fp8_bytes = N * K + s.numel() * 4 + tail_rows * K * 2 + io
            bf16_bytes = (N + tail_rows) * K * 2 + io
            if "fp8_us" in row:
                row["fp8_TBps"] = fp8_bytes / row["fp8_us"] / 1e6
                row["speedup"] = row["bf16_us"] / row["fp8_us"]
            row["bf16_TBps"] = bf16_bytes / row["bf16_us"] / 1e6
            log(json.dumps(row))
            rows.append(row)
    return rows


def _alt_row(row: dict[str, Any], x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, sets: list,
             dev: torch.device, quick: bool) -> None:
    """Paths fp8_linear does not take by default, timed on the same inputs ("alt"): M <= gemv_max_m the
    two-launch path the GEMV replaced (quantization + the Triton GEMM, the dense tail by ``F.linear``); M >= 512
    the Triton GEMM when cuBLAS's block-scaled ``_scaled_mm`` is the default (or the reverse)."""
    from gdnserve.ops.quant import fp8_scaled_mm as sm
    op = importlib.import_module("gdnserve.ops.quant.fp8_linear")
    M = x.shape[0]
    if M <= op.linear_config(x.device).gemv_max_m:
        row["alt"] = "quant + GEMM (2 launches) + F.linear tail"
        no_gemv = op.Fp8LinearConfig(gemv_max_m=0)
        _timed(row, "alt_us", lambda t: fp8_linear(x, t[0], t[1], tail=t[2], config=no_gemv), sets, dev, quick)
        if M == 1:
            fused = op.gemv_quantizes_inside(M, *q.shape, op.linear_config(x.device))
            row["alt2"] = "GEMV, x quantized " + ("by its own launch" if fused else "in the GEMV (1 launch)")
            other = op.Fp8LinearConfig(gemv_quant_inside=not fused)
            _timed(row, "alt2_us", lambda t: fp8_linear(x, t[0], t[1], tail=t[2], config=other), sets, dev, quick)
    elif M >= sm.MIN_M:
        on = op.linear_config(x.device).scaled_mm and sm.use_scaled_mm(x, q.shape[0])
        row["alt"] = "triton GEMM" if on else "cuBLAS _scaled_mm"
        flipped = op.Fp8LinearConfig(scaled_mm=not on)
        if on or sm.use_scaled_mm(x, q.shape[0]):
            _timed(row, "alt_us", lambda t: fp8_linear(x, t[0], t[1], tail=t[2], config=flipped), sets, dev, quick)


def moe_rows(dev: torch.device, quick: bool, log: Callable[[str], None]) -> list[dict[str, Any]]:
    from gdnserve.ops.moe import moe_experts
    E, I, k = (256, 512, 8) if dev.type == "cuda" else (8, 128, 2)
    Hm = H if dev.type == "cuda" else 256
    gu = torch.randn(E, 2 * I, Hm, device=dev) / Hm ** 0.5
    dn = torch.randn(E, Hm, I, device=dev) / I ** 0.5
    (qg, sg), (qu, su), (qd, sd) = (quantize_weight(t) for t in (gu[:, :I], gu[:, I:], dn))
    q_gu, s_gu = torch.cat([qg, qu], 1).contiguous(), torch.cat([sg, su], 1).contiguous()
    q_dn, s_dn = qd.contiguous(), sd.contiguous()
    gu16, dn16 = gu.to(_act(dev)), dn.to(_act(dev))
    rows = []
    for T in ((1, 16, 64, 256, 4096) if dev.type == "cuda" else (3,)):
        sets = [_routing(T, Hm, E, k, dev) for _ in range(1 if T >= 256 or dev.type != "cuda" else 8)]
        x, w, idx = sets[0]
        row: dict[str, Any] = {"T": T, "E": E, "top_k": k, "H": Hm, "I": I}
        try:
            y = moe_experts(x, w, idx, q_gu, q_dn, scales=(s_gu, s_dn))
            ref = moe_experts(x, w, idx, q_gu, q_dn, scales=(s_gu, s_dn), backend="torch")   # same roundings
            row["rel_err"] = rel_rms(y, ref)
            _timed(row, "fp8_us", lambda r: moe_experts(*r, q_gu, q_dn, scales=(s_gu, s_dn)), sets, dev, quick)
            if dev.type == "cuda":
                _timed(row, "fp8_old_us", lambda r: _old_fp8_experts(*r, q_gu, q_dn, (s_gu, s_dn)), sets, dev, quick)
            if dev.type == "cuda" and _decode_experts(T * k):     # the default is the decode path: the grouped one too
                _timed(row, "fp8_grouped_us", lambda r: _grouped_fp8_experts(*r, q_gu, q_dn, (s_gu, s_dn)), sets,
                       dev, quick)
        except Exception as e:                   # noqa: BLE001
            row["fp8_error"] = f"{type(e).__name__}: {e}"[:300]
        _timed(row, "bf16_us", lambda r: moe_experts(*r, gu16, dn16), sets, dev, quick)
        touched = sum(len(torch.unique(r[2])) for r in sets) / len(sets)       # experts a call reads
        fp8_bytes = touched * (3 * I * Hm + (s_gu[0].numel() + s_dn[0].numel()) * 4)
        row["bf16_TBps"] = touched * 3 * I * Hm * 2 / row["bf16_us"] / 1e6
        if "fp8_us" in row:
            row["speedup"] = row["bf16_us"] / row["fp8_us"]
            row["fp8_TBps"] = fp8_bytes / row["fp8_us"] / 1e6
        log(json.dumps(row))
        rows.append(row)
    return rows


def _routing(T: int, Hm: int, E: int, k: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, weights, experts) of T tokens routed top-k at random (fresh expert sets: the weights they touch
    rotate out of L2 between calls)."""
    x = torch.randn(T, Hm, device=dev).to(_act(dev))
    w, idx = torch.topk(torch.softmax(torch.randn(T, E, device=dev), -1), k, dim=-1)
    return x, (w / w.sum(-1, keepdim=True)).to(_act(dev)), idx


def _decode_experts(num_pairs: int) -> bool:
    from gdnserve.ops.moe.decode_fp8_triton import uses_decode
    return uses_decode(num_pairs)


def _grouped_fp8_experts(x, w, idx, q_gu, q_dn, scales):
    """The grouped FP8 kernels (``grouped_fp8_triton``) where ``moe_experts`` takes the decode path."""
    from gdnserve.ops.moe import decode_fp8_triton, moe_experts
    keep, decode_fp8_triton.DECODE_MAX_PAIRS = decode_fp8_triton.DECODE_MAX_PAIRS, 0
    try:
        return moe_experts(x, w, idx, q_gu, q_dn, scales=scales)
    finally:
        decode_fp8_triton.DECODE_MAX_PAIRS = keep


def _old_fp8_experts(x, w, idx, q_gu, q_dn, scales):
    """The FP8 branch of grouped_triton (bf16 dots of the upcast e4m3 weights), for comparison."""
    from gdnserve.ops.moe.align import align_pairs
    from gdnserve.ops.moe.align_triton import MAX_PAIRS, align_pairs_triton
    from gdnserve.ops.moe.grouped_triton import block_rows, moe_experts_triton
    T, k = idx.shape
    E = q_gu.shape[0]
    al = (align_pairs_triton if T * k <= MAX_PAIRS else align_pairs)(idx, E, block_rows(T * k, E))
    return moe_experts_triton(x, w, al, q_gu, q_dn, k, scales)


GEMV_SWEEP = [(bn, bk, w, st) for bn in (2, 4, 8) for bk in (512, 1024, 2048) for w in (4,) for st in (1, 2)] + [
    (16, 1024, 8, 2), (16, 2048, 8, 2), (8, 2048, 8, 2), (4, 4096, 4, 1), (2, 4096, 4, 1), (1, 2048, 2, 1),
    (1, 4096, 4, 1), (2, 2048, 2, 1), (4, 1024, 2, 1)]
# the Triton GEMM at M = 16: (BM, BN, warps, stages, GROUP_N, split-K programs target, SWAP)
GEMM16_SWEEP = [(16, bn, 4, st, 1, tgt, True) for bn in (16, 32, 64) for st in (3, 5) for tgt in (0, 4 * 132)]


# the M = 1 GEMV on pre-quantized x (``--sweep-m1``): (BN, BK, warps, stages), a [BN, BK] tile
GEMV_M1_SWEEP = [(bn, bk, 4, st) for bn in (4, 8, 16) for bk in (1024, 2048, 4096) if bn * bk <= 32768
                 for st in (1, 2)] + [(2, 2048, 4, 1), (2, 4096, 4, 1), (8, 2048, 8, 1), (16, 2048, 8, 1),
                                      (8, 4096, 8, 1), (16, 1024, 8, 2), (4, 512, 4, 1), (16, 512, 4, 1)]


def _weight_sets(N: int, K: int, tail_rows: int, dev: torch.device) -> list[tuple]:
    """Copies of one random projection's (e4m3 weight, block scales, bf16 tail or None), enough to rotate past L2."""
    w = torch.randn(N + tail_rows, K, device=dev) * 0.02
    q, s = quantize_weight(w[:N])
    tail = w[N:].bfloat16() if tail_rows else None
    return [(q.clone(), s.clone(), None if tail is None else tail.clone()) for _ in range(_copies(N * K, dev))]


def sweep_m1_rows(dev: torch.device, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """The M = 1 GEMV alone on x quantized beforehand (what a producer that quantizes its output hands it):
    ``gemv-cols`` (``_gemv_kernel``) per config, and ``gemv-qx`` (x quantized inside) at its table config. (At
    c35cf6e..b043644 it also timed two variants since removed, both no faster: the K groups as a tile axis, and
    the weights read as int32 words decoded by integer ops — docs/kernels.md, "Block-FP8 GEMMs".)"""
    from gdnserve.ops.quant import fp8_gemv_triton as gv
    from gdnserve.ops.quant.fp8_gemm_triton import quantize_act_triton
    from gdnserve.ops.quant.fp8_gemv_triton import GemvConfig, fp8_gemv
    rows: list[dict[str, Any]] = []
    for shape, (N, K, tail_rows) in LINEARS.items():
        sets = _weight_sets(N, K, tail_rows, dev)
        x = torch.randn(1, K, device=dev).bfloat16()
        xq, xs = quantize_act_triton(x)
        y = torch.empty(1, N + tail_rows, dtype=x.dtype, device=dev)
        for c in (c for c in GEMV_M1_SWEEP if c[1] <= max(1024, 2 * K)):
            rows.append(_sweep_one({"kernel": "gemv-cols", "shape": shape, "M": 1, "config": list(c)},
                                   lambda t, g=GemvConfig(*c): fp8_gemv(x, xq, xs, t[0], t[1], y, tail=t[2], config=g),
                                   sets, dev))
            log("measured " + json.dumps(rows[-1]))
        rows.append(_sweep_one({"kernel": "gemv-qx", "shape": shape, "M": 1, "config": list(gv.config(1, N, K))},
                               lambda t: fp8_gemv(x, None, None, t[0], t[1], y, tail=t[2]), sets, dev))
    rows.sort(key=lambda r: (r["kernel"], r["shape"], r["M"], r.get("us", math.inf)))
    for r in rows:
        log(json.dumps(r))
    return rows


def sweep_rows(dev: torch.device, log: Callable[[str], None], moe: bool = False) -> list[dict[str, Any]]:
    """The decode kernels' configs on every dense projection (in_proj with its dense tail): the CUDA-core GEMV
    (``fp8_gemv_triton``: BN weight rows, BK, warps, stages) at M = 1, 2, 4, the Triton GEMM's at M = 1, 4, 16;
    ``moe``: the FP8 experts' ((BNH, warps, stages), (BN, warps, stages)) at T = 1, 16, 64, 4096."""
    from gdnserve.ops.quant.fp8_gemv_triton import MAX_M, GemvConfig
    op = importlib.import_module("gdnserve.ops.quant.fp8_linear")
    rows: list[dict[str, Any]] = []
    for shape, (N, K, tail_rows) in LINEARS.items():
        sets = _weight_sets(N, K, tail_rows, dev)
        small = [c for c in GEMV_SWEEP if c[0] <= 4 and c[1] <= 1024]
        plan = [(1, "gemv", GEMV_SWEEP), (1, "gemm", GEMM16_SWEEP), (2, "gemv", small), (4, "gemv", small),
                (4, "gemm", GEMM16_SWEEP[::2]), (16, "gemm", GEMM16_SWEEP)]
        for M, kernel, cfgs in plan:
            x = torch.randn(M, K, device=dev).bfloat16()
            for c in cfgs:       # (the GEMM's rows at M <= 4 too: gemv_max_m = 0)
                lc = (op.Fp8LinearConfig(gemv_max_m=MAX_M, gemv=GemvConfig(*c)) if kernel == "gemv"
                      else op.Fp8LinearConfig(gemv_max_m=0, gemm=tuple(c)))
                rows.append(_sweep_one({"kernel": kernel, "shape": shape, "M": M, "config": list(c)},
                                       lambda t, lc=lc: fp8_linear(x, t[0], t[1], tail=t[2], config=lc), sets, dev))
    if moe:
        rows += _moe_sweep(dev)
    rows.sort(key=lambda r: (r["kernel"], r["shape"], r["M"], r.get("us", math.inf)))
    for r in rows:
        log(json.dumps(r))
    return rows


def _moe_sweep(dev: torch.device) -> list[dict[str, Any]]:
    from gdnserve.ops.moe import moe_experts
    rows: list[dict[str, Any]] = []
    E, I, k = 256, 512, 8
    gu = torch.randn(E, 2 * I, H, device=dev) / H ** 0.5
    (qg, sg), (qu, su), (qd, sd) = (quantize_weight(t) for t in (gu[:, :I], gu[:, I:], torch.randn(E, H, I, device=dev)))
    q_gu, s_gu = torch.cat([qg, qu], 1).contiguous(), torch.cat([sg, su], 1).contiguous()
    moe_cfgs = {1: [((bnh, 4, st), (bn, 4, 3)) for bnh, st in ((32, 5), (64, 4)) for bn in (64, 128)],
                16: [((32, 4, 5), (128, 4, 3)), ((64, 4, 4), (128, 4, 3))],
                64: [((64, 4, 4), (128, 4, 3)), ((128, 8, 3), (128, 4, 3))],
                PREFILL_M: [((128, 8, 3), (128, 4, 3)), ((128, 8, 4), (128, 8, 3)), ((128, 4, 3), (128, 4, 4))]}
    for T, cfgs in moe_cfgs.items():
        sets = [_routing(T, H, E, k, dev) for _ in range(1 if T >= 256 else 8)]
        for c in cfgs:
            rows.append(_sweep_one({"kernel": "moe", "shape": f"E={E} k={k}", "M": T, "config": [list(t) for t in c]},
                                   lambda r, c=c: moe_experts(*r, q_gu, qd.contiguous(), scales=(s_gu, sd.contiguous()),
                                                              config=c), sets, dev))
    return rows


def _sweep_one(row: dict[str, Any], fn: Callable[..., Any], sets: list, dev: torch.device) -> dict[str, Any]:
    try:
        t = _pct(fn, sets, dev, quick=True)
        row["us"], row["p10_p90"] = t["p50"], [t["p10"], t["p90"]]
    except Exception as e:                       # noqa: BLE001 — a config that fails is reported
        row["error"] = f"{type(e).__name__}: {e}"[:200]
    return row


def model_rows(dev: torch.device, quick: bool, layers: int | None, experts: int | None, log: Callable[[str], None],
               full: bool = False, formats: tuple[str, ...] = ("bf16", "fp8")) -> list[dict[str, Any]]:
    """The random-weight model in bf16, then (the bf16 copy freed) quantized in place to FP8: decode steps at
    each batch (B = 1; ``full``: 1, 16, 64, 256 at context 128) and a 1 x L prefill, timed as bench_model times
    them (perf_counter around a step, device synchronised; median and P10-P90), with the decode byte floor
    (bench_model.decode_bytes: FP8 weights count one byte) at the measured copy rate."""
    from benchmarks.bench_model import Plan
    from benchmarks.random_model import config_for
    from benchmarks.timing import measure_ceilings
    cuda = dev.type == "cuda"
    cfg = config_for(dev, layers, experts, full=full)
    L = 4096 if cuda else 32
    batches = (1, 16, 64, 256) if full else (1,)
    plan = Plan(((1, L),), batches, 128 if cuda else 16, 2 if cuda else 0, (5 if quick else 10) if cuda else 1, 0.0)
    copy_tbps = measure_ceilings(dev, quick=True)["copy_TBps"] if cuda else None
    rows = []
    op = importlib.import_module("gdnserve.ops.quant.fp8_linear")
    for fmt in formats:
        if fmt not in ("bf16", "fp8", "fp8-qx", "fp8-q2"):
            raise ValueError(f"--formats: unknown format {fmt!r} (bf16, fp8, fp8-qx, fp8-q2)")
        with op.override(**({"fp8-qx": {"gemv_quant_inside": True}, "fp8-q2": {"gemv_quant_inside": False}}
                            .get(fmt, {}))):
            rows.append(_model_row(fmt, cfg, dev, batches, plan, copy_tbps, L, log))
        if cuda:
            torch.cuda.empty_cache()
    return rows


def _model_row(fmt: str, cfg: dict, dev: torch.device, batches: tuple, plan, copy_tbps, L: int, log) -> dict[str, Any]:
    """One format's decode and prefill rows (a whole model built, quantized and timed)."""
    from benchmarks.bench_model import decode_bytes, ours_decode, ours_prefill
    from benchmarks.random_model import build_random_model
    from benchmarks.timing import percentiles
    from gdnserve.engine.execution.model_runner import ModelRunner, RunnerConfig
    from gdnserve.models.loader import quantize_model_fp8_
    cuda = dev.type == "cuda"
    torch.manual_seed(0)
    model = build_random_model(cfg, dev, torch.bfloat16 if cuda else torch.float32)
    fp8_layers = quantize_model_fp8_(model) if fmt.startswith("fp8") else []
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    runner = ModelRunner(model, RunnerConfig(num_slots=max(batches) + 2, page_size=16, num_pages=4096,
                                             graph_max_tokens=L, max_model_len=2 * L))
    row: dict[str, Any] = {"format": fmt, "layers": cfg["num_hidden_layers"], "experts": cfg["num_experts"],
                           "weight_GB": weight_bytes / 1e9, "fp8_layers": len(fp8_layers), "decode": {}}
    for B in batches:
        t = percentiles([v * 1e3 for v in ours_decode(runner, B, plan, dev)["times"]])
        floor = decode_bytes(model, B, plan.context) / (copy_tbps * 1e12) * 1e3 if copy_tbps else None
        row["decode"][str(B)] = {"ms": t, "floor_ms": floor, "tok_s": B / t["p50"] * 1e3}
        log(json.dumps({"format": fmt, "case": f"decode B={B}", **row["decode"][str(B)]}))    # (partial runs)
    row["decode_B1_ms"] = row["decode"]["1"]["ms"]["p50"]
    t = percentiles([v * 1e3 for v in ours_prefill(runner, torch.randint(0, cfg["vocab_size"], (1, L)), plan,
                                                   dev)["times"]])
    row["prefill_ms"], row["prefill_p10_p90"] = t["p50"], [t["p10"], t["p90"]]
    row["prefill_tok_s"], row["prefill_len"] = L / row["prefill_ms"] * 1e3, L
    log(json.dumps(row))
    del runner, model           # free before the next format is built
    return row


def _p(r: dict[str, Any], key: str, fmt: str = ".1f") -> str:
    """'p50 [p10–p90]' of a timed row entry, or '—'."""
    if key not in r:
        return "—"
    lo, hi = r.get(key + "_p10_p90", [float("nan")] * 2)
    return f"{r[key]:{fmt}} [{lo:{fmt}}–{hi:{fmt}}]"


def markdown(rep: dict[str, Any]) -> str:
    copy = rep.get("ceilings", {}).get("copy_TBps")
    out = [f"# Block-FP8 vs bf16 ({rep['device']})", "", f"`{rep['command']}` — torch {rep['torch']}, "
           f"triton {rep['triton']}" + (f", git {rep['git']}" if rep.get("git") else "") + ". µs: CUDA-graph replay "
           "per call, median [P10–P90]; TB/s: bytes the call must move (weights, scales, x, y) / median time"
           + (f" (measured copy ceiling {copy:.2f} TB/s)" if copy else "") + "; rel_err: FP8 result vs the float32 "
           "dequantizing reference of the same quantized math. bf16: cuBLAS `F.linear` / the bf16 grouped Triton "
           "GEMM; fp8: what `ops.quant.fp8_linear` runs by default (M >= 512: cuBLAS block-scaled `torch._scaled_mm` "
           "where available, else and below: `ops/quant/fp8_gemm_triton.py`) / `ops/moe/grouped_fp8_triton.py` "
           "(T·k <= 64 pairs: `decode_fp8_triton.py`; fp8 grouped: the grouped kernels there); fp8 old: "
           "the FP8 branch of `grouped_triton.py` (bf16 dots of upcast weights).", ""]
    out += ["## Linear (Qwen3.5-35B-A3B projections)", "",
            "| shape | N | K | M | bf16 µs | fp8 µs | fp8 / bf16 time | bf16 TB/s | fp8 TB/s | rel_err | "
            "alt path | alt µs | alt 2 path | alt 2 µs |",
            "|---" * 14 + "|"]
    for r in rep["linear"]:
        ratio = f"{1 / r['speedup']:.2f}" if "speedup" in r else f"error: {r.get('fp8_error')}"
        out.append(f"| {r['shape']} | {r['N']} | {r['K']} | {r['M']} | {_p(r, 'bf16_us')} | {_p(r, 'fp8_us')} | "
                   f"{ratio} | {r['bf16_TBps']:.2f} | {r.get('fp8_TBps', float('nan')):.2f} | "
                   f"{r.get('rel_err', float('nan')):.1e} | {r.get('alt', '—')} | {_p(r, 'alt_us')} | "
                   f"{r.get('alt2', '—')} | {_p(r, 'alt2_us')} |")
    out += ["", "## Routed experts (grouped GEMM; T random routings rotated: the touched experts leave L2)", "",
            "| T | E | top-k | bf16 µs | fp8 µs | fp8 grouped µs | fp8 old µs | fp8 / bf16 time | bf16 TB/s | fp8 TB/s | "
            "rel_err |", "|---" * 11 + "|"]
    for r in rep["moe"]:
        ratio = f"{1 / r['speedup']:.2f}" if "speedup" in r else f"error: {r.get('fp8_error')}"
        out.append(f"| {r['T']} | {r['E']} | {r['top_k']} | {_p(r, 'bf16_us')} | {_p(r, 'fp8_us')} | "
                   f"{_p(r, 'fp8_grouped_us')} | {_p(r, 'fp8_old_us')} | {ratio} | {r.get('bf16_TBps', float('nan')):.2f} | "
                   f"{r.get('fp8_TBps', float('nan')):.2f} | {r.get('rel_err', float('nan')):.1e} |")
    if rep.get("model"):
        out += ["", "## Model (random weights; ms: median [P10–P90] per step; floor: decode bytes / copy rate)", "",
                "| format | layers | experts | weights GB | FP8 layers | case | ms | tokens/s | floor ms | % floor |",
                "|---" * 10 + "|"]
        for r in rep["model"]:
            head = f"| {r['format']} | {r['layers']} | {r['experts']} | {r['weight_GB']:.2f} | {r['fp8_layers']} |"
            for B, d in r["decode"].items():
                t, fl = d["ms"], d["floor_ms"]
                floor = "— | —" if fl is None else f"{fl:.2f} | {100 * fl / t['p50']:.0f} %"
                out.append(f"{head} decode B={B} | {t['p50']:.2f} [{t['p10']:.2f}–{t['p90']:.2f}] | "
                           f"{d['tok_s']:,.0f} | {floor} |")
            lo, hi = r["prefill_p10_p90"]
            out.append(f"{head} prefill 1x{r['prefill_len']} | {r['prefill_ms']:.1f} [{lo:.1f}–{hi:.1f}] | "
                       f"{r['prefill_tok_s']:,.0f} | — | — |")
    if rep.get("sweep"):
        out += ["", "## Decode-kernel sweep (best first; gemv: `fp8_gemv_triton` (BN weight rows, BK, warps, stages); "
                "gemm: `fp8_gemm_triton` (BM, BN, warps, stages, GROUP_N, split-K programs target, SWAP); both through "
                "`fp8_linear` (x quantized by its own launch), in_proj with its dense tail; moe: (BNH, warps, stages) "
                "gate_up, (BN, warps, stages) down; gemv-cols: the M = 1 GEMV alone on x quantized beforehand; "
                "gemv-qx: x quantized inside)", "",
                "| kernel | shape | M / T | config | µs [P10–P90] |", "|---|---|---|---|---|"]
        for r in rep["sweep"]:
            t = (f"{r['us']:.1f} [{r['p10_p90'][0]:.1f}–{r['p10_p90'][1]:.1f}]" if "us" in r else r.get("error"))
            out.append(f"| {r['kernel']} | {r['shape']} | {r['M']} | {r['config']} | {t} |")
    for note in rep.get("notes", []):
        out += ["", note]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--quick", action="store_true", help="fewer timing iterations (CPU: a smoke run in seconds)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--sweep", action="store_true", help="also sweep the decode linear kernel's configs (CUDA)")
    ap.add_argument("--sweep-moe", action="store_true", help="with --sweep: also the FP8 experts' tile configs")
    ap.add_argument("--formats", default="bf16,fp8", help="model section: the formats to build (comma-separated)")
    ap.add_argument("--no-model", action="store_true", help="skip the model section")
    ap.add_argument("--sweep-only", action="store_true", help="with --sweep: only the sweep (no linear, moe, model)")
    ap.add_argument("--model-only", action="store_true", help="only the model section (no linear, moe tables)")
    ap.add_argument("--sweep-m1", action="store_true", help="with --sweep: only the M = 1 GEMV on pre-quantized x "
                    "in the sweep")
    ap.add_argument("--full", action="store_true", help="model section: the full-size 40-layer model, decode "
                    "B = 1, 16, 64, 256 (CUDA; default: the 8-layer cut, B = 1)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--time-budget", type=float, default=math.inf, help="seconds; later sections are skipped")
    args = ap.parse_args(argv)
    dev = _dev(args.device)
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev.index)
    import triton
    t0 = time.perf_counter()
    rep: dict[str, Any] = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                           "command": "python -m benchmarks.bench_fp8 " + " ".join(argv if argv is not None else sys.argv[1:]),
                           "torch": torch.__version__, "triton": triton.__version__, "notes": [],
                           "git": os.environ.get("GDNSERVE_GIT")}
    log = lambda s: print(s, flush=True)        # noqa: E731
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        (out / f"fp8_{_tag(dev)}.json").write_text(jsonfmt.dumps(rep))
        (out / f"fp8_{_tag(dev)}.md").write_text(markdown(rep))
    if dev.type == "cuda":
        from benchmarks.timing import measure_ceilings
        rep["ceilings"] = measure_ceilings(dev, quick=True)
        from gdnserve.ops.quant import fp8_scaled_mm as sm
        ok = sm.available(dev)
        rep["scaled_mm"] = {"available": ok, "probe": sm.PROBE_RESULT.get(dev.index or 0)}
        rep["notes"].append(f"cuBLAS block-scaled `torch._scaled_mm` on this torch: {'available' if ok else 'not used'} "
                            f"(probe: {rep['scaled_mm']['probe']}).")
    with torch.no_grad():
        skip = args.sweep_only or args.model_only
        rep["linear"] = [] if skip else linear_rows(dev, args.quick, log)
        rep["moe"] = [] if skip else moe_rows(dev, args.quick, log)
        save()
        if args.sweep and dev.type == "cuda":
            if time.perf_counter() - t0 < args.time_budget:
                rep["sweep"] = (sweep_m1_rows(dev, log) if args.sweep_m1 else sweep_rows(dev, log, moe=args.sweep_moe))
                save()
            else:
                rep["notes"].append("sweep skipped: --time-budget spent")
        if not (args.no_model or args.sweep_only):
            if time.perf_counter() - t0 < args.time_budget:
                rep["model"] = model_rows(dev, args.quick, args.layers, args.experts, log,
                                          full=args.full and dev.type == "cuda",
                                          formats=tuple(args.formats.split(",")))
            else:
                rep["notes"].append("model section skipped: --time-budget spent")
    save()
    print(markdown(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
