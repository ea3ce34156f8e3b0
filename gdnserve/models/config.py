"""Model facts from an HF ``config.json``: one frozen :class:`ModelConfig` per checkpoint.

Supported (``model_type`` → family): ``qwen3_next`` (Qwen3NextForCausalLM), ``qwen3_5_text``
(Qwen3_5ForCausalLM), ``qwen3_5_moe_text`` (Qwen3_5MoeForCausalLM), and the multimodal wrappers
``qwen3_5`` / ``qwen3_5_moe`` (their ``text_config``; the vision tower is not ours). Every default below
is the default of the HF config class of that family (transformers 5.x ``configuration_qwen3_next.py``,
``configuration_qwen3_5.py``, ``configuration_qwen3_5_moe.py``); tests/models/test_config.py checks each
against transformers itself, so a changed HF default fails a test instead of silently changing a model.
"""
from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gdnserve.layers.rank_shapes import GDNShape

Family = Literal["qwen3_next", "qwen3_5", "qwen3_5_moe"]
LayerType = Literal["linear_attention", "full_attention"]
LAYER_TYPES = ("linear_attention", "full_attention")

# text model_type -> family; wrapper model_type -> text model_type
TEXT_MODEL_TYPES: dict[str, Family] = {"qwen3_next": "qwen3_next", "qwen3_5_text": "qwen3_5",
                                       "qwen3_5_moe_text": "qwen3_5_moe"}
WRAPPER_MODEL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
ARCHITECTURES = {"Qwen3NextForCausalLM": "qwen3_next", "Qwen3_5ForCausalLM": "qwen3_5_text",
                 "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text", "Qwen3_5ForConditionalGeneration": "qwen3_5",
                 "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe"}

# HF class defaults per family (None = the family has no such field).
_COMMON = dict(hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
               attention_bias=False, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
               linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
               rope_theta=10000.0, partial_rotary_factor=0.25, full_attention_interval=4)
_DEFAULTS: dict[Family, dict[str, Any]] = {
    "qwen3_next": dict(_COMMON, vocab_size=151936, hidden_size=2048, intermediate_size=5632,
                       num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2,
                       decoder_sparse_step=1, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                       num_experts_per_tok=10, num_experts=512, norm_topk_prob=True),
    "qwen3_5": dict(_COMMON, vocab_size=248320, hidden_size=4096, intermediate_size=12288,
                    num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4),
    "qwen3_5_moe": dict(_COMMON, vocab_size=248320, hidden_size=2048, num_hidden_layers=40,
                        num_attention_heads=16, num_key_value_heads=2, moe_intermediate_size=512,
                        shared_expert_intermediate_size=512, num_experts_per_tok=8, num_experts=256),
}


class UnsupportedModelError(ValueError):
    """The config names an architecture gdnserve does not build."""


def _positive(owner: str, **values: int) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{owner}.{name} must be a positive int, got {v!r}")


@dataclass(frozen=True)
class GDNConfig:
    """Gated-DeltaNet layers. HF keys: linear_num_key_heads (H), linear_num_value_heads (HV),
    linear_key_head_dim (K), linear_value_head_dim (V), linear_conv_kernel_dim (W)."""
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        _positive("GDNConfig", num_k_heads=self.num_k_heads, num_v_heads=self.num_v_heads,
                  head_k_dim=self.head_k_dim, head_v_dim=self.head_v_dim, conv_kernel=self.conv_kernel)
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"GDNConfig.num_v_heads (linear_num_value_heads) = {self.num_v_heads} must be a "
                             f"multiple of num_k_heads (linear_num_key_heads) = {self.num_k_heads}")

    @property
    def ratio(self) -> int:
        """r = HV / H: value heads per key head (value head j reads key head j // r)."""
        return self.num_v_heads // self.num_k_heads

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """D = 2·H·K + HV·V: channels of the depthwise conv (q, k and v; layers/rank_shapes.py)."""
        return GDNShape.of(self).conv_dim


