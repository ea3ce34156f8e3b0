"""Tensor parallelism, TP = 2 against TP = 1 in one run (equality, throughput, all-reduce, serve, Qwen3-Next).

Equal greedy outputs, decode / prefill tokens/s, the all-reduce time per step, the RFC serve workload, and
Qwen3-Next-80B-A3B's shapes at TP = 2 when they fit.

Run ``python -m benchmarks.bench_tp --device cuda --tp 1,2`` (on nvidia-h200-x2: ``bash benchmarks/device.sh
tp:500``; options: --quick, --shape, --layers, --experts, --sections, --batches, --prefill, --tp1-graphs,
--time-budget, --out). Writes ``tp_<device>.json`` and ``.md`` under --out (rewritten after every row).

Model: ``benchmarks/tp_model.py``'s random model, built by every rank as its shard of the same weights (each
full tensor drawn once and cut by the layer's own weight loader; TP = 1 is the size-1 shard), with
``make_greedy_chain_`` (large-norm embeddings, permuted lm head: the greedy next token pi(t) wins by a wide
margin, so bf16 rounding cannot flip it; same cost as the plain random model). CUDA: the full-size
Qwen3.5-35B-A3B (40 layers, 256 experts, bf16; ``--shape quick``: the 8-layer, 64-expert cut); CPU: the tiny fp32
shape (ranks are gloo processes). Per TP size one worker group (``TPSession``) serves every section, all on one
engine config (the serve plan's pools, ``spec_k`` n-gram drafts, eager steps): the workers' pools are built for
it, so runners and engines come and go on rank 0 while the workers stay.

Sections (``--sections``, default all, in this order per TP size; TP sizes in ascending order):

* ``eq`` — greedy outputs of TP = N against TP = 1 on: plain prompts, a checkpoint group (one prefix with
  ``checkpoint_at`` = its length — what the server makes of a ``<|state_checkpoint|>`` marker — and three
  suffixes, submitted together: producer and consumers) and two greedy-chain prompts that repeat their start (the
  n-gram drafter's drafts are the model's own continuation: verify steps accept them). Two passes: ``logprobs``
  (top-2 logprobs per token: these requests decode without drafts) and ``spec`` (no logprobs: speculative, k =
  ``spec_k``). Reported: the share of equal tokens, sequences equal in full, and the max |logprob difference| of
  the chosen tokens and of the top-2 alternatives (where the sequences still agree). Tolerance: fp32 (CPU) 1e-5
  and every token equal; bf16 every token equal, chosen-token |d| <= 0.05, alternatives |d| <= 3 % of
  max(1, |logprob|) (bf16 keeps 8 bits: a logit near 40 is rounded to 0.25, and the two sizes sum their partial
  products in another order).
* ``decode`` — B (CUDA 1, 16, 64, 256) sequences at a context of 128, steady-state ``runner.step([], decodes)`` +
  argmax + host copy (bench_model's loop); ``prefill`` — N x L (CUDA 1x4096, 8x1024) fresh sequences in one step.
  TP = 1 eagerly, and with CUDA graphs (``--tp1-graphs``, CUDA default: what TP = 1 serves with); TP = 2 eagerly
  (tensor-parallel steps have no CUDA graphs). ms: median [P10–P90] of perf_counter around the call, device
  synchronised before and after.
* all-reduce (with ``decode`` / ``prefill`` at TP > 1): after each case's timed calls, ``allreduce_steps`` more
  calls with rank 0's ``dist.all_reduce`` calls timed (``CollectiveTimer``: CUDA events around each call, i.e.
  the NCCL kernel including its wait for the other rank): calls and ms per step, and their share of the step.
* ``serve`` — the RFC workload of bench_serve (groups of a 600-token prefix + 10 candidates; modes none, fused,
  score) on the session's engine, at every TP size (bench_serve.serve_rows; two_phase needs another worker group).
* ``next`` — Qwen3-Next-80B-A3B (48 layers, 512 experts top-10) at the largest TP size, decode and prefill, when
  its shard and pools fit every GPU's free memory (checked first; skipped with the numbers otherwise). On CPU its
  family (model_type qwen3_next) at the tiny shape, as a smoke test of the path (a second worker group).
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks import bench_model as bm
from benchmarks import bench_serve as bs
from benchmarks.e2e_report import Report, fmt_pct, model_summary, pct, run_cli
from benchmarks.random_model import (
    FULL_EXPERTS,
    FULL_LAYERS,
    bench_hf_config,
    qwen3_next_hf_config,
    tiny_hf_config,
)
from benchmarks.tp_model import CollectiveTimer, TPSession
from gdnserve.engine.cache.sequence import PrefillItem
from gdnserve.engine.config import EngineConfig
from gdnserve.engine.execution.model_runner import ModelRunner
from gdnserve.engine.sampling_params import SamplingParams

SECTIONS = ("eq", "decode", "prefill", "serve", "next")
# TP = 1's optional rows (CUDA graphs, serve) are skipped past this share of the budget, TP = N's serve rows past
# the second: the TP = 2 rows and Qwen3-Next keep their time
TP1_EXTRAS_SHARE, SERVE_SHARE = 0.35, 0.8


@dataclass(frozen=True)
class Plan:
    batches: tuple[int, ...]
    prefill: tuple[tuple[int, int], ...]
    context: int
    warmup: int
    iters: int
    case_cap_s: float             # timed calls of one case stop after this (at least one sample)
    allreduce_steps: int
    eq_tokens: int                # generated per equality prompt
    eq_prompt: int                # the plain prompts' / the prefix's length
    chain_len: int
    spec_k: int
    serve: bs.Plan
    num_slots: int | None = None  # the session's pools (None: the engine default); two sets coexist while a new
    num_pages: int | None = None  # runner binds its own, so at full size they are kept to what the cases need


def make_plan(cuda: bool, quick: bool) -> Plan:
    serve = bs.make_plan(cuda, quick, None)
    serve = replace(serve, workloads=serve.workloads[:1])          # the RFC workload
    if cuda:
        # 320 slots: decode B = 256, or the RFC pass's 16 x 10 requests + their checkpoints; bench_serve's 16384 pages
        return Plan((1, 16, 64, 256), ((1, 4096), (8, 1024)), 128, 1 if quick else 2, 3 if quick else 6,
                    8.0 if quick else 15.0, 3, 16 if quick else 32, 200, 48, 2, serve, 320, 16384)
    return Plan((1, 4), ((1, 64), (4, 16)), 16, 1, 2 if quick else 3, 5.0, 2, 8, 24, 16, 2, serve)


def engine_config(plan: Plan) -> EngineConfig:
    """The one engine config of every session (module docstring); eager."""
    s = plan.serve
    return EngineConfig(max_num_seqs=s.max_num_seqs, max_step_tokens=s.max_step_tokens, max_model_len=4096,
                        num_pages=plan.num_pages or s.num_pages, page_size=16, num_slots=plan.num_slots,
                        spec_k=plan.spec_k, cuda_graphs=False)


def model_config(device: torch.device, shape: str, layers: int | None, experts: int | None) -> dict[str, Any]:
    if shape == "auto":
        shape = "full" if device.type == "cuda" else "tiny"
    if shape == "tiny":
        return tiny_hf_config(layers or 4, experts or 8)
    full = shape == "full"
    return bench_hf_config(layers or (FULL_LAYERS if full else 8), experts or (FULL_EXPERTS if full else 64))


def _past(rep: Report, share: float, what: str) -> bool:
    """True (``what`` listed as skipped) once ``share`` of the time budget is spent."""
    if rep.elapsed <= share * rep.budget_s:
        return False
    rep.res["skipped"].append(f"{what} (past {100 * share:.0f} % of the budget)")
    rep.log(f"skipping {what}: past {100 * share:.0f} % of the time budget")
    return True


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------
# equality
# ---------------------------------------------------------------------------------------------------------

def eq_prompts(plan: Plan, vocab: int, perm: list[int] | None) -> list[tuple[str, list[int], int | None]]:
    """(name, token ids, checkpoint_at): plain prompts, one checkpoint group, greedy-chain prompts that repeat."""
    rng = random.Random(18)
    ids = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    L = plan.eq_prompt
    out: list[tuple[str, list[int], int | None]] = [("plain0", ids(L), None), ("plain1", ids(L // 2 + 3), None),
                                                    ("plain2", ids(7), None)]
    prefix = ids(L)
    out += [(f"group{j}", prefix + ids(n), len(prefix)) for j, n in enumerate((5, 9, 13))]
    if perm is not None:
        for j in range(2):
            t, chain = rng.randrange(vocab), []
            for _ in range(plan.chain_len):
                chain.append(t)
                t = perm[t]
            out.append((f"chain{j}", chain + chain[:4], None))
    return out


def eq_outputs(session: TPSession, cfg: EngineConfig, plan: Plan, vocab: int) -> dict[str, Any]:
    """Both passes' outputs: {pass: {name: (token ids, logprobs)}, counters: {pass: {...}}}."""
    perm = session.model.chain_perm
    prompts = eq_prompts(plan, vocab, None if perm is None else perm.tolist())
    res: dict[str, Any] = {"counters": {}}
    for name, params in (("logprobs", SamplingParams(temperature=0, max_tokens=plan.eq_tokens, logprobs=2,
                                                     ignore_eos=True)),
                         ("spec", SamplingParams(temperature=0, max_tokens=plan.eq_tokens, ignore_eos=True))):
        engine = session.engine(cfg)
        for rid, ids, at in prompts:
            engine.add_request(rid, ids, params, at)
        final = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    final[o.request_id] = (list(o.outputs[0].token_ids), o.outputs[0].logprobs)
        c = engine.counts.as_dict()
        res[name] = final
        res["counters"][name] = {k: c[k] for k in ("spec_drafted", "spec_accepted", "checkpoint_hits",
                                                   "checkpoints_published")}
        engine = None
        _free(session.model.embed_tokens.weight.device)
    return res


