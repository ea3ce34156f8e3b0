"""Model-level throughput: prefill and decode tokens/s of gdnserve's model and of HF transformers'
``Qwen3_5MoeForCausalLM`` on the *same* random weights, measured in the same run.

Run ``gdnserve bench model`` or ``python -m benchmarks.bench_model`` (options: --device, --quick, --out,
--no-hf, --layers, --experts, --time-budget). Writes ``model_<device>_<date>.json`` and ``.md``.

Model: ``benchmarks/random_model.py`` (Qwen3.5-35B-A3B GDN / attention / MoE shapes, 8 layers and 64
experts by default on CUDA, bf16; a tiny fp32 model on CPU). The HF model is built first and gdnserve's is
loaded from its state dict through our checkpoint loader, so both hold identical weights; the rel-RMS of
the two models' last-token logits on one prompt is recorded as a sanity check.

* prefill N x L (CUDA: 1x4096, 8x1024): ours = one ``ModelRunner.step`` of N fresh sequences (plan build,
  upload, forward, last-token logits); HF = one forward of ``[N, L]`` ids with ``logits_to_keep=1``.
* decode B (CUDA: 1, 16, 64, 256) at a context of 128 prompt tokens: steady-state steps, each feeding
  every sequence its previous argmax; ours = ``ModelRunner.step([], decodes)`` + argmax + host copy
  (what one engine step does, without the scheduler); HF = a manual loop over its own cache
  (``cache=``, ``logits_to_keep=1``) + argmax. HF cases stop early when they exceed a per-case time cap
  (noted in the results).

Times: perf_counter around the call with the device synchronised before and after (host work included;
no CUDA graphs on either side). tokens/s = tokens of the call / median time. Floors from ceilings measured
in this run: prefill = FLOPs (2 x active parameters per token + causal attention) / bf16 matmul rate;
decode = bytes (every non-expert weight once, the experts a uniform router touches, GDN conv + SSM
state read and written, KV read) / copy rate.
"""
from __future__ import annotations

import argparse
import gc
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_ops import resolve_device
from benchmarks.e2e_report import Report, fmt_pct, model_summary, one_thread_on_cpu, pct, timed
from benchmarks.random_model import build_hf_model, build_random_model, config_for, ours_from_hf
from benchmarks.timing import measure_ceilings
from gdnserve.engine.model_runner import ModelRunner, PrefillItem, RunnerConfig
from gdnserve.ops.numerics import rel_rms


@dataclass(frozen=True)
class Plan:
    prefill: tuple[tuple[int, int], ...]
    batches: tuple[int, ...]
    context: int
    warmup: int
    iters: int
    hf_case_cap_s: float


def make_plan(cuda: bool, quick: bool) -> Plan:
    if cuda:
        return Plan(((1, 4096), (8, 1024)), (1, 16, 64, 256), 128, 1 if quick else 2, 3 if quick else 8, 12.0)
    return Plan(((1, 64), (4, 16)), (1, 4), 16, 1, 2 if quick else 4, 20.0)


def hf_gdn_path() -> dict[str, str]:
    """Which implementation transformers bound for each GDN function (fla / causal_conv1d or its torch fallback)."""
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as m
    out = {}
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                 "causal_conv1d_update"):
        try:
            impl = inspect.getclosurevars(getattr(m, name)).nonlocals.get("implementation")
            out[name] = f"{impl.__module__}.{impl.__qualname__}" if impl is not None else "unknown"
        except (AttributeError, TypeError):
            out[name] = "unknown"
    return out


def decode_bytes(model, B: int, ctx: int) -> int:
    """Essential bytes of one decode step (module docstring): weights, GDN state, KV."""
    cfg, a, g = model.cfg, model.cfg.attn, model.cfg.gdn
    E, k = cfg.mlp.num_experts, cfg.mlp.num_experts_per_tok
    dense = expert = 0
    for name, p in model.named_parameters():
        if name.startswith("embed_tokens"):
            continue
        if ".experts_" in name:
            expert += p[0].numel() * p.element_size()
        else:
            dense += p.numel() * p.element_size()
    # ``expert`` is one expert's bytes summed over the MoE layers; a uniform router touches this many per layer:
    touched = E * (1 - (1 - k / E) ** B) if E else 0
    s_a = model.embed_tokens.weight.element_size()
    state = cfg.num_linear_layers * 2 * B * (g.num_v_heads * g.head_v_dim * g.head_k_dim * 4
                                             + (g.conv_kernel - 1) * g.conv_dim * s_a)
    kv = (cfg.num_layers - cfg.num_linear_layers) * B * ctx * a.num_kv_heads * a.head_dim * 2 * s_a
    return int(dense + touched * expert + state + kv)


