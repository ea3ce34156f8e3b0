"""Speculative decoding through ``LLMEngine``: decode tokens/s at batch B with k drafts per step, GDN verify
in ``intermediate`` and ``replay`` mode, against plain decoding — with oracle drafts of chosen acceptance.

Run ``gdnserve bench spec`` or ``python -m benchmarks.bench_spec`` (options: --device, --quick, --out,
--layers, --experts, --batches, --ks, --acceptance, --time-budget). Writes ``spec_<device>_<date>.json``/``.md``.

Model: ``benchmarks/random_model.py`` (Qwen3.5-35B-A3B shapes, 8 layers, 64 experts, bf16 on CUDA; tiny
fp32 on CPU) with ``make_greedy_chain_``: large-norm embeddings and a permuted lm head make the greedy next
token pi(t) by a wide logit margin, so bf16 rounding differences between decode and verify steps cannot
change the greedy continuation (same shapes and cost as the plain random model).

Per batch B (CUDA: 1, 16, 64, 256; prompts of 64 random tokens): a run **without speculation** is the
baseline and records each request's greedy continuation; then for each k (1, 2, 3), mode and acceptance
rate (1.0 and 0.6 per draft) a fresh engine (``spec_k=k, spec_mode=mode``) runs the same prompts with
``benchmarks/oracle_drafter.RecordedOracleDrafter`` as its drafter (set as ``engine.drafter``; the engine
is unchanged). Timed: ``warmup`` + ``steps`` engine steps once every request has its first token (all B
requests decoding or verifying, none finished), perf_counter around ``engine.step()`` with the device
synchronised. tokens/s = generated tokens in the timed steps / their time; tokens/step = per request.

GDN state traffic per GDN layer per step (from the shapes; s = HV V K x 4 bytes fp32 SSM state,
c = (W-1) D conv state, x = D conv input per token, p = (H K + HV V + 2 HV) pending inputs per token, at
the activation dtype; L = k + 1; a = accepted tokens, taken as its measured mean):

    plain decode      B (2 s + 2 c)
    intermediate      B ((1 + L) s  +  2 s  +  c + L x  +  2 c + a x)        verify: read slot, write L scratch
                                                                           states; commit: copy one; conv fold
    replay            B (2 s  +  a p + L p  +  2 c + L x + a x)            replay a pending tokens into the
                                                                           slot (read + write once), keep L
Scratch memory: the bytes of the buffers the runner binds per mode (``bind_spec``), all GDN layers.
"""
from __future__ import annotations

import argparse
import gc
import random
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.e2e_report import Report, fmt_pct, model_summary, pct, run_cli, timed
from benchmarks.oracle_drafter import RecordedOracleDrafter
from benchmarks.random_model import NullTokenizer, build_random_model, config_for, make_greedy_chain_
from gdnserve.engine.execution.model_runner import RunnerConfig
from gdnserve.engine.llm_engine import LLMEngine
from gdnserve.engine.sampling_params import SamplingParams

MODES = ("intermediate", "replay")
MiB = float(1 << 20)


@dataclass(frozen=True)
class Plan:
    batches: tuple[int, ...]
    ks: tuple[int, ...]
    rates: tuple[float, ...]
    prompt: int
    warmup: int
    steps: int

    @property
    def max_tokens(self) -> int:
        """Enough that no request finishes inside the timed steps, even with every draft accepted."""
        return (self.warmup + self.steps + 2) * (max(self.ks) + 1) + 2


