"""benchmarks/bench_engine_overhead.py end to end on the CPU's tiny random model: the rows the results pages and
issue 26 read (``batch``, ``engine_ms``, ``replay_ms``), the engine's decode phase equal to G - 1 steps, serial and overlapped loops. No timing
is asserted."""
from __future__ import annotations

import json

from benchmarks import bench_engine_overhead as b


def test_quick_rows(tmp_path):
    assert b.main(["--quick", "--batches", "1,3", "--prompt", "5", "--generated", "3", "--out", str(tmp_path)]) == 0
    res = json.loads(next(tmp_path.glob("engine_overhead_*.json")).read_text())
    assert [(r["batch"], r["loop"]) for r in res["rows"]] == [(1, "serial"), (1, "overlap"), (3, "serial"),
                                                               (3, "overlap")] and not res["errors"]
    for r in res["rows"]:
        assert r["engine_ms"] > 0 and r["synced_ms"] > 0 and r["replay_ms"] > 0 and r["decode_steps"] == 2
        assert r["ratio"] == round(r["engine_ms"] / r["replay_ms"], 3) or abs(r["ratio"] - r["engine_ms"] / r["replay_ms"]) < 0.01
    assert "engine / bare" in next(tmp_path.glob("engine_overhead_*.md")).read_text()