def prefill_flops(model, N: int, L: int) -> float:
    cfg, a = model.cfg, model.cfg.attn
    active = 0
    for name, p in model.named_parameters():
        if name.startswith("embed_tokens"):
            continue
        active += p[0].numel() * cfg.mlp.num_experts_per_tok if ".experts_" in name else p.numel()
    attn_layers = cfg.num_layers - cfg.num_linear_layers
    return 2.0 * N * L * active + attn_layers * N * 2.0 * L * L * a.num_heads * a.head_dim


def _rand_ids(vocab: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, vocab, shape)


def parity(runner: ModelRunner, hf, vocab: int, dev: torch.device) -> float:
    """rel-RMS of the two models' last-token logits on one random 64-token prompt."""
    ids = _rand_ids(vocab, 1, 64)
    seq = runner.new_seq()
    got = runner.step([PrefillItem(seq, ids[0].tolist())], [])[0]
    runner.free_seq(seq)
    return rel_rms(got, hf(ids.to(dev), logits_to_keep=1).logits[0, -1].float())


def ours_prefill(runner: ModelRunner, ids: torch.Tensor, plan: Plan, dev: torch.device) -> list[float]:
    """ids: [N, L] host int64; each call prefills N fresh sequences (freed after the call)."""
    rows, times = ids.tolist(), []
    for i in range(plan.warmup + plan.iters):
        seqs = [runner.new_seq() for _ in rows]
        _, t = timed(lambda: runner.step([PrefillItem(s, x) for s, x in zip(seqs, rows)], []), dev)
        for s in seqs:
            runner.free_seq(s)
        if i >= plan.warmup:
            times.append(t)
    return times


