"""Where an engine pass's time goes, step by step: the full-size random model served as ``serve_random`` builds it
(same flags: speculative decoding, the MTP oracle, FP8), N requests of P random tokens submitted at once, G tokens
each (``ignore_eos``), every ``LLMEngine.step()`` timed with the device synchronised, and inside it the runner's
forward (``ModelRunner.step``, synchronised too): host time = engine step - forward. Steps are grouped by what
they ran (prefill tokens, decodes, verifies) and by graph use (replay / eager / fallback counts).

    python -m benchmarks.step_trace --out /tmp/res [--requests 16 --prompt 8192 --output 64]
        [--spec-k 3 --spec-draft mtp --spec-oracle 0.6] [--fp8] [--max-step-tokens 4096]

Writes ``step_trace_<device>.md`` (a diagnostic, cited by commit and command; not a tracked benchmark).
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path


def kind_of(prefill_tokens: int, decodes: int, verifies: int) -> str:
    parts = (["prefill"] if prefill_tokens else []) + (["decode"] if decodes else []) + (["verify"] if verifies else [])
    return "+".join(parts) or "empty"


def main(argv: list[str] | None = None) -> int:
    import torch

    from benchmarks.serve_random import load_random_engine
    from gdnserve.engine.config import EngineConfig
    from gdnserve.engine.sampling_params import SamplingParams
    ap = argparse.ArgumentParser(prog="python -m benchmarks.step_trace")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", choices=["full", "bench", "tiny"], default="full")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=9216)
    ap.add_argument("--max-step-tokens", type=int, default=4096)
    ap.add_argument("--spec-k", type=int, default=0)
    ap.add_argument("--spec-draft", default="ngram")
    ap.add_argument("--spec-oracle", type=float, default=None)
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--show", type=int, default=40, help="steps listed one by one")
    ap.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                    help="skip the server's start-up warm-up (LLMEngine.warm_up): first-use captures in the trace")
    a = ap.parse_args(argv)
    cfg = EngineConfig(max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len, max_step_tokens=a.max_step_tokens,
                       spec_k=a.spec_k, spec_draft=a.spec_draft)
    t0 = time.perf_counter()
    engine = load_random_engine(None, dtype=None, device=a.device, config=cfg, shape=a.shape, fp8=a.fp8, seed=0,
                                spec_oracle=a.spec_oracle)
    dev = engine.runner.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    build_s = time.perf_counter() - t0
    warm = engine.warm_up() if a.warm_up else "skipped (--no-warm-up)"
    runner, graphs = engine.runner, engine.runner.graphs
    record: list[dict] = []
    real_step = runner.step

    def timed(prefills, decodes, verifies=(), **kw):
        sync()
        t = time.perf_counter()
        g0 = Counter(graphs.stats) if graphs is not None else Counter()
        out = real_step(prefills, decodes, verifies=verifies, **kw)
        sync()
        g1 = Counter(graphs.stats) if graphs is not None else Counter()
        record.append({"fwd_ms": 1e3 * (time.perf_counter() - t), "prefill": sum(len(it.tokens) for it in prefills),
                       "items": len(prefills), "decodes": len(decodes), "verifies": len(verifies),
                       "graph": ",".join(sorted(k for k in g1 if g1[k] > g0[k])) or "-"})
        return out
    runner.step = timed
    compiles: list[str] = []          # Triton JIT compiles (its cache hook: before each compile), kernel + signature
    try:
        from triton import knobs

        def hook(*_, **kw):
            compiles.append(kw.get("repr", "?"))
            return None
        knobs.runtime.jit_cache_hook = hook
    except (ImportError, AttributeError):
        pass
    V = engine.runner.model.cfg.vocab_size
    rnd = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=a.output, ignore_eos=True)
    for _ in range(a.requests):
        engine.add_request(None, [rnd.randrange(V) for _ in range(a.prompt)], params)
    steps = []
    t_all = time.perf_counter()
    while engine.has_unfinished():
        sync()
        t = time.perf_counter()
        n, c = len(record), len(compiles)
        engine.step()
        sync()
        ms = 1e3 * (time.perf_counter() - t)
        r = record[n] if len(record) > n else {"fwd_ms": 0.0, "prefill": 0, "items": 0, "decodes": 0, "verifies": 0,
                                                 "graph": "-"}
        steps.append({**r, "step_ms": ms, "compiles": compiles[c:]})
    wall = time.perf_counter() - t_all
    st = engine.counts
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for s in steps:
        groups[(kind_of(s["prefill"], s["decodes"], s["verifies"]), s["graph"])].append(s)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    L = [f"# Engine step trace — {name}", "",
         f"`python -m benchmarks.step_trace {' '.join(sys.argv[1:] if argv is None else argv)}`; torch {torch.__version__}; model "
         f"built in {build_s:.1f} s; warm-up: {warm or 'nothing to warm'}. {a.requests} requests x {a.prompt} prompt tokens, {a.output} generated each "
         f"(spec k={a.spec_k} {a.spec_draft} oracle {a.spec_oracle}); {len(steps)} steps in {wall:.2f} s; "
         f"generated {st.tokens_generated}, drafted {st.spec_drafted}, accepted {st.spec_accepted}.", "",
         "| step kind | graph | steps | step ms p50 | forward ms p50 | host ms p50 (step - forward) | total s | "
         "prefill tokens | rows/step p50 |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (k, g), ss in sorted(groups.items(), key=lambda kv: -sum(s["step_ms"] for s in kv[1])):
        med = lambda f: statistics.median(f(s) for s in ss)  # noqa: E731
        L.append(f"| {k} | {g} | {len(ss)} | {med(lambda s: s['step_ms']):.2f} | {med(lambda s: s['fwd_ms']):.2f} | "
                 f"{med(lambda s: s['step_ms'] - s['fwd_ms']):.2f} | {sum(s['step_ms'] for s in ss) / 1e3:.2f} | "
                 f"{sum(s['prefill'] for s in ss)} | {med(lambda s: s['decodes'] + s['verifies']):.0f} |")
    L += ["", f"First {a.show} steps:", "", "| # | step ms | forward ms | prefill tokens (items) | decodes | verifies | "
          "graph | Triton compiles |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for i, s in enumerate(steps[:a.show]):
        L.append(f"| {i} | {s['step_ms']:.2f} | {s['fwd_ms']:.2f} | {s['prefill']} ({s['items']}) | {s['decodes']} | "
                 f"{s['verifies']} | {s['graph']} | {len(s['compiles'])} |")
    late = [(i, c) for i, s in enumerate(steps) for c in s["compiles"]]
    L += ["", f"Triton compiles during the pass: {len(late)} (kernel and specialisation, first 400 characters):", ""]
    L += [f"- step {i}: `{c[:400]}`" for i, c in late[:80]]
    a.out.mkdir(parents=True, exist_ok=True)
    tag = "cuda" if dev.type == "cuda" else "cpu"
    (a.out / f"step_trace_{tag}{'_mtp' if a.spec_draft == 'mtp' and a.spec_k else ''}.md").write_text("\n".join(L) + "\n")
    print("\n".join(L[:40]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
