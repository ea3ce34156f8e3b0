"""Property tests of the step-plan builder (hypothesis): random groups, lengths and slot
assignments, every mode."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gdnserve.engine.execution.step_plan import (
    IndexStager,
    InitFrom,
    PlanError,
    PrefillSegment,
    build_step_plan,
    fused_slots,
)
from gdnserve.layers.prefill_plan import PREFILL_MODES

NUM_SLOTS = 64


@st.composite
def steps(draw):
    slots = draw(st.permutations(list(range(NUM_SLOTS))))
    it = iter(slots)
    ready = [next(it) for _ in range(draw(st.integers(0, 3)))]
    segs: list[PrefillSegment] = []
    for _ in range(draw(st.integers(0, 3))):             # producers and their consumers
        segs.append(PrefillSegment(draw(st.integers(0, 200)), InitFrom.ZEROS, next(it)))
        pi = len(segs) - 1
        if ready and draw(st.booleans()):                  # a producer extending a READY checkpoint
            segs[pi].init, segs[pi].init_slot = InitFrom.CHECKPOINT, draw(st.sampled_from(ready))
        for _ in range(draw(st.integers(1, 4))):
            segs.append(PrefillSegment(draw(st.integers(0, 130)), InitFrom.PRODUCER, next(it), producer=pi))
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from([InitFrom.ZEROS, InitFrom.OWN_SLOT] + ([InitFrom.CHECKPOINT] if ready else [])))
        dst = next(it)
        init_slot = dst if kind is InitFrom.OWN_SLOT else (draw(st.sampled_from(ready)) if kind is InitFrom.CHECKPOINT else -1)
        segs.append(PrefillSegment(draw(st.integers(0, 150)), kind, dst, init_slot=init_slot))
    perm = draw(st.permutations(list(range(len(segs)))))
    remap = {old: new for new, old in enumerate(perm)}
    out = [segs[old] for old in perm]
    for s in out:
        if s.init is InitFrom.PRODUCER:
            s.producer = remap[s.producer]
    return out, set(ready), draw(st.sampled_from(PREFILL_MODES))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps())
def test_plan_invariants(case):
    segs, ready, mode = case
    if not segs:
        return
    stager = IndexStager(1 << 14, "cpu")
    uploads = []
    real = stager.upload
    stager.upload = lambda vals: uploads.append(len(vals)) or real(vals)
    plan = build_step_plan(segs, mode, stager, ready=ready)
    assert uploads == [plan.host_ints], "exactly one host-to-device copy per step"
    pf = plan.prefill
    T = sum(s.num_tokens for s in segs)
    assert sorted(plan.order) == list(range(len(segs)))
    # the groups' token ranges partition [0, T) in order, and each group's lengths add up
    t = 0
    for g in pf.groups:
        assert g.t0 == t and g.t1 >= g.t0
        assert g.meta.num_tokens == g.t1 - g.t0 == int(g.meta.cu_seqlens[-1])
        t = g.t1
    assert t == T == pf.num_tokens
    written: list[int] = []
    for g in pf.groups:
        dst = g.dst.tolist()
        assert not any(d in ready for d in dst), "a READY checkpoint is a destination"
        written += [d for d in dst if d >= 0]
    assert len(written) == len(set(written)), "a slot is written twice in the step"
    # every consumer's source is a same-step producer's destination or a READY checkpoint
    producer_dsts = {segs[s.producer].dst_slot for s in segs if s.init is InitFrom.PRODUCER}
    ref = plan.reference
    for src in ref.consumer_shared_state_sources.tolist():
        assert src in ready or src in producer_dsts
    n_cons = sum(s.init in (InitFrom.CHECKPOINT, InitFrom.PRODUCER) for i, s in enumerate(segs)
                 if i not in {x.producer for x in segs if x.init is InitFrom.PRODUCER})
    assert ref.consumer_ranges.shape == (n_cons, 2)
    # consumers come after every producer in the token layout (two-phase modes need it)
    pos = {seg: p for p, seg in enumerate(plan.order)}
    for i, s in enumerate(segs):
        if s.init is InitFrom.PRODUCER:
            assert pos[s.producer] < pos[i]
    # within one launch no slot read by one sequence is written by another
    for g in pf.groups:
        src, dst = g.src.tolist(), g.dst.tolist()
        par = g.parents.tolist() if g.parents is not None else [-1] * len(src)
        for j in range(len(src)):
            reads = {src[j]} | ({src[par[j]]} if par[j] >= 0 else set())
            for jj, d in enumerate(dst):
                assert jj == j or d < 0 or d not in reads
    if mode == "two_phase" and n_cons:
        assert pf.copy is not None and pf.copy.src.numel() == n_cons
    if mode == "fused":       # the mixed graphs' lean path: the same launch group, nothing packed
        g = pf.groups[0]
        par = g.parents.tolist() if g.parents is not None else [-1] * len(segs)
        assert fused_slots(segs, ready) == (g.src.tolist(), g.dst.tolist(), par)


def test_contract_violations_are_refused():
    st_ = IndexStager(1024, "cpu")
    ready = {5}
    cases = {
        "READY checkpoint": [PrefillSegment(3, InitFrom.ZEROS, 5)],
        "not READY": [PrefillSegment(3, InitFrom.CHECKPOINT, 1, init_slot=2)],
        "destination of two": [PrefillSegment(3, InitFrom.ZEROS, 1), PrefillSegment(3, InitFrom.ZEROS, 1)],
        "one level only": [PrefillSegment(3, InitFrom.ZEROS, 1), PrefillSegment(3, InitFrom.PRODUCER, 2, producer=0),
                           PrefillSegment(3, InitFrom.PRODUCER, 3, producer=1)],
        "publishes no state": [PrefillSegment(3, InitFrom.ZEROS, -1), PrefillSegment(3, InitFrom.PRODUCER, 2, producer=0)],
        "not another segment": [PrefillSegment(3, InitFrom.PRODUCER, 2, producer=0)],
        "read by segment": [PrefillSegment(3, InitFrom.OWN_SLOT, 1, init_slot=2), PrefillSegment(3, InitFrom.ZEROS, 2)],
    }
    for msg, segs in cases.items():
        with pytest.raises(PlanError, match=msg):
            build_step_plan(segs, "fused", st_, ready=ready)
    with pytest.raises(PlanError, match="private slot"):
        build_step_plan([PrefillSegment(3, InitFrom.ZEROS, 1), PrefillSegment(3, InitFrom.PRODUCER, -1, producer=0)],
                        "two_phase", st_)
    with pytest.raises(PlanError, match="mode"):
        build_step_plan([PrefillSegment(3, InitFrom.ZEROS, 1)], "bogus", st_)
    with pytest.raises(PlanError, match="capacity"):
        build_step_plan([PrefillSegment(3, InitFrom.ZEROS, 1)] * 1, "fused", IndexStager(4, "cpu"))


def test_one_upload_per_step_into_the_persistent_buffer():
    st_ = IndexStager(1024, "cpu")
    segs = [PrefillSegment(70, InitFrom.ZEROS, 1), PrefillSegment(10, InitFrom.PRODUCER, 2, producer=0)]
    plan = build_step_plan(segs, "fused", st_, decode_slots=[7, 8, -1])
    g = plan.prefill.groups[0]
    for t in (g.meta.cu_seqlens, g.src, g.dst, g.parents, plan.decode_slots):
        assert t.untyped_storage().data_ptr() == st_.dev.untyped_storage().data_ptr()
    assert plan.decode_slots.tolist() == [7, 8, -1]
    assert g.parents.tolist() == [-1, 0] and g.src.tolist() == [-1, -1] and g.dst.tolist() == [1, 2]
    assert torch.equal(g.meta.chunk_indices.cpu(), torch.tensor([[0, 0], [0, 1], [1, 0]], dtype=torch.int32))


@pytest.mark.parametrize("n_consumers", [1, 2, 3, 5])
def test_every_device_vector_is_16_byte_aligned(n_consumers):
    """Triton specialises on pointer alignment: a view at an odd int32 offset would compile a new kernel
    variant whenever a step's lengths shift it (1-5 s compiles inside serving passes on the H200)."""
    st_ = IndexStager(4096, "cpu")
    segs = [PrefillSegment(70, InitFrom.ZEROS, 1), PrefillSegment(3, InitFrom.ZEROS, 9)]
    segs += [PrefillSegment(5 + i, InitFrom.PRODUCER, 2 + i, producer=0) for i in range(n_consumers)]
    for mode in PREFILL_MODES:
        plan = build_step_plan(segs, mode, st_, decode_slots=[7, 8, -1][:n_consumers], extra={"x": [1] * n_consumers})
        tensors = [plan.decode_slots]
        for g in plan.prefill.groups:
            tensors += [g.meta.cu_seqlens, g.meta.chunk_offsets, g.meta.chunk_indices, g.src, g.dst, g.parents]
        for t in tensors:
            if t is not None and t.numel():
                assert t.data_ptr() % 16 == 0, mode


def test_graph_input_views_and_runner_uploads_are_16_byte_aligned():
    from gdnserve.engine.execution.graph_inputs import StepKind, _layout
    from gdnserve.engine.execution.model_runner import ModelRunner, RunnerConfig
    from gdnserve.models.builtin import build_builtin_model
    for kind in (StepKind(1), StepKind(3, "intermediate"), StepKind(4, "replay")):
        for Bk in (1, 3, 5, 17):
            lay, _ = _layout(kind, Bk, 7)
            assert all(a % 4 == 0 for a, _ in lay.values()), (kind, Bk)
    r = ModelRunner(build_builtin_model(), RunnerConfig(num_slots=8, num_pages=16))
    for n in (1, 2, 3, 5):
        for v in r._upload(*[list(range(n))] * 3):
            assert v.data_ptr() % 16 == 0 and v.tolist() == list(range(n))