def ours_decode(runner: ModelRunner, B: int, plan: Plan, dev: torch.device) -> list[float]:
    vocab = runner.model.cfg.vocab_size
    seqs = [runner.new_seq() for _ in range(B)]
    per_step = max(1, 8192 // plan.context)                 # prompts prefilled 8192 tokens a step
    toks: list[int] = []
    for j in range(0, B, per_step):
        items = [PrefillItem(s, _rand_ids(vocab, plan.context).tolist()) for s in seqs[j:j + per_step]]
        toks += runner.step(items, []).argmax(-1).tolist()
    times = []
    for i in range(plan.warmup + plan.iters):
        toks, t = timed(lambda: runner.step([], list(zip(seqs, toks))).argmax(-1).tolist(), dev)
        if i >= plan.warmup:
            times.append(t)
    for s in seqs:
        runner.free_seq(s)
    return times


def _capped_loop(call, plan: Plan, dev: torch.device) -> tuple[list[float], bool]:
    """Warm-up + timed calls of ``call()``, stopping once the calls have taken ``plan.hf_case_cap_s`` (then the
    warm-up samples are kept if nothing else was measured). The first call (fla's autotuning and compiles: 13 s on
    the H200) is run untimed and not counted against the cap. Returns (seconds per call, capped)."""
    timed(call, dev)
    times, total = [], plan.warmup + plan.iters
    for i in range(total):
        times.append(timed(call, dev)[1])
        if sum(times) > plan.hf_case_cap_s and i < total - 1:
            return (times[plan.warmup:] or times), True
    return times[plan.warmup:], False


def hf_prefill(hf, ids: torch.Tensor, plan: Plan, dev: torch.device) -> tuple[list[float], bool]:
    ids = ids.to(dev)
    return _capped_loop(lambda: hf(ids, use_cache=False, logits_to_keep=1), plan, dev)


def hf_decode(hf, B: int, plan: Plan, dev: torch.device, vocab: int) -> tuple[list[float], bool]:
    out = hf(_rand_ids(vocab, B, plan.context).to(dev), use_cache=True, logits_to_keep=1)
    state = {"cache": out.cache, "next": out.logits[:, -1].argmax(-1, keepdim=True)}

    def step() -> list[int]:
        o = hf(state["next"], cache=state["cache"], use_cache=True, logits_to_keep=1)
        state["next"] = o.logits[:, -1].argmax(-1, keepdim=True)
        return state["next"].flatten().tolist()
    return _capped_loop(step, plan, dev)


def _row(kind: str, shape: str, tokens: int, impl: str, times: list[float], floor_s: float | None,
         capped: bool = False) -> dict[str, Any]:
    p = pct([t * 1e3 for t in times])
    return {"kind": kind, "shape": shape, "impl": impl, "tokens": tokens, "ms": p, "n": len(times),
            "tokens_per_s": tokens / (p["p50"] / 1e3), "floor_ms": None if floor_s is None else floor_s * 1e3,
            "pct_of_floor": None if floor_s is None else 100 * floor_s * 1e3 / p["p50"], "capped": capped}


def table(res: dict[str, Any]) -> list[str]:
    c = res.get("ceilings") or {}
    L = [res.get("model_summary", ""), "",
         f"HF transformers {res.get('transformers') or '—'}; its GDN path: {res.get('hf_gdn_path_summary', '—')}. "
         f"Same weights: last-token logits rel-RMS ours vs HF = {res.get('parity_rel_rms', '—')}.", ""]
    if c:
        L += [f"Ceilings measured in this run: copy {c['copy_TBps']:.3g} TB/s, bf16 matmul "
              f"{c['bf16_matmul_TFLOPs']:.3g} TFLOP/s.", ""]
    L += ["ms per call: median [P10–P90] of perf_counter around the call, device synchronised before and after. "
          "tokens/s from the median. % floor: the floor (FLOPs / bf16 rate for prefill, essential bytes / copy "
          "rate for decode; fp32 rate for an fp32 model) over the median. ours/HF: tokens/s ratio.", "",
          "| case | impl | ms | tokens/s | floor ms | % floor | ours/HF | n |",
          "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    ours = {(r["kind"], r["shape"]): r for r in res["rows"] if r["impl"] == "gdnserve"}
    for r in res["rows"]:
        ratio = ""
        if r["impl"] == "hf" and (r["kind"], r["shape"]) in ours:
            ratio = f"{ours[(r['kind'], r['shape'])]['tokens_per_s'] / r['tokens_per_s']:.2f}"
        fl = "—" if r["floor_ms"] is None else f"{r['floor_ms']:.2f}"
        pf = "—" if r["pct_of_floor"] is None else f"{r['pct_of_floor']:.0f} %"
        L.append(f"| {r['kind']} {r['shape']} | {r['impl']}{' (capped)' if r['capped'] else ''} | "
                 f"{fmt_pct(r['ms'], '.2f')} | {r['tokens_per_s']:,.0f} | {fl} | {pf} | {ratio} | {r['n']} |")
    return L


def _measure(rep: Report, plan: Plan, hf_cfg: dict[str, Any], dtype: torch.dtype, device: torch.device,
             use_hf: bool) -> None:
    cuda, hf = device.type == "cuda", None
    rep.res["ceilings"] = measure_ceilings(device, quick=True)
    if use_hf:
        try:
            import transformers
            rep.res["transformers"] = transformers.__version__
            rep.log("building the HF model on the device")
            hf = build_hf_model(hf_cfg, device, dtype)
            rep.res["hf_gdn_path"] = hf_gdn_path()
            rep.res["hf_gdn_path_summary"] = (
                ("fla kernels" if "fla" in str(rep.res["hf_gdn_path"]) else "its PyTorch fallback")
                + f" (details in the JSON); MoE experts `{getattr(hf.config, '_experts_implementation', '?')}`, "
                f"attention `{getattr(hf.config, '_attn_implementation', '?')}`")
        except Exception as e:  # noqa: BLE001 — no HF: our rows alone
            rep.error("building the HF model (HF rows skipped)", e)
            hf = None
    rep.log("building gdnserve's model" + (" from the HF weights" if hf is not None else ""))
    ours = ours_from_hf(hf, hf_cfg, device, dtype) if hf is not None else build_random_model(hf_cfg, device, dtype)
    runner = ModelRunner(ours, RunnerConfig(num_slots=max(plan.batches) + 2, num_pages=4096, page_size=16))
    if hf is not None:
        try:
            rep.res["parity_rel_rms"] = f"{parity(runner, hf, hf_cfg['vocab_size'], device):.2e}"
            rep.log(f"parity: rel-RMS {rep.res['parity_rel_rms']}")
        except Exception as e:  # noqa: BLE001
            rep.error("parity check", e)
    cases = [("prefill", f"{N}x{L}", N, L) for N, L in plan.prefill]
    cases += [("decode", f"B={B}", B, 1) for B in plan.batches]
    for kind, shape, N, L in cases:
        if rep.over_budget(f"{kind} {shape}"):
            continue
        rate = rep.res["ceilings"]["bf16_matmul_TFLOPs" if dtype == torch.bfloat16 else "fp32_matmul_TFLOPs"]
        floor = (prefill_flops(ours, N, L) / (rate * 1e12) if kind == "prefill"
                 else decode_bytes(ours, N, plan.context) / (rep.res["ceilings"]["copy_TBps"] * 1e12))
        ids = _rand_ids(hf_cfg["vocab_size"], N, L)             # the same prompts for both (prefill)
        rep.log(f"{kind} {shape}: gdnserve")
        try:
            times = ours_prefill(runner, ids, plan, device) if kind == "prefill" else ours_decode(runner, N, plan, device)
            rep.add(_row(kind, shape, N * L, "gdnserve", times, floor))
        except Exception as e:  # noqa: BLE001
            rep.error(f"{kind} {shape} gdnserve", e)
        if hf is None:
            continue
        rep.log(f"{kind} {shape}: HF")
        try:
            times, capped = (hf_prefill(hf, ids, plan, device) if kind == "prefill"
                             else hf_decode(hf, N, plan, device, hf_cfg["vocab_size"]))
            rep.add(_row(kind, shape, N * L, "hf", times, floor, capped))
        except Exception as e:  # noqa: BLE001
            rep.error(f"{kind} {shape} HF", e)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def run(device: torch.device, quick: bool, out_dir: Path, use_hf: bool, layers: int | None, experts: int | None,
        budget_s: float) -> dict[str, Any]:
    cuda = device.type == "cuda"
    plan = make_plan(cuda, quick)
    hf_cfg = config_for(device, layers, experts)
    dtype = torch.bfloat16 if cuda else torch.float32
    rep = Report("model", "Model throughput: gdnserve vs HF transformers", device, out_dir, quick=quick,
                 budget_s=budget_s, table=table, model_config=hf_cfg, dtype=str(dtype),
                 model_summary=model_summary(hf_cfg, dtype), plan=plan.__dict__)
    torch.manual_seed(0)
    try:
        with torch.inference_mode():
            _measure(rep, plan, hf_cfg, dtype, device, use_hf)
    except Exception as e:  # noqa: BLE001 — set-up failed: the report says so
        rep.error("set-up", e)
    if any(r["capped"] for r in rep.res["rows"]):
        rep.note(f"HF cases marked capped stopped after {plan.hf_case_cap_s:.0f} s of calls (fewer samples).")
    return rep.finish()


def run_from_args(args: argparse.Namespace) -> int:
    try:
        device = resolve_device(args.device)
    except (ValueError, RuntimeError) as e:
        print(f"bench model: {e}", file=sys.stderr)
        return 2
    with one_thread_on_cpu(device):
        res = run(device, args.quick, Path(args.out), args.hf, args.layers, args.experts, args.time_budget)
    return 1 if res["errors"] else 0


def main(argv: list[str] | None = None) -> int:
    from gdnserve.entrypoints.cli import add_bench_model_arguments
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_model", description=__doc__.split("\n")[0])
    add_bench_model_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
