"""The command line's small things (issue 13): clean one-line errors before any model load (no such model
folder, a folder without tokenizer.json, --device cuda without CUDA, a port in use), --help with defaults,
``gdnserve score``, ``gdnserve bench`` writing outside the checkout, the shutdown grace reaching uvicorn,
the tqdm bar while safetensors load."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from gdnserve.engine.config import OVERLAP_BY_DEFAULT
from gdnserve import cli
from gdnserve.entrypoints import serve
from gdnserve.entrypoints.preflight import PreflightError, bind_socket, check_device, check_model_folder
from gdnserve.models.tokenizer import Tokenizer


def run_cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gdnserve.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def one_line_error(p: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    assert p.returncode == code, (p.returncode, p.stdout, p.stderr)
    err = p.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err
    return err


def test_nonexistent_model_and_missing_tokenizer(tmp_path):
    one_line_error(run_cli("serve", "--model", "/nonexistent/model", "--device", "cpu"), 2,
                   "gdnserve serve: --model /nonexistent/model: no such folder")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    one_line_error(run_cli("generate", "hi", "--model", str(tmp_path), "--device", "cpu"), 2, "tokenizer.json")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path)
    with pytest.raises(PreflightError, match="tokenizer.json"):
        check_model_folder(str(tmp_path))
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(PreflightError, match="not a folder"):
        check_model_folder(str(f))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_cpu_machine():
    one_line_error(run_cli("serve", "--device", "cuda"), 2, "--device cuda", "use --device cpu")
    one_line_error(run_cli("score", "a", "b", "--device", "cuda:1"), 2, "--device cuda:1")
    with pytest.raises(PreflightError, match="not a device"):
        check_device("gpu")
    check_device("cpu")
    check_device("auto")


def test_port_in_use_is_reported_before_the_model_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        p = run_cli("serve", "--device", "cpu", "--port", str(port))
        err = one_line_error(p, 2, f"127.0.0.1:{port}", "in use", "--port")
        assert "serving" not in p.stderr and time.monotonic() - t0 < 60, err
        with pytest.raises(PreflightError, match="in use"):
            bind_socket("127.0.0.1", port)
    s = bind_socket("127.0.0.1", 0)  # free: bound, not listening yet
    s.close()


def test_help_shows_defaults_and_every_limit():
    text = cli.build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "TCP port to listen on (default 8000)" in " ".join(text.split())
    for flag in ("--max-body-bytes", "--max-prompts", "--max-stop", "--max-stop-chars", "--max-json-depth",
                 "--max-candidates", "--allowed-hosts", "--allowed-origins", "--public-metrics", "--shutdown-timeout",
                 "--parse-special-tokens", "--chat-default-max-tokens"):
        assert flag in text
    docs = (cli.REPO_ROOT / "docs" / "serving.md").read_text()
    for action in cli.build_parser()._subparsers._group_actions[0].choices["serve"]._actions:
        for opt in action.option_strings:
            if opt.startswith("--") and opt != "--help":
                assert f"`{opt}" in docs, f"{opt} is not documented in docs/serving.md"


def test_checkpoint_spill_ahead_flag_reaches_the_config():
    def parse(*argv):
        return cli.build_parser().parse_args(["serve", *argv])
    assert serve.engine_config(parse()).checkpoint_spill_ahead == 2
    args = parse("--checkpoint-host-memory", "1", "--checkpoint-spill-ahead", "0")
    assert serve.engine_config(args).checkpoint_spill_ahead == 0
    with pytest.raises(ValueError, match="--checkpoint-spill-ahead"):
        serve.engine_config(parse("--checkpoint-spill-ahead", "-1"))


def test_no_auto_checkpoints_reaches_the_engine():
    """``--no-auto-checkpoints``: the engine publishes no automatic checkpoint, so over HTTP a prompt that extends
    an earlier one starts cold; the banner says so. Default: on."""
    httpx = pytest.importorskip("httpx")
    from gdnserve.engine.async_engine import AsyncEngine
    from gdnserve.entrypoints.llm import load_engine
    from tests.entrypoints.fake_engine import Served

    def parse(*argv):
        return cli.build_parser().parse_args(["serve", *argv])
    assert serve.engine_config(parse()).auto_checkpoints is True
    args = parse("--no-auto-checkpoints", "--max-num-seqs", "4", "--num-pages", "64")
    engine = load_engine(device="cpu", config=serve.engine_config(args))
    assert engine.config.auto_checkpoints is False
    text = serve.banner(engine, args, serve.server_config(args), 8000, 0.1)
    assert "automatic checkpoints off" in text and "n <= 4 (--max-n 64, capped by the engine)" in text
    args.max_n = 3
    assert ", n <= 3, " in serve.banner(engine, args, serve.server_config(args), 8000, 0.1)
    served = Served(AsyncEngine(engine))
    try:
        with httpx.Client(base_url=served.url, timeout=60) as c:
            for prompt in ("Hello world", "Hello world, again"):
                r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
                assert r.status_code == 200, r.text
                prov = r.json()["gdnserve"]["prompts"][0]
                assert prov["hit_length"] == 0 and not prov["published"], prov
    finally:
        served.stop()
    assert len(engine.index) == 0


def test_replicas_without_ray_names_the_extra(monkeypatch, capsys):
    """``serve --replicas 2`` where Ray is not installed: one line naming the ``[replicas]`` extra, exit 2 (it was
    a raw ``No module named 'ray'`` traceback)."""
    monkeypatch.setitem(sys.modules, "ray", None)          # what a missing package looks like to ``import``
    monkeypatch.setitem(sys.modules, "ray.serve", None)
    assert cli.main(["serve", "--replicas", "2", "--device", "cpu", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("gdnserve serve: --replicas needs Ray Serve"), err
    assert 'pip install "gdnserve[replicas]"' in err


def test_score_command(capsys):
    assert cli.main(["score", "Is it good? Answer:", " yes", " no", "--device", "cpu", "--labels", "121,110",
                     "--softmax", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prefix_tokens"] == len("Is it good? Answer:") and len(out["data"]) == 2
    for row in out["data"]:
        assert row["num_tokens"] == len(row["candidate"]) and row["sum_logprob"] < 0
        assert sum(row["label_probs"].values()) == pytest.approx(1.0)
    assert cli.main(["score", "prefix", "a", "bcd", "--device", "cpu"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "prefix: 6 tokens" and "sum_logprob" in table[1] and len(table) == 4
    assert cli.main(["score", "p", "x", "--softmax"]) == 2


def test_bench_does_not_write_into_the_checkout(monkeypatch, tmp_path):
    for name in ("ops", "grouped-prefill", "model", "serve", "spec"):
        out = cli.build_parser().parse_args(["bench", name]).out
        assert cli.REPO_ROOT not in out.resolve().parents, out
    assert cli.DEFAULT_RESULTS.parts[-2:] == ("gdnserve", "bench")


def test_shutdown_timeout_and_config_reach_uvicorn(monkeypatch):
    from gdnserve.entrypoints import server
    from gdnserve.entrypoints.shutdown import ANSWER_S, GracefulServer
    seen = {}
    monkeypatch.setattr(GracefulServer, "run", lambda self, sockets=None: seen.update(server=self, sockets=sockets))
    args = cli.build_parser().parse_args(["serve", "--shutdown-timeout", "3.5", "--max-prompts", "7",
                                          "--allowed-origins", "http://a.example, http://b.example"])
    config = serve.server_config(args)
    assert config.limits.max_prompts == 7 and config.allowed_origins == ("http://a.example", "http://b.example")
    from tests.entrypoints.fake_engine import FakeEngine
    server.run_server(FakeEngine(), config, port=1234, shutdown_timeout=args.shutdown_timeout)
    s = seen["server"]  # the grace is ours (then the app answers 503); uvicorn's own cut comes ANSWER_S later
    assert s.grace_s == 3.5 and s.config.timeout_graceful_shutdown == 3.5 + ANSWER_S and s.config.port == 1234


def test_progress_bar_while_shards_load(tmp_path, capsys):
    pytest.importorskip("transformers")
    from gdnserve.models.loader import load_model
    from tests.models.test_hf_parity import tiny_qwen35
    tiny_qwen35(tmp_path)
    load_model(tmp_path, dtype=torch.float32, progress=True)
    err = capsys.readouterr().err
    assert "loading" in err and "1 shard" in err and "tensor" in err
    load_model(tmp_path, dtype=torch.float32, progress=False)
    assert capsys.readouterr().err == ""


def test_engine_flags_out_of_range_name_the_flag():
    """A flag the engine config refuses: one line naming the flag (and the config field), exit 2 (exit 1 and the
    field alone before), before any model load."""
    for flags, flag in [(["--max-num-seqs", "0"], "--max-num-seqs"), (["--spec-k", "-1"], "--spec-k"),
                        (["--max-model-len", "0"], "--max-model-len"), (["--max-step-tokens", "0"], "--max-step-tokens")]:
        one_line_error(run_cli("serve", "--device", "cpu", "--port", "0", *flags), 2, f"gdnserve serve: {flag}: ")


def test_every_command_maps_its_flags_through_one_engine_config(monkeypatch, capsys):
    """``serve``, ``serve --replicas``, ``generate`` and ``score`` build their EngineConfig with serve.engine_config
    (the one flags -> config mapping): a refused value names its flag and exits 2 on every path (the replicas
    path printed the bare field before), and a command's flags reach the config it loads."""
    one_line_error(run_cli("generate", "hi", "--device", "cpu", "--tensor-parallel-size", "0"), 2,
                   "gdnserve generate: --tensor-parallel-size: tensor_parallel_size must be an int >= 1")
    assert cli.main(["serve", "--replicas", "2", "--device", "cpu", "--port", "0", "--max-num-seqs", "0"]) == 2
    err = capsys.readouterr().err
    assert "gdnserve serve: --max-num-seqs: max_num_seqs must be an int >= 1" in err or "needs Ray Serve" in err
    args = cli.build_parser().parse_args(["serve", "--max-num-seqs", "3", "--no-cuda-graphs", "--spec-k", "2",
                                          "--max-step-tokens", "8192"])
    cfg = serve.engine_config(args, num_pages=77)
    assert (cfg.max_num_seqs, cfg.cuda_graphs, cfg.spec_k, cfg.num_pages, cfg.max_step_tokens) == (3, False, 2, 77, 8192)
    vllm = cli.build_parser().parse_args(["serve", "--max-num-batched-tokens", "2048"])     # vLLM's name
    assert serve.engine_config(vllm).max_step_tokens == 2048
    assert cfg.overlap is None and not cfg.overlapped("cuda")            # --spec-k: the serial loop
    no = serve.engine_config(cli.build_parser().parse_args(["serve", "--no-overlap"]))
    on = serve.engine_config(cli.build_parser().parse_args(["serve", "--overlap"]))
    assert no.overlap is False and not no.overlapped("cuda") and on.overlapped("cuda") and on.overlapped("cpu")
    assert serve.engine_config(cli.build_parser().parse_args(["serve"])).overlapped("cuda") is OVERLAP_BY_DEFAULT
    with pytest.raises(ValueError, match="^overlap: not with spec_k = 1"):    # a fixed field: no flag named
        serve.engine_config(cli.build_parser().parse_args(["serve", "--spec-k", "1"]), overlap=True)
    seen = {}

    def fake_load(model, dtype=None, device="auto", config=None, **kw):
        seen["config"] = config
        raise ValueError("stop here")
    monkeypatch.setattr("gdnserve.entrypoints.llm.load_engine", fake_load)
    assert cli.main(["score", "a prefix", "x", "y", "--device", "cpu"]) == 1
    assert seen["config"].max_num_seqs == 4 and seen["config"].num_pages == 260
