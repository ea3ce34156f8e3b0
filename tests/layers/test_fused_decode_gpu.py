"""GPU-only: the model with every fused decode path on (GDNSERVE_FUSED_DECODE, _QK_STORE, _NORM_ROUTER read when the
modules are built): a decode graph replay equals the graph-shaped eager step bit for bit — logits and every byte of
GDN state and KV cache — and stays close to the plain eager step (engine/cuda_graphs' lockstep test, MoE model)."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_fused_paths_replay_equals_graph_shaped_eager(monkeypatch):
    from tests.engine.test_cuda_graphs_gpu import lockstep
    for name in ("GDNSERVE_FUSED_DECODE", "GDNSERVE_FUSED_QK_STORE", "GDNSERVE_FUSED_NORM_ROUTER"):
        monkeypatch.setenv(name, "1")
    g, _ = lockstep(None, 0, [1, 3], steps=3, moe=True)      # (the captured runner, its sequences)
    from gdnserve.layers.gdn_mixer import GatedDeltaNet
    assert all(m.fused_decode for m in g.model.modules() if isinstance(m, GatedDeltaNet))
    assert g.graphs.stats["fallback"] == 0
