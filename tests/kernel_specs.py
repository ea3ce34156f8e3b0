"""Counts the Triton kernel specialisations a test run launches, per test file: what a GPU run compiles.

On the H200 a test file's time is mostly Triton compiling one binary per distinct specialisation of a kernel
(~1-5 s each); the CPU interpreter compiles nothing, so a CPU run cannot show that cost. This plugin, loaded
under the interpreter, keys every launch the way ``gdnserve.ops.launch`` and Triton's jit do (constexpr
values, tensor dtypes and 16-byte alignment, None, integers == 1 / divisible by 16 / wider than 32 bits,
warps, stages) and prints, per file, the number of distinct keys (= GPU compiles, given the same config row):

    PYTHONPATH=$PWD python -m pytest -q -n 0 -p tests.kernel_specs tests/ops/test_router.py

``GDNSERVE_SPECS_ROW="NVIDIA H200"`` runs the chunked prefill with that device's ChunkConfig row (chunk_configs.TABLE)
instead of the default, as on that GPU. Estimates only: gpu-marked tests are skipped here, and backend="auto"
takes PyTorch on CPU (model and engine tests run their Triton kernels only where they ask for them).
"""
from __future__ import annotations

import inspect
from collections import defaultdict


_keys: dict[str, set] = defaultdict(set)
_first: dict[tuple, str] = {}       # key -> the test that launched it first
_current: list[str] = ["?", "?"]    # file, test


def _kinds(fn) -> tuple[str, ...]:
    dns = set(fn.kwargs.get("do_not_specialize", ()) or ())
    kinds = []
    for i, p in enumerate(inspect.signature(fn.fn).parameters.values()):
        if "constexpr" in str(p.annotation):
            kinds.append("c")
        else:
            kinds.append("n" if (p.name in dns or i in dns) else "s")
    return tuple(kinds)


def _spec(kind: str, a):
    """The launch path's own specialisation key of one argument (ops/launch.py), as text: hashable and
    printable whatever the constexpr's value."""
    from gdnserve.ops.launch import _spec as launch_spec
    return repr(launch_spec(kind, a))


def pytest_configure(config):
    import os

    from triton.runtime.interpreter import InterpretedFunction

    from gdnserve.ops.gdn import chunk_configs
    row = os.environ.get("GDNSERVE_SPECS_ROW")
    if row:
        chunk_configs.DEFAULT = chunk_configs.TABLE[row]
    run = InterpretedFunction.run

    def counting_run(self, *args, grid, warmup, **kwargs):
        if not warmup:
            kinds = _kinds(self)
            key = (self.fn.__module__, self.fn.__name__, kwargs.get("num_warps"), kwargs.get("num_stages"),
                   *(_spec(k, a) for k, a in zip(kinds, args)))
            _keys[_current[0]].add(key)
            _first.setdefault((_current[0], key), _current[1])
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = counting_run


def pytest_runtest_setup(item):
    _current[:] = [item.nodeid.split("::")[0], item.nodeid.split("::", 1)[1]]


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line("kernel specialisations (distinct launch keys) per file:")
    for f in sorted(_keys):
        per_fn = defaultdict(int)
        for k in _keys[f]:
            per_fn[k[1]] += 1
        detail = ", ".join(f"{n} {c}" for n, c in sorted(per_fn.items(), key=lambda x: -x[1]))
        terminalreporter.write_line(f"  {len(_keys[f]):4d} {f}: {detail}")
        if terminalreporter.config.getoption("verbose") > 0:   # -v: the new keys each test brought
            per_test = defaultdict(int)
            for k in _keys[f]:
                per_test[_first[(f, k)]] += 1
            for t, c in per_test.items():
                terminalreporter.write_line(f"         {c:3d} {t}")
