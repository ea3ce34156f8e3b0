"""The ``gdnserve`` command line.

    gdnserve bench ops [--device auto|cpu|cuda[:N]] [--quick] [--out DIR] [--no-fla]
    gdnserve bench grouped-prefill [--device ...] [--quick] [--out DIR] [--no-fla] [--modes M1,M2,...]
    gdnserve bench model | serve | spec [--device ...] [--quick] [--out DIR] [--layers N] [--experts N] ...
    gdnserve generate PROMPT [--model DIR] [--max-tokens N] [--device ...] [--dtype ...]
    gdnserve score PREFIX CANDIDATE... [--model DIR] [--labels ID,...] [--softmax] [--json] ...
    gdnserve serve [--model DIR] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--prefill-mode fused] ...
    gdnserve serve --replicas N [--router affinity|default] [--replica-cpus C] [--replica-gpus G] ...

One ``_add_*`` function per command registers its parser and sets ``func``, a handler that takes the
parsed arguments and returns an exit code. Heavy imports (torch, the benchmarks) happen inside handlers,
so ``--help`` is instant.

The benchmarks write to ``--out``, by default a folder in the user's cache
(``$XDG_CACHE_HOME/gdnserve/bench``, else ``~/.cache/gdnserve/bench``), never into the checkout; results
meant for the repository are written with ``--out benchmarks/results``.

The benchmarks live in the repository's ``benchmarks/`` folder, not in the package. The CLI finds
them beside the package directory: an editable install (``pip install -e .``) leaves the package in
the checkout. A non-editable install has no ``benchmarks/``, and the CLI says so.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RESULTS = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gdnserve" / "bench"


class BenchmarkNotFound(RuntimeError):
    pass


def load_benchmark(name: str) -> ModuleType:
    """Import ``benchmarks.<name>`` from the checkout that holds this package."""
    path = REPO_ROOT / "benchmarks" / f"{name}.py"
    if not path.is_file():
        raise BenchmarkNotFound(
            f"benchmark '{name}' not found: expected {path}. The benchmarks ship with the repository, not "
            f"the wheel; run from a clone installed with `pip install -e .`.")
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    module = importlib.import_module(f"benchmarks.{name}")
    found = Path(getattr(module, "__file__", "") or "").resolve()
    if found != path.resolve():
        raise BenchmarkNotFound(f"`benchmarks.{name}` resolved to {found}, not {path}: another package named "
                                f"`benchmarks` shadows the repository's; run `python -m benchmarks.{name}` "
                                f"from {REPO_ROOT} instead.")
    return module


def _add_bench_common(p: argparse.ArgumentParser, cpu_shapes: str, what: str, files: str, fla_help: str) -> None:
    p.add_argument("--device", default="auto",
                   help=f"auto (default: cuda if available, else cpu), cpu, cuda or cuda:N. On CPU {cpu_shapes}, "
                        "PyTorch path only, no fla")
    p.add_argument("--quick", action="store_true", help=f"fewer iterations; on CUDA only the {what} the targets name")
    p.add_argument("--out", type=Path, default=DEFAULT_RESULTS,
                   help=f"folder for {files} (default: {DEFAULT_RESULTS})")
    p.add_argument("--no-fla", dest="fla", action="store_false", help=fla_help)


def add_bench_ops_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``bench ops``; ``python -m benchmarks.bench_ops`` takes the same ones."""
    _add_bench_common(p, "the workloads are tiny (H=2, HV=4, K=V=32)", "shapes", "ops_<device>_<date>.json and .md",
                      "skip the flash-linear-attention (fla-core 0.6.0) comparison rows")


def add_bench_grouped_prefill_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``bench grouped-prefill``; ``python -m benchmarks.bench_grouped_prefill`` takes the same."""
    _add_bench_common(p, "the shapes are tiny (H=2, HV=4, K=V=16), fewer workloads", "workloads",
                      "grouped_prefill_<device>_<date>.json, .md and .png",
                      "skip fla's two-phase path (fla-core 0.6.0), the peer measured in the same run")
    p.add_argument("--modes", default="serial,two_phase,two_phase_indexed,fused",
                   help="comma-separated executors to time (default: all four); serial always runs, it is the "
                        "baseline of the speedup and of the correctness column")


def _add_bench_e2e_common(p: argparse.ArgumentParser, files: str) -> None:
    """Options shared by the end-to-end benchmarks (random-weight model, benchmarks/random_model.py)."""
    p.add_argument("--device", default="auto",
                   help="auto (default: cuda if available, else cpu), cpu, cuda or cuda:N. On CPU a tiny fp32 model "
                        "(a smoke test of the harness, not a performance figure)")
    p.add_argument("--quick", action="store_true", help="fewer iterations and cases (CI smoke runs)")
    p.add_argument("--out", type=Path, default=DEFAULT_RESULTS, help=f"folder for {files} (default: {DEFAULT_RESULTS})")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: 8 on CUDA, 4 on CPU; 3 GDN : 1 "
                                                             "attention)")
    p.add_argument("--experts", type=int, default=None, help="MoE experts (default: 64 on CUDA, 8 on CPU; top-8 on "
                                                              "CUDA)")
    p.add_argument("--time-budget", type=float, default=150.0,
                   help="seconds after which the remaining cases are skipped (default 150); partial results are "
                        "written after every case")


def add_bench_model_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``bench model``; ``python -m benchmarks.bench_model`` takes the same ones."""
    _add_bench_e2e_common(p, "model_<device>_<date>.json and .md")
    p.add_argument("--no-hf", dest="hf", action="store_false",
                   help="skip the HF transformers rows (Qwen3_5MoeForCausalLM on the same weights)")


