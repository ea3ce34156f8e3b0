"""FP8 block checkpoints end to end: a tiny bf16 checkpoint (transformers' own model, block-aligned sizes)
quantized here with the releases' scheme (128x128 weight blocks, ``weight_scale_inv``, the official
``modules_to_not_convert`` set: embeddings, norms, router, shared expert gate, GDN in_proj_a/b/ba, A_log,
dt_bias, conv, lm head) loads with its projections as FP8 layers, and its logits are within a stated
tolerance of the unquantized model and of a float64 evaluation of the same quantized math (transformers'
model in float64 with the dequantized weights, each FP8 layer's input rounded through the per-token-group
activation quantization). Loader errors name the tensor."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from gdnserve.engine.cache.sequence import PrefillItem
from gdnserve.engine.execution.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from gdnserve.models.loader import CheckpointError, load_model  # noqa: E402
from gdnserve.ops.moe.fp8_torch import dequantize_gate_up  # noqa: E402
from gdnserve.ops.numerics import rel_rms  # noqa: E402
from gdnserve.ops.quant import dequantize_weight, quantize_weight  # noqa: E402
from gdnserve.ops.quant.fp8_ref import qdq_act  # noqa: E402
from tests.models.test_hf_parity import _randomise  # noqa: E402

# measured on CPU (float32 model vs float64 model, both FP8; FP8 vs the bf16 original): see docs/models.md
TOL_F64 = 1e-4          # same quantized math, fp32 vs fp64 (measured 3-4e-7; a re-quantization tie can flip an e4m3 step)
TOL_QUANT = 0.15        # FP8 (weights + activations) vs the unquantized model (measured 0.06-0.09)
KEEP = ("embed_tokens", "lm_head", "norm", "mlp.gate.", "shared_expert_gate", "in_proj_a.", "in_proj_b.",
        "in_proj_ba.", "conv1d", "A_log", "dt_bias")


def tiny_qwen35_aligned(folder):
    """Qwen3.5 dense, every projection a whole number of 128-blocks except GDN b / a (4 rows: the dense tail)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    cfg = Qwen3_5TextConfig(vocab_size=97, hidden_size=256, intermediate_size=384, num_hidden_layers=4,
                            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                            num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                            linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
                            linear_conv_kernel_dim=4, tie_word_embeddings=False, rms_norm_eps=1e-6,
                            max_position_embeddings=256)
    return _save(Qwen3_5ForCausalLM(cfg), folder)


def _tiny_qwen3_next(folder, **kw):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    base = dict(vocab_size=97, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                layer_types=["linear_attention", "full_attention"], num_attention_heads=2, num_key_value_heads=1,
                head_dim=128, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=128,
                linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts_per_tok=2, decoder_sparse_step=1,
                tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=256)
    return _save(Qwen3NextForCausalLM(Qwen3NextConfig(**{**base, **kw})), folder)


def tiny_qwen3_next_moe(folder):
    """Qwen3-Next with MoE: in_proj_qkvz de-interleaved by whole blocks (K = V = 128), experts with a partial
    block (moe_intermediate 192), a shared expert of 96 (gate | up not block-aligned: loaded dequantized;
    its down_proj, one partial K block, runs FP8)."""
    return _tiny_qwen3_next(folder, num_experts=4, moe_intermediate_size=192, shared_expert_intermediate_size=96)


def tiny_qwen3_next_fold(folder):
    """Qwen3-Next with experts and shared expert of one 128-block each: every MoE layer FP8, and the shared
    expert folds into the FP8 experts as expert E (layers/moe.py)."""
    return _tiny_qwen3_next(folder, num_experts=5, moe_intermediate_size=128, shared_expert_intermediate_size=128)


def _save(model, folder):
    torch.manual_seed(0)
    model = model.float().eval()
    _randomise(model)
    with torch.no_grad():            # keep activations O(1) through the layers (random 0.2 weights grow them)
        for n, p in model.named_parameters():
            if p.dim() == 2 and "norm" not in n and "embed" not in n:
                p.mul_(0.5 / (0.2 * p.shape[1] ** 0.5))
    model.save_pretrained(folder, safe_serialization=True)
    return model


