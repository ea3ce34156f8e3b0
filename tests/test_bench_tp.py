"""``python -m benchmarks.bench_tp`` on CPU: TP=2 as two gloo processes against TP=1, every section in one quick
run (Qwen3-Next's family at the tiny shape: a second worker group in the same process). The equality section finds every greedy token equal and the logprobs within fp32's
1e-5 (plain prompts, a checkpoint group, speculative decoding with accepted n-gram drafts); the throughput rows
exist at both sizes with TP=2's all-reduces counted (two per layer: the mixer's and the MLP's); the serve rows run
the RFC workload at both sizes with checkpoint hits. The random model's shards are cuts of the size-1 weights."""
import json

import torch

from benchmarks import bench_tp
from benchmarks.tp_model import build_random_shard
from gdnserve.layers.linear import load_shard


def test_shards_are_cuts_of_the_size_1_weights():
    cfg = bench_tp.model_config(torch.device("cpu"), "tiny", 4, 8)
    full = dict(build_random_shard(cfg, torch.device("cpu"), torch.float32, chain=True).named_parameters())
    for r in range(2):
        shard = build_random_shard(cfg, torch.device("cpu"), torch.float32, r, 2, chain=True)
        for name, p in shard.named_parameters():
            if ".mlp." not in name:                    # MoE blocks are folded (the shared expert appended)
                assert torch.equal(p, load_shard(shard, name, full[name])), name
        assert shard.layers[0].mixer.out_proj.weight.shape[1] * 2 == full["layers.0.mixer.out_proj.weight"].shape[1]


def test_quick_cpu_run_tp2_equals_tp1(tmp_path):
    rc = bench_tp.main(["--device", "cpu", "--quick", "--tp", "1,2", "--out", str(tmp_path),
                        "--time-budget", "600"])
    res = json.loads((tmp_path / "tp_cpu.json").read_text())
    assert rc == 0 and res["errors"] == [] and res["complete"] and res["skipped"] == []
    eq = res["equality"]["2"]
    assert eq["within_tolerance"], eq
    for p in ("logprobs", "spec"):
        r = eq["passes"][p]
        assert r["equal_tokens"] == r["tokens"] > 0 and r["sequences_equal"] == r["sequences"]
        assert r["counters_tpN"] == r["counters_tp1"]            # same drafts, acceptances, checkpoint hits
        assert r["counters_tpN"]["checkpoint_hits"] > 0           # the group's consumers started from the prefix
    lp = eq["passes"]["logprobs"]
    assert lp["logprob_positions"] == lp["tokens"] and lp["max_abs_d_alt_logprob"] <= 1e-5
    assert eq["passes"]["spec"]["counters_tpN"]["spec_accepted"] > 0
    rows = [r for r in res["rows"] if r["section"] == "throughput"]
    layers = res["model_config"]["num_hidden_layers"]
    cases = [("decode", "B=1"), ("decode", "B=4"), ("prefill", "1x64"), ("prefill", "4x16")]
    assert sorted((r["model"], r["tp"], r["kind"], r["shape"]) for r in rows) == sorted(
        [("4-layer", tp, k, s) for tp in (1, 2) for k, s in cases] + [("qwen3-next-tiny", 2, k, s) for k, s in cases])
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["n"] >= 1
        if r["tp"] == 2:
            assert r["allreduce"]["calls_per_step"] == 2 * layers and r["allreduce"]["ms_per_step"] > 0
        else:
            assert r["allreduce"] is None
    serve = {(r["tp"], r["mode"], r["pass"]): r for r in res["rows"] if r["section"] == "serve"}
    assert len(serve) == 2 * 3 * 2
    assert all(serve[(tp, "fused", "throughput")]["hits"] > 0 for tp in (1, 2))
    md = (tmp_path / "tp_cpu.md").read_text()
    assert "**within tolerance**" in md and "| all-reduce calls |" in md and "| RFC-tiny" in md
