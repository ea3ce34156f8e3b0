"""Checkpoint tiers with the MTP drafter (``spec_draft="mtp"``): a checkpoint's slot state includes the drafter's
``hidden[slot]`` (the hidden after its last token, which a consumer's first MTP pair reads), registered with the
state pool by the runner. A checkpoint copied to the host tier or to disk and restored into another slot lands with
that row bit-identical (a stale row keeps outputs exact but drafts from the wrong hidden); the scratch row past the
real slots and every other slot's row are untouched; a copy or file without the row (taken before it was
registered, another layout, a version-1 file) is never restored; the fingerprint names the rows. Through the engine:
the row a restore writes is the one the evicted slot held, and greedy outputs equal an engine without tiers."""
from __future__ import annotations

import logging

import pytest
import torch

from gdnserve.engine.cache import checkpoint_disk
from gdnserve.engine.cache.checkpoint_copy import Copier
from gdnserve.engine.cache.checkpoint_index import checkpoint_key, conversation_prefix
from gdnserve.engine.cache.checkpoint_tiers import model_fingerprint
from gdnserve.entrypoints.llm import LLM
from tests.engine.test_checkpoint_tiers import CONVS, IDS, Rig, _run, bits, pools, same

H = 6       # the rigs' hidden width


@pytest.mark.parametrize("stage", [None, 160])
def test_registered_rows_travel_with_the_slot_and_touch_nothing_else(stage):
    st, pg = pools()
    hidden = torch.randn(st.num_slots + 1, H)          # a row per slot and the drafter's scratch row
    st.register_rows("mtp_hidden", hidden)
    cp = Copier(st, pg, stage_bytes=stage)
    assert cp.names == ("conv", "ssm", "mtp_hidden", "k", "v")
    hc = cp.snapshot(b"k" * 16, (1, 2, 3), 1, [5, 6])
    assert list(hc.tensors) == list(cp.names) and hc.tensors["mtp_hidden"].shape == (1, H)
    assert torch.equal(bits(hc.tensors["mtp_hidden"][0]), bits(hidden[1]))
    assert cp.bytes_of(2) >= hc.nbytes == st.bytes_per_slot + 2 * pg.bytes_per_page + H * 4
    want, before = bits(hidden[1]), bits(hidden)
    hidden[3].fill_(float("nan"))                       # the restore's destination, poisoned
    cp.restore(hc, 3, [0, 1])
    assert torch.equal(bits(hidden[3]), want)
    others = [s for s in range(st.num_slots + 1) if s != 3]
    assert torch.equal(bits(hidden[others]), before[others])       # the scratch row included
    with pytest.raises(ValueError, match="register_rows"):
        st.register_rows("ssm", hidden)
    with pytest.raises(ValueError, match="register_rows"):
        st.register_rows("short", hidden[:2])


def test_a_copy_taken_before_the_rows_were_registered_is_not_restored(tmp_path):
    r = Rig(tmp_path, host_ckpts=2, disk=False)
    for ids in IDS[:5]:
        r.make(ids)                                     # IDS[0] in the host tier, without a hidden row
    r.st.register_rows("mtp_hidden", torch.randn(r.st.num_slots, H))
    assert not r.copier.fits(r.tiers.host[checkpoint_key(IDS[0])])
    look = r.ck.lookup(IDS[0])
    assert not look.hit
    r.ck.poll(wait=True)
    assert r.stats.restore_failures == 1 and not r.ck.lookup(IDS[0]).hit
    assert r.st.check_integrity() == [] and r.pg.check_integrity() == [] and r.ck.index.check_integrity() == []


