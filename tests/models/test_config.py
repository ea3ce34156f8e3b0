"""ModelConfig.from_hf against transformers itself: every field against the HF config object, and the layer
structure, head shapes, norm forms, rotary dims and MoE placement against the tiny HF model each config
builds. Also the defaults of each family, config.json folders (v5 and legacy v4 layouts), the multimodal
wrappers, unsupported architectures, validation messages, and the embedded model's two configs."""
from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
import transformers
from transformers import (Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig,
                          Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig,
                          Qwen3NextForCausalLM)

from gdnserve.models.builtin import builtin_config, builtin_hf_config_dict
from gdnserve.models.config import ModelConfig, UnsupportedModelError
from gdnserve.models.tokenizer import ByteTokenizer

HF = {"qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM), "qwen3_5": (Qwen3_5TextConfig, Qwen3_5ForCausalLM),
      "qwen3_5_moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM)}
SMALL = dict(vocab_size=97, hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             linear_key_head_dim=16, linear_value_head_dim=24)
# (family, HF kwargs): r in {1, 2, 3}, interval- and list-given layer types, dense / sparse / mixed MLPs
CASES = [
    ("qwen3_next", dict(SMALL, num_hidden_layers=5, full_attention_interval=2, linear_num_key_heads=2,
                        linear_num_value_heads=6, intermediate_size=40, num_experts=4, num_experts_per_tok=2,
                        decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=False, moe_intermediate_size=24,
                        shared_expert_intermediate_size=20, partial_rotary_factor=0.5, rope_theta=1e6,
                        tie_word_embeddings=True, mtp_num_hidden_layers=1, dtype="bfloat16")),
    ("qwen3_next", dict(SMALL, num_hidden_layers=3, layer_types=["full_attention", "linear_attention",
                        "linear_attention"], linear_num_key_heads=3, linear_num_value_heads=3, num_experts=0,
                        intermediate_size=56, linear_conv_kernel_dim=3, attention_bias=True)),
    ("qwen3_5", dict(SMALL, num_hidden_layers=6, linear_num_key_heads=2, linear_num_value_heads=4,
                     intermediate_size=72, rms_norm_eps=1e-5, mtp_num_hidden_layers=1,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                      "mrope_section": [2, 1, 1], "mrope_interleaved": True})),
    ("qwen3_5_moe", dict(SMALL, num_hidden_layers=3, layer_types=["linear_attention", "full_attention",
                         "linear_attention"], linear_num_key_heads=1, linear_num_value_heads=3, num_experts=5,
                         num_experts_per_tok=3, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                         max_position_embeddings=4096)),
]
IDS = ["next_moe_r3", "next_dense_r1", "q35_r2", "q35moe_r3"]


def _norm_kind(norm: torch.nn.Module, dim: int, gated: bool = False) -> str:
    """Classify an HF RMSNorm by what it computes on random input with a random weight."""
    x, z, w = torch.randn(5, dim), torch.randn(5, dim), torch.randn(dim)
    with torch.no_grad():
        norm.weight.copy_(w)
    eps = norm.eps if hasattr(norm, "eps") else norm.variance_epsilon
    xhat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    y = norm(x, z) if gated else norm(x)
    gate = torch.nn.functional.silu(z) if gated else 1.0
    for kind, ref in (("zero_centered", xhat * (1 + w) * gate), ("plain", xhat * w * gate)):
        if torch.allclose(y, ref, rtol=1e-5, atol=1e-6):
            return kind
    return "other"


