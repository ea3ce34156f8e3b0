"""The one-launch GDN decode chain (ops/gdn/decode_fused) against a float64 reference that rounds where the
kernels round (conv output and recurrent output to the activation dtype), and against today's three-launch
chain (conv update + recurrent decode + gated norm). Fresh random inputs and non-zero pools every run, grouped
value heads (r = 2) and r = 1, B = 1 and B = 3 with a padded slot; untouched slots bit for bit; the arrival
counters back at 0 after every launch (a graph replay finds them so). The inputs are drawn on the CPU (the same
values on every device) and the kernels run on the ``device`` fixture's device (the interpreter on the CPU); the
float64 reference runs on the CPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gdnserve.ops.conv import causal_conv1d_update
from gdnserve.ops.gdn.decode_fused import gdn_decode_fused, new_counters
from gdnserve.ops.gdn.recurrent import gdn_decode
from gdnserve.ops.norm import gated_rms_norm
from gdnserve.ops.numerics import rel_rms

BF16, F64 = torch.bfloat16, torch.float64
EPS = 1e-6
S, W = 6, 4


def make(B, H, HV, K, V, slots, seed, device):
    """Drawn by a CPU generator (the same values on every device), then moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    D = 2 * H * K + HV * V
    r = lambda *s: torch.randn(*s, generator=g)
    wide = r(B, D + HV * V + 2 * HV + 5).to(BF16).to(device)
    x = {"conv_weight": (0.5 * r(D, W)).to(BF16), "conv_pool": r(S, W - 1, D).to(BF16),
         "A_log": (1 + 15 * torch.rand(HV, generator=g)).log(), "dt_bias": 0.5 * r(HV),
         "ssm_pool": 0.3 * r(S, HV, V, K), "slots": torch.tensor(slots, dtype=torch.int32),
         "norm_weight": (1 + 0.2 * r(V)).to(BF16)}
    # proj sliced after the cast and the move: a strided row view, as in_proj's (.to() would make it contiguous)
    return {"proj": wide[:, :D + HV * V + 2 * HV], **{n: t.to(device) for n, t in x.items()}}


def rnd(x, dt):
    return x.to(dt).to(F64)


def reference(x, H, scale=None):
    """float64 of the chain on the CPU, rounding to bf16 where the kernels do; returns (y, conv_pool, ssm_pool)."""
    x = {n: t.cpu() for n, t in x.items()}
    cp, sp = x["conv_pool"].to(F64).clone(), x["ssm_pool"].to(F64).clone()
    proj, w = x["proj"].to(F64), x["conv_weight"].to(F64)
    _, HV, V, K = sp.shape
    D, r = 2 * H * K + HV * V, HV // H
    scale = K ** -0.5 if scale is None else scale
    y = torch.zeros(proj.shape[0], HV * V, dtype=F64)
    for n, s in enumerate(x["slots"].tolist()):
        if s < 0:
            continue
        win = torch.cat([cp[s], proj[n, None, :D]], 0)                      # [W, D]
        c = rnd(F.silu((win * w.T).sum(0)), BF16)
        cp[s] = win[1:]
        q, k, v = c[:H * K].view(H, K), c[H * K:2 * H * K].view(H, K), c[2 * H * K:].view(HV, V)
        z = proj[n, D:D + HV * V].view(HV, V)
        b, a = proj[n, D + HV * V:D + HV * V + HV], proj[n, D + HV * V + HV:]
        for j in range(HV):
            i = j // r
            g = -x["A_log"][j].double().exp() * F.softplus(a[j] + x["dt_bias"][j].double())
            beta = torch.sigmoid(b[j])
            kn, qn = k[i] / k[i].norm(), q[i] / q[i].norm() * scale
            St = sp[s, j] * g.exp()
            St = St + beta * (v[j] - St @ kn)[:, None] * kn[None, :]
            sp[s, j] = St
            o = rnd(St @ qn, BF16)
            nrm = rnd(o / (o.pow(2).mean() + EPS).sqrt(), BF16)
            y[n, j * V:(j + 1) * V] = rnd(x["norm_weight"].double() * nrm, BF16) * F.silu(z[j])
    return y, cp, sp


def run_fused(x, H, quant=False, nt=1):
    """nt: V tiles per head (> 1: the gated norm by the key head's last arrival)."""
    cp, sp = x["conv_pool"].clone(), x["ssm_pool"].clone()
    cnt = new_counters(S, H, x["ssm_pool"].device)
    out = gdn_decode_fused(x["proj"], x["conv_weight"], cp, x["A_log"], x["dt_bias"], sp, x["slots"],
                           x["norm_weight"], EPS, cnt, H, quant=quant, tile=(nt, 2))
    assert (cnt == 0).all(), "counters must be left at 0"
    return out, cp, sp


