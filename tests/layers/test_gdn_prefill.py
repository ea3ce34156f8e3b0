"""The four grouped-prefill executors agree bit for bit, keep READY checkpoints intact, and equal
running each request's whole token sequence (within the chunk tolerance)."""
from __future__ import annotations

import random

import pytest
import torch

from gdnserve.engine.execution.step_plan import IndexStager, InitFrom, build_step_plan
from gdnserve.layers.gdn_prefill import GDNCoreParams, gdn_prefill_core
from gdnserve.layers.prefill_plan import PREFILL_MODES
from gdnserve.ops.numerics import rel_rms
from tests.layers.scenario import random_step

H, HV, K, V, W = 2, 4, 16, 16, 4
D = 2 * H * K + HV * V
S = 40


def make_params(device, dtype):
    return GDNCoreParams(conv_weight=(torch.randn(D, W, device=device) * 0.5).to(dtype),
                         A_log=torch.log(torch.empty(HV, device=device).uniform_(1, 16)),
                         dt_bias=torch.rand(HV, device=device), H=H, HV=HV, K=K, V=V)


def pools(device, dtype):
    conv = torch.randn(S, W - 1, D, device=device).to(dtype)
    ssm = torch.randn(S, HV, V, K, device=device) * 0.3
    return conv, ssm


# the executors differ in their plans and launches, not in dtype code: the Triton kernels in bf16 (the model's
# dtype; each dtype's kernels: tests/ops), PyTorch in both
@pytest.mark.parametrize("backend,dtype", [("torch", torch.float32), ("torch", torch.bfloat16),
                                           ("triton", torch.bfloat16)])
def test_four_executors_agree(backend, dtype, device):
    rng = random.Random(torch.randint(0, 2 ** 31, ()).item())
    ready = [30, 31]
    segs = random_step(rng, S, ready, max_len=70 if backend == "torch" else 40)
    T = sum(s.num_tokens for s in segs)
    p = make_params(device, dtype)
    x = torch.randn(T, D, device=device).to(dtype)
    a = torch.randn(T, HV, device=device).to(dtype)
    b = torch.randn(T, HV, device=device).to(dtype)
    conv0, ssm0 = pools(device, dtype)
    results = {}
    stager = IndexStager(4096, device)
    for mode in PREFILL_MODES:
        plan = build_step_plan(segs, mode, stager, ready=ready)
        conv, ssm = conv0.clone(), ssm0.clone()
        o = torch.full((T, HV, V), float("nan"), dtype=dtype, device=device)
        gdn_prefill_core(x, a, b, p, conv, ssm, plan.prefill, out=o, backend=backend)
        assert torch.isfinite(o).all(), mode
        assert torch.equal(ssm[ready], ssm0[ready]) and torch.equal(conv[ready], conv0[ready]), \
            f"{mode} wrote a READY checkpoint"
        results[mode] = (o, conv, ssm)
    base = results["serial"]
    written = sorted({s.dst_slot for s in segs})
    for mode in PREFILL_MODES[1:]:
        o, conv, ssm = results[mode]
        assert torch.equal(o, base[0]), f"{mode} outputs differ from serial"
        assert torch.equal(conv[written], base[1][written]), f"{mode} conv states differ"
        assert torch.equal(ssm[written], base[2][written]), f"{mode} ssm states differ"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_consumer_equals_whole_sequence(backend, device):
    """A consumer's output and final state equal one prefill of (producer tokens ++ consumer tokens)."""
    rng = random.Random(torch.randint(0, 2 ** 31, ()).item())
    dtype = torch.float32
    segs = random_step(rng, S, [30], max_len=70, n_plain=0, n_ready_consumers=0, n_continued=0)
    T = sum(s.num_tokens for s in segs)
    p = make_params(device, dtype)
    x, a, b = torch.randn(T, D, device=device), torch.randn(T, HV, device=device), torch.randn(T, HV, device=device)
    conv, ssm = pools(device, dtype)
    stager = IndexStager(4096, device)
    plan = build_step_plan(segs, "fused", stager)
    o = gdn_prefill_core(x, a, b, p, conv, ssm, plan.prefill, backend=backend)
    start, t = {}, 0
    for i in plan.order:
        start[i] = (t, t + segs[i].num_tokens)
        t += segs[i].num_tokens
    for i, s in enumerate(segs):
        if s.init is not InitFrom.PRODUCER:
            continue
        pr = s.producer
        idx = torch.cat([torch.arange(*start[pr]), torch.arange(*start[i])]).to(device)
        Lp, Lc = segs[pr].num_tokens, s.num_tokens
        c2, s2 = pools(device, dtype)
        one = build_step_plan([type(s)(Lp + Lc, InitFrom.ZEROS, 0)], "fused", IndexStager(64, device))
        o2 = gdn_prefill_core(x[idx], a[idx], b[idx], p, c2, s2, one.prefill, backend=backend)
        assert rel_rms(o[start[i][0]:start[i][1]], o2[Lp:]) < 1e-4
        assert rel_rms(ssm[s.dst_slot], s2[0]) < 1e-4
        assert torch.equal(conv[s.dst_slot], c2[0])