def assert_matches_hf_model(cfg: ModelConfig, model: torch.nn.Module) -> None:
    """What the HF modeling code actually built agrees with every structural fact in ``cfg``."""
    m = model.model
    layers = list(m.layers)
    assert tuple("linear_attention" if hasattr(l, "linear_attn") else "full_attention" for l in layers) \
        == cfg.layer_types
    assert [hasattr(l.mlp, "experts") for l in layers] == [cfg.is_moe_layer(i) for i in range(cfg.num_layers)]
    assert m.embed_tokens.weight.shape == (cfg.vocab_size, cfg.hidden_size)
    tied = model.lm_head.weight.data_ptr() == m.embed_tokens.weight.data_ptr()
    assert tied == cfg.tie_word_embeddings
    assert _norm_kind(m.norm, cfg.hidden_size) == cfg.norm_kind
    g, a, mlp = cfg.gdn, cfg.attn, cfg.mlp
    for i, layer in enumerate(layers):
        assert _norm_kind(layer.input_layernorm, cfg.hidden_size) == cfg.norm_kind
        if cfg.layer_types[i] == "linear_attention":
            la = layer.linear_attn
            assert (la.num_k_heads, la.num_v_heads, la.head_k_dim, la.head_v_dim) == \
                (g.num_k_heads, g.num_v_heads, g.head_k_dim, g.head_v_dim)
            assert la.conv1d.weight.shape == (g.conv_dim, 1, g.conv_kernel) and la.conv1d.bias is None
            assert la.A_log.shape == la.dt_bias.shape == (g.num_v_heads,)
            in_rows = sum(p.shape[0] for n, p in la.named_parameters() if n.startswith("in_proj"))
            assert in_rows == g.conv_dim + g.value_dim + 2 * g.num_v_heads   # q k v | z | b a
            assert _norm_kind(la.norm, g.head_v_dim, gated=True) == cfg.gdn_norm_kind
        else:
            sa = layer.self_attn
            q_width = a.num_heads * a.head_dim * (2 if a.output_gate else 1)
            assert sa.q_proj.out_features == q_width and sa.k_proj.out_features == a.num_kv_heads * a.head_dim
            assert (sa.q_proj.bias is not None) == a.attention_bias
            assert _norm_kind(sa.q_norm, a.head_dim) == _norm_kind(sa.k_norm, a.head_dim) == cfg.norm_kind
        if cfg.is_moe_layer(i):
            assert layer.mlp.experts.gate_up_proj.shape == (mlp.num_experts, 2 * mlp.moe_intermediate_size,
                                                            cfg.hidden_size)
            assert layer.mlp.gate.top_k == mlp.num_experts_per_tok
            assert getattr(layer.mlp.gate, "norm_topk_prob", True) == mlp.norm_topk_prob
            assert layer.mlp.shared_expert.gate_proj.out_features == mlp.shared_expert_intermediate_size
        else:
            assert layer.mlp.gate_proj.out_features == mlp.intermediate_size
    inv_freq = m.rotary_emb.inv_freq
    assert 2 * inv_freq.numel() == a.rotary_dim
    ref = 1.0 / a.rope_theta ** (torch.arange(0, a.rotary_dim, 2, dtype=torch.float64) / a.rotary_dim)
    torch.testing.assert_close(inv_freq.double(), ref, rtol=1e-6, atol=0)


def assert_matches_hf_config(cfg: ModelConfig, hf) -> None:
    rope = hf.rope_parameters
    assert cfg.vocab_size == hf.vocab_size and cfg.hidden_size == hf.hidden_size
    assert cfg.num_layers == hf.num_hidden_layers and cfg.layer_types == tuple(hf.layer_types)
    assert cfg.rms_norm_eps == hf.rms_norm_eps and cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert cfg.torch_dtype == (str(hf.dtype).removeprefix("torch.") if hf.dtype is not None else "float32")
    assert dataclasses.astuple(cfg.gdn) == (hf.linear_num_key_heads, hf.linear_num_value_heads,
                                            hf.linear_key_head_dim, hf.linear_value_head_dim,
                                            hf.linear_conv_kernel_dim)
    a = cfg.attn
    assert (a.num_heads, a.num_kv_heads, a.head_dim, a.max_position_embeddings, a.attention_bias) == \
        (hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim, hf.max_position_embeddings, hf.attention_bias)
    assert (a.rope_theta, a.partial_rotary_factor) == (rope["rope_theta"], rope["partial_rotary_factor"])
    assert a.rotary_dim == int(hf.head_dim * rope["partial_rotary_factor"]) and a.output_gate
    extra = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
    assert a.rope_scaling == (None if extra == {"rope_type": "default"} else extra)
    assert cfg.mtp.num_layers == getattr(hf, "mtp_num_hidden_layers", 0)
    if cfg.family == "qwen3_5":
        assert cfg.mlp.num_experts == 0 and cfg.mlp.intermediate_size == hf.intermediate_size
    else:
        mlp = cfg.mlp
        assert (mlp.num_experts, mlp.num_experts_per_tok, mlp.moe_intermediate_size,
                mlp.shared_expert_intermediate_size) == (hf.num_experts, hf.num_experts_per_tok,
                                                         hf.moe_intermediate_size, hf.shared_expert_intermediate_size)
        if cfg.family == "qwen3_next":
            assert mlp.norm_topk_prob == hf.norm_topk_prob and mlp.intermediate_size == hf.intermediate_size
            assert (mlp.decoder_sparse_step, mlp.mlp_only_layers) == (hf.decoder_sparse_step,
                                                                      tuple(hf.mlp_only_layers))


