"""The FP8 quantized-input handover end to end (issue 16): a tiny FP8 Qwen3.5 (one GDN and one attention
layer, every mixer projection FP8; quantized as tests/models/test_fp8_checkpoint.py does) on the Triton path —
its mixers' FP8 linears on Triton too (the interpreter on CPU; the MLPs stay on the PyTorch path: they take no
handover) — gives bit-identical logits with the producers' in-register quantization on (``PRODUCER_QUANT``) and
off (each linear's own quantization launch), at a few-token prefill (the GEMM) and at decode (M = 1, the
two-launch GEMV), and the handover replaces every mixer projection's quantization launch (the input norm's
for in_proj / qkv_proj, the gated norm's for out_proj, the sigmoid gate's for o_proj)."""
from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("transformers")
from gdnserve.engine.execution.model_runner import (  # noqa: E402
    ModelRunner,
    PrefillItem,
    RunnerConfig,
)
from gdnserve.layers import linear  # noqa: E402
from gdnserve.models.loader import load_model  # noqa: E402
from tests.models.test_fp8_checkpoint import _save, quantize_checkpoint  # noqa: E402

fp8_linear_mod = importlib.import_module("gdnserve.ops.quant.fp8_linear")
gemm_mod = importlib.import_module("gdnserve.ops.quant.fp8_gemm_triton")


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    cfg = Qwen3_5TextConfig(vocab_size=97, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                            layer_types=["linear_attention", "full_attention"], num_attention_heads=2,
                            num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=2,
                            linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
                            tie_word_embeddings=False, rms_norm_eps=1e-6, max_position_embeddings=256)
    root = tmp_path_factory.mktemp("fp8_handover")
    _save(Qwen3_5ForCausalLM(cfg), root / "bf16")
    quantize_checkpoint(root / "bf16", root / "fp8")
    return root / "fp8"


def run(folder, ids, device):
    """Logits of a prefill of ids[:-1] then a decode step on the Triton path."""
    model, _ = load_model(folder, dtype=torch.bfloat16, device=device)
    for layer in model.layers:                 # the mixers' FP8 linears on Triton, the MLPs' on PyTorch (any device)
        for part, backend in ((layer.mixer, "triton"), (layer.mlp, "torch")):
            for m in part.modules():
                if isinstance(m, (linear.ColumnParallelLinear, linear.RowParallelLinear)):
                    assert m.qweight is not None
                    m.backend = backend
    runner = ModelRunner(model, RunnerConfig(backend="triton", page_size=8))
    seq = runner.new_seq()
    first = runner.step([PrefillItem(seq, ids[:-1])], [])[0]
    return torch.stack([first, runner.step([], [(seq, ids[-1])])[0]])


def test_handover_is_bit_identical(fp8_folder, device, monkeypatch):
    monkeypatch.setattr(fp8_linear_mod, "QX_MAX_WEIGHTS", 0)    # M = 1: the GEMV's own launch (every weight)
    calls = []
    real = gemm_mod.quantize_act_triton
    monkeypatch.setattr(gemm_mod, "quantize_act_triton", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    ids = torch.randint(0, 97, (6,)).tolist()
    with torch.no_grad():
        on = run(fp8_folder, ids, device)
        n_on = len(calls)
        monkeypatch.setattr(linear, "PRODUCER_QUANT", False)
        off = run(fp8_folder, ids, device)
    n_off = len(calls) - n_on
    print(f"quantization launches: {n_on} with the handover, {n_off} without")
    assert torch.equal(on, off)
    # 2 layers x 2 mixer projections x 2 steps: every one handed over (on CUDA the runner captures its steps in
    # graphs, and capturing calls the ops' Python again: 16 without, at 9edd96b on the H200)
    assert n_on == 0 and n_off in ((8, 16) if device.type == "cuda" else (8,))
