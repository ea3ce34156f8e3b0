"""Per-step wall time and per-kernel GPU time of the serve benchmark's throughput pass (RFC workload), per mode.

    python -m benchmarks.profile_serve --out /tmp/res/profile_serve.json [--modes none,fused,two_phase]

Uses only bench_serve's make_plan / make_engine / drive and random_model's builders, so the same script runs
against an older checkout (PYTHONPATH=that tree) to compare commits side by side. For each mode: the
latency warm-up (1 group) and two throughput-shaped warm-ups (16 groups each), then one timed pass (per step
wall time, device synchronised around every step) and one profiled pass (torch.profiler, CUDA kernels summed
by name over the pass; ``busy_share``: their sum / the timed pass's wall, issue 26's GPU busy share). Prints JSON
lines and writes the whole result to --out.

``--stub`` (CPU, no device): the host path alone — the CUDA plan's RFC workload (16 groups, 8,192-token steps)
through the prefill / mixed graph path run graph-shaped with the model's forward replaced by zeros, so what is
timed and cProfiled is only the engine's host work per step (scheduling, layout, the fill, sampling, outputs).
"""
from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict

import torch

from benchmarks import jsonfmt
from benchmarks.bench_serve import drive, make_engine, make_plan
from benchmarks.random_model import build_random_model, config_for
from gdnserve.engine.sampling_params import SamplingParams


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_pass(engine, groups, mode: str, params, tag: str) -> dict:
    steps: list[float] = []
    step = engine.step

    def timed():
        _sync()
        t = time.perf_counter()
        out = step()
        _sync()
        steps.append(time.perf_counter() - t)
        return out
    engine.step = timed
    try:
        t0 = time.perf_counter()
        drive(engine, groups, mode, params, tag)
        wall = time.perf_counter() - t0
    finally:
        engine.step = step
    return {"wall_ms": 1e3 * wall, "steps_ms": [round(1e3 * s, 2) for s in steps],
            "qps": sum(len(c) for _, c in groups) / wall}


def watch_mixed(engine) -> list:
    """Record each prefill step's (tokens, segments, longest, decodes, verifies) -> the mixed graph bucket picked
    (or None: eager), when the runner has prefill / mixed graphs."""
    picks: list = []
    g = getattr(engine.runner, "graphs", None)
    if g is None or not hasattr(g, "select_mixed"):
        return picks
    sel = g.select_mixed

    def wrapped(prefills, decodes, verifies=()):
        key = sel(prefills, decodes, verifies)
        lens = [len(it.tokens) for it in prefills]
        picks.append([sum(lens), len(lens), max(lens, default=0), len(decodes), len(verifies), str(key)])
        return key
    g.select_mixed = wrapped
    return picks


def kernel_table(engine, groups, mode: str, params, tag: str, top: int) -> list[tuple[str, int, float]]:
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        drive(engine, groups, mode, params, tag)
        _sync()
    agg: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if not cuda or e.device_type == torch.autograd.DeviceType.CUDA:
            a = agg[e.name[:90]]
            a[0] += 1
            a[1] += e.device_time_total if cuda else e.self_cpu_time_total
    rows = sorted(((n, int(c), round(t, 1)) for n, (c, t) in agg.items()), key=lambda r: -r[2])
    return [("TOTAL", sum(r[1] for r in rows), round(sum(r[2] for r in rows), 1))] + rows[:top]


def stub_engine(mode: str, plan):
    """An engine on the CPU whose graph-shaped forward returns zeros (no model time): the host path alone."""
    from benchmarks.random_model import NullTokenizer, tiny_hf_config
    from gdnserve.engine.execution.mixed_inputs import MixedKey
    from gdnserve.engine.execution.model_runner import RunnerConfig
    from gdnserve.engine.llm_engine import LLMEngine
    model = build_random_model(tiny_hf_config(), torch.device("cpu"), torch.float32)
    rc = RunnerConfig(num_slots=2 * plan.max_num_seqs + 2, num_pages=plan.num_pages, page_size=16,
                      prefill_mode="fused" if mode == "none" else mode, graph_max_tokens=plan.max_step_tokens,
                      cuda_graphs=True, graph_capture=False)
    engine = LLMEngine(model, NullTokenizer(), runner=rc, max_num_seqs=plan.max_num_seqs,
                       max_step_tokens=plan.max_step_tokens, max_model_len=4096, auto_checkpoints=mode != "none")
    g, H = engine.runner.graphs, model.cfg.hidden_size
    g._forward = lambda key: torch.zeros(key.rows if isinstance(key, MixedKey) else key[1] * key[0].L, H)
    return engine, model.cfg.vocab_size


def cpu_pass(engine, groups, mode: str, params, tag: str) -> dict:
    """CPU time (this process only: robust to other processes on the machine) of a pass, by engine phase."""
    acc: dict[str, float] = defaultdict(float)
    saved = []

    def wrap(obj, name: str, label: str):
        fn = getattr(obj, name)
        saved.append((obj, name))

        def timed(*x, **kw):
            t = time.process_time()
            try:
                return fn(*x, **kw)
            finally:
                acc[label] += time.process_time() - t
        setattr(obj, name, timed)
    wrap(engine, "add_request", "add_request")
    wrap(engine.scheduler, "schedule", "schedule")
    wrap(engine.runner, "step", "runner.step")
    wrap(engine, "_sample", "sample")
    wrap(engine, "_process", "process")
    wrap(engine.scheduler, "update_from_output", "update")     # settle + publish + counts (scheduler.py)
    wrap(engine, "_outputs", "outputs")
    t = time.process_time()
    try:
        drive(engine, groups, mode, params, tag)
    finally:
        for obj, name in saved:
            delattr(obj, name)          # the instance attribute set above; the class's method shows again
    acc["total"] = time.process_time() - t
    return {k: round(1e3 * v, 2) for k, v in acc.items()}


