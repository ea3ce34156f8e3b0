"""Load HF-format checkpoints (config.json + sharded safetensors) into HybridLM.

Checkpoint names are mapped to our fused parameters: ``in_proj = [in_proj_qkv | in_proj_z | in_proj_b |
in_proj_a]`` (Qwen3.5) or the de-interleaved ``in_proj_qkvz`` / ``in_proj_ba`` (Qwen3-Next, per key-head
group ``[q_g | k_g | v_g | z_g]`` and ``[b_g | a_g]``); ``qkv_proj = [q_proj | k_proj | v_proj]``;
``gate_up_proj = [gate_proj | up_proj]``; ``conv1d.weight [D, 1, W] -> conv_weight [D, W]``; sparse MoE
blocks through ``layers.moe.load_moe_from_hf`` (per-expert or fused expert tensors). A missing,
unexpected or mis-shaped tensor fails with its name and the expected shape.

FP8 block checkpoints (``quantization_config``, models/fp8.py): the layers the checkpoint quantizes become
FP8 layers before any memory is allocated (``prepare_fp8``), their e4m3 weights and block scales copied
as stored; everything else is read dense (dequantized if stored as FP8).

Tensor parallel: every mapping above yields the FULL fused tensor (de-interleaving happens on the whole
checkpoint tensor); each parameter then keeps this rank's rows / columns through
``layers.linear.load_shard`` (shapes in errors are the full, checkpoint ones).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors import safe_open

from gdnserve.layers.linear import fill_, load_shard
from gdnserve.layers.moe import SparseMoE, fold_shared_experts, load_moe_from_hf
from gdnserve.models.config import ModelConfig
from gdnserve.models.fp8 import (CheckpointError, Fp8Source, Part, dense_parts, fp8_parts, fp8_prefix,
                                 parts_for_blocks)

PREFIXES = ("model.language_model.", "model.", "")   # multimodal wrapper, CausalLM, bare
SKIP = ("mtp.", "model.visual.", "visual.")          # MTP only when the model builds it; vision: not ours


def checkpoint_tensors(folder: str | Path) -> dict[str, Callable[[], torch.Tensor]]:
    """name -> lazy loader over model.safetensors or the shards named by model.safetensors.index.json."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no .safetensors files")
    out: dict[str, Callable[[], torch.Tensor]] = {}
    for f in files:
        with safe_open(str(folder / f), framework="pt") as h:
            for name in h.keys():
                out[name] = (lambda f=f, name=name: _read(folder / f, name))
    return out


def _read(path: Path, name: str) -> torch.Tensor:
    with safe_open(str(path), framework="pt") as h:
        return h.get_tensor(name)


def _deinterleave_qkvz(w: torch.Tensor, H: int, HV: int, K: int, V: int) -> torch.Tensor:
    """Qwen3-Next in_proj_qkvz rows per key-head group g: [q_g K | k_g K | v_g rV | z_g rV] -> [Q|K|V|Z]."""
    r = HV // H
    g = w.view(H, 2 * K + 2 * r * V, -1)
    q, k, v, z = torch.split(g, [K, K, r * V, r * V], dim=1)
    return torch.cat([t.reshape(-1, w.shape[-1]) for t in (q, k, v, z)], 0)


def _deinterleave_ba(w: torch.Tensor, H: int, HV: int) -> torch.Tensor:
    r = HV // H
    g = w.view(H, 2 * r, -1)
    b, a = torch.split(g, [r, r], dim=1)
    return torch.cat([b.reshape(-1, w.shape[-1]), a.reshape(-1, w.shape[-1])], 0)


