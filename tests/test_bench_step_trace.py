"""benchmarks/step_trace.py on the CPU (tiny random model): every engine step listed, grouped by kind."""
from benchmarks import step_trace


def test_step_trace_smoke(tmp_path):
    assert step_trace.main(["--out", str(tmp_path), "--shape", "tiny", "--device", "cpu", "--requests", "2",
                            "--prompt", "40", "--output", "4"]) == 0
    text = (tmp_path / "step_trace_cpu.md").read_text()
    assert "warm-up: nothing to warm" in text and "generated 8" in text
