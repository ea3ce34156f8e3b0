"""The memory-bound prefill kernels of a Qwen3.5-35B-A3B layer, old (ff7685e) vs new, in one run:
``python -m benchmarks.bench_prefill_ops [--out DIR] [--tokens 1,64,512,4096,8192] [--commit SHA]``.

Shapes: the GDN conv over D = 8192 channels (W = 4) reading a column slice of the in-projection output
[T, 12352]; the GDN gated RMSNorm over [T, 32, 128] with z a view into that output; the attention q/k norm +
partial rotary over q [T, 16, 256] (a view of [q | gate] per head) and k [T, 2, 256]; bf16; plus the 8x1024
packed conv. Every variant is checked first (conv: against the PyTorch path in float64, the pool bit-exact,
rows vs tile bitwise; norms: rel-RMS against float64 and the largest difference from HF's PyTorch path in
bf16 ulps), then timed: CUDA-graph replays of back-to-back calls (benchmarks/timing.py ``time_call``; p10 /
p50 / p90 of the per-call time), input sets rotated so that the data of one replay exceeds the L2 where it
can. Bytes: every input read once and every output written once; TB/s against the measured copy ceiling.
Writes prefill_ops_<dev>.json / .md under --out and prints the table; also times chunk_prep_kernel's warps.
"""
from __future__ import annotations

import argparse
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.prefill_ops_legacy import gated_rms_norm_per_row, rms_norm_rope_per_row
from benchmarks.timing import measure_ceilings, time_call
from gdnserve.ops.attention.rope import rms_norm_rope
from gdnserve.ops.attention.rope_triton import rms_norm_rope_triton, rope_tile
from gdnserve.ops.conv.prefill import conv_kernel, conv_prefill, conv_prefill_torch, conv_tile, use_kernel
from gdnserve.ops.norm.gated import gated_rms_norm_torch
from gdnserve.ops.norm.gated_triton import gated_rms_norm_triton, norm_tile
from gdnserve.ops.norm.naive import naive_gated_rms_norm
from gdnserve.ops.numerics import rel_rms
from gdnserve.ops.varlen import VarlenMeta
from benchmarks import jsonfmt

