"""The fused kernels inside the model (residual add + RMSNorm, GDN gated norm, q/k norm + rotary, MoE router;
``set_fused``): on the PyTorch backend the residual wiring is the old ``h = h + mixer(norm(h));
h = h + mlp(norm(h))`` bit for bit; on the Triton backend (interpreted on CPU) fused and unfused steps agree
to fp32 rounding."""
from __future__ import annotations

import pytest
import torch

from benchmarks.random_model import build_random_model, tiny_hf_config
from gdnserve.engine.cache.sequence import PrefillItem
from gdnserve.engine.execution.model_runner import (
    ModelRunner,
    RunnerConfig,
)
from gdnserve.models.qwen3_5 import HybridLM, set_fused
from gdnserve.ops.numerics import rel_rms

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def unfused_hidden_states(self: HybridLM, input_ids: torch.Tensor) -> torch.Tensor:
    """The decoder loop before the residual stream was carried as (branch output, stream)."""
    h = self.embed_tokens(input_ids)
    for layer in self.layers:
        h = h + layer.mixer(layer.input_layernorm(h))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h


def steps(runner: ModelRunner, prompt: list[int], decodes: int) -> list[torch.Tensor]:
    """Logits of a prefill of ``prompt`` (plus a second, shorter sequence) and of ``decodes`` decode steps."""
    a, b = runner.new_seq(), runner.new_seq()
    out = [runner.step([PrefillItem(a, prompt), PrefillItem(b, prompt[:3])], [])]
    for _ in range(decodes):
        nxt = out[-1].argmax(-1).tolist()
        out.append(runner.step([], [(a, nxt[0]), (b, nxt[1])]))
    return [o.float().cpu() for o in out]


def runner_for(backend: str, device: torch.device, fused: bool = True) -> ModelRunner:
    model = build_random_model(tiny_hf_config(num_layers=4, num_experts=8), device, torch.float32, seed=3)
    set_fused(model, fused)
    return ModelRunner(model, RunnerConfig(backend=backend, num_slots=4, num_pages=32, page_size=8,
                                           cuda_graphs=False))


def test_torch_path_is_the_unfused_loop_bit_for_bit(monkeypatch):
    prompt = torch.randint(0, 512, (11,)).tolist()
    got = steps(runner_for("torch", torch.device("cpu")), prompt, 2)
    monkeypatch.setattr(HybridLM, "hidden_states", unfused_hidden_states)
    want = steps(runner_for("torch", torch.device("cpu")), prompt, 2)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_set_fused_reaches_every_site():
    model = build_random_model(tiny_hf_config(num_layers=4, num_experts=8), torch.device("cpu"), torch.float32)
    sites = [m for m in model.modules() if hasattr(m, "fused")]
    kinds = {type(m).__name__ for m in sites}
    assert {"DecoderLayer", "GatedDeltaNet", "GatedAttention", "SparseMoE"} <= kinds
    set_fused(model, False)
    assert not any(m.fused for m in sites)


def test_triton_fused_equals_unfused():
    """The whole tiny MoE model on the Triton backend: fused norms and router vs the PyTorch ops between the
    same Triton GDN / attention / expert kernels; prefill and decode logits to fp32 rounding."""
    prompt = torch.randint(0, 512, (9,)).tolist()
    fused = steps(runner_for("triton", DEVICE, True), prompt, 1)
    unfused = steps(runner_for("triton", DEVICE, False), prompt, 1)
    for f, u in zip(fused, unfused):
        assert rel_rms(f, u) < 1e-5
        assert torch.equal(f.argmax(-1), u.argmax(-1))
