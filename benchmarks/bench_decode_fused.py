"""Decode step with the fused decode paths off and on, side by side in one process (issue 29).

The full-size random-weight Qwen3.5-35B-A3B (CUDA; ``--quick``: the tiny CPU model, a smoke run) is built once;
for each format (bf16, then the same weights quantized in place to block FP8) and each impl (``IMPLS``: ``off``
today's kernels; ``on`` every ``GatedDeltaNet.fused_decode`` (the GDN decode chain as one launch, one program per
value head), ``GatedAttention.fused_qk_store`` (q/k norm + rotary + K/V store as one launch) and
``SparseMoE.fused_norm_router`` (at B = 1 the post-attention norm, the router GEMM and the routing as one launch)
set; ``on-nt8`` the same with eight V tiles per head; ``--impls`` also takes ``gdn``, ``qk``, ``router``: one path
each) a ModelRunner is built, its decode steps at B = 1 and 16 (context 128) captured in CUDA graphs in warm-up and timed as replays
(perf_counter around ``runner.step`` with the device synchronised: the wall of a step, host work included);
then a short torch.profiler pass counts kernels per step (per layer = / num layers) and their GPU time.

Rows: ``kind`` (decode), ``shape`` (B=n), ``impl``, ``format``, ``ms`` (median), ``p10``/``p90``, ``pct_of_floor``
(floor as bench_model's: essential bytes / measured copy rate), ``kernels_per_step``, ``kernels_per_layer``,
``gpu_ms`` (kernel sum), ``gap_ms`` (wall - kernel sum); per-kernel tables per case. Written to
``decode_fused_<device>.json`` and ``.md``, after every row.

    python -m benchmarks.bench_decode_fused --out DIR [--batches 1,16] [--formats bf16,fp8] [--steps 20]
        [--impls off,on,on-nt8] [--time-budget S] [--quick]
"""
from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import jsonfmt

# impl -> (GDN chain, q/k prologue, norm in the router, V tiles per head of the fused GDN kernel). "on":
# GatedDeltaNet.fused_decode (the GDN chain as one launch, one program per value head: 32 at B = 1),
# GatedAttention.fused_qk_store (q/k norm + rotary + K/V store as one launch) and SparseMoE.fused_norm_router (B = 1:
# the post-attention norm, the router GEMM and the routing as one launch); "on-nt8": the same with eight V tiles per head (16-row tiles as
# today's recurrent kernel; the gated norm by the key head's last arrival). The one-path impls (not run by default)
# attribute a gain.
IMPLS = {"off": (False, False, False, 1), "on": (True, True, True, 1), "on-nt8": (True, True, True, 8),
         "gdn": (True, False, False, 1), "qk": (False, True, False, 1), "router": (False, False, True, 1)}
DEFAULT_IMPLS = ("off", "on", "on-nt8")


def set_fused_decode(model, impl: str) -> int:
    """Set the fused-path switches of every GDN mixer, attention layer and MoE block and the fused GDN kernel's V
    split (read at launch, i.e. fixed in a capture); returns the number of GDN layers."""
    import os

    from gdnserve.layers.attention import GatedAttention
    from gdnserve.layers.gdn_mixer import GatedDeltaNet
    from gdnserve.layers.moe import SparseMoE
    gdn, qk, router, nt = IMPLS[impl]
    os.environ["GDNSERVE_FUSED_DECODE_NT"] = str(nt)
    mixers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    for m in mixers:
        m.fused_decode = gdn
    for m in model.modules():
        if isinstance(m, GatedAttention):
            m.fused_qk_store = qk
        elif isinstance(m, SparseMoE):
            m.fused_norm_router = router
    return len(mixers)


def kernel_profile(call, reps: int) -> tuple[dict[str, list[float]] | None, float | None]:
    """(kernel name -> [launches per step, GPU µs per step], profiled wall ms) from torch.profiler; (None, None)
    without CUDA."""
    if not torch.cuda.is_available():
        return None, None
    from benchmarks.profile_steps import profile_steps
    return profile_steps(call, reps)


