"""Kernels per decoder layer per step, with the fused kernels off (before) and on (after) in the same run:
``python -m benchmarks.profile_layers [--layers 8] [--experts 64] [--out FILE] [--commit SHA]``.

CUDA (the measurement): the benchmark shape of ``random_model.py`` (Qwen3.5-35B-A3B layers: hidden 2048,
GDN H=16 HV=32 K=V=128, attention 16/2 heads of 256, MoE top-8 of 64 + a shared expert; bf16), kernels and
their GPU time from torch.profiler. Each ``DecoderLayer.step`` runs inside a profiler range with the device
synchronised at its start and end, so the kernels a layer launched execute inside its range's time window
(torch.profiler puts kernel start times on the host clock); kernels outside every window (the step's input
uploads, embedding, final norm, lm head) are "outside layers". The synchronisation changes times, not counts.

CPU (a proxy, ``TRITON_INTERPRET=1``): the tiny model in bf16 on the Triton backend, interpreted; a "kernel"
is an aten op that is not a view or an allocation (on CUDA each launches one kernel, or one copy) or one
Triton launch (the torch ops the interpreter runs inside a launch are not counted). Same op structure as
CUDA (the paths are picked by backend, not by shape, except the router's one-launch limit of 64 tokens).

Cases: decode B=1 at a context of 128 and prefill 1x512, each an eager ``ModelRunner.step`` (no CUDA graph:
a replayed graph's kernels cannot be told apart by layer). ``fused`` = ``models.qwen3_5.set_fused``: off =
the PyTorch ops for the norms, residual adds, q/k rotary and router; on = the Triton kernels of ops/norm,
ops/attention/rope and ops/moe/router. ``--cases decode`` / ``prefill`` runs one. Writes a markdown table
(default ``benchmarks/results/kernels_per_layer_<h200|cpu>.md``).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.random_model import build_random_model, config_for
from gdnserve.engine.cache.sequence import PrefillItem
from gdnserve.engine.execution.model_runner import (
    ModelRunner,
    RunnerConfig,
)
from gdnserve.models.qwen3_5 import set_fused
from gdnserve.ops.backend import interpreting

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


def _now() -> float:
    return time.perf_counter() * 1e6


def wrap_layers(model, cuda: bool, windows: list[tuple[float, float]]) -> None:
    """Run each decoder layer's ``step`` in a profiler range ``gdnserve.layer{i}`` (CUDA: synchronised at both
    ends) and append its host-clock window to ``windows`` (what the CPU proxy attributes by)."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for i, layer in enumerate(model.layers):
        def step(h, residual, _orig=layer.step, _i=i):
            sync()
            t0 = _now()
            with record_function(f"{RANGE}{_i}"):
                out = _orig(h, residual)
                sync()
            windows.append((t0, _now()))
            return out
        layer.step = step


def profiled(call: Callable[[], None], reps: int = 3) -> list[StepCount]:
    """CUDA: ``reps`` profiled calls of ``call`` (after 2 unprofiled ones); one StepCount per call."""
    for _ in range(2):
        call()
    counts = []
    for _ in range(reps):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        windows: dict[int, tuple[float, float]] = {}
        found: list[Event] = []
        for e in prof.events():
            if e.name.startswith(RANGE) and e.device_type == torch.autograd.DeviceType.CPU:
                windows[int(e.name[len(RANGE):])] = (e.time_range.start, e.time_range.end)
            elif e.device_type == torch.autograd.DeviceType.CUDA:
                found.append(Event(e.name, e.time_range.start, e.device_time))
        counts.append(attribute([windows[i] for i in sorted(windows)], found))
    return counts


# aten ops that launch nothing on CUDA besides views (``OpOverload.is_view``): allocations and aliasing
_NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach", "alias",
              "lift_fresh", "_unsafe_view", "set_", "resize_", "promote_types", "_record_function_enter_new",
              "_record_function_exit"}


