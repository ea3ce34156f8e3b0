"""Checkpoint loading errors name the tensor; sharded checkpoints load; dtypes are honoured."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from gdnserve.models.config import UnsupportedModelError  # noqa: E402
from gdnserve.models.loader import CheckpointError, load_model  # noqa: E402
from tests.models.test_hf_parity import tiny_qwen35  # noqa: E402


def _rewrite(folder, fn):
    f = folder / "model.safetensors"
    sd = load_file(str(f))
    fn(sd)
    save_file(sd, str(f))


def test_missing_and_misshaped_and_unexpected_tensors(tmp_path):
    tiny_qwen35(tmp_path)
    name = "model.layers.0.linear_attn.in_proj_z.weight"
    _rewrite(tmp_path, lambda sd: sd.pop(name))
    with pytest.raises(CheckpointError, match="missing tensor model.layers.0.linear_attn.in_proj_z.weight"):
        load_model(tmp_path, dtype=torch.float32)
    tiny_qwen35(tmp_path)
    _rewrite(tmp_path, lambda sd: sd.__setitem__("model.layers.2.self_attn.o_proj.weight", torch.zeros(3, 3)))
    with pytest.raises(CheckpointError, match=r"layers\.2\.mixer\.o_proj\.weight: checkpoint tensor has shape \[3, 3\]"):
        load_model(tmp_path, dtype=torch.float32)
    tiny_qwen35(tmp_path)
    _rewrite(tmp_path, lambda sd: sd.__setitem__("model.layers.0.mystery.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match="unexpected tensors in checkpoint: \\['model.layers.0.mystery.weight'\\]"):
        load_model(tmp_path, dtype=torch.float32)


def test_unknown_architecture(tmp_path):
    tiny_qwen35(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "llama", ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="llama"):
        load_model(tmp_path)


def test_sharded_checkpoint_and_bf16(tmp_path):
    hf = tiny_qwen35(tmp_path)
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    (tmp_path / "model.safetensors").unlink(missing_ok=True)
    model, cfg = load_model(tmp_path, dtype=torch.bfloat16)
    mixer = model.layers[0].mixer
    assert mixer.in_proj.weight.dtype == torch.bfloat16 and mixer.A_log.dtype == torch.float32
    ref = hf.model.layers[0].linear_attn
    want = torch.cat([ref.in_proj_qkv.weight, ref.in_proj_z.weight, ref.in_proj_b.weight, ref.in_proj_a.weight])
    assert torch.equal(mixer.in_proj.weight, want.to(torch.bfloat16))
