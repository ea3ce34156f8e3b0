"""Is a request served in a batch equal to the same request served alone? (issue 27's solo check, localised.)

The HTTP benchmark's solo check replays requests of its most concurrent level one at a time and compares the greedy
texts; on the H200 it failed at the first token with margins far past a bf16 rounding flip. This probe runs the
same comparison inside one process, on one random model built once, under engine variants that each switch one
mechanism off (the overlapped loop, CUDA graphs, prefill / mixed graphs, automatic checkpoints, chunking), so the
variant whose batched run equals its solo runs names the mechanism. Per request it reports the first differing
generated token and, at the first generated token, the largest |logprob difference| over the top tokens both
runs list (a rounding flip between batch shapes: ~1e-2 nats; a wrong state: ~1 nat or a token not listed).

    python -m benchmarks.solo_probe --shape full --device cuda --out /tmp/res [--variants default,serial,...]

Writes ``solo_probe_<device>.{md,json}``. The CPU smoke (``--shape tiny --device cpu``) runs in seconds.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import random
import sys
import time
from pathlib import Path

VARIANTS = {
    "default": {},
    "serial": {"overlap": False},
    "no_mixed_graphs": {"mixed_graphs": False},
    "no_graphs": {"cuda_graphs": False},
    "no_auto_ckpt": {"auto_checkpoints": False},
    "no_chunking": {"max_step_tokens": 16384},
    "plain": {"overlap": False, "cuda_graphs": False, "auto_checkpoints": False},
}
TOP = 5


def run_requests(engine, prompts, params):
    ids = [engine.add_request(None, p, params) for p in prompts]
    got: dict[str, object] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                got[o.request_id] = o
    out = []
    for rid in ids:
        o = got[rid]
        if o.error:
            raise RuntimeError(f"request {rid} failed: {o.error}")
        c = o.outputs[0]
        out.append({"tokens": list(c.token_ids), "top0": {int(k): float(v) for k, v in (c.logprobs[0] or {}).items()},
                    "hit": o.checkpoint.hit_length})
    return out


def compare(b: dict, s: dict) -> dict:
    first = next((i for i, (x, y) in enumerate(zip(b["tokens"], s["tokens"])) if x != y), None)
    both = set(b["top0"]) & set(s["top0"])
    d = max((abs(b["top0"][t] - s["top0"][t]) for t in both), default=None)
    return {"first_diff": first, "top0_max_abs": None if d is None else round(d, 5), "shared_top": len(both),
            "hit_batched": b["hit"], "hit_solo": s["hit"]}


def main(argv: list[str] | None = None) -> int:
    import torch

    from benchmarks import jsonfmt
    from benchmarks.random_model import build_random_model
    from benchmarks.serve_random import CharTokenizer, random_hf_config
    from gdnserve.engine.config import EngineConfig
    from gdnserve.engine.execution.model_runner import ModelRunner
    from gdnserve.engine.llm_engine import LLMEngine
    from gdnserve.engine.sampling_params import SamplingParams
    from gdnserve.models.config import ModelConfig
    from gdnserve.models.loader import quantize_model_fp8_
    ap = argparse.ArgumentParser(prog="python -m benchmarks.solo_probe")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", choices=["full", "bench", "tiny"], default="full")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--lens", default="8192,4097,1000,63,8192,2000,64,5000", help="prompt lengths, cycled")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--solo", type=int, default=4, help="requests replayed alone per variant")
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=9216)
    ap.add_argument("--time-budget", type=float, default=1e9)
    ap.add_argument("--dtype", default=None, help="the served model's dtype (default bfloat16 on CUDA)")
    ap.add_argument("--ref", action="store_true", help="also the same weights in float32, served plainly: the "
                    "distance of batched and of alone from it tells rounding (both near) from a wrong state")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    dev = torch.device(a.device)
    dt = getattr(torch, a.dtype) if a.dtype else torch.bfloat16 if dev.type == "cuda" else torch.float32
    hf = random_hf_config(a.shape)
    net = build_random_model(hf, dev, dt, 0)
    net32 = copy.deepcopy(net).float() if a.ref else None
    if a.fp8:
        quantize_model_fp8_(net)
    V = ModelConfig.from_hf(hf).vocab_size
    lens = [int(x) for x in a.lens.split(",")]
    if a.shape == "tiny":
        lens = [min(n, 300) for n in lens]
    rnd = random.Random(1)
    prompts = [[rnd.randrange(V) for _ in range(lens[i % len(lens)])] for i in range(a.requests)]
    solo_idx = sorted(range(a.requests), key=lambda i: -len(prompts[i]))[:a.solo]
    params = SamplingParams(temperature=0.0, max_tokens=a.gen, ignore_eos=True, logprobs=TOP)
    pages = -(-(a.max_model_len + 16) // 16) * (a.max_num_seqs + 2)
    rows, ref_solo = [], None
    for name in a.variants.split(","):
        if time.perf_counter() - t0 > a.time_budget:
            rows.append({"variant": name, "skipped": "time budget"})
            continue
        kw = dict(VARIANTS[name])
        mixed = kw.pop("mixed_graphs", True)
        cfg = EngineConfig(max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len, num_pages=pages,
                           num_slots=2 * a.max_num_seqs + 2, **kw)

        def factory(model, rc, pools, mixed=mixed):
            return ModelRunner(model, dataclasses.replace(rc, mixed_graphs=mixed), pools=pools)
        t = time.perf_counter()
        try:
            engine = LLMEngine(net, CharTokenizer(V), cfg, runner_factory=factory)
            batched = run_requests(engine, prompts, params)
            solo = [run_requests(engine, [prompts[i]], params)[0] for i in solo_idx]
            fresh = LLMEngine(net, CharTokenizer(V), cfg.with_(auto_checkpoints=False),
                              runner_factory=factory) \
                if cfg.auto_checkpoints else engine
            if fresh is not engine:
                engine.close()
            del engine
            solo_fresh = [run_requests(fresh, [prompts[i]], params)[0] for i in solo_idx]
            fresh.close()
            del fresh
        except Exception as e:  # noqa: BLE001 - a variant that fails is a row, not the end of the probe
            rows.append({"variant": name, "error": f"{type(e).__name__}: {e}"[:400]})
            continue
        finally:
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        ref_solo = ref_solo or solo_fresh
        row = {"variant": name, "seconds": round(time.perf_counter() - t, 1),
               "batched_vs_solo": [compare(batched[i], s) for i, s in zip(solo_idx, solo)],
               "batched_vs_fresh_solo": [compare(batched[i], s) for i, s in zip(solo_idx, solo_fresh)],
               "solo_vs_fresh_solo": [compare(s, f) for s, f in zip(solo, solo_fresh)],
               "fresh_solo_vs_default_fresh_solo": [compare(f, r) for f, r in zip(solo_fresh, ref_solo)]}
        rows.append({**row, "batched": batched, "solo_fresh": solo_fresh})
        print(json.dumps(row), flush=True)
    if net32 is not None:       # float32 on the PyTorch path (the Triton MoE kernels' tiles are sized for 16-bit)
        del net
        gc.collect()
        cfg = EngineConfig(max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len, num_pages=pages,
                           num_slots=2 * a.max_num_seqs + 2, backend="torch", **VARIANTS["plain"])
        e32 = LLMEngine(net32, CharTokenizer(V), cfg)
        b32 = run_requests(e32, prompts, params)
        s32 = [run_requests(e32, [prompts[i]], params)[0] for i in solo_idx]
        e32.close()
        served = next((r for r in rows if "batched" in r), None)
        row = {"variant": "float32 reference", "fp32_batched_vs_fp32_alone": [compare(b32[i], s) for i, s in
                                                                           zip(solo_idx, s32)]}
        if served is not None:
            row["served_batched_vs_fp32_alone"] = [compare(served["batched"][i], s) for i, s in zip(solo_idx, s32)]
            row["served_alone_vs_fp32_alone"] = [compare(x, s) for x, s in zip(served["solo_fresh"], s32)]
        rows.append(row)
        print(json.dumps(row), flush=True)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    res = {"device": name, "torch": torch.__version__, "shape": a.shape, "fp8": a.fp8, "dtype": str(dt), "lens": [len(p) for p in prompts],
           "solo_idx": solo_idx, "gen": a.gen, "argv": sys.argv[1:] if argv is None else argv, "rows": rows}
    tag = "h200" if "H200" in name else dev.type
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"solo_probe_{tag}.json").write_text(jsonfmt.dumps(res))

    def cell(cs):
        eq = sum(c["first_diff"] is None for c in cs)
        d = [c["top0_max_abs"] for c in cs]
        return f"{eq}/{len(cs)} equal; first diff {[c['first_diff'] for c in cs]}; top-{TOP} max abs {d}"
    L = [f"# Batched vs alone — {name}", "", f"`python -m benchmarks.solo_probe {' '.join(res['argv'])}`; torch "
         f"{torch.__version__}; prompts {res['lens']}; alone: requests {solo_idx}; {a.gen} greedy tokens.", "",
         "| variant | batched vs alone (same engine) | batched vs alone (fresh engine, no checkpoints) | alone vs fresh "
         "alone | fresh alone vs default's |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["variant"] == "float32 reference":
            L += ["", "Float32 reference (the same weights in float32, served plainly): "
                  f"float32 batched vs float32 alone: {cell(r['fp32_batched_vs_fp32_alone'])}"]
            if "served_batched_vs_fp32_alone" in r:
                L += [f"served batched vs float32 alone: {cell(r['served_batched_vs_fp32_alone'])}",
                      f"served alone vs float32 alone: {cell(r['served_alone_vs_fp32_alone'])}"]
            continue
        if "batched_vs_solo" not in r:
            L.append(f"| {r['variant']} | {r.get('error') or r.get('skipped')} | | | |")
            continue
        L.append(f"| {r['variant']} | {cell(r['batched_vs_solo'])} | {cell(r['batched_vs_fresh_solo'])} | "
                 f"{cell(r['solo_vs_fresh_solo'])} | {cell(r['fresh_solo_vs_default_fresh_solo'])} |")
    (a.out / f"solo_probe_{tag}.md").write_text("\n".join(L) + "\n")
    print("\n".join(L))
    return 0


if __name__ == "__main__":
    sys.exit(main())
