"""Test set-up: without a GPU, Triton kernels run under Triton's CPU interpreter. The variable
must be set before triton.jit decorates anything, i.e. before gdnserve's kernels are imported.

The README's plain ``python -m pytest -q`` on a CPU machine runs on 2 pytest-xdist workers, one file per worker
at a time (``--dist loadfile``: a module's live server, Ray cluster or model is built once); see
``pytest_cmdline_main``."""
import os
import random

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Ray Serve's routers drop a replica from a routing choice when its queue-length probe misses a deadline (0.1 s,
# doubling up to 1 s). On a busy 2-core CI machine a replica computing a step can miss it, and a request of a
# checkpoint group then lands on the other replica (tests/replicas: CI at c0dfe84 saw 45 of 48 affinity hits).
# The replica tests time nothing: give the probe time. Read when ray.serve is imported, so set before any test
# module imports it; the local cluster's actors inherit this process's environment.
os.environ.setdefault("RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S", "5")
os.environ.setdefault("RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S", "10")

import sys  # noqa: E402

# Under xdist each worker gets its share of the cores for torch's intra-op threads (2 workers x 2 default threads
# on CI's 2 cores thrash); OMP_NUM_THREADS passes the share on to the servers and processes the tests start.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _share = max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    torch.set_num_threads(_share)
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))

# HF transformers (the test-only reference) binds fla's kernels at import whenever fla is installed and then
# sends its CPU reference models' tensors to them (a failure seen on the H200, where fla is carried for the
# benchmarks). The references must run HF's own PyTorch path: make `import fla` fail inside the tests.
sys.modules.setdefault("fla", None)

import pytest  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CPU_WORKERS = 2     # CI's machine: 2 cores
# Under xdist these files go first (then the rest in collection order): with a file per unit of work, the ones
# whose set-up or few tests take longest (a Ray cluster, gloo process groups, long interpreted kernels) would
# otherwise leave one worker running one of them alone at the end. An ordering hint only.
FIRST = ("tests/replicas/test_ray_replicas.py", "tests/test_bench_tp.py", "tests/models/test_tp.py",
         "tests/ops/test_gdn_chunk_cp.py")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """The whole suite on a CPU machine (no test paths on the command line, as the README and CI run it): 2 xdist
    workers, a file per worker at a time. Not on a GPU machine (benchmarks/device.sh runs a file per process),
    not in a worker, not when -n / --dist / --tx / --pdb / --collect-only is given or xdist is not installed
    (-p no:xdist), not on one core; `-n 0` runs in-process."""
    opt = config.option
    if (hasattr(config, "workerinput") or not config.pluginmanager.hasplugin("xdist") or torch.cuda.is_available()
            or config.args_source != pytest.Config.ArgsSource.TESTPATHS or len(os.sched_getaffinity(0)) < 2
            or opt.numprocesses is not None or opt.dist != "no" or opt.tx or opt.usepdb or opt.collectonly):
        return
    # all three: the result does not depend on whether xdist's own cmdline_main (it turns -n into tx) runs first
    opt.numprocesses, opt.dist, opt.tx = CPU_WORKERS, "loadfile", ["popen"] * CPU_WORKERS
    opt.loadscopereorder = False        # the collection's order (FIRST first), not xdist's by-test-count one


def pytest_terminal_summary(terminalreporter):
    """The versions this run used, printed last (also under -q): CI's log says what it tested."""
    import platform

    import numpy
    import triton
    workers = len(getattr(terminalreporter.config.option, "tx", None) or ())
    terminalreporter.write_line(
        f"versions: python {platform.python_version()} | torch {torch.__version__} | triton {triton.__version__} | "
        f"numpy {numpy.__version__} | device {DEVICE} | TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}"
        f" | xdist workers {workers}")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {f: i for i, f in enumerate(FIRST)}
        items.sort(key=lambda it: rank.get(it.nodeid.split("::")[0], len(FIRST)))    # stable: files stay whole
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture
def seed() -> int:
    """A fresh seed for torch and random, printed so a failure can be replayed."""
    s = random.SystemRandom().randrange(2**31)
    print(f"seed = {s}")
    torch.manual_seed(s)
    random.seed(s)
    return s
