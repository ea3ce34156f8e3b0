"""``gdnserve bench model``: a quick CPU run on the tiny random model writes its JSON and markdown, with
gdnserve's and HF's rows on the same weights (logits equal) for every decode and prefill case (decode first),
and the bf16 parity diagnosis (ours / HF x bf16 / fp32: the fp32 pair equal, routing included); a spent time
budget skips every case with a note instead of failing; without transformers ours still run (HF skipped with a
note); each JSON row carries its markdown line's columns, also in the committed H200 result."""
import json
import re
import sys
from pathlib import Path

import pytest

from gdnserve import cli


def test_help_lists_its_options(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "model", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for option in ("--device", "--quick", "--out", "--no-hf", "--layers", "--experts", "--time-budget"):
        assert option in out


def test_decode_bytes_at_the_benchmark_shape():
    """One decode step reads every non-expert weight once, the experts a uniform router touches (top-8 of 16:
    8 for one token, 12 expected for two), and each GDN layer's fp32 SSM state (2 MiB per request at HV=32,
    K=V=128) and bf16 conv state, read and written; KV of the attention layer at context 0 is nothing."""
    import torch

    from gdnserve.models.config import ModelConfig
    from gdnserve.models.qwen3_5 import HybridLM
    bm = cli.load_benchmark("bench_model")
    cfg = cli.load_benchmark("random_model").bench_hf_config(num_layers=4, num_experts=16, vocab_size=256)
    with torch.device("meta"):
        model = HybridLM(ModelConfig.from_hf(cfg)).to(torch.bfloat16)
    state = 3 * 2 * (32 * 128 * 128 * 4 + 3 * 8192 * 2)          # per request: 3 GDN layers, read + write
    expert = 4 * (2 * 512 * 2048 + 2048 * 512) * 2                 # one expert of each of the 4 layers, bf16
    assert bm.decode_bytes(model, 2, 0) - bm.decode_bytes(model, 1, 0) == pytest.approx(state + 4 * expert, abs=1)


def test_quick_cpu_run_writes_json_and_markdown(tmp_path):
    pytest.importorskip("transformers")
    rc = cli.main(["bench", "model", "--device", "cpu", "--quick", "--out", str(tmp_path)])
    js, md = sorted(tmp_path.glob("model_cpu_*.json")), sorted(tmp_path.glob("model_cpu_*.md"))
    assert len(js) == 1 and len(md) == 1
    res = json.loads(js[0].read_text())
    assert res["errors"] == [] and rc == 0 and res["complete"]
    assert float(res["parity_rel_rms"]) < 1e-4                       # the same weights in both models
    assert res["model_config"]["model_type"] == "qwen3_5_moe_text"
    assert "PyTorch fallback" in res["hf_gdn_path_summary"]           # no fla on CPU
    assert [r["kind"] for r in res["rows"]] == ["decode"] * 4 + ["prefill"] * 4      # decode cases first
    cases = {(r["kind"], r["shape"], r["impl"]) for r in res["rows"]}
    assert cases == {(k, s, i) for k, s in [("prefill", "1x64"), ("prefill", "4x16"), ("decode", "B=1"),
                                             ("decode", "B=4")] for i in ("gdnserve", "hf")}
    for r in res["rows"]:
        assert r["tokens_per_s"] > 0 and r["ms"]["p50"] > 0 and r["floor_ms"] > 0 and r["first_call_s"] >= 0
    d = res["bf16_diagnosis"]
    assert sorted(d["runs"]) == ["hf_bf16", "hf_fp32", "ours_bf16", "ours_fp32"]
    assert set(d["rel_rms"]) == {f"{x} vs {y}" for x, y in bm_pairs()}
    assert d["rel_rms"]["ours_fp32 vs hf_fp32"] < 1e-4                # the same (bf16-representable) weights
    assert d["routing_flip_frac"]["ours_fp32 vs hf_fp32"] == 0.0       # hooks on both models, tokens aligned
    assert d["moe_layers"] == 4 and d["routed_tokens"] == d["prompts"] * d["prompt_len"]
    assert 0 < d["rel_rms"]["ours_bf16 vs hf_fp32"] < 0.5 and 0 < d["rel_rms"]["hf_bf16 vs hf_fp32"] < 0.5
    assert d["interpretation"]
    text = md[0].read_text()
    assert "| case | impl | ms | tokens/s |" in text and "| decode B=4 | hf |" in text
    assert "| runs compared | last-token logits rel-RMS |" in text and d["interpretation"] in text


def bm_pairs():
    return cli.load_benchmark("bench_model").DIAG_PAIRS


def test_spent_budget_skips_every_case_with_a_note(tmp_path):
    rc = cli.main(["bench", "model", "--device", "cpu", "--quick", "--no-hf", "--time-budget", "0",
                   "--out", str(tmp_path)])
    res = json.loads(next(tmp_path.glob("model_cpu_*.json")).read_text())
    assert rc == 0 and res["errors"] == [] and res["complete"] and res["rows"] == []
    assert [s.split(" (")[0] for s in res["skipped"]] == res["case_order"]
    assert all("budget spent" in s for s in res["skipped"])


def test_without_transformers_ours_run_and_hf_is_skipped_with_a_note(tmp_path, monkeypatch, capsys):
    """A fresh install has no transformers (the bench and test extras bring it): the run times ours, exits 0 and
    says in one line why there are no HF rows, so the documented `gdnserve bench model --quick && ...` chain goes
    on (it stopped at an error 'building the HF model' and exit code 1)."""
    monkeypatch.setitem(sys.modules, "transformers", None)           # `import transformers` raises ImportError
    rc = cli.main(["bench", "model", "--device", "cpu", "--quick", "--layers", "2", "--out", str(tmp_path)])
    res = json.loads(next(tmp_path.glob("model_cpu_*.json")).read_text())
    assert rc == 0 and res["errors"] == [] and res["complete"]
    assert [f"{r['kind']} {r['shape']}" for r in res["rows"]] == res["case_order"]
    assert {r["impl"] for r in res["rows"]} == {"gdnserve"}
    note = [n for n in res["notes"] if n.startswith("HF rows skipped: transformers is not importable")]
    assert len(note) == 1 and "'.[bench]'" in note[0]
    assert note[0] in capsys.readouterr().err


def test_json_rows_carry_the_markdown_columns():
    """A JSON row holds what its markdown line shows (case = kind + shape, impl, ms, tokens/s, floor ms, % floor,
    n, 1st call s; ours/HF from the two rows) and the weights' ``format``, under the names tools read."""
    bm = cli.load_benchmark("bench_model")
    m = {"times": [0.002, 0.002, 0.002], "capped": False, "first_call_s": 0.5}
    ours = bm._row("decode", "B=4", 4, "gdnserve", "bf16", m, 0.0005)
    hf = bm._row("decode", "B=4", 4, "hf", "bf16", {**m, "times": [0.004]}, 0.0005)
    assert {k: ours[k] for k in ("kind", "shape", "impl", "format", "tokens", "n")} == \
        {"kind": "decode", "shape": "B=4", "impl": "gdnserve", "format": "bf16", "tokens": 4, "n": 3}
    assert ours["ms"]["p50"] == pytest.approx(2.0) and ours["tokens_per_s"] == pytest.approx(2000)
    assert ours["floor_ms"] == pytest.approx(0.5) and ours["pct_of_floor"] == pytest.approx(25.0)
    lines = bm.table({"rows": [ours, hf]})
    assert "| decode B=4 | gdnserve | 2.00 [2.00–2.00] | 2,000 | 0.50 | 25 % |  | 3 | 0.50 |" in lines
    assert "| decode B=4 | hf | 4.00 [4.00–4.00] | 1,000 | 0.50 | 12 % | 2.00 | 1 | 0.50 |" in lines


def test_committed_h200_json_matches_its_markdown():
    """benchmarks/results/model_h200.json (converted from the run's table) has a row per markdown line, with the
    same numbers, and the run's config in ``model_config``."""
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    res = json.loads((results / "model_h200.json").read_text())
    md = (results / "model_h200.md").read_text()
    assert res["bench"] == "model" and res["model_config"]["num_hidden_layers"] == 40 and res["git"]["commit"]
    lines = [line for line in md.splitlines() if re.match(r"\| (decode|prefill) ", line)]
    assert len(lines) == len(res["rows"]) > 0
    for line, r in zip(lines, res["rows"]):
        assert set(r) >= {"kind", "shape", "impl", "format", "ms", "pct_of_floor", "tokens_per_s", "floor_ms", "n"}
        assert line.startswith(f"| {r['kind']} {r['shape']} | {r['impl']}")
        assert f"| {r['ms']['p50']:.2f} [{r['ms']['p10']:.2f}–{r['ms']['p90']:.2f}] | {r['tokens_per_s']:,} | " \
               f"{r['floor_ms']:.2f} | {r['pct_of_floor']} % |" in line


@pytest.mark.parametrize("a, b, d, word", [
    (0.19, 0.16, 5e-6, "as far from fp32 as ours"),
    (0.19, 0.02, 5e-6, "farther from fp32 than HF"),
    (0.02, 0.19, 5e-6, "closer to fp32 than HF"),
    (0.19, 0.16, 0.1, "disagree in fp32 too")])
def test_interpretation_follows_the_numbers(a, b, d, word):
    bm = cli.load_benchmark("bench_model")
    rel = {"ours_bf16 vs hf_fp32": a, "hf_bf16 vs hf_fp32": b, "ours_bf16 vs hf_bf16": 0.19, "ours_fp32 vs hf_fp32": d}
    flips = {"ours_bf16 vs ours_fp32": 0.35, "hf_bf16 vs hf_fp32": 0.37}
    assert word in bm.interpret(rel, flips)
    assert "Only the bf16 pair" in bm.interpret({"ours_bf16 vs hf_bf16": 0.19}, {})
    assert "Only the fp32 pair" in bm.interpret({"ours_fp32 vs hf_fp32": 4e-7}, {})


def test_loops_stop_at_their_deadlines():
    """Past the case's deadline the timed calls stop after one sample (capped); past the whole budget after HF's
    untimed first call, nothing is timed; HF's first call is never a sample."""
    import time

    import torch
    bm = cli.load_benchmark("bench_model")
    plan = bm.make_plan(False, False)
    calls = []
    dev, past = torch.device("cpu"), time.perf_counter() - 1
    m = bm._capped_loop(lambda: calls.append(1), plan, dev)
    assert not m["capped"] and len(m["times"]) == plan.iters and len(calls) == 1 + plan.warmup + plan.iters
    m = bm._capped_loop(lambda: None, plan, dev, deadline=past)
    assert m["capped"] and len(m["times"]) == 1 and m["first_call_s"] >= 0
    assert bm._capped_loop(lambda: None, plan, dev, hard_end=past)["times"] == []
    m = bm._timed_loop(lambda _: None, plan, dev, deadline=past)
    assert m["capped"] and len(m["times"]) == 1
    assert len(bm._timed_loop(lambda _: None, plan, dev, deadline=float("inf"))["times"]) == plan.iters


def test_full_size_shapes_and_prefill_flops():
    """The full-size default is Qwen3.5-35B-A3B exactly (40 layers in its 3 GDN : 1 attention pattern, 256
    experts top-8, 69.3 GB in bf16); Qwen3-Next-80B-A3B's pattern (159 GB) is over an H200's 139 GiB. The
    prefill floor counts top-k experts + the shared expert per token and the lm head once per sequence."""
    import torch

    from gdnserve.models.config import ModelConfig
    from gdnserve.models.qwen3_5 import HybridLM
    rm, bm = cli.load_benchmark("random_model"), cli.load_benchmark("bench_model")
    full = rm.config_for(torch.device("cuda"), None, None, full=True)
    assert full == rm.full_hf_config() and full["num_hidden_layers"] == 40 and full["num_experts"] == 256
    assert full["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 10
    assert rm.config_for(torch.device("cuda"), None, None)["num_hidden_layers"] == 8      # the quick cut
    n, b = rm.param_bytes(full)
    assert 34.5e9 < n < 35e9 and 69e9 < b < 69.5e9
    n80, b80 = rm.param_bytes(rm.qwen3_next_hf_config())
    assert 79e9 < n80 < 80.5e9 and b80 > 139 * 2**30
    cfg = rm.bench_hf_config(num_layers=4, num_experts=16, vocab_size=256)
    with torch.device("meta"):
        model = HybridLM(ModelConfig.from_hf(cfg)).to(torch.bfloat16)
    dense = sum(p.numel() for name, p in model.named_parameters()
                if ".experts_" not in name and not name.startswith(("embed_tokens", "lm_head")))
    routed = 4 * 8 * (2 * 512 * 2048 + 2048 * 512)                # 4 MoE layers x top-8 experts
    attn = 2 * 16 * 256                                            # 1 attention layer: 2 L^2 H Dh
    one, two = bm.prefill_flops(model, 1, 1), bm.prefill_flops(model, 1, 2)
    assert two - one == pytest.approx(2 * (dense + routed) + attn * (4 - 1), rel=1e-12)
    assert bm.prefill_flops(model, 2, 1) == pytest.approx(2 * one)                # the head once per sequence
    assert one == pytest.approx(2 * (dense + routed) + 2 * 256 * 2048 + attn)
