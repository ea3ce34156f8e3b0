"""Multi-turn chat beyond the GPU's checkpoint capacity: the host tier off and on (issue 30).

N conversations x T turns (default 4): turn 1 is a system prompt + a user message; every later turn is the
previous prompt + its output + a new user message, so it resumes from the previous turn's automatic checkpoint
(prompt + output minus the last token). Each turn sends every conversation's request in order, C at a time (a
closed loop), so by the time conversation 0 comes back the N - 1 others have published after it. N defaults to 10x
the GPU's checkpoint capacity (state slots left beside the running requests; ``--num-slots`` keeps it small), so
with the tier off the later turns mostly miss and recompute; with ``--checkpoint-host-memory`` sized for all N they
restore. Per mode and turn: the checkpoint hit rate, hits per tier, TTFT p50 / p99 (submission to first token,
engine in process, no HTTP). Then, on the tier-on engine, the restore time of K host-tier checkpoints (lookup to
READY, room made beforehand, so only the host -> GPU copy is timed) beside the recompute time of the same prefix
(one prefill of its tokens) and the spill time (GPU -> host copy on eviction, issued and then waited for).

    python -m benchmarks.bench_checkpoint_tiers --device cuda --random full --out /tmp/res   # the H200
    python -m benchmarks.bench_checkpoint_tiers --device cpu --out /tmp/res                   # seconds: a smoke test

Writes ``checkpoint_tier_<device>.json`` (rows one per line, benchmarks/jsonfmt.py) and ``.md`` into ``--out``.
Goal (issue 30): with the tier on, later turns hit >= 95 % of the time and their TTFT p50 is <= 0.25x the tier-off
run's; restoring a checkpoint costs <= 0.2x recomputing its prefix.
"""
from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks import jsonfmt
from gdnserve.engine.cache.checkpoint_copy import Copier
from gdnserve.engine.cache.host_arena import block_size
from gdnserve.engine.cache.sequence import PrefillItem
from gdnserve.engine.config import EngineConfig
from gdnserve.engine.llm_engine import LLMEngine
from gdnserve.engine.sampling_params import SamplingParams


@dataclass
class Plan:
    conversations: int
    turns: int
    system_tokens: int
    user_tokens: int
    max_tokens: int
    concurrency: int
    num_slots: int
    host_gb: float
    samples: int


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(args: argparse.Namespace, device: torch.device):
    """(model, tokenizer, dtype): the embedded model on CPU, the random model of ``--random`` on CUDA."""
    if device.type == "cpu" and args.random == "tiny":
        from benchmarks.random_model import NullTokenizer
        from gdnserve.models.builtin import build_builtin_model
        return build_builtin_model(dtype=torch.float32, device="cpu"), NullTokenizer(), torch.float32
    from benchmarks.random_model import NullTokenizer, build_random_model
    from benchmarks.serve_random import random_hf_config
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return build_random_model(random_hf_config(args.random), device, dtype), NullTokenizer(), dtype


def engine_config(args: argparse.Namespace, plan: Plan, host_gb: float) -> EngineConfig:
    return EngineConfig(max_num_seqs=plan.concurrency, max_model_len=args.max_model_len, num_slots=plan.num_slots,
                        num_pages=args.num_pages, max_step_tokens=args.max_step_tokens,
                        checkpoint_host_memory_gb=host_gb, cuda_graphs=False if args.no_graphs else None,
                        checkpoint_spill_ahead=(EngineConfig.checkpoint_spill_ahead if args.spill_ahead is None
                                                else args.spill_ahead),
                        gpu_memory_utilization=args.gpu_memory_utilization, model_name="bench-tiers")


