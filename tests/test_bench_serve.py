"""``gdnserve bench serve``: a quick CPU run drives shared-prefix groups through LLMEngine in every mode and
writes its JSON and markdown; with checkpoints every candidate but the group's first starts from the
prefix state, prefills only prefix + suffixes, and gets the same first token as without checkpoints; every timed pass
follows an untimed pass of the same shape (its wall time recorded)."""
import json

import pytest

from gdnserve import cli


def test_help_lists_its_options(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for option in ("--device", "--quick", "--out", "--groups", "--max-tokens", "--time-budget"):
        assert option in out


def test_quick_cpu_run_writes_json_and_markdown(tmp_path):
    rc = cli.main(["bench", "serve", "--device", "cpu", "--quick", "--groups", "2", "--max-tokens", "2",
                   "--out", str(tmp_path)])
    js, md = sorted(tmp_path.glob("serve_cpu_*.json")), sorted(tmp_path.glob("serve_cpu_*.md"))
    assert len(js) == 1 and len(md) == 1
    res = json.loads(js[0].read_text())
    assert res["errors"] == [] and rc == 0 and res["complete"] and res["skipped"] == []
    rows = {(r["workload"], r["mode"], r["pass"]): r for r in res["rows"]}
    assert len(rows) == 2 * 4 * 2
    for w in res["workloads"]:
        for p in ("latency", "throughput"):
            none, fused = rows[(w["name"], "none", p)], rows[(w["name"], "fused", p)]
            n, g = none["requests"], none["groups"]
            assert n == g * w["candidates"] and none["hits"] == 0
            for mode in ("fused", "two_phase"):
                r = rows[(w["name"], mode, p)]
                assert r["hits"] == n - g                          # all but each group's producer request
                assert r["first_token_agreement_vs_none"] == 1.0
                assert r["prefill_tokens"] == fused["prefill_tokens"] < none["prefill_tokens"]
            assert rows[(w["name"], "score", p)]["hits"] == n
            for r in (none, fused):
                assert r["qps"] > 0 and r["ttft_ms"]["p50"] > 0
            for mode in ("none", "fused", "two_phase", "score"):   # an untimed pass of the same shape first
                r = rows[(w["name"], mode, p)]
                assert r["warmup_wall_s"] > 0 and r["warmup_groups"] == (1 if p == "latency" else r["groups"])
                if mode != "score":
                    if p == "throughput":   # other prompts of the same shape: their token counts may need a step more
                        assert abs(r["warmup_steps"] - r["steps"]) <= 1 and len(r["qps_range"]) == 2
                    else:
                        assert r["warmup_steps"] == r["steps"] // r["groups"]
    assert res["target"]["result"].startswith("n/a")
    assert "| workload | mode | pass |" in md[0].read_text() and "| warm-up s |" in md[0].read_text()


def test_graph_counts_per_pass():
    """Each pass counts its own steps (the counters' difference around it): replays of both graph kinds against
    eager steps, captures beside; None without graphs."""
    from collections import Counter
    from types import SimpleNamespace
    bs = cli.load_benchmark("bench_serve")
    stats = Counter(replay=5, capture=2)
    eng = SimpleNamespace(runner=SimpleNamespace(graphs=SimpleNamespace(stats=stats)))

    @bs.counted
    def pass_(engine):
        stats.update(replay=3, mixed_replay=4, mixed_verify=2, fallback=1, capture=1)
        return {}
    g = pass_(eng)["graphs"]
    assert g == {"replay": 3, "mixed_replay": 4, "eager": 0, "mixed_eager": 0, "mixed_verify": 2, "fallback": 1,
                 "capture": 1}
    assert bs.graph_cell(g) == "7 / 1 (1 cap.)" and bs.graph_cell(None) == "—"
    eng.runner.graphs = None
    assert pass_(eng)["graphs"] is None