def quantize_checkpoint(src, dst, keep=KEEP):
    """The FP8 release's layout from a bf16 checkpoint: every ``*.weight`` of a quantized linear -> e4m3 +
    ``weight_scale_inv`` per 128x128 block; ``modules_to_not_convert`` lists each module left as is."""
    dst.mkdir(exist_ok=True)
    sd = load_file(str(src / "model.safetensors"))
    out, skip = {}, []
    for name, t in sd.items():
        mod = name.removesuffix(".weight")
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):      # fused on disk -> per expert
            I = t.shape[1] // 2
            for e in range(t.shape[0]):
                parts = {"gate_proj": t[e, :I], "up_proj": t[e, I:]} if "gate_up" in name else {"down_proj": t[e]}
                for p, w in parts.items():
                    m = f"{name.rsplit('.', 1)[0]}.{e}.{p}"
                    out[m + ".weight"], out[m + ".weight_scale_inv"] = quantize_weight(w)
        elif name.endswith(".weight") and t.dim() == 2 and not any(k in name + "." for k in keep):
            out[name], out[mod + ".weight_scale_inv"] = quantize_weight(t)
        else:
            out[name] = t
            if name.endswith(".weight") and "norm" not in name:
                skip.append(mod)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128], "modules_to_not_convert": sorted(skip)}
    (dst / "config.json").write_text(json.dumps(cfg))
    return out


def _qdq(x: torch.Tensor) -> torch.Tensor:
    return qdq_act(x.reshape(-1, x.shape[-1])).to(x.dtype).view(x.shape)


def float64_reference(hf_cls, src, sd, dense_fallback=()):
    """transformers' model in float64 with every quantized weight dequantized; the layers gdnserve runs as
    FP8 (all quantized ones but ``dense_fallback``) get their input quantized per token-group first; fused
    experts: the same, on the gathered rows and on the intermediate."""
    model = hf_cls.from_pretrained(src, dtype=torch.float64).eval()
    mods = dict(model.named_modules())
    with torch.no_grad():
        for name, p in model.named_parameters():
            mod = name.removesuffix(".weight")
            if mod + ".weight_scale_inv" in sd:
                p.copy_(dequantize_weight(sd[name], sd[mod + ".weight_scale_inv"], torch.float64))
                if not any(f in mod for f in dense_fallback):
                    mods[mod].register_forward_pre_hook(lambda m, args: (_qdq(args[0]),) + args[1:])
    for name, m in mods.items():
        if type(m).__name__.endswith("Experts"):
            gu, dn = (torch.stack([sd[f"{name}.{e}.{p}.weight"] for e in range(m.num_experts)]) for p in ("gate_up", "down"))
            sgu, sdn = (torch.stack([sd[f"{name}.{e}.{p}.weight_scale_inv"] for e in range(m.num_experts)])
                        for p in ("gate_up", "down"))
            m.gate_up_proj.data, m.down_proj.data = dequantize_gate_up(gu, sgu, torch.float64), \
                dequantize_weight(dn, sdn, torch.float64)
            m.forward = _fp8_experts_forward.__get__(m)
    return model


def _fp8_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    out = torch.zeros_like(hidden_states)
    I = self.down_proj.shape[2]
    for t in range(hidden_states.shape[0]):
        for j in range(top_k_index.shape[1]):
            e = int(top_k_index[t, j])
            h = self.gate_up_proj[e] @ _qdq(hidden_states[t:t + 1])[0]
            h = torch.nn.functional.silu(h[:I]) * h[I:]
            out[t] += top_k_weights[t, j] * (self.down_proj[e] @ _qdq(h[None])[0])
    return out


def _logits(model, ids):
    runner = ModelRunner(model, RunnerConfig(backend="torch", page_size=8))
    seq = runner.new_seq()
    rows = [runner.step([PrefillItem(seq, ids[:-3])], [])[0]]
    for t in ids[-3:]:
        rows.append(runner.step([], [(seq, t)])[0])
    return torch.stack(rows)


def tiny_qwen3_next_fold_tp(folder):
    """As tiny_qwen3_next_fold with two 128-blocks per expert: at TP = 2 each rank keeps one of each, FP8, folded."""
    return _tiny_qwen3_next(folder, num_experts=4, moe_intermediate_size=256, shared_expert_intermediate_size=256,
                            num_key_value_heads=2)


FAMILIES = {"qwen3_5": tiny_qwen35_aligned, "qwen3_next_moe": tiny_qwen3_next_moe,
            "qwen3_next_fold": tiny_qwen3_next_fold}