def test_host_and_disk_tiers_carry_the_hidden_row_into_another_slot(tmp_path):
    r = Rig(tmp_path, host_ckpts=1, inline_disk=True, hidden=H)
    slots = {ids: r.make(ids).slot for ids in IDS[:6]}  # IDS[0] to the host tier then to disk, IDS[1] to the host
    r.disk.flush()
    assert [r.where(i) for i in IDS[:2]] == ["disk", "host"]
    for ids, tier in ((IDS[1], "host"), (IDS[0], "disk")):
        e = r.restore(ids)
        assert e.origin == tier and e.slot != slots[ids] and same(r.snap(e), r.data[ids])
    assert r.stats.restores == {"host": 1, "disk": 1}
    r.ck.close()                                        # graceful shutdown: every checkpoint to disk
    r2 = Rig(tmp_path, host_ckpts=0, hidden=H)          # a restart: the files hold the row
    assert len(r2.disk) == 6
    e = r2.restore(IDS[3])
    assert e.origin == "disk" and same(r2.snap(e), r.data[IDS[3]])


def test_files_without_the_row_or_of_version_1_are_ignored_with_one_line(tmp_path, caplog, monkeypatch):
    plain = Rig(tmp_path, host_ckpts=0)                 # another layout under the same fingerprint: no hidden row
    plain.make(IDS[0])
    plain.ck.close()
    monkeypatch.setattr(checkpoint_disk, "VERSION", 1)  # a file of the previous format (its rows left out)
    old = Rig(tmp_path, host_ckpts=0, hidden=H)
    old.make(IDS[1])
    old.ck.close()
    monkeypatch.setattr(checkpoint_disk, "VERSION", 2)
    caplog.set_level(logging.WARNING)
    caplog.clear()
    r = Rig(tmp_path, host_ckpts=0, hidden=H)
    lines = [m for m in caplog.messages if "ignored" in m]
    assert len(lines) == 2 and any("tensors" in m for m in lines) and any("format version 1" in m for m in lines)
    assert len(r.disk) == 0 and r.ck.lookup(IDS[0]).entry is None and r.ck.lookup(IDS[1]).entry is None


def test_the_fingerprint_names_the_rows():
    from gdnserve.models.builtin import build_builtin_model
    m = build_builtin_model(seed=0)
    st, pg = pools()
    fp = model_fingerprint(m, torch.float32, 1, st.config, pg.config)
    assert fp == model_fingerprint(m, torch.float32, 1, st.config, pg.config, {})    # none: as before
    row = {"mtp_hidden": ((1, H), torch.float32)}
    assert fp != model_fingerprint(m, torch.float32, 1, st.config, pg.config, row)
    assert model_fingerprint(m, torch.float32, 1, st.config, pg.config, row) != \
        model_fingerprint(m, torch.float32, 1, st.config, pg.config, {"mtp_hidden": ((1, H), torch.bfloat16)})


# ------------------------------------------------------------------ the engine
MTP = {"device": "cpu", "max_num_seqs": 2, "num_slots": 4, "num_pages": 64, "page_size": 8, "spec_k": 2,
       "spec_mode": "replay", "spec_draft": "mtp"}


class Watch:
    """Spies on an engine's copier: the drafter's ``hidden`` row of each checkpoint's slot when it is copied down,
    and for each restore (key, the slot it was copied down from, the slot it lands in, the row there after)."""

    def __init__(self, engine, down: dict | None = None) -> None:
        hidden, cp = engine.runner.mtp.hidden, engine.kv.checkpoint_cache.tiers.copier
        assert engine.runner.state.slot_rows["mtp_hidden"] is hidden and "mtp_hidden" in cp.names
        self.down: dict[bytes, tuple[int, torch.Tensor]] = {} if down is None else down
        self.up: list[tuple[bytes, int, int, torch.Tensor]] = []
        copy_down, restore = cp.copy_down, cp.restore

        def spy_down(hc, slot, pages, **kw):        # (free=False: a spill ahead, the slot stays READY)
            self.down[hc.key] = (slot, bits(hidden[slot]))
            return copy_down(hc, slot, pages, **kw)

        def spy_up(hc, slot, pages):
            out = restore(hc, slot, pages)
            self.up.append((hc.key, self.down[hc.key][0], slot, bits(hidden[slot])))
            return out
        cp.copy_down, cp.restore = spy_down, spy_up

    def exact(self) -> bool:
        """Every restore wrote the row its checkpoint's slot held when it was copied down."""
        return all(torch.equal(row, self.down[key][1]) for key, _, _, row in self.up)


