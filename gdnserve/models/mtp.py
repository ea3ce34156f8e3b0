"""The multi-token-prediction (MTP) head of Qwen3-Next / Qwen3.5 (``mtp.*`` tensors), the speculative drafter.

Structure, as the public implementations build it (vLLM ``qwen3_next_mtp.py`` / ``qwen3_5_mtp.py``, SGLang
``qwen3_next_mtp.py``): for the target's final hidden state ``h_p`` at position p (AFTER the target's final
norm: the same vector its lm head reads) and the next token ``x_{p+1}``

    u    = fc([pre_fc_norm_embedding(embed(x_{p+1})) | pre_fc_norm_hidden(h_p)])     fc: [H, 2H], no bias
    g_p  = norm(layers[0](u))          one full-attention decoder layer, rotary position p, its own KV cache
    logits for x_{p+2} = lm_head(g_p)

The embedding and lm head are the target's (``mtp_use_dedicated_embeddings = false``: nothing of their own).
Every norm is the zero-centred RMSNorm ``x̂ · (1 + w)``. The decoder layer is the target's full-attention
layer (gated attention, q/k norms, partial rotary) with the MLP the target's rule gives layer index i: dense
for Qwen3.5, sparse MoE for Qwen3.5-MoE, Qwen3-Next's ``mlp_only_layers`` / ``decoder_sparse_step`` rule
(vLLM builds ``mtp.layers.{i}`` with layer index i). Draft step j > 1 feeds the head its own ``g`` and the
draft of step j - 1. Only ``layers[0]`` drafts (as vLLM's proposer); further layers load but are unused.

The engine drives it (``speculative/mtp.py``); this module only holds the weights and the math.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from gdnserve.layers.attention import GatedAttention
from gdnserve.layers.norm import RMSNorm
from gdnserve.models.config import ModelConfig


class MTPHead(nn.Module):
    def __init__(self, cfg: ModelConfig, make_layer: Callable[..., nn.Module], tp_rank: int = 0, tp_size: int = 1):
        """``make_layer``: the target's decoder layer class (models/qwen3_5.py's ``DecoderLayer``, which builds
        this head: passed in, so that this module does not import the decoder that imports it)."""
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        if cfg.mtp.num_layers < 1:
            raise ValueError(f"MTPHead: config mtp_num_hidden_layers = {cfg.mtp.num_layers}, need >= 1")
        self.pre_fc_norm_embedding = RMSNorm(H, eps)
        self.pre_fc_norm_hidden = RMSNorm(H, eps)
        self.fc = nn.Linear(2 * H, H, bias=False)          # replicated under tensor parallelism
        self.layers = nn.ModuleList(make_layer(cfg, i, tp_rank, tp_size, kind="full_attention")
                                    for i in range(cfg.mtp.num_layers))
        self.norm = RMSNorm(H, eps)

    @property
    def attention(self) -> GatedAttention:
        """The drafting layer's attention (bound to the MTP page-pool layer by the runner)."""
        return self.layers[0].mixer

    def fuse(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """emb: [T, H] embeddings of the next tokens, hidden: [T, H] the hidden state before them -> [T, H]."""
        return self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], dim=-1))

    def store(self, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
              token_index: torch.Tensor | None = None) -> None:
        """The feed pass: K/V of the drafting layer for T (hidden, next token) pairs into its cache; the
        layer's attention output, MLP and norm are not needed for that and not computed."""
        layer = self.layers[0]
        layer.mixer.store(layer.input_layernorm(self.fuse(emb, hidden)), positions, slot_mapping, token_index)

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """One draft step (attention metadata from the forward context) -> ``g: [T, H]``, the normed
        output: the lm head reads it for the draft, and the next draft step takes it as ``hidden``."""
        return self.norm(self.layers[0](self.fuse(emb, hidden)))
