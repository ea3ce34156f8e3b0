"""The report every end-to-end benchmark (bench_model, bench_serve, bench_spec) writes: one JSON and one
markdown file ``<bench>_<device>_<date>.json/.md`` under --out, rewritten after every row so a run killed
by a time limit still leaves its partial results (``"complete": false`` until the end); progress lines on
stderr with the elapsed time; a time budget after which the remaining cases are skipped (and listed).
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from benchmarks.bench_ops import _err, _git, _versions, device_name, device_slug
from benchmarks.timing import percentiles
from benchmarks import jsonfmt


def pct(values: list[float]) -> dict[str, float]:
    """{p10, p50, p90} of a list of samples."""
    return percentiles(values)


def fmt_pct(p: dict[str, float] | None, fmt: str = ".1f") -> str:
    """``median [P10–P90]``."""
    if not p:
        return "—"
    return f"{format(p['p50'], fmt)} [{format(p['p10'], fmt)}–{format(p['p90'], fmt)}]"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def one_thread_on_cpu(device: torch.device) -> Iterator[None]:
    """On CPU, one intra-op thread for the run: at the tiny CPU shapes more threads only add OpenMP wake-ups,
    which on a loaded 2-core machine made the same step vary tenfold (as in bench_grouped_prefill)."""
    threads = torch.get_num_threads()
    if device.type != "cuda":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_cli(name: str, device_arg: str, run: Callable[[torch.device], dict[str, Any]],
            validate: Callable[[torch.device], Any] | None = None) -> int:
    """The ``run_from_args`` of the end-to-end benchmarks: resolve ``--device`` (and ``validate`` the options
    against it), 2 with a message on bad options; ``run(device)`` with one CPU thread; 1 if it recorded errors."""
    from benchmarks.bench_ops import resolve_device
    try:
        device = resolve_device(device_arg)
        if validate is not None:
            validate(device)
    except (ValueError, RuntimeError) as e:
        print(f"bench {name}: {e}", file=sys.stderr)
        return 2
    with one_thread_on_cpu(device):
        res = run(device)
    return 1 if res["errors"] else 0


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """(result, seconds): perf_counter around ``fn()`` with the device synchronised before and after, so the
    time covers the host work and every kernel of the call."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


class Report:
    """Collects rows, notes and errors of one benchmark run and keeps its JSON + markdown files current.
    ``table(res)`` renders the bench-specific markdown lines from the result dict."""

    def __init__(self, bench: str, title: str, device: torch.device, out_dir: Path, *, quick: bool,
                 budget_s: float, table: Callable[[dict[str, Any]], list[str]], **fields: Any) -> None:
        self.t0 = time.perf_counter()
        self.bench, self.title, self.table, self.budget_s = bench, title, table, budget_s
        self.res: dict[str, Any] = {
            "schema": 1, "bench": bench, "device": device_name(device), "device_slug": device_slug(device),
            "date": _dt.date.today().isoformat(), **_versions(), "git": _git(), "quick": quick,
            "argv": sys.argv, "time_budget_s": budget_s, **fields,
            "rows": [], "skipped": [], "errors": [], "notes": [], "complete": False}
        out_dir.mkdir(parents=True, exist_ok=True)
        stem = out_dir / f"{bench}_{self.res['device_slug']}_{self.res['date']}"
        self.res["paths"] = {"json": str(stem.with_suffix(".json")), "md": str(stem.with_suffix(".md"))}

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def log(self, msg: str) -> None:
        print(f"[bench {self.bench} {self.elapsed:6.1f}s] {msg}", file=sys.stderr, flush=True)

    def over_budget(self, what: str) -> bool:
        """True (and ``what`` recorded as skipped) once the time budget is spent."""
        if self.elapsed <= self.budget_s:
            return False
        self.res["skipped"].append(what)
        self.log(f"time budget {self.budget_s:.0f}s spent: skipping {what}")
        return True

    def add(self, row: dict[str, Any]) -> None:
        self.res["rows"].append(row)
        self.write()

    def note(self, text: str) -> None:
        self.res["notes"].append(text)
        self.log(text)

    def error(self, where: str, e: BaseException) -> None:
        """Record an exception (call from its ``except`` block: the traceback goes to stderr, i.e. the log)."""
        traceback.print_exc(file=sys.stderr)
        self.res["errors"].append({"where": where, "error": _err(e)})
        self.log(f"{where} FAILED: {_err(e)}")
        self.write()

    def write(self) -> None:
        self.res["elapsed_s"] = round(self.elapsed, 1)
        Path(self.res["paths"]["json"]).write_text(jsonfmt.dumps(self.res))
        Path(self.res["paths"]["md"]).write_text(self.markdown())

    def finish(self) -> dict[str, Any]:
        self.res["complete"] = True
        self.write()
        print(self.markdown())
        self.log(f"wrote {self.res['paths']['json']}, {self.res['paths']['md']}"
                 + (f"; {len(self.res['errors'])} error(s)" if self.res["errors"] else ""))
        return self.res

    def markdown(self) -> str:
        r = self.res
        git = f" (git {r['git']['commit']}{', dirty' if r['git']['dirty'] else ''})" if r.get("git") else ""
        L = [f"# {self.title} — {r['device']}, {r['date']}", "",
             f"torch {r['torch']}, triton {r['triton']}, gdnserve {r['gdnserve']}{git}; "
             f"{'quick' if r['quick'] else 'full'} run, {r.get('elapsed_s', 0):.0f} s"
             + ("" if r["complete"] else " — **partial** (the run has not finished)") + ".", ""]
        L += self.table(r)
        if r["skipped"]:
            L += ["", f"Skipped (time budget {r['time_budget_s']:.0f} s): " + "; ".join(r["skipped"])]
        if r["errors"]:
            L += ["", "## Errors", ""] + [f"- {e['where']}: {e['error']}" for e in r["errors"]]
        if r["notes"]:
            L += ["", "## Notes", ""] + [f"- {n}" for n in r["notes"]]
        return "\n".join(L) + "\n"


def model_summary(hf_cfg: dict[str, Any], dtype: torch.dtype) -> str:
    c = hf_cfg
    return (f"Random-weight Qwen3.5-MoE-shaped model ({dtype}): {c['num_hidden_layers']} layers "
            f"({sum(t == 'linear_attention' for t in c['layer_types'])} GDN, "
            f"{sum(t == 'full_attention' for t in c['layer_types'])} attention), hidden {c['hidden_size']}, "
            f"GDN H={c['linear_num_key_heads']} HV={c['linear_num_value_heads']} K={c['linear_key_head_dim']} "
            f"V={c['linear_value_head_dim']}, attention {c['num_attention_heads']}q/{c['num_key_value_heads']}kv "
            f"x {c['head_dim']}, MoE {c['num_experts']} experts top-{c['num_experts_per_tok']} "
            f"(I={c['moe_intermediate_size']}, shared {c['shared_expert_intermediate_size']}), "
            f"vocab {c['vocab_size']}; the exact config is in the JSON (`model_config`).")
