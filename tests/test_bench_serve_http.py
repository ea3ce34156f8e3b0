"""The HTTP serving benchmark (benchmarks/bench_serve_http.py): vLLM's metric definitions on hand-made records, and
``--quick`` end to end against a real ``gdnserve serve`` on the embedded model (CPU): every workload at C = 1 and 4,
0 errors, the row fields the results pages read, checkpoint hits on the shared-prefix rows, the most concurrent
level's requests equal to the same requests alone, nothing leaked. No timing is asserted."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("httpx")

from benchmarks import bench_serve_http as b  # noqa: E402


def rec(sent_ttft: float, chunks: list[tuple[float, int]], e2e: float, out: int, prompt: int = 10, hit: int = 0):
    return b.Record(ok=True, ttft=sent_ttft, chunks=chunks, e2e=e2e, output_tokens=out, prompt_tokens=prompt,
                    hit_length=hit)


def test_metric_definitions():
    """TTFT: the first text chunk; TPOT: (e2e - TTFT) / (out - 1) per request; ITL: chunk gaps, a chunk of k tokens
    k gaps of gap / k; throughput over the wall time; hit rate over completed requests."""
    r1 = rec(0.1, [(0.1, 1), (0.2, 1), (0.4, 2)], e2e=0.45, out=4, hit=5)
    r2 = rec(0.3, [(0.3, 1), (0.5, 1)], e2e=0.5, out=2)
    bad = b.Record(ok=False, error="HTTP 500")
    row = b.summarize("random", "bf16", 2, [r1, r2, bad], wall=2.0, cpu=0.5, ceiling=10.0)
    assert row["errors"] == 1 and row["completed"] == 2 and row["error_samples"] == ["HTTP 500"]
    assert row["ttft_p50_ms"] == pytest.approx(200.0)                       # median of 100 and 300 ms
    assert row["tpot_p50_ms"] == pytest.approx((0.35 / 3 + 0.2) / 2 * 1e3, abs=0.01)   # 116.7 and 200 ms
    assert row["itl_p50_ms"] == pytest.approx(100.0)                         # gaps 100, 100, 100 (200 / 2 tokens), 200
    assert row["output_tok_s"] == 3.0 and row["total_tok_s"] == 13.0 and row["requests_per_s"] == 1.0
    assert row["checkpoint_hit_rate"] == 0.5 and row["hit_token_share"] == 0.25 and row["pct_of_ceiling"] == 30.0
    assert b.parse_levels("1,16,max,64", 64) == [1, 16, 64] and b.parse_levels("1,256,max", 219) == [1, 219, 256]
    model = {"rows": [{"kind": "decode", "impl": "gdnserve", "shape": "B=16", "format": "fp8", "tokens_per_s": 1600}]}
    assert b.ceiling_for(model, "fp8", 16) == 1600 and b.ceiling_for(model, "bf16", 16) is None
    fp8 = {"model": [{"format": "fp8", "decode": {"16": {"tok_s": 1599.4}}}, {"format": "bf16", "decode": {}}]}
    assert b.ceiling_for(fp8, "fp8", 16) == 1599 and b.ceiling_for(fp8, "fp8", 64) is None     # bench_fp8's JSON
    text = "gdnserve:num_requests_running 0.0\ngdnserve:spec_decode_num_draft_tokens_total 12.0\n"
    assert b.metric(text, "num_requests_running") == 0.0 and b.metric(text, "spec_decode_num_draft_tokens") == 12.0
    assert b.metric(text, "checkpoints_ready") is None


def test_one_percentile_for_both_http_benchmarks():
    """bench_load's percentile is the one both report (it was written twice, nearest-rank in bench_load and
    interpolated here, so the same latencies read differently): interpolated, None without values."""
    from benchmarks import bench_load
    assert b.pct is bench_load.pct
    assert bench_load.pct([], 50) is None and bench_load.pct([0.3, 0.1, 0.2, 0.4], 50) == pytest.approx(0.25)
    assert b.pct_ms([0.1, 0.3], 99) == pytest.approx(298.0) and b.pct_ms([], 50) is None


def test_quick_run_end_to_end(tmp_path):
    rc = b.main(["--quick", "--out", str(tmp_path), "--tag", "test"])
    res = json.loads((tmp_path / "serve_http_test.json").read_text())
    assert rc == 0 and res["complete"] and not res["errors"], res["errors"]
    assert [(r["workload"], r["concurrency"]) for r in res["rows"]] == [
        (w, c) for w in ("random", "prefix", "chat") for c in (1, 4)]
    for r in res["rows"]:
        assert r["errors"] == 0 and r["completed"] == r["requests"] > 0, r
        for k in ("format", "total_tok_s", "output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
                  "itl_p50_ms", "itl_p99_ms", "requests_per_s", "checkpoint_hit_rate", "ceiling_tok_s"):
            assert k in r, k
        assert r["output_tok_s"] > 0 and r["ttft_p99_ms"] >= r["ttft_p50_ms"] > 0 and r["format"] == "fp32"
    assert all(r["checkpoint_hit_rate"] > 0 for r in res["rows"] if r["workload"] == "prefix")
    assert any("memory: budget" in x for x in res["banner"])
    md = (tmp_path / "serve_http_test.md").read_text()
    assert "| random | fp32 | none | 1 | 4 | 0 |" in md and "TTFT p50/p99 ms" in md
    assert all(r["spec"] == "none" and r["spec_acceptance"] is None for r in res["rows"])
    # issue 27: the C = 4 level's requests replayed alone give the same greedy texts; nothing leaked after the run
    assert {w: (v["checked"], v["equal"]) for w, v in res["solo"].items()} == {"random": (4, 4), "prefix": (4, 4)}
    assert res["leaks"]["ok"] and res["leaks"]["running"] == 0, res["leaks"]
    assert "random 4/4; prefix 4/4" in md and "nothing leaked" in md


def test_near_tie_gap_classifies_the_first_difference():
    """The solo check's margin at the first differing character: the solo run's logprob of its token minus the
    batched run's token's (from the solo run's top logprobs), None when the batched token is not among them."""
    from benchmarks.bench_serve_http import Record, near_tie_gap
    alone = Record(text="abcd", tokens=["ab", "c", "d"],
                   top=[{"ab": -0.1}, {"c": -0.70, "x": -0.72, "xy": -0.74}, {"d": -0.2}])
    assert near_tie_gap(alone, "abxyz", 2) == 0.04          # "xy", the longest candidate the batched text starts with
    assert near_tie_gap(alone, "abq", 2) is None             # not in the solo top-k: a real difference
    assert near_tie_gap(Record(text="ab"), "ax", 1) is None  # no logprobs sent
    longer = Record(text="abcd", tokens=["ab", "c", "d"], top=[{"ab": -0.1}, {"c": -0.50, "cx": -0.51}, {"d": -0.2}])
    assert near_tie_gap(longer, "abcxe", 3) == 0.01          # the batched token "cx" extends the solo "c"
