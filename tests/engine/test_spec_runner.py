"""Speculative verify through the model runner (embedded model, CPU): for every acceptance count, both
verify modes reproduce plain greedy decoding token for token, and the KV/state bookkeeping stays exact."""
from __future__ import annotations

import pytest

from gdnserve.engine.cache.sequence import PrefillItem
from gdnserve.engine.execution.model_runner import (
    ModelRunner,
    RunnerConfig,
)
from gdnserve.models.builtin import build_builtin_model

PROMPT = list(b"Speculative decoding keeps only the accepted tokens in the state.")


@pytest.fixture(scope="module")
def model():
    return build_builtin_model()


def greedy_reference(model, n):
    r = ModelRunner(model, RunnerConfig(backend="torch", num_slots=4, num_pages=64, page_size=8))
    seq = r.new_seq()
    out = [int(r.step([PrefillItem(seq, PROMPT)], [])[0].argmax())]
    while len(out) < n:
        out.append(int(r.step([], [(seq, out[-1])])[0].argmax()))
    return out


@pytest.mark.parametrize("mode", ["intermediate", "replay"])
@pytest.mark.parametrize("k", [1, 3])
def test_verify_equals_plain_greedy_for_every_acceptance_count(model, mode, k):
    N = 30
    ref = greedy_reference(model, N + k + 2)
    r = ModelRunner(model, RunnerConfig(backend="torch", num_slots=4, num_pages=64, page_size=8, spec_mode=mode,
                                        spec_tokens=k + 1))
    seq = r.new_seq()
    out = [int(r.step([PrefillItem(seq, PROMPT)], [])[0].argmax())]
    seen = set()
    step = 0
    while len(out) < N:
        # oracle drafts: the true continuation with a planned first error, so every count 0..k occurs
        true = ref[len(out):len(out) + k]
        err = step % (k + 1)
        drafts = [t if i < err else (t + 1) % 256 for i, t in enumerate(true)]
        logits = r.step([], [], verifies=[(seq, [out[-1]] + drafts)])
        target = logits.argmax(-1).tolist()
        a = 0
        while a < k and drafts[a] == target[a]:
            a += 1
        seen.add(a)
        out += drafts[:a] + [target[a]]
        r.accept([(seq, a + 1)])
        assert seq.length == len(PROMPT) + len(out) - 1
        step += 1
    assert out[:N] == ref[:N]
    assert seen == set(range(k + 1))
    r.flush([seq])                                        # replay: land the pending tokens, then plain decode
    nxt = int(r.step([], [(seq, out[-1])])[0].argmax())
    assert nxt == ref[len(out)]
    r.free_seq(seq)
    assert r.state.check_integrity() == [] and r.pages.check_integrity() == []


@pytest.mark.parametrize("mode", ["intermediate", "replay"])
def test_verify_indices_are_built_once_per_step(model, mode, monkeypatch):
    """The reference PR's concern: the verify index vectors are resolved once per step, as views of the
    runner's persistent upload buffer, and every GDN layer's conv and recurrent op receives the very same
    tensor objects (no per-layer construction)."""
    import gdnserve.layers.gdn_mixer as gm
    seen = []
    real_conv, real_verify = gm.causal_conv1d_update, gm.gdn_verify

    def conv(x, w, pool, slots, **kw):
        seen.append(("conv", slots, kw.get("pending_out_rows"), kw.get("pending_in_rows"), kw.get("num_pending")))
        return real_conv(x, w, pool, slots, **kw)

    def verify(*a, **kw):
        seen.append(("verify", a[8], kw.get("scratch_rows") if kw.get("mode") == "intermediate" else kw.get("pending_out_rows"),
                     kw.get("pending_in_rows"), kw.get("num_pending")))
        return real_verify(*a, **kw)
    monkeypatch.setattr(gm, "causal_conv1d_update", conv)
    monkeypatch.setattr(gm, "gdn_verify", verify)
    r = ModelRunner(model, RunnerConfig(backend="torch", num_slots=4, num_pages=64, page_size=8, spec_mode=mode,
                                        spec_tokens=3))
    seqs = [r.new_seq() for _ in range(2)]
    r.step([PrefillItem(s, PROMPT) for s in seqs], [])
    seen.clear()
    r.step([], [], verifies=[(s, [1, 2, 3]) for s in seqs])
    n_gdn = len(model.gdn_layers())
    assert len(seen) == 2 * n_gdn
    first = seen[0][1:]
    for _, *tensors in seen:
        assert all(t is f for t, f in zip(tensors, first))          # the identical objects in every call
    base = r.stager.dev.untyped_storage().data_ptr()
    assert all(t is None or t.untyped_storage().data_ptr() == base for t in first)   # views of the persistent buffer
