"""Loading allocates the weights once, in their dtype (issue 27: the memory plan counts them so): the meta model
is cast before ``to_empty``. Before, a bf16 load allocated every parameter in fp32 first and then replaced it, a
peak of twice the weights (140 GB for Qwen3.5-35B-A3B, more than an H200)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from gdnserve.engine.memory.memory_budget import config_weights_bytes, weights_bytes  # noqa: E402
from gdnserve.models.loader import load_model  # noqa: E402
from tests.models.test_hf_parity import tiny_qwen35  # noqa: E402


def test_to_empty_allocates_the_target_dtype(tmp_path, monkeypatch):
    tiny_qwen35(tmp_path).save_pretrained(tmp_path, safe_serialization=True)
    allocated = []
    to_empty = torch.nn.Module.to_empty

    def spy(self, *, device, recurse=True):
        allocated.append(weights_bytes(self))        # meta tensors: their dtype's bytes, nothing allocated yet
        return to_empty(self, device=device, recurse=recurse)
    monkeypatch.setattr(torch.nn.Module, "to_empty", spy)
    model, cfg = load_model(tmp_path, dtype=torch.bfloat16)
    assert allocated[0] <= config_weights_bytes(cfg, torch.bfloat16) == weights_bytes(model)


def test_weights_are_loaded_into_the_storage_to_empty_allocated(tmp_path, monkeypatch):
    """Every parameter keeps the storage ``to_empty`` gave it: A_log allocated fp32 there, the MoE blocks
    allocated folded (the shared expert as expert E) and filled in place. Loading replaced each parameter by a new
    tensor and then concatenated the shared expert into the experts and router: on CUDA the freed blocks, split
    by later allocations, stayed cached as fragments."""
    tiny_qwen35(tmp_path).save_pretrained(tmp_path, safe_serialization=True)
    ptrs = {}
    to_empty = torch.nn.Module.to_empty

    def spy(self, *, device, recurse=True):
        out = to_empty(self, device=device, recurse=recurse)
        ptrs.update({n: p.data_ptr() for n, p in out.named_parameters()})
        return out
    monkeypatch.setattr(torch.nn.Module, "to_empty", spy)
    model, cfg = load_model(tmp_path, dtype=torch.bfloat16)
    moved = [n for n, p in model.named_parameters() if ptrs.get(n) != p.data_ptr()]
    assert ptrs and not moved, moved
    assert all(m.shared_folded for m in model.modules() if hasattr(m, "shared_folded"))
    assert all(m.A_log.dtype == torch.float32 for m in model.gdn_layers())