@dataclass(frozen=True)
class AttnConfig:
    """Full-attention layers: q_proj is 2x wide ([q | gate] per head) when ``output_gate``; q/k get a
    zero-centred RMSNorm over head_dim; RoPE (rotate_half style) on the first ``rotary_dim`` dims only.
    ``rope_scaling`` is None for plain RoPE, else the HF rope parameters without theta / partial factor
    (Qwen3.5 records ``mrope_section`` / ``mrope_interleaved`` here; for text-only positions M-RoPE is
    plain RoPE, the three position rows being equal)."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    rotary_dim: int
    output_gate: bool
    max_position_embeddings: int
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    attention_bias: bool = False

    def __post_init__(self) -> None:
        _positive("AttnConfig", num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                  max_position_embeddings=self.max_position_embeddings)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"AttnConfig.num_heads (num_attention_heads) = {self.num_heads} must be a multiple "
                             f"of num_kv_heads (num_key_value_heads) = {self.num_kv_heads}")
        if self.rotary_dim != int(self.head_dim * self.partial_rotary_factor):
            raise ValueError(f"AttnConfig.rotary_dim = {self.rotary_dim} must be int(head_dim * "
                             f"partial_rotary_factor) = {int(self.head_dim * self.partial_rotary_factor)}")
        if not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"AttnConfig.partial_rotary_factor = {self.partial_rotary_factor} gives rotary_dim "
                             f"{self.rotary_dim}; it must be even and in (0, head_dim={self.head_dim}]")


@dataclass(frozen=True)
class MLPConfig:
    """Dense SwiGLU MLP or sparse MoE (softmax top-k router, optional renormalisation, plus a shared
    expert scaled by sigmoid(shared_expert_gate)). ``num_experts == 0`` means every layer is dense."""
    intermediate_size: int
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.decoder_sparse_step <= 0:
            raise ValueError(f"MLPConfig.decoder_sparse_step must be > 0, got {self.decoder_sparse_step}")
        if self.num_experts < 0:
            raise ValueError(f"MLPConfig.num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts:
            _positive("MLPConfig", num_experts_per_tok=self.num_experts_per_tok,
                      moe_intermediate_size=self.moe_intermediate_size)
            if self.num_experts_per_tok > self.num_experts:
                raise ValueError(f"MLPConfig.num_experts_per_tok = {self.num_experts_per_tok} exceeds "
                                 f"num_experts = {self.num_experts}")

    def is_moe_layer(self, i: int) -> bool:
        """HF's rule (Qwen3NextDecoderLayer): not in mlp_only_layers, experts exist, and
        (i + 1) % decoder_sparse_step == 0. Qwen3.5-MoE makes every layer sparse, which from_hf encodes
        as decoder_sparse_step = 1 and no mlp_only_layers."""
        return (i not in self.mlp_only_layers and self.num_experts > 0
                and (i + 1) % self.decoder_sparse_step == 0)


@dataclass(frozen=True)
class MTPConfig:
    """Multi-token-prediction head (``mtp.*`` tensors, used as the speculative drafter). ``num_layers``: HF key
    ``mtp_num_hidden_layers`` (else ``num_nextn_predict_layers``); 0 = none. ``in_config``: False when
    config.json names no count (Qwen3-Next releases ship ``mtp.*`` without one): the loader then counts the
    checkpoint's ``mtp.layers.{i}``. ``dedicated_embeddings``: HF ``mtp_use_dedicated_embeddings`` (True is
    not supported: every public implementation shares the target's embedding and lm head)."""
    num_layers: int = 0
    in_config: bool = True
    dedicated_embeddings: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.num_layers, int) or isinstance(self.num_layers, bool) or self.num_layers < 0:
            raise ValueError(f"MTPConfig.num_layers (mtp_num_hidden_layers) must be an int >= 0, "
                             f"got {self.num_layers!r}")


