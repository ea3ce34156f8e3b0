"""benchmarks/solo_probe.py on the CPU: the tiny random model, two variants and the float32 reference; on the CPU
(float32, the PyTorch path) a request batched equals it alone bit for bit, so every comparison is exact."""
import json

from benchmarks import solo_probe


def test_solo_probe_smoke(tmp_path):
    assert solo_probe.main(["--shape", "tiny", "--device", "cpu", "--out", str(tmp_path), "--requests", "4",
                            "--solo", "2", "--gen", "3", "--lens", "100,63", "--variants", "default,plain",
                            "--ref"]) == 0
    res = json.loads((tmp_path / "solo_probe_cpu.json").read_text())
    rows = {r["variant"]: r for r in res["rows"]}
    assert set(rows) == {"default", "plain", "float32 reference"}
    for r in (rows["default"], rows["plain"]):
        for key in ("batched_vs_solo", "batched_vs_fresh_solo", "solo_vs_fresh_solo"):
            assert all(c["first_diff"] is None and c["top0_max_abs"] == 0.0 for c in r[key]), (r["variant"], key)
    assert all(c["first_diff"] is None for c in rows["float32 reference"]["fp32_batched_vs_fp32_alone"])
    assert "Batched vs alone" in (tmp_path / "solo_probe_cpu.md").read_text()
