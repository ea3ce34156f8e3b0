"""Model-level throughput: prefill and decode tokens/s of gdnserve's model and of HF transformers'
``Qwen3_5MoeForCausalLM`` on the *same* random weights, measured in the same run; and a diagnosis of the
bf16 parity gap between the two.

Run ``gdnserve bench model`` or ``python -m benchmarks.bench_model`` (options: --device, --quick, --out,
--no-hf, --layers, --experts, --time-budget; ``python -m`` also takes --diagnosis on|off|only, --shape
auto|bench, --vocab). Writes ``model_<device>_<date>.json`` and ``.md``. The HF rows need transformers (the
``bench`` extra: ``pip install -e '.[bench]'``); without it they are skipped with a note and ours still run.

Model: ``benchmarks/random_model.py``. On CUDA by default the full-size Qwen3.5-35B-A3B (all 40 layers, 256
experts, its 3 GDN : 1 attention pattern; random bf16 weights drawn on the device, 70 GB); ``--quick`` (or
``--layers`` / ``--experts``) gives the 8-layer, 64-expert cut with the same per-layer shapes. A tiny fp32
model on CPU, or the CUDA cut with ``--shape bench``. HF's model does not fit beside ours at full size (two
70 GB copies and the state pools exceed the H200's 139 GiB), so a full-size run has no HF rows and no bf16
diagnosis (both need HF; ``--quick`` keeps them). The report also sizes Qwen3-Next-80B-A3B's layer pattern
(48 layers, 512 experts top-10) without allocating it and says whether it fits the device
(``qwen3_next_80b`` in the JSON). With HF, the HF model is built first and gdnserve's is loaded from its
state dict through our checkpoint loader, so both hold identical weights (bf16-representable values also in
an fp32 run, so that the diagnosis can switch dtype without changing them).

Order (each case has a time share, below): parity first (it also takes HF's first call: fla's autotuning),
then decode B (CUDA: 1, 16, 64, 256), then prefill N x L (CUDA: 1x4096, 8x1024), then the second dtype of
the diagnosis.

* decode B at a context of 128 prompt tokens: steady-state steps, each feeding every sequence its previous
  argmax; ours = ``ModelRunner.step([], decodes)`` + argmax + host copy (what one engine step does, without
  the scheduler); HF = a manual loop over its own cache (``cache=``, ``logits_to_keep=1``) + argmax.
* prefill N x L: ours = one ``ModelRunner.step`` of N fresh sequences (plan build, upload, forward,
  last-token logits); HF = one forward of ``[N, L]`` ids with ``logits_to_keep=1``.

Warm-up: every case shape gets untimed calls before its timed ones, on both sides: ours ``warmup`` calls,
HF one untimed first call (fla's autotuning and Triton compiles land there; its time is in the JSON and the
table) then ``warmup`` more. Time budget: the cases share what is left of ``--time-budget`` after set-up and
parity, minus a reserve for the diagnosis (``diag_share``); each case gets the remaining time divided by
the cases still to run, unspent time rolls over. A case whose share is spent stops its timed calls
(``capped``, fewer samples); HF is skipped with a note when the share is gone before it starts, and a case
found over the whole budget is skipped (listed) instead of running into the caller's timeout. HF's timed
calls also stop after ``hf_case_cap_s`` of calls.

bf16 parity diagnosis: on ``diag_prompts`` random prompts of ``diag_len`` tokens, last-token logits of ours
and HF in bf16 and in fp32 with the same (bf16-representable) weights, their pairwise rel-RMS, the share of
argmax agreement, and the share of MoE (token, layer) top-k expert sets that differ between runs (each MoE
block's own router re-run on its input by a forward pre-hook). The run's dtype is measured with the parity
check at the start; the other dtype at the end (HF's parameters converted in place, exactly, and ours
rebuilt from them); ``--diagnosis only`` runs both dtypes without the throughput cases, ``off`` the parity
check alone. On CUDA the fp32 runs trace Triton's default-precision fp32 dots as IEEE (``ieee_fp32_dots``:
fla's would be TF32). The markdown gets a table and one sentence of interpretation generated from the
numbers.

Times: perf_counter around the call with the device synchronised before and after (host work included).
HF runs eagerly; ours runs the ModelRunner's default, which captures decode and prefill steps in CUDA graphs
when the model allows it (on first use of a bucket, i.e. in the untimed warm-up; ``ours_cuda_graphs`` in the
JSON says whether it did, ``graph_stats`` how many steps replayed). tokens/s = tokens of the call / median time. Floors from ceilings measured
in this run: prefill = FLOPs (2 x active parameters per token — router, shared expert and top-k routed
experts; the lm head only for each sequence's last token — + causal attention) / bf16 matmul rate;
decode = bytes (every non-expert weight once, the experts a uniform router touches, GDN conv + SSM
state read and written, KV read) / copy rate.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from benchmarks.e2e_report import Report, fmt_pct, model_summary, pct, run_cli, timed
from benchmarks.random_model import (
    VOCAB,
    bench_hf_config,
    build_hf_model,
    build_random_model,
    config_for,
    ours_from_hf,
    param_bytes,
    qwen3_next_hf_config,
)
from benchmarks.timing import measure_ceilings
from gdnserve.engine.cache.sequence import PrefillItem
from gdnserve.engine.execution.model_runner import ModelRunner, RunnerConfig
from gdnserve.ops.numerics import rel_rms


@dataclass(frozen=True)
class Plan:
    prefill: tuple[tuple[int, int], ...]
    batches: tuple[int, ...]
    context: int
    warmup: int
    iters: int
    hf_case_cap_s: float
    diag_prompts: int = 4         # prompts of the parity check / bf16 diagnosis
    diag_len: int = 128           # tokens per prompt
    diag_share: float = 0.25      # share of the time budget kept for the diagnosis' second dtype (at the end)


def make_plan(cuda: bool, quick: bool) -> Plan:
    if cuda:
        return Plan(((1, 4096), (8, 1024)), (1, 16, 64, 256), 128, 1 if quick else 2, 3 if quick else 8, 12.0,
                    4, 128, 0.25)
    return Plan(((1, 64), (4, 16)), (1, 4), 16, 1, 2 if quick else 4, 20.0, 4, 32, 0.25)


def cases_in_order(plan: Plan) -> list[tuple[str, str, int, int]]:
    """(kind, shape, N, L): decode first (small batches first), then prefill."""
    return ([("decode", f"B={B}", B, 1) for B in plan.batches]
            + [("prefill", f"{N}x{L}", N, L) for N, L in plan.prefill])


def transformers_missing() -> str | None:
    """Why HF's rows cannot run (transformers not importable: it comes with the ``bench`` and ``test`` extras, not
    with the package), or None. A fresh install has no transformers, and its ``gdnserve bench model`` must still
    time ours."""
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        return str(e) or type(e).__name__
    return None


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
    """FLOPs of prefilling N sequences of L tokens: every token through the router, the shared expert and its
    top-k routed experts (one expert's parameters x k) and every other non-embedding weight; the lm head for
    each sequence's last token only (the step returns those logits); causal attention 2 L^2 H Dh per sequence
    and attention layer."""
    cfg, a = model.cfg, model.cfg.attn
    active = head = 0
    for name, p in model.named_parameters():
        if name.startswith("embed_tokens"):
            continue
        if name.startswith("lm_head"):
            head += p.numel()
        else:
            active += p[0].numel() * cfg.mlp.num_experts_per_tok if ".experts_" in name else p.numel()
    if model.lm_head is None:                           # tied: the head is the embedding matrix
        head = model.embed_tokens.weight.numel()
    attn_layers = cfg.num_layers - cfg.num_linear_layers
    return 2.0 * N * L * active + 2.0 * N * head + attn_layers * N * 2.0 * L * L * a.num_heads * a.head_dim


def _rand_ids(vocab: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, vocab, shape)


def _tag(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}.get(dtype, str(dtype))


# ---------------------------------------------------------------------------------------------------------
# bf16 parity diagnosis
# ---------------------------------------------------------------------------------------------------------

DIAG_PAIRS = (("ours_bf16", "hf_fp32"), ("hf_bf16", "hf_fp32"), ("ours_bf16", "hf_bf16"),
              ("ours_fp32", "hf_fp32"), ("ours_bf16", "ours_fp32"))


def _is_moe_block(m: torch.nn.Module) -> bool:
    """gdnserve's SparseMoE (has ``route``) or HF's ``*SparseMoeBlock`` (a ``gate`` router module)."""
    return (callable(getattr(m, "route", None)) and hasattr(m, "gate")) or type(m).__name__.endswith("SparseMoeBlock")


def _topk_sets(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The block's own routing of x ([..., hidden]): its top-k expert ids per token, sorted, [T, k] on the host."""
    x = x.reshape(-1, x.shape[-1])
    if callable(getattr(block, "route", None)):
        idx = block.route(x)[1]
    else:
        out = block.gate(x)
        if isinstance(out, tuple) and len(out) >= 3 and not out[2].is_floating_point():
            idx = out[2]                                   # HF's TopKRouter: (logits, scores, indices)
        else:                                              # a plain linear router: top-k of its logits
            logits = out[0] if isinstance(out, tuple) else out
            k = getattr(block.gate, "top_k", None) or getattr(block, "top_k", None)
            idx = torch.topk(torch.softmax(logits.float(), -1), k, dim=-1).indices
    return idx.sort(-1).values.cpu()


class RoutingCapture:
    """Forward pre-hooks on every MoE block of ``model`` recording the block's top-k expert sets of each call.
    ``sets()``: [MoE layers, tokens, k] (calls concatenated in order), or None if the model has no MoE block."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.blocks = [m for m in model.modules() if _is_moe_block(m)]
        self.calls: list[list[torch.Tensor]] = [[] for _ in self.blocks]
        self.handles: list[Any] = []

    def __enter__(self) -> "RoutingCapture":
        for i, b in enumerate(self.blocks):
            self.handles.append(b.register_forward_pre_hook(
                lambda mod, args, i=i: self.calls[i].append(_topk_sets(mod, args[0]))))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def sets(self) -> torch.Tensor | None:
        if not self.blocks or not all(self.calls):
            return None
        return torch.stack([torch.cat(c, 0) for c in self.calls])


def ours_logits(runner: ModelRunner, ids: torch.Tensor) -> torch.Tensor:
    """Last-token logits [N, V] (fp32, host) of N fresh sequences prefilled in one step (freed after)."""
    seqs = [runner.new_seq() for _ in range(ids.shape[0])]
    try:
        return runner.step([PrefillItem(s, x) for s, x in zip(seqs, ids.tolist())], []).float().cpu()
    finally:
        for s in seqs:
            runner.free_seq(s)


def hf_logits(hf, ids: torch.Tensor, dev: torch.device) -> torch.Tensor:
    return hf(ids.to(dev), use_cache=False, logits_to_keep=1).logits[:, -1].float().cpu()


def flip_fraction(a: torch.Tensor | None, b: torch.Tensor | None) -> tuple[float | None, list[float] | None]:
    """Share of (layer, token) top-k sets that differ between two captures, and per MoE layer."""
    if a is None or b is None or a.shape != b.shape:
        return None, None
    diff = (a != b).any(-1).float()
    return diff.mean().item(), [round(v, 4) for v in diff.mean(1).tolist()]


def interpret(rel: dict[str, float], flips: dict[str, float | None]) -> str:
    """One sentence on the bf16 gap from the diagnosis' numbers (keys ``"x vs y"`` of DIAG_PAIRS)."""
    g = lambda x, y: rel.get(f"{x} vs {y}")  # noqa: E731
    a, b, c, d = g("ours_bf16", "hf_fp32"), g("hf_bf16", "hf_fp32"), g("ours_bf16", "hf_bf16"), g("ours_fp32", "hf_fp32")
    fo, fh = flips.get("ours_bf16 vs ours_fp32"), flips.get("hf_bf16 vs hf_fp32")
    fl = ""
    if fo is not None or fh is not None:
        fl = (" (bf16 changes " + " / ".join(f"{100 * v:.1f} % ({w})" for v, w in ((fo, "ours"), (fh, "HF"))
                                            if v is not None) + " of the MoE (token, layer) top-k sets vs fp32)")
    if a is None or b is None:
        for v, t in ((c, "bf16"), (d, "fp32")):
            if v is not None:
                fb = flips.get(f"ours_{t} vs hf_{t}")
                return (f"Only the {t} pair was measured (the other dtype's runs are missing): ours vs HF {t} "
                        f"rel-RMS {v:.2e}" + (f", {100 * fb:.1f} % of the routing top-k sets differ"
                                              if fb is not None else "") + ".")
        return "Not enough runs measured for a diagnosis."
    if d is not None and d > max(1e-3, 0.2 * min(a, b)):
        return (f"Ours and HF disagree in fp32 too (rel-RMS {d:.2e}, comparable to the bf16 gaps {a:.2e} / {b:.2e}): "
                "the fp32 runs are no clean reference - a real mismatch, or (on CUDA) fp32 kernels running TF32 "
                "dots, amplified by the random weights; compare with the CPU fp32 parity.")
    agree = f"ours and HF agree in fp32 to {d:.1e}" if d is not None else "ours fp32 not measured"
    gap = f"the {c:.2e} gap between the two bf16 runs" if c is not None else "the gap between the bf16 runs"
    if a <= 2 * b and b <= 2 * a:
        return (f"HF bf16 is as far from fp32 as ours ({b:.2e} vs {a:.2e}; {agree}): {gap} is bf16 rounding "
                f"amplified by the random weights{fl}, not a bug.")
    if a > 2 * b:
        return (f"Ours bf16 is {a / b:.1f}x farther from fp32 than HF bf16 ({a:.2e} vs {b:.2e}; {agree}){fl}: a "
                "precision loss in our bf16 path, worth finding.")
    return (f"Ours bf16 is closer to fp32 than HF bf16 ({a:.2e} vs {b:.2e}; {agree}){fl}: {gap} is mostly HF's "
            "bf16 rounding, not ours.")


class Diagnosis:
    """Logits and routing of ours / HF in bf16 and fp32 on the same prompts; kept in ``rep.res['bf16_diagnosis']``."""

    def __init__(self, rep: Report, plan: Plan, vocab: int, device: torch.device) -> None:
        self.rep, self.device = rep, device
        gen = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, vocab, (plan.diag_prompts, plan.diag_len), generator=gen)
        self.logits: dict[str, torch.Tensor] = {}
        self.routes: dict[str, torch.Tensor | None] = {}
        self.res: dict[str, Any] = {
            "prompts": plan.diag_prompts, "prompt_len": plan.diag_len, "runs": [], "run_s": {},
            "rel_rms": {}, "routing_flip_frac": {}, "routing_flip_per_layer": {}, "top1_agree": {},
            "tf32": {"torch_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                     "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
                     "TRITON_F32_DEFAULT": os.environ.get("TRITON_F32_DEFAULT")},
            "interpretation": ""}
        rep.res["bf16_diagnosis"] = self.res

    def run(self, name: str, model: torch.nn.Module, call: Callable[[], torch.Tensor]) -> None:
        """Capture ``call()``'s logits and ``model``'s routing as run ``name`` (e.g. ``ours_bf16``)."""
        t0 = time.perf_counter()
        with RoutingCapture(model) as cap:
            self.logits[name] = call()
        self.routes[name] = cap.sets()
        self.res["run_s"][name] = round(time.perf_counter() - t0, 2)
        self.res["runs"].append(name)
        if self.routes[name] is not None:
            self.res["moe_layers"], self.res["routed_tokens"] = self.routes[name].shape[:2]
        self.update()

    def rel(self, x: str, y: str) -> float | None:
        return self.res["rel_rms"].get(f"{x} vs {y}")

    def update(self) -> None:
        r = self.res
        for x, y in DIAG_PAIRS:
            if x in self.logits and y in self.logits:
                key = f"{x} vs {y}"
                r["rel_rms"][key] = rel_rms(self.logits[x], self.logits[y])
                r["top1_agree"][key] = (self.logits[x].argmax(-1) == self.logits[y].argmax(-1)).float().mean().item()
                r["routing_flip_frac"][key], r["routing_flip_per_layer"][key] = flip_fraction(
                    self.routes.get(x), self.routes.get(y))
        r["interpretation"] = interpret(r["rel_rms"], r["routing_flip_frac"])
        self.rep.write()