def run_unfused(x, H):
    """Today's three launches on the Triton backend."""
    cp, sp = x["conv_pool"].clone(), x["ssm_pool"].clone()
    _, HV, V, K = sp.shape
    D = 2 * H * K + HV * V
    p = x["proj"]
    c = causal_conv1d_update(p[:, :D], x["conv_weight"], cp, x["slots"], tokens_per_req=1, backend="triton")
    B = p.shape[0]
    q, k, v = c[:, :H * K].view(B, H, K), c[:, H * K:2 * H * K].view(B, H, K), c[:, 2 * H * K:].view(B, HV, V)
    o = gdn_decode(q, k, v, p[:, D + HV * V + HV:], p[:, D + HV * V:D + HV * V + HV], x["A_log"], x["dt_bias"], sp,
                   x["slots"], backend="triton")
    y = gated_rms_norm(o, p[:, D:D + HV * V].view(B, HV, V), x["norm_weight"], EPS, backend="triton")
    return y.view(B, HV * V), cp, sp


def check(x, H, y, cp, sp):
    yr, cpr, spr = reference(x, H)
    x = {n: t.cpu() for n, t in x.items()}
    y, cp, sp = y.cpu(), cp.cpu(), sp.cpu()
    live = [n for n, s in enumerate(x["slots"].tolist()) if s >= 0]
    dead = [s for s in range(S) if s not in x["slots"].tolist()]
    assert rel_rms(y[live].double(), yr[live]) < 8e-3
    assert (y[[n for n in range(y.shape[0]) if n not in live]] == 0).all()
    used = sorted(s for s in x["slots"].tolist() if s >= 0)
    assert rel_rms(sp[used].double(), spr[used]) < 1e-5
    assert torch.equal(cp[used].double(), cpr[used])   # the history is copied, never computed
    assert torch.equal(sp[dead], x["ssm_pool"][dead]) and torch.equal(cp[dead], x["conv_pool"][dead])


@pytest.mark.parametrize("B,slots,nt", [(1, [4], 1), (3, [2, -1, 5], 1), (3, [-1, 0, 5], 2)])
def test_grouped_heads_vs_float64(B, slots, nt, device):
    H, HV, K, V = 2, 4, 16, 16
    x = make(B, H, HV, K, V, slots, seed=B + nt, device=device)
    y, cp, sp = run_fused(x, H, nt=nt)
    check(x, H, y, cp, sp)
    yu, cpu_, spu = run_unfused(x, H)          # today's chain: same roundings, other sum orders
    assert torch.equal(cp, cpu_)
    assert rel_rms(sp, spu) < 1e-6 and rel_rms(y.float(), yu.float()) < 8e-3


@pytest.mark.parametrize("nt", [1, 4])
def test_one_value_head_per_key_head_twice_in_a_row(nt, device):
    """r = 1 (no counter with one V tile; the V-split's last arrival with 4) and a second step on the state the
    first left: the history shift and state chain."""
    H, HV, K, V = 2, 2, 16, 32
    x = make(3, H, HV, K, V, [1, 3, -1], seed=7, device=device)
    y, cp, sp = run_fused(x, H, nt=nt)
    check(x, H, y, cp, sp)
    x2 = dict(x, conv_pool=cp, ssm_pool=sp, proj=make(3, H, HV, K, V, [1, 3, -1], seed=8, device=device)["proj"])
    y2, cp2, sp2 = run_fused(x2, H, nt=nt)
    check(x2, H, y2, cp2, sp2)


@pytest.mark.parametrize("nt", [1, 8])
def test_quantized_output_for_fp8_out_proj(nt, device):
    from gdnserve.ops.quant.quant_out import quantize_out_torch
    H, HV, K, V = 1, 2, 16, 128
    x = make(3, H, HV, K, V, [0, -1, 3], seed=11, device=device)
    (y, (q, s)), cp, sp = run_fused(x, H, quant=True, nt=nt)
    check(x, H, y, cp, sp)
    qr, sr = quantize_out_torch(y)
    assert torch.equal(q.float(), qr.float()) and torch.equal(s, sr)


def test_rejects_bad_shapes(device):
    x = make(1, 2, 4, 16, 16, [0], seed=1, device=device)
    with pytest.raises(ValueError, match="H"):
        gdn_decode_fused(x["proj"], x["conv_weight"], x["conv_pool"], x["A_log"], x["dt_bias"], x["ssm_pool"],
                         x["slots"], x["norm_weight"], EPS, new_counters(S, 3, device), 3)
    with pytest.raises(ValueError, match="quant"):
        gdn_decode_fused(x["proj"], x["conv_weight"], x["conv_pool"], x["A_log"], x["dt_bias"], x["ssm_pool"],
                         x["slots"], x["norm_weight"], EPS, new_counters(S, 2, device), 2, quant=True)