def make_plan(cuda: bool, quick: bool, batches: str | None, ks: str, rates: str) -> Plan:
    parse = lambda s, f: tuple(f(x) for x in s.split(",") if x.strip())  # noqa: E731
    b = parse(batches, int) if batches else ((1, 16, 64, 256) if cuda else (1, 4))
    plan = Plan(b, parse(ks, int), parse(rates, float), 64 if cuda else 12, 2, 12 if cuda else 4)
    if quick:
        plan = replace(plan, steps=max(2, plan.steps // 2), warmup=1)
    bad = [k for k in plan.ks if k < 1] + [r for r in plan.rates if not 0 <= r <= 1] + [x for x in plan.batches if x < 1]
    if bad or not (plan.ks and plan.rates and plan.batches):
        raise ValueError(f"--batches, --ks (>= 1), --acceptance (0..1): bad values {bad}")
    return plan


def state_bytes(mode: str, k: int, B: int, g, act_bytes: int, accepted: float) -> dict[str, float]:
    """GDN bytes per layer per step (module docstring); ``mode`` 'plain' for decoding without drafts."""
    s = g.num_v_heads * g.head_v_dim * g.head_k_dim * 4
    c = (g.conv_kernel - 1) * g.conv_dim * act_bytes
    x = g.conv_dim * act_bytes
    p = (g.num_k_heads * g.head_k_dim + g.num_v_heads * g.head_v_dim + 2 * g.num_v_heads) * act_bytes
    L, a = k + 1, accepted
    if mode == "plain":
        ssm, other = 2 * s, 2 * c
    elif mode == "intermediate":
        ssm, other = (1 + L) * s + 2 * s, 3 * c + L * x + a * x
    else:
        ssm, other = 2 * s, a * p + L * p + 2 * c + L * x + a * x
    return {"ssm": B * ssm, "conv_and_inputs": B * other, "total": B * (ssm + other)}


def scratch_bytes(engine: LLMEngine) -> int:
    total = 0
    for layer in engine.runner.model.gdn_layers():
        for t in (layer.conv_scratch, layer.ssm_scratch):
            total += 0 if t is None else t.numel() * t.element_size()
        if layer.pending is not None:
            p = layer.pending
            total += sum(t.numel() * t.element_size() for t in (p.k, p.v, p.a, p.b))
    return total


def make_engine(model, B: int, k: int, mode: str) -> LLMEngine:
    rc = RunnerConfig(num_slots=B + 2, num_pages=B * 16 + 64, page_size=16)
    return LLMEngine(model, NullTokenizer(), runner=rc, max_num_seqs=B, max_step_tokens=8192, max_model_len=4096,
                     auto_checkpoints=False, spec_k=k, spec_mode=mode)


def drive(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, plan: Plan, dev: torch.device,
          finish: bool) -> tuple[dict[str, Any], dict[str, list[int]]]:
    """Prefill every prompt, time ``warmup + steps`` steady steps, then finish (``finish``, to record every
    continuation) or abort. Returns (timings, request id -> prompt + output)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    seen: dict[str, list[int]] = {}
    while len(seen) < len(ids):                       # prefill until every request has its first token
        for o in engine.step():
            if o.outputs[0].token_ids:
                seen[o.request_id] = o.outputs[0].token_ids
    times, tokens = [], []
    for i in range(plan.warmup + plan.steps):
        before = engine.counts.tokens_generated
        _, t = timed(engine.step, dev)
        if i >= plan.warmup:
            times.append(t)
            tokens.append(engine.counts.tokens_generated - before)
    outputs: dict[str, list[int]] = {}
    while finish and engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outputs[o.request_id] = o.prompt_token_ids + o.outputs[0].token_ids
    for rid in ids:
        engine.abort(rid)
    B = len(prompts)
    return {"step_ms": pct([t * 1e3 for t in times]), "tokens_per_s": sum(tokens) / sum(times),
            "tokens_per_step": sum(tokens) / len(tokens) / B, "steps": len(times)}, outputs


def table(res: dict[str, Any]) -> list[str]:
    L = [res.get("model_summary", ""), "",
         f"Prompts of {res['plan']['prompt']} tokens, greedy; {res['plan']['steps']} timed steps after "
         f"{res['plan']['warmup']} warm-up, every request decoding. step ms: median [P10–P90]. tokens/step: generated "
         "per request per step (1 + accepted drafts). ×plain: tokens/s over plain decoding at the same B. GDN MiB: "
         "state traffic per GDN layer per step from the shapes (SSM state; conv state + raw inputs); scratch: the "
         "verify buffers the runner allocates, all GDN layers.", "",
         "| B | mode | k | rate | tokens/s | ×plain | tokens/step | step ms | GDN SSM MiB/layer/step | conv+inputs MiB "
         "| scratch MiB | diverged |",
         "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    plain = {r["B"]: r["tokens_per_s"] for r in res["rows"] if r["mode"] == "plain"}
    for r in res["rows"]:
        x = f"{r['tokens_per_s'] / plain[r['B']]:.2f}" if r["B"] in plain else ""
        sb = r["state_bytes"]
        L.append(f"| {r['B']} | {r['mode']} | {r['k'] or '—'} | {'—' if r['rate'] is None else r['rate']} | "
                 f"{r['tokens_per_s']:,.0f} | {x} | {r['tokens_per_step']:.2f} | {fmt_pct(r['step_ms'], '.2f')} | "
                 f"{sb['ssm'] / MiB:.4g} | {sb['conv_and_inputs'] / MiB:.3g} | {r['scratch_bytes'] / MiB:.4g} | "
                 f"{'' if r['diverged'] is None else r['diverged']} |")
    return L


def _measure(rep: Report, plan: Plan, hf_cfg: dict[str, Any], dtype: torch.dtype, device: torch.device) -> None:
    cuda = device.type == "cuda"
    rep.log("building the random model on the device")
    model = build_random_model(hf_cfg, device, dtype)
    with torch.no_grad():
        make_greedy_chain_(model)
    g, act = model.cfg.gdn, model.embed_tokens.weight.element_size()
    rng = random.Random(0)
    for B in plan.batches:
        prompts = [[rng.randrange(hf_cfg["vocab_size"]) for _ in range(plan.prompt)] for _ in range(B)]
        if rep.over_budget(f"B={B} (all modes)"):
            continue
        rep.log(f"B={B}: plain decoding (baseline + recording the greedy continuations)")
        try:
            engine = make_engine(model, B, 0, "replay")
            t, outs = drive(engine, prompts, plan.max_tokens + max(plan.ks) + 2, plan, device, finish=True)
            futures = [outs[f"r{i}"] for i in range(B)]
            rep.add({"B": B, "mode": "plain", "k": 0, "rate": None, **t, "diverged": None, "scratch_bytes": 0,
                     "state_bytes": state_bytes("plain", 0, B, g, act, 0)})
        except Exception as e:  # noqa: BLE001 — no recording, no spec rows for this B
            rep.error(f"B={B} plain", e)
            continue
        engine.close()              # unbinds the shared model (LLMEngine.close): its pools go with the engine
        del engine
        for k in plan.ks:
            for mode in MODES:
                for rate in plan.rates:
                    what = f"B={B} {mode} k={k} rate={rate}"
                    if rep.over_budget(what):
                        continue
                    rep.log(what)
                    engine = None
                    try:
                        engine = make_engine(model, B, k, mode)
                        engine.drafter = RecordedOracleDrafter(futures, plan.prompt, k, rate)
                        t, _ = drive(engine, prompts, plan.max_tokens, plan, device, finish=False)
                        rep.add({"B": B, "mode": mode, "k": k, "rate": rate, **t,
                                 "acceptance_measured": (t["tokens_per_step"] - 1) / k,
                                 "diverged": len(engine.drafter.diverged), "scratch_bytes": scratch_bytes(engine),
                                 "state_bytes": state_bytes(mode, k, B, g, act, t["tokens_per_step"])})
                    except Exception as e:  # noqa: BLE001
                        rep.error(what, e)
                    if engine is not None:
                        engine.close()
                    engine = None
                    gc.collect()
                    if cuda:
                        torch.cuda.empty_cache()


def run(device: torch.device, quick: bool, out_dir: Path, layers: int | None, experts: int | None,
        batches: str | None, ks: str, rates: str, budget_s: float) -> dict[str, Any]:
    cuda = device.type == "cuda"
    plan = make_plan(cuda, quick, batches, ks, rates)
    hf_cfg = config_for(device, layers, experts)
    dtype = torch.bfloat16 if cuda else torch.float32
    rep = Report("spec", "Speculative decoding (oracle drafts)", device, out_dir, quick=quick, budget_s=budget_s,
                 table=table, model_config=hf_cfg, dtype=str(dtype), plan={**plan.__dict__, "max_tokens": plan.max_tokens},
                 model_summary=model_summary(hf_cfg, dtype) + " Greedy chain lm head (module docstring).")
    try:
        _measure(rep, plan, hf_cfg, dtype, device)
    except Exception as e:  # noqa: BLE001 — set-up failed: the report says so
        rep.error("set-up", e)
    if any(r.get("diverged") for r in rep.res["rows"]):
        rep.note("Some requests left the recorded continuation (diverged column): their drafts were wrong from "
                 "then on, so their acceptance is below the nominal rate.")
    return rep.finish()


def run_from_args(args: argparse.Namespace) -> int:
    return run_cli("spec", args.device, lambda device: run(
        device, args.quick, Path(args.out), args.layers, args.experts, args.batches, args.ks, args.acceptance,
        args.time_budget),
        validate=lambda device: make_plan(device.type == "cuda", args.quick, args.batches, args.ks, args.acceptance))


def main(argv: list[str] | None = None) -> int:
    from gdnserve.cli import add_bench_spec_arguments
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_spec", description=__doc__.split("\n")[0])
    add_bench_spec_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
