"""The shared expert folded into the routed grouped GEMM (``SparseMoE.fold_shared``): the stacked layout and its
undo, the folded Triton block (router GEMM over E+1 rows, k+1 pairs, E+1 experts; CPU interpreter in CI)
against the unfolded block and the PyTorch path, and tensor-parallel ranks' partials summing to TP=1's."""
from __future__ import annotations

import copy

import pytest
import torch

from gdnserve.layers import moe as moe_mod
from gdnserve.layers.moe import SparseMoE, fold_shared_experts, load_moe_from_hf
from gdnserve.ops.numerics import rel_rms

pytestmark = pytest.mark.usefixtures("seed")
H, E, K, I = 36, 5, 2, 20          # odd hidden, intermediate not a tile multiple, E + 1 = 6 experts
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def random_block(dtype=torch.float32, device="cpu", renorm=True, tp_rank=0, tp_size=1) -> SparseMoE:
    moe = SparseMoE(H, E, K, I, I, renorm, tp_rank=tp_rank, tp_size=tp_size)
    moe.fold_max_tokens = 1 << 30             # the folded path at every step size
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
        moe.gate.weight.mul_(3)
    return moe.to(device=device, dtype=dtype).eval()


def clear_routing(moe64: SparseMoE, x64: torch.Tensor, margin: float = 0.1) -> torch.Tensor:
    """Rows whose top-k experts are not within ``margin`` of a tie with the next one (float64 logits of the
    unfolded block)."""
    top = (x64 @ moe64.gate.weight[:E].T).topk(K + 1, dim=-1).values
    return (top[:, K - 1] - top[:, K]) > margin


def checkpoint(moe: SparseMoE) -> dict[str, torch.Tensor]:
    """An unfolded block's weights under the HF names ``load_moe_from_hf`` reads (fused expert layout)."""
    s = moe.shared_expert
    gate, up = s.gate_up_proj.weight.chunk(2, 0)
    return {"gate.weight": moe.gate.weight, "experts.gate_up_proj": moe.experts_gate_up,
            "experts.down_proj": moe.experts_down, "shared_expert.gate_proj.weight": gate,
            "shared_expert.up_proj.weight": up, "shared_expert.down_proj.weight": s.down_proj.weight,
            "shared_expert_gate.weight": moe.shared_expert_gate.weight}


def test_layout_no_second_copy_and_unfold():
    moe = random_block()
    before = {n: p.detach().clone() for n, p in moe.named_parameters()}
    numel = sum(p.numel() for p in moe.parameters())
    assert moe.fold_shared() and moe.shared_folded and moe.fold_shared()         # idempotent
    assert moe.shared_expert is None and moe.shared_expert_gate is None
    assert moe.experts_gate_up.shape == (E + 1, 2 * I, H) and moe.experts_down.shape == (E + 1, H, I)
    assert moe.gate.weight.shape == (E + 1, H) and moe.experts_gate_up.is_contiguous()
    assert sum(p.numel() for p in moe.parameters()) == numel                     # the shared weights once
    assert torch.equal(moe.experts_gate_up[E], before["shared_expert.gate_up_proj.weight"])
    assert torch.equal(moe.experts_down[E], before["shared_expert.down_proj.weight"])
    assert torch.equal(moe.gate.weight[E:], before["shared_expert_gate.weight"])
    moe.unfold_shared()
    after = dict(moe.named_parameters())
    assert after.keys() == before.keys() and all(torch.equal(after[n], before[n]) for n in before)
    # what does not fold: another shared size, no shared expert, FP8 experts (to_fp8 unfolds first)
    assert not SparseMoE(H, E, K, I, I + 2, True).fold_shared()
    assert not SparseMoE(H, E, K, I, 0, True).fold_shared()
    assert fold_shared_experts(moe) == 1
    moe.to_fp8()
    assert not moe.shared_folded and moe.experts_gate_up.shape[0] == E and not moe.fold_shared()


def test_loader_folds_and_pytorch_path_is_bit_exact():
    """load_moe_from_hf folds a dense shared expert of the experts' size; the PyTorch path then computes it
    from views of row E with the same ops, so the block's output is the unfolded block's, bit for bit."""
    ref = random_block()
    sd = checkpoint(ref)
    moe = SparseMoE(H, E, K, I, I, True)
    used = load_moe_from_hf(moe, sd.__getitem__, "", torch.float32)
    assert used == set(sd) and moe.shared_folded
    load_moe_from_hf(moe, sd.__getitem__, "", torch.float32)                    # loading again: still fine
    x = torch.randn(13, H)
    with torch.no_grad():
        assert torch.equal(moe(x), ref(x))
        w, idx = moe.route(x)
        w0, idx0 = ref.route(x)
        assert torch.equal(idx, idx0) and torch.equal(w, w0)


