"""benchmarks/bench_skinny_m4.py: the quick smoke run end to end (tiny shapes; the interpreter on CPU), the pruned
config grid, and the TABLE fragment's rules on made-up timings (the real ones need the H200)."""
from __future__ import annotations

import json
import math

from benchmarks import bench_skinny_m4 as b
from gdnserve.ops.gemv import SkinnyConfig, skinny_triton


def test_quick_run(tmp_path):
    assert b.main(["--quick", "--out", str(tmp_path)]) == 0
    (js,) = tmp_path.glob("skinny_m4_*.json")
    res = json.loads(js.read_text())
    assert [(r["N"], r["K"], r["M"]) for r in res["rows"]] == [(n, k, m) for n, k, _ in b.QUICK_SHAPES for m in b.MS]
    for r in res["rows"]:
        assert r["best"]["rel err"] < b.RTOL and r["best"]["deterministic"]
        assert r["rows differ from M = 4's"] == []
        assert len(r["all"]) == len(b.QUICK_CONFIGS)
    assert "every config's M < 4 rows equal its M = 4 rows" in " ".join(res["notes"])
    assert "| 17x96 | 3 |" in js.with_suffix(".md").read_text()


def test_sweep_grid_is_pruned():
    for K in (512, 2048, 4096):
        cfgs = b.sweep_configs(K)
        assert 8 <= len(cfgs) <= 40 and len(set(cfgs)) == len(cfgs)
        for c in cfgs:
            assert not c.dot and c.BK <= K and 16 <= c.BN * c.BK // (32 * c.warps) <= 64
            assert c.stages == 1 or c.BK < K
    first = b.table_configs(skinny_triton.TABLE)
    assert first and b.ordered(b.sweep_configs(2048), first)[:len(first)] == first


def test_fragment_rules(monkeypatch):
    """M = 1 entries kept; at M = 2..4 the fastest beating cuBLAS by 3 %, the M = 1 config preferred within the
    slack; a cuBLAS win ends the ranges (later committed entries dropped, with a note); a new shape takes the
    sweep from M = 1; committed entries past M = 4 follow."""
    one, fast, dot = SkinnyConfig(2, 4096, 4, 1, False), SkinnyConfig(4, 1024, 8, 1, False), SkinnyConfig(16, 512, 4, 3)
    table = {(10, 20): ((1, one), (16, dot)), (30, 40): ((1, one), (16, dot))}
    monkeypatch.setattr(skinny_triton, "PROVISIONAL", {})
    shapes = ((10, 20, "a"), (30, 40, "b"), (50, 60, "new"))
    best, timed = {}, {}
    for M in b.MS:
        best[(10, 20, M)] = (fast, 10.0)            # one is within 2 %: kept (rows = M = 1's)
        timed[(10, 20, M)] = {"cublas": 20.0, "table": 15.0, "m1": 10.1}
        best[(30, 40, M)] = (fast, 10.0 if M < 3 else 19.9)       # cuBLAS wins at M = 3
        timed[(30, 40, M)] = {"cublas": 20.0, "table": 25.0, "m1": 12.0}
        best[(50, 60, M)] = (fast, 5.0)
        timed[(50, 60, M)] = {"cublas": 20.0, "table": None, "m1": 5.0}
    frag, notes = b.fragment(table, shapes, best, timed, 0.02)
    assert frag[(10, 20)] == ((4, one), (16, dot))
    assert frag[(30, 40)] == ((1, one), (2, fast))
    assert frag[(50, 60)] == ((4, fast),)
    assert any("30x40: the committed entries' M >= 3 dropped" in n for n in notes)
    text = b.fragment_text(frag, shapes)
    ns = {"SkinnyConfig": SkinnyConfig}
    assert eval("{\n" + text + "\n}", ns) == frag
    assert math.isclose(timed[(10, 20, 2)]["m1"], 10.1)