def compare(ref: dict[str, Any], got: dict[str, Any], fp32: bool) -> dict[str, Any]:
    """TP = N's outputs against TP = 1's (module docstring: shares, max differences, the tolerance verdict)."""
    out: dict[str, Any] = {"passes": {}, "tolerance": (
        "fp32: every token equal, |d logprob| <= 1e-5" if fp32 else
        "bf16: every token equal, chosen-token |d logprob| <= 0.05, alternatives |d| <= 3 % of max(1, |logprob|)")}
    ok = True
    for p in ("logprobs", "spec"):
        if p not in ref or p not in got:
            continue
        equal = total = full = compared = 0
        d_chosen = d_alt = r_alt = 0.0
        diverged: dict[str, int] = {}
        for rid, (toks, lps) in ref[p].items():
            gt, glp = got[p].get(rid, ([], None))
            same = [a == b for a, b in zip(toks, gt)]
            equal, total = equal + sum(same), total + len(toks)
            full += len(gt) == len(toks) and all(same)
            agree = same.index(False) if False in same else min(len(toks), len(gt))
            if agree < len(toks):
                diverged[rid] = agree
            for i in range(agree if lps and glp else 0):
                a, b = lps[i], glp[i]
                compared += 1
                d_chosen = max(d_chosen, abs(a[toks[i]] - b[toks[i]]))
                for t in set(a) & set(b) - {toks[i]}:
                    d = abs(a[t] - b[t])
                    d_alt, r_alt = max(d_alt, d), max(r_alt, d / max(1.0, abs(a[t])))
        share = equal / total if total else float("nan")
        good = equal == total and (d_chosen <= 1e-5 and d_alt <= 1e-5 if fp32 else d_chosen <= 0.05 and r_alt <= 0.03)
        ok &= good
        if not compared:                    # the spec pass asks for no logprobs: tokens only
            d_chosen = d_alt = r_alt = None
        out["passes"][p] = {"tokens": total, "equal_tokens": equal, "equal_share": share, "sequences": len(ref[p]),
                            "sequences_equal": full, "first_divergence": diverged, "logprob_positions": compared,
                            "max_abs_d_chosen_logprob": d_chosen,
                            "max_abs_d_alt_logprob": d_alt, "max_rel_d_alt_logprob": r_alt, "within_tolerance": good,
                            "counters_tp1": ref["counters"][p], "counters_tpN": got["counters"][p]}
    out["within_tolerance"] = ok and bool(out["passes"])
    return out


