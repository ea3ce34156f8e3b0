"""Test helpers for the MTP head: random ``mtp.*`` tensors added to a tiny HF checkpoint saved by transformers
(whose classes drop MTP), and a plain float64 reference of the MTP draft chain written from the checkpoint's
own tensors (HF names and layouts, not our fused parameters).

Reference (vLLM qwen3_next_mtp.py / qwen3_5_mtp.py): pair p = (h_p, x_{p+1}), h_p the target's hidden after
its final norm; u = fc([rmsz(embed(x_{p+1}), w_emb) | rmsz(h_p, w_hid)]); one full-attention decoder layer at
rotary position p attending pairs 0..p; g_p = rmsz(layer(u), w_norm); logits = lm_head(g_p). A draft chain
after n fed tokens and the sampled x_n starts at pair n - 1 and continues with (g, draft) pairs.
"""
from __future__ import annotations

import json
import math

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

F64 = torch.float64


def add_mtp(folder, *, seed: int, count_in_config: bool = True, std: float = 0.2) -> dict[str, torch.Tensor]:
    """Add one random MTP layer to ``folder``'s model.safetensors: attention tensors shaped like the
    checkpoint's first full-attention layer, MLP tensors like layer 0's (the MTP layer follows layer 0's MoE
    rule), plus fc / pre-fc norms / final norm; set ``mtp_num_hidden_layers = 1`` in config.json (or leave
    it out). Returns the added tensors."""
    f = folder / "model.safetensors"
    sd = load_file(str(f))
    cfg = json.loads((folder / "config.json").read_text())
    pre = "model.language_model." if any(n.startswith("model.language_model.") for n in sd) else "model."
    types = cfg["layer_types"]
    attn = f"{pre}layers.{types.index('full_attention')}."
    gen = torch.Generator().manual_seed(seed)
    H = sd[pre + "embed_tokens.weight"].shape[1]

    def rnd(shape, norm=False):
        t = torch.randn(shape, generator=gen)
        return t * 0.1 if norm else t * std

    mtp = {"mtp.fc.weight": rnd((H, 2 * H)), "mtp.norm.weight": rnd((H,), True),
           "mtp.pre_fc_norm_embedding.weight": rnd((H,), True), "mtp.pre_fc_norm_hidden.weight": rnd((H,), True)}
    for name, t in sd.items():
        if name.startswith(attn + "self_attn.") or name.startswith(pre + "layers.0.mlp."):
            layer = attn if name.startswith(attn) else pre + "layers.0."
            mtp["mtp.layers.0." + name[len(layer):]] = rnd(t.shape, "norm" in name)
    for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        mtp["mtp.layers.0." + n] = rnd((H,), True)
    save_file({**sd, **mtp}, str(f))
    if count_in_config:
        cfg["mtp_num_hidden_layers"] = 1
    cfg.pop("num_nextn_predict_layers", None)
    (folder / "config.json").write_text(json.dumps(cfg))
    return mtp