EXTRA = {"qwen3_next_fold_tp": tiny_qwen3_next_fold_tp}        # built only by the tests that ask for them


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (folder with bf16/ and fp8/, the HF model, the quantized state dict), built once per module."""
    made = {}

    def get(family):
        if family not in made:
            root = tmp_path_factory.mktemp(family)
            hf = {**FAMILIES, **EXTRA}[family](root / "bf16")
            made[family] = (root, hf, quantize_checkpoint(root / "bf16", root / "fp8"))
        return made[family]
    return get
FALLBACK = {"qwen3_5": (), "qwen3_next_moe": ("shared_expert.gate_proj", "shared_expert.up_proj"),  # dequantized
            "qwen3_next_fold": ()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fp8_checkpoint_logits(checkpoints, family):
    tmp_path, hf, sd = checkpoints(family)
    fp8, cfg = load_model(tmp_path / "fp8", dtype=torch.float32)
    assert cfg.quant is not None and cfg.quant.weight_block_size == (128, 128)
    fp8_layers = {n.removesuffix(".qweight") for n, p in fp8.named_parameters() if p.dtype == torch.float8_e4m3fn}
    if family == "qwen3_5":
        assert {"layers.0.mixer.in_proj", "layers.0.mixer.out_proj", "layers.2.mixer.qkv_proj",
                "layers.2.mixer.o_proj", "layers.0.mlp.gate_up_proj", "layers.3.mlp.down_proj"} <= fp8_layers
        tail = fp8.layers[0].mixer.in_proj.weight                     # b | a stay dense
        assert tail.shape == (8, 256) and tail.dtype == torch.float32
    elif family == "qwen3_next_fold":       # the FP8 shared expert folded: expert E of the FP8 experts
        assert all(fp8.layers[i].mlp.shared_folded and fp8.layers[i].mlp.experts_gate_up.shape[0] == 6
                   and fp8.layers[i].mlp.experts_scales[0].shape[0] == 6 for i in (0, 1))
        assert fp8.fp8_dequantized == []
    else:
        assert {"layers.0.mixer.in_proj", "layers.1.mlp.experts_gate_up", "layers.1.mlp.experts_down"} <= fp8_layers
        assert fp8.layers[0].mlp.shared_expert.gate_up_proj.qweight is None      # 96 rows: dequantized
        assert fp8.fp8_dequantized == [f"model.layers.{i}.mlp.shared_expert.{p}" for i in (0, 1)
                                       for p in ("gate_proj", "up_proj")]
    ref64 = float64_reference(type(hf), tmp_path / "bf16", _per_expert_view(sd), FALLBACK[family])
    dense, _ = load_model(tmp_path / "bf16", dtype=torch.float32)
    ids = torch.randint(0, 97, (29,)).tolist()
    with torch.no_grad():
        got, want = _logits(fp8, ids), _logits(dense, ids)
        want64 = ref64(torch.tensor([ids])).logits[0, -4:]
    e64, eq = rel_rms(got, want64), rel_rms(got, want)
    print(f"{family}: FP8 vs float64 of the same math {e64:.2e}, FP8 vs unquantized {eq:.2e}")
    assert e64 < TOL_F64 and eq < TOL_QUANT


def _per_expert_view(sd):
    """The quantized state dict with expert gate/up pairs re-fused as HF's experts module holds them."""
    out = dict(sd)
    for n in [n for n in sd if n.endswith(".gate_proj.weight") and ".experts." in n]:
        m = n.removesuffix(".gate_proj.weight")
        up = m + ".up_proj"
        out[m + ".gate_up.weight"] = torch.cat([sd[n], sd[up + ".weight"]])
        out[m + ".gate_up.weight_scale_inv"] = torch.cat([sd[m + ".gate_proj.weight_scale_inv"],
                                                          sd[up + ".weight_scale_inv"]])
        out[m + ".down.weight"] = sd[m + ".down_proj.weight"]
        out[m + ".down.weight_scale_inv"] = sd[m + ".down_proj.weight_scale_inv"]
    return out


