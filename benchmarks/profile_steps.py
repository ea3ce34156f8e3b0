"""Where a whole-model step's GPU time goes: per-kernel GPU time of decode and prefill steps, kernels grouped
into the parts of a decoder layer (GEMMs, routed experts, GDN, attention, norms, elementwise, ...).

    python -m benchmarks.profile_steps --out /tmp/res/profile_steps.md [--layers 8 --experts 64] [--cases ...] [--fp8]

Default on CUDA: the full-size random-weight Qwen3.5-35B-A3B (40 layers, 256 experts, bf16; ``--fp8``: quantized
to block FP8 in place, ``models.loader.quantize_model_fp8_``), steps as the
benchmark runs them (CUDA-graph replays where the runner has a bucket). Each case runs a few untimed steps,
then ``--reps`` profiled steps; times are per step (sum over the step's kernels / reps), next to the step's
wall time (device synchronised) so the gaps between kernels show as wall − GPU.
"""
from __future__ import annotations

import argparse
import re
import time
from collections import defaultdict

import torch

from benchmarks.random_model import build_random_model, config_for
from gdnserve.engine.cache.sequence import PrefillItem
from gdnserve.engine.execution.model_runner import (
    ModelRunner,
    RunnerConfig,
)

# (part, regex on the kernel name), first match wins
PARTS = (
    ("experts (grouped GEMM)", r"_gate_up_kernel|_gate_up_one_dot|_down_kernel|_down_par_kernel|grouped"),
    ("router + alignment", r"router|_align|topk|sort|softmax"),
    ("GDN kernels", r"gdn_|chunk_|conv_|recurrent|kkt|solve|wy_"),
    ("attention kernels", r"attention|store_kv|flash|fmha|rope"),
    ("norms", r"rms_norm|_norm_"),
    ("FP8 activation quantization", r"_quant_kernel"),
    ("GEMM (cuBLAS)", r"nvjet|gemm|sm90|cutlass|splitK|gemv|skinny|dot_kernel|reduce_1Block"),
    ("reductions", r"reduce_kernel"),
    ("copies", r"copy|Memcpy|Memset|CatArray|fill"),
    ("elementwise", r"elementwise|_silu_mul|_sigmoid_mul"),
)


def part_of(name: str) -> str:
    for part, rx in PARTS:
        if re.search(rx, name):
            return part
    return "other"


