"""Replicas sharing a GPU (``--replica-gpus`` < 1, issue 27): each gets its share of the device as a fixed budget
(``memory_budget_gb``), not ``--gpu-memory-utilization`` of the whole device minus what the replicas started
before it hold. No Ray needed: the config step alone."""
from __future__ import annotations

import pytest

from gdnserve.engine.config import EngineConfig
from gdnserve.replicas.serve_cli import shared_gpu_config

GiB = 1 << 30


def test_replicas_sharing_a_gpu_split_its_budget():
    half = shared_gpu_config(EngineConfig(), 0.5, 140 * GiB)
    assert half.memory_budget_gb == 63.0 and half.gpu_memory_utilization == 0.9      # 0.9 x 0.5 x 140 GiB
    third = shared_gpu_config(EngineConfig(gpu_memory_utilization=0.8), 1 / 3, 141 * GiB)
    assert third.memory_budget_gb == 37.6 and 3 * third.memory_budget_gb <= 0.8 * 141      # rounded down
    given = EngineConfig(memory_budget_gb=20)
    assert shared_gpu_config(given, 0.25, 140 * GiB) is given                   # the user's own split is kept


def test_a_shared_gpu_without_a_device_to_size_it_is_refused():
    with pytest.raises(ValueError, match=r"^--replica-gpus 0.5 shares a GPU between replicas: give each its "
                                         r"--memory-budget-gb"):
        shared_gpu_config(EngineConfig(), 0.5, None)