@dataclass(frozen=True)
class QuantConfig:
    """``quantization_config`` of an FP8 block checkpoint (the Qwen3.5 / Qwen3-Next FP8 releases):
    ``quant_method`` "fp8", ``fmt`` "e4m3", ``activation_scheme`` "dynamic" (activations quantized per token
    and group of 128 at run time), ``weight_block_size`` [128, 128] (``weight_scale_inv`` per block), and
    ``modules_to_not_convert``: the modules the checkpoint keeps unquantized (see ``not_converted``)."""
    quant_method: str = "fp8"
    fmt: str = "e4m3"
    activation_scheme: str = "dynamic"
    weight_block_size: tuple[int, int] = (128, 128)
    modules_to_not_convert: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.quant_method != "fp8":
            raise ValueError(f"quantization_config.quant_method = {self.quant_method!r} is not supported "
                             f"(gdnserve loads bf16 checkpoints and 'fp8' block-quantized ones)")
        if self.fmt != "e4m3":
            raise ValueError(f"quantization_config.fmt = {self.fmt!r} is not supported (only 'e4m3')")
        if self.activation_scheme != "dynamic":
            raise ValueError(f"quantization_config.activation_scheme = {self.activation_scheme!r} is not "
                             f"supported (only 'dynamic': per-token-group scales computed at run time)")
        if tuple(self.weight_block_size) != (128, 128):
            raise ValueError(f"quantization_config.weight_block_size = {list(self.weight_block_size)} is not "
                             f"supported (only [128, 128])")

    def not_converted(self, module: str) -> bool:
        """Whether ``module`` (a checkpoint module name, e.g. ``model.layers.0.mlp.gate``) is in
        ``modules_to_not_convert``. An entry matches the module itself and everything under it, compared on
        whole dotted components, with the checkpoint prefixes (``model.language_model.``, ``model.``) ignored
        on both sides; ``*`` is a wildcard within the name."""
        name = _strip_prefix(module)
        for pat in self.modules_to_not_convert:
            p = _strip_prefix(pat)
            if "*" in p:
                rx = re.escape(p).replace(r"\*", ".*")
                if re.fullmatch(rf"(.*\.)?{rx}(\..*)?", name):
                    return True
            elif name == p or name.startswith(p + ".") or name.endswith("." + p) or f".{p}." in name:
                return True
        return False


def _strip_prefix(name: str) -> str:
    for pre in ("model.language_model.", "language_model.", "model."):
        if name.startswith(pre):
            return name[len(pre):]
    return name


def _quant(raw: dict[str, Any], top: dict[str, Any]) -> QuantConfig | None:
    q = top.get("quantization_config") or raw.get("quantization_config")
    if not q:
        return None
    if not isinstance(q, Mapping):
        raise ValueError(f"quantization_config must be an object, got {type(q).__name__}")
    if "weight_block_size" not in q or q["weight_block_size"] is None:
        raise ValueError("quantization_config.weight_block_size is missing: per-tensor FP8 is not supported "
                         "(only block-quantized [128, 128] checkpoints)")
    return QuantConfig(quant_method=str(q.get("quant_method")), fmt=str(q.get("fmt", "e4m3")),
                       activation_scheme=str(q.get("activation_scheme", "dynamic")),
                       weight_block_size=tuple(q["weight_block_size"]),
                       modules_to_not_convert=tuple(q.get("modules_to_not_convert") or q.get("ignored_layers") or ()))


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model builder needs, derived once from config.json. ``norm_kind`` is the form of the
    decoder / final / q-k RMSNorms (``zero_centered``: weight stored as w, applied as x̂·(1+w), computed in
    fp32); ``gdn_norm_kind`` the GDN gated norm (``plain``: x̂·w, then · silu(z)). ``hf_model_type`` is
    the checkpoint's own model_type (a wrapper type means weights live under ``model.language_model.``).
    ``quant``: the checkpoint's FP8 block ``quantization_config`` (None: unquantized)."""
    family: Family
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[LayerType, ...]
    rms_norm_eps: float
    tie_word_embeddings: bool
    torch_dtype: str
    gdn: GDNConfig
    attn: AttnConfig
    mlp: MLPConfig
    mtp: MTPConfig = MTPConfig()
    norm_kind: Literal["zero_centered"] = "zero_centered"
    gdn_norm_kind: Literal["plain"] = "plain"
    hidden_act: str = "silu"
    hf_model_type: str = ""
    quant: QuantConfig | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        _positive("ModelConfig", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                  num_layers=self.num_layers)
        if self.family not in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
            raise ValueError(f"ModelConfig.family = {self.family!r} is not one of qwen3_next, qwen3_5, qwen3_5_moe")
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"ModelConfig.layer_types has {len(self.layer_types)} entries but num_layers "
                             f"(num_hidden_layers) = {self.num_layers}")
        bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if bad:
            raise ValueError(f"ModelConfig.layer_types has unknown entries {bad}; allowed: {list(LAYER_TYPES)}")
        if self.hidden_act != "silu":
            # both the MLP and the GDN conv use hidden_act; our kernels implement SiLU only
            raise ValueError(f"ModelConfig.hidden_act = {self.hidden_act!r}: only 'silu' is supported")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"ModelConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps}")

    def is_moe_layer(self, i: int) -> bool:
        return self.mlp.is_moe_layer(i)

    @property
    def num_linear_layers(self) -> int:
        return sum(t == "linear_attention" for t in self.layer_types)

    @classmethod
    def from_hf(cls, source: Mapping[str, Any] | str | os.PathLike[str]) -> ModelConfig:
        """Build from an HF config dict, a config.json path, or the folder holding config.json."""
        if isinstance(source, Mapping):
            raw = dict(source)
        else:
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            raw = json.loads(path.read_text())
        return _from_hf_dict(raw)