def test_fp8_loader_errors_name_the_tensor(checkpoints, tmp_path):
    import shutil
    root, _, good = checkpoints("qwen3_5")
    dst = tmp_path / "fp8"
    shutil.copytree(root / "fp8", dst)

    def broken(fn):
        sd = dict(good)
        fn(sd)
        save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    broken(lambda sd: sd.pop("model.layers.2.self_attn.o_proj.weight_scale_inv"))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.2\.self_attn\.o_proj\.weight_scale_inv"):
        load_model(dst)
    broken(lambda sd: sd.__setitem__("model.layers.0.mlp.down_proj.weight_scale_inv", torch.ones(3, 3)))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.down_proj\.weight_scale_inv: shape \[3, 3\], "
                                              r"expected \[2, 3\]"):
        load_model(dst)
    broken(lambda sd: sd.__setitem__("model.layers.0.linear_attn.in_proj_z.weight",
                                     sd["model.layers.0.linear_attn.in_proj_z.weight"].float()))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.linear_attn\.in_proj_z\.weight is float32, "
                                              r"expected float8_e4m3fn"):
        load_model(dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value, msg in [("quant_method", "awq", "quant_method = 'awq' is not supported"),
                            ("fmt", "e5m2", "fmt = 'e5m2' is not supported"),
                            ("weight_block_size", [64, 64], r"weight_block_size = \[64, 64\] is not supported")]:
        bad = dict(cfg, quantization_config=dict(cfg["quantization_config"], **{key: value}))
        (dst / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=msg):
            load_model(dst)


def test_fp8_tensor_parallel_shards(checkpoints):
    """Under TP each rank keeps its columns of a row-parallel FP8 layer (whole K blocks, their scales); a
    column layer whose per-rank blocks are not whole 128-blocks (here q / k at 64 rows per rank) loads
    dequantized on every rank, not wrongly sharded."""
    tmp_path = checkpoints("qwen3_5")[0]
    full, _ = load_model(tmp_path / "fp8", dtype=torch.float32)
    for r in range(2):
        shard, _ = load_model(tmp_path / "fp8", dtype=torch.float32, tp_rank=r, tp_size=2)
        o, o_full = shard.layers[2].mixer.o_proj, full.layers[2].mixer.o_proj
        assert o.qweight is not None and o.qweight.shape == (256, 128)
        assert torch.equal(o.qweight.float(), o_full.qweight[:, 128 * r:128 * (r + 1)].float())
        assert torch.equal(o.weight_scale_inv, o_full.weight_scale_inv[:, r:r + 1])
        assert shard.layers[2].mixer.qkv_proj.qweight is None            # dense fallback


def test_fp8_fold_tensor_parallel(checkpoints, monkeypatch):
    """At TP = 2 each rank folds its shard of the FP8 shared expert (its gate and up block, its down K block, their
    scales) as expert E, and the two ranks' block outputs (the all-reduce replaced by a sum) give TP = 1's. (This
    checkpoint also found that a fused FP8 layer with no dense tail — qkv_proj here — failed to load at TP = 2.)"""
    from gdnserve.layers import moe as moe_mod
    monkeypatch.setattr(moe_mod, "all_reduce", lambda t, tp_size: t)
    tmp_path = checkpoints("qwen3_next_fold_tp")[0]
    full, _ = load_model(tmp_path / "fp8", dtype=torch.float32)
    E = 4
    x = torch.randn(5, 128)
    parts = []
    for r in range(2):
        shard, _ = load_model(tmp_path / "fp8", dtype=torch.float32, tp_rank=r, tp_size=2)
        qkv = shard.layers[1].mixer.qkv_proj          # all FP8 at 256 / 128 rows per rank: an empty dense tail
        assert qkv.qweight is not None and qkv.weight.shape[0] == 0
        m, mf = shard.layers[0].mlp, full.layers[0].mlp
        assert m.shared_folded and mf.shared_folded and m.experts_gate_up.shape == (E + 1, 256, 128)
        want = torch.cat([mf.experts_gate_up[E, 128 * r:128 * (r + 1)], mf.experts_gate_up[E, 256 + 128 * r:256 + 128 * (r + 1)]])
        assert torch.equal(m.experts_gate_up[E].view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(m.experts_scales[0][E], mf.experts_scales[0][E][[r, 2 + r]])
        assert torch.equal(m.experts_scales[1][E], mf.experts_scales[1][E][:, r:r + 1])
        with torch.no_grad():
            parts.append(m(x))
    with torch.no_grad():
        assert rel_rms(parts[0] + parts[1], full.layers[0].mlp(x)) < 1e-5


def test_an_fp8_checkpoint_loads_into_a_model_folded_while_dense(checkpoints):
    """load_weights into a model whose dense shared experts are already folded (a random model's layout) from an FP8
    checkpoint: the experts turn FP8 first, which unfolds the shared expert, so it is made FP8 and folded again
    (review finding: it loaded dequantized and unfolded), with the logits of load_model's."""
    from gdnserve.layers.moe import fold_shared_experts
    from gdnserve.models.loader import checkpoint_tensors, load_weights
    from gdnserve.models.qwen3_5 import HybridLM
    root, _, _ = checkpoints("qwen3_next_fold")
    ref, cfg = load_model(root / "fp8", dtype=torch.float32)
    with torch.device("meta"):
        m = HybridLM(cfg).to(torch.float32)
    m = m.to_empty(device="cpu")
    fold_shared_experts(m)
    load_weights(m, cfg, checkpoint_tensors(root / "fp8"), torch.float32)
    for attn in m.attention_layers():               # non-persistent buffers (load_model resets them too)
        attn.rotary.reset_buffers()
    assert all(x.shared_folded for x in m.modules() if hasattr(x, "shared_folded")) and m.fp8_dequantized == []
    ids = torch.randint(0, 97, (11,)).tolist()
    with torch.no_grad():
        assert torch.equal(_logits(m.eval(), ids), _logits(ref, ids))