class OpCounter(TorchDispatchMode):
    """CPU proxy of kernel launches: aten ops that compute or copy, and Triton launches (interpreted; the aten
    ops the interpreter runs inside one are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[Event] = []
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not self.paused and name not in _NO_KERNEL and (not func.is_view or _copied(args, out)):
            self.events.append(Event(f"aten::{name}", _now(), 0.0))
        return out

    @contextlib.contextmanager
    def triton_launches(self) -> Iterator[None]:
        from triton.runtime.interpreter import InterpretedFunction
        orig = InterpretedFunction.run
        counter = self

        def run(fn, *args, **kwargs):
            counter.events.append(Event(f"triton::{fn.__name__}", _now(), 0.0))
            counter.paused += 1
            try:
                return orig(fn, *args, **kwargs)
            finally:
                counter.paused -= 1
        InterpretedFunction.run = run
        try:
            yield
        finally:
            InterpretedFunction.run = orig


def _copied(args, out) -> bool:
    """An op whose schema may alias its input (``to``, ``contiguous``, ``reshape``) but returned new storage."""
    src = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if src is None or not isinstance(out, torch.Tensor):
        return False
    return out.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()


def counted(call: Callable[[], None], windows: list[tuple[float, float]], reps: int = 1) -> list[StepCount]:
    """CPU proxy: ``reps`` counted calls of ``call`` (after one uncounted); one StepCount per call."""
    call()
    counts = []
    for _ in range(reps):
        windows.clear()
        counter = OpCounter()
        with counter.triton_launches(), counter:
            call()
        counts.append(attribute(list(windows), counter.events))
    return counts


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


def run_cases(runner: ModelRunner, cuda: bool, prefill_len: int, context: int, reps: int,
              windows: list[tuple[float, float]], cases: Sequence[str] = ("decode", "prefill")) -> list[CaseResult]:
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
            if case.split()[0] not in cases:
                continue
            steps = profiled(call, reps) if cuda else counted(call, windows, reps)
            out.append(CaseResult(case, fused, kinds, steps))
    return out


def markdown(results: list[CaseResult], header: list[str], timed: bool = True) -> str:
    lines = header + ["", "| case | layer | kernels / layer, fused off | fused on | GPU µs / layer, off | on |",
                      "| --- | --- | --- | --- | --- | --- |"]
    by = {(r.case, r.fused): r for r in results}
    cases = list(dict.fromkeys(r.case for r in results))
    kinds = list(dict.fromkeys(results[0].kinds))
    for case in cases:
        off, on = by[(case, False)], by[(case, True)]
        for kind in kinds:
            (n0, t0), (n1, t1) = off.per_layer(kind), on.per_layer(kind)
            us = f"{t0:.1f} | {t1:.1f}" if timed else "- | -"
            lines.append(f"| {case} | {kind} | {n0:.0f} | {n1:.0f} | {us} |")
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
    ap.add_argument("--cases", default="decode,prefill", help="comma-separated: decode, prefill")
    ap.add_argument("--out", default=None, help="markdown (default benchmarks/results/kernels_per_layer_<dev>.md)")
    ap.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD)")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if not cuda and not interpreting():
        ap.error("the CPU proxy runs the Triton kernels interpreted: set TRITON_INTERPRET=1")
    model = build_random_model(config_for(dev, args.layers, args.experts), dev, torch.bfloat16)
    pages = (args.context + 2 * args.prefill) // 16 + 16
    runner = ModelRunner(model, RunnerConfig(num_slots=4, num_pages=pages, page_size=16, cuda_graphs=False,
                                             backend="triton"))
    windows: list[tuple[float, float]] = []
    wrap_layers(model, cuda, windows)
    with torch.inference_mode():
        reps = args.reps if cuda else 1
        cases = args.cases.split(",")
        if not set(cases) <= {"decode", "prefill"}:
            ap.error(f"--cases: expected decode and/or prefill, got {args.cases!r}")
        results = run_cases(runner, cuda, args.prefill, args.context, reps, windows, cases)
    name = torch.cuda.get_device_name(dev) if cuda else platform.processor() or "cpu"
    tag = ("h200" if "H200" in name else "cuda") if cuda else "cpu"
    cfg = model.cfg
    what = ("CUDA kernels (torch.profiler)" if cuda else
            "CPU proxy: aten ops that compute or copy + Triton launches, interpreted; GPU µs columns empty")
    cmd = "python -m benchmarks.profile_layers" if cuda else "TRITON_INTERPRET=1 python -m benchmarks.profile_layers"
    header = [f"# Kernels per decoder layer per step ({what})", "",
              f"Device {name}; torch {torch.__version__}; commit {args.commit or _commit()}; command "
              f"`{cmd} {' '.join(argv if argv is not None else sys.argv[1:])}`.",
              f"Model: benchmarks/random_model.py, {cfg.num_layers} layers ({', '.join(results[0].kinds)}), "
              f"{cfg.mlp.num_experts} experts, hidden {cfg.hidden_size}, bf16; Triton backend, eager steps (no CUDA "
              "graph), "
              f"decode at context {args.context}. Fused off = the PyTorch ops for the residual adds, norms, q/k "
              "rotary and router and the shared expert as its own MLP (`set_fused(model, False)`), on = ops/norm, "
              "ops/attention/rope, ops/moe/router and, at steps of at most layers.moe.FOLD_MAX_TOKENS tokens, the "
              "shared expert folded into the routed grouped GEMM (same run).",
              "Counts are per layer and per step (mean over the layers of a kind and "
              f"{reps} profiled step(s)); 'outside' = kernels outside every layer (uploads, embedding, final "
              "norm, lm head)."]
    text = markdown(results, header, timed=cuda)
    out = Path(args.out or f"benchmarks/results/kernels_per_layer_{tag}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text, flush=True)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