def _unsupported(model_type: Any, architectures: Any) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"unsupported model: model_type={model_type!r}, architectures={architectures!r}. gdnserve builds "
        f"model_type {sorted(TEXT_MODEL_TYPES) + sorted(WRAPPER_MODEL_TYPES)} "
        f"(architectures {sorted(ARCHITECTURES)})")


def _from_hf_dict(raw: dict[str, Any]) -> ModelConfig:
    model_type, archs = raw.get("model_type"), raw.get("architectures") or []
    if model_type is None and archs:
        model_type = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if model_type not in TEXT_MODEL_TYPES and model_type not in WRAPPER_MODEL_TYPES:
        raise _unsupported(raw.get("model_type"), archs or None)
    if archs and not any(a in ARCHITECTURES for a in archs):
        raise _unsupported(model_type, archs)
    top = raw
    if model_type in WRAPPER_MODEL_TYPES:
        raw = dict(raw.get("text_config") or {})
        inner = raw.get("model_type", WRAPPER_MODEL_TYPES[model_type])
        if inner != WRAPPER_MODEL_TYPES[model_type]:
            raise _unsupported(f"{model_type}/text_config:{inner}", archs or None)
    family = TEXT_MODEL_TYPES[WRAPPER_MODEL_TYPES.get(model_type, model_type)]
    d = dict(_DEFAULTS[family])
    d.update({k: v for k, v in raw.items() if v is not None})
    if top is not raw:
        # HF's ForConditionalGeneration ties by the wrapper's own flag (default False), not text_config's
        d["tie_word_embeddings"] = top.get("tie_word_embeddings") or False
        for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers", "mtp_use_dedicated_embeddings"):
            if key not in d and top.get(key) is not None:
                d[key] = top[key]

    num_layers = d["num_hidden_layers"]
    if raw.get("layer_types") is not None:
        layer_types = tuple(raw["layer_types"])
    else:  # HF: every full_attention_interval-th layer (1-based) is full attention
        interval = d["full_attention_interval"]
        if not isinstance(interval, int) or interval <= 0:
            raise ValueError(f"full_attention_interval must be a positive int, got {interval!r}")
        layer_types = tuple("linear_attention" if (i + 1) % interval else "full_attention"
                            for i in range(num_layers))

    head_dim = d["head_dim"]  # HF: the class default (256) when absent, never hidden // heads
    rope = _rope(d, raw)
    attn = AttnConfig(num_heads=d["num_attention_heads"], num_kv_heads=d["num_key_value_heads"], head_dim=head_dim,
                      rope_theta=float(rope.pop("rope_theta")),
                      partial_rotary_factor=float(rope["partial_rotary_factor"]),
                      rotary_dim=int(head_dim * rope.pop("partial_rotary_factor")), output_gate=True,
                      max_position_embeddings=d["max_position_embeddings"],
                      rope_scaling=None if rope == {"rope_type": "default"} else rope,
                      attention_bias=bool(d["attention_bias"]))
    gdn = GDNConfig(num_k_heads=d["linear_num_key_heads"], num_v_heads=d["linear_num_value_heads"],
                    head_k_dim=d["linear_key_head_dim"], head_v_dim=d["linear_value_head_dim"],
                    conv_kernel=d["linear_conv_kernel_dim"])
    return ModelConfig(family=family, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
                       num_layers=num_layers, layer_types=layer_types, rms_norm_eps=float(d["rms_norm_eps"]),
                       tie_word_embeddings=bool(d["tie_word_embeddings"]), torch_dtype=_dtype(raw, top),
                       gdn=gdn, attn=attn, mlp=_mlp(family, d), mtp=_mtp(d),
                       hidden_act=d["hidden_act"], hf_model_type=str(top.get("model_type", model_type)),
                       quant=_quant(raw, top))


