"""``gdnserve serve`` and the memory plan (issue 27): a pool size that cannot fit is refused before the model
loads, in one line naming the flag with the bytes asked for and available (exit 2); the banner prints the plan."""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

from gdnserve.engine.config import EngineConfig
from gdnserve.entrypoints import serve
from gdnserve.entrypoints.config import ServerConfig
from gdnserve.entrypoints.llm import load_engine


def test_num_pages_beyond_the_budget_exits_2_before_loading():
    p = subprocess.run([sys.executable, "-m", "gdnserve.cli", "serve", "--device", "cpu", "--port", "0",
                        "--num-pages", "100000000"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONUNBUFFERED="1"))
    err = p.stderr.strip()
    assert p.returncode == 2 and "Traceback" not in err and len(err.splitlines()) == 1, (p.returncode, err)
    assert err.startswith("gdnserve serve: num_pages (--num-pages) = 100000000 asks for 100000000 KV pages")
    need = int(re.search(r"(\d+) bytes; the pools have", err).group(1))
    have = int(re.search(r"the pools have [^(]*\((\d+) bytes\)", err).group(1))
    assert need == 100_000_000 * 16384 + 130 * 215040 and need > have > 0       # fp32 embedded model's bytes
    assert "weights" in err and "activations" in err and "gpu_memory_utilization" not in err


def test_bad_utilization_is_a_flag_error(capsys):
    from gdnserve import cli
    assert cli.main(["serve", "--device", "cpu", "--port", "0", "--gpu-memory-utilization", "1.5"]) == 2
    assert "gpu_memory_utilization must be a number in (0, 1], got 1.5" in capsys.readouterr().err


def test_banner_prints_the_plan():
    engine = load_engine(None, device="cpu", config=EngineConfig(memory_budget_gb=0.2, max_num_seqs=4,
                                                                  max_model_len=256))
    p = argparse.ArgumentParser()
    serve.add_serve_arguments(p)
    text = serve.banner(engine, p.parse_args(["--max-num-seqs", "4", "--max-model-len", "256"]), ServerConfig(),
                        8000, 1.0)
    plan = engine.memory_plan
    assert f"  pools: {plan.num_slots} state slots" in text and f"{plan.num_pages} KV pages" in text
    assert "budget 204.80 MiB (--memory-budget-gb 0.2)" in text and "(sized from the budget)" in text
    assert "capacity: 4 concurrent requests at max_model_len 256" in text
