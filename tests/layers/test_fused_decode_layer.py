"""The one-launch GDN decode chain inside the model (GatedDeltaNet.fused_decode, GDNSERVE_FUSED_DECODE): on the
Triton backend (interpreted on CPU) a runner with it on gives the same logits as one with it off to fp32
rounding, over a prefill and decode steps of two sequences (the fused path runs the pure decode steps, the
prefill keeps the three launches); the GDN pools end equal to fp32 rounding."""
from __future__ import annotations

import torch

from gdnserve.layers.gdn_mixer import GatedDeltaNet
from gdnserve.ops.numerics import rel_rms
from tests.layers.test_fused_layers import DEVICE, runner_for, steps


def _runner(on: bool):
    r = runner_for("triton", DEVICE, True)
    mixers = [m for m in r.model.modules() if isinstance(m, GatedDeltaNet)]
    assert mixers and all(m.decode_counters is not None for m in mixers)
    for m in mixers:
        m.fused_decode = on
    return r, mixers


def test_fused_decode_equals_three_launches(monkeypatch):
    prompt = torch.randint(0, 512, (7,)).tolist()
    (r_on, m_on), (r_off, m_off) = _runner(True), _runner(False)
    calls = []
    import gdnserve.layers.gdn_mixer as gm
    real = gm.gdn_decode_fused
    monkeypatch.setattr(gm, "gdn_decode_fused", lambda *a, **k: calls.append(1) or real(*a, **k))
    on = steps(r_on, prompt, 2)
    n_on = len(calls)
    off = steps(r_off, prompt, 2)
    assert n_on == 2 * len(m_on) and len(calls) == n_on      # every GDN layer of both decode steps, only with it on
    for a, b in zip(on, off):
        assert rel_rms(a, b) < 1e-5
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    for a, b in zip(m_on, m_off):
        assert rel_rms(a.ssm_pool, b.ssm_pool) < 1e-5
        assert torch.equal(a.conv_pool, b.conv_pool)
        assert (a.decode_counters == 0).all()
