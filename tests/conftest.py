"""Test set-up: without a GPU, Triton kernels run under Triton's CPU interpreter. The variable
must be set before triton.jit decorates anything, i.e. before gdnserve's kernels are imported."""
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

# HF transformers (the test-only reference) binds fla's kernels at import whenever fla is installed and then
# sends its CPU reference models' tensors to them (a failure seen on the H200, where fla is carried for the
# benchmarks). The references must run HF's own PyTorch path: make `import fla` fail inside the tests.
sys.modules.setdefault("fla", None)

import pytest  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pytest_terminal_summary(terminalreporter):
    """The versions this run used, printed last (also under -q): CI's log says what it tested."""
    import platform

    import numpy
    import triton
    terminalreporter.write_line(
        f"versions: python {platform.python_version()} | torch {torch.__version__} | triton {triton.__version__} | "
        f"numpy {numpy.__version__} | device {DEVICE} | TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}")


def pytest_collection_modifyitems(config, items):
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
