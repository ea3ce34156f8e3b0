"""SparseMoE against HF's Qwen3NextSparseMoeBlock / Qwen3_5MoeSparseMoeBlock (the test-only reference) on tiny
random blocks, loaded through load_moe_from_hf from both the fused and the per-expert checkpoint layouts."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gdnserve.layers.moe import SparseMoE, load_moe_from_hf  # noqa: E402
from gdnserve.ops.numerics import rel_rms  # noqa: E402

H, E, K, I, S, T = 32, 8, 2, 16, 24, 37
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def hf_block(family: str, *, top_k: int = K, shared: int = S, norm_topk_prob: bool = True) -> torch.nn.Module:
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock as Block
        cfg = Qwen3NextConfig(hidden_size=H, num_experts=E, num_experts_per_tok=top_k, moe_intermediate_size=I,
                              shared_expert_intermediate_size=shared, norm_topk_prob=norm_topk_prob)
    else:
        from transformers import Qwen3_5MoeTextConfig
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock as Block
        assert norm_topk_prob, "Qwen3.5-MoE's router always renormalises"
        cfg = Qwen3_5MoeTextConfig(hidden_size=H, num_experts=E, num_experts_per_tok=top_k,
                                   moe_intermediate_size=I, shared_expert_intermediate_size=shared)
    cfg._experts_implementation = "eager"   # HF's reference loop, not a hub/grouped-mm kernel
    block = Block(cfg).float().eval()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
        block.gate.weight.mul_(4)     # spread the router's probabilities so top-k is not a near tie
    return block


def ours(block: torch.nn.Module, sd: dict[str, torch.Tensor], dtype: torch.dtype, *,
         norm_topk_prob: bool = True) -> tuple[SparseMoE, set[str]]:
    shared = block.shared_expert.down_proj.in_features
    moe = SparseMoE(H, E, block.gate.top_k, I, shared, norm_topk_prob)
    for p in moe.parameters():
        p.data.fill_(float("nan"))    # a parameter the loader forgets to fill poisons the output
    used = load_moe_from_hf(moe, sd.__getitem__, "", dtype)
    return moe.eval(), used


def fused(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF's module state dict already holds the fused layout (as on-disk Qwen3.5-MoE checkpoints do)."""
    return dict(sd)


