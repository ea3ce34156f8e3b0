"""Block-FP8 GEMMs against bf16 at the Qwen3.5-35B-A3B shapes, and the random-weight bench model in FP8 next
to bf16.

    python -m benchmarks.bench_fp8 [--device auto|cpu|cuda[:N]] [--quick] [--out DIR] [--sweep] [--no-model]

Sections (each row also checks the FP8 result against the dequantizing float32 reference of the same math):

* **linear**: ``ops.quant.fp8_linear`` (Triton block-scaled GEMM, activations quantized per token-group of
  128 on the fly) vs ``F.linear`` in bf16, at decode (M = 1, 16, 64, 256) and prefill (M = 4096) for every
  dense projection of a Qwen3.5-35B-A3B layer (benchmarks/random_model.py's ``bench_hf_config``: hidden 2048;
  GDN in_proj 12288 FP8 rows (+64 dense b/a rows), out_proj; attention qkv 9216, o_proj; shared expert).
  µs = CUDA-graph replay time per call (benchmarks/timing.py); TB/s = bytes the call must move (weights,
  scales, x, y) / time; the weights rotate over enough copies to exceed L2.
* **moe**: the routed experts (256 experts, top-8, 2048 x 512) FP8 vs bf16, T = 1 ... 4096 tokens.
* **model**: the bench model (8 layers, 64 experts, vocab 248320; ``random_model.build_random_model``), one
  decode step at B = 1 (CUDA graph) and one 1 x 4096 prefill, bf16 and quantized in place to FP8
  (``models.loader.quantize_model_fp8_``: the release's layout), with the decode byte floor of each.
* ``--sweep``: the linear kernel's tile configs at M = 1 and 4096 on the in_proj shape (best first).

On CPU (``--quick``: seconds) the shapes are tiny and FP8 runs the dequantizing PyTorch path: a smoke run of
the script, not a measurement. Writes ``fp8_<device>.json`` and ``.md`` under ``--out`` (default
benchmarks/results; ``<device>`` is ``h200`` on an H200, else the device type).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from benchmarks.timing import time_call
from gdnserve.ops.numerics import rel_rms
from gdnserve.ops.quant import fp8_linear, quantize_weight
from gdnserve.ops.quant.fp8_ref import fp8_linear_torch

H = 2048
# name -> (FP8 rows N, K, dense tail rows): one Qwen3.5-35B-A3B layer's projections
LINEARS = {"gdn.in_proj": (12288, H, 64), "gdn.out_proj": (H, 4096, 0), "attn.qkv_proj": (9216, H, 0),
           "attn.o_proj": (H, 4096, 0), "shared.gate_up": (1024, H, 0), "shared.down": (H, 512, 0)}
TINY = {"tiny.col": (256, 256, 8), "tiny.row": (128, 384, 0)}
DECODE_M, PREFILL_M = (1, 16, 64, 256), 4096
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
    cpu = dev.type != "cuda"
    r = time_call(fn, iters=2 if cpu else (5 if quick else 20), warmup=1 if cpu else 2, rotate=rotate, device=dev)
    return r["gpu_us"]["p50"]


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
                row["fp8_us"] = _us(lambda t: fp8_linear(x, t[0], t[1], tail=t[2]), sets_fp8, dev, quick)
            except Exception as e:               # noqa: BLE001 — a failed case is reported, not fatal
                row["fp8_error"] = f"{type(e).__name__}: {e}"[:300]
            row["bf16_us"] = _us(lambda wt: F.linear(x, wt), sets_bf16, dev, quick)
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
        x = torch.randn(T, Hm, device=dev).to(_act(dev))
        w, idx = torch.topk(torch.softmax(torch.randn(T, E, device=dev), -1), k, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(_act(dev))
        row: dict[str, Any] = {"T": T, "E": E, "top_k": k, "H": Hm, "I": I}
        try:
            y = moe_experts(x, w, idx, q_gu, q_dn, scales=(s_gu, s_dn))
            ref = moe_experts(x, w, idx, q_gu, q_dn, scales=(s_gu, s_dn), backend="torch")   # same roundings
            row["rel_err"] = rel_rms(y, ref)
            row["fp8_us"] = _us(lambda _: moe_experts(x, w, idx, q_gu, q_dn, scales=(s_gu, s_dn)), [0], dev, quick)
        except Exception as e:                   # noqa: BLE001
            row["fp8_error"] = f"{type(e).__name__}: {e}"[:300]
        row["bf16_us"] = _us(lambda _: moe_experts(x, w, idx, gu16, dn16), [0], dev, quick)
        if "fp8_us" in row:
            row["speedup"] = row["bf16_us"] / row["fp8_us"]
        log(json.dumps(row))
        rows.append(row)
    return rows


def sweep_rows(dev: torch.device, log: Callable[[str], None]) -> list[dict[str, Any]]:
    from gdnserve.ops.quant import fp8_gemm_triton as g
    N, K, _ = LINEARS["gdn.in_proj"]
    q, s = quantize_weight(torch.randn(N, K, device=dev) * 0.02)
    sets = [(q.clone(), s.clone()) for _ in range(_copies(N * K, dev))]
    rows = []
    for M, cfgs in ((1, [(16, bn, w, st, 1) for bn in (16, 32, 64, 128) for w, st in ((4, 4), (2, 6))]),
                    (PREFILL_M, [(bm, bn, w, 3, 8) for bm, bn in ((64, 128), (128, 128)) for w in (4, 8)])):
        x = torch.randn(M, K, device=dev).bfloat16()
        for c in cfgs:
            g.CONFIG_OVERRIDE = c
            try:
                us = _us(lambda t: fp8_linear(x, t[0], t[1]), sets, dev, quick=True)
                rows.append({"M": M, "config": list(c), "us": us})
            except Exception as e:               # noqa: BLE001
                rows.append({"M": M, "config": list(c), "error": f"{type(e).__name__}: {e}"[:200]})
        g.CONFIG_OVERRIDE = None
    rows.sort(key=lambda r: (r["M"], r.get("us", math.inf)))
    for r in rows:
        log(json.dumps(r))
    return rows


def model_rows(dev: torch.device, quick: bool, layers: int, experts: int, log: Callable[[str], None]
               ) -> list[dict[str, Any]]:
    from benchmarks.random_model import build_random_model, config_for
    from gdnserve.engine.model_runner import ModelRunner, PrefillItem, RunnerConfig
    from gdnserve.models.loader import quantize_model_fp8_
    cfg = config_for(dev, layers, experts)
    L = 4096 if dev.type == "cuda" else 32
    rows = []
    for fmt in ("bf16", "fp8"):
        model = build_random_model(cfg, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
        fp8_layers = quantize_model_fp8_(model) if fmt == "fp8" else []
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        runner = ModelRunner(model, RunnerConfig(num_slots=4, page_size=16, num_pages=2 * (L // 16) + 32,
                                                 graph_max_batch=1, max_model_len=2 * L))
        ids = torch.randint(0, cfg["vocab_size"], (L,)).tolist()

        def prefill() -> None:
            seq = runner.new_seq()
            runner.step([PrefillItem(seq, ids)], [])
            runner.free_seq(seq)
        seq = runner.new_seq()
        tok = [int(runner.step([PrefillItem(seq, ids[:32])], []).argmax(-1)[0])]

        def decode() -> None:
            tok[0] = int(runner.step([], [(seq, tok[0])]).argmax(-1)[0])
        row: dict[str, Any] = {"format": fmt, "layers": cfg["num_hidden_layers"], "experts": cfg["num_experts"],
                               "weight_GB": weight_bytes / 1e9, "fp8_layers": len(fp8_layers)}
        cpu = dev.type != "cuda"
        row["decode_B1_ms"] = _wall(decode, dev, 0 if cpu else 5, 1 if cpu else (5 if quick else 20))
        row["prefill_ms"] = _wall(prefill, dev, 0 if cpu else 1, 1 if cpu else (2 if quick else 5))
        row["prefill_tok_s"] = L / row["prefill_ms"] * 1e3
        log(json.dumps(row))
        rows.append(row)
        runner = model = None       # free before the next format is built
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _wall(fn: Callable[[], None], dev: torch.device, warmup: int, iters: int) -> float:
    """Median wall ms of one call, the device synchronised around each (what a step costs end to end)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def markdown(rep: dict[str, Any]) -> str:
    out = [f"# Block-FP8 vs bf16 ({rep['device']})", "", f"`{rep['command']}` — torch {rep['torch']}, "
           f"triton {rep['triton']}. µs: CUDA-graph replay per call (p50); TB/s: bytes moved / time; rel_err: "
           "FP8 result vs the float32 dequantizing reference of the same quantized math.", ""]
    out += ["## Linear (Qwen3.5-35B-A3B projections)", "",
            "| shape | N | K | M | bf16 µs | fp8 µs | speedup | bf16 TB/s | fp8 TB/s | rel_err |", "|---" * 10 + "|"]
    for r in rep["linear"]:
        fp8 = (f"{r['fp8_us']:.1f} | {r['speedup']:.2f}x" if "fp8_us" in r else f"error: {r.get('fp8_error')} | -")
        out.append(f"| {r['shape']} | {r['N']} | {r['K']} | {r['M']} | {r['bf16_us']:.1f} | {fp8} | "
                   f"{r['bf16_TBps']:.2f} | {r.get('fp8_TBps', float('nan')):.2f} | {r.get('rel_err', float('nan')):.1e} |")
    out += ["", "## Routed experts (grouped GEMM)", "", "| T | E | top-k | bf16 µs | fp8 µs | speedup | rel_err |",
            "|---" * 7 + "|"]
    for r in rep["moe"]:
        fp8 = f"{r['fp8_us']:.1f} | {r['speedup']:.2f}x" if "fp8_us" in r else f"error: {r.get('fp8_error')} | -"
        out.append(f"| {r['T']} | {r['E']} | {r['top_k']} | {r['bf16_us']:.1f} | {fp8} | "
                   f"{r.get('rel_err', float('nan')):.1e} |")
    if rep.get("model"):
        out += ["", "## Bench model (random weights)", "",
                "| format | layers | experts | weights GB | FP8 layers | decode B=1 ms | prefill 1x4096 ms | prefill tok/s |",
                "|---" * 8 + "|"]
        for r in rep["model"]:
            out.append(f"| {r['format']} | {r['layers']} | {r['experts']} | {r['weight_GB']:.2f} | {r['fp8_layers']} | "
                       f"{r['decode_B1_ms']:.2f} | {r['prefill_ms']:.1f} | {r['prefill_tok_s']:.0f} |")
    if rep.get("sweep"):
        out += ["", "## Linear tile sweep (gdn.in_proj; BM, BN, warps, stages, GROUP_M)", "", "| M | config | µs |",
                "|---|---|---|"]
        out += [f"| {r['M']} | {r['config']} | {r.get('us', r.get('error'))} |" for r in rep["sweep"]]
    for note in rep.get("notes", []):
        out += ["", note]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--quick", action="store_true", help="fewer timing iterations (CPU: a smoke run in seconds)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--sweep", action="store_true", help="also sweep the linear kernel's tile configs (CUDA)")
    ap.add_argument("--no-model", action="store_true", help="skip the bench-model section")
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
                           "torch": torch.__version__, "triton": triton.__version__, "notes": []}
    log = lambda s: print(s, flush=True)        # noqa: E731
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        (out / f"fp8_{_tag(dev)}.json").write_text(json.dumps(rep, indent=1))
        (out / f"fp8_{_tag(dev)}.md").write_text(markdown(rep))
    with torch.no_grad():
        rep["linear"] = linear_rows(dev, args.quick, log)
        rep["moe"] = moe_rows(dev, args.quick, log)
        save()
        if not args.no_model:
            if time.perf_counter() - t0 < args.time_budget:
                rep["model"] = model_rows(dev, args.quick, args.layers, args.experts, log)
                save()
            else:
                rep["notes"].append("model section skipped: --time-budget spent")
        if args.sweep and dev.type == "cuda":
            if time.perf_counter() - t0 < args.time_budget:
                rep["sweep"] = sweep_rows(dev, log)
            else:
                rep["notes"].append("sweep skipped: --time-budget spent")
    save()
    print(markdown(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