def _linears(cfg: ModelConfig, L: str, kind: str, moe: bool) -> dict[str, list[Part]]:
    """Our GEMM layers of one decoder layer (parameters AND checkpoint tensors named ``L...``) -> the checkpoint
    linears each concatenates, in row order (the MoE block's shared expert: ``_moe_linears``)."""
    g, d = cfg.gdn, {}
    if not moe:
        d[L + "mlp.gate_up_proj"] = [Part(L + "mlp.gate_proj"), Part(L + "mlp.up_proj")]
        d[L + "mlp.down_proj"] = [Part(L + "mlp.down_proj")]
    if kind == "linear_attention":
        A = L + "linear_attn."
        if cfg.family == "qwen3_next":
            def qkvz(n: int) -> torch.Tensor:
                return _deinterleave_qkvz(torch.arange(n).view(n, 1), g.num_k_heads, g.num_v_heads, g.head_k_dim,
                                          g.head_v_dim).view(-1)

            def ba(n: int) -> torch.Tensor:
                return _deinterleave_ba(torch.arange(n).view(n, 1), g.num_k_heads, g.num_v_heads).view(-1)
            d[L + "mixer.in_proj"] = [Part(A + "in_proj_qkvz", 4, qkvz), Part(A + "in_proj_ba", 2, ba)]
        else:
            d[L + "mixer.in_proj"] = [Part(A + "in_proj_qkv", 3), Part(A + "in_proj_z"), Part(A + "in_proj_b"),
                                      Part(A + "in_proj_a")]
        d[L + "mixer.out_proj"] = [Part(A + "out_proj")]
    else:
        A = L + "self_attn."
        d[L + "mixer.qkv_proj"] = [Part(A + "q_proj"), Part(A + "k_proj"), Part(A + "v_proj")]
        d[L + "mixer.o_proj"] = [Part(A + "o_proj")]
    return d


def _moe_linears(L: str) -> dict[str, list[Part]]:
    """The shared expert's GEMM layers of MoE layer ``L``."""
    S = L + "mlp.shared_expert."
    return {S + "gate_up_proj": [Part(S + "gate_proj"), Part(S + "up_proj")], S + "down_proj": [Part(S + "down_proj")]}


def _layer_plan(plan: dict[str, Callable[[], torch.Tensor]], src: Fp8Source, cfg: ModelConfig, L: str, kind: str,
                moe: bool) -> dict[str, list[Part]]:
    """Entries of ``plan`` for one decoder layer's norms and per-layer tensors; returns its GEMM layers
    (planned by ``_linear_plan``). A MoE MLP is loaded separately."""
    get = src.get
    plan[L + "input_layernorm.weight"] = lambda: get(L + "input_layernorm.weight")
    plan[L + "post_attention_layernorm.weight"] = lambda: get(L + "post_attention_layernorm.weight")
    if kind == "linear_attention":
        A = L + "linear_attn."
        plan[L + "mixer.conv_weight"] = lambda: get(A + "conv1d.weight").squeeze(1)
        for n in ("A_log", "dt_bias", "norm.weight"):
            plan[L + "mixer." + n] = lambda n=n: get(A + n)
    else:
        A = L + "self_attn."
        for n in ("q_norm.weight", "k_norm.weight"):
            plan[L + "mixer." + n] = lambda n=n: get(A + n)
    return _linears(cfg, L, kind, moe)


def _linear_plan(plan: dict[str, Callable[[], torch.Tensor]], src: Fp8Source, model: torch.nn.Module, name: str,
                 parts: list[Part]) -> None:
    """Plan entries of GEMM layer ``name``: its dense ``weight``, or for an FP8 layer (``to_fp8`` done)
    ``qweight`` + ``weight_scale_inv`` from the quantized parts and the dense tail rows in ``weight``."""
    layer = model.get_submodule(name)
    if layer.qweight is None:
        plan[name + ".weight"] = lambda: dense_parts(src, parts)
        return
    n_fp8 = parts_for_blocks(parts, layer.num_fp8_blocks)
    scales: list[torch.Tensor] = []                 # read with the weights, planned right after them

    def qweight() -> torch.Tensor:
        q, s = fp8_parts(src, parts, n_fp8)
        scales.append(s)
        return q
    plan[name + ".qweight"] = qweight
    plan[name + ".weight_scale_inv"] = lambda: scales.pop()
    if layer.weight is not None:
        plan[name + ".weight"] = ((lambda: dense_parts(src, parts[n_fp8:])) if n_fp8 < len(parts)
                                  else (lambda: torch.empty(0, layer.in_features)))


def model_linears(cfg: ModelConfig, with_mtp: bool) -> dict[str, list[Part]]:
    """Every GEMM layer of the model (projections, dense MLPs, shared experts) -> its checkpoint parts."""
    out: dict[str, list[Part]] = {}
    layers = [(f"layers.{i}.", k, cfg.is_moe_layer(i)) for i, k in enumerate(cfg.layer_types)]
    if with_mtp:
        layers += [(f"mtp.layers.{i}.", "full_attention", cfg.is_moe_layer(i)) for i in range(cfg.mtp.num_layers)]
    for L, kind, moe in layers:
        out.update(_linears(cfg, L, kind, moe))
        if moe and cfg.mlp.shared_expert_intermediate_size:
            out.update(_moe_linears(L))
    return out