def _mlp(family: Family, d: dict[str, Any]) -> MLPConfig:
    if family == "qwen3_5":
        return MLPConfig(intermediate_size=d["intermediate_size"])
    if family == "qwen3_5_moe":
        # HF Qwen3_5MoeDecoderLayer: every layer sparse, router always renormalises the top-k; the
        # decoder_sparse_step / mlp_only_layers / norm_topk_prob keys are ignored there, so here too.
        if not d["num_experts"]:
            raise ValueError("num_experts must be > 0 for qwen3_5_moe (every layer is a sparse MoE block)")
        return MLPConfig(intermediate_size=0, num_experts=d["num_experts"],
                         num_experts_per_tok=d["num_experts_per_tok"], moe_intermediate_size=d["moe_intermediate_size"],
                         shared_expert_intermediate_size=d["shared_expert_intermediate_size"], norm_topk_prob=True)
    return MLPConfig(intermediate_size=d["intermediate_size"], num_experts=d["num_experts"],
                     num_experts_per_tok=d["num_experts_per_tok"], moe_intermediate_size=d["moe_intermediate_size"],
                     shared_expert_intermediate_size=d["shared_expert_intermediate_size"],
                     norm_topk_prob=bool(d["norm_topk_prob"]), decoder_sparse_step=d["decoder_sparse_step"],
                     mlp_only_layers=tuple(d.get("mlp_only_layers") or ()))


def _mtp(d: dict[str, Any]) -> MTPConfig:
    n = d.get("mtp_num_hidden_layers", d.get("num_nextn_predict_layers"))
    return MTPConfig(0 if n is None else n, in_config=n is not None,
                     dedicated_embeddings=bool(d.get("mtp_use_dedicated_embeddings") or False))


def _rope(d: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    """HF's convert_rope_params_to_dict: rope_scaling (legacy) or rope_parameters, then theta and the
    partial factor from the dict, else from top-level keys, else the family default."""
    rope = copy.deepcopy(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    if isinstance(rope.get("full_attention"), dict):  # per-layer-type nesting: only attention layers rotate
        rope = rope["full_attention"]
    rope.setdefault("rope_theta", d["rope_theta"])
    rope.setdefault("partial_rotary_factor", d["partial_rotary_factor"])
    rope.setdefault("rope_type", rope.pop("type", "default"))
    return rope


def _dtype(raw: dict[str, Any], top: dict[str, Any]) -> str:
    for src in (raw, top):
        for key in ("dtype", "torch_dtype"):
            if src.get(key):
                return str(src[key]).removeprefix("torch.")
    return "float32"  # no dtype recorded: what torch builds by default