@pytest.mark.parametrize("family,kwargs", CASES, ids=IDS)
def test_from_hf_matches_hf_config_and_model(family, kwargs):
    config_cls, model_cls = HF[family]
    hf = config_cls(**kwargs)
    cfg = ModelConfig.from_hf(hf.to_dict())
    assert cfg.family == family and cfg.hf_model_type == hf.model_type
    assert_matches_hf_config(cfg, hf)
    torch.manual_seed(random.randrange(2**31))
    assert_matches_hf_model(cfg, model_cls(hf))


@pytest.mark.parametrize("family,kwargs", CASES, ids=IDS)
def test_from_saved_folder_and_file(family, kwargs, tmp_path):
    config_cls, _ = HF[family]
    hf = config_cls(**kwargs)
    hf.save_pretrained(tmp_path)
    cfg = ModelConfig.from_hf(hf.to_dict())
    assert ModelConfig.from_hf(tmp_path) == cfg
    assert ModelConfig.from_hf(str(tmp_path / "config.json")) == cfg


@pytest.mark.parametrize("family", list(HF))
def test_defaults_are_hf_defaults(family):
    config_cls, _ = HF[family]
    cfg = ModelConfig.from_hf({"model_type": config_cls.model_type})
    assert cfg == ModelConfig.from_hf(config_cls().to_dict())
    assert_matches_hf_config(cfg, config_cls())


def test_legacy_v4_config_json_reads_like_hf():
    """Hub config.json files written by transformers 4.x: top-level rope_theta / partial_rotary_factor,
    rope_scaling null, torch_dtype, no layer_types. HF normalises them; we must read the same facts."""
    legacy = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "torch_dtype": "bfloat16",
              "rope_theta": 5e6, "partial_rotary_factor": 0.5, "rope_scaling": None, "full_attention_interval": 3,
              "num_hidden_layers": 7, "head_dim": 64, "num_attention_heads": 4, "hidden_size": 64,
              "mtp_num_hidden_layers": 1, "decoder_sparse_step": 1, "mlp_only_layers": [0]}
    cfg = ModelConfig.from_hf(legacy)
    hf = Qwen3NextConfig.from_dict(dict(legacy))
    assert cfg == ModelConfig.from_hf(hf.to_dict())
    assert_matches_hf_config(cfg, hf)
    assert cfg.layer_types == ("linear_attention", "linear_attention", "full_attention") * 2 + ("linear_attention",)
    assert (cfg.attn.rope_theta, cfg.attn.rotary_dim, cfg.torch_dtype) == (5e6, 32, "bfloat16")
    assert not cfg.is_moe_layer(0) and cfg.is_moe_layer(1)


def _wrapper_text(family: str) -> dict:
    text = dict(CASES[2][1] if family == "qwen3_5" else CASES[3][1])
    return dict(text, tie_word_embeddings=True)


