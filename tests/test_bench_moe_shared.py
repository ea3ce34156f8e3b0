"""The folded-shared-expert MoE block benchmark runs end to end (CPU smoke run, tiny shapes)."""
from __future__ import annotations

import json

from benchmarks import bench_moe_shared


def test_smoke(tmp_path, device):
    # the Triton backend needs the interpreter on CPU tensors: on a GPU machine (no TRITON_INTERPRET) run on CUDA
    out = tmp_path / "moe_shared.md"
    assert bench_moe_shared.main(["--device", device.type, "--tokens", "3", "--experts", "9", "--hidden", "32",
                                  "--intermediate", "16", "--iters", "1", "--out", str(out), "--commit", "x"]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["T"], r["variant"]) for r in rows] == [(3, "unfolded"), (3, "folded")]
    assert rows[1]["rel_rms_vs_unfolded"] < 1e-2 and rows[1]["rel_rms_vs_f64"] < 1e-2
    assert "| 3 |" in out.read_text()


def test_smoke_fp8(tmp_path, device):
    """--fp8: the block in block FP8 (the shared expert folded again), folded and unfolded within FP8 rounding."""
    out = tmp_path / "moe_shared_fp8.md"
    assert bench_moe_shared.main(["--device", device.type, "--tokens", "2", "--experts", "9", "--hidden", "128",
                                  "--intermediate", "128", "--iters", "1", "--out", str(out), "--commit", "x",
                                  "--fp8"]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["T"], r["variant"]) for r in rows] == [(2, "unfolded"), (2, "folded")]
    assert rows[1]["rel_rms_vs_unfolded"] < 5e-2 and rows[1]["rel_rms_vs_f64"] < 0.15
    assert "block FP8" in out.read_text()
