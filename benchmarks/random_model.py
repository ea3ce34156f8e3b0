"""A random-weight model with the Qwen3.5-35B-A3B GDN and attention shapes, built directly on the device
(no checkpoint on disk), for the model, serving and speculative-decoding benchmarks.

``bench_hf_config(...)`` is the HF config.json (``qwen3_5_moe_text``) that every benchmark records in its
JSON: hidden 2048; GDN H=16, HV=32, K=V=128, W=4; attention 16 q heads, 2 KV heads, head_dim 256, gated,
a quarter of each head rotated; 3 GDN : 1 attention; sparse MoE top-8 with moe_intermediate 512 and a
shared expert of 512; vocab 248320. Only the layer and expert counts are cut (default 8 layers, 64
experts instead of 40 and 256) so a run fits a few minutes. ``tiny_hf_config()`` is the CPU smoke shape.

Weights: N(0, 0.02) projections and embeddings, zero-centred norms at 0 (identity), the GDN gated norm at
1, A_log = log U(1, 16), dt_bias 1, conv N(0, 0.3) — ``init_random_`` applies these rules by parameter
name, so gdnserve's model and transformers' get the same distribution; ``build_hf_model`` +
``ours_from_hf`` give both models the *same* weights (our loader's name mapping, applied in memory).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from gdnserve.models.config import ModelConfig

VOCAB = 248320


def layer_types(num_layers: int) -> list[str]:
    """3 GDN : 1 attention, as Qwen3.5 (every 4th layer is full attention)."""
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]


def bench_hf_config(num_layers: int = 8, num_experts: int = 64, vocab_size: int = VOCAB) -> dict[str, Any]:
    return {
        "model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"], "dtype": "bfloat16",
        "vocab_size": vocab_size, "hidden_size": 2048, "num_hidden_layers": num_layers,
        "layer_types": layer_types(num_layers), "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "max_position_embeddings": 32768,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "num_experts": num_experts, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "eos_token_id": None, "pad_token_id": None, "bos_token_id": None,
    }


def tiny_hf_config(num_layers: int = 4, num_experts: int = 8) -> dict[str, Any]:
    """The same architecture at CPU-smoke size (hidden 64, GDN H=2 HV=4 K=V=16, vocab 512)."""
    d = bench_hf_config(num_layers, num_experts, vocab_size=512)
    d.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, num_experts_per_tok=2,
             moe_intermediate_size=32, shared_expert_intermediate_size=32, max_position_embeddings=8192, dtype="float32")
    return d


def config_for(device: torch.device, num_layers: int | None, num_experts: int | None) -> dict[str, Any]:
    """The benchmark shape on CUDA, the tiny one on CPU; layer / expert counts overridable."""
    if device.type == "cuda":
        return bench_hf_config(num_layers or 8, num_experts or 64)
    return tiny_hf_config(num_layers or 4, num_experts or 8)


@torch.no_grad()
def init_random_(model: torch.nn.Module, seed: int) -> None:
    """Fill every parameter by the rules in the module docstring (names of gdnserve's or HF's modules)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.rand(p.shape, generator=gen, device=p.device).mul_(15).add_(1).log_())
        elif name.endswith("dt_bias"):
            p.fill_(1.0)
        elif "conv" in name:
            p.copy_(torch.randn(p.shape, generator=gen, device=p.device) * 0.3)
        elif "norm" in name:   # GDN gated norm (plain weight) at 1, zero-centred norms at 0
            p.fill_(1.0 if name.endswith(("mixer.norm.weight", "linear_attn.norm.weight")) else 0.0)
        else:
            std = 0.02 if p.dim() > 1 else 1 / math.sqrt(p.numel())
            p.copy_(torch.randn(p.shape, generator=gen, device=p.device) * std)


def build_random_model(hf_cfg: dict[str, Any], device: torch.device, dtype: torch.dtype, seed: int = 0):
    """gdnserve's HybridLM with random weights, built on the meta device and filled on ``device``."""
    from gdnserve.models.qwen3_5 import HybridLM
    cfg = ModelConfig.from_hf(hf_cfg)
    with torch.device("meta"):
        model = HybridLM(cfg).to(dtype)
    model = model.to_empty(device=device)
    init_random_(model, seed)
    _finish(model)
    return model.eval()


def _finish(model) -> None:
    for layer in model.gdn_layers():           # the decay rate stays fp32 (as the loader keeps it)
        layer.A_log.data = layer.A_log.data.float()
    for attn in model.attention_layers():      # non-persistent buffers are not filled by to_empty
        attn.rotary.reset_buffers()


def build_hf_model(hf_cfg: dict[str, Any], device: torch.device, dtype: torch.dtype, seed: int = 0):
    """transformers' Qwen3_5MoeForCausalLM with random weights on ``device`` (needs transformers >= 5.24)."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    fields = {k: v for k, v in hf_cfg.items() if k not in ("model_type", "architectures", "dtype")}
    config = Qwen3_5MoeTextConfig(**fields)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3_5MoeForCausalLM(config)
    finally:
        torch.set_default_dtype(prev)
    init_random_(model, seed)
    return model.eval()


def ours_from_hf(hf_model, hf_cfg: dict[str, Any], device: torch.device, dtype: torch.dtype):
    """gdnserve's model with exactly the HF model's weights, through the checkpoint loader's name mapping
    (unfused tensors are shared with the HF model, fused ones copied)."""
    from gdnserve.models.loader import load_weights
    from gdnserve.models.qwen3_5 import HybridLM
    cfg = ModelConfig.from_hf(hf_cfg)
    with torch.device("meta"):
        model = HybridLM(cfg).to(dtype)
    model = model.to_empty(device=device)
    tensors = {n: (lambda t=t: t.detach()) for n, t in hf_model.state_dict().items()}
    load_weights(model, cfg, tensors, dtype)
    _finish(model)
    return model.eval()


@torch.no_grad()
def make_greedy_chain_(model, seed: int = 1, embed_std: float = 8.0) -> torch.Tensor:
    """Give the random model a greedy continuation that bf16 rounding cannot flip: embeddings with a large
    norm dominate the residual stream, and the lm head row of token pi(t) is token t's embedding for a
    random permutation pi, so the argmax after token t is pi(t) by a wide margin. Compute cost is unchanged
    (same shapes; MoE routing still varies per token). Returns pi [vocab] (int64, on the model's device)."""
    emb = model.embed_tokens.weight
    gen = torch.Generator(device=emb.device).manual_seed(seed)
    emb.copy_(torch.randn(emb.shape, generator=gen, device=emb.device) * embed_std)
    perm = torch.randperm(emb.shape[0], generator=gen, device=emb.device)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(emb.shape[0], device=emb.device)
    head = model.lm_head.weight if model.lm_head is not None else None
    if head is None:
        raise ValueError("make_greedy_chain_: needs an untied lm head")
    head.copy_(emb[inv] / embed_std * 0.02)
    return perm


class NullTokenizer:
    """The engine's tokenizer for token-id prompts: no text. ``decode`` returns '' (the engine decodes the
    whole output after every token, so this keeps the loop's cost out of the numbers); no EOS ids."""
    eos_token_ids: tuple[int, ...] = ()

    def encode(self, text: str) -> list[int]:
        raise ValueError("NullTokenizer: benchmarks send token ids, not text")

    def encode_with_marker(self, text: str):
        raise ValueError("NullTokenizer: benchmarks send token ids with checkpoint_at, not text")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return ""