def prepare_fp8(model: torch.nn.Module, cfg: ModelConfig, src: Fp8Source) -> list[str]:
    """Turn the layers the checkpoint quantizes into FP8 layers (``to_fp8``; on the meta device this
    allocates nothing; idempotent). Returns the FP8 layers' names. No-op for an unquantized config."""
    if cfg.quant is None:
        return []
    done = []
    for name, mod in model.named_modules():     # first: a folded block made FP8 unfolds its shared expert, whose
        if isinstance(mod, SparseMoE):           # layers the loop below then makes FP8
            e0 = name + ".experts.0.gate_proj"
            if (mod.experts_scales is None and mod.experts_fp8_ok() and src.is_fp8(e0)
                    and src.full(e0 + ".weight") in src.tensors):
                mod.to_fp8()
            if mod.experts_scales is not None:
                done.append(name + ".experts")
    for name, parts in model_linears(cfg, getattr(model, "mtp", None) is not None).items():
        try:
            layer = model.get_submodule(name)
        except AttributeError:          # a folded block's shared expert: rows of its experts (FP8 with them)
            continue
        if layer.qweight is None:
            nb = fp8_prefix(src, layer, parts)
            if not nb:
                continue
            layer.to_fp8(nb) if hasattr(layer, "blocks") else layer.to_fp8()
        done.append(name)
    return done


def load_weights(model: torch.nn.Module, cfg: ModelConfig, tensors: dict[str, Callable[[], torch.Tensor]],
                 dtype: torch.dtype, progress: bool | None = False, desc: str = "loading weights",
                 in_place: bool = True) -> None:
    """Copy every parameter of ``model`` (this rank's part of it) from ``tensors`` (see module docstring).
    With ``model.mtp`` built, the ``mtp.*`` tensors (top level, never under the model prefix) fill it and a
    missing, mis-shaped or unexpected one fails like any other. ``progress``: a tqdm bar on stderr over the
    parameters read from the safetensors shards (None: only when stderr is a terminal). ``in_place`` False: a
    parameter takes the tensor itself where device and dtype allow (shared with ``tensors``' owner, e.g. an HF
    model in memory), else a new one; True (``load_model``): copied into the parameter's own storage."""
    from tqdm import tqdm
    with_mtp = getattr(model, "mtp", None) is not None
    src = checkpoint_source(cfg, tensors, with_mtp)
    names = _names(tensors, with_mtp)
    prepare_fp8(model, cfg, src)        # (a block folded before it was made FP8 is unfolded there)
    get = src.get
    plan: dict[str, Callable[[], torch.Tensor]] = {"embed_tokens.weight": lambda: get("embed_tokens.weight"),
                                                  "norm.weight": lambda: get("norm.weight")}
    if not cfg.tie_word_embeddings:
        plan["lm_head.weight"] = lambda: get("lm_head.weight")
    moe_blocks: list[tuple[torch.nn.Module, str]] = []           # (our MoE module, its parameter prefix)
    linears: dict[str, list[Part]] = {}
    for i, kind in enumerate(cfg.layer_types):
        linears.update(_layer_plan(plan, src, cfg, f"layers.{i}.", kind, cfg.is_moe_layer(i)))
        if cfg.is_moe_layer(i):
            moe_blocks.append((model.layers[i].mlp, f"layers.{i}.mlp."))
    if with_mtp:
        for n in ("fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight"):
            plan["mtp." + n] = lambda n=n: get("mtp." + n)
        for i in range(cfg.mtp.num_layers):
            linears.update(_layer_plan(plan, src, cfg, f"mtp.layers.{i}.", "full_attention", cfg.is_moe_layer(i)))
            if cfg.is_moe_layer(i):
                moe_blocks.append((model.mtp.layers[i].mlp, f"mtp.layers.{i}.mlp."))
    for moe, p in moe_blocks:                # a shared expert's FP8 layers are planned like the others
        if moe.shared_expert is not None:
            linears.update({n: parts for n, parts in _moe_linears(p[:-len("mlp.")]).items()
                            if model.get_submodule(n).qweight is not None})
    for name, parts in linears.items():
        _linear_plan(plan, src, model, name, parts)
    params = dict(model.named_parameters())
    moe_params = {n for n in params if any(n.startswith(p) for _, p in moe_blocks)} - set(plan)
    missing_params = sorted(set(params) - set(plan) - moe_params)
    if missing_params:
        raise CheckpointError(f"no checkpoint mapping for parameters {missing_params}")
    bar = tqdm(total=len(plan) + len(moe_blocks), desc=desc, unit="tensor", disable=None if progress is None
               else not progress, leave=False, dynamic_ncols=True)
    with torch.no_grad():
        for name, fetch in plan.items():
            p = params[name]
            t = fetch()
            try:
                t = load_shard(model, name, t)
            except ValueError as e:
                raise CheckpointError(f"{name}: {e}") from e
            fill_(p, t, _param_dtype(name, dtype), in_place)
            bar.update()
    for moe, p in moe_blocks:
        try:
            load_moe_from_hf(moe, get, p, dtype, get_fp8=src.get_fp8, in_place=in_place)
        except (KeyError, ValueError) as e:
            raise CheckpointError(str(e)) from e
        bar.update()
    bar.close()
    fold_shared_experts(model)          # FP8 shared experts, whose layers were planned above (layers/moe.py)
    model.fp8_dequantized = sorted(set(src.dequantized))   # quantized in the checkpoint, loaded dense
    unexpected = sorted(n for n in names - src.used if not (cfg.tie_word_embeddings and n == "lm_head.weight"))
    if unexpected:
        raise CheckpointError(f"unexpected tensors in checkpoint: {unexpected[:8]}"
                              + (f" (+{len(unexpected) - 8} more)" if len(unexpected) > 8 else ""))


