"""A random-weight model with the Qwen3.5-35B-A3B GDN and attention shapes, built directly on the device
(no checkpoint on disk), for the model, serving and speculative-decoding benchmarks.

``bench_hf_config(...)`` is the HF config.json (``qwen3_5_moe_text``) that every benchmark records in its
JSON: hidden 2048; GDN H=16, HV=32, K=V=128, W=4; attention 16 q heads, 2 KV heads, head_dim 256, gated,
a quarter of each head rotated; 3 GDN : 1 attention; sparse MoE top-8 with moe_intermediate 512 and a
shared expert of 512; vocab 248320. ``full_hf_config()`` is the whole Qwen3.5-35B-A3B (40 layers =
10 x (3 GDN + 1 attention), 256 experts: 35.1 B parameters, 70 GB in bf16), the default of ``bench model``
on CUDA; the 8-layer, 64-expert cut (``bench_hf_config()``'s default) is its ``--quick`` shape and the
serving benchmarks'. ``qwen3_next_hf_config()`` is Qwen3-Next-80B-A3B's layer pattern (48 layers =
12 x (3 GDN + 1 attention), 512 experts top-10, vocab 151936), sized by ``param_bytes`` without allocating
it (it does not fit one H200 in bf16). ``tiny_hf_config()`` is the CPU smoke shape.

Weights: N(0, 0.02) projections and embeddings, zero-centred norms at 0 (identity), the GDN gated norm at
1, A_log = log U(1, 16), dt_bias 1, conv N(0, 0.3) — ``init_random_`` applies these rules by parameter
name, so gdnserve's model and transformers' get the same distribution; ``build_hf_model`` +
``ours_from_hf`` give both models the *same* weights (our loader's name mapping, applied in memory).
On CUDA the model is allocated on the device (meta -> ``to_empty``) in its final layout (shared experts folded,
fp32 A_log: nothing re-allocated, so no freed block is left split) and every parameter is filled in place in its
own dtype (``normal_`` / ``uniform_`` with a device generator): no host copy and no fp32 temporary, so the 70 GB
model needs 70 GB. On CPU the draws go through fp32 tensors as before (the tests' values).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from gdnserve.layers.moe import fold_shared_experts
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


FULL_LAYERS, FULL_EXPERTS = 40, 256        # Qwen3.5-35B-A3B
QUICK_LAYERS, QUICK_EXPERTS = 8, 64        # the quick / serving cut


def full_hf_config() -> dict[str, Any]:
    """Qwen3.5-35B-A3B's text model exactly (the layer and expert counts of its config.json)."""
    return bench_hf_config(FULL_LAYERS, FULL_EXPERTS)


def qwen3_next_hf_config() -> dict[str, Any]:
    """Qwen3-Next-80B-A3B's text model (model_type qwen3_next; the other fields are that family's HF defaults,
    models/config.py): 48 layers, GDN H=16 HV=32 K=V=128, attention 16/2 heads of 256, 512 experts top-10 of
    512 + a shared expert of 512, vocab 151936."""
    return {"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "dtype": "bfloat16",
            "num_hidden_layers": 48, "num_experts": 512, "num_experts_per_tok": 10, "vocab_size": 151936,
            "eos_token_id": None, "pad_token_id": None, "bos_token_id": None}


def param_bytes(hf_cfg: dict[str, Any], dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
    """(parameters, bytes) of gdnserve's model of ``hf_cfg`` in ``dtype`` (A_log kept fp32), counted on the meta
    device: nothing is allocated."""
    from gdnserve.models.qwen3_5 import HybridLM
    with torch.device("meta"):
        model = HybridLM(ModelConfig.from_hf(hf_cfg)).to(dtype)
    n = b = 0
    for name, p in model.named_parameters():
        n += p.numel()
        b += p.numel() * (4 if name.endswith("A_log") else p.element_size())
    return n, b


def tiny_hf_config(num_layers: int = 4, num_experts: int = 8) -> dict[str, Any]:
    """The same architecture at CPU-smoke size (hidden 64, GDN H=2 HV=4 K=V=16, vocab 512)."""
    d = bench_hf_config(num_layers, num_experts, vocab_size=512)
    d.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, num_experts_per_tok=2,
             moe_intermediate_size=32, shared_expert_intermediate_size=32, max_position_embeddings=8192, dtype="float32")
    return d


def config_for(device: torch.device, num_layers: int | None, num_experts: int | None,
               full: bool = False) -> dict[str, Any]:
    """The benchmark shape on CUDA (``full``: all 40 layers and 256 experts, else the 8-layer, 64-expert cut),
    the tiny one on CPU; layer / expert counts overridable."""
    if device.type == "cuda":
        d_layers, d_experts = (FULL_LAYERS, FULL_EXPERTS) if full else (QUICK_LAYERS, QUICK_EXPERTS)
        return bench_hf_config(num_layers or d_layers, num_experts or d_experts)
    return tiny_hf_config(num_layers or 4, num_experts or 8)


@torch.no_grad()
def init_random_(model: torch.nn.Module, seed: int) -> None:
    """Fill every parameter by the rules in the module docstring (names of gdnserve's or HF's modules)."""
    dev = next(model.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(seed)
    if dev.type == "cuda":
        _init_in_place_(model, gen)
        return
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


def _init_in_place_(model: torch.nn.Module, gen: torch.Generator) -> None:
    """The same rules, drawn in place in each parameter's dtype (the CUDA path: no temporaries)."""
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.uniform_(1, 16, generator=gen).log_()
        elif name.endswith("dt_bias"):
            p.fill_(1.0)
        elif "conv" in name:
            p.normal_(0, 0.3, generator=gen)
        elif "norm" in name:
            p.fill_(1.0 if name.endswith(("mixer.norm.weight", "linear_attn.norm.weight")) else 0.0)
        else:
            p.normal_(0, 0.02 if p.dim() > 1 else 1 / math.sqrt(p.numel()), generator=gen)


def build_random_model(hf_cfg: dict[str, Any], device: torch.device, dtype: torch.dtype, seed: int = 0):
    """gdnserve's HybridLM with random weights, built on the meta device and filled on ``device`` (on CUDA in
    place, in ``dtype``: the full-size model needs its 70 GB and nothing more)."""
    from gdnserve.models.qwen3_5 import HybridLM
    cfg = ModelConfig.from_hf(hf_cfg)
    with torch.device("meta"):
        model = HybridLM(cfg).to(dtype)
        if device.type == "cuda":
            # the final layout before allocating: folded experts ([E+1, ...]) and fp32 A_log re-allocated after
            # to_empty left every MoE layer's freed [E, ...] block split by later allocations, segments that
            # empty_cache cannot return (~0.5 GiB a layer, 20 GiB "in use" on the H200 at full size)
            _finish(model)
    model = model.to_empty(device=device)
    init_random_(model, seed)
    _finish(model)
    return model.eval()


def _finish(model) -> None:
    fold_shared_experts(model)                 # as the loader does: the shared expert as expert E (layers/moe.py)
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
    load_weights(model, cfg, tensors, dtype, in_place=False)      # HF's tensors shared, not copied
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
