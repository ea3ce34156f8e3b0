"""StatePool: per-layer views the ops accept, exact sizing, the allocator's errors, and its invariants under
random allocate/free sequences (hypothesis, check_integrity() after every step)."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gdnserve.engine.cache.state_pool import (
    PoolFullError,
    SlotKind,
    SlotRecord,
    StatePool,
    StatePoolConfig,
    StatePoolError,
)
from gdnserve.ops.conv import causal_conv1d_prefill
from gdnserve.ops.gdn.chunk import chunk_gated_delta_rule
from gdnserve.ops.varlen import VarlenMeta
from tests.ops.gdn_inputs import gdn_inputs, idx

DIMS = dict(num_layers=2, HV=2, K=8, V=8, conv_dim=16, conv_width=4)


def make_pool(num_slots: int = 4, **kw) -> StatePool:
    return StatePool(StatePoolConfig(num_slots=num_slots, **{**DIMS, **kw}))


def test_config_rejects_bad_fields():
    with pytest.raises(ValueError, match="num_slots"):
        StatePoolConfig(num_slots=0, **DIMS)
    with pytest.raises(ValueError, match="conv_width"):
        StatePoolConfig(num_slots=1, **{**DIMS, "conv_width": 1})
    with pytest.raises(ValueError, match="ssm_dtype"):
        StatePoolConfig(num_slots=1, ssm_dtype=torch.float16, **DIMS)
    with pytest.raises(ValueError, match="HV"):
        StatePoolConfig(num_slots=1, **{**DIMS, "HV": 2.0})
    cfg = StatePoolConfig(num_slots=1, device="cpu", **DIMS)
    assert cfg.device == torch.device("cpu")
    with pytest.raises(AttributeError):
        cfg.num_slots = 2  # frozen


@pytest.mark.parametrize("num_spec", [0, 2])
@pytest.mark.parametrize("ssm_dtype", [torch.float32, torch.bfloat16])
def test_views_are_contiguous_per_layer_slices(num_spec, ssm_dtype):
    pool = make_pool(5, num_spec=num_spec, ssm_dtype=ssm_dtype)
    for layer in range(2):
        c, s = pool.conv(layer), pool.ssm(layer)
        assert c.shape == (5, 3 + num_spec, 16) and c.dtype == torch.bfloat16 and c.is_contiguous()
        assert s.shape == (5, 2, 8, 8) and s.dtype == ssm_dtype and s.is_contiguous()
        assert c.data_ptr() == pool.conv_pools[layer].data_ptr()
        assert s.untyped_storage().data_ptr() == pool.ssm_pools.untyped_storage().data_ptr()
        assert not c.any() and not s.any()  # zero-initialised
    assert pool.conv(1).data_ptr() - pool.conv(0).data_ptr() == pool.conv(0).nbytes
    for bad in (2, -1, "0"):
        with pytest.raises(IndexError, match="layer"):
            pool.conv(bad)


def test_views_drive_the_pool_indexed_ops():
    """The per-layer views are exactly what the ops take: a prefill into one slot of layer 1 writes that
    slot of layer 1 and leaves every other slot and layer bit-identical."""
    pool = make_pool(4)
    pool.conv_pools.copy_(torch.randn_like(pool.conv_pools, dtype=torch.float32))
    pool.ssm_pools.copy_(torch.randn_like(pool.ssm_pools))
    conv0, ssm0 = pool.conv_pools.clone(), pool.ssm_pools.clone()
    pool.allocate(SlotKind.RUNNING, "other")
    slot = pool.allocate(SlotKind.RUNNING, "req")
    T, meta = 5, VarlenMeta.build([5], "cpu")
    x = torch.randn(T, 16).to(torch.bfloat16)
    w = torch.randn(16, 4).to(torch.bfloat16)
    causal_conv1d_prefill(x, w, pool.conv(1), meta, idx([-1], "cpu"), idx([slot], "cpu"), backend="torch")
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(T, 2, 2, 8, 8, torch.bfloat16, "cpu")
    chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, pool.ssm(1), meta, idx([-1], "cpu"), idx([slot], "cpu"),
                           backend="torch")
    assert torch.equal(pool.conv_pools[1, slot], x[-3:])  # the last W-1 inputs
    for new, old in ((pool.conv_pools, conv0), (pool.ssm_pools, ssm0)):
        changed = (new != old).flatten(2).any(-1).nonzero().tolist()
        assert changed and {tuple(c) for c in changed} == {(1, slot)}


def test_allocate_lowest_first_with_kind_and_owner():
    pool = make_pool(4)
    assert [pool.allocate(SlotKind.RUNNING, r) for r in ("a", "b", "c")] == [0, 1, 2]
    pool.free(1)
    pool.free(0)
    assert pool.allocate(SlotKind.SCRATCH, "d") == 0
    assert pool.try_allocate(SlotKind.CHECKPOINT, "e") == 1
    assert pool.kind_of(1) is SlotKind.CHECKPOINT and pool.owner_of(1) == "e"
    assert pool.kind_of(3) is None and pool.owner_of(3) is None
    assert pool.slots_of("c") == [2] and pool.slots_of("zz") == []
    assert pool.usage() == {SlotKind.RUNNING: 1, SlotKind.CHECKPOINT: 1, SlotKind.SCRATCH: 1}
    assert pool.num_free == 1 and pool.check_integrity() == []
    with pytest.raises(ValueError, match="owner"):
        pool.allocate(SlotKind.RUNNING, None)
    with pytest.raises(TypeError, match="SlotKind"):
        pool.allocate("running", "x")


def test_full_pool_raises_with_reason_and_recovers():
    pool = make_pool(4)
    for kind, owner in [(SlotKind.RUNNING, 1), (SlotKind.RUNNING, 2), (SlotKind.CHECKPOINT, "ix"),
                        (SlotKind.SCRATCH, "step")]:
        pool.allocate(kind, owner)
    assert pool.try_allocate(SlotKind.RUNNING, 3) is None
    with pytest.raises(PoolFullError) as err:
        pool.allocate(SlotKind.RUNNING, 3)
    assert str(err.value) == "state pool full: 0 of 4 slots free (running 2, checkpoint 1, scratch 1)"
    assert err.value.reason == str(err.value) and isinstance(err.value, StatePoolError)
    assert err.value.num_slots == 4 and err.value.usage[SlotKind.RUNNING] == 2
    assert pool.check_integrity() == []  # a failed allocation changes nothing
    pool.free(2)
    assert pool.allocate(SlotKind.RUNNING, 3) == 2
    assert pool.check_integrity() == []


def test_double_free_and_bad_slots_name_the_slot():
    pool = make_pool(4)
    s = pool.allocate(SlotKind.RUNNING, "r")
    pool.free(s)
    with pytest.raises(StatePoolError, match=f"slot {s} is not allocated"):
        pool.free(s)
    with pytest.raises(StatePoolError, match="slot 3 is not allocated"):
        pool.free(3)
    for bad in (4, 99, -1, True, 1.0):
        with pytest.raises(StatePoolError, match=f"slot {bad!r} is not a slot"):
            pool.free(bad)
    with pytest.raises(StatePoolError, match="slot 7"):
        pool.kind_of(7)
    assert pool.check_integrity() == []


def test_bytes_per_slot_exact():
    # conv: (W-1+spec) * D * 2 bytes (bf16); ssm: HV * V * K * 4 (fp32) or 2 (bf16); times 2 layers.
    assert StatePoolConfig(num_slots=1, **DIMS).bytes_per_slot == 2 * (3 * 16 * 2 + 2 * 8 * 8 * 4) == 1216
    assert StatePoolConfig(num_slots=1, ssm_dtype=torch.bfloat16, **DIMS).bytes_per_slot == 2 * (96 + 256)
    assert StatePoolConfig(num_slots=1, num_spec=1, conv_dtype=torch.float32, **DIMS).bytes_per_slot \
        == 2 * (4 * 16 * 4 + 512)
    pool = make_pool(3, num_spec=2)
    assert pool.bytes_per_slot * 3 == pool.conv_pools.nbytes + pool.ssm_pools.nbytes


def test_from_budget_sizes_the_pool():
    per = 1216
    pool = StatePool.from_budget(5 * per + per - 1, **DIMS)
    assert pool.num_slots == 5 and pool.num_free == 5 and pool.bytes_per_slot == per
    assert pool.conv(0).shape == (5, 3, 16) and pool.ssm(1).shape == (5, 2, 8, 8)
    assert StatePool.from_budget(per, **DIMS).num_slots == 1
    assert StatePool.from_budget(100 * per, max_slots=3, **DIMS).num_slots == 3
    with pytest.raises(StatePoolError, match=r"budget of 1215 bytes .* one slot needs 1216 bytes"):
        StatePool.from_budget(per - 1, **DIMS)
    with pytest.raises(StatePoolError, match="budget of 0 bytes"):
        StatePool.from_budget(0, **DIMS)


def test_check_integrity_detects_corruption():
    """The check must be able to fail: corrupt each piece of bookkeeping and see it reported."""
    pool = make_pool(4)
    pool.allocate(SlotKind.RUNNING, "r")
    pool._free.append(1)                                  # duplicate in the free list
    assert any("duplicates" in p for p in pool.check_integrity())
    pool._free.remove(1)
    pool._records[1] = SlotRecord(SlotKind.SCRATCH, "x")  # both free and owned
    probs = pool.check_integrity()
    assert any("both free and owned: [1]" in p for p in probs) and any("counters" in p for p in probs)
    del pool._records[1]
    pool._free.remove(3)                                  # slot lost
    assert any("neither free nor owned: [3]" in p for p in pool.check_integrity())
    with pytest.raises(StatePoolError, match="integrity"):
        pool.assert_integrity()


class PoolMachine(RuleBasedStateMachine):
    """Random allocate/free sequences against a dict model; integrity after every step."""

    @initialize(num_slots=st.integers(1, 6))
    def setup(self, num_slots):
        self.pool = make_pool(num_slots)
        self.model: dict[int, tuple[SlotKind, int]] = {}

    @rule(kind=st.sampled_from(SlotKind), owner=st.integers(0, 3))
    def allocate(self, kind, owner):
        free = set(range(self.pool.num_slots)) - self.model.keys()
        if not free:
            assert self.pool.try_allocate(kind, owner) is None
            with pytest.raises(PoolFullError, match=f"0 of {self.pool.num_slots} slots free"):
                self.pool.allocate(kind, owner)
            return
        slot = self.pool.allocate(kind, owner) if owner % 2 else self.pool.try_allocate(kind, owner)
        assert slot == min(free)
        self.model[slot] = (kind, owner)

    @precondition(lambda self: self.model)
    @rule(pick=st.randoms(use_true_random=False))
    def free(self, pick: random.Random):
        slot = pick.choice(sorted(self.model))
        self.pool.free(slot)
        del self.model[slot]

    @rule(slot=st.integers(-2, 8))
    def free_unallocated(self, slot):
        if slot in self.model:
            return
        with pytest.raises(StatePoolError, match=f"slot {slot}"):
            self.pool.free(slot)

    @invariant()
    def consistent(self):
        if not hasattr(self, "pool"):
            return
        assert self.pool.check_integrity() == []
        assert self.pool.num_free == self.pool.num_slots - len(self.model)
        for kind in SlotKind:
            assert self.pool.usage()[kind] == sum(k is kind for k, _ in self.model.values())
        for s in range(self.pool.num_slots):
            kind, owner = self.model.get(s, (None, None))
            assert self.pool.kind_of(s) is kind and self.pool.owner_of(s) == owner


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