def decode_case(runner, B: int, ctx: int, steps: int, warmup: int, dev: torch.device, prof_reps: int
                ) -> dict[str, Any]:
    from benchmarks.timing import percentiles
    from gdnserve.engine.cache.sequence import PrefillItem
    vocab = runner.model.cfg.vocab_size
    g = torch.Generator().manual_seed(B)
    seqs = [runner.new_seq() for _ in range(B)]
    try:
        toks = runner.step([PrefillItem(s, torch.randint(0, vocab, (ctx,), generator=g).tolist()) for s in seqs],
                           []).argmax(-1).tolist()
        state = {"toks": toks}

        def call():
            state["toks"] = runner.step([], list(zip(seqs, state["toks"]))).argmax(-1).tolist()
        times = []
        for i in range(warmup + steps):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            call()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(1e3 * (time.perf_counter() - t))
        agg, _ = kernel_profile(call, prof_reps)
        n = None if agg is None else sum(c for c, _ in agg.values())
        gpu = None if agg is None else sum(t for _, t in agg.values()) / 1e3
        return {"ms": percentiles(times), "kernels_per_step": n, "gpu_ms": gpu, "kernels": agg,
                "graph_stats": dict(runner.graphs.stats) if getattr(runner, "graphs", None) else None}
    finally:
        for s in seqs:
            runner.free_seq(s)


def run(dev: torch.device, quick: bool, batches: tuple[int, ...], formats: tuple[str, ...], steps: int,
        impls: tuple[str, ...] = DEFAULT_IMPLS, log=print, budget_s: float = float("inf"),
        save=lambda res: None) -> dict[str, Any]:
    """The cases in order (format, impl, batch); ``save(res)`` after every row (a run cut short keeps its rows).
    ``budget_s``: a format's impls past the first two start only while the format is within its share of what is
    left (the FP8 rows must not be starved by the bf16 extras); past the budget nothing new starts (``skipped``)."""
    from benchmarks.bench_model import decode_bytes
    from benchmarks.random_model import build_random_model, config_for
    from benchmarks.timing import measure_ceilings
    from gdnserve.engine.execution.model_runner import ModelRunner, RunnerConfig
    cuda = dev.type == "cuda"
    t0 = time.perf_counter()
    cfg = config_for(dev, None, None, full=cuda and not quick)
    ctx = 128 if cuda else 8
    model = build_random_model(cfg, dev, torch.bfloat16 if cuda else torch.float32)
    log(f"model built in {time.perf_counter() - t0:.1f} s")
    copy_tbps = measure_ceilings(dev, quick=True)["copy_TBps"] if cuda else None
    n_layers = model.cfg.num_layers
    res: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu", "model_config": cfg,
                           "dtype": str(next(model.parameters()).dtype),   # the CPU smoke model is fp32
                           "copy_TBps": copy_tbps, "rows": [], "skipped": []}
    for fi, fmt in enumerate(formats):
        t_fmt = time.perf_counter()
        share = (budget_s - (t_fmt - t0)) / (len(formats) - fi)
        if fmt == "fp8":
            from gdnserve.models.loader import quantize_model_fp8_
            t = time.perf_counter()
            quantize_model_fp8_(model)
            log(f"fp8 conversion {time.perf_counter() - t:.1f} s")
        elif fmt != "bf16":
            raise ValueError(f"--formats: unknown format {fmt!r} (bf16, fp8)")
        for ii, impl in enumerate(impls):
            spent = time.perf_counter() - t0
            if spent > budget_s or (ii >= 2 and time.perf_counter() - t_fmt > 0.6 * share):
                res["skipped"].append(f"{fmt} {impl}: {spent:.0f} s of the {budget_s:.0f} s budget spent")
                log(res["skipped"][-1])
                continue
            n_gdn = set_fused_decode(model, impl)
            runner = ModelRunner(model, RunnerConfig(num_slots=max(batches) + 1, num_pages=16 * max(batches) + 32,
                                                     page_size=16, graph_max_batch=max(batches), mixed_graphs=False,
                                                     max_model_len=2 * ctx + 64))
            for B in batches:
                r = decode_case(runner, B, ctx, steps, 3 if cuda else 1, dev, 3)
                floor = decode_bytes(model, B, ctx) / (copy_tbps * 1e12) * 1e3 if copy_tbps else None
                ms = r["ms"]["p50"]
                n = r["kernels_per_step"]
                row = {"kind": "decode", "shape": f"B={B}", "impl": impl, "format": fmt, "ms": round(ms, 4),
                       "p10": round(r["ms"]["p10"], 4), "p90": round(r["ms"]["p90"], 4),
                       "floor_ms": None if floor is None else round(floor, 4),
                       "pct_of_floor": None if floor is None else round(100 * floor / ms, 1),
                       "kernels_per_step": None if n is None else round(n, 1),
                       "kernels_per_layer": None if n is None else round(n / n_layers, 2),
                       "gpu_ms": None if r["gpu_ms"] is None else round(r["gpu_ms"], 4),
                       # wall minus the kernels' sum: launch gaps and host work between replays
                       "gap_ms": None if r["gpu_ms"] is None else round(ms - r["gpu_ms"], 4),
                       "gdn_layers": n_gdn, "graph_stats": r["graph_stats"]}
                res["rows"].append(row)
                if r["kernels"]:
                    res.setdefault("kernels", {})[f"{fmt} B={B} {impl}"] = {
                        k: [round(c, 2), round(t, 2)] for k, (c, t) in r["kernels"].items()}
                res["seconds"] = round(time.perf_counter() - t0, 1)
                save(res)
                log(json.dumps(row))
            del runner
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