def conversations(plan: Plan, vocab: int, seed: int) -> list[list[list[int]]]:
    """Per conversation, per turn: the new tokens of that turn (turn 1: system + user message)."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(3, vocab) for _ in range(n)]
    return [[tok(plan.system_tokens + plan.user_tokens)] + [tok(plan.user_tokens) for _ in range(plan.turns - 1)]
            for _ in range(plan.conversations)]


def run_turn(e: LLMEngine, prompts: list[list[int]], params: SamplingParams, c: int, device: torch.device
             ) -> list[tuple[Any, float]]:
    """Every prompt through the engine, ``c`` in flight (closed loop): (final output, TTFT s) in prompt order."""
    todo = list(enumerate(prompts))
    todo.reverse()
    inflight: dict[str, list] = {}
    res: list[Any] = [None] * len(prompts)
    while todo or inflight:
        while todo and len(inflight) < c:
            i, ids = todo.pop()
            rid = e.add_request(None, ids, params)
            inflight[rid] = [i, time.perf_counter(), None]
        for o in e.step():
            rec = inflight.get(o.request_id)
            if rec is None:
                continue
            if rec[2] is None and any(c_.token_ids for c_ in o.outputs):
                rec[2] = time.perf_counter()   # the step's outputs are host values: its device work is done
            if o.finished:
                res[rec[0]] = (o, rec[2] - rec[1])
                del inflight[o.request_id]
    return res


def run_mode(e: LLMEngine, plan: Plan, convs: list[list[list[int]]], mode: str, device: torch.device,
             deadline: float) -> list[dict[str, Any]]:
    params = SamplingParams(temperature=0.0, max_tokens=plan.max_tokens, ignore_eos=True)
    prompts = [[] for _ in convs]
    rows = []
    for t in range(plan.turns):
        if time.perf_counter() > deadline:
            print(f"  {mode}: time budget spent before turn {t + 1}", flush=True)
            break
        for i, conv in enumerate(convs):
            prompts[i] = prompts[i] + conv[t]
        t0 = time.perf_counter()
        out = run_turn(e, prompts, params, plan.concurrency, device)
        wall = time.perf_counter() - t0
        ttft = [x[1] * 1e3 for x in out]
        hits = [x[0].checkpoint.hit_length > 0 for x in out]
        tiers: dict[str, int] = {}
        for x in out:
            tier = x[0].checkpoint.tier
            if tier is not None:
                tiers[tier] = tiers.get(tier, 0) + 1
        row = {"mode": mode, "turn": t + 1, "requests": len(out), "prompt_tokens": round(statistics.mean(
            len(p) for p in prompts)), "hit_rate": sum(hits) / len(hits), "hits_by_tier": tiers,
            "hit_tokens": round(statistics.mean(x[0].checkpoint.hit_length for x in out)),
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99), "wall_s": wall}
        rows.append(row)
        print(f"  {mode} turn {t + 1}: hit {row['hit_rate']:.0%} {tiers} TTFT p50 {row['ttft_p50_ms']:.1f} ms "
              f"p99 {row['ttft_p99_ms']:.1f} ms ({wall:.1f} s)", flush=True)
        for i, (o, _) in enumerate(out):
            prompts[i] = prompts[i] + o.outputs[0].token_ids
    return rows


def restore_vs_recompute(e: LLMEngine, k: int, device: torch.device) -> list[dict[str, Any]]:
    """K host-tier checkpoints: restore (lookup -> READY, room made beforehand) beside one prefill of their prefix,
    and the spill of a device checkpoint (evict -> the copy done)."""
    ck = e.kv.checkpoint_cache
    tiers = ck.tiers
    out = []
    for hc in list(tiers.host.values())[-k:]:
        ids = hc.token_ids
        ck.evict(1)                                     # room for the restore, untimed
        sync(device)
        t0 = time.perf_counter()
        look = ck.lookup(ids)
        if look.entry is None:
            continue
        ck.poll(wait=True)
        sync(device)
        restore = time.perf_counter() - t0
        ck.evict(1) if e.kv.state.num_free == 0 else None
        for _ in range(2):                              # the recompute: one prefill of the same tokens (the
            seq = e.kv.new_seq()                        # second: the first may compile or capture its shape)
            sync(device)
            t0 = time.perf_counter()
            e.runner.step([PrefillItem(seq, list(ids))], [])
            sync(device)
            recompute = time.perf_counter() - t0
            e.kv.free_seq(seq)
        victim = ck.index.lru_victims(1)
        if victim:
            tiers.drop_ahead(victim[0].key)             # a copy made ahead would make the eviction free: time one
        t0 = time.perf_counter()
        ck.evict(1)                                     # a spill: issued, then waited for
        sync(device)
        spill = time.perf_counter() - t0 if victim else float("nan")
        out.append({"tokens": len(ids), "mbytes": hc.nbytes / 1e6, "restore_ms": restore * 1e3,
                    "recompute_ms": recompute * 1e3, "ratio": restore / recompute, "spill_ms": spill * 1e3,
                    "restore_gbps": hc.nbytes / restore / 1e9})
    return out


def link_rate(nbytes: int, device: torch.device, reps: int = 5) -> dict[str, float] | None:
    """The PCIe link's rate for one transfer of ``nbytes`` each way between pinned host memory and the device
    (median of ``reps``): what a restore or spill of that size could reach. None off CUDA."""
    if device.type != "cuda" or nbytes <= 0:
        return None
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for name, dst, src in (("h2d_gbps", dev, host), ("d2h_gbps", host, dev)):
        ts = []
        for _ in range(reps):
            sync(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            sync(device)
            ts.append(time.perf_counter() - t0)
        out[name] = nbytes / statistics.median(ts) / 1e9
    return out


def later(rows: list[dict[str, Any]], mode: str) -> list[dict[str, Any]]:
    return [r for r in rows if r["mode"] == mode and r["turn"] > 1]


def markdown(res: dict[str, Any]) -> str:
    p = res["plan"]
    lines = [f"# Checkpoint tiers: multi-turn chat beyond the GPU ({res['device_name']})", "",
             (f"{p['conversations']} conversations x {p['turns']} turns, system {p['system_tokens']} + "
             f"{p['user_tokens']} tokens a turn, {p['max_tokens']} output tokens, {p['concurrency']} in flight; GPU "
             f"checkpoint capacity ~{res['gpu_capacity']} ({p['num_slots']} state slots); host tier "
             f"{res['host_gb']:.1f} GiB when on. {res['versions']}"), "",
             "| mode | turn | requests | prompt tokens | hit rate | hits by tier | TTFT p50 ms | TTFT p99 ms | wall s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['mode']} | {r['turn']} | {r['requests']} | {r['prompt_tokens']} | {r['hit_rate']:.1%} | "
                     f"{r['hits_by_tier']} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | {r['wall_s']:.1f} |")
    if res["restore"]:
        lines += ["", "| tokens | MB | restore ms | recompute ms | restore / recompute | restore GB/s | spill ms |",
                  "|---|---|---|---|---|---|---|"]
        for r in res["restore"]:
            lines.append(f"| {r['tokens']} | {r['mbytes']:.1f} | {r['restore_ms']:.2f} | {r['recompute_ms']:.2f} | "
                         f"{r['ratio']:.3f} | {r['restore_gbps']:.1f} | {r['spill_ms']:.2f} |")
        if res.get("link"):
            lk = res["link"]
            lines += ["", f"The link, one pinned transfer of the median checkpoint's bytes (median of 5): host -> "
                          f"device {lk['h2d_gbps']:.1f} GB/s, device -> host {lk['d2h_gbps']:.1f} GB/s."]
    sp = res.get("spills", {})
    if sp:
        lines += ["", f"Tier on, spill ahead {res.get('spill_ahead')}: {sp['spills']} spills, {sp['spills_ahead']} "
                      f"of them ahead of need, {sp['evictions_waited']} evictions that copied down then, "
                      f"{sp['dropped']} dropped."]
    t = res["targets"]
    lines += ["", "## Targets (issue 30)", "",
              f"- later turns' hit rate with the tier on: {t['hit_rate_on']:.1%} (goal >= 95 %)",
              f"- later turns' TTFT p50, on / off: {t['ttft_ratio']:.3f} (goal <= 0.25)",
              f"- restore / recompute, median: {t['restore_ratio']:.3f} (goal <= 0.2)", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_checkpoint_tiers", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--random", choices=["full", "bench", "tiny"], default=None,
                    help="the random model's shape (default: full on CUDA; tiny on CPU = the embedded model)")
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--conversations", type=int, default=None, help="default: 10x the GPU's checkpoint capacity")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=None)
    ap.add_argument("--user-tokens", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=None)
    ap.add_argument("--num-slots", type=int, default=None)
    ap.add_argument("--num-pages", type=int, default=None,
                    help="default: 1.5x what every state slot's longest sequence needs (the slots bound the checkpoints)")
    ap.add_argument("--max-step-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--host-gb", type=float, default=None, help="default: room for every conversation's checkpoint")
    ap.add_argument("--samples", type=int, default=None, help="checkpoints timed in the restore-vs-recompute part")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--spill-ahead", type=int, default=None,
                    help="the engine's checkpoint_spill_ahead watermark (default: EngineConfig's; 0: off)")
    ap.add_argument("--time-budget", type=float, default=540.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    deadline = time.perf_counter() + args.time_budget
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    args.random = args.random or ("full" if cuda else "tiny")
    model, tok, dtype = build_model(args, device)
    vocab = model.cfg.vocab_size
    plan = Plan(conversations=0, turns=args.turns, system_tokens=args.system_tokens or (1024 if cuda else 24),
                user_tokens=args.user_tokens or (64 if cuda else 4), max_tokens=args.max_tokens or (16 if cuda else 3),
                concurrency=args.concurrency or (8 if cuda else 2), num_slots=args.num_slots or (40 if cuda else 6),
                host_gb=0.0, samples=args.samples or (16 if cuda else 3))
    capacity = plan.num_slots - plan.concurrency
    plan.conversations = args.conversations or 10 * capacity
    last_prefix = plan.system_tokens + plan.turns * (plan.user_tokens + plan.max_tokens)
    if args.num_pages is None:       # pages for every slot's longest sequence, 1.5x: the slots bound the checkpoints
        args.num_pages = int(1.5 * plan.num_slots * -(-last_prefix // 16))
    rows: list[dict[str, Any]] = []
    restore: list[dict[str, Any]] = []
    host_gb = 0.0
    e = None
    for mode in ("off", "on"):
        if e is not None:          # size the host tier for every conversation's last checkpoint, then free the GPU
            per = block_size(Copier(e.kv.state, e.kv.pages).layout_bytes(-(-last_prefix // e.kv.page_size)))
            host_gb = args.host_gb if args.host_gb is not None else 1.1 * plan.conversations * per / 2**30
            e.close()              # unbinds the shared model (LLMEngine.close): the off engine's pools go with it
            e = None
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        t0 = time.perf_counter()
        e = LLMEngine(model, tok, engine_config(args, plan, host_gb))
        print(f"{mode}: engine in {time.perf_counter() - t0:.1f} s: {e.kv.state.num_slots} slots, "
              f"{e.kv.pages.num_pages} pages, host tier {host_gb:.2f} GiB", flush=True)
        rows += run_mode(e, plan, conversations(plan, vocab, args.seed), mode, device, deadline)
    snap = e.tier_stats.snapshot() if e.tier_stats is not None else {}
    if time.perf_counter() < deadline:
        restore = restore_vs_recompute(e, plan.samples, device)
    plan.host_gb = host_gb
    link = link_rate(int(statistics.median(r["mbytes"] for r in restore) * 1e6), device) if restore else None
    on, off = later(rows, "on"), later(rows, "off")
    med = lambda rs, k: statistics.median(r[k] for r in rs) if rs else float("nan")
    targets = {"hit_rate_on": (sum(r["hit_rate"] * r["requests"] for r in on) / max(1, sum(r["requests"] for r in on))),
               "ttft_ratio": med(on, "ttft_p50_ms") / med(off, "ttft_p50_ms") if off else float("nan"),
               "restore_ratio": med(restore, "ratio")}
    import triton
    res = {"device": device.type, "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
           "versions": f"torch {torch.__version__}, triton {triton.__version__}, model random-{args.random} {dtype}",
           "plan": plan.__dict__, "gpu_capacity": capacity, "host_gb": host_gb, "rows": rows, "restore": restore,
           "targets": targets, "link": link, "spill_ahead": e.config.checkpoint_spill_ahead,
           "spills": {k: snap.get(k, 0) for k in ("spills", "spills_ahead", "evictions_waited", "dropped")}}
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"checkpoint_tier_{'h200' if cuda and 'H200' in res['device_name'] else device.type}"
    (args.out / f"{name}.json").write_text(jsonfmt.dumps(res))
    (args.out / f"{name}.md").write_text(markdown(res))
    print(markdown(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