def _skip(rep: Report, what: str, why: str) -> None:
    rep.res["skipped"].append(f"{what} ({why})")
    rep.log(f"skipping {what}: {why}")
    rep.write()


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _bf16_representable_(model: torch.nn.Module) -> None:
    """Round every floating parameter to a bf16 value (kept in its dtype), so a dtype switch keeps the weights."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != torch.bfloat16:
                p.copy_(p.to(torch.bfloat16))


def _params_to_(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Parameters (not buffers: HF keeps rotary inv_freq in fp32 in a bf16 model) to ``dtype`` in place; exact
    for bf16-representable weights. Tensors of another model that shared the old storage keep it."""
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)


@contextlib.contextmanager
def ieee_fp32_dots(device: torch.device, dtype: torch.dtype) -> Iterator[str | None]:
    """For fp32 runs on CUDA: Triton's default precision of fp32 ``tl.dot`` set to IEEE while they trace their
    kernels (fla leaves ``input_precision`` at the default, TF32; ours picks IEEE for fp32 itself), so HF's fp32
    run is a true fp32 reference. Left alone when TRITON_F32_DEFAULT is set. Yields the precision in force."""
    env = os.environ.get("TRITON_F32_DEFAULT")
    if device.type != "cuda" or dtype != torch.float32 or env:
        yield env
        return
    try:
        from triton import knobs
        lang = knobs.language
    except (ImportError, AttributeError):
        yield None
        return
    prev = lang.fp32_default
    lang.fp32_default = "ieee"
    try:
        yield "ieee"
    finally:
        lang.fp32_default = prev


