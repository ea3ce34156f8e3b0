"""benchmarks/bench_fp8.py: the CPU --quick smoke run writes its JSON and markdown with every section's rows
(the dequantizing FP8 path against bf16 at tiny shapes; the tiny random model in FP8 next to bf16, its decode and prefill rows)."""
import json

from benchmarks import bench_fp8


def test_quick_cpu_run_writes_json_and_markdown(tmp_path):
    assert bench_fp8.main(["--device", "cpu", "--quick", "--out", str(tmp_path), "--layers", "2"]) == 0
    rep = json.loads((tmp_path / "fp8_cpu.json").read_text())
    assert {r["M"] for r in rep["linear"]} == {1, 16} and all(r["rel_err"] < 1e-2 for r in rep["linear"])
    assert all("fp8_us" in r for r in rep["linear"] + rep["moe"])
    assert [r["format"] for r in rep["model"]] == ["bf16", "fp8"] and rep["model"][1]["fp8_layers"] > 0
    assert all(list(r["decode"]) == ["1"] and r["prefill_ms"] > 0 for r in rep["model"])
    md = (tmp_path / "fp8_cpu.md").read_text()
    assert "## Linear" in md and "## Routed experts" in md and "## Model" in md
