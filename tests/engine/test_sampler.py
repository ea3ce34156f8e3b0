"""SamplingParams validation and the Sampler: greedy is argmax; draws follow softmax(logits / T) after
top-k and top-p (the vectorised distribution checked row by row against a float64 reference, the draws
by a chi-square test); seeded rows reproduce across calls and batch positions; logprobs come from the
raw logits; stop strings are found across token boundaries and a holding-back streamer never retracts.
Chi-square tests fail by chance with probability ~1e-6 each."""
from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from gdnserve.engine.execution.sampler import (
    Sampler,
    SamplingTensors,
    row_seed,
    stop_check,
    stop_holdback,
    token_logprobs,
)
from gdnserve.engine.sampling_params import SamplingParams

V = 257  # odd vocabulary


def chi2_limit(dof: int, z: float = 4.75) -> float:
    """Wilson-Hilferty upper quantile of chi-square(dof); z = 4.75 is a one-sided 1e-6 tail."""
    a = 2.0 / (9 * dof)
    return dof * (1 - a + z * math.sqrt(a)) ** 3


def assert_follows(ids: torch.Tensor, probs: torch.Tensor) -> None:
    """``ids`` drawn i.i.d. from ``probs`` [V] (float64): zero-probability tokens never appear and the
    counts pass a chi-square test."""
    counts = torch.bincount(ids.cpu(), minlength=probs.numel()).double()
    probs = probs.cpu().double()
    support = probs > 0
    assert counts[~support].sum() == 0, f"drew outside the support: {torch.nonzero(counts * ~support).flatten()}"
    expected = probs[support] * ids.numel()
    assert expected.min() >= 20, "test set-up: expected counts too small for chi-square"
    stat = ((counts[support] - expected) ** 2 / expected).sum().item()
    dof = int(support.sum()) - 1
    if dof > 0:
        assert stat < chi2_limit(dof), f"chi2 {stat:.1f} over {dof} dof (limit {chi2_limit(dof):.1f})"