def markdown(res: dict[str, Any]) -> str:
    out = [f"# Decode, fused paths off vs on — {res['device']}", "",
           f"copy rate {res['copy_TBps']} TB/s; {res.get('seconds')} s; command `python -m benchmarks.bench_decode_fused`.",
           "", ("| format | shape | impl | ms | p10–p90 | floor ms | % floor | kernels / step | kernels / layer | GPU ms "
                "| gap ms |"), "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["rows"]:
        out.append(f"| {r['format']} | {r['shape']} | {r['impl']} | {r['ms']:.3f} | {r['p10']:.3f}–{r['p90']:.3f} | "
                   f"{r['floor_ms']} | {r['pct_of_floor']} | {r['kernels_per_step']} | {r['kernels_per_layer']} | "
                   f"{r['gpu_ms']} | {r.get('gap_ms')} |")
    out += [f"Skipped: {x}" for x in res.get("skipped", [])]
    for case, agg in res.get("kernels", {}).items():     # per-kernel tables (profile_steps' format), top 20
        from benchmarks.profile_steps import markdown as kernel_table
        row = next((r for r in res["rows"] if f"{r['format']} {r['shape']} {r['impl']}" == case), None)
        out += [""] + kernel_table(f"{case} (wall {row['ms']:.3f} ms timed)" if row else case, agg,
                                   row["ms"] if row else 0.0, 20)
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_decode_fused", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="the tiny model (CPU smoke run)")
    ap.add_argument("--batches", default=None, help="comma-separated (default 1,16; --quick 1,3)")
    ap.add_argument("--formats", default=None, help="bf16,fp8 (default both on CUDA, bf16 with --quick)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per case (default 20; --quick 2)")
    ap.add_argument("--impls", default=",".join(DEFAULT_IMPLS), help=f"comma-separated of {list(IMPLS)}")
    ap.add_argument("--time-budget", type=float, default=float("inf"), help="seconds (see run)")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    batches = tuple(int(b) for b in (a.batches or ("1,3" if a.quick else "1,16")).split(","))
    formats = tuple((a.formats or ("bf16" if a.quick else "bf16,fp8")).split(","))
    impls = tuple(a.impls.split(","))
    if any(i not in IMPLS for i in impls):
        raise SystemExit(f"--impls: each of {list(IMPLS)}, got {a.impls!r}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "h200" if "H200" in (torch.cuda.get_device_name() if dev.type == "cuda" else "") else dev.type

    def save(res):
        (out / f"decode_fused_{tag}.json").write_text(jsonfmt.dumps(res))      # the committed results' form
        (out / f"decode_fused_{tag}.md").write_text(markdown(res))
    res = run(dev, a.quick, batches, formats, a.steps or (2 if a.quick else 20), impls, budget_s=a.time_budget,
              save=save)
    save(res)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