def add_bench_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``bench serve``; ``python -m benchmarks.bench_serve`` takes the same ones."""
    _add_bench_e2e_common(p, "serve_<device>_<date>.json and .md")
    p.add_argument("--groups", type=int, default=None,
                   help="groups per throughput run (default: 16 for the RFC workload on CUDA, 4 for 1P2048+16C64)")
    p.add_argument("--max-tokens", type=int, default=1,
                   help="tokens generated per request (default 1: score-like, first token only)")


def add_bench_spec_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``bench spec``; ``python -m benchmarks.bench_spec`` takes the same ones."""
    _add_bench_e2e_common(p, "spec_<device>_<date>.json and .md")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default: 1,16,64,256 on CUDA)")
    p.add_argument("--ks", default="1,2,3", help="comma-separated draft lengths k (default 1,2,3)")
    p.add_argument("--acceptance", default="1.0,0.6",
                   help="comma-separated oracle acceptance rates per draft token (default 1.0,0.6)")


def _bench_ops(args: argparse.Namespace) -> int:
    return load_benchmark("bench_ops").run_from_args(args)


def _bench_grouped_prefill(args: argparse.Namespace) -> int:
    return load_benchmark("bench_grouped_prefill").run_from_args(args)


_E2E = {  # name -> (module, add_arguments, help)
    "model": ("bench_model", add_bench_model_arguments,
              "model prefill / decode tokens/s: gdnserve vs HF transformers on the same random weights"),
    "serve": ("bench_serve", add_bench_serve_arguments,
              "end-to-end LLMEngine: shared-prefix groups with checkpoints (fused, two_phase) vs none; QPS, TTFT"),
    "spec": ("bench_spec", add_bench_spec_arguments,
             "speculative decoding tokens/s (oracle drafts, k = 1..3, intermediate vs replay) vs plain decode"),
}


def _add_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help=f"benchmarks (write JSON + markdown to --out, default {DEFAULT_RESULTS})",
                           description="Benchmarks; each writes JSON and a markdown table.")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="{ops,grouped-prefill,model,serve,spec}",
                                     required=True)
    ops = bench_sub.add_parser(
        "ops", help="op benchmarks: conv + chunked prefill, decode, verify; ours vs fla",
        description="Time gdnserve's ops (conv + chunked GDN prefill, decode, verify) against fla 0.6.0 at the "
                    "Qwen3.5-35B-A3B GDN shape, print the roofline, and write JSON + markdown to --out.")
    add_bench_ops_arguments(ops)
    ops.set_defaults(func=_bench_ops)
    gp = bench_sub.add_parser(
        "grouped-prefill", help="grouped prefill (1 prefix, N continuations): the four executors vs fla's two-phase",
        description="Time one GDN layer's prefill core for shared-prefix workloads (1P512+{1..16}C64, "
                    "1P4096+{16,64}C256, 4Px8C) with each grouped-prefill executor (serial, two_phase, "
                    "two_phase_indexed, fused) and fla's two-phase path, check they agree, print the targets, and "
                    "write JSON + markdown + a PNG plot to --out.")
    add_bench_grouped_prefill_arguments(gp)
    gp.set_defaults(func=_bench_grouped_prefill)
    for name, (module, add_arguments, text) in _E2E.items():
        p = bench_sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + "; writes JSON + markdown.")
        add_arguments(p)
        p.set_defaults(func=lambda args, module=module: load_benchmark(module).run_from_args(args))


def _add_generate(sub) -> None:
    from gdnserve.entrypoints.generate import add_generate_arguments, run_generate
    p = sub.add_parser("generate", help="greedy continuation of a prompt (embedded model by default)")
    add_generate_arguments(p)
    p.set_defaults(func=run_generate)


def _add_score(sub) -> None:
    from gdnserve.entrypoints.score import add_score_arguments, run_score
    p = sub.add_parser("score", help="score candidates after a shared prefix (embedded model by default)",
                       description="Score each CANDIDATE as a continuation of PREFIX, the prefix computed once "
                                   "(as /v1/score does): tokens, summed and mean log-probability, label probabilities.")
    add_score_arguments(p)
    p.set_defaults(func=run_score)


def _add_serve(sub) -> None:
    from gdnserve.entrypoints.serve import add_serve_arguments, run_serve
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (embedded model by default)")
    add_serve_arguments(p)
    p.set_defaults(func=run_serve)
    _add_replicas(p, run_serve)


def _add_replicas(p: argparse.ArgumentParser, run_serve) -> None:
    """``serve --replicas N``: N engines on Ray Serve (gdnserve/replicas/serve_cli.py; Ray imported only then)."""
    from gdnserve.replicas.serve_cli import add_replica_arguments, run_replicas
    add_replica_arguments(p)
    p.set_defaults(func=lambda a: (_tp_with_replicas(a) or run_replicas(a)) if a.replicas is not None else run_serve(a))


def _tp_with_replicas(args: argparse.Namespace) -> int:
    """Replicas run TP = 1 engines: refuse a tensor-parallel size with them rather than ignore it."""
    if getattr(args, "tensor_parallel_size", 1) != 1:
        print("gdnserve serve: --tensor-parallel-size with --replicas is not supported yet (each replica runs one "
              "GPU); use one or the other", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gdnserve", description="gdnserve: an inference engine for hybrid "
                                     "Gated-DeltaNet + attention models.")
    sub = parser.add_subparsers(dest="command", metavar="{serve,generate,score,bench}", required=True)
    _add_serve(sub)
    _add_generate(sub)
    _add_score(sub)
    _add_bench(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except BenchmarkNotFound as e:
        print(f"gdnserve: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