def profile_steps(call, reps: int) -> tuple[dict[str, list[float]], float]:
    """(kernel name -> [launches per step, GPU µs per step]), median wall ms per step."""
    from torch.profiler import ProfilerActivity, profile
    walls = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            call()
            torch.cuda.synchronize()
            walls.append(1e3 * (time.perf_counter() - t))
    agg: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            a = agg[e.name]
            a[0] += 1 / reps
            a[1] += e.device_time_total / reps
    return dict(agg), sorted(walls)[len(walls) // 2]


def markdown(case: str, agg: dict[str, list[float]], wall_ms: float, top: int) -> list[str]:
    gpu = sum(t for _, t in agg.values())
    n = sum(c for c, _ in agg.values())
    parts: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for name, (c, t) in agg.items():
        p = parts[part_of(name)]
        p[0] += c
        p[1] += t
    out = [f"### {case}: wall {wall_ms:.2f} ms per step, GPU (kernel sum) {gpu / 1e3:.2f} ms, {n:.0f} kernels", "",
           "| part | kernels / step | GPU µs / step | share |", "| --- | --- | --- | --- |"]
    for p, (c, t) in sorted(parts.items(), key=lambda kv: -kv[1][1]):
        out.append(f"| {p} | {c:.0f} | {t:.1f} | {100 * t / gpu:.1f} % |")
    out += ["", "| kernel | part | launches / step | GPU µs / step | µs / launch |", "| --- | --- | --- | --- | --- |"]
    for name, (c, t) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]:
        short = name if len(name) <= 70 else name[:67] + "..."
        out.append(f"| `{short}` | {part_of(name)} | {c:.0f} | {t:.1f} | {t / max(c, 1e-9):.2f} |")
    return out + [""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.profile_steps")
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--cases", default="decode:1,decode:64,decode:256,prefill:1x4096,prefill:8x1024")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--fp8", action="store_true", help="quantize the model to block FP8 first (the release's layout)")
    ap.add_argument("--mtp", type=int, default=0, metavar="K",
                    help="an MTP head and k = K drafts (replay mode): cases verify:B run its verify steps (draft + "
                         "target + feed, one graph), each followed by accepting every token")
    ap.add_argument("--fold-max-tokens", type=int, default=None,
                    help="the MoE blocks' fold_max_tokens (layers/moe.py FOLD_MAX_TOKENS) for this run")
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    full = a.layers is None and a.experts is None
    hf_cfg = config_for(dev, a.layers, a.experts, full=full)
    if a.mtp:
        hf_cfg["mtp_num_hidden_layers"] = 1
    model = build_random_model(hf_cfg, dev, torch.bfloat16)
    if a.fold_max_tokens is not None:
        for m in model.modules():
            if hasattr(m, "fold_max_tokens"):
                m.fold_max_tokens = a.fold_max_tokens
    if a.fp8:
        from gdnserve.models.loader import quantize_model_fp8_
        quantize_model_fp8_(model)
    cases = [c.split(":") for c in a.cases.split(",")]
    max_b = max([int(v) for k, v in cases if k in ("decode", "verify")] + [8])
    max_t = max([int(v.split("x")[0]) * int(v.split("x")[1]) for k, v in cases if k == "prefill"] + [16])
    spec = {"spec_mode": "replay", "spec_tokens": a.mtp + 1, "spec_draft": "mtp"} if a.mtp else {}
    runner = ModelRunner(model, RunnerConfig(num_slots=max_b + 2, num_pages=4096, page_size=16,
                                             graph_max_tokens=max_t, **spec))
    vocab = hf_cfg["vocab_size"]
    g = torch.Generator().manual_seed(0)
    ids = lambda *s: torch.randint(0, vocab, s, generator=g)  # noqa: E731
    lines = [f"# Per-kernel GPU time per step ({torch.cuda.get_device_name()})", "",
             f"torch {torch.__version__}; model {hf_cfg['num_hidden_layers']} layers, "
             f"{hf_cfg.get('num_experts')} experts, {'block FP8' if a.fp8 else 'bf16'}; command `python -m benchmarks.profile_steps "
             f"{' '.join(argv) if argv else ''}`; graph stats after the run in the last line.", ""]
    for kind, arg in cases:
        if kind == "decode":
            B = int(arg)
            seqs = [runner.new_seq() for _ in range(B)]
            toks = runner.step([PrefillItem(s, ids(a.context).tolist()) for s in seqs], []).argmax(-1).tolist()
            state = {"t": toks}

            def call() -> None:
                state["t"] = runner.step([], list(zip(seqs, state["t"]))).argmax(-1).tolist()
            for _ in range(3):
                call()
            agg, wall = profile_steps(call, a.reps)
            for s in seqs:
                runner.free_seq(s)
            case = f"decode B={B} (context {a.context})"
        elif kind == "verify":
            B = int(arg)
            seqs = [runner.new_seq() for _ in range(B)]
            toks = runner.step([PrefillItem(s, ids(a.context).tolist()) for s in seqs], []).argmax(-1).tolist()

            def call() -> None:
                runner.step([], [], verifies=[(s, [t]) for s, t in zip(seqs, toks)])
                runner.accept([(s, a.mtp + 1) for s in seqs])
            for _ in range(3):
                call()
            agg, wall = profile_steps(call, a.reps)
            for s in seqs:
                runner.free_seq(s)
            case = f"MTP verify B={B} k={a.mtp} (context {a.context}, all accepted)"
        else:
            N, L = (int(v) for v in arg.split("x"))
            rows = ids(N, L).tolist()

            def call() -> None:
                seqs = [runner.new_seq() for _ in rows]
                runner.step([PrefillItem(s, x) for s, x in zip(seqs, rows)], [])
                torch.cuda.synchronize()
                for s in seqs:
                    runner.free_seq(s)
            for _ in range(2):
                call()
            agg, wall = profile_steps(call, a.reps)
            case = f"prefill {N}x{L}"
        lines += markdown(case, agg, wall, a.top)
        print("\n".join(markdown(case, agg, wall, 12)), flush=True)
    lines.append(f"graph stats: {dict(runner.graphs.stats) if runner.graphs is not None else None}")
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
