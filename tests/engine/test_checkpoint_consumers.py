"""Checkpoints through the real pool and index: a producer publishes a checkpoint in one step
(same-step consumers included), it becomes READY only after the step, and any number of later
consumers in any executor mode leave its bytes identical."""
from __future__ import annotations

import pytest
import torch

from gdnserve.engine.cache.checkpoint_index import CheckpointIndex, MissReason
from gdnserve.engine.cache.state_pool import SlotKind, StatePool, StatePoolConfig
from gdnserve.engine.execution.step_plan import IndexStager, InitFrom, PlanError, PrefillSegment, build_step_plan
from gdnserve.layers.gdn_prefill import GDNCoreParams, gdn_prefill_core
from gdnserve.layers.prefill_plan import PREFILL_MODES

H, HV, K, V, W = 2, 4, 16, 16, 4
D = 2 * H * K + HV * V


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_ready_checkpoint_bytes_survive_consumers(backend, device):
    dtype = torch.bfloat16
    pool = StatePool(StatePoolConfig(num_layers=1, num_slots=24, HV=HV, K=K, V=V, conv_dim=D, conv_width=W,
                                     conv_dtype=dtype, device=device))
    index = CheckpointIndex(pool)
    p = GDNCoreParams(conv_weight=(torch.randn(D, W, device=device) * 0.5).to(dtype),
                      A_log=torch.log(torch.empty(HV, device=device).uniform_(1, 16)),
                      dt_bias=torch.rand(HV, device=device), H=H, HV=HV, K=K, V=V)
    stager = IndexStager(2048, device)
    prefix = list(range(100, 170))
    assert index.lookup(prefix).reason is MissReason.ABSENT
    ck = index.reserve(prefix)                              # PENDING checkpoint slot for the producer
    assert index.lookup(prefix).reason is MissReason.PENDING
    runs = [pool.allocate(SlotKind.RUNNING, f"r{i}") for i in range(3)]
    step1 = [PrefillSegment(len(prefix), InitFrom.ZEROS, ck.slot, request="producer"),
             PrefillSegment(9, InitFrom.PRODUCER, runs[0], producer=0, request="r0"),
             PrefillSegment(33, InitFrom.PRODUCER, runs[1], producer=0, request="r1")]
    T = sum(s.num_tokens for s in step1)
    rnd = lambda n: (torch.randn(n, D, device=device).to(dtype), torch.randn(n, HV, device=device).to(dtype),  # noqa: E731
                     torch.randn(n, HV, device=device).to(dtype))
    x, a, b = rnd(T)
    plan = build_step_plan(step1, "fused", stager, ready={s for s in range(pool.num_slots) if not index.is_writable(s)})
    gdn_prefill_core(x, a, b, p, pool.conv(0), pool.ssm(0), plan.prefill, backend=backend)
    index.mark_ready(ck)                                    # the producing step has finished
    assert index.lookup(prefix).hit and not index.is_writable(ck.slot)
    ssm_ck, conv_ck = pool.ssm(0)[ck.slot].clone(), pool.conv(0)[ck.slot].clone()

    for mode in PREFILL_MODES:                              # later steps: consumers of the READY checkpoint
        index.acquire(ck)
        dsts = [pool.allocate(SlotKind.RUNNING, f"{mode}{i}") for i in range(5)]
        segs = [PrefillSegment(7 + 11 * i, InitFrom.CHECKPOINT, d, init_slot=ck.slot) for i, d in enumerate(dsts)]
        segs.append(PrefillSegment(20, InitFrom.OWN_SLOT, runs[2], init_slot=runs[2]))
        assert all(index.is_writable(s.dst_slot) for s in segs)
        plan = build_step_plan(segs, mode, stager, ready={s for s in range(pool.num_slots) if not index.is_writable(s)})
        T = sum(s.num_tokens for s in segs)
        x, a, b = rnd(T)
        gdn_prefill_core(x, a, b, p, pool.conv(0), pool.ssm(0), plan.prefill, backend=backend)
        assert torch.equal(pool.ssm(0)[ck.slot], ssm_ck), mode
        assert torch.equal(pool.conv(0)[ck.slot], conv_ck), mode
        index.release(ck)
        for d in dsts:
            pool.free(d)
    with pytest.raises(PlanError, match="READY checkpoint"):     # and it can never be made a destination
        build_step_plan([PrefillSegment(4, InitFrom.ZEROS, ck.slot)], "fused", stager,
                        ready={s for s in range(pool.num_slots) if not index.is_writable(s)})
    assert pool.check_integrity() == [] and index.check_integrity() == []
