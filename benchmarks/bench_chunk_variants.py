"""The chunked GDN prefill side by side (issue 28): our device row ("ours"), the ``fused_main`` variant (FlashQLA's
structure, chunk_fused_triton.py) at V tiles 16, 32 and 64 and with its context parallelism (segments of 32 and 16
chunks), fla 0.6.0's internal forward and FlashQLA 0.1.3 (auto
context parallelism on, and off), when importable, on the SAME inputs.

    python -m benchmarks.bench_chunk_variants --out benchmarks/results            # H200, ~2-3 min
    TRITON_INTERPRET=1 python -m benchmarks.bench_chunk_variants --quick --out /tmp/x   # CPU smoke (interpreted)
    bash benchmarks/device.sh chunkvar            # on the device (FlashQLA needs its wheels in .whl/)

Shapes (N x L): the issue's 1x32768, 1x16384, 1x8192, 1x4096, 28672+4096, 4x8192, 8x4096, 8x1024, 64x256 at the
Qwen3.5-35B-A3B TP1 GDN shape (H = 16, HV = 32, K = V = 128), bf16 activations, fp32 states. Inputs: raw q, k, a, b
(fresh random), A_log = log U(1, 16), dt_bias = U(0, 1); ours takes them raw (gates and l2norm inside), fla and
FlashQLA take l2norm(q), l2norm(k), g, beta computed from the same tensors (outside the timed region), so every
implementation computes the same function. Initial states: random pool slots (ours reads pool[src] and writes
pool[dst] in place; fla/FlashQLA get the same states as a contiguous tensor and return final states).

Timing: ``benchmarks.timing.time_call``: a CUDA graph of back-to-back calls where the implementation allows capture
(ours), else events around n back-to-back eager calls ("batched_events": fla's varlen forward and FlashQLA's
auto-CP read cu_seqlens on the host); the method is in every row. GPU µs, median and P10-P90 over the replays.
Errors: rel-RMS of o and of the final state against our fp32 PyTorch path (float32 activations, same inputs) at
shapes of <= 8192 tokens; beyond that against the "ours" row. Writes chunk_variants_<device>.md/.json to --out
after every shape (a run cut short keeps what it measured).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
import traceback
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch

from benchmarks import jsonfmt
from benchmarks.timing import time_call

# the most telling first (a run cut short by its budget keeps them): throughput-bound, latency-bound, many short
SHAPES = [[4096] * 8, [32768], [256] * 64, [4096], [1024] * 8, [8192] * 4, [28672, 4096], [16384], [8192]]
QUICK_SHAPES = [[130], [33, 65, 1]]
VARIANTS: dict[str, dict[str, Any]] = {       # ours: ChunkConfig fields on top of the device's row
    "ours": {},
    # V tiles >= 64 only: at 16 and 32 Triton 3.6's bf16 products were wrong on the H200 (chunk_fused_triton.MIN_TILE)
    "ours fused bv64": {"fused_main": True, "main_bv": 64},
    "ours fused bv128": {"fused_main": True, "main_bv": 128},
    "ours fused bv64 tf32": {"fused_main": True, "main_bv": 64, "main_tf32": True},   # X, U unrounded (error)
    # context parallelism on the fused path: sequences of >= 3 segments (a 2-segment sequence is one program anyway)
    "ours fused bv64 cp32": {"fused_main": True, "main_bv": 64, "cp_min_chunks": 96, "cp_seg_chunks": 32},
    "ours fused bv64 cp16": {"fused_main": True, "main_bv": 64, "cp_min_chunks": 48, "cp_seg_chunks": 16},
}
REF_MAX_TOKENS = 8192


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def shape_name(lens: list[int]) -> str:
    return f"{len(lens)}x{lens[0]}" if len(set(lens)) == 1 else "+".join(map(str, lens))


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30))


def load_anchors(no_fla: bool, no_qla: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if not no_fla:
        try:
            from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd
            out["fla"] = chunk_gated_delta_rule_fwd
        except Exception as e:  # noqa: BLE001 — optional anchor
            out["fla_error"] = repr(e)[:200]
    if not no_qla:
        try:
            import flash_qla
            out["flashqla"] = flash_qla.chunk_gated_delta_rule_fwd
            out["flashqla_version"] = flash_qla.__version__
        except Exception as e:  # noqa: BLE001 — optional anchor (needs tilelang and a Hopper/Blackwell GPU)
            out["flashqla_error"] = repr(e)[:200]
    return out


def _find(outs, pred) -> torch.Tensor | None:
    for t in (outs if isinstance(outs, (tuple, list)) else (outs,)):
        if torch.is_tensor(t) and pred(t):
            return t
    return None


def run_shape(lens: list[int], dims: tuple[int, int, int], dev: torch.device, anchors: dict[str, Any],
              variants: dict[str, dict[str, Any]], iters: int) -> list[dict[str, Any]]:
    from gdnserve.ops.gdn.chunk import chunk_gated_delta_rule
    from gdnserve.ops.gdn.chunk_configs import chunk_config, override
    from gdnserve.ops.gdn.chunk_workspace import ChunkWorkspace
    from gdnserve.ops.gdn.gates import gates, l2norm
    from gdnserve.ops.varlen import VarlenMeta

    H, HV, D = dims
    T, N = sum(lens), len(lens)
    dt = torch.bfloat16
    torch.manual_seed(0)
    q = torch.randn(T, H, D, device=dev, dtype=dt)
    k = torch.randn(T, H, D, device=dev, dtype=dt)
    v = torch.randn(T, HV, D, device=dev, dtype=dt)
    a = torch.randn(T, HV, device=dev, dtype=dt)
    b = torch.randn(T, HV, device=dev, dtype=dt)
    A_log = torch.log(torch.empty(HV, device=dev).uniform_(1, 16))
    dt_bias = torch.rand(HV, device=dev)
    pool = torch.randn(2 * N, HV, D, D, device=dev) * 0.1      # [S, HV, V, K]
    src = torch.arange(N, dtype=torch.int32, device=dev)
    dst = torch.arange(N, 2 * N, dtype=torch.int32, device=dev)
    meta = VarlenMeta.build(lens, dev)
    out = torch.empty(T, HV, D, device=dev, dtype=dt)
    ws = ChunkWorkspace.empty(T, meta.num_chunk_rows, HV, D, D, dt, dev)
    rows: list[dict[str, Any]] = []

    ref = None
    if T <= REF_MAX_TOKENS:     # our fp32 PyTorch path on the same inputs
        p32 = pool.clone()
        o32 = chunk_gated_delta_rule(q.float(), k.float(), v.float(), a.float(), b.float(), A_log, dt_bias, p32,
                                     meta, src, dst, backend="torch")
        ref = (o32, p32[N:].clone(), "fp32 torch path")
        del p32

    def record(impl: str, fn: Callable[[], Any], o_fs: Callable[[], tuple[torch.Tensor, torch.Tensor]],
               extra: dict[str, Any]) -> None:
        nonlocal ref
        row: dict[str, Any] = {"shape": shape_name(lens), "T": T, "N": N, "impl": impl, **extra}
        try:
            r = time_call(fn, iters=iters, warmup=2, host_iters=max(2, iters // 2), device=dev)
            row.update(us=r["gpu_us"], method=r["gpu_method"], graph_calls=r["graph_calls"],
                       call_us=r["call_us"]["p50"], host_us=r["host_us"])
            o, fs = o_fs()
            if ref is None:         # the first row (ours) is the reference beyond REF_MAX_TOKENS
                ref = (o.float().clone(), fs.float().clone(), "ours")
            row.update(err_o=rel_rms(o, ref[0]), err_state=rel_rms(fs, ref[1]), err_vs=ref[2])
        except Exception as e:  # noqa: BLE001 — one failing implementation must not end the run
            row["error"] = f"{type(e).__name__}: {e}"[:300]
            log(traceback.format_exc(limit=3))
        rows.append(row)
        us = row.get("us", {})
        log(f"{row['shape']:>12} {impl:<18} {us.get('p50', float('nan')):9.1f} us "
            f"[{us.get('p10', float('nan')):.1f}-{us.get('p90', float('nan')):.1f}] {row.get('method', '')} "
            f"err o {row.get('err_o', float('nan')):.2e} state {row.get('err_state', float('nan')):.2e}"
            + (f" ERROR {row['error']}" if "error" in row else ""))

    for name, fields in variants.items():
        def call_ours(fields=fields):
            with override(**fields):
                chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, pool, meta, src, dst, out=out, workspace=ws,
                                       backend="triton")
        with override(**fields):
            cfg = chunk_config(dev)
        record(name, call_ours, lambda: (out, pool[N:]), {"config": {f: getattr(cfg, f) for f in fields}})

    # the anchors' inputs: normalised q/k, gates, the same initial states (outside the timed region)
    g, beta = gates(a, b, A_log, dt_bias)
    qn, kn = l2norm(q).to(dt)[None], l2norm(k).to(dt)[None]
    g, beta, v1 = g[None].contiguous(), beta[None].contiguous(), v[None]
    cu = meta.cu_seqlens
    h0_vk = pool[:N].clone()                                      # [N, HV, V, K] (state_v_first)
    h0_kv = h0_vk.transpose(-1, -2).contiguous()                  # [N, HV, K, V]
    scale = D ** -0.5
    res: dict[str, Any] = {}
    if "fla" in anchors:
        fla = anchors["fla"]

        def call_fla():
            res["fla"] = fla(qn, kn, v1, g, beta, scale=scale, initial_state=h0_kv, output_final_state=True,
                             cu_seqlens=cu.long())

        def fla_out():
            o = _find(res["fla"], lambda t: t.shape == (1, T, HV, D))
            fs = _find(res["fla"], lambda t: t.shape == (N, HV, D, D) and t.dtype == torch.float32)
            return o[0], fs.transpose(-1, -2)
        record("fla", call_fla, fla_out, {})
    if "flashqla" in anchors:
        qla = anchors["flashqla"]
        for cp in (True, False):
            key = f"flashqla{'' if cp else ' no-cp'}"

            def call_qla(cp=cp, key=key):
                res[key] = qla(qn, kn, v1, g, beta, scale=scale, initial_state=h0_vk, output_final_state=True,
                               cu_seqlens=cu, auto_cp=cp, state_v_first=True)

            def qla_out(key=key):
                _, _, o, _, fs, _ = res[key]
                return o[0], fs
            record(key, call_qla, qla_out, {"auto_cp": cp})
    return rows


def write(rows: list[dict[str, Any]], meta: dict[str, Any], out_dir: Path, tag: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"chunk_variants_{tag}.json").write_text(jsonfmt.dumps({"meta": meta, "rows": rows}) + "\n")
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    lines = [f"# Chunked GDN prefill variants ({meta['device']})", "",
             (f"{meta['versions']}; command `{meta['command']}`. GPU µs per call, median [P10-P90]; timing method "
              "per cell (graph = CUDA graph replay, batched = events around back-to-back eager calls); errors are "
              "rel-RMS of o / final state against the fp32 PyTorch path (<= 8192 tokens) or the `ours` row."), "",
             "| shape | " + " | ".join(impls) + " | best ours / FlashQLA |", "|" + " --- |" * (len(impls) + 2)]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        cells, by = [], {r["impl"]: r for r in rows if r["shape"] == shape}
        for impl in impls:
            r = by.get(impl)
            if r is None or "us" not in r:
                cells.append("—" if r is None else "error")
                continue
            u = r["us"]
            m = {"cuda_graph": "graph", "batched_events": "batched"}.get(r["method"], r["method"])
            cells.append(f"{u['p50']:,.1f} [{u['p10']:,.0f}-{u['p90']:,.0f}] {m}; "
                         f"{r.get('err_o', float('nan')):.1e} / {r.get('err_state', float('nan')):.1e}")
        ours = [by[i]["us"]["p50"] for i in by if i.startswith("ours") and "us" in by[i]]
        qla = by.get("flashqla", {}).get("us", {}).get("p50")
        ratio = f"{min(ours) / qla:.2f}" if ours and qla else "—"
        lines.append(f"| {shape} | " + " | ".join(cells) + f" | {ratio} |")
    errs = [f"- {r['shape']} {r['impl']}: {r['error']}" for r in rows if "error" in r]
    notes = [f"- {k}: {v}" for k, v in meta.items() if k.endswith("_error")]
    if errs or notes:
        lines += ["", "Errors and missing anchors:", *notes, *errs]
    (out_dir / f"chunk_variants_{tag}.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true", help="tiny shapes and heads (CPU smoke under the interpreter)")
    ap.add_argument("--shapes", default=None, help="N x L list, e.g. 1x32768,8x4096 (default: the issue's nine)")
    ap.add_argument("--variants", default=None, help=f"comma list of {list(VARIANTS)} (default: all)")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--no-flashqla", action="store_true")
    ap.add_argument("--time-budget", type=float, default=170.0, help="seconds; no new shape starts past it")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("on CPU the Triton kernels run interpreted: set TRITON_INTERPRET=1")
    dims = (16, 32, 128) if not args.quick else (1, 2, 32)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.shapes:
        shapes = [[int(L)] * int(n) for n, L in (s.split("x") for s in args.shapes.split(","))]
    variants = VARIANTS if not args.variants else {v: VARIANTS[v] for v in args.variants.split(",")}
    if args.quick:   # the CP rows cut the smoke's short sequences too (2-chunk segments from 3 chunks on)
        variants = {n: {**f, "cp_min_chunks": 3, "cp_seg_chunks": 2} if "cp_seg_chunks" in f else f
                    for n, f in variants.items()}
    anchors = load_anchors(args.no_fla or not cuda, args.no_flashqla or not cuda)
    import triton
    dev_name = torch.cuda.get_device_name() if cuda else "cpu"
    tag = "h200" if "H200" in dev_name else ("cpu" if not cuda else dev_name.replace(" ", "_").lower())
    meta: dict[str, Any] = {
        "device": dev_name, "command": "python -m benchmarks.bench_chunk_variants" + (" --quick" if args.quick else ""),
        "versions": f"torch {torch.__version__}, Triton {triton.__version__}, python {platform.python_version()}"
                    + (f", flash-qla {anchors['flashqla_version']}" if "flashqla_version" in anchors else ""),
        "dims": {"H": dims[0], "HV": dims[1], "K": dims[2], "V": dims[2]}, "variants": variants,
        **{k: v for k, v in anchors.items() if k.endswith("_error")},
    }
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    for lens in shapes:
        if time.time() - t0 > args.time_budget:
            log(f"time budget spent: {shape_name(lens)} and later shapes not run")
            meta.setdefault("skipped", []).append(shape_name(lens))
            continue
        rows += run_shape(lens, dims, dev, anchors, variants, args.iters if cuda else 2)
        write(rows, meta, Path(args.out), tag)
        if cuda:
            torch.cuda.empty_cache()
    write(rows, meta, Path(args.out), tag)
    print(Path(args.out, f"chunk_variants_{tag}.md").read_text())
    print(json.dumps({"rows": len(rows), "seconds": round(time.time() - t0, 1)}))


if __name__ == "__main__":
    main()
