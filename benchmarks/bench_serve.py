"""End-to-end serving of shared-prefix groups through ``LLMEngine`` (offline, no HTTP): queries per second
and time to first token with checkpoints (``prefill_mode=fused``, ``two_phase``) and without.

Run ``gdnserve bench serve`` or ``python -m benchmarks.bench_serve`` (options: --device, --quick, --out,
--layers, --experts, --groups, --max-tokens, --time-budget; ``python -m`` also takes --tensor-parallel-size N:
N ranks, each building its shard of the random model, ``benchmarks/tp_model.py``; modes none, fused and score,
eager steps). Writes ``serve_<device>_<date>.json`` / ``.md``.

Model: ``benchmarks/random_model.py`` (Qwen3.5-35B-A3B shapes, 8 layers, 64 experts, bf16 on CUDA; tiny
fp32 on CPU). Prompts are random token ids; the engine gets them as ids with ``checkpoint_at`` = the
prefix length — what the HTTP server sends after stripping a ``<|state_checkpoint|>`` marker — so the
engine's real admission path runs: the group's first request becomes the producer of the prefix, the
others join it in the same step as consumers (or hit its READY checkpoint later).

Workloads (CUDA): **RFC** — groups of one shared prefix of 600 tokens + 10 requests with distinct suffixes
of 16–32 tokens (~624 tokens each: 1 anchor + 9 candidates); **1P2048+16C64** — one prefix of 2,048
tokens + 16 candidates of 64. Each request generates ``--max-tokens`` greedy tokens (default 1, score-like).

Modes: ``fused`` and ``two_phase`` — requests carry ``checkpoint_at``, automatic checkpoints on (the
engine default); ``none`` — no ``checkpoint_at``, automatic checkpoints off: every request prefilled in
full. ``score`` (RFC and 1P2048 rows, fused engine) — one score job per group (``engine.add_score(prefix,
candidates)``, the structured API: candidate log-probs, no token generated), scheduled like every other
request: the throughput pass submits all groups at once and the engine batches them.

CUDA graphs (the runner's default on CUDA): decode steps and, in ``fused`` / ``none`` / ``score`` modes,
prefill and mixed steps replay bucketed graphs (docs/serving.md § CUDA graphs; ``two_phase`` prefills run
eagerly: two launch groups). Each row counts its pass's steps as replays / eager steps and the captures
that happened in it (``graphs`` in the JSON; ``warmup_graphs`` for the warm-up pass): after warm-up a step
that meets a bucket the warm-up did not is captured then.

Two passes per mode: **latency** — one group at a time on an idle engine (TTFT without queueing);
**throughput** — all groups submitted at once, the engine batching them back to back. QPS = requests
(candidates) per second over the wall time of the pass; groups/s also given. TTFT = time from
submission to the step that returns the request's first token (its median and P90).

Warm-up: every timed pass is preceded, on the same engine, by an untimed pass of the same shape on other
prompts of the same lengths — one group before the latency pass (each latency call is one group), all
``groups`` groups at once before the throughput pass — so Triton compilation and autotuning for the step
shapes of that pass (token counts, producer/consumer layouts) land outside the timing. Each row records its
warm-up's wall time and steps (``warmup_wall_s``, ``warmup_steps``) beside the timed pass's. Sanity columns: checkpoint hits (requests whose provenance says they started
from the prefix state) and the share of first tokens equal to the ``none`` mode's on the same prompts.
"""
from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.e2e_report import Report, model_summary, pct, run_cli
from benchmarks.random_model import NullTokenizer, build_random_model, config_for
from gdnserve.engine.config import EngineConfig
from gdnserve.engine.execution.model_runner import RunnerConfig
from gdnserve.engine.llm_engine import LLMEngine
from gdnserve.engine.sampling_params import SamplingParams

MODES = ("none", "fused", "two_phase", "score")   # none first: the reference of the agreement column
Group = tuple[list[int], list[list[int]]]       # (prefix ids, candidate suffix ids)


@dataclass(frozen=True)
class Workload:
    name: str
    prefix: int
    candidates: int
    suffix: tuple[int, int]       # suffix length range (inclusive)
    groups: int                   # groups in the throughput pass
    latency_groups: int           # groups run one at a time

    def make_groups(self, n: int, vocab: int, rng: random.Random) -> list[Group]:
        ids = lambda k: [rng.randrange(vocab) for _ in range(k)]  # noqa: E731
        return [(ids(self.prefix), [ids(rng.randint(*self.suffix)) for _ in range(self.candidates)])
                for _ in range(n)]


