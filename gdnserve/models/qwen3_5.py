"""The hybrid decoder of Qwen3.5 text models (dense and MoE) and Qwen3-Next: embeddings -> layers of
[zero-centred RMSNorm -> GDN or gated attention -> residual -> RMSNorm -> MLP or sparse MoE -> residual]
-> final norm -> lm head (tied to the embeddings when the config says so). Packed tokens [T] in, all
per-step metadata from the forward context.

Tensor parallel (world size 1 by default, see layers/parallel.py): GDN heads, attention heads and MLP /
expert intermediate dims are split across ranks (layers/linear.py), one all-reduce after each row-parallel
projection (one per MoE block); embeddings, norms and the lm head are replicated, so every rank holds the
full hidden state and returns the full logits."""
from __future__ import annotations

import torch
from torch import nn

from gdnserve.layers.attention import GatedAttention
from gdnserve.layers.gdn_mixer import GatedDeltaNet
from gdnserve.layers.mlp import MLP
from gdnserve.layers.moe import SparseMoE
from gdnserve.layers.norm import RMSNorm
from gdnserve.layers.parallel import resolve
from gdnserve.models.config import ModelConfig
from gdnserve.models.mtp import MTPHead
from gdnserve.ops.backend import resolve as resolve_backend


def check_tp(cfg: ModelConfig, tp_size: int) -> None:
    """ValueError naming the config field (HF key) whose size does not divide by ``tp_size``."""
    g, a, m = cfg.gdn, cfg.attn, cfg.mlp
    sizes: dict[str, int] = {}
    if cfg.num_linear_layers:
        sizes.update(linear_num_key_heads=g.num_k_heads, linear_num_value_heads=g.num_v_heads)
    if cfg.num_linear_layers < cfg.num_layers or cfg.mtp.num_layers:
        sizes.update(num_attention_heads=a.num_heads, num_key_value_heads=a.num_kv_heads)
    mlp_layers = range(max(cfg.num_layers, cfg.mtp.num_layers))     # MTP layer i follows layer i's MLP rule
    if any(not cfg.is_moe_layer(i) for i in mlp_layers):
        sizes["intermediate_size"] = m.intermediate_size
    if any(cfg.is_moe_layer(i) for i in mlp_layers):
        sizes["moe_intermediate_size"] = m.moe_intermediate_size
        if m.shared_expert_intermediate_size:
            sizes["shared_expert_intermediate_size"] = m.shared_expert_intermediate_size
    for key, n in sizes.items():
        if n % tp_size:
            raise ValueError(f"tensor parallel: config {key} = {n} is not divisible by tp_size = {tp_size}")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int, tp_rank: int = 0, tp_size: int = 1, kind: str | None = None):
        """Layer ``i`` of the decoder: its mixer from ``cfg.layer_types[i]`` (or ``kind``: the MTP layers are
        full attention), its MLP by the config's MoE rule for index i."""
        super().__init__()
        self.kind = kind or cfg.layer_types[i]
        eps = cfg.rms_norm_eps
        tp = dict(tp_rank=tp_rank, tp_size=tp_size)
        if self.kind == "linear_attention":
            g = cfg.gdn
            self.mixer: nn.Module = GatedDeltaNet(cfg.hidden_size, g.num_k_heads, g.num_v_heads, g.head_k_dim,
                                                  g.head_v_dim, g.conv_kernel, eps, **tp)
        else:
            a = cfg.attn
            self.mixer = GatedAttention(cfg.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, a.rotary_dim,
                                        a.rope_theta, eps, **tp)
        m = cfg.mlp
        if cfg.is_moe_layer(i):
            self.mlp: nn.Module = SparseMoE(cfg.hidden_size, m.num_experts, m.num_experts_per_tok,
                                            m.moe_intermediate_size, m.shared_expert_intermediate_size,
                                            m.norm_topk_prob, **tp)
        else:
            self.mlp = MLP(cfg.hidden_size, m.intermediate_size, **tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.fused = True      # fused residual add + norm (set_fused); the mixer's backend picks Triton or not

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: [T, hidden] -> h + mixer + MLP (the layer on its own: the MTP head's use)."""
        out, residual = self.step(h, None)
        return out + residual

    def step(self, h: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream carried as (the previous layer's MLP output ``h``, the stream before it
        ``residual``; None for the first layer, whose ``h`` is the stream itself) -> this layer's pair. Each
        norm adds the pending branch output into the stream first: with ``fused`` and a Triton backend
        (the mixer's, set by the runner) the add and the norm are one launch; else the PyTorch ops, which
        are ``h = h + mixer(norm(h)); h = h + mlp(norm(h))`` bit for bit. Where the mixer's first projection
        is FP8 and would quantize its input by a launch of its own, the Triton input norm quantizes its output
        in registers and hands it over (``xq``; the same numbers). The MoE block behind the post-attention
        norm quantizes inside its own kernels: not there."""
        be = self.mixer.backend if self.fused else "torch"
        quant = resolve_backend(be, h) == "triton" and self.mixer.takes_quantized_input(h)
        out = self.input_layernorm(h, residual, backend=be, quant=quant)     # y | (y, s), then (q, s) if quant
        xq = out[-1] if quant else None
        if residual is None:
            x, residual = (out[0] if quant else out), h
        else:
            x, residual = out[0], out[1]
        mixed = self.mixer(x, xq=xq)
        if be != "torch" and hasattr(self.mlp, "forward_prenorm"):   # the MoE block may fold the norm into its router
            return self.mlp.forward_prenorm(mixed, residual, self.post_attention_layernorm, be)
        x, residual = self.post_attention_layernorm(mixed, residual, backend=be)
        return self.mlp(x), residual


def set_fused(model: nn.Module, on: bool) -> None:
    """Switch every fused kernel of the decoder on or off (``fused`` attributes: the residual add + norm of
    the decoder layers, the GDN gated norm, the attention's q/k norm + rotary, the MoE router); off = the
    unfused PyTorch ops on any device (what the kernel-count profile compares against). On by default; they
    run only on the Triton backend (CPU runs take the PyTorch path anyway)."""
    for m in model.modules():
        if hasattr(m, "fused"):
            m.fused = on


class HybridLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_rank: int | None = None, tp_size: int | None = None):
        """tp_rank / tp_size: this rank's shard (default: the torch.distributed group's, 0 / 1 without one)."""
        super().__init__()
        self.cfg = cfg
        self.tp_rank, self.tp_size = resolve(tp_rank, tp_size)
        check_tp(cfg, self.tp_size)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.tp_rank, self.tp_size) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = None                   # the MTP head (models/mtp.py), registered last; None = no MTP drafter
        self.mtp_unavailable = "config.json has no MTP layers (mtp_num_hidden_layers = 0)"
        if cfg.mtp.num_layers:
            self.mtp = MTPHead(cfg, DecoderLayer, self.tp_rank, self.tp_size)
            self.mtp_unavailable = None

    def gdn_layers(self) -> list[GatedDeltaNet]:
        return [l.mixer for l in self.layers if isinstance(l.mixer, GatedDeltaNet)]

    def attention_layers(self) -> list[GatedAttention]:
        return [l.mixer for l in self.layers if isinstance(l.mixer, GatedAttention)]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, logits_rows: torch.Tensor | None = None,
                return_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids: [T] packed tokens of the step; logits_rows: [R] rows whose logits are wanted
        (None = all). Returns [R, vocab] in fp32; with ``return_hidden`` also the final hidden states of all
        T rows after the final norm ``[T, hidden]`` (what the lm head reads; the MTP drafter's input)."""
        h = self.hidden_states(input_ids)
        hidden = self.norm(h) if return_hidden else None
        # the logits rows are normed on their own either way, so logits are bit-identical with and without
        logits = self.logits(self.norm(h if logits_rows is None else h[logits_rows]))
        return (logits, hidden) if return_hidden else logits

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] tokens -> [T, hidden] after the last decoder layer (before the final norm). A CUDA graph
        captures this plus the norm; the lm head then runs eagerly on the live rows only."""
        h, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            h, residual = layer.step(h, residual)
        return h + residual

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [R, hidden] -> fp32 logits [R, vocab]."""
        return torch.nn.functional.linear(h, self.lm_head_weight).float()
