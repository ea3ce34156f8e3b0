"""Prepared launches (ops/launch.py ``Prepared``, ``prepare_decode`` / ``prepare_verify``): built once, called
with the bound tensors or with another set of activations, they equal the public ops bit for bit (same kernels,
same arguments); a call on misaligned activations (another specialisation) stays right."""
from __future__ import annotations

import pytest
import torch

from gdnserve.ops.gdn.recurrent import (GDNPending, gdn_decode, gdn_verify, prepare_decode, prepare_recurrent,
                                        prepare_verify)
from gdnserve.ops.numerics import rel_rms
from tests.ops.test_gdn_recurrent import BF16, DEV, idx, make_inputs, qkvab, rand_pool, same_bits

BACKENDS = ["torch", "triton"]


def _acts(x, B, HV, V):
    return (*qkvab(x), torch.empty(B, HV, V, dtype=BF16, device=DEV))


@pytest.mark.parametrize("backend", BACKENDS)
def test_prepared_decode_equals_public(backend):
    B, H, HV, K, V = 3, 2, 4, 16, 24
    x1, x2 = make_inputs(B, H, HV, K, V), make_inputs(B, H, HV, K, V)
    x2["A_log"], x2["dt_bias"] = x1["A_log"], x1["dt_bias"]
    pool = rand_pool(5, HV, V, K)
    slots = idx(4, -1, 1)
    p_pub, p_prep = pool.clone(), pool.clone()
    a1, a2 = _acts(x1, B, HV, V), _acts(x2, B, HV, V)
    prep = prepare_decode(*a1[:5], x1["A_log"], x1["dt_bias"], p_prep, slots, out=a1[5], backend=backend)
    assert same_bits(p_prep, pool)                       # construction launches nothing
    o1 = prep()
    o2 = prep(*a2)                                       # the next step's activations
    r1 = gdn_decode(*qkvab(x1), x1["A_log"], x1["dt_bias"], p_pub, slots, backend=backend)
    r2 = gdn_decode(*qkvab(x2), x1["A_log"], x1["dt_bias"], p_pub, slots, backend=backend)
    assert o1 is a1[5] and o2 is a2[5]
    assert same_bits(o1, r1) and same_bits(o2, r2) and same_bits(p_prep, p_pub)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["replay", "intermediate"])
def test_prepared_verify_equals_public(backend, mode):
    B, L, H, HV, K, V = 2, 3, 1, 2, 16, 16
    x = make_inputs(B * L, H, HV, K, V)
    pool = rand_pool(4, HV, V, K)
    slots = idx(3, 0)
    pend0 = [torch.randn(shape, device=DEV).to(BF16) for shape in
             ((2 * B, L, H, K), (2 * B, L, HV, V), (2 * B, L, HV), (2 * B, L, HV))]
    res = []
    for prepared in (False, True):
        new = pool.clone()
        pend = GDNPending(*(t.clone() for t in pend0))
        scratch = torch.zeros(B, L, HV, V, K, device=DEV)
        kw = (dict(pending=pend, pending_in_rows=idx(0, 1), num_pending=idx(2, 3), pending_out_rows=idx(2, 3))
              if mode == "replay" else dict(scratch=scratch, scratch_rows=idx(1, 0)))
        out = torch.empty(B * L, HV, V, dtype=BF16, device=DEV)
        args = (*qkvab(x), x["A_log"], x["dt_bias"], new, slots)
        if prepared:
            o = prepare_verify(*args, tokens_per_req=L, mode=mode, out=out, backend=backend, **kw)()
        else:
            o = gdn_verify(*args, tokens_per_req=L, mode=mode, out=out, backend=backend, **kw)
        res.append((o, new, scratch, pend))
    (o0, s0, c0, p0), (o1, s1, c1, p1) = res
    assert same_bits(o0, o1) and same_bits(s0, s1) and same_bits(c0, c1)
    for t0, t1 in zip((p0.k, p0.v, p0.a, p0.b), (p1.k, p1.v, p1.a, p1.b)):
        assert same_bits(t0, t1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prepared_rebinds_misaligned_activations(backend):
    """Activations whose pointers lose 16-byte alignment take the ordinary launch path, still right."""
    B, H, HV, K, V = 2, 1, 2, 16, 16
    x = make_inputs(B, H, HV, K, V)
    pool = rand_pool(3, HV, V, K)
    slots = idx(2, 0)
    p1, p2 = pool.clone(), pool.clone()
    prep = prepare_recurrent(*qkvab(x), x["A_log"], x["dt_bias"], p1, slots, tokens_per_req=1, backend=backend)
    buf = torch.empty(B * H * K + 1, dtype=BF16, device=DEV)
    q_odd = buf[1:].view(B, H, K)
    q_odd.copy_(x["q"])
    o = prep(q_odd, *qkvab(x)[1:], torch.empty(B, HV, V, dtype=BF16, device=DEV))
    ref = gdn_decode(*qkvab(x), x["A_log"], x["dt_bias"], p2, slots, backend=backend)
    assert rel_rms(o, ref) <= 1e-3 and rel_rms(p1, p2) <= 1e-6