@pytest.mark.parametrize("wrapper_cls,family", [(Qwen3_5Config, "qwen3_5"), (Qwen3_5MoeConfig, "qwen3_5_moe")])
def test_multimodal_wrapper_reads_text_config(wrapper_cls, family):
    text = _wrapper_text(family)
    wrapped = ModelConfig.from_hf(wrapper_cls(text_config=text).to_dict())
    plain = ModelConfig.from_hf(HF[family][0](**text).to_dict())
    # HF ties the wrapper's lm_head by the wrapper's own flag (default False), not text_config's
    assert plain.tie_word_embeddings and not wrapped.tie_word_embeddings
    assert wrapped == dataclasses.replace(plain, tie_word_embeddings=False, hf_model_type=wrapper_cls.model_type)
    assert ModelConfig.from_hf(wrapper_cls(text_config=text, tie_word_embeddings=True).to_dict()) \
        == dataclasses.replace(plain, hf_model_type=wrapper_cls.model_type)


@pytest.mark.parametrize("wrapper_tie", [False, True])
def test_wrapper_tie_rule_is_what_hf_builds(wrapper_tie):
    text = dict(_wrapper_text("qwen3_5"), num_hidden_layers=2)
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=text["hidden_size"])
    hf = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=wrapper_tie)
    model = Qwen3_5ForConditionalGeneration(hf)
    tied = model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()
    assert tied == wrapper_tie == ModelConfig.from_hf(hf.to_dict()).tie_word_embeddings


@pytest.mark.parametrize("raw,names", [
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, ["llama", "LlamaForCausalLM"]),
    ({"architectures": ["MambaForCausalLM"]}, ["MambaForCausalLM"]),
    ({"model_type": "qwen3_next", "architectures": ["Qwen3NextForSequenceClassification"]},
     ["Qwen3NextForSequenceClassification"]),
    ({"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_moe_text"}}, ["qwen3_5_moe_text"]),
    ({}, ["None"]),
])
def test_unsupported_architecture_names_it_and_lists_supported(raw, names):
    with pytest.raises(UnsupportedModelError) as err:
        ModelConfig.from_hf(raw)
    msg = str(err.value)
    for name in names + ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"]:
        assert name in msg


def test_architectures_alone_select_the_family():
    cfg = ModelConfig.from_hf({"architectures": ["Qwen3_5MoeForCausalLM"], "num_hidden_layers": 4})
    assert cfg.family == "qwen3_5_moe" and all(cfg.is_moe_layer(i) for i in range(4))


@pytest.mark.parametrize("overrides,field", [
    ({"linear_num_key_heads": 4, "linear_num_value_heads": 6}, "num_v_heads"),
    ({"linear_key_head_dim": 0}, "head_k_dim"),
    ({"linear_value_head_dim": -8}, "head_v_dim"),
    ({"head_dim": 0}, "head_dim"),
    ({"num_hidden_layers": 5, "layer_types": ["linear_attention"] * 4}, "layer_types"),
    ({"layer_types": ["linear_attention", "mamba"], "num_hidden_layers": 2}, "layer_types"),
    ({"num_attention_heads": 4, "num_key_value_heads": 3}, "num_heads"),
    ({"partial_rotary_factor": 0.1, "head_dim": 32}, "partial_rotary_factor"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({"num_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_validation_errors_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf({"model_type": "qwen3_next", **overrides})


def test_config_is_frozen_and_hashable():
    cfg = builtin_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_layers = 3
    assert hash(cfg) == hash(ModelConfig.from_hf(builtin_hf_config_dict()))


def test_builtin_config_is_its_hf_dict_and_what_hf_builds(tmp_path):
    cfg = builtin_config()
    raw = builtin_hf_config_dict()
    assert ModelConfig.from_hf(raw) == cfg
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert ModelConfig.from_hf(tmp_path) == cfg
    assert cfg.vocab_size == ByteTokenizer().vocab_size
    assert (cfg.family, cfg.hidden_size, cfg.num_layers, cfg.gdn.ratio) == ("qwen3_5", 256, 4, 2)
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    hf = Qwen3_5TextConfig.from_dict(raw)
    assert_matches_hf_config(cfg, hf)
    torch.manual_seed(random.randrange(2**31))
    assert_matches_hf_model(cfg, Qwen3_5ForCausalLM(hf))


def test_transformers_is_the_version_the_defaults_were_read_from():
    # the defaults table mirrors transformers 5.x config classes; test_defaults_are_hf_defaults pins them
    assert int(transformers.__version__.split(".")[0]) >= 5