@pytest.fixture(scope="module")
def ref():
    return LLM(device="cpu", max_num_seqs=2, num_pages=256, auto_checkpoints=False).engine


def test_a_host_tier_restore_brings_the_mtp_hidden_into_its_new_slot(ref):
    e = LLM(checkpoint_host_memory_gb=0.01, **MTP).engine
    w = Watch(e)
    first = [_run(e, c).outputs[0].token_ids for c in CONVS]
    assert w.down and not w.up                          # 4 slots: the first turns' checkpoints spilled
    for c, out in zip(CONVS, first):
        ids = c + out + [7, 8, 9]
        got = _run(e, ids)
        assert got.checkpoint.hit_length == len(c) + len(out) - 1
        assert got.outputs[0].token_ids == _run(ref, ids).outputs[0].token_ids
    assert e.tier_stats.restores["host"] >= 2 and len(w.up) == e.tier_stats.restores["host"]
    assert any(old != new for _, old, new, _ in w.up) and w.exact()
    assert e.counts.spec_drafted > 0 and e.runner.state.check_integrity() == []
    e.close()


def test_a_disk_tier_restore_brings_the_mtp_hidden_across_a_restart(tmp_path, ref):
    kw = {**MTP, "checkpoint_dir": str(tmp_path)}
    e = LLM(**kw).engine
    w = Watch(e)
    first = [_run(e, c).outputs[0].token_ids for c in CONVS[:5]]
    c, out = CONVS[0], first[0]                         # evicted first: on disk, restored into another slot
    assert checkpoint_key(conversation_prefix(c, out)) in e.kv.checkpoint_cache.tiers.disk
    got = _run(e, c + out + [5])
    assert got.checkpoint.tier == "disk" and got.outputs[0].token_ids == _run(ref, c + out + [5]).outputs[0].token_ids
    assert len(w.up) == 1 and w.up[0][1] != w.up[0][2] and w.exact()
    e.close()                                           # the rest written at shutdown, each with its row
    e2 = LLM(**kw).engine
    w2 = Watch(e2, down=w.down)
    for c, out in zip(CONVS[1:5], first[1:]):
        ids = c + out + [5]
        got = _run(e2, ids)
        assert got.checkpoint.tier == "disk" and got.outputs[0].token_ids == _run(ref, ids).outputs[0].token_ids
    assert len(w2.up) == 4 and w2.exact()
    e2.close()


def test_pages_of_rejected_drafts_past_the_length_stay_behind(tmp_path):
    """A checkpoint published after speculative decoding keeps, past its length, the pages a verify step appended
    for rejected drafts: it is copied down with the pages of its tokens only (a host restore of all of them raised
    in PageTable, a disk one failed)."""
    r = Rig(tmp_path, host_ckpts=1, inline_disk=True, hidden=H)
    orig = r.make

    def make(ids):
        e = orig(ids)                                   # its data: the 2 pages of its 6 tokens
        t = r.ck.pages[e.key]
        t.append_tokens(3)                              # a verify step's draft positions: one more page ...
        t.length = len(ids)                             # ... kept when the drafts were rejected
        assert len(t.pages) == 3
        return e
    for ids in IDS[:6]:
        make(ids)
    r.disk.flush()
    assert [r.where(i) for i in IDS[:2]] == ["disk", "host"]
    for ids, tier in ((IDS[1], "host"), (IDS[0], "disk")):
        e = r.restore(ids)
        assert e.origin == tier and same(r.snap(e), r.data[ids])
    assert r.stats.restore_failures == 0 and r.pg.check_integrity() == []