def diagnose_other_dtype(diag: Diagnosis, hf, hf_cfg: dict[str, Any], dtype: torch.dtype,
                         device: torch.device, rep: Report) -> None:
    """The diagnosis' second dtype: HF's parameters converted in place (HF's run first: the reference), then
    ours rebuilt from them; a failure of either is recorded and the other still runs."""
    _params_to_(hf, dtype)
    with ieee_fp32_dots(device, dtype) as prec:
        if device.type == "cuda" and dtype == torch.float32:
            diag.res["tf32"]["triton_fp32_dot_default_in_fp32_runs"] = prec or "tf32 (Triton's default)"
        _other_dtype_runs(diag, hf, hf_cfg, dtype, device, rep)


def _other_dtype_runs(diag: Diagnosis, hf, hf_cfg: dict[str, Any], dtype: torch.dtype,
                      device: torch.device, rep: Report) -> None:
    tag = _tag(dtype)
    try:
        diag.run(f"hf_{tag}", hf, lambda: hf_logits(hf, diag.ids, device))
    except Exception as e:  # noqa: BLE001
        rep.error(f"bf16 diagnosis: hf_{tag}", e)
    _free(device)
    try:
        ours = ours_from_hf(hf, hf_cfg, device, dtype)
        n, L = diag.ids.shape
        runner = ModelRunner(ours, RunnerConfig(num_slots=n + 2, num_pages=n * (-(-L // 16) + 1) + 16, page_size=16))
        diag.run(f"ours_{tag}", ours, lambda: ours_logits(runner, diag.ids))
    except Exception as e:  # noqa: BLE001
        rep.error(f"bf16 diagnosis: ours_{tag}", e)


def diagnosis_table(d: dict[str, Any]) -> list[str]:
    if not d or not d.get("rel_rms"):
        return []
    L = ["", f"bf16 parity diagnosis ({d['prompts']} random prompts x {d['prompt_len']} tokens, the same weights "
             f"in every run; routing: MoE (token, layer) top-k expert sets that differ, over "
             f"{d.get('routed_tokens', '?')} tokens x {d.get('moe_layers', '?')} MoE layers):", "",
         "| runs compared | last-token logits rel-RMS | argmax agree | routing sets differing |",
         "| --- | --- | --- | --- |"]
    keys = [f"{x} vs {y}" for x, y in DIAG_PAIRS]
    for key in sorted(d["rel_rms"], key=lambda k: keys.index(k) if k in keys else len(keys)):
        v, fl = d["rel_rms"][key], d["routing_flip_frac"].get(key)
        L.append(f"| {key} | {v:.2e} | {100 * d['top1_agree'][key]:.0f} % | "
                 f"{'—' if fl is None else f'{100 * fl:.2f} %'} |")
    L += ["", d["interpretation"]]
    return L


# ---------------------------------------------------------------------------------------------------------
# throughput cases
# ---------------------------------------------------------------------------------------------------------

def _timed_loop(call: Callable[[], Any], plan: Plan, dev: torch.device, deadline: float,
                setup: Callable[[], Any] = lambda: None, teardown: Callable[[Any], Any] = lambda _: None
                ) -> dict[str, Any]:
    """``plan.warmup`` untimed calls then ``plan.iters`` timed ones, each ``call(setup())`` with ``setup`` and
    ``teardown`` outside the timed region; past ``deadline`` (perf_counter) the timed calls stop once one sample
    exists (``capped``). ``first_call_s``: the first (untimed) call."""
    times: list[float] = []
    first = None
    total = plan.warmup + plan.iters
    for i in range(total):
        arg = setup()
        t = timed(lambda: call(arg), dev)[1]
        teardown(arg)
        first = t if first is None else first
        if i >= plan.warmup:
            times.append(t)
            if time.perf_counter() > deadline and i < total - 1:
                return {"times": times, "capped": True, "first_call_s": first}
    return {"times": times, "capped": False, "first_call_s": first}


def ours_prefill(runner: ModelRunner, ids: torch.Tensor, plan: Plan, dev: torch.device,
                 deadline: float = math.inf) -> dict[str, Any]:
    """ids: [N, L] host int64; each call prefills N fresh sequences (allocated before, freed after the call)."""
    rows = ids.tolist()

    def free(seqs: list) -> None:
        for s in seqs:
            runner.free_seq(s)
    return _timed_loop(lambda seqs: runner.step([PrefillItem(s, x) for s, x in zip(seqs, rows)], []), plan, dev,
                       deadline, setup=lambda: [runner.new_seq() for _ in rows], teardown=free)


def ours_decode(runner: ModelRunner, B: int, plan: Plan, dev: torch.device,
                deadline: float = math.inf) -> dict[str, Any]:
    vocab = runner.model.cfg.vocab_size
    seqs = [runner.new_seq() for _ in range(B)]
    try:
        per_step = max(1, 8192 // plan.context)                 # prompts prefilled 8192 tokens a step
        toks: list[int] = []
        for j in range(0, B, per_step):
            items = [PrefillItem(s, _rand_ids(vocab, plan.context).tolist()) for s in seqs[j:j + per_step]]
            toks += runner.step(items, []).argmax(-1).tolist()
        state = {"toks": toks}

        def call(_: Any) -> None:
            state["toks"] = runner.step([], list(zip(seqs, state["toks"]))).argmax(-1).tolist()
        return _timed_loop(call, plan, dev, deadline)
    finally:
        for s in seqs:
            runner.free_seq(s)


def _capped_loop(call: Callable[[], Any], plan: Plan, dev: torch.device, deadline: float = math.inf,
                 hard_end: float = math.inf) -> dict[str, Any]:
    """HF's loop: one untimed first call (fla's autotuning and compiles: 13 s on the H200; its time is
    ``first_call_s``), then warm-up + timed calls, stopping once the calls have taken ``plan.hf_case_cap_s`` or
    ``deadline`` has passed (then the warm-up samples are kept if nothing else was measured). Past
    ``hard_end`` after the first call no call is timed (``times`` empty)."""
    first = timed(call, dev)[1]
    if time.perf_counter() > hard_end:
        return {"times": [], "capped": True, "first_call_s": first}
    times, total = [], plan.warmup + plan.iters
    for i in range(total):
        times.append(timed(call, dev)[1])
        if i < total - 1 and (sum(times) > plan.hf_case_cap_s or time.perf_counter() > deadline):
            return {"times": times[plan.warmup:] or times, "capped": True, "first_call_s": first}
    return {"times": times[plan.warmup:], "capped": False, "first_call_s": first}


def hf_prefill(hf, ids: torch.Tensor, plan: Plan, dev: torch.device, deadline: float = math.inf,
               hard_end: float = math.inf) -> dict[str, Any]:
    ids = ids.to(dev)
    return _capped_loop(lambda: hf(ids, use_cache=False, logits_to_keep=1), plan, dev, deadline, hard_end)


def hf_decode(hf, B: int, plan: Plan, dev: torch.device, vocab: int, deadline: float = math.inf,
              hard_end: float = math.inf) -> dict[str, Any]:
    out = hf(_rand_ids(vocab, B, plan.context).to(dev), use_cache=True, logits_to_keep=1)
    # transformers >= 5.2x names the cache `cache` (output field and keyword); earlier 5.x `past_key_values`
    key = "cache" if hasattr(out, "cache") else "past_key_values"
    state = {"cache": getattr(out, key), "next": out.logits[:, -1].argmax(-1, keepdim=True)}
    if time.perf_counter() > hard_end:
        return {"times": [], "capped": True, "first_call_s": None}

    def step() -> list[int]:
        o = hf(state["next"], **{key: state["cache"]}, use_cache=True, logits_to_keep=1)
        state["next"] = o.logits[:, -1].argmax(-1, keepdim=True)
        return state["next"].flatten().tolist()
    return _capped_loop(step, plan, dev, deadline, hard_end)


def _row(kind: str, shape: str, tokens: int, impl: str, fmt: str, m: dict[str, Any], floor_s: float | None,
         share_s: float | None = None) -> dict[str, Any]:
    """One JSON row: the markdown table's columns (case = kind + shape, ours/HF from two rows' tokens_per_s) and
    ``format``, the weights' number format (bf16, fp32)."""
    times = m["times"]
    p = pct([t * 1e3 for t in times])
    return {"kind": kind, "shape": shape, "impl": impl, "format": fmt, "tokens": tokens, "ms": p, "n": len(times),
            "tokens_per_s": tokens / (p["p50"] / 1e3), "floor_ms": None if floor_s is None else floor_s * 1e3,
            "pct_of_floor": None if floor_s is None else 100 * floor_s * 1e3 / p["p50"], "capped": m["capped"],
            "first_call_s": m.get("first_call_s"), "share_s": share_s}


def table(res: dict[str, Any]) -> list[str]:
    c = res.get("ceilings") or {}
    L = [res.get("model_summary", ""), "",
         f"HF transformers {res.get('transformers') or '—'}; its GDN path: {res.get('hf_gdn_path_summary', '—')}. "
         f"Same weights: last-token logits rel-RMS ours vs HF = {res.get('parity_rel_rms', '—')}"
         + (f" ({res['parity_dtype']})" if res.get("parity_dtype") else "") + "."]
    L += diagnosis_table(res.get("bf16_diagnosis") or {})
    L.append("")
    if res.get("ours_cuda_graphs") is not None:
        gs = res.get("graph_stats") or {}
        L += [f"gdnserve's decode and prefill steps: "
              f"{'CUDA graphs (captured in the warm-up)' if res['ours_cuda_graphs'] else 'eager'}"
              + (f" — {gs.get('replay', 0)} decode replays, {gs.get('mixed_replay', 0)} prefill replays, "
                 f"{gs.get('fallback', 0)} eager steps, {gs.get('capture', 0)} captures" if gs else "")
              + "; HF: eager.", ""]
    if c:
        L += [f"Ceilings measured in this run: copy {c['copy_TBps']:.3g} TB/s, bf16 matmul "
              f"{c['bf16_matmul_TFLOPs']:.3g} TFLOP/s.", ""]
    if not res["rows"]:
        return L + ["No throughput rows."]
    L += ["ms per call: median [P10–P90] of perf_counter around the call, device synchronised before and after. "
          "tokens/s from the median. % floor: the floor (FLOPs / bf16 rate for prefill, essential bytes / copy "
          "rate for decode; fp32 rate for an fp32 model) over the median. ours/HF: tokens/s ratio. 1st call s: the "
          "case's first (untimed) call, compilation / autotuning included.", "",
          "| case | impl | ms | tokens/s | floor ms | % floor | ours/HF | n | 1st call s |",
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    ours = {(r["kind"], r["shape"]): r for r in res["rows"] if r["impl"] == "gdnserve"}
    for r in res["rows"]:
        ratio = ""
        if r["impl"] == "hf" and (r["kind"], r["shape"]) in ours:
            ratio = f"{ours[(r['kind'], r['shape'])]['tokens_per_s'] / r['tokens_per_s']:.2f}"
        fl = "—" if r["floor_ms"] is None else f"{r['floor_ms']:.2f}"
        pf = "—" if r["pct_of_floor"] is None else f"{r['pct_of_floor']:.0f} %"
        first = "—" if r.get("first_call_s") is None else f"{r['first_call_s']:.2f}"
        L.append(f"| {r['kind']} {r['shape']} | {r['impl']}{' (capped)' if r['capped'] else ''} | "
                 f"{fmt_pct(r['ms'], '.2f')} | {r['tokens_per_s']:,.0f} | {fl} | {pf} | {ratio} | {r['n']} | {first} |")
    return L


def run_cases(rep: Report, plan: Plan, ours, runner: ModelRunner, hf, vocab: int, dtype: torch.dtype,
              device: torch.device, reserve_s: float) -> None:
    """Every case in ``cases_in_order``, each with its time share of ``budget - reserve_s`` (module docstring)."""
    cases = cases_in_order(plan)
    soft_end = rep.t0 + rep.budget_s - reserve_s             # the cases' end (perf_counter)
    hard_end = rep.t0 + rep.budget_s                         # the whole budget's end
    rate = rep.res["ceilings"]["bf16_matmul_TFLOPs" if dtype == torch.bfloat16 else "fp32_matmul_TFLOPs"]
    for i, (kind, shape, N, L) in enumerate(cases):
        case = f"{kind} {shape}"
        now = time.perf_counter()
        if now >= soft_end:
            _skip(rep, case, f"the cases' {rep.budget_s - reserve_s:.0f} s of the budget spent" if reserve_s
                  else "budget spent")
            continue
        share = (soft_end - now) / (len(cases) - i)
        deadline = now + share
        floor = (prefill_flops(ours, N, L) / (rate * 1e12) if kind == "prefill"
                 else decode_bytes(ours, N, plan.context) / (rep.res["ceilings"]["copy_TBps"] * 1e12))
        ids = _rand_ids(vocab, N, L)                         # the same prompts for both (prefill)
        rep.log(f"{case}: gdnserve (time share {share:.1f} s)")
        try:
            m = ours_prefill(runner, ids, plan, device, deadline) if kind == "prefill" else \
                ours_decode(runner, N, plan, device, deadline)
            rep.add(_row(kind, shape, N * L, "gdnserve", _tag(dtype), m, floor, share))
        except Exception as e:  # noqa: BLE001
            rep.error(f"{case} gdnserve", e)
        _free(device)
        if hf is None:
            continue
        if time.perf_counter() >= deadline:
            _skip(rep, f"{case} HF", f"its time share ({share:.1f} s) was spent by gdnserve's calls")
            continue
        rep.log(f"{case}: HF ({deadline - time.perf_counter():.1f} s left of its share)")
        try:
            m = (hf_prefill(hf, ids, plan, device, deadline, hard_end) if kind == "prefill"
                 else hf_decode(hf, N, plan, device, vocab, deadline, hard_end))
            if m["times"]:
                rep.add(_row(kind, shape, N * L, "hf", _tag(dtype), m, floor, share))
            else:
                _skip(rep, f"{case} HF", "over the time budget after its untimed first call"
                      + (f" ({m['first_call_s']:.1f} s)" if m.get("first_call_s") else ""))
        except Exception as e:  # noqa: BLE001
            rep.error(f"{case} HF", e)
        _free(device)


def _measure(rep: Report, plan: Plan, hf_cfg: dict[str, Any], dtype: torch.dtype, device: torch.device,
             use_hf: bool, diagnosis: str) -> None:
    hf = None
    with_cases = diagnosis != "only"
    if with_cases:
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
            if diagnosis != "off":
                _bf16_representable_(hf)      # the diagnosis switches dtype: weights must survive it exactly
        except Exception as e:  # noqa: BLE001 — no HF: our rows alone
            rep.error("building the HF model (HF rows skipped)", e)
            hf = None
    rep.log("building gdnserve's model" + (" from the HF weights" if hf is not None else ""))
    ours = ours_from_hf(hf, hf_cfg, device, dtype) if hf is not None else build_random_model(hf_cfg, device, dtype)
    slots = max(plan.batches) + 2 if with_cases else plan.diag_prompts + 2
    runner = ModelRunner(ours, RunnerConfig(num_slots=slots, num_pages=4096, page_size=16,
                                            graph_max_tokens=max([N * L for N, L in plan.prefill] + [16])))
    rep.res["ours_cuda_graphs"] = runner.graphs is not None
    diag = None
    if hf is not None:
        try:
            rep.log(f"parity: ours and HF ({_tag(dtype)}) on {plan.diag_prompts} prompts x {plan.diag_len} tokens "
                    "(HF's and our first calls: compilation, autotuning)")
            diag = Diagnosis(rep, plan, hf_cfg["vocab_size"], device)
            diag.run(f"ours_{_tag(dtype)}", ours, lambda: ours_logits(runner, diag.ids))
            diag.run(f"hf_{_tag(dtype)}", hf, lambda: hf_logits(hf, diag.ids, device))
            rep.res["parity_rel_rms"] = f"{diag.rel(f'ours_{_tag(dtype)}', f'hf_{_tag(dtype)}'):.2e}"
            rep.res["parity_dtype"] = _tag(dtype)
            rep.log(f"parity: rel-RMS {rep.res['parity_rel_rms']}")
        except Exception as e:  # noqa: BLE001
            rep.error("parity check", e)
    _free(device)
    if with_cases:
        reserve = plan.diag_share * rep.budget_s if (diag is not None and diagnosis == "on") else 0.0
        run_cases(rep, plan, ours, runner, hf, hf_cfg["vocab_size"], dtype, device, reserve)
        if runner.graphs is not None:
            rep.res["graph_stats"] = dict(runner.graphs.stats)
            rep.write()
    if diag is None or diagnosis == "off":
        return
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    what = f"bf16 diagnosis: the {_tag(other)} runs"
    if rep.elapsed > rep.budget_s:
        _skip(rep, what, "budget spent")
        return
    runner = ours = None
    _free(device)
    rep.log(f"{what} (HF's parameters converted in place, ours rebuilt from them)")
    try:
        diagnose_other_dtype(diag, hf, hf_cfg, other, device, rep)
        rep.log(f"diagnosis: {diag.res['interpretation']}")
    except Exception as e:  # noqa: BLE001
        rep.error(what, e)


def run(device: torch.device, quick: bool, out_dir: Path, use_hf: bool, layers: int | None, experts: int | None,
        budget_s: float, diagnosis: str = "on", shape: str = "auto", vocab: int | None = None) -> dict[str, Any]:
    """diagnosis: "on" (parity at the start, the other dtype after the cases), "off" (parity only), "only" (parity
    and the diagnosis, no throughput cases). shape: "auto" (CUDA: the benchmark shape, CPU: tiny) or "bench" (the
    benchmark shape on any device). vocab: overrides the vocabulary size."""
    if diagnosis not in ("on", "off", "only"):
        raise ValueError(f"diagnosis must be on, off or only, got {diagnosis!r}")
    cuda = device.type == "cuda"
    plan = make_plan(cuda, quick)
    full = cuda and shape == "auto" and not quick and layers is None and experts is None
    if shape == "bench":
        hf_cfg = bench_hf_config(layers or 8, experts or 64, vocab or VOCAB)
        plan = replace(plan, diag_len=max(plan.diag_len, 128))      # the diagnosis at the CUDA prompt length
    else:
        hf_cfg = config_for(device, layers, experts, full=full)
        if vocab:
            hf_cfg["vocab_size"] = vocab
    dtype = torch.bfloat16 if cuda else torch.float32
    notes = []
    missing = transformers_missing() if use_hf else None
    if missing is not None:
        use_hf = False
        notes.append(f"HF rows skipped: transformers is not importable ({missing}); "
                     "`pip install -e '.[bench]'` adds it.")
    if full and use_hf:
        use_hf, diagnosis = False, ("off" if diagnosis == "on" else diagnosis)
        notes.append("Full-size model: no HF rows and no bf16 diagnosis (HF's copy of the 70 GB weights does not "
                     "fit beside ours); `--quick` runs the 8-layer cut with both.")
    rep = Report("model", "Model throughput: gdnserve vs HF transformers", device, out_dir, quick=quick,
                 budget_s=budget_s, table=table, model_config=hf_cfg, dtype=str(dtype),
                 model_summary=model_summary(hf_cfg, dtype), plan=plan.__dict__, diagnosis=diagnosis,
                 case_order=[f"{k} {s}" for k, s, _, _ in cases_in_order(plan)] if diagnosis != "only" else [])
    for n in notes:
        rep.note(n)
    if cuda:
        rep.res["qwen3_next_80b"] = next_fit(device)
        rep.note(rep.res["qwen3_next_80b"]["summary"])
    torch.manual_seed(0)
    try:
        with torch.inference_mode():
            _measure(rep, plan, hf_cfg, dtype, device, use_hf, diagnosis)
    except Exception as e:  # noqa: BLE001 — set-up failed: the report says so
        rep.error("set-up", e)
    if any(r["capped"] for r in rep.res["rows"]):
        rep.note(f"Rows marked capped stopped their timed calls early (fewer samples): HF after "
                 f"{plan.hf_case_cap_s:.0f} s of calls, or either side at the end of the case's time share.")
    return rep.finish()


def next_fit(device: torch.device) -> dict[str, Any]:
    """Qwen3-Next-80B-A3B's layer pattern in bf16, sized on the meta device, against ``device``'s memory."""
    n, b = param_bytes(qwen3_next_hf_config(), torch.bfloat16)
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    fits = total is not None and b < total
    where = f"{total / 2**30:.0f} GiB" if total else "?"
    return {"params": n, "bytes": b, "device_bytes": total, "fits": fits,
            "summary": f"Qwen3-Next-80B-A3B (48 layers, 512 experts top-10) in bf16: {n / 1e9:.1f} B parameters, "
                       f"{b / 1e9:.1f} GB ({b / 2**30:.1f} GiB) of weights alone, "
                       + ("fits" if fits else "does not fit") + f" the device's {where}; not run."}


def run_from_args(args: argparse.Namespace) -> int:
    return run_cli("model", args.device, lambda device: run(
        device, args.quick, Path(args.out), args.hf, args.layers, args.experts, args.time_budget,
        getattr(args, "diagnosis", "on"), getattr(args, "shape", "auto"), getattr(args, "vocab", None)))


def add_extra_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``python -m benchmarks.bench_model`` beyond the CLI's (each added only if not there yet)."""
    have = p._option_string_actions
    if "--diagnosis" not in have:
        p.add_argument("--diagnosis", choices=("on", "off", "only"), default="on",
                       help="bf16 parity diagnosis: on (default; the second dtype after the throughput cases), off, "
                            "or only (parity + diagnosis, no throughput cases)")
    if "--shape" not in have:
        p.add_argument("--shape", choices=("auto", "bench"), default="auto",
                       help="auto (default: the benchmark shape on CUDA, tiny on CPU) or bench (the benchmark "
                            "shape on any device)")
    if "--vocab" not in have:
        p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the shape's)")


def main(argv: list[str] | None = None) -> int:
    from gdnserve.cli import add_bench_model_arguments
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_model", description=__doc__.split("\n")[0])
    add_bench_model_arguments(parser)
    add_extra_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