@dataclass(frozen=True)
class Plan:
    workloads: tuple[Workload, ...]
    max_step_tokens: int
    max_num_seqs: int
    num_pages: int
    tp_passes: int = 3            # timed throughput passes (distinct prompts, same shape): the row is the median
    tp_warmups: int = 2           # throughput-shaped warm-up passes before them


def make_plan(cuda: bool, quick: bool, groups: int | None) -> Plan:
    if cuda:
        wl = (Workload("RFC 1P600+10C(16-32)", 600, 10, (16, 32), 16, 4),
              Workload("1P2048+16C64", 2048, 16, (64, 64), 4, 2))
        plan = Plan(wl, 8192, 256, 16384)
    else:
        wl = (Workload("RFC-tiny 1P48+10C(2-6)", 48, 10, (2, 6), 3, 1),
              Workload("1P96+16C8", 96, 16, (8, 8), 1, 1))
        plan = Plan(wl, 1024, 64, 2048)
    if quick:
        wl = tuple(replace(w, groups=max(1, w.groups // 2), latency_groups=1) for w in plan.workloads)
        plan = replace(plan, workloads=wl, tp_passes=1, tp_warmups=1)
    if groups:
        plan = replace(plan, workloads=tuple(replace(w, groups=groups) for w in plan.workloads))
    return plan


def engine_config(plan: Plan, mode: str, spec_k: int = 0) -> EngineConfig:
    """The engine of ``mode`` (``make_engine``'s; bench_tp's sessions build theirs from it too)."""
    rc = RunnerConfig(num_slots=2 * plan.max_num_seqs + 2, num_pages=plan.num_pages, page_size=16,
                      prefill_mode="fused" if mode in ("none", "score") else mode,
                      graph_max_tokens=plan.max_step_tokens)
    return EngineConfig.from_runner(rc, max_num_seqs=plan.max_num_seqs, max_step_tokens=plan.max_step_tokens,
                                    max_model_len=4096, auto_checkpoints=mode != "none", spec_k=spec_k or None)


def make_engine(model, mode: str, plan: Plan) -> LLMEngine:
    return LLMEngine(model, NullTokenizer(), engine_config(plan, mode))


GRAPH_STATS = ("replay", "mixed_replay", "eager", "mixed_eager", "mixed_verify", "fallback", "capture")


def graph_counts(engine: LLMEngine) -> dict[str, int] | None:
    """The runner's CUDA-graph counters (cuda_graphs.py StepGraphs.stats), None without graphs."""
    g = engine.runner.graphs
    return None if g is None else {k: g.stats[k] for k in GRAPH_STATS}


def counted(fn):
    """``fn(engine, ...)``'s result with ``graphs``: how its steps ran (replays, graph-shaped eager, ordinary
    eager fallbacks, captures), the difference of the counters around the call (None without graphs)."""
    def wrapped(engine: LLMEngine, *a, **kw) -> dict[str, Any]:
        before = graph_counts(engine)
        r = fn(engine, *a, **kw)
        after = graph_counts(engine)
        r["graphs"] = None if after is None else {k: v - before[k] for k, v in after.items()}
        return r
    return wrapped


@counted
def drive(engine: LLMEngine, groups: list[Group], mode: str, params: SamplingParams, tag: str) -> dict[str, Any]:
    """Submit every request of ``groups`` now and step the engine until all have finished."""
    t_sub: dict[str, float] = {}
    ttft: dict[str, float] = {}
    first: dict[str, int] = {}
    hits = steps = 0
    t0 = time.perf_counter()
    for g, (prefix, cands) in enumerate(groups):
        for j, suffix in enumerate(cands):
            rid = f"{tag}g{g}c{j}"
            engine.add_request(rid, prefix + suffix, params, None if mode == "none" else len(prefix))
            t_sub[rid] = time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        steps += 1
        for o in outs:
            if o.request_id not in ttft and o.outputs[0].token_ids:
                ttft[o.request_id] = now - t_sub[o.request_id]
                first[o.request_id.removeprefix(tag)] = o.outputs[0].token_ids[0]
                hits += o.checkpoint.hit_length > 0
    return {"wall_s": time.perf_counter() - t0, "ttft_s": list(ttft.values()), "first": first, "hits": hits,
            "steps": steps}


@counted
def drive_score(engine: LLMEngine, groups: list[Group]) -> dict[str, Any]:
    """One score job per group, all submitted now and scheduled together (like the other modes' requests);
    'TTFT' = each job's latency from submission to its result."""
    t0 = time.perf_counter()
    t_sub, lat = {}, {}
    for prefix, cands in groups:
        rid = engine.add_score(prefix, cands)
        t_sub[rid] = time.perf_counter()
    steps = 0
    while len(lat) < len(t_sub):
        engine.step()
        steps += 1
        now = time.perf_counter()
        for rid in t_sub:
            if rid not in lat and engine.take_score(rid) is not None:
                lat[rid] = now - t_sub[rid]
    n = sum(len(c) for _, c in groups)
    return {"wall_s": time.perf_counter() - t0, "ttft_s": list(lat.values()), "first": {}, "hits": n, "steps": steps}


def _row(wl: Workload, mode: str, pass_: str, groups: list[Group], r: dict[str, Any],
         ref_first: dict[str, int] | None, warm: dict[str, Any] | None = None, warm_groups: int = 0
         ) -> dict[str, Any]:
    n = sum(len(c) for _, c in groups)
    tok = sum(len(p) + len(s) for p, c in groups for s in c) if mode == "none" else \
        sum(len(p) + sum(map(len, c)) for p, c in groups)
    agree = None
    if ref_first and r["first"]:
        same = [r["first"][k] == ref_first[k] for k in r["first"] if k in ref_first]
        agree = sum(same) / len(same) if same else None
    return {"workload": wl.name, "mode": mode, "pass": pass_, "groups": len(groups), "requests": n,
            "wall_s": r["wall_s"], "qps": n / r["wall_s"], "groups_per_s": len(groups) / r["wall_s"],
            "qps_range": [n / max(r["pass_walls_s"]), n / min(r["pass_walls_s"])] if r.get("pass_walls_s") else None,
            "ttft_ms": pct([t * 1e3 for t in r["ttft_s"]]), "hits": r["hits"], "steps": r["steps"],
            "prefill_tokens": tok, "first_token_agreement_vs_none": agree,
            "warmup_groups": warm_groups, "warmup_wall_s": None if warm is None else warm["wall_s"],
            "warmup_steps": None if warm is None else warm["steps"], "graphs": r.get("graphs"),
            "warmup_graphs": None if warm is None else warm.get("graphs")}


def median_pass(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """The pass of median wall time, with every pass's wall time in ``pass_walls_s``. Its ``first`` tokens are
    the first pass's: every mode runs the same prompt sets in the same order, so the agreement column compares
    the same prompts."""
    order = sorted(range(len(passes)), key=lambda i: passes[i]["wall_s"])
    r = dict(passes[order[len(order) // 2]])
    r["pass_walls_s"] = [p["wall_s"] for p in passes]
    r["first"] = passes[0]["first"]          # the first pass's tokens: the same prompts in every mode
    return r


def _range(r: dict[str, Any]) -> str:
    q = r.get("qps_range")
    return f" [{q[0]:.0f}–{q[1]:.0f}]" if q else ""


def graph_cell(g: dict[str, int] | None) -> str:
    """'replays / eager steps (captures)' of a pass: replays of decode/verify + prefill/mixed graphs; eager =
    ordinary eager steps + graph-shaped eager ones (CPU)."""
    if not g:
        return "—"
    rep, eager = g["replay"] + g["mixed_replay"], g["fallback"] + g["eager"] + g["mixed_eager"]
    return f"{rep} / {eager}" + (f" ({g['capture']} cap.)" if g["capture"] else "")


def table(res: dict[str, Any]) -> list[str]:
    L = [res.get("model_summary", ""), "", f"Engine: {res.get('engine')}.", "",
         "QPS = requests per second over the pass's wall time (groups/s beside it; the throughput pass: the median of "
         f"{res.get('tp_passes', 1)} passes on distinct prompts of the same shape, [slowest–fastest] beside it); TTFT ms: median and P90 "
         "from submission to the step returning the first token. latency = one group at a time on an idle engine; "
         "throughput = all groups submitted at once. ×none: QPS over the `none` row of the same workload and pass. "
         "hits: requests started from the prefix state; agree: first tokens equal to `none`'s. warm-up s: wall time "
         "of the untimed pass of the same shape (other prompts) run just before, on the same engine (1 group before "
         "the latency pass, all groups at once twice before the throughput passes). graphs: steps of the timed pass run as "
         "CUDA-graph replays / eagerly (captures in the pass; the warm-up's are in the JSON).", "",
         "| workload | mode | pass | groups × req | QPS | groups/s | ×none | TTFT ms median | TTFT P90 | "
         "prefill tokens | steps | graphs | hits | agree | warm-up s |",
         "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    none = {(r["workload"], r["pass"]): r["qps"] for r in res["rows"] if r["mode"] == "none"}
    for r in res["rows"]:
        base = none.get((r["workload"], r["pass"]))
        x = f"{r['qps'] / base:.2f}" if base else ""
        ag = "" if r["first_token_agreement_vs_none"] is None else f"{100 * r['first_token_agreement_vs_none']:.0f} %"
        L.append(f"| {r['workload']} | {r['mode']} | {r['pass']} | {r['groups']} × {r['requests'] // r['groups']} | "
                 f"{r['qps']:.1f}{_range(r)} | {r['groups_per_s']:.2f} | {x} | {r['ttft_ms']['p50']:.1f} | "
                 f"{r['ttft_ms']['p90']:.1f} | {r['prefill_tokens']:,} | {r['steps']} | {graph_cell(r.get('graphs'))} | "
                 f"{r['hits']} | {ag} | "
                 + ("—" if r.get("warmup_wall_s") is None else f"{r['warmup_wall_s']:.2f}") + " |")
    t = res.get("target")
    if t:
        L += ["", f"Target: fused ≥ 2.1x the QPS of `none` on the RFC workload (throughput pass): measured "
                  f"{t['value']:.2f}x — {t['result']}."]
    return L


def _measure(rep: Report, plan: Plan, hf_cfg: dict[str, Any], dtype: torch.dtype, device: torch.device,
             max_tokens: int, tp: int = 1) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    if tp == 1:
        rep.log("building the random model on the device")
        model = build_random_model(hf_cfg, device, dtype)
        serve_rows(rep, plan, lambda mode: make_engine(model, mode, plan), hf_cfg["vocab_size"], params, MODES,
                   device)
        return
    from benchmarks.tp_model import TPSession
    rc = engine_config(plan, "fused").with_(tensor_parallel_size=tp).runner_config()
    rep.log(f"starting {tp} tensor-parallel ranks (random shards built on each)")
    session = TPSession(hf_cfg, device, dtype, tp, rc, chain=False)
    try:
        rep.note(f"tensor_parallel_size = {tp}: two_phase is not run (its prefill mode needs its own worker group); "
                 "steps run eagerly (no CUDA graphs at TP > 1).")
        serve_rows(rep, plan, lambda mode: session.engine(engine_config(plan, mode)), hf_cfg["vocab_size"], params,
                   tuple(m for m in MODES if m != "two_phase"), device)
    finally:
        session.close()


def serve_rows(rep: Report, plan: Plan, engine_for, vocab: int, params: SamplingParams, modes: tuple[str, ...],
               device: torch.device, close_engines: bool = True, **extra: Any) -> None:
    """Every workload x mode of the plan on ``engine_for(mode)``'s engines (rows get ``extra``'s fields).
    ``close_engines``: each engine is closed after its mode (its pools freed with it); False when they share a
    runner that outlives them (bench_tp's session: closing would stop its workers)."""
    cuda = device.type == "cuda"
    for wl in plan.workloads:
        rng = random.Random(wl.prefix)
        warm = wl.make_groups(1, vocab, rng)                 # the latency pass's warm-up (one group)
        lat_groups = wl.make_groups(wl.latency_groups, vocab, rng)
        tp_sets = [wl.make_groups(wl.groups, vocab, rng) for _ in range(plan.tp_passes)]
        tp_groups = tp_sets[0]
        # the throughput pass's warm-up: the same shape, twice (the second pass of a fresh engine still ran
        # ~1.5x slower on the H200 — allocator growth, cuBLAS heuristics — and made a single timed pass noisy)
        warm_tps = [wl.make_groups(wl.groups, vocab, rng) for _ in range(plan.tp_warmups)]
        warm_tp = warm_tps[0]
        ref: dict[str, dict[str, int]] = {}
        for mode in modes:
            if rep.over_budget(f"{wl.name} {mode}"):
                continue
            rep.log(f"{wl.name}: {mode} (warm-up group, {wl.latency_groups} latency; warm-up pass of {wl.groups} "
                    f"groups, {wl.groups} throughput)")
            engine = None
            try:
                engine = engine_for(mode)
                if mode == "score":
                    w_lat = drive_score(engine, warm)
                    lat = [drive_score(engine, [g]) for g in lat_groups]
                    w_tp = [drive_score(engine, g) for g in warm_tps][0]
                    tps = [drive_score(engine, g) for g in tp_sets]
                else:
                    w_lat = drive(engine, warm, mode, params, "w")
                    lat = [drive(engine, [g], mode, params, f"l{i}-") for i, g in enumerate(lat_groups)]
                    w_tp = [drive(engine, g, mode, params, f"wt{i}-") for i, g in enumerate(warm_tps)][0]
                    tps = [drive(engine, g, mode, params, f"t{i}-") for i, g in enumerate(tp_sets)]
                tp = median_pass(tps)
                merged = {"wall_s": sum(r["wall_s"] for r in lat), "ttft_s": [t for r in lat for t in r["ttft_s"]],
                          "first": {f"l{i}-{k}": v for i, r in enumerate(lat) for k, v in r["first"].items()},
                          "hits": sum(r["hits"] for r in lat), "steps": sum(r["steps"] for r in lat),
                          "graphs": None if not lat or lat[0]["graphs"] is None else
                          {k: sum(r["graphs"][k] for r in lat) for k in GRAPH_STATS}}
                rep.log(f"{wl.name} {mode}: graphs (replays / eager) latency {graph_cell(merged['graphs'])}, "
                        f"throughput {graph_cell(tp['graphs'])}")
                if mode == "none":
                    ref = {"latency": merged["first"], "throughput": tp["first"]}
                rep.add({**_row(wl, mode, "latency", lat_groups, merged, ref.get("latency"), w_lat, len(warm)),
                         **extra})
                rep.add({**_row(wl, mode, "throughput", tp_groups, tp, ref.get("throughput"), w_tp,
                              len(warm_tp)), **extra})
            except Exception as e:  # noqa: BLE001
                rep.error(f"{wl.name} {mode}", e)
            if engine is not None and close_engines:
                engine.close()      # unbinds the shared model (LLMEngine.close): its pools go with the engine
            engine = None
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()


def run(device: torch.device, quick: bool, out_dir: Path, layers: int | None, experts: int | None,
        groups: int | None, max_tokens: int, budget_s: float, tp: int = 1) -> dict[str, Any]:
    """``tp``: tensor_parallel_size (benchmarks/tp_model.py: every rank builds its shard of the random model;
    modes none, fused, score; the rows are eager steps)."""
    cuda = device.type == "cuda"
    plan = make_plan(cuda, quick, groups)
    hf_cfg = config_for(device, layers, experts)
    dtype = torch.bfloat16 if cuda else torch.float32
    rep = Report("serve", "Serving shared-prefix groups (LLMEngine)", device, out_dir, quick=quick, budget_s=budget_s,
                 table=table, model_config=hf_cfg, dtype=str(dtype), model_summary=model_summary(hf_cfg, dtype),
                 engine=f"max_step_tokens {plan.max_step_tokens}, max_num_seqs {plan.max_num_seqs}, "
                        f"{plan.num_pages} KV pages of 16, greedy, max_tokens {max_tokens}, CUDA graphs "
                        + ("on (decode / verify and prefill / mixed steps)" if cuda and tp == 1 else "off")
                        + (f", tensor_parallel_size {tp}" if tp > 1 else ""), tensor_parallel_size=tp,
                 workloads=[w.__dict__ for w in plan.workloads], tp_passes=plan.tp_passes,
                 warmup="before every timed pass, on the same engine, an untimed pass of the same shape on other "
                        f"prompts (1 group before the latency pass, all groups at once {plan.tp_warmups}x before the "
                        "throughput passes); "
                        "rows: warmup_wall_s, warmup_steps, warmup_groups")
    try:
        _measure(rep, plan, hf_cfg, dtype, device, max_tokens, tp)
    except Exception as e:  # noqa: BLE001 — set-up failed: the report says so
        rep.error("set-up", e)
    rows = {(r["workload"], r["mode"]): r for r in rep.res["rows"] if r["pass"] == "throughput"}
    rfc = plan.workloads[0].name
    if (rfc, "fused") in rows and (rfc, "none") in rows:
        v = rows[(rfc, "fused")]["qps"] / rows[(rfc, "none")]["qps"]
        rep.res["target"] = {"target": "fused QPS >= 2.1x none (RFC, throughput)", "value": v,
                             "result": ("met" if v >= 2.1 else "not met") if cuda else "n/a on CPU (tiny shapes)"}
    return rep.finish()


def run_from_args(args: argparse.Namespace) -> int:
    return run_cli("serve", args.device, lambda device: run(
        device, args.quick, Path(args.out), args.layers, args.experts, args.groups, args.max_tokens, args.time_budget,
        getattr(args, "tensor_parallel_size", 1)))


def main(argv: list[str] | None = None) -> int:
    from gdnserve.cli import add_bench_serve_arguments
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_serve", description=__doc__.split("\n")[0])
    add_bench_serve_arguments(parser)
    if "--tensor-parallel-size" not in parser._option_string_actions:
        parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                            help="N ranks (one GPU each; gloo processes on CPU): modes none, fused, score")
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
