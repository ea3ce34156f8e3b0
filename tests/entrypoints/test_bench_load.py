"""The load benchmark's harness (``benchmarks/bench_load.py``) at a tiny size: the server subprocess starts,
the burst and a short soak run with no error, the drain check finds only READY checkpoints, and the
markdown + JSON are written. No timing is asserted (the numbers are the benchmark's, not a test's)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("httpx")


def test_bench_load_smoke(tmp_path):
    from benchmarks import bench_load
    rc = bench_load.main(["--requests", "12", "--group-size", "4", "--max-tokens", "2", "--soak-seconds", "3",
                          "--soak-clients", "3", "--num-pages", "1024", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "load_cpu.json").read_text())
    assert rc == 0, res
    assert res["burst"]["completed"] == 12 and res["burst"]["errors"] == 0
    assert res["pool_after_burst"]["only_ready_checkpoints"] and res["pool_after_soak"]["only_ready_checkpoints"]
    assert res["soak"]["requests"] >= 3 and res["soak"]["errors"] == 0
    md = (tmp_path / "load_cpu.md").read_text()
    assert "| 12 | 3 x 4 | 2 | 12/12 | 0 |" in md and "RSS before" in md