@torch.no_grad()
def quantize_model_fp8_(model: torch.nn.Module) -> list[str]:
    """Quantize a loaded dense model in place the way the FP8 releases are (benchmarks, tests): every GEMM
    layer whose layout allows it becomes an FP8 layer (128x128 blocks, ``quantize_weight``) except the GDN
    in_proj's ``b`` / ``a`` rows (its dense tail); router, shared expert gate, embeddings, lm head and MTP
    ``fc`` stay dense. Returns the FP8 layers' names."""
    done = []
    for mod in model.modules():             # a folded shared expert (expert E) becomes its own MLP again
        if isinstance(mod, SparseMoE):
            mod.unfold_shared()
    for name in model_linears(model.cfg, getattr(model, "mtp", None) is not None):
        layer = model.get_submodule(name)
        if layer.qweight is None and quantize_linear_fp8_(layer, 4 if name.endswith("mixer.in_proj") else None):
            done.append(name)                                                   # (in_proj: [q k v z | b a])
    for name, mod in model.named_modules():
        if isinstance(mod, SparseMoE) and quantize_experts_fp8_(mod):
            done.append(name + ".experts")
    fold_shared_experts(model)              # as the loader does: an FP8 shared expert as expert E again
    return done


@torch.no_grad()
def quantize_linear_fp8_(layer: torch.nn.Module, nb: int | None = None) -> bool:
    """One dense linear layer quantized in place to 128x128-block FP8 (``quantize_weight``); a fused layer's first
    ``nb`` blocks (default: all), the rest kept dense as its tail. False (unchanged) where its layout does not allow
    it."""
    from gdnserve.ops.quant import quantize_weight
    w = layer.weight.data
    if hasattr(layer, "blocks"):
        nb = len(layer.blocks) if nb is None else nb
        if not layer.fp8_layout_ok(nb):
            return False
        rows = sum(layer.local_blocks[:nb])
        layer.to_fp8(nb)
        layer.weight.data = w[rows:].clone()
    else:
        if not layer.fp8_layout_ok():
            return False
        rows = w.shape[0]
        layer.to_fp8()
    layer.qweight.data, layer.weight_scale_inv.data = quantize_weight(w[:rows])
    return True


@torch.no_grad()
def quantize_experts_fp8_(mod: SparseMoE) -> bool:
    """A dense block's routed experts quantized in place to 128x128-block FP8 (gate and up blocks each, then
    down). False (unchanged) where they are FP8 already or their layout does not allow it."""
    from gdnserve.ops.quant import quantize_weight
    if mod.experts_scales is not None or not mod.experts_fp8_ok():
        return False
    gu, dn, n = mod.experts_gate_up.data, mod.experts_down.data, mod.local_intermediate
    mod.to_fp8()
    (qg, sg), (qu, su), (qd, sd) = (quantize_weight(t) for t in (gu[:, :n], gu[:, n:], dn))
    mod.experts_gate_up.data, mod.experts_gate_up_scale_inv.data = torch.cat([qg, qu], 1), torch.cat([sg, su], 1)
    mod.experts_down.data, mod.experts_down_scale_inv.data = qd, sd.contiguous()
    return True