def ref_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Float64 per-row reference of what the vectorised sampler draws from: softmax(x / T) over the top-k
    (ties with the k-th kept), then over the smallest prefix with renormalised mass >= top_p (ties with
    the last kept token kept)."""
    x = logits.double().cpu() / p.temperature
    keep = torch.ones_like(x, dtype=torch.bool)
    if 0 < p.top_k < x.numel():
        keep &= x >= x.sort(descending=True).values[p.top_k - 1]
    if p.top_p < 1:
        probs = torch.where(keep, x, -math.inf).softmax(-1)
        mass, last = 0.0, None
        for i in probs.argsort(descending=True, stable=True).tolist():
            if mass >= p.top_p or not keep[i]:
                break
            mass, last = mass + probs[i].item(), i
        keep &= x >= x[last]
    return torch.where(keep, x, -math.inf).softmax(-1)


def tiled(params: SamplingParams, n: int) -> list[SamplingParams]:
    return [params] * n


# ---- SamplingParams ----------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", "1"),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", float("nan")), ("top_p", None),
    ("top_k", -1), ("top_k", 2.0), ("top_k", True),
    ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 1.5),
    ("n", 0), ("n", 65), ("n", "2"),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", 1.0),
    ("prompt_logprobs", 21), ("prompt_logprobs", -1),
    ("seed", 1.5), ("seed", "7"), ("seed", True),
    ("stop", ""), ("stop", ["ok", ""]), ("stop", [1]), ("stop", 3),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]), ("stop_token_ids", 5),
    ("ignore_eos", 1),
])
def test_params_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**{field: value})


def test_params_normalise_and_freeze():
    p = SamplingParams(temperature=1, top_p=1, stop=["a", "bc"], stop_token_ids=[3, 4], seed=-3,
                       logprobs=0, prompt_logprobs=20, n=64)
    assert p.stop == ("a", "bc") and p.stop_token_ids == (3, 4)
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(temperature=0).greedy and not p.greedy
    with pytest.raises(AttributeError):
        p.temperature = 0.5
    again = SamplingParams(**dataclasses.asdict(p))
    assert again == p and hash(again) == hash(p)  # usable as a cache key for SamplingTensors


# ---- greedy, temperature, top-k, top-p ---------------------------------------------------------------

def test_greedy_is_argmax_and_ignores_filters_and_seed(device):
    logits = torch.randn(37, V, device=device) * 3
    params = [SamplingParams(temperature=0.0, top_k=i % 4, top_p=[1.0, 0.3][i % 2], seed=i if i % 3 else None)
              for i in range(37)]
    res = Sampler().sample(logits, params, steps=[0] * 37)
    assert res.token_ids.dtype == torch.int64 and res.token_ids.device == logits.device
    assert torch.equal(res.token_ids, logits.argmax(-1))


def test_greedy_rows_in_a_mixed_batch(device):
    logits = torch.randn(64, V, device=device)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.3, top_k=5 * (i % 3)) for i in range(64)]
    ids = Sampler().sample(logits, params).token_ids
    assert torch.equal(ids[1::2], logits[1::2].argmax(-1))
    assert not torch.equal(ids[0::2], logits[0::2].argmax(-1))  # 32 sampled rows: ~never all argmax


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.8])
def test_temperature_frequencies(device, temperature):
    logits = torch.rand(5, device=device) * 2
    n = 20_000
    ids = Sampler().sample(logits.expand(n, 5).contiguous(), tiled(SamplingParams(temperature=temperature), n))
    assert_follows(ids.token_ids, (logits.double() / temperature).softmax(-1))


@pytest.mark.parametrize("k", [1, 3, 7])
def test_top_k_never_leaves_the_top_k(device, k):
    logits = torch.randn(8, device=device)
    n = 20_000
    ids = Sampler().sample(logits.expand(n, 8).contiguous(), tiled(SamplingParams(top_k=k, temperature=0.9), n))
    top = set(logits.topk(k).indices.tolist())
    assert set(ids.token_ids.unique().tolist()) <= top
    assert_follows(ids.token_ids, ref_probs(logits, SamplingParams(top_k=k, temperature=0.9)))


def test_top_p_keeps_smallest_prefix_reaching_p():
    # probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625; cut points kept clear of fp32 rounding
    logits = torch.tensor([[4.0, 2.0, 1.0, 0.5, 0.5]]).log()
    def support(p: float) -> list[int]:
        t = SamplingTensors.build([SamplingParams(top_p=p)], "cpu")
        return torch.nonzero(Sampler.probs(logits, t)[0]).flatten().tolist()
    assert support(1e-6) == [0]
    assert support(0.49) == [0]
    assert support(0.51) == [0, 1]
    assert support(0.74) == [0, 1]
    assert support(0.76) == [0, 1, 2]
    assert support(0.88) == [0, 1, 2, 3, 4]  # 0.0625 tie at the cut: both kept
    assert support(1.0) == [0, 1, 2, 3, 4]


def test_top_p_one_keeps_every_token():
    # a token 30 nats below the rest: fp32 cumsum reaches 1.0 long before it
    logits = torch.randn(3, V) * 0.1
    logits[:, 17] -= 30
    t = SamplingTensors.build([SamplingParams(top_p=1.0), SamplingParams(top_p=1.0, top_k=V + 5),
                               SamplingParams(top_p=0.999999)], "cpu")
    probs = Sampler.probs(logits, t)
    assert (probs[:2] > 0).all()
    assert probs[2, 17] == 0 and (probs[2] > 0).sum() < V


def test_ties_are_kept_together():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0, 2.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    t = SamplingTensors.build([SamplingParams(top_k=2), SamplingParams(top_p=0.5),
                               SamplingParams(top_k=1, top_p=0.1)], "cpu")
    probs = Sampler.probs(logits, t)
    torch.testing.assert_close(probs[0], torch.tensor([0, 1 / 3, 1 / 3, 1 / 3, 0]))
    torch.testing.assert_close(probs[1:], torch.full((2, 5), 0.2))


def test_vectorised_distribution_matches_per_row_reference(device):
    rng = random.Random()
    params = [SamplingParams(temperature=rng.choice([0.3, 0.8, 1.0, 2.5]), top_k=rng.choice([0, 0, 1, 2, 13, 100, V]),
                             top_p=rng.choice([1.0, 1.0, 0.05, 0.5, 0.9, 0.97])) for _ in range(61)]
    logits = torch.randn(61, V, device=device) * 2
    probs = Sampler.probs(logits, SamplingTensors.build(params, device))
    for i, p in enumerate(params):
        ref = ref_probs(logits[i], p)
        assert torch.equal(probs[i].cpu() > 0, ref > 0), f"row {i} {p}: support differs"
        torch.testing.assert_close(probs[i].cpu().double(), ref, atol=1e-6, rtol=1e-5)


def test_filtered_draws_follow_the_renormalised_distribution(device):
    logits = torch.randn(6, device=device)
    p = SamplingParams(temperature=0.8, top_k=5, top_p=0.8)
    n = 20_000
    ids = Sampler().sample(logits.expand(n, 6).contiguous(), tiled(p, n)).token_ids
    assert_follows(ids, ref_probs(logits, p))


# ---- seeds -------------------------------------------------------------------------------------------

def test_seeded_rows_reproduce_across_calls_and_batch_positions(device):
    seeds = [random.randrange(-2**40, 2**40) for _ in range(6)]
    logits_row = torch.randn(V, device=device) * 0.1  # near-uniform: a coincidence is ~1/V per draw

    def draw(sampler: Sampler, batch: int, positions: list[int], step: int, sample_index: int = 0) -> list[int]:
        logits = torch.randn(batch, V, device=device)
        params = [SamplingParams(temperature=random.choice([1.0, 1.5]), top_k=random.choice([0, 9]))
                  for _ in range(batch)]
        for pos, s in zip(positions, seeds):
            logits[pos] = logits_row
            params[pos] = SamplingParams(seed=s, temperature=0.9)
        ids = sampler.sample(logits, params, steps=[step] * batch, sample_indices=[sample_index] * batch).token_ids
        return ids[positions].tolist()

    first = draw(Sampler(), 6, list(range(6)), step=3)
    assert draw(Sampler(seed=1), 6, list(range(6)), step=3) == first
    assert draw(Sampler(), 17, [16, 0, 9, 3, 11, 5], step=3) == first
    s = Sampler()
    s.sample(torch.randn(4, V, device=device), tiled(SamplingParams(), 4))  # advance the shared generator
    assert draw(s, 9, [8, 7, 6, 5, 4, 3], step=3) == first
    assert draw(Sampler(), 6, list(range(6)), step=4) != first
    assert draw(Sampler(), 6, list(range(6)), step=3, sample_index=1) != first


def test_row_seed_mixes_every_input():
    base = row_seed(7, 3, 0)
    assert 0 <= base < 2**63 and row_seed(7, 3, 0) == base
    assert len({base, row_seed(8, 3, 0), row_seed(7, 4, 0), row_seed(7, 3, 1), row_seed(3, 7, 0)}) == 5


def test_unseeded_rows_differ(device):
    logits = torch.zeros(64, 1000, device=device) + torch.randn(1, 1000, device=device) * 0.01
    params = tiled(SamplingParams(), 64)
    a = Sampler().sample(logits, params).token_ids
    b = Sampler().sample(logits, params).token_ids
    s = Sampler(seed=5)
    c, d = s.sample(logits, params).token_ids, s.sample(logits, params).token_ids
    assert not torch.equal(a, b) and not torch.equal(c, d)
    assert len(set(a.tolist())) > 32  # rows of one call differ too
    assert torch.equal(Sampler(seed=5).sample(logits, params).token_ids, c)  # sampler seed: reproducible


def test_seeded_rows_need_steps():
    with pytest.raises(ValueError, match="^steps"):
        Sampler().sample(torch.randn(2, V), [SamplingParams(seed=1), SamplingParams()])


# ---- logprobs ----------------------------------------------------------------------------------------

def test_logprobs_are_of_the_raw_logits(device):
    logits = torch.randn(23, V, device=device) * 4
    params = [SamplingParams(temperature=[0.0, 0.5, 2.0][i % 3], top_k=i % 5, top_p=[1.0, 0.7][i % 2],
                             logprobs=[None, 0, 3, 20][i % 4]) for i in range(23)]
    res = Sampler().sample(logits, params)
    ref = logits.double().log_softmax(-1)
    torch.testing.assert_close(res.logprobs.double(), ref.gather(1, res.token_ids[:, None]).squeeze(1),
                               atol=2e-6, rtol=1e-6)
    assert res.top_ids.shape == (23, 20) and res.top_logprobs.shape == (23, 20)
    assert (res.top_logprobs[:, :-1] >= res.top_logprobs[:, 1:]).all()  # sorted descending
    ref_top = ref.topk(20, dim=-1)
    assert torch.equal(res.top_ids, ref_top.indices)
    torch.testing.assert_close(res.top_logprobs.double(), ref_top.values, atol=2e-6, rtol=1e-6)


def test_no_top_logprobs_unless_asked(device):
    logits = torch.randn(3, V, device=device)
    for lp in (None, 0):
        res = Sampler().sample(logits, tiled(SamplingParams(logprobs=lp), 3))
        assert res.top_ids is None and res.top_logprobs is None and res.logprobs.shape == (3,)


def test_token_logprobs_for_prompt_positions():
    logits = torch.randn(9, 4) * 3
    ids = torch.randint(0, 4, (9,))
    lp, top_ids, top_lp = token_logprobs(logits, ids, num_top=20)  # more than V: clipped
    torch.testing.assert_close(lp, logits.log_softmax(-1)[torch.arange(9), ids])
    assert top_ids.shape == (9, 4) and torch.equal(top_lp.exp().sum(-1).round(), torch.ones(9))


# ---- the public boundary, cached tensors -------------------------------------------------------------

def test_sample_validates_logits_and_rows():
    with pytest.raises(ValueError, match="^logits"):
        Sampler().sample(torch.randn(2, V, dtype=torch.float64), tiled(SamplingParams(), 2))
    with pytest.raises(ValueError, match="^logits"):
        Sampler().sample(torch.randn(V), [SamplingParams()])
    with pytest.raises(ValueError, match="^params"):
        Sampler().sample(torch.randn(3, V), tiled(SamplingParams(), 2))
    with pytest.raises(ValueError, match="^sample_indices"):
        Sampler().sample(torch.randn(2, V), tiled(SamplingParams(), 2), sample_indices=[0])


def test_cached_tensors_give_the_same_draws(device):
    logits = torch.randn(11, V, device=device)
    params = [SamplingParams(seed=i, top_k=i, temperature=0.5 + i / 10, logprobs=i) for i in range(11)]
    t = SamplingTensors.build(params, device)
    a = Sampler().sample(logits, params, steps=list(range(11)))
    b = Sampler().sample(logits, t, steps=list(range(11)))
    assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.top_ids, b.top_ids)


# ---- stop strings ------------------------------------------------------------------------------------

def test_stop_check_across_token_boundaries():
    assert stop_check("Hello wo", "rld!", ("world",)) == ("Hello ", True)
    assert stop_check("Hello w", "o", ("world",)) == ("Hello wo", False)
    assert stop_check("ab", "cd", ("bc", "d")) == ("a", True)           # earliest start wins
    assert stop_check("a", "xyzb", ("b", "xy")) == ("a", True)
    assert stop_check("", "STOP", ("STOP",)) == ("", True)
    assert stop_check("abc", "", ("abc",)) == ("abc", False)            # old text was checked already
    assert stop_check("abc", "d", ()) == ("abcd", False)
    assert stop_check("x\n", "\nrest", ("\n\n",)) == ("x", True)


def test_streaming_with_holdback_never_retracts():
    rng = random.Random()
    for _ in range(200):
        text = "".join(rng.choice("abc") for _ in range(rng.randrange(1, 40)))
        stop = tuple({"".join(rng.choice("abc") for _ in range(rng.randrange(1, 5))) for _ in range(2)})
        if any(a != b and a in b for a in stop for b in stop):
            continue  # then the earliest-starting match may complete last; the whole-text oracle below differs
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(0, 10))))
        pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        so_far, sent, stopped = "", "", False
        for piece in pieces:
            so_far, stopped = stop_check(so_far, piece, stop)
            emit = so_far if stopped else so_far[:len(so_far) - stop_holdback(so_far, stop)]
            assert emit.startswith(sent), (text, stop, pieces)
            sent = emit
            if stopped:
                break
        first = min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))
        assert stopped == (first < len(text)) and (sent if stopped else so_far) == text[:first]


def test_stop_holdback():
    assert stop_holdback("Hello wor", ("world",)) == 3
    assert stop_holdback("Hello", ("world",)) == 0
    assert stop_holdback("abab", ("abac", "bx")) == 2
    assert stop_holdback("xaba", ("abac", "bx")) == 3
    assert stop_holdback("x", ("x",)) == 0  # a whole stop string is stop_check's business


@pytest.mark.parametrize("logprobs", [None, 0, 3])
def test_all_greedy_fast_path_equals_the_tensor_path(logprobs):
    """A batch of greedy rows skips building per-row parameter tensors; its result is the general path's."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(7, V, generator=g)
    params = [SamplingParams(temperature=0.0, logprobs=logprobs if i % 2 else None) for i in range(7)]
    s = Sampler(0)
    fast = s.sample(logits, params)
    full = s.sample(logits, SamplingTensors.build(params, "cpu"))
    assert torch.equal(fast.token_ids, full.token_ids) and torch.equal(fast.logprobs, full.logprobs)
    assert (fast.top_ids is None) == (full.top_ids is None)
    if fast.top_ids is not None:
        assert torch.equal(fast.top_ids, full.top_ids) and torch.equal(fast.top_logprobs, full.top_logprobs)
    with pytest.raises(ValueError, match="must describe"):
        s.sample(logits, params[:3])


