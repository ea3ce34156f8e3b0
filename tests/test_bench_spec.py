"""``gdnserve bench spec``: the oracle drafter's acceptance, the state-traffic formula at the Qwen3.5 shape,
and a quick CPU run through LLMEngine with speculative decoding in both verify modes."""
import json

import pytest

from gdnserve import cli


def test_help_lists_its_options(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "spec", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for option in ("--device", "--quick", "--out", "--batches", "--ks", "--acceptance", "--time-budget"):
        assert option in out


def test_bad_k_is_a_usage_error(tmp_path, capsys):
    assert cli.main(["bench", "spec", "--device", "cpu", "--ks", "0", "--out", str(tmp_path)]) == 2
    assert "--ks" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_oracle_drafter_accepts_rate_times_k_on_average():
    od = cli.load_benchmark("oracle_drafter")
    from gdnserve.speculative.acceptance import greedy_accept
    import torch
    prompt = [5, 6, 7]
    future = prompt + list(range(10, 410))
    d = od.RecordedOracleDrafter([future], 3, k=3, rate=0.6)
    accepted = []
    for pos in range(4, 300):
        drafts = d.propose(future[:pos])
        n, _ = greedy_accept(torch.tensor([drafts]), torch.tensor([future[pos:pos + 4]]))
        accepted.append(int(n))
    assert sorted(set(accepted)) == [1, 2] and abs(sum(accepted) / len(accepted) - 1.8) < 0.1
    assert d.propose(prompt + [999]) == [] and d.diverged == {0}


def test_state_bytes_at_the_qwen35_shape():
    """Per request per GDN layer (fp32 SSM state 2 MiB): plain 2 states, intermediate 1 + (k+1) + 2 (verify
    read, scratch writes, commit copy), replay 2 (the slot read and written once)."""
    bs = cli.load_benchmark("bench_spec")
    from gdnserve.models.config import ModelConfig
    g = ModelConfig.from_hf(cli.load_benchmark("random_model").bench_hf_config()).gdn
    S = 32 * 128 * 128 * 4
    assert bs.state_bytes("plain", 0, 1, g, 2, 1)["ssm"] == 2 * S
    assert bs.state_bytes("intermediate", 3, 4, g, 2, 2.0)["ssm"] == 4 * 7 * S
    assert bs.state_bytes("replay", 3, 4, g, 2, 2.0)["ssm"] == 4 * 2 * S


def test_quick_cpu_run_writes_json_and_markdown(tmp_path):
    rc = cli.main(["bench", "spec", "--device", "cpu", "--quick", "--batches", "3", "--ks", "1,3",
                   "--acceptance", "1.0,0.5", "--out", str(tmp_path)])
    js, md = sorted(tmp_path.glob("spec_cpu_*.json")), sorted(tmp_path.glob("spec_cpu_*.md"))
    assert len(js) == 1 and len(md) == 1
    res = json.loads(js[0].read_text())
    assert res["errors"] == [] and rc == 0 and res["complete"]
    rows = res["rows"]
    assert [r["mode"] for r in rows[:1]] == ["plain"] and len(rows) == 1 + 2 * 2 * 2
    assert rows[0]["tokens_per_step"] == 1.0
    for r in rows[1:]:
        assert r["diverged"] == 0 and r["scratch_bytes"] > 0 and r["tokens_per_s"] > 0
        if r["rate"] == 1.0:
            assert r["tokens_per_step"] == r["k"] + 1           # every oracle draft accepted
        else:
            assert 1.0 <= r["tokens_per_step"] < r["k"] + 1
    inter = {r["k"]: r["scratch_bytes"] for r in rows if r["mode"] == "intermediate"}
    replay = {r["k"]: r["scratch_bytes"] for r in rows if r["mode"] == "replay"}
    assert all(replay[k] < inter[k] for k in inter)              # replay keeps raw inputs, not states
    assert "| B | mode | k | rate | tokens/s |" in md[0].read_text()