def stub_main(a) -> int:
    """``--stub``: host time per step and a cProfile of one throughput pass per mode, forward stubbed out."""
    import cProfile
    import io
    import pstats
    torch.set_num_threads(1)          # the host path is one thread; intra-op threads only add noise here
    plan = make_plan(True, False, None)
    wl = plan.workloads[0]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    res = {"tag": a.tag, "workload": wl.name, "stub": True}
    for mode in a.modes.split(","):
        rng = random.Random(0)
        engine, vocab = stub_engine(mode, plan)
        for i in range(2):
            drive(engine, wl.make_groups(wl.groups, vocab, rng), mode, params, f"wt{i}")
        passes = [timed_pass(engine, wl.make_groups(wl.groups, vocab, rng), mode, params, f"t{i}") for i in range(3)]
        r = sorted(passes, key=lambda x: x["wall_ms"])[1]
        r["cpu_ms"] = cpu_pass(engine, wl.make_groups(wl.groups, vocab, rng), mode, params, "c")
        pr = cProfile.Profile()
        groups = wl.make_groups(wl.groups, vocab, rng)
        pr.enable()
        drive(engine, groups, mode, params, "h")
        pr.disable()
        buf = io.StringIO()
        st = pstats.Stats(pr, stream=buf)
        r["calls"] = st.total_calls
        st.sort_stats("tottime").print_stats(a.top)
        st.sort_stats("cumtime").print_stats(a.top)
        r["host_profile"] = buf.getvalue()
        r["graph_stats"] = dict(engine.runner.graphs.stats)
        res[mode] = r
        print(buf.getvalue() if a.host else "", json.dumps({"tag": a.tag, "mode": mode, "wall_ms": round(r["wall_ms"], 1),
              "steps_ms": r["steps_ms"], "calls": r["calls"], "graph_stats": r["graph_stats"]}), flush=True)
    with open(a.out, "w") as f:
        f.write(jsonfmt.dumps(res))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--modes", default="none,fused,two_phase")
    ap.add_argument("--tag", default="")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--host", action="store_true", help="also cProfile one pass per mode (host time by function)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--stub", action="store_true", help="CPU: the host path alone, the model's forward stubbed out")
    a = ap.parse_args()
    if a.stub:
        return stub_main(a)
    dev = torch.device(a.device)
    plan = make_plan(dev.type == "cuda", False, None)
    wl = plan.workloads[0]
    hf_cfg = config_for(dev, None, None)
    model = build_random_model(hf_cfg, dev, torch.bfloat16)
    vocab = hf_cfg["vocab_size"]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    res = {"tag": a.tag, "workload": wl.name}
    for mode in a.modes.split(","):
        rng = random.Random(0)
        engine = make_engine(model, mode, plan)
        picks = watch_mixed(engine)
        drive(engine, wl.make_groups(1, vocab, rng), mode, params, "w")
        for i in range(2):
            drive(engine, wl.make_groups(wl.groups, vocab, rng), mode, params, f"wt{i}")
        r = timed_pass(engine, wl.make_groups(wl.groups, vocab, rng), mode, params, "t")
        r["kernels"] = kernel_table(engine, wl.make_groups(wl.groups, vocab, rng), mode, params, "p", a.top)
        # issue 26's GPU busy share: the kernels' summed time over a pass of the same groups / the timed pass's
        # wall (the profiled pass's own wall carries the profiler's overhead)
        r["busy_share"] = round(r["kernels"][0][2] / (1e3 * r["wall_ms"]), 3)
        if a.host:
            import cProfile
            import io
            import pstats
            pr = cProfile.Profile()
            pr.enable()
            drive(engine, wl.make_groups(wl.groups, vocab, rng), mode, params, "h")
            _sync()
            pr.disable()
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(35)
            pstats.Stats(pr, stream=buf).sort_stats("cumtime").print_stats(35)
            r["host_profile"] = buf.getvalue()
            print(buf.getvalue(), flush=True)
        g = getattr(engine.runner, "graphs", None)
        r["graph_stats"] = dict(g.stats) if g is not None and hasattr(g, "stats") else None
        r["mixed_picks"] = picks[-8:]
        res[mode] = r
        print(json.dumps({"tag": a.tag, "mode": mode, "qps": round(r["qps"], 1), "busy_share": r["busy_share"],
                          "steps_ms": r["steps_ms"],
                          "graph_stats": r["graph_stats"], "mixed_picks": r["mixed_picks"]}), flush=True)
        for row in r["kernels"][:a.top]:
            print(f"  {a.tag} {mode} {row[2]:>10.1f} us {row[1]:>6d}  {row[0]}")
        del engine
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        f.write(jsonfmt.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