# ---------------------------------------------------------------------------------------------------------
# throughput and all-reduce
# ---------------------------------------------------------------------------------------------------------

def _bm_plan(plan: Plan, warmup: int, iters: int) -> bm.Plan:
    return bm.Plan(plan.prefill, plan.batches, plan.context, warmup, iters, plan.case_cap_s)


def _after(call, steps: int, dev: torch.device, timed_allreduce: bool) -> dict[str, Any] | None:
    """``steps`` more calls with rank 0's all-reduces timed (None without them)."""
    if not timed_allreduce or steps < 1:
        return None
    t0 = time.perf_counter()
    with CollectiveTimer(dev) as ct:
        for _ in range(steps):
            call()
        res = ct.result(steps)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    res["step_ms_while_timed"] = (time.perf_counter() - t0) * 1e3 / steps
    return res


def decode_case(runner: ModelRunner, B: int, plan: Plan, dev: torch.device, deadline: float,
                allreduce: bool) -> dict[str, Any]:
    vocab = runner.model.cfg.vocab_size
    seqs = [runner.new_seq() for _ in range(B)]
    try:
        per_step = max(1, 8192 // plan.context)
        toks: list[int] = []
        for j in range(0, B, per_step):
            items = [PrefillItem(s, torch.randint(0, vocab, (plan.context,)).tolist()) for s in seqs[j:j + per_step]]
            toks += runner.step(items, []).argmax(-1).tolist()
        state = {"toks": toks}

        def call() -> None:
            state["toks"] = runner.step([], list(zip(seqs, state["toks"]))).argmax(-1).tolist()
        m = bm._timed_loop(lambda _: call(), _bm_plan(plan, plan.warmup, plan.iters), dev, deadline)
        m["allreduce"] = _after(call, plan.allreduce_steps, dev, allreduce)
        return m
    finally:
        for s in seqs:
            runner.free_seq(s)


def prefill_case(runner: ModelRunner, N: int, L: int, plan: Plan, dev: torch.device, deadline: float,
                 allreduce: bool) -> dict[str, Any]:
    rows = torch.randint(0, runner.model.cfg.vocab_size, (N, L)).tolist()

    def once() -> None:
        seqs = [runner.new_seq() for _ in rows]
        try:
            runner.step([PrefillItem(s, x) for s, x in zip(seqs, rows)], [])
        finally:
            for s in seqs:
                runner.free_seq(s)
    m = bm.ours_prefill(runner, torch.tensor(rows), _bm_plan(plan, plan.warmup, plan.iters), dev, deadline)
    m["allreduce"] = _after(once, plan.allreduce_steps, dev, allreduce)
    return m


def throughput(rep: Report, runner: ModelRunner, plan: Plan, sections: set[str], dev: torch.device, tp: int,
               impl: str, model: str) -> None:
    cases = ([("decode", f"B={B}", B, 1) for B in plan.batches] if "decode" in sections else []) + \
            ([("prefill", f"{N}x{L}", N, L) for N, L in plan.prefill] if "prefill" in sections else [])
    for kind, shape, N, L in cases:
        what = f"{model} TP={tp} {impl} {kind} {shape}"
        if rep.over_budget(what):
            continue
        rep.log(what)
        deadline = time.perf_counter() + plan.case_cap_s
        try:
            m = (decode_case(runner, N, plan, dev, deadline, tp > 1) if kind == "decode" else
                 prefill_case(runner, N, L, plan, dev, deadline, tp > 1))
            p = pct([t * 1e3 for t in m["times"]])
            ar = m.get("allreduce")
            if ar:
                ar["share_of_step"] = ar["ms_per_step"] / p["p50"]
            rep.add({"section": "throughput", "model": model, "tp": tp, "impl": impl, "kind": kind, "shape": shape,
                     "tokens": N * L, "ms": p, "n": len(m["times"]), "tokens_per_s": N * L / (p["p50"] / 1e3),
                     "capped": m["capped"], "first_call_s": m["first_call_s"], "allreduce": ar})
        except Exception as e:  # noqa: BLE001
            rep.error(what, e)
        _free(dev)


# ---------------------------------------------------------------------------------------------------------
# Qwen3-Next-80B-A3B at the largest TP size
# ---------------------------------------------------------------------------------------------------------

def shard_bytes(hf_cfg: dict[str, Any], tp: int, dtype: torch.dtype) -> int:
    """Rank 0's parameter bytes of ``hf_cfg`` at ``tp`` (meta device: nothing allocated; folded shapes alike)."""
    from gdnserve.models.config import ModelConfig
    from gdnserve.models.qwen3_5 import HybridLM
    with torch.device("meta"):
        m = HybridLM(ModelConfig.from_hf(hf_cfg), 0, tp).to(dtype)
    return sum(p.numel() * (4 if n.endswith("A_log") else p.element_size()) for n, p in m.named_parameters())


def pool_bytes(hf_cfg: dict[str, Any], tp: int, cfg: EngineConfig, dtype: torch.dtype) -> int:
    """The state and KV pools of ``cfg`` on one rank."""
    from gdnserve.models.config import ModelConfig
    c = ModelConfig.from_hf(hf_cfg)
    g, a = c.gdn, c.attn
    esz = torch.finfo(dtype).bits // 8
    gdn = c.num_linear_layers * cfg.slots * (g.num_v_heads // tp * g.head_v_dim * g.head_k_dim * 4
                                             + (g.conv_kernel - 1) * (2 * g.num_k_heads * g.head_k_dim
                                                                      + g.num_v_heads * g.head_v_dim) // tp * esz)
    kv = (c.num_layers - c.num_linear_layers) * cfg.num_pages * cfg.page_size * 2 * max(1, a.num_kv_heads // tp) \
        * a.head_dim * esz
    return int(gdn + kv)


def tiny_next_hf_config() -> dict[str, Any]:
    """Qwen3-Next's family (model_type qwen3_next) at the CPU smoke size of ``tiny_hf_config``."""
    d = {k: v for k, v in tiny_hf_config().items() if k not in ("layer_types", "rope_parameters")}
    d.update(model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], intermediate_size=64,
             num_experts_per_tok=2, full_attention_interval=4)
    return d


def run_next(rep: Report, plan: Plan, dev: torch.device, tp: int, sections: set[str]) -> None:
    """Qwen3-Next-80B-A3B on CUDA (its family's tiny shape on CPU: the same code path, no memory check)."""
    cuda = dev.type == "cuda"
    hf_cfg, name = ((qwen3_next_hf_config(), "qwen3-next-80b-a3b") if cuda else
                    (tiny_next_hf_config(), "qwen3-next-tiny"))
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = EngineConfig(max_num_seqs=max(plan.batches), max_step_tokens=8192, max_model_len=4096,
                       num_pages=max(2048, max(plan.batches) * (plan.context // 16 + 8) + 1024), page_size=16,
                       cuda_graphs=False, tensor_parallel_size=tp)
    need = shard_bytes(hf_cfg, tp, dtype) + pool_bytes(hf_cfg, tp, cfg, dtype) + (8 << 30)
    free = [torch.cuda.mem_get_info(i)[0] for i in range(tp)] if cuda else None
    fit = not cuda or all(f > need for f in free)
    info = {"need_bytes_per_rank": need, "free_bytes": free, "fits": fit, "tp": tp, "model_config": hf_cfg,
            "summary": f"{name} at TP={tp}: {need / 2**30:.1f} GiB per rank (shard + pools + 8 GiB of activations)"
                       + (f", free {', '.join(f'{f / 2**30:.1f}' for f in free)} GiB" if free else "") + ": "
                       + ("runs" if fit else "skipped (does not fit)")}
    rep.res["qwen3_next_80b"] = info
    rep.note(info["summary"])
    if not fit or rep.over_budget(name):
        return
    rep.log(f"{name}: building the shards")
    t0 = time.perf_counter()
    session = TPSession(hf_cfg, dev, dtype, tp, cfg.runner_config(), chain=False)
    try:
        info["build_s"] = round(time.perf_counter() - t0, 1)
        cases = sections & {"decode", "prefill"} or {"decode", "prefill"}      # `--sections next` alone: both
        throughput(rep, session.runner(), plan, cases, dev, tp, "eager", name)
    finally:
        session.close()
        _free(dev)


# ---------------------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------------------

def run(device: torch.device, quick: bool, out_dir: Path, tps: list[int], sections: set[str], shape: str = "auto",
        layers: int | None = None, experts: int | None = None, batches: tuple[int, ...] | None = None,
        prefill: tuple[tuple[int, int], ...] | None = None, tp1_graphs: bool | None = None,
        budget_s: float = 480.0) -> dict[str, Any]:
    cuda = device.type == "cuda"
    if cuda:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")   # NVLink multicast off (the x2 machine's setting)
    plan = make_plan(cuda, quick)
    plan = replace(plan, batches=batches or plan.batches, prefill=prefill or plan.prefill)
    tp1_graphs = cuda if tp1_graphs is None else tp1_graphs
    hf_cfg = model_config(device, shape, layers, experts)
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = engine_config(plan)
    rc = cfg.runner_config()
    rep = Report("tp", "Tensor parallelism: TP=2 vs TP=1", device, out_dir, quick=quick, budget_s=budget_s,
                 table=table, model_config=hf_cfg, dtype=str(dtype), model_summary=model_summary(hf_cfg, dtype),
                 tp_sizes=tps, sections=sorted(sections), plan={k: v for k, v in plan.__dict__.items() if k != "serve"},
                 serve_workload=plan.serve.workloads[0].__dict__, gpus=torch.cuda.device_count() if cuda else 0,
                 nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"),
                 engine=f"max_num_seqs {cfg.max_num_seqs}, max_step_tokens {cfg.max_step_tokens}, {cfg.num_pages} "
                        f"KV pages of 16, spec_k {cfg.spec_k} (n-gram, replay), {cfg.slots} state slots, eager")
    stem = out_dir / f"tp_{rep.res['device_slug']}"
    rep.res["paths"] = {"json": str(stem.with_suffix(".json")), "md": str(stem.with_suffix(".md"))}
    model = "qwen3.5-35b-a3b" if hf_cfg["num_hidden_layers"] == FULL_LAYERS else f"{hf_cfg['num_hidden_layers']}-layer"
    eq: dict[int, dict[str, Any]] = {}
    torch.manual_seed(0)
    with torch.inference_mode():
        for tp in sorted(tps) if sections - {"next"} else []:
            if rep.over_budget(f"TP={tp}"):
                continue
            rep.log(f"TP={tp}: building the shards")
            t0 = time.perf_counter()
            try:
                session = TPSession(hf_cfg, device, dtype, tp, rc)
            except Exception as e:  # noqa: BLE001
                rep.error(f"TP={tp} start", e)
                continue
            rep.res.setdefault("build_s", {})[str(tp)] = round(time.perf_counter() - t0, 1)
            try:
                if "eq" in sections and not rep.over_budget(f"TP={tp} eq"):
                    rep.log(f"TP={tp}: equality prompts")
                    try:
                        eq[tp] = eq_outputs(session, cfg, plan, hf_cfg["vocab_size"])
                        if tp > 1 and 1 in eq:
                            rep.res.setdefault("equality", {})[str(tp)] = compare(eq[1], eq[tp], not cuda)
                            rep.write()
                    except Exception as e:  # noqa: BLE001
                        rep.error(f"TP={tp} eq", e)
                if sections & {"decode", "prefill"}:
                    throughput(rep, session.runner(), plan, sections, device, tp, "eager", model)
                    _free(device)
                    if tp == 1 and tp1_graphs and not _past(rep, TP1_EXTRAS_SHARE, "TP=1 graphs rows"):
                        runner = ModelRunner(session.model, replace(rc, cuda_graphs=True))
                        throughput(rep, runner, plan, sections, device, tp, "graphs", model)
                        runner = None
                        _free(device)
                share = TP1_EXTRAS_SHARE if tp == 1 and len(tps) > 1 else SERVE_SHARE
                if "serve" in sections and not _past(rep, share, f"TP={tp} serve"):
                    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
                    engine_for = lambda mode: session.engine(cfg.with_(auto_checkpoints=mode != "none"))  # noqa: E731
                    bs.serve_rows(rep, plan.serve, engine_for, hf_cfg["vocab_size"], params, ("none", "fused", "score"),
                                  device, close_engines=False, section="serve", tp=tp)
            finally:
                session.close()
                session = None
                _free(device)
        if "next" in sections and max(tps) > 1:
            try:
                run_next(rep, plan, device, max(tps), sections)
            except Exception as e:  # noqa: BLE001
                rep.error("Qwen3-Next-80B-A3B", e)
    return rep.finish()


# ---------------------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------------------

def _eq_lines(res: dict[str, Any]) -> list[str]:
    L = []
    for tp, e in (res.get("equality") or {}).items():
        L += [f"Greedy outputs, TP={tp} vs TP=1 (tolerance — {e['tolerance']}): "
              + ("**within tolerance**" if e["within_tolerance"] else "**NOT within tolerance**") + ".", "",
              "| pass | equal tokens | sequences equal | max abs d logprob (chosen) | max abs d (top-2 alternatives) "
              "| rel d (alt.) | drafted / accepted TP=1 | TP=" + tp + " | checkpoint hits TP=1 / TP=" + tp + " |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for p, r in e["passes"].items():
            c1, cn = r["counters_tp1"], r["counters_tpN"]
            d = lambda k: "—" if r[k] is None else f"{r[k]:.2e}"  # noqa: E731
            L.append(f"| {p} | {r['equal_tokens']} / {r['tokens']} ({100 * r['equal_share']:.1f} %) | "
                     f"{r['sequences_equal']} / {r['sequences']} | {d('max_abs_d_chosen_logprob')} | "
                     f"{d('max_abs_d_alt_logprob')} | {d('max_rel_d_alt_logprob')} | "
                     f"{c1['spec_drafted']} / {c1['spec_accepted']} | {cn['spec_drafted']} / {cn['spec_accepted']} | "
                     f"{c1['checkpoint_hits']} / {cn['checkpoint_hits']} |")
        L.append("")
    return L


def _throughput_lines(res: dict[str, Any]) -> list[str]:
    rows = [r for r in res["rows"] if r.get("section") == "throughput"]
    if not rows:
        return []
    L = ["ms per call: median [P10–P90] (perf_counter, device synchronised around the call); tokens/s from the "
         "median. all-reduce: rank 0's dist.all_reduce calls per step and their time per step (CUDA events around "
         "each call: the NCCL kernel including the wait for the other rank), and that time's share of the median "
         "step. TP=2 / TP=1: tokens/s ratio against TP=1 eager (and graphs).", "",
         "| model | case | TP | impl | ms | tokens/s | vs TP=1 eager | vs TP=1 graphs | all-reduce calls | "
         "all-reduce ms/step | share | n |",
         "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    base = {(r["model"], r["kind"], r["shape"], r["impl"]): r["tokens_per_s"] for r in rows if r["tp"] == 1}
    for r in rows:
        key = (r["model"], r["kind"], r["shape"])
        e, g = base.get(key + ("eager",)), base.get(key + ("graphs",))
        ar = r.get("allreduce") or {}
        impl = r["impl"] + (" (capped)" if r["capped"] else "")
        L.append(f"| {r['model']} | {r['kind']} {r['shape']} | {r['tp']} | {impl} "
                 f"| {fmt_pct(r['ms'], '.2f')} | {r['tokens_per_s']:,.0f} | "
                 + (f"{r['tokens_per_s'] / e:.2f}" if e and r["tp"] > 1 else "") + " | "
                 + (f"{r['tokens_per_s'] / g:.2f}" if g and r["tp"] > 1 else "") + " | "
                 + (f"{ar['calls_per_step']:.0f} | {ar['ms_per_step']:.3f} | {100 * ar['share_of_step']:.0f} %"
                    if ar else "| |") + f" | {r['n']} |")
    return L + [""]


def _serve_lines(res: dict[str, Any]) -> list[str]:
    rows = [r for r in res["rows"] if r.get("section") == "serve"]
    if not rows:
        return []
    L = ["Serve workload (bench_serve's RFC groups, max_tokens 1, eager steps at every TP size): QPS = requests per "
         "second over the pass; TTFT ms median / P90; hits: requests started from the prefix state.", "",
         "| workload | TP | mode | pass | groups × req | QPS | TTFT ms median | TTFT P90 | steps | hits | agree |",
         "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ag = r.get("first_token_agreement_vs_none")
        L.append(f"| {r['workload']} | {r['tp']} | {r['mode']} | {r['pass']} | {r['groups']} × "
                 f"{r['requests'] // r['groups']} | {r['qps']:.1f} | {r['ttft_ms']['p50']:.1f} | "
                 f"{r['ttft_ms']['p90']:.1f} | {r['steps']} | {r['hits']} | "
                 + ("" if ag is None else f"{100 * ag:.0f} %") + " |")
    return L + [""]


def table(res: dict[str, Any]) -> list[str]:
    L = [res.get("model_summary", ""), "",
         f"Engine (every TP size): {res.get('engine')}; TP sizes {res.get('tp_sizes')}, "
         f"{res.get('gpus')} GPUs visible, NCCL_NVLS_ENABLE={res.get('nccl_nvls_enable')}; shard build s "
         f"{res.get('build_s', {})}.", ""]
    L += _eq_lines(res) + _throughput_lines(res) + _serve_lines(res)
    if res.get("qwen3_next_80b"):
        L.append(res["qwen3_next_80b"]["summary"] + ".")
    return L


def _pairs(text: str) -> tuple[tuple[int, int], ...]:
    return tuple(tuple(int(v) for v in x.split("x")) for x in text.split(","))  # type: ignore[misc]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_tp", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto", help="cuda, cpu or auto")
    p.add_argument("--tp", default="1,2", help="comma-separated TP sizes (default 1,2; 1 is the reference)")
    p.add_argument("--quick", action="store_true", help="fewer timed calls and equality tokens")
    p.add_argument("--shape", choices=("auto", "full", "quick", "tiny"), default="auto",
                   help="auto (CUDA: full-size Qwen3.5-35B-A3B; CPU: tiny), full, quick (8 layers, 64 experts), tiny")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--experts", type=int, default=None)
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--batches", default=None, help="decode batch sizes (default CUDA 1,16,64,256)")
    p.add_argument("--prefill", default=None, help="prefill cases NxL (default CUDA 1x4096,8x1024)")
    p.add_argument("--tp1-graphs", choices=("on", "off"), default=None,
                   help="TP=1 throughput with CUDA graphs too (default: on CUDA)")
    p.add_argument("--time-budget", type=float, default=480.0, help="seconds; later cases are skipped past it")
    p.add_argument("--out", default="benchmarks/results", help="output folder (tp_<device>.json / .md)")
    a = p.parse_args(argv)
    sections = {s for s in a.sections.split(",") if s}
    bad = sections - set(SECTIONS)
    tps = sorted({int(x) for x in a.tp.split(",")})
    if bad or not tps or tps[0] < 1:
        p.error(f"--sections: unknown {sorted(bad)}" if bad else "--tp: sizes >= 1")
    if any(t > 1 for t in tps) and 1 not in tps and "eq" in sections:
        tps = [1] + tps                     # the equality section's reference
    return run_cli("tp", a.device, lambda device: run(
        device, a.quick, Path(a.out), tps, sections, a.shape, a.layers, a.experts,
        tuple(int(x) for x in a.batches.split(",")) if a.batches else None, _pairs(a.prefill) if a.prefill else None,
        None if a.tp1_graphs is None else a.tp1_graphs == "on", a.time_budget))


if __name__ == "__main__":
    sys.exit(main())
