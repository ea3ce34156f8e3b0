"""What the engine adds to a decode step: ``LLMEngine.step()`` against a bare replay of the same step (issue 26).

The full-size Qwen3.5-35B-A3B shapes with random weights (``--shape full``, CUDA; ``tiny`` on CPU for a smoke
run). For each batch B: B requests of P random prompt tokens, G greedy tokens each (``ignore_eos``), submitted at
once to ``LLMEngine`` (the path the HTTP server drives), after a warm-up pass of the same shapes (graph captures,
compiles). Per row:

- ``engine_ms``: the median wall time between consecutive returns of ``engine.step()`` in the steady decode
  phase (every request decoding) of a pass with no synchronisation between steps: the step time a client sees.
  Serial, that is the GPU step plus the host work around it; overlapped (``--overlap``), the host work of step
  n + 1 runs while step n is on the GPU, so it is the larger of the two;
- ``synced_ms``: the same steps with the device synchronised before and after each (host and GPU work both
  inside, nothing overlapping: the issue's original measurement);
- ``replay_ms``: the median of the same decode step run bare (``ModelRunner.step`` on B sequences of P tokens, no
  scheduler, no sampling beyond argmax, no output processing: ``bench_model``'s decode measurement; a graph
  replay where graphs are on), on the same engine's runner and pools, in the same run;
- ``ratio`` = engine / replay (goal <= 1.03), P10-P90 of each, and ``pass_out_tok_s``: the output tokens/s of a
  whole pass (prefill + decode) with no synchronisation between steps, the throughput a client sees.

Each batch runs with the serial loop and with the overlapped one (``loop`` = "serial" / "overlap") on one engine
(its graphs captured once), same model, same run.

    python -m benchmarks.bench_engine_overhead --device cuda --out benchmarks/results     # B = 1, 64, 256
    python -m benchmarks.bench_engine_overhead --quick                                   # CPU smoke

Writes ``engine_overhead_<device>.json`` (rows ``{"batch", "engine_ms", "replay_ms", ...}``) and ``.md``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import jsonfmt
from benchmarks.bench_model import Plan, ours_decode
from benchmarks.e2e_report import sync, timed
from benchmarks.random_model import NullTokenizer, build_random_model, config_for
from benchmarks.timing import percentiles
from gdnserve.cli import DEFAULT_RESULTS
from gdnserve.engine.config import EngineConfig
from gdnserve.engine.llm_engine import LLMEngine
from gdnserve.engine.sampling_params import SamplingParams


def engine_pass(eng: LLMEngine, B: int, P: int, G: int, vocab: int, rng: random.Random, dev: torch.device,
                synced: bool) -> tuple[float, list[float]]:
    """One pass of B requests; returns (wall s, per-step s): each step's synchronised wall time when ``synced``,
    else the time between consecutive returns of ``step()``."""
    sp = SamplingParams(temperature=0.0, max_tokens=G, ignore_eos=True)
    for _ in range(B):
        eng.add_request(None, [rng.randrange(vocab) for _ in range(P)], sp)
    steps: list[float] = []
    sync(dev)
    t0 = last = time.perf_counter()
    while eng.has_unfinished():
        if synced:
            steps.append(timed(eng.step, dev)[1])
        else:
            eng.step()
            now = time.perf_counter()
            steps.append(now - last)
            last = now
    sync(dev)
    return time.perf_counter() - t0, steps


def measure(model, B: int, P: int, G: int, dev: torch.device, max_num_seqs: int) -> list[dict[str, Any]]:
    """One engine (graphs captured once), the serial loop then the overlapped one (``LLMEngine.overlap`` switched
    while idle), each after a warm-up pass; one bare measurement beside both."""
    vocab = model.cfg.vocab_size
    pages = max_num_seqs * (-(-(P + G) // 16) + 2) + 64
    cfg = EngineConfig(max_num_seqs=max_num_seqs, max_step_tokens=8192, max_model_len=P + G + 16, num_pages=pages,
                       num_slots=max_num_seqs + 2, auto_checkpoints=False, overlap=False)
    eng = LLMEngine(model, NullTokenizer(), cfg)
    rng = random.Random(B)
    runs = {}
    for overlap in (False, True):
        eng.overlap = overlap
        engine_pass(eng, B, P, G, vocab, rng, dev, synced=True)             # warm-up: captures, compiles
        _, steps = engine_pass(eng, B, P, G, vocab, rng, dev, synced=True)
        wall, gaps = engine_pass(eng, B, P, G, vocab, rng, dev, synced=False)
        # the steady decode phase: every request decoding (the last G - 1 steps), less the last few (the
        # overlapped loop's final steps only drain what is in flight)
        dec = gaps[-(G - 1):]
        runs[overlap] = (steps[-(G - 1):], dec[:-4] if len(dec) > 8 else dec, wall)
    # the same decode step bare: bench_model's measurement, on this engine's runner and pools
    r = percentiles(ours_decode(eng.runner, B, Plan((), (B,), P, 3, max(8, G // 2), 0.0), dev)["times"])
    eng.close()         # unbinds the shared model from this engine's pools: bound, its layers kept them alive, and
    del eng             # on the H200 the next batch's engine found 19.3 GiB in use and its memory plan refused it
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    ms = lambda v: round(v * 1e3, 3)
    rows = []
    for overlap, (synced, dec, wall) in runs.items():
        e, y = percentiles(dec), percentiles(synced)
        rows.append({"batch": B, "loop": "overlap" if overlap else "serial", "prompt": P, "generated": G,
                     "engine_ms": ms(e["p50"]), "replay_ms": ms(r["p50"]), "ratio": round(e["p50"] / r["p50"], 3),
                     "synced_ms": ms(y["p50"]), "engine_p10_p90_ms": [ms(e["p10"]), ms(e["p90"])],
                     "synced_p10_p90_ms": [ms(y["p10"]), ms(y["p90"])],
                     "replay_p10_p90_ms": [ms(r["p10"]), ms(r["p90"])], "decode_steps": len(dec),
                     "pass_s": round(wall, 3), "pass_out_tok_s": round(B * G / wall, 1)})
    return rows


def markdown(res: dict[str, Any]) -> str:
    out = [f"# Engine overhead per decode step — {res['device']}", "",
           (f"Code {res['git']}, {res['date']}, torch {res.get('torch')}, triton {res.get('triton')}; model "
           f"{res['model']}; command `{' '.join(res['argv'])}`. Definitions: benchmarks/bench_engine_overhead.py."),
           "", "| B | loop | engine step ms (P10–P90) | synced step ms (P10–P90) | bare step ms (P10–P90) | engine / bare | "
           "whole pass out tok/s |", "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        out.append(f"| {r['batch']} | {r['loop']} | {r['engine_ms']} ({r['engine_p10_p90_ms'][0]}–"
                   f"{r['engine_p10_p90_ms'][1]}) | {r['synced_ms']} ({r['synced_p10_p90_ms'][0]}–"
                   f"{r['synced_p10_p90_ms'][1]}) | "
                   f"{r['replay_ms']} ({r['replay_p10_p90_ms'][0]}–{r['replay_p10_p90_ms'][1]}) | "
                   f"{r['ratio']}x | {r['pass_out_tok_s']} |")
    out += ["", "Goal (issue 26): engine <= 1.03x bare at every batch.", ""]
    if res["errors"]:
        out += ["Errors: " + "; ".join(res["errors"]), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--shape", choices=["full", "bench", "tiny"], default=None)
    ap.add_argument("--batches", default=None, help="comma-separated B (default 1,64,256; CPU 1,4)")
    ap.add_argument("--prompt", type=int, default=None, help="P (default 512; CPU 16)")
    ap.add_argument("--generated", type=int, default=None, help="G (default 64; CPU 6)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=DEFAULT_RESULTS)
    args = ap.parse_args(argv)
    from benchmarks.bench_ops import (
        _git,
        _versions,
        device_name,
        device_slug,
        resolve_device,
    )
    dev = resolve_device("cpu" if args.quick and args.device == "auto" else args.device)
    cuda = dev.type == "cuda"
    shape = args.shape or ("full" if cuda else "tiny")
    batches = [int(x) for x in (args.batches or ("1,64,256" if cuda else "1,4")).split(",")]
    P, G = args.prompt or (512 if cuda else 16), args.generated or (64 if cuda else 6)
    hf = config_for(dev, None, None, full=True) if shape == "full" else config_for(dev, None, None) \
        if shape == "bench" else config_for(torch.device("cpu"), None, None)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build_random_model(hf, dev, dtype)
    git = _git() or {}
    res: dict[str, Any] = {"schema": 1, "bench": "engine_overhead", "device": device_name(dev),
                           "date": _dt.date.today().isoformat(), **_versions(),
                           "git": f"{git.get('commit', '?')}{' dirty' if git.get('dirty') else ''}",
                           "argv": ["bench_engine_overhead", *(sys.argv[1:] if argv is None else argv)],
                           "model": f"random {shape} ({hf['num_hidden_layers']} layers, {hf.get('num_experts')} "
                                    f"experts), {str(dtype).removeprefix('torch.')}",
                           "rows": [], "errors": []}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"engine_overhead_{device_slug(dev)}"
    for B in batches:
        try:
            for row in measure(model, B, P, G, dev, max(batches)):
                res["rows"].append(row)
                print(f"[engine_overhead] B={B} {row['loop']}: engine {row['engine_ms']} ms (synced "
                      f"{row['synced_ms']}), bare {row['replay_ms']} ms, {row['ratio']}x, pass "
                      f"{row['pass_out_tok_s']} out tok/s", file=sys.stderr, flush=True)
        except Exception as e:  # noqa: BLE001  recorded; the other rows still run
            res["errors"].append(f"B={B}: {type(e).__name__}: {e}"[:500])
        stem.with_suffix(".json").write_text(jsonfmt.dumps(res))
        stem.with_suffix(".md").write_text(markdown(res))
    print(markdown(res))
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
