"""The attention prologue as one launch (ops/attention/qk_rope_store): q/k RMSNorm + partial rotary and the K/V
store against the three launches it replaces (rms_norm_rope on q and k, store_kv; the same bits on the CPU
interpreter) and a float64 reference; strided views of one projection row as in the model, grouped KV heads,
B = 1 and 3 with a padded slot (-1: its cache slot untouched), untouched slots bit for bit."""
from __future__ import annotations

import pytest
import torch

from gdnserve.ops.attention import store_kv
from gdnserve.ops.attention.qk_rope_store import qk_rope_store
from gdnserve.ops.attention.rope import rms_norm_rope
from gdnserve.ops.numerics import rel_rms

BF16 = torch.bfloat16
QH, KVH, Dh, HALF, PAGES, PS = 4, 2, 32, 8, 3, 4
EXACT = not torch.cuda.is_available()
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make(T, slots, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)
    row = r(T, 2 * QH * Dh + 2 * KVH * Dh + 3).to(BF16)                 # one projection row per token
    qg = row[:, :2 * QH * Dh].view(T, QH, 2 * Dh)
    k = row[:, 2 * QH * Dh:2 * QH * Dh + KVH * Dh].view(T, KVH, Dh)
    v = row[:, 2 * QH * Dh + KVH * Dh:2 * QH * Dh + 2 * KVH * Dh].view(T, KVH, Dh)
    x = {"q": qg[..., :Dh], "k": k, "v": v, "wq": (0.2 * r(Dh)).to(BF16), "wk": (0.2 * r(Dh)).to(BF16),
         "positions": torch.randint(0, 5000, (T,), generator=g),
         "inv_freq": 1.0 / (10000 ** (torch.arange(0, 2 * HALF, 2).float() / (2 * HALF))),
         "kc": r(PAGES, PS, KVH, Dh).to(BF16), "vc": r(PAGES, PS, KVH, Dh).to(BF16),
         "slots": torch.tensor(slots, dtype=torch.int64)}
    return {n: t.to(DEV) for n, t in x.items()}


def ref64(x):
    """float64 norm + rotary (no intermediate roundings) of q and k."""
    def one(t, w):
        t = t.double()
        y = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w.double())
        a = x["positions"].double()[:, None] * x["inv_freq"].double()[None, :]
        c, s = a.cos()[:, None, :], a.sin()[:, None, :]
        lo, hi = y[..., :HALF], y[..., HALF:2 * HALF]
        return torch.cat([lo * c - hi * s, hi * c + lo * s, y[..., 2 * HALF:]], -1)
    return one(x["q"], x["wq"]), one(x["k"], x["wk"])


@pytest.mark.parametrize("T,slots", [(1, [5]), (3, [7, -1, 0])])
def test_one_launch_equals_three_and_float64(T, slots):
    x = make(T, slots, seed=T)
    kc, vc = x["kc"].clone(), x["vc"].clone()
    q = qk_rope_store(x["q"], x["k"], x["v"], x["wq"], x["wk"], 1e-6, x["positions"], x["inv_freq"], kc, vc,
                      x["slots"])
    assert q.is_contiguous() and q.shape == (T, QH, Dh)
    # the three launches
    kc3, vc3 = x["kc"].clone(), x["vc"].clone()
    q3 = rms_norm_rope(x["q"], x["wq"], 1e-6, x["positions"], x["inv_freq"], backend="triton")
    k3 = rms_norm_rope(x["k"], x["wk"], 1e-6, x["positions"], x["inv_freq"], backend="triton")
    store_kv(k3, x["v"], kc3, vc3, x["slots"], backend="triton")
    if EXACT:
        assert torch.equal(q, q3) and torch.equal(kc, kc3) and torch.equal(vc, vc3)
    else:
        assert rel_rms(q.float(), q3.float()) < 4e-3 and rel_rms(kc.float(), kc3.float()) < 4e-3
        assert torch.equal(vc, vc3)
    qr, kr = ref64(x)
    assert rel_rms(q.double(), qr) < 8e-3
    live = [(n, s) for n, s in enumerate(slots) if s >= 0]
    for n, s in live:
        got = kc.view(-1, KVH, Dh)[s].double()
        assert rel_rms(got, kr[n]) < 8e-3
        assert torch.equal(vc.view(-1, KVH, Dh)[s], x["v"][n])
    untouched = [s for s in range(PAGES * PS) if s not in slots]
    assert torch.equal(kc.view(-1, KVH, Dh)[untouched], x["kc"].view(-1, KVH, Dh)[untouched])
    assert torch.equal(vc.view(-1, KVH, Dh)[untouched], x["vc"].view(-1, KVH, Dh)[untouched])


def test_rejects_a_slot_mapping_of_another_length():
    x = make(2, [1, 2], seed=0)
    with pytest.raises(ValueError, match="slot_mapping"):
        qk_rope_store(x["q"], x["k"], x["v"], x["wq"], x["wk"], 1e-6, x["positions"], x["inv_freq"], x["kc"],
                      x["vc"], x["slots"][:1])