@pytest.mark.parametrize("block", [1, 3, 7, 512])
def test_row_blocked_logprobs_equal_the_whole_gather(block):
    """token_logprobs_rows (prompt logprobs, scores, the memory plan's measuring step) keeps its [rows, vocab]
    temporaries block-sized; per row it is the unblocked call's values (rows in any order, repeated, fewer than a
    block, an odd last block)."""
    from gdnserve.engine.execution.sampler import token_logprobs_rows
    g = torch.Generator().manual_seed(block)
    logits = torch.randn(40, 97, generator=g) * 4
    rows = torch.tensor([5, 0, 39, 5, 17, 18, 2, 33, 11, 11, 25, 8, 30, 1, 9, 21, 3])
    ids = torch.randint(0, 97, (rows.numel(),), generator=g)
    for top in (0, 5):
        want = token_logprobs(logits[rows], ids, top)
        got = token_logprobs_rows(logits, rows, ids, top, block=block)
        for w, x in zip(want, got):
            assert (w is None and x is None) or torch.allclose(w.float(), x.float(), atol=1e-6, rtol=0)
        assert got[1] is None or torch.equal(got[1], want[1])
    # the score path's use: the targets' log-softmax is the gathered logit minus the row's logsumexp
    want = logits[rows, ids] - logits[rows].logsumexp(-1)
    assert torch.allclose(token_logprobs_rows(logits, rows, ids, block=block)[0], want, atol=1e-6, rtol=0)