def _param_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """A_log stays fp32 (the decay rate; fp16/bf16 would make exp(A_log) coarse); FP8 weights stay e4m3,
    their block scales fp32."""
    if name.endswith(("A_log", "weight_scale_inv")):
        return torch.float32
    return torch.float8_e4m3fn if name.endswith("qweight") else dtype


def _names(tensors: dict[str, Callable[[], torch.Tensor]], with_mtp: bool) -> set[str]:
    return {n for n in tensors if not n.startswith(SKIP) or (with_mtp and n.startswith("mtp."))}


def checkpoint_source(cfg: ModelConfig, tensors: dict[str, Callable[[], torch.Tensor]], with_mtp: bool) -> Fp8Source:
    """The checkpoint accessor (prefix detected from where ``embed_tokens.weight`` lives)."""
    names = _names(tensors, with_mtp)
    prefix = next((p for p in PREFIXES if f"{p}embed_tokens.weight" in names), None)
    if prefix is None:
        raise CheckpointError("checkpoint has no embed_tokens.weight under any of "
                              + ", ".join(f"'{p}'" for p in PREFIXES))
    return Fp8Source(tensors, prefix, cfg.quant)


def resolve_mtp(cfg: ModelConfig, names: Iterable[str]) -> tuple[ModelConfig, str | None]:
    """The MTP layers this checkpoint gets and, when none, why (the MTP drafter's error names it). Config
    without a count (Qwen3-Next releases): the checkpoint's ``mtp.layers.{i}``. A count the config states
    but no ``mtp.*`` tensor at all: the target loads, MTP unavailable. Some ``mtp.*`` present: the loader
    requires all of them (errors name the missing one)."""
    m = cfg.mtp
    have = sorted({int(n.split(".")[2]) for n in names if n.startswith("mtp.layers.") and n.split(".")[2].isdigit()})
    any_mtp = any(n.startswith("mtp.") for n in names)
    n, why = m.num_layers, None
    if m.dedicated_embeddings:
        n, why = 0, "config mtp_use_dedicated_embeddings = true is not supported (MTP embeddings are shared)"
    elif not m.in_config:
        n = have[-1] + 1 if have else 0
        why = None if n else "config.json names no MTP layers and the checkpoint has no mtp.layers.* tensors"
    elif n and not any_mtp:
        n, why = 0, f"config mtp_num_hidden_layers = {m.num_layers} but the checkpoint has no mtp.* tensors"
    elif not n:
        why = "config.json has no MTP layers (mtp_num_hidden_layers = 0)"
    return dataclasses.replace(cfg, mtp=dataclasses.replace(m, num_layers=n)), why


def load_model(folder: str | Path, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
               tp_rank: int | None = None, tp_size: int | None = None, progress: bool | None = None):
    """config.json + safetensors -> (HybridLM on ``device`` in ``dtype``, ModelConfig). Built on the meta
    device, so no memory is spent on initial weights. ``tp_rank`` / ``tp_size`` (default: the
    torch.distributed group's, 0 / 1 without one) pick the tensor-parallel shard this process holds.
    ``progress``: a tqdm bar while the shards are read (default: when stderr is a terminal)."""
    from gdnserve.models.qwen3_5 import HybridLM
    tensors = checkpoint_tensors(folder)
    cfg, why = resolve_mtp(ModelConfig.from_hf(Path(folder)), tensors)
    with torch.device("meta"):     # in ``dtype`` before allocating: an fp32 to_empty would need twice the weights
        model = HybridLM(cfg, tp_rank, tp_size).to(dtype)
        for layer in model.gdn_layers():    # the decay rate stays fp32 (_param_dtype): allocated so, filled in place
            layer.A_log.data = layer.A_log.data.float()
    prepare_fp8(model, cfg, checkpoint_source(cfg, tensors, model.mtp is not None))   # before allocating
    fold_shared_experts(model)      # the final layout before allocating too: load_moe_from_hf fills it in place
    model = model.to_empty(device=device)
    model.mtp_unavailable = why
    shards = len(list(Path(folder).glob("*.safetensors")))
    load_weights(model, cfg, tensors, dtype, progress, f"loading {Path(folder).name} ({shards} shard"
                 f"{'s' if shards != 1 else ''})")
    for attn in model.attention_layers() + ([l.mixer for l in model.mtp.layers] if model.mtp is not None else []):
        attn.rotary.reset_buffers()                  # non-persistent buffers are not in checkpoints
    return model.eval(), cfg