D, W, COLS, HV, V, QH, KH, DH, ROT = 8192, 4, 12352, 32, 128, 16, 2, 256, 64
L2_BYTES = 60 << 20
CONV_TILES = [(128, 1, 8), (256, 1, 8), (512, 2, 8), (256, 2, 8)]
NORM_TILES = [(16, 4), (8, 4), (32, 8)]
ROPE_TILES = [(8, 4), (4, 4), (16, 8)]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def n_sets(nbytes: int) -> int:
    """Input sets so that one round exceeds twice the L2 (at most 8)."""
    return max(1, min(8, -(-2 * L2_BYTES // max(nbytes, 1))))


def timed(fn: Callable[[Any], Any], sets: list[Any], nbytes: int, ceil: float) -> dict[str, Any]:
    r = time_call(fn, iters=11, warmup=1, rotate=sets, host_iters=1)
    g = r["gpu_us"]
    return {"us": g, "TBps": nbytes / (g["p50"] * 1e-6) / 1e12, "share_of_copy": nbytes / (g["p50"] * 1e-6) / 1e12
            / ceil, "method": r["gpu_method"], "graph_calls": r["graph_calls"], "n_inputs": r["n_inputs"]}


def conv_case(lens: list[int], dev, ceil: float) -> list[dict[str, Any]]:
    T, N = sum(lens), len(lens)
    nbytes = (2 * T * D + D * W + 2 * N * (W - 1) * D) * 2
    meta = VarlenMeta.build(lens, dev)
    src = torch.arange(N, dtype=torch.int32, device=dev)
    dst = src + N                                  # src != dst: repeated calls do the same work
    w = (torch.randn(D, W, device=dev) * 0.3).bfloat16()
    sets = []
    for _ in range(n_sets(nbytes)):
        proj = torch.randn(T, COLS, device=dev).bfloat16()
        sets.append((proj[:, :D], torch.randn(2 * N, W - 1, D, device=dev).bfloat16(),
                     torch.empty(T, D, device=dev, dtype=torch.bfloat16)))
    x, pool, _ = sets[0]
    # reference: the PyTorch path in float64 on the same inputs
    pool64 = pool.double().clone()
    y64 = torch.empty(T, D, dtype=torch.float64, device=dev)
    conv_prefill_torch(x.double(), w.double(), pool64, y64, meta, src, dst, None, True)
    variants: list[tuple[str, str, Any]] = [("tile (ff7685e)", "tile", conv_tile("tile", meta.num_chunk_rows, D))]
    variants += [(f"rows BD={t[0]} warps={t[1]} U={t[2]}", "rows", t) for t in CONV_TILES]
    out, y_tile = [], None
    for name, kernel, tile in variants:
        pool_k = pool.clone()
        y = torch.empty(T, D, device=dev, dtype=torch.bfloat16)
        with use_kernel(kernel):
            conv_prefill(x, w, pool_k, y, meta, src, dst, None, True, tile=tile)
        _sync()
        err = (y.double() - y64).abs().max().item()
        pool_ok = torch.equal(pool_k.double(), pool64)
        y_tile = y if kernel == "tile" else y_tile
        same = bool(torch.equal(y, y_tile))

        def call(s, kernel=kernel, tile=tile):
            with use_kernel(kernel):
                conv_prefill(s[0], w, s[1], s[2], meta, src, dst, None, True, tile=tile)
        row = {"op": "conv_prefill", "case": f"{N}x{T // N}" if N > 1 else f"T={T}", "variant": name,
               "default": kernel == conv_kernel(meta.num_chunk_rows) and tile == conv_tile(kernel, meta.num_chunk_rows, D),
               "bytes": nbytes, "max_abs_err_vs_f64": err, "pool_bit_exact": pool_ok, "bitwise_equal_tile": same}
        row.update(timed(call, sets, nbytes, ceil))
        out.append(row)
        print(_line(row), flush=True)
    return out


def gated_case(T: int, dev, ceil: float) -> list[dict[str, Any]]:
    nbytes = (3 * T * HV * V + V) * 2
    g = (1 + 0.3 * torch.randn(V, device=dev)).bfloat16()
    sets = []
    for _ in range(n_sets(nbytes)):
        proj = torch.randn(T, COLS, device=dev).bfloat16()
        sets.append((torch.randn(T, HV, V, device=dev).bfloat16(), proj[:, D:D + HV * V].view(T, HV, V)))
    o, z = sets[0]
    ref, hf = naive_gated_rms_norm(o, z, g, 1e-6), gated_rms_norm_torch(o, z, g, 1e-6)
    variants = [("per row (ff7685e)", lambda s: gated_rms_norm_per_row(s[0], s[1], g, 1e-6), None)]
    variants += [(f"BR={t[0]} warps={t[1]}", lambda s, t=t: gated_rms_norm_triton(s[0], s[1], g, 1e-6, tile=t), t)
                 for t in NORM_TILES]
    return [_norm_row("gated_rms_norm", f"T={T}", name, fn, sets, ref, hf, nbytes, ceil,
                      t == norm_tile(V, T * HV)) for name, fn, t in variants]


def rope_case(T: int, G: int, dev, ceil: float) -> list[dict[str, Any]]:
    nbytes = (2 * T * G * DH + DH) * 2 + 8 * T
    w = (torch.randn(DH, device=dev) * 0.2).bfloat16()
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, ROT, 2, device=dev).float() / ROT))
    pos = torch.arange(T, device=dev) + 17
    sets = []
    for _ in range(n_sets(nbytes)):
        qg = torch.randn(T, G, 2 * DH, device=dev).bfloat16()
        sets.append(qg[..., :DH])
    q = sets[0]
    hf = rms_norm_rope(q, w, 1e-6, pos, inv_freq, backend="torch")
    variants = [("per row (ff7685e)", lambda s: rms_norm_rope_per_row(s, w, 1e-6, pos, inv_freq), None)]
    variants += [(f"BR={t[0]} warps={t[1]}", lambda s, t=t: rms_norm_rope_triton(s, w, 1e-6, pos, inv_freq, tile=t), t)
                 for t in ROPE_TILES]
    return [_norm_row("rms_norm_rope", f"T={T} G={G}", name, fn, sets, None, hf, nbytes, ceil,
                      t == rope_tile(DH, T * G)) for name, fn, t in variants]


def _norm_row(op, case, name, fn, sets, ref, hf, nbytes, ceil, default) -> dict[str, Any]:
    y = fn(sets[0])
    _sync()
    diff = (y.float() - hf.float()).abs() / hf.float().abs().clamp(min=1e-30)
    row = {"op": op, "case": case, "variant": name, "default": bool(default), "bytes": nbytes,
           "rel_rms_vs_f64": rel_rms(y, ref) if ref is not None else None,
           "max_rel_diff_vs_torch": diff.max().item(), "bitwise_equal_torch_share": (y == hf).float().mean().item()}
    row.update(timed(fn, sets, nbytes, ceil))
    print(_line(row), flush=True)
    return row