def _rmsz(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm over the last dim: x / rms(x) * (1 + w)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def _rope(x: torch.Tensor, pos: torch.Tensor, rd: int, theta: float) -> torch.Tensor:
    """x: [T, heads, Dh]; rotate-half on the first rd dims at positions pos [T]."""
    inv = 1.0 / theta ** (torch.arange(0, rd, 2, dtype=F64) / rd)
    f = pos[:, None].to(F64) * inv[None]
    cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
    xr, xp = x[..., :rd], x[..., rd:]
    rot = torch.cat([-xr[..., rd // 2:], xr[..., :rd // 2]], -1)
    return torch.cat([xr * cos + rot * sin, xp], -1)


def _mlp(W: dict, P: str, x: torch.Tensor, cfg) -> torch.Tensor:
    if P + "gate_proj.weight" in W:
        return F.linear(F.silu(F.linear(x, W[P + "gate_proj.weight"])) * F.linear(x, W[P + "up_proj.weight"]),
                        W[P + "down_proj.weight"])
    E, k = cfg.mlp.num_experts, cfg.mlp.num_experts_per_tok
    probs = torch.softmax(F.linear(x, W[P + "gate.weight"]), -1)
    w, idx = torch.topk(probs, k, -1)
    if cfg.mlp.norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(E):
        if P + "experts.gate_up_proj" in W:
            gu, down = W[P + "experts.gate_up_proj"][e], W[P + "experts.down_proj"][e]
        else:
            gu = torch.cat([W[f"{P}experts.{e}.gate_proj.weight"], W[f"{P}experts.{e}.up_proj.weight"]])
            down = W[f"{P}experts.{e}.down_proj.weight"]
        I = gu.shape[0] // 2
        y = F.linear(F.silu(F.linear(x, gu[:I])) * F.linear(x, gu[I:]), down)
        out += y * (w * (idx == e)).sum(-1, keepdim=True)
    if P + "shared_expert.gate_proj.weight" in W:
        s = P + "shared_expert."
        shared = F.linear(F.silu(F.linear(x, W[s + "gate_proj.weight"])) * F.linear(x, W[s + "up_proj.weight"]),
                          W[s + "down_proj.weight"])
        out += torch.sigmoid(F.linear(x, W[P + "shared_expert_gate.weight"])) * shared
    return out


def mtp_layer(W: dict, cfg, u: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The MTP decoder layer on the whole pair sequence u: [T, H] (pair t at rotary position pos[t]; causal)."""
    a, eps, P = cfg.attn, cfg.rms_norm_eps, "mtp.layers.0."
    T, Dh, QH, KVH = u.shape[0], a.head_dim, a.num_heads, a.num_kv_heads
    x = _rmsz(u, W[P + "input_layernorm.weight"], eps)
    qg = F.linear(x, W[P + "self_attn.q_proj.weight"]).view(T, QH, 2 * Dh)
    q, gate = qg[..., :Dh], qg[..., Dh:].reshape(T, QH * Dh)
    k = F.linear(x, W[P + "self_attn.k_proj.weight"]).view(T, KVH, Dh)
    v = F.linear(x, W[P + "self_attn.v_proj.weight"]).view(T, KVH, Dh)
    q = _rope(_rmsz(q, W[P + "self_attn.q_norm.weight"], eps), pos, a.rotary_dim, a.rope_theta)
    k = _rope(_rmsz(k, W[P + "self_attn.k_norm.weight"], eps), pos, a.rotary_dim, a.rope_theta)
    g = QH // KVH
    s = torch.einsum("thd,shd->hts", q, k.repeat_interleave(g, 1)) / math.sqrt(Dh)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hts,shd->thd", torch.softmax(s, -1), v.repeat_interleave(g, 1)).reshape(T, QH * Dh)
    u = u + F.linear(o * torch.sigmoid(gate), W[P + "self_attn.o_proj.weight"])
    return u + _mlp(W, P + "mlp.", _rmsz(u, W[P + "post_attention_layernorm.weight"], eps), cfg)


def reference_draft_logits(W: dict, cfg, hidden: torch.Tensor, tokens: list[int], drafts: list[int]) -> torch.Tensor:
    """Float64 draft logits [k, vocab] after ``tokens`` (n fed tokens and the sampled x_n, so n + 1 ids) whose
    target hidden states are ``hidden: [n, H]``, the chain continuing with ``drafts`` (k - 1 used).
    ``W``: checkpoint tensors in float64 (embedding, lm head, mtp.*)."""
    eps = cfg.rms_norm_eps
    emb = W["embed"]
    head = W["lm_head"]
    n, k = hidden.shape[0], len(drafts)
    hs, xs = [hidden[p] for p in range(n)], list(tokens[1:])
    out = []
    for j in range(k):
        T = len(hs)
        e = emb[torch.tensor(xs)]
        u = F.linear(torch.cat([_rmsz(e, W["mtp.pre_fc_norm_embedding.weight"], eps),
                                _rmsz(torch.stack(hs), W["mtp.pre_fc_norm_hidden.weight"], eps)], -1),
                     W["mtp.fc.weight"])
        g = _rmsz(mtp_layer(W, cfg, u, torch.arange(T)), W["mtp.norm.weight"], eps)[-1]
        out.append(F.linear(g, head))
        hs.append(g)
        xs.append(drafts[j])
    return torch.stack(out)


def reference_weights(folder, cfg) -> dict[str, torch.Tensor]:
    """The checkpoint's mtp.* tensors plus ``embed`` / ``lm_head`` (the target's), all float64."""
    sd = load_file(str(folder / "model.safetensors"))
    W = {n: t.to(F64) for n, t in sd.items() if n.startswith("mtp.")}
    emb = next(t for n, t in sd.items() if n.endswith("embed_tokens.weight")).to(F64)
    W["embed"], W["lm_head"] = emb, (emb if cfg.tie_word_embeddings else sd["lm_head.weight"].to(F64))
    return W
