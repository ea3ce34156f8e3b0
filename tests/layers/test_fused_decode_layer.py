"""The one-launch decode paths inside the model (GatedDeltaNet.fused_decode, GDNSERVE_FUSED_DECODE: the GDN chain;
GatedAttention.fused_qk_store, GDNSERVE_FUSED_QK_STORE: q/k norm + rotary + K/V store): on the Triton backend
(interpreted on CPU) a runner with them on gives the same logits as one with them off to fp32 rounding, over a
prefill and decode steps of two sequences (the GDN chain runs the pure decode steps, the prologue every step);
the GDN pools and the KV caches end equal to fp32 rounding."""
from __future__ import annotations

import torch

from gdnserve.layers.attention import GatedAttention
from gdnserve.layers.gdn_mixer import GatedDeltaNet
from gdnserve.ops.numerics import rel_rms
from tests.layers.test_fused_layers import DEVICE, runner_for, steps


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
    return r, mixers, attns


def test_fused_decode_equals_three_launches(monkeypatch):
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
    for a, b in zip(m_on, m_off):
        assert rel_rms(a.ssm_pool, b.ssm_pool) < 1e-5
        assert torch.equal(a.conv_pool, b.conv_pool)
        assert (a.decode_counters == 0).all()
    for a, b in zip(a_on, a_off):
        assert rel_rms(a.k_cache, b.k_cache) < 1e-5 and torch.equal(a.v_cache, b.v_cache)
