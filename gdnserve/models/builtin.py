"""The embedded default model: a tiny Qwen3.5-architecture config (weights come from a fixed seed in the
model builder) paired with the built-in byte tokenizer, so the engine runs with nothing downloaded.

4 layers, GDN, GDN, GDN, attention; hidden 256; GDN H=2, HV=4 (r=2), K=V=64, W=4; attention 4 heads /
2 KV heads of 64 with a quarter of each head rotated; dense MLP 512; tied embeddings; one MTP layer
(``mtp.*``, random like the rest: ``--spec-draft mtp`` runs on it, its drafts are rarely accepted).
``builtin_hf_config_dict()`` is the same model as an HF config.json, so tests can build it with
transformers' own Qwen3_5ForCausalLM and compare.
"""
from __future__ import annotations

from typing import Any

from gdnserve.models.config import AttnConfig, GDNConfig, MLPConfig, ModelConfig, MTPConfig
from gdnserve.models.tokenizer import BYTE_VOCAB_SIZE, ByteTokenizer

_LAYER_TYPES = ("linear_attention", "linear_attention", "linear_attention", "full_attention")
_ROPE_THETA = 10000.0
_MAX_POSITIONS = 32768


def builtin_config() -> ModelConfig:
    return ModelConfig(
        family="qwen3_5", vocab_size=BYTE_VOCAB_SIZE, hidden_size=256, num_layers=4, layer_types=_LAYER_TYPES,
        rms_norm_eps=1e-6, tie_word_embeddings=True, torch_dtype="float32",
        gdn=GDNConfig(num_k_heads=2, num_v_heads=4, head_k_dim=64, head_v_dim=64, conv_kernel=4),
        attn=AttnConfig(num_heads=4, num_kv_heads=2, head_dim=64, rope_theta=_ROPE_THETA, partial_rotary_factor=0.25,
                        rotary_dim=16, output_gate=True, max_position_embeddings=_MAX_POSITIONS, rope_scaling=None),
        mlp=MLPConfig(intermediate_size=512), mtp=MTPConfig(1), hf_model_type="qwen3_5_text")


def builtin_hf_config_dict() -> dict[str, Any]:
    """The HF config.json of the embedded model (model_type ``qwen3_5_text``)."""
    tok = ByteTokenizer()
    return {
        "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"], "dtype": "float32",
        "vocab_size": BYTE_VOCAB_SIZE, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
        "layer_types": list(_LAYER_TYPES), "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "attention_bias": False,
        "max_position_embeddings": _MAX_POSITIONS,
        "rope_parameters": {"rope_type": "default", "rope_theta": _ROPE_THETA, "partial_rotary_factor": 0.25},
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
        "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "eos_token_id": list(tok.eos_token_ids), "pad_token_id": None, "bos_token_id": None,
    }


def build_builtin_model(seed: int = 0, dtype=None, device="cpu", tp_rank: int | None = None,
                        tp_size: int | None = None):
    """The embedded model with deterministic random weights (a fixed-seed generator, the same on every
    machine): N(0, 0.02) projections and embeddings, norms at their identity (zero-centred 0, gated 1),
    A_log = log U(1, 16), dt_bias 1, conv N(0, 0.3). The MTP head's parameters come last in the generator's
    order, so the target's weights are those of the model before it had one. ``tp_rank`` / ``tp_size``
    (default: the torch.distributed group's): this rank's shard of those same full weights."""
    import math

    import torch

    from gdnserve.layers.linear import load_shard
    from gdnserve.layers.parallel import resolve
    from gdnserve.models.qwen3_5 import HybridLM

    gen = torch.Generator().manual_seed(seed)
    model = HybridLM(builtin_config(), 0, 1)         # the full weights first, whatever the rank
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 15 + 1))
            elif name.endswith("dt_bias"):
                p.fill_(1.0)
            elif name.endswith("conv_weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            elif "norm" in name:
                p.fill_(1.0 if name.endswith("mixer.norm.weight") else 0.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.02 if p.dim() > 1 else 1 / math.sqrt(p.numel())))
    rank, size = resolve(tp_rank, tp_size)
    if size > 1:
        full, model = dict(model.named_parameters()), HybridLM(builtin_config(), rank, size)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(load_shard(model, name, full[name]))
    model = model.to(device=device, dtype=dtype or torch.float32)
    for layer in model.gdn_layers():
        layer.A_log.data = layer.A_log.data.float()
    return model.eval()
