"""The one-launch decode paths inside the model (GatedDeltaNet.fused_decode, GDNSERVE_FUSED_DECODE: the GDN chain;
GatedAttention.fused_qk_store, GDNSERVE_FUSED_QK_STORE: q/k norm + rotary + K/V store; SparseMoE.fused_norm_router,
GDNSERVE_FUSED_NORM_ROUTER: the post-attention norm folded into the router GEMM at one bf16 token, switched here
too but engaged only by the block test below): on the Triton backend
(interpreted on CPU) a runner with them on gives the same logits as one with them off to fp32 rounding, over a
prefill and decode steps of two sequences (the GDN chain runs the pure decode steps, the prologue every step);
the GDN pools and the KV caches end equal to fp32 rounding.

Bit for bit only where the roundings are the same: under the CPU interpreter both paths do the same fp32 ops in
the same order (numpy: one rounding per op, no FMAs), so everything is equal. Compiled for a GPU (Triton's
enable_fp_fusion, on by default) the conv kernel's chain acc += h·w contracts into FMAs while the fused kernel
reduces its 4 products with tl.sum (fp32 model: the products are not exact, so other roundings), and every row
sum (l2 norms, St·k, St·q, the gated norm) reduces in the order of its kernel's layout and warps; so from the
first fused GDN launch on the fp32 bits differ (on the H200 the logits still agreed to 1e-5). On a GPU every
tensor a fused launch feeds is therefore held to fp32 rounding (1e-5, as the logits), and the first GDN layer's
conv history, which no fused launch feeds (copies of in_proj(norm(embedding)) rows), stays bit for bit."""
from __future__ import annotations

import torch

from gdnserve.layers.attention import GatedAttention
from gdnserve.layers.gdn_mixer import GatedDeltaNet
from gdnserve.layers.moe import SparseMoE
from gdnserve.ops.numerics import rel_rms
from tests.layers.test_fused_layers import DEVICE, runner_for, steps

EXACT = DEVICE.type == "cpu"     # the interpreter: the same ops in the same order in both paths (docstring)


def _runner(on: bool):
    r = runner_for("triton", DEVICE, True)
    mixers = [m for m in r.model.modules() if isinstance(m, GatedDeltaNet)]
    assert mixers and all(m.decode_counters is not None for m in mixers)
    for m in mixers:
        m.fused_decode = on
    attns = [m for m in r.model.modules() if isinstance(m, GatedAttention)]
    assert attns
    for m in attns:
        m.fused_qk_store = on
    for m in r.model.modules():
        if isinstance(m, SparseMoE):
            m.fused_norm_router = on
    return r, mixers, attns


def test_fused_decode_equals_three_launches(monkeypatch):
    torch.manual_seed(0)
    prompt = torch.randint(0, 512, (7,)).tolist()
    (r_on, m_on, a_on), (r_off, m_off, a_off) = _runner(True), _runner(False)
    calls, qk_calls = [], []
    import gdnserve.layers.attention as at
    import gdnserve.layers.gdn_mixer as gm
    real, real_qk = gm.gdn_decode_fused, at.qk_rope_store
    monkeypatch.setattr(gm, "gdn_decode_fused", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(at, "qk_rope_store", lambda *a, **k: qk_calls.append(1) or real_qk(*a, **k))
    on = steps(r_on, prompt, 2)
    n_on, nq_on = len(calls), len(qk_calls)
    off = steps(r_off, prompt, 2)
    assert n_on == 2 * len(m_on) and len(calls) == n_on      # every GDN layer of both decode steps, only with it on
    assert nq_on == 3 * len(a_on) and len(qk_calls) == nq_on   # every attention layer of all three steps
    for a, b in zip(on, off):
        assert rel_rms(a, b) < 1e-5
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert r_on.model.layers[0].mixer is m_on[0]           # the first layer is GDN: its input is no fused output
    for i, (a, b) in enumerate(zip(m_on, m_off)):
        assert rel_rms(a.ssm_pool, b.ssm_pool) < 1e-5
        if EXACT or i == 0:
            assert torch.equal(a.conv_pool, b.conv_pool)       # the history is copied, never computed
        else:
            assert rel_rms(a.conv_pool, b.conv_pool) < 1e-5
        # two sequences in 4 slots: the other two slots' rows stay zero (the zero rows of a printed pool)
        used = a.conv_pool.flatten(1).ne(0).any(1)
        assert int(used.sum()) == 2 and torch.equal(used, b.conv_pool.flatten(1).ne(0).any(1))
        assert (a.decode_counters == 0).all()
    for a, b in zip(a_on, a_off):
        assert rel_rms(a.k_cache, b.k_cache) < 1e-5
        # v is stored as in_proj wrote it: equal where the layer's input is (the interpreter), else fp32 rounding
        assert torch.equal(a.v_cache, b.v_cache) if EXACT else rel_rms(a.v_cache, b.v_cache) < 1e-5


def test_norm_folded_into_the_router_at_one_token(monkeypatch):
    """SparseMoE.forward_prenorm at one bf16 token on the Triton backend: with fused_norm_router the norm + router
    GEMM + routing launch, else the norm's launch and the block; the stream bit for bit, the output to bf16
    rounding, the counter back at 0."""
    from benchmarks.random_model import build_random_model, tiny_hf_config
    from gdnserve.models.qwen3_5 import HybridLM
    model: HybridLM = build_random_model(tiny_hf_config(num_layers=4, num_experts=8), DEVICE, torch.bfloat16, seed=5)
    layer = next(la for la in model.layers if isinstance(la.mlp, SparseMoE))
    moe = layer.mlp
    assert moe.shared_folded
    moe.backend = "triton"
    g = torch.Generator().manual_seed(1)
    h = torch.randn(1, moe.hidden, generator=g).to(torch.bfloat16).to(DEVICE)
    res = (2 * torch.randn(1, moe.hidden, generator=g)).to(torch.bfloat16).to(DEVICE)
    w = layer.post_attention_layernorm.weight
    # drawn on the CPU then copied (a CPU generator cannot fill a CUDA tensor): the same weights on every device
    w.data.copy_(torch.empty(w.shape, dtype=w.dtype).normal_(0, 0.2, generator=torch.Generator().manual_seed(2)))
    outs = {}
    import gdnserve.layers.moe as mo
    calls, real = [], mo.add_rms_norm_gemv_route
    monkeypatch.setattr(mo, "add_rms_norm_gemv_route", lambda *a, **k: calls.append(1) or real(*a, **k))
    for on in (False, True):
        moe.fused_norm_router = on
        outs[on] = moe.forward_prenorm(h, res, layer.post_attention_layernorm, "triton")
    assert len(calls) == 1                           # the fused launch only with the switch on
    assert int(moe._route_counter.item()) == 0
    (o0, s0), (o1, s1) = outs[False], outs[True]
    assert torch.equal(s0, s1)
    assert rel_rms(o1.float(), o0.float()) < 1e-2
