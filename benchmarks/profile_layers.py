"""Kernels per decoder layer per step (torch.profiler), with the fused kernels off (before) and on (after) in
the same run: ``python -m benchmarks.profile_layers [--layers 8] [--experts 64] [--out FILE] [--commit SHA]``.

Model: ``random_model.py``'s benchmark shape (Qwen3.5-35B-A3B layers: hidden 2048, GDN H=16 HV=32 K=V=128,
attention 16/2 heads of 256, MoE top-8 of 64 + a shared expert; bf16) on CUDA, the tiny fp32 model on CPU
(a smoke run: CPU ops instead of kernels). Cases: decode B=1 at a context of 128 and prefill 1x512, each an
eager ``ModelRunner.step`` (no CUDA graph: a replayed graph's kernels cannot be told apart by layer).

How a kernel is given to a layer: each ``DecoderLayer.step`` runs inside a profiler range with the device
synchronised at its start and end, so the kernels a layer launched execute inside its range's time window
(kernel start times lie on the host clock in torch.profiler's trace); kernels outside every window (the
step's input uploads, embedding, final norm, lm head) are "outside layers". The synchronisation changes
times, not counts; GPU µs are the kernels' own durations. ``fused`` = ``models.qwen3_5.set_fused``: off =
the PyTorch ops for the norms, residual adds and router; on = the Triton kernels of ops/norm and
ops/moe/router. Writes a markdown table (default ``benchmarks/results/kernels_per_layer_<device>.md``).
"""
from __future__ import annotations

import argparse
import collections
import platform
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.random_model import build_random_model, config_for
from gdnserve.engine.model_runner import ModelRunner, PrefillItem, RunnerConfig
from gdnserve.models.qwen3_5 import set_fused

RANGE = "gdnserve.layer"


@dataclass
class Event:
    name: str
    start: float          # µs, the profiler's clock
    dur: float            # µs of device time (CPU smoke run: of CPU time)


@dataclass
class StepCount:
    """One profiled step: the kernels of each layer (in launch order) and those outside every layer."""
    layers: list[list[Event]] = field(default_factory=list)
    outside: list[Event] = field(default_factory=list)


def attribute(windows: Sequence[tuple[float, float]], events: Sequence[Event]) -> StepCount:
    """Give each event to the window (one per layer, in order, disjoint) holding its start; else outside."""
    out = StepCount(layers=[[] for _ in windows])
    for e in sorted(events, key=lambda e: e.start):
        for i, (a, b) in enumerate(windows):
            if a <= e.start <= b:
                out.layers[i].append(e)
                break
        else:
            out.outside.append(e)
    return out


def wrap_layers(model, sync: Callable[[], None]) -> None:
    """Run each decoder layer's ``step`` in a profiler range ``gdnserve.layer{i}``, synchronised at both ends."""
    for i, layer in enumerate(model.layers):
        def step(h, residual, _orig=layer.step, _i=i):
            sync()
            with record_function(f"{RANGE}{_i}"):
                out = _orig(h, residual)
                sync()
            return out
        layer.step = step


def profiled(call: Callable[[], None], cuda: bool, reps: int = 3) -> list[StepCount]:
    """``reps`` profiled calls of ``call`` (after unprofiled warm-up ones); one StepCount per call."""
    for _ in range(2 if cuda else 1):
        call()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    counts = []
    for _ in range(reps):
        with profile(activities=acts) as prof:
            call()
            if cuda:
                torch.cuda.synchronize()
        counts.append(step_count(prof.events(), cuda))
    return counts


def step_count(events, cuda: bool) -> StepCount:
    windows: dict[int, tuple[float, float]] = {}
    found: list[Event] = []
    for e in events:
        if e.name.startswith(RANGE) and e.device_type == torch.autograd.DeviceType.CPU:
            windows[int(e.name[len(RANGE):])] = (e.time_range.start, e.time_range.end)
        elif cuda and e.device_type == torch.autograd.DeviceType.CUDA:
            found.append(Event(e.name, e.time_range.start, e.device_time))
        elif not cuda and e.name.startswith("aten::") and not _aten_parent(e):
            found.append(Event(e.name, e.time_range.start, e.cpu_time))
    return attribute([windows[i] for i in sorted(windows)], found)


def _aten_parent(e) -> bool:
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith("aten::"):
            return True
        p = p.cpu_parent
    return False


@dataclass
class CaseResult:
    case: str
    fused: bool
    kinds: list[str]
    steps: list[StepCount]

    def per_layer(self, kind: str) -> tuple[float, float]:
        """(kernels, GPU µs) per layer of ``kind``, averaged over the layers of that kind and the steps."""
        rows = [s.layers[i] for s in self.steps for i, k in enumerate(self.kinds) if k == kind]
        return sum(map(len, rows)) / len(rows), sum(e.dur for r in rows for e in r) / len(rows)

    def names(self, kind: str) -> collections.Counter:
        """Kernel names of the first layer of ``kind`` in the first step (launch order kept by Counter)."""
        i = self.kinds.index(kind)
        return collections.Counter(_short(e.name) for e in self.steps[0].layers[i])

    def totals(self) -> tuple[float, float]:
        n = len(self.steps)
        return (sum(sum(map(len, s.layers)) for s in self.steps) / n, sum(len(s.outside) for s in self.steps) / n)