def prep_warps(dev, ceil: float) -> list[dict[str, Any]]:
    """chunk_prep_kernel at 1x4096 with prep_warps 2 / 4 (the default) / 8 (stretch: its launch config)."""
    from gdnserve.ops.gdn import chunk_configs
    from gdnserve.ops.gdn.chunk_triton import launch_prep
    from gdnserve.ops.gdn.chunk_workspace import ChunkWorkspace
    T, H, K = 4096, 16, 128
    meta = VarlenMeta.build([T], dev)
    y = torch.randn(T, 2 * H * K + HV * V, device=dev).bfloat16()
    q, k, v = y[:, :H * K].view(T, H, K), y[:, H * K:2 * H * K].view(T, H, K), y[:, 2 * H * K:].view(T, HV, V)
    a, b = torch.randn(T, HV, device=dev).bfloat16(), torch.randn(T, HV, device=dev).bfloat16()
    A_log = torch.rand(HV, device=dev).mul(15).add(1).log()
    dt = torch.rand(HV, device=dev).bfloat16()
    ws = ChunkWorkspace.empty(T, meta.num_chunk_rows, HV, K, V, torch.bfloat16, dev)
    o = torch.empty(T, HV, V, device=dev).bfloat16()     # the prep writes the output's state-independent half
    nbytes = T * (2 * H * K + HV * V + 2 * HV) * 2 + T * HV * (4 + 2 * K + 2 * V)
    out, ref = [], None
    for warps in (4, 2, 8):
        with chunk_configs.override(prep_warps=warps):
            launch_prep(q, k, v, a, b, A_log, dt, meta, ws, o)
            _sync()
            got = (ws.w.clone(), ws.u.clone())
            ref = ref or got
            row = {"op": "chunk_prep", "case": "T=4096", "variant": f"prep_warps={warps}", "default": warps == 4,
                   "bytes": nbytes, "rel_rms_vs_warps4": max(rel_rms(got[0], ref[0]), rel_rms(got[1], ref[1]))}
            row.update(timed(lambda _: launch_prep(q, k, v, a, b, A_log, dt, meta, ws, o), [None], nbytes, ceil))
        out.append(row)
        print(_line(row), flush=True)
    return out


def _line(r: dict[str, Any]) -> str:
    u = r["us"]
    chk = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()
           if k in ("max_abs_err_vs_f64", "pool_bit_exact", "bitwise_equal_tile", "rel_rms_vs_f64",
                    "max_rel_diff_vs_torch", "bitwise_equal_torch_share", "rel_rms_vs_warps4")}
    return (f"| {r['op']} | {r['case']} | {r['variant']}{' (default)' if r['default'] else ''} | {u['p50']:.2f} | "
            f"{u['p10']:.2f}-{u['p90']:.2f} | {r['TBps']:.2f} | {100 * r['share_of_copy']:.0f} % | {chk} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_prefill_ops", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tokens", default="1,64,512,4096,8192")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU smoke run (interpreted): no 8x1024, no chunk_prep")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    ceil = measure_ceilings(dev, quick=True)
    copy = ceil["copy_TBps"]
    print(f"copy ceiling {copy:.2f} TB/s", flush=True)
    rows: list[dict[str, Any]] = []
    with torch.inference_mode():
        for T in [int(t) for t in args.tokens.split(",")]:
            rows += conv_case([T], dev, copy)
            rows += gated_case(T, dev, copy)
            rows += rope_case(T, QH, dev, copy)
            rows += rope_case(T, KH, dev, copy)
        if not args.smoke:
            rows += conv_case([1024] * 8, dev, copy)
            rows += prep_warps(dev, copy)
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip() or "unknown"
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    meta = {"device": name, "torch": torch.__version__, "python": platform.python_version(), "commit": commit,
            "command": "python -m benchmarks.bench_prefill_ops " + " ".join(sys.argv[1:] if argv is None else argv), "ceilings": ceil}
    head = [f"# Prefill ops, old (ff7685e) vs new ({name})", "",
            f"torch {torch.__version__}; commit {commit}; command `{meta['command'].strip()}`; copy ceiling "
            f"{copy:.2f} TB/s (benchmarks/timing.py measure_ceilings). Times: µs per call, CUDA-graph replays "
            "(p50, p10-p90). '(default)' = the tile the launcher picks for that shape.", "",
            "| op | case | variant | p50 µs | p10-p90 | TB/s | of copy | checks |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = ("h200" if "H200" in name else "cuda") if dev.type == "cuda" else "cpu"
    (out / f"prefill_ops_{tag}.md").write_text("\n".join(head + [_line(r) for r in rows]) + "\n")
    (out / f"prefill_ops_{tag}.json").write_text(jsonfmt.dumps({"meta": meta, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
