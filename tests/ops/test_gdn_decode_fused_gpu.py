"""The one-launch GDN decode chain on a GPU at the real model's head shapes (H 16, HV 32, K = V = 128, W 4):
an eager call and a CUDA-graph replay of the same call give the same bits (outputs, both pools), a padded slot
leaves the pools bit for bit, the counters are back at 0, and the result matches today's three launches."""
from __future__ import annotations

import pytest
import torch

from gdnserve.ops.gdn.decode_fused import gdn_decode_fused, new_counters
from gdnserve.ops.numerics import rel_rms

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
H, HV, K, V, W, S = 16, 32, 128, 128, 4, 8


def inputs(B, slots):
    dev, bf = "cuda", torch.bfloat16
    D = 2 * H * K + HV * V
    return {"proj": torch.randn(B, D + HV * V + 2 * HV, device=dev).to(bf),
                "conv_weight": (0.3 * torch.randn(D, W, device=dev)).to(bf),
                "conv_pool": torch.randn(S, W - 1, D, device=dev).to(bf),
                "A_log": torch.empty(HV, device=dev).uniform_(1, 16).log(), "dt_bias": torch.rand(HV, device=dev),
                "ssm_pool": 0.3 * torch.randn(S, HV, V, K, device=dev),
                "slots": torch.tensor(slots, dtype=torch.int32, device=dev),
                "norm_weight": (1 + 0.1 * torch.randn(V, device=dev)).to(bf)}


@pytest.mark.parametrize("quant,nt", [(False, 1), (True, 1), (True, 8)])
def test_eager_equals_graph_replay_and_padding_untouched(quant, nt):
    x = inputs(3, [5, -1, 2])
    cnt = new_counters(S, H, "cuda")
    c0, s0 = x["conv_pool"].clone(), x["ssm_pool"].clone()

    def call():
        return gdn_decode_fused(x["proj"], x["conv_weight"], x["conv_pool"], x["A_log"], x["dt_bias"],
                                x["ssm_pool"], x["slots"], x["norm_weight"], 1e-6, cnt, H, quant=quant,
                                tile=(nt, 8 if nt == 1 else 2))
    out = call()                                   # eager (also the compile)
    eager = [t.clone() for t in (out[0] if quant else out, x["conv_pool"], x["ssm_pool"])]
    assert (cnt == 0).all()
    for s in (0, 1, 3, 4, 6, 7):
        assert torch.equal(x["conv_pool"][s], c0[s]) and torch.equal(x["ssm_pool"][s], s0[s])
    x["conv_pool"].copy_(c0)
    x["ssm_pool"].copy_(s0)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gout = call()
    x["conv_pool"].copy_(c0)
    x["ssm_pool"].copy_(s0)
    cnt.zero_()
    g.replay()
    torch.cuda.synchronize()
    got = [gout[0] if quant else gout, x["conv_pool"], x["ssm_pool"]]
    for a, b in zip(eager, got):
        assert torch.equal(a, b)
    assert (cnt == 0).all()
    assert (got[0][1] == 0).all()


@pytest.mark.parametrize("nt", [1, 4])
def test_matches_three_launches(nt):
    from gdnserve.ops.conv import causal_conv1d_update
    from gdnserve.ops.gdn.recurrent import gdn_decode
    from gdnserve.ops.norm import gated_rms_norm
    x = inputs(4, [1, 3, 0, 6])
    c0, s0 = x["conv_pool"].clone(), x["ssm_pool"].clone()
    y = gdn_decode_fused(x["proj"], x["conv_weight"], x["conv_pool"], x["A_log"], x["dt_bias"], x["ssm_pool"],
                         x["slots"], x["norm_weight"], 1e-6, new_counters(S, H, "cuda"), H,
                         tile=(nt, 8 if nt == 1 else 4))
    D, B = 2 * H * K + HV * V, 4
    p = x["proj"]
    c = causal_conv1d_update(p[:, :D], x["conv_weight"], c0, x["slots"], tokens_per_req=1)
    q, k, v = c[:, :H * K].view(B, H, K), c[:, H * K:2 * H * K].view(B, H, K), c[:, 2 * H * K:].view(B, HV, V)
    o = gdn_decode(q, k, v, p[:, D + HV * V + HV:], p[:, D + HV * V:D + HV * V + HV], x["A_log"], x["dt_bias"], s0,
                   x["slots"])
    yu = gated_rms_norm(o, p[:, D:D + HV * V].view(B, HV, V), x["norm_weight"], 1e-6, backend="triton")
    assert torch.equal(x["conv_pool"], c0)
    assert rel_rms(x["ssm_pool"], s0) < 1e-6
    assert rel_rms(y.float(), yu.view(B, -1).float()) < 8e-3