def per_expert(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The on-disk Qwen3-Next layout, rebuilt from the fused one (gate rows first, as HF's converter cats)."""
    out = {k: v for k, v in sd.items() if not k.startswith("experts.")}
    for e in range(E):
        gate, up = sd["experts.gate_up_proj"][e].chunk(2, dim=0)
        out[f"experts.{e}.gate_proj.weight"] = gate.clone()
        out[f"experts.{e}.up_proj.weight"] = up.clone()
        out[f"experts.{e}.down_proj.weight"] = sd["experts.down_proj"][e].clone()
    return out


CASES = [("qwen3_next", dict()), ("qwen3_next", dict(norm_topk_prob=False)), ("qwen3_next", dict(top_k=3)),
         ("qwen3_5_moe", dict()), ("qwen3_5_moe", dict(top_k=3)),
         ("qwen3_next", dict(shared=I, norm_topk_prob=False)), ("qwen3_5_moe", dict(shared=I))]   # folded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", [fused, per_expert])
@pytest.mark.parametrize("family,kw", CASES, ids=[f"{f}-{'-'.join(f'{k}={v}' for k, v in kw.items())}"
                                                  for f, kw in CASES])
def test_matches_hf(family, kw, layout, dtype):
    block = hf_block(family, **kw)
    sd = layout(block.state_dict())
    moe, used = ours(block, sd, dtype, norm_topk_prob=kw.get("norm_topk_prob", True))
    assert used == set(sd), f"not consumed: {sorted(set(sd) - used)}"
    assert moe.shared_folded == (kw.get("shared", S) == I)     # the shared expert as expert E (PyTorch path: views)
    block = block.to(dtype)
    x = torch.randn(T, H, dtype=dtype)
    with torch.no_grad():
        ref = block(x[None])[0]
        out = moe(x)
        # the routing itself must agree exactly, else a near-tie flips an expert and the check is meaningless
        hf_w, hf_idx = block.gate(x)[1:]
        w, idx = moe.route(x)
        assert torch.equal(idx, hf_idx) and torch.equal(w, hf_w)
    assert out.dtype == dtype and out.shape == (T, H)
    err = rel_rms(out, ref)
    assert err <= TOL[dtype], f"rel-RMS {err:.3g}"
    if dtype == torch.float32:   # fp64 oracle: our error is HF's, not bigger
        ref64 = block.double()(x.double()[None])[0]
        assert rel_rms(out, ref64) <= 1e-6


def test_layouts_load_identically():
    block = hf_block("qwen3_next")
    sd = block.state_dict()
    a, _ = ours(block, fused(sd), torch.float32)
    b, _ = ours(block, per_expert(sd), torch.float32)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    x = torch.randn(T, H)
    with torch.no_grad():
        assert torch.equal(a(x), b(x))


def test_without_shared_expert():
    """HF's block always has a shared expert; with size 0 it contributes exactly zero, which our block without
    one must equal. The size-0 shared tensors are then not ours to consume."""
    block = hf_block("qwen3_next", shared=0)
    sd = block.state_dict()
    moe, used = ours(block, sd, torch.float32)
    assert moe.shared_expert is None and moe.shared_expert_gate is None
    assert set(sd) - used == {"shared_expert.gate_proj.weight", "shared_expert.up_proj.weight",
                              "shared_expert.down_proj.weight", "shared_expert_gate.weight"}
    x = torch.randn(T, H)
    with torch.no_grad():
        assert rel_rms(moe(x), block(x[None])[0]) <= TOL[torch.float32]


def test_prefix_and_empty_batch():
    block = hf_block("qwen3_5_moe")
    sd = {f"model.language_model.layers.5.mlp.{k}": v for k, v in per_expert(block.state_dict()).items()}
    moe = SparseMoE(H, E, K, I, S, True)
    used = load_moe_from_hf(moe, sd.__getitem__, "model.language_model.layers.5.mlp.", torch.float32)
    assert used == set(sd)
    x = torch.randn(T, H)
    with torch.no_grad():
        assert rel_rms(moe(x), block(x[None])[0]) <= TOL[torch.float32]
        assert moe(x[:0]).shape == (0, H)
    with pytest.raises(ValueError, match=r"x: expected \[T, 32\]"):
        moe(x[None])


@pytest.mark.parametrize("layout", [fused, per_expert])
@pytest.mark.parametrize("name", ["gate.weight", "experts.3.up_proj.weight", "experts.gate_up_proj",
                                  "experts.down_proj", "experts.7.down_proj.weight", "shared_expert.up_proj.weight",
                                  "shared_expert_gate.weight"])
def test_missing_or_misshaped_tensor_is_named(layout, name):
    sd = layout(hf_block("qwen3_next").state_dict())
    if name not in sd:
        pytest.skip(f"{name} is not in the {layout.__name__} layout")
    moe = SparseMoE(H, E, K, I, S, True)
    bad = dict(sd)
    bad[name] = bad[name][..., :-1]
    with pytest.raises(ValueError, match=rf"{name}: checkpoint tensor has shape .*expected"):
        load_moe_from_hf(moe, bad.__getitem__, "", torch.float32)
    del bad[name]
    with pytest.raises(ValueError, match=rf"missing tensor {name}\b"):
        load_moe_from_hf(moe, bad.__getitem__, "", torch.float32)


def test_no_expert_layout_names_both():
    sd = {k: v for k, v in hf_block("qwen3_next").state_dict().items() if not k.startswith("experts.gate_up")}
    with pytest.raises(ValueError, match=r"missing tensor experts\.gate_up_proj .* or per-expert "
                                         r"experts\.0\.gate_proj\.weight"):
        load_moe_from_hf(SparseMoE(H, E, K, I, S, True), sd.__getitem__, "", torch.float32)