def _short(name: str) -> str:
    return name if len(name) <= 70 else name[:67] + "..."


def run_cases(runner: ModelRunner, cuda: bool, prefill_len: int, context: int, reps: int) -> list[CaseResult]:
    model = runner.model
    vocab = model.cfg.vocab_size
    kinds = ["GDN" if l.kind == "linear_attention" else "attention" for l in model.layers]
    gen = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, vocab, (n,), generator=gen).tolist()   # noqa: E731
    seq = runner.new_seq()
    runner.step([PrefillItem(seq, ids(context))], [])
    tok = [1]

    def decode() -> None:
        tok[0] = int(runner.step([], [(seq, tok[0])]).argmax(-1)[0])

    prompt = ids(prefill_len)

    def prefill() -> None:
        s = runner.new_seq()
        runner.step([PrefillItem(s, prompt)], [])
        runner.free_seq(s)

    out = []
    for fused in (False, True):
        set_fused(model, fused)
        for case, call in (("decode B=1", decode), (f"prefill 1x{prefill_len}", prefill)):
            out.append(CaseResult(case, fused, kinds, profiled(call, cuda, reps)))
    return out


def markdown(results: list[CaseResult], header: list[str]) -> str:
    lines = header + ["", "| case | layer | kernels / layer, fused off | fused on | GPU µs / layer, off | on |",
                      "| --- | --- | --- | --- | --- | --- |"]
    by = {(r.case, r.fused): r for r in results}
    cases = list(dict.fromkeys(r.case for r in results))
    kinds = list(dict.fromkeys(results[0].kinds))
    for case in cases:
        off, on = by[(case, False)], by[(case, True)]
        for kind in kinds:
            (n0, t0), (n1, t1) = off.per_layer(kind), on.per_layer(kind)
            lines.append(f"| {case} | {kind} | {n0:.0f} | {n1:.0f} | {t0:.1f} | {t1:.1f} |")
        (a0, o0), (a1, o1) = off.totals(), on.totals()
        lines.append(f"| {case} | all {len(off.kinds)} layers (+ outside) | {a0:.0f} (+{o0:.0f}) | {a1:.0f} "
                     f"(+{o1:.0f}) | | |")
    for case in cases:
        for kind in kinds:
            lines += ["", f"### {case}, one {kind} layer: kernels by name (fused off -> on)", "",
                      "| kernel | off | on |", "| --- | --- | --- |"]
            c0, c1 = by[(case, False)].names(kind), by[(case, True)].names(kind)
            for name in dict.fromkeys(list(c0) + list(c1)):
                lines.append(f"| `{name.replace('|', '/')}` | {c0.get(name, 0)} | {c1.get(name, 0)} |")
    return "\n".join(lines) + "\n"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.profile_layers", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: 8 on CUDA, 4 on CPU)")
    ap.add_argument("--experts", type=int, default=None, help="experts (default: 64 on CUDA, 8 on CPU)")
    ap.add_argument("--prefill", type=int, default=512, help="prefill tokens (one sequence)")
    ap.add_argument("--context", type=int, default=128, help="decode context (prompt tokens before it)")
    ap.add_argument("--reps", type=int, default=3, help="profiled steps per case and setting")
    ap.add_argument("--out", default=None, help="markdown path (default benchmarks/results/kernels_per_layer_<dev>.md)")
    ap.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD)")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build_random_model(config_for(dev, args.layers, args.experts), dev, dtype)
    pages = (args.context + 2 * args.prefill) // 16 + 16
    runner = ModelRunner(model, RunnerConfig(num_slots=4, num_pages=pages, page_size=16, cuda_graphs=False))
    wrap_layers(model, torch.cuda.synchronize if cuda else (lambda: None))
    with torch.inference_mode():
        results = run_cases(runner, cuda, args.prefill, args.context, args.reps)
    name = torch.cuda.get_device_name(dev) if cuda else platform.processor() or "cpu"
    tag = "h200" if "H200" in name else dev.type
    cfg = model.cfg
    header = [f"# Kernels per decoder layer per step ({'CUDA kernels' if cuda else 'CPU smoke run: aten ops'})", "",
              f"Device {name}; torch {torch.__version__}; commit {args.commit or _commit()}; command "
              f"`python -m benchmarks.profile_layers --reps {args.reps}`.",
              f"Model: benchmarks/random_model.py, {cfg.num_layers} layers ({', '.join(results[0].kinds)}), "
              f"{cfg.mlp.num_experts} experts, {str(dtype).replace('torch.', '')}; eager steps (no CUDA graph), "
              f"decode at context {args.context}. Fused off = the PyTorch ops for the residual adds, norms and "
              "router (`set_fused(model, False)`), on = ops/norm + ops/moe/router (same run).",
              "Counts are per layer and per step (mean over the layers of a kind and "
              f"{args.reps} profiled steps); 'outside' = kernels outside every layer (uploads, embedding, final "
              "norm, lm head)."]
    text = markdown(results, header)
    out = Path(args.out or f"benchmarks/results/kernels_per_layer_{tag}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text, flush=True)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
