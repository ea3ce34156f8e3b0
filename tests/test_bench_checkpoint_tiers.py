"""benchmarks/bench_checkpoint_tiers.py on CPU, tiny (a smoke test of its logic; its numbers need the H200): both
modes and every turn reported, the tier-on run's later turns hit from the host tier where the tier-off run misses,
restore-vs-recompute rows, the JSON (one row per line) and the markdown written."""
from __future__ import annotations

import json

from benchmarks.bench_checkpoint_tiers import main


def test_bench_checkpoint_tiers_smoke(tmp_path):
    assert main(["--device", "cpu", "--out", str(tmp_path), "--conversations", "4", "--turns", "2",
                 "--num-slots", "3", "--concurrency", "1", "--system-tokens", "8", "--user-tokens", "2",
                 "--max-tokens", "2", "--samples", "1", "--num-pages", "128"]) == 0
    res = json.loads((tmp_path / "checkpoint_tier_cpu.json").read_text())
    rows = {(r["mode"], r["turn"]): r for r in res["rows"]}
    assert set(rows) == {("off", 1), ("off", 2), ("on", 1), ("on", 2)}
    assert rows[("off", 2)]["hit_rate"] <= 2 / 4 and rows[("on", 2)]["hit_rate"] == 1.0
    assert rows[("on", 2)]["hits_by_tier"].get("host", 0) >= 2
    assert len(res["restore"]) == 1 and all(r["restore_ms"] > 0 and r["recompute_ms"] > 0 for r in res["restore"])
    assert res["targets"]["hit_rate_on"] == 1.0            # over the later turns
    md = (tmp_path / "checkpoint_tier_cpu.md").read_text()
    assert "| on | 2 |" in md and "## Targets" in md
