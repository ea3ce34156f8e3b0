"""benchmarks/bench_decode_fused.py's CPU smoke run: the tiny model, both impls, the rows and files it writes."""
import json

from benchmarks.bench_decode_fused import main


def test_quick_run_writes_off_and_on_rows(tmp_path):
    assert main(["--out", str(tmp_path), "--quick", "--device", "cpu", "--steps", "1", "--batches", "1,2",
                 "--impls", "off,on"]) == 0
    res = json.loads((tmp_path / "decode_fused_cpu.json").read_text())
    rows = res["rows"]
    assert [(r["shape"], r["impl"]) for r in rows] == [("B=1", "off"), ("B=2", "off"), ("B=1", "on"), ("B=2", "on")]
    for r in rows:
        assert {"kind", "shape", "impl", "format", "ms", "pct_of_floor", "kernels_per_layer"} <= set(r)
        assert r["kind"] == "decode" and r["ms"] > 0 and r["gdn_layers"] > 0
    assert "| bf16 | B=2 | on |" in (tmp_path / "decode_fused_cpu.md").read_text()


def test_spent_budget_skips_and_still_writes(tmp_path):
    assert main(["--out", str(tmp_path), "--quick", "--device", "cpu", "--time-budget", "0"]) == 0
    res = json.loads((tmp_path / "decode_fused_cpu.json").read_text())
    assert res["rows"] == [] and len(res["skipped"]) == 3 and "budget" in res["skipped"][0]


def test_json_is_jsonfmt_form(tmp_path):
    from benchmarks import jsonfmt
    assert main(["--out", str(tmp_path), "--quick", "--device", "cpu", "--steps", "1", "--batches", "1",
                 "--impls", "off"]) == 0
    text = (tmp_path / "decode_fused_cpu.json").read_text()
    assert text == jsonfmt.dumps(json.loads(text), default=None)