@pytest.mark.parametrize("T", [1, 3, 65])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("renorm", [True, False], ids=["renorm", "no_renorm"])
def test_folded_triton_equals_unfolded(T, dtype, renorm, device):
    moe = random_block(dtype, device, renorm)
    moe.backend = "torch"
    x = torch.randn(T, H, device=device).to(dtype)
    f64 = copy.deepcopy(moe).double()       # the float64 reference of the same (unfolded) block, PyTorch ops
    with torch.no_grad():
        ref = f64(x.double())
        unfolded_torch = moe(x)
        moe.backend = "triton"
        unfolded = moe(x)
        assert moe.fold_shared()
        folded = moe(x)
        moe.fold_max_tokens = T - 1        # folded storage, the shared expert as its own MLP (views)
        split = moe(x)
    assert folded.dtype == dtype and folded.shape == (T, H)
    assert torch.equal(split, unfolded)
    if dtype == torch.float32:
        assert rel_rms(folded, unfolded) < TOL[dtype] and rel_rms(folded, unfolded_torch) < TOL[dtype]
    else:   # two bf16 paths differ by a few roundings each (~1e-2 apart): each is held to the float64 reference,
        # on the tokens whose k-th and (k+1)-th router logits are clearly apart (a near-tie may pick another expert
        # in bf16 than in float64: a different, equally valid block output, not an error of the kernels)
        # The bar is HF's own bf16 ops' spread: over 400 seeds the PyTorch path's rel-RMS to float64 had median
        # 5.0e-3 at every T, but p99 9.6e-3 / max 1.34e-2 at T = 1 (36 numbers, a noisy RMS) against max 6.5e-3
        # at T = 65 (seed 860345014 gave 1.06e-2 at T = 1 in CI for HF's ops too); few rows take gdn_kernels.md
        # §6.4's whole-layer bar of 2e-2, and T = 65 keeps 1e-2.
        keep = clear_routing(f64, x.double())
        tol = TOL[dtype] if keep.sum() > 3 else 2e-2
        for out in (folded, unfolded, unfolded_torch):
            assert rel_rms(out.double()[keep], ref[keep]) < tol


def test_default_folds_only_small_steps(monkeypatch, device):
    """By default only steps of at most FOLD_MAX_TOKENS tokens take the folded path (H200: faster at T = 1,
    slower from T = 16 on); larger ones run the shared expert as its own MLP from the folded weights."""
    seen = []
    route = moe_mod.route
    monkeypatch.setattr(moe_mod, "route", lambda *a, **kw: seen.append(kw.get("shared", False)) or route(*a, **kw))
    moe = random_block(device=device)
    moe.fold_max_tokens = moe_mod.FOLD_MAX_TOKENS
    moe.fold_shared()
    moe.backend = "triton"
    with torch.no_grad():
        for T in (moe_mod.FOLD_MAX_TOKENS, moe_mod.FOLD_MAX_TOKENS + 1):
            moe(torch.randn(T, H, device=device))
    assert seen == [True, False]


def test_tp2_partials_sum_to_tp1(monkeypatch, device):
    """Two ranks' folded blocks (loaded from one checkpoint, one all-reduce at the end: here a plain sum of
    the partials) give TP=1's output; expert E's intermediate is cut like every expert's."""
    monkeypatch.setattr(moe_mod, "all_reduce", lambda t, tp_size: t)
    sd = checkpoint(random_block())
    full = SparseMoE(H, E, K, I, I, True)
    load_moe_from_hf(full, sd.__getitem__, "", torch.float32)
    full.fold_max_tokens = 1 << 30
    x = torch.randn(7, H, device=device)
    parts = []
    for r in range(2):
        shard = SparseMoE(H, E, K, I, I, True, tp_rank=r, tp_size=2)
        load_moe_from_hf(shard, sd.__getitem__, "", torch.float32)
        shard.fold_max_tokens = 1 << 30
        assert shard.shared_folded and shard.experts_gate_up.shape == (E + 1, I, H)
        gate, up = sd["shared_expert.gate_proj.weight"], sd["shared_expert.up_proj.weight"]
        want = torch.cat([gate.chunk(2, 0)[r], up.chunk(2, 0)[r]])
        assert torch.equal(shard.experts_gate_up[E], want)
        assert torch.equal(shard.experts_down[E], sd["shared_expert.down_proj.weight"].chunk(2, 1)[r])
        shard = shard.to(device)
        shard.backend = "triton"
        with torch.no_grad():
            parts.append(shard(x))
    full = full.to(device)
    full.backend = "triton"
    with torch.no_grad():
        ref = full(x)
        unfolded = copy.deepcopy(full)
        unfolded.unfold_shared()
        ref_unfolded = unfolded(x)
    assert rel_rms(parts[0] + parts[1], ref) < TOL[torch.float32]
    assert rel_rms(ref, ref_unfolded) < TOL[torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16, 64, 300])
def test_bench_shape_folded_equals_unfolded_on_gpu(T, device):
    """The Qwen3.5-35B-A3B block (hidden 2048, 256 experts, top-8, shared 512), bf16: folded vs unfolded."""
    moe = SparseMoE(2048, 256, 8, 512, 512, True).to(device=device, dtype=torch.bfloat16)
    moe.fold_max_tokens = 1 << 30
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.02)
    x = torch.randn(T, 2048, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        unfolded = moe(x)
        moe.fold_shared()
        folded = moe(x)
    assert rel_rms(folded, unfolded) < 1e-2
