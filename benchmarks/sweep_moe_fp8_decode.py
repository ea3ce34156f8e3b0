"""Sweep of the FP8 decode experts kernels (``ops/moe/decode_fp8_triton``) against the grouped FP8 path and
bf16, at the Qwen3.5-35B-A3B experts (256 experts, top-8, H 2048, I 512), T = 1 ... 32 tokens.

    python -m benchmarks.sweep_moe_fp8_decode [--out DIR] [--time-budget S]

Stage 1 sweeps the gate_up side (BR, KG, warps, QX) with the default down side at T = 1 and 16; stage 2 the
down side (BR2, warps2, QH, PAR) with the best gate_up of each T; then the best of each T is timed at every T
next to the grouped FP8 kernels (``DECODE_MAX_PAIRS = 0``) and bf16. µs: CUDA-graph replay per call, median
[P10–P90], 8 random routings rotated (bench_fp8's experts methodology: the touched experts leave L2).
Writes ``moe_fp8_decode_sweep_<device>.json`` and ``.md``. (The committed H200 result is the tree of commit
112ac0b (92f85cf after a rebase), whose lists also held variants since removed: the block scales folded into
the activation side (``FOLD``, elementwise FMAs into a 3-D accumulator): equal at T = 1, slower at T = 16;
deeper pipelines (``stages`` 2-4): no change. ``PAR`` was first timed at b4c1697: the committed file is that run.)
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_fp8 import H as HID
from benchmarks.bench_fp8 import _pct, _routing, _tag
from gdnserve.ops.moe import decode_fp8_triton as d
from gdnserve.ops.moe import moe_experts
from gdnserve.ops.numerics import rel_rms
from gdnserve.ops.quant import quantize_weight
from benchmarks import jsonfmt

C = d.DecodeConfig
DEFAULT_MAX = d.DECODE_MAX_PAIRS


def _time(fn, sets, dev, quick=True) -> dict[str, Any]:
    try:
        t = _pct(fn, sets, dev, quick)
        return {"us": t["p50"], "p10_p90": [t["p10"], t["p90"]]}
    except Exception as e:                   # noqa: BLE001 — a failing config is reported
        return {"error": f"{type(e).__name__}: {e}"[:200]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--time-budget", type=float, default=150.0)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run of the script (interpreter, tiny shapes)")
    ap.add_argument("--final-only", action="store_true", help="no sweep: the default configs, grouped, bf16")
    args = ap.parse_args(argv)
    dev = torch.device("cpu" if args.tiny else "cuda")
    t0 = time.perf_counter()
    E, I, k, H = (8, 128, 2, 256) if args.tiny else (256, 512, 8, HID)
    gu = torch.randn(E, 2 * I, H, device=dev) / H ** 0.5
    dn = torch.randn(E, H, I, device=dev) / I ** 0.5
    (qg, sg), (qu, su), (qd, sd) = (quantize_weight(t) for t in (gu[:, :I], gu[:, I:], dn))
    q_gu, s_gu = torch.cat([qg, qu], 1).contiguous(), torch.cat([sg, su], 1).contiguous()
    q_dn, s_dn = qd.contiguous(), sd.contiguous()
    gu16, dn16 = (gu, dn) if args.tiny else (gu.bfloat16(), dn.bfloat16())
    del gu, dn
    Ts = (1, 16) if args.tiny else (1, 2, 4, 8, 16, 32)
    sets = {T: [_routing(T, H, E, k, dev) for _ in range(8)] for T in Ts}
    fp8 = lambda r, cfg=None: moe_experts(*r, q_gu, q_dn, scales=(s_gu, s_dn), config=cfg)   # noqa: E731
    rep: dict[str, Any] = {"device": "cpu" if args.tiny else torch.cuda.get_device_name(dev), "sweep": [], "final": [],
                           "parts": []}
    d.DECODE_MAX_PAIRS = 10 ** 6
    log = lambda s: print(s, flush=True)     # noqa: E731

    def one(T: int, cfg: C, stage: str) -> dict[str, Any]:
        x, w, idx = sets[T][0]
        row = {"stage": stage, "T": T, "config": cfg._asdict()}
        try:
            y = fp8((x, w, idx), cfg)
            ref = moe_experts(x, w, idx, q_gu, q_dn, scales=(s_gu, s_dn), backend="torch")
            row["rel_err"] = rel_rms(y, ref)
        except Exception as e:               # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"[:200]
            return row
        row.update(_time(lambda r: fp8(r, cfg), sets[T], dev))
        log(json.dumps(row))
        rep["sweep"].append(row)
        return row

    best: dict[int, C] = {}

    def stage(T: int, name: str, cfgs: list[C]) -> None:
        rows = [one(T, c, name) for c in cfgs if time.perf_counter() - t0 < args.time_budget]
        ok = [r for r in rows if "us" in r]
        if ok:
            best[T] = C(**min(ok, key=lambda r: r["us"])["config"])
    if not args.final_only:
        b1 = C(BR=8, KG=4, QX=True, BR2=4, QH=True)          # the T = 1 best so far
        g1 = [b1._replace(BR=br, KG=kg, warps=wp, QX=qx) for br in (4, 8, 16) for kg in (4, 16) for wp in (2, 4)
              for qx in (True, False) if not (kg == 16 and br == 16)]
        g16 = [C(BR=br, KG=4, warps=wp, QX=False, BR2=32, QH=False) for br, wp in ((8, 4), (16, 4), (32, 8))]
        if args.tiny:
            g1, g16 = [C(BR=32, BR2=64), C(BR=32, BR2=64, QX=False)], [C(BR=64, BR2=64, QX=False, QH=False)]
        stage(1, "gate_up", g1)
        stage(16, "gate_up", g16)
        for T in (1, 16):
            bb = best.get(T, C())
            tiles = ((4, 2), (4, 4), (8, 2), (8, 4), (16, 4)) if T == 1 else ((16, 4), (32, 4), (64, 4), (32, 8))
            dn = [bb._replace(BR2=br2, warps2=wp, QH=qh) for qh in (True, False) for br2, wp in tiles
                  if not (T == 16 and qh)]
            dn += [bb._replace(BR2=br2, warps2=wp, QH=qh, PAR=True) for br2, wp, qh in
                   (((2, 4, True), (4, 4, True), (4, 8, True), (8, 8, True), (4, 4, False)) if T == 1
                    else ((8, 4, False), (16, 8, False), (32, 8, False)))]
            stage(T, "down", dn[:1] + dn[-1:] if args.tiny else dn)
        if not args.tiny:
            for T, cfg in best.items():        # each launch alone (the intermediate precomputed)
                x, w, idx = sets[T][0]
                inter = d.gate_up_decode(x, idx, q_gu, s_gu, cfg)
                up = _time(lambda r: d.gate_up_decode(r[0], r[2], q_gu, s_gu, cfg), sets[T], dev)
                down = _time(lambda r: d.down_decode(inter, r[1], r[2], q_dn, s_dn, cfg), sets[T], dev)
                rep["parts"].append({"T": T, "config": cfg._asdict(), "gate_up": up, "down": down})
                log(json.dumps(rep["parts"][-1]))
    rep["best"] = {T: c._asdict() for T, c in best.items()}
    default_max = d.DECODE_MAX_PAIRS = DEFAULT_MAX
    for T in Ts:
        d.DECODE_MAX_PAIRS = default_max
        row: dict[str, Any] = {"T": T, "default_takes_decode": d.uses_decode(T * k)}
        for name, cfg in (("decode_b1", best.get(1)), ("decode_b16", best.get(16)), ("default", None)):
            if name != "default" and cfg is None:
                continue
            d.DECODE_MAX_PAIRS = 10 ** 6 if name != "default" else default_max
            row[name] = _time(lambda r, cfg=cfg: fp8(r, cfg), sets[T], dev, quick=False)
        d.DECODE_MAX_PAIRS = 0
        row["grouped"] = _time(fp8, sets[T], dev, quick=False)
        d.DECODE_MAX_PAIRS = 10 ** 6
        row["bf16"] = _time(lambda r: moe_experts(*r, gu16, dn16), sets[T], dev, quick=False)
        log(json.dumps(row))
        rep["final"].append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"moe_fp8_decode_sweep_{_tag(dev)}.json").write_text(jsonfmt.dumps(rep))
    f = lambda t: f"{t['us']:.1f} [{t['p10_p90'][0]:.1f}–{t['p10_p90'][1]:.1f}]" if "us" in t else t.get("error", "—")  # noqa: E731
    md = [f"# FP8 decode experts sweep ({rep['device']})", "", "| T | decode (T=1 best) | decode (T=16 best) | default "
          "(config(); decode path?) | grouped fp8 | bf16 |", "|---|---|---|---|---|---|"]
    md += [f"| {r['T']} | {f(r.get('decode_b1', {}))} | {f(r.get('decode_b16', {}))} | {f(r['default'])} "
           f"({'decode' if r['default_takes_decode'] else 'grouped'}) | {f(r['grouped'])} | {f(r['bf16'])} |"
           for r in rep["final"]]
    md += ["", f"best: {json.dumps(rep['best'])}", "", "| T | config | gate_up alone µs | down alone µs |", "|---|---|---|---|"]
    md += [f"| {r['T']} | {tuple(r['config'].values())} | {f(r['gate_up'])} | {f(r['down'])} |" for r in rep["parts"]]
    md += ["", "| stage | T | config | µs | rel_err |", "|---|---|---|---|---|"]
    md += [f"| {r['stage']} | {r['T']} | {tuple(r['config'].values())} | {f(r)} | {r.get('rel_err', math.nan):.1e} |"
           for r in sorted(rep["sweep"], key=lambda r: (r["stage"], r["T"], r.get("us", math.inf)))]
    (out / f"moe_fp8_decode_sweep_{_tag(dev)}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
