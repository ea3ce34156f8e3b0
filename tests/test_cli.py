"""The ``gdnserve`` command line: parsing, locating the repository's benchmarks, and a quick CPU run
of ``gdnserve bench ops`` (the README's main job) that must write its JSON and markdown."""
import importlib
import json

import pytest

from gdnserve import cli


def test_bench_ops_help_lists_its_options(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "ops", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for option in ("--device", "--quick", "--out", "--no-fla"):
        assert option in out


def test_command_is_required(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        cli.main(["bench"])
    assert e.value.code == 2


def test_missing_benchmarks_folder_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "REPO_ROOT", tmp_path)
    assert cli.main(["bench", "ops", "--device", "cpu", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "bench_ops" in err and "pip install -e ." in err
    assert not list(tmp_path.iterdir())


def _ops_import_error() -> str | None:
    names = {"gdnserve.ops.conv": ["causal_conv1d_prefill"], "gdnserve.ops.gdn.chunk": ["chunk_gated_delta_rule"],
             "gdnserve.ops.gdn.recurrent": ["GDNPending", "gdn_commit_intermediate", "gdn_decode", "gdn_verify"]}
    try:
        for module, attrs in names.items():
            m = importlib.import_module(module)
            for attr in attrs:
                getattr(m, attr)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


def test_bench_ops_quick_cpu_run_writes_json_and_markdown(tmp_path):
    reason = _ops_import_error()
    if reason is not None:
        pytest.skip(f"gdnserve ops not importable yet ({reason})")
    rc = cli.main(["bench", "ops", "--device", "cpu", "--quick", "--out", str(tmp_path)])
    js, md = sorted(tmp_path.glob("ops_cpu_*.json")), sorted(tmp_path.glob("ops_cpu_*.md"))
    assert len(js) == 1 and len(md) == 1 and js[0].stem == md[0].stem
    res = json.loads(js[0].read_text())
    assert res["errors"] == [], res["errors"]
    assert rc == 0
    for key in ("device", "torch", "triton", "fla", "ceilings", "rows", "targets"):
        assert key in res
    assert res["ceilings"]["copy_TBps"] > 0 and res["ceilings"]["bf16_matmul_TFLOPs"] > 0
    assert {r["case"] for r in res["rows"]} == {"prefill", "decode", "verify"}
    impls = {r["impl"] for r in res["rows"]}
    assert {"ours", "ours intermediate+commit", "ours replay"} <= impls
    for r in res["rows"]:
        assert r["ours"] and "error" not in r, r
        assert r["gpu_us"]["p50"] > 0 and r["bytes"] > 0 and r["flops"] > 0 and r["host_parts_us"]
        # bf16 outputs against the float64 reference land near 2e-3; a wrong op lands near 1
        assert r["ref"] == "naive_f64" and r["rel_rms_max"] < 1e-2, r["rel_rms"]
    text = md[0].read_text()
    assert "| case | impl |" in text and "## Targets" in text


def test_serve_spec_draft_reaches_the_engine(monkeypatch, capsys):
    """``gdnserve serve --spec-k 2 --spec-draft mtp`` builds the engine with the MTP drafter."""
    import gdnserve.engine.async_engine as async_engine
    import gdnserve.entrypoints.llm as llm
    import gdnserve.entrypoints.server as server
    seen = {}
    monkeypatch.setattr(llm, "load_engine", lambda model, **kw: seen.update(kw) or "engine")
    monkeypatch.setattr(async_engine, "AsyncEngine", lambda engine: engine)
    monkeypatch.setattr(server, "run_server", lambda engine, **kw: seen.update(served=engine))
    assert cli.main(["serve", "--device", "cpu", "--port", "0", "--spec-k", "2", "--spec-draft", "mtp"]) == 0
    cfg = seen["config"]                          # serve builds the EngineConfig (issue 12)
    assert (cfg.spec_k, cfg.spec_draft, seen["served"]) == (2, "mtp", "engine")
    with pytest.raises(SystemExit):
        cli.main(["serve", "--spec-draft", "eagle"])
    assert "invalid choice: 'eagle'" in capsys.readouterr().err
