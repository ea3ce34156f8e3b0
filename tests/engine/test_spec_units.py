"""Speculative-decoding units: the n-gram drafter finds the longest, most recent suffix match; the oracle
drafter errs exactly where asked; greedy acceptance keeps exactly the matching prefix for every count
0..k; rejection sampling emits tokens that follow the target's distribution (the joint of the first two
tokens, chi-square, through a bigram target so each position's distribution depends on the previous
token) for one-hot and random drafts. Chi-square tests fail by chance with probability ~1e-6 each."""
from __future__ import annotations

import random
import time

import numpy as np
import pytest
import torch

from gdnserve.speculative.acceptance import emitted_tokens, greedy_accept, rejection_sample
from gdnserve.speculative.ngram import NgramDrafter, OracleDrafter
from tests.engine.test_sampler import chi2_limit

# ---------------------------------------------------------------- n-gram drafter


def test_ngram_longest_match_wins_over_more_recent_shorter():
    # suffix [7, 8, 9]: the 3-gram occurs at 0..2 (followed by 1, 2); the 1-gram 9 alone more recently (-> 5)
    ctx = [7, 8, 9, 1, 2, 3, 9, 5, 4, 7, 8, 9]
    assert NgramDrafter(k=2, max_ngram=3).propose(ctx) == [1, 2]
    assert NgramDrafter(k=2, max_ngram=1).propose(ctx) == [5, 4]


def test_ngram_most_recent_occurrence_and_k_truncation():
    ctx = [1, 2, 10, 11, 12, 13, 1, 2, 20, 21, 22, 23, 1, 2]
    assert NgramDrafter(k=3, max_ngram=2).propose(ctx) == [20, 21, 22]
    assert NgramDrafter(k=1, max_ngram=2).propose(ctx) == [20]
    assert NgramDrafter(k=6, max_ngram=2).propose(ctx) == [20, 21, 22, 23, 1, 2]


def test_ngram_no_match_and_min_ngram():
    assert NgramDrafter(k=3).propose([5, 6, 7, 8]) == []
    assert NgramDrafter(k=3).propose([5]) == []
    ctx = [3, 4, 1, 9, 2, 4]  # only the 1-gram [4] recurs
    assert NgramDrafter(k=2, min_ngram=1).propose(ctx) == [1, 9]
    assert NgramDrafter(k=2, min_ngram=2).propose(ctx) == []


def test_ngram_overlapping_match_continues_the_period():
    assert NgramDrafter(k=4).propose([9, 5, 5, 5, 5]) == [5, 5, 5, 5]
    assert NgramDrafter(k=5, max_ngram=3).propose([0, 1, 2, 1, 2]) == [1, 2, 1, 2, 1]


def test_ngram_window_and_numpy_input():
    ctx = [42, 43, 44] + list(range(100, 200)) + [42]
    assert NgramDrafter(k=2).propose(ctx) == [43, 44]
    assert NgramDrafter(k=2, window=50).propose(ctx) == []  # the earlier 42 is outside the window
    assert NgramDrafter(k=2).propose(np.array(ctx, dtype=np.int64)) == [43, 44]


def test_ngram_matches_a_brute_force_reference(seed):
    def reference(ctx, k, max_n, min_n):
        for n in range(max_n, min_n - 1, -1):
            if n >= len(ctx):
                continue
            for end in range(len(ctx) - 1, n - 1, -1):
                if ctx[end - n:end] == ctx[-n:]:
                    ext = list(ctx)
                    while len(ext) < end + k:
                        ext.append(ext[end + len(ext) - len(ctx)])
                    return ext[end:end + k]
        return []

    for _ in range(300):
        ctx = [random.randrange(4) for _ in range(random.randrange(1, 40))]
        k, max_n = random.randint(1, 5), random.randint(1, 4)
        min_n = random.randint(1, max_n)
        assert NgramDrafter(k, max_n, min_n).propose(ctx) == reference(ctx, k, max_n, min_n), (ctx, k, max_n, min_n)


def test_ngram_long_context_is_fast():
    ctx = [random.randrange(150_000) for _ in range(10_000)]
    d = NgramDrafter(k=3)
    t0 = time.perf_counter()
    for _ in range(100):
        d.propose(ctx)
    assert (time.perf_counter() - t0) / 100 < 5e-3


def test_propose_padded():
    d = NgramDrafter(k=4, max_ngram=2)
    assert d.propose_padded([1, 2, 3, 1, 2, 3, 7, 1, 2]) == ([3, 7, 1, 2], 4)
    assert d.propose_padded([1, 2, 9, 1, 2]) == ([9, 1, 2, 9], 4)
    assert d.propose_padded([5, 6, 7]) == ([7, 7, 7, 7], 0)
    assert d.propose_padded([1, 2, 9, 1, 2], k=2) == ([9, 1], 2)
    assert d.propose_padded([1, 2, 9, 1, 2], k=6) == ([9, 1, 2, 9, 9, 9], 4)
    with pytest.raises(ValueError, match="token_ids"):
        d.propose_padded([])


def test_drafter_arguments_validated():
    for kwargs in (dict(k=0), dict(k=2, min_ngram=0), dict(k=2, max_ngram=2, min_ngram=3), dict(k=2, window=3)):
        with pytest.raises(ValueError):
            NgramDrafter(**kwargs)

# ---------------------------------------------------------------- oracle drafter


def test_oracle_drafter_error_pattern():
    future = [random.randrange(1000) for _ in range(50)]
    for k in (1, 2, 3):
        for e in range(k + 1):
            drafts = OracleDrafter(future, k, e).propose(future[:20])
            assert len(drafts) == k
            assert drafts[:k - e] == future[20:20 + k - e]
            assert all(d != t and d >= 0 for d, t in zip(drafts[k - e:], future[20 + k - e:]))
    d = OracleDrafter([3, 0, 1, 2], k=3, errors_per_step=lambda pos: pos)
    assert d.propose([3]) == [0, 1, 1]
    assert d.propose([3, 0]) == [1, 1]  # future ends: 2 drafts; positions 1 and 2 of 3 wrong
    assert d.propose([3, 0, 1]) == [1]
    assert d.propose_padded([3, 0]) == ([1, 1, 1], 2)
    with pytest.raises(ValueError, match="errors_per_step"):
        d.propose([3, 0, 1, 2])
    with pytest.raises(ValueError, match="diverged"):
        d.propose([3, 1])


def test_oracle_drives_every_greedy_acceptance_count():
    V, k, L = 97, 3, 40
    future = [random.randrange(V) for _ in range(L + k + 1)]
    d = OracleDrafter(future, k, errors_per_step=lambda pos: pos % (k + 1))
    positions = range(10, 10 + 2 * (k + 1))
    drafts = torch.tensor([d.propose(future[:pos]) for pos in positions])
    target = torch.tensor([future[pos:pos + k + 1] for pos in positions])
    num_accepted, emitted = greedy_accept(drafts, target)
    assert num_accepted.tolist() == [k - pos % (k + 1) for pos in positions]
    assert emitted_tokens(num_accepted, emitted) == [future[p:p + k + 1 - p % (k + 1)] for p in positions]

# ---------------------------------------------------------------- greedy acceptance


@pytest.mark.parametrize("k", [0, 1, 2, 3, 5])
def test_greedy_accept_every_count(k):
    V, reps = 31, 3
    B = (k + 1) * reps
    target = torch.randint(0, V, (B, k + 1))
    drafts = target[:, :k].clone()
    want = torch.arange(B) % (k + 1)  # row b accepts want[b] drafts; want = k: all accepted plus the bonus
    for b in range(B):
        a = int(want[b])
        if a < k:
            drafts[b, a] = (target[b, a] + 1 + random.randrange(V - 1)) % V
            if a + 1 < k and b % 2:  # a later draft that matches again must not count
                drafts[b, a + 1] = target[b, a + 1]
    num_accepted, emitted = greedy_accept(drafts, target)
    assert num_accepted.dtype == torch.int64 and torch.equal(num_accepted, want)
    for b in range(B):
        a = int(want[b])
        assert emitted[b, :a + 1].tolist() == target[b, :a + 1].tolist()
        assert (emitted[b, a + 1:] == -1).all()
    assert emitted_tokens(num_accepted, emitted) == [target[b, :int(want[b]) + 1].tolist() for b in range(B)]


def test_acceptance_validates_shapes():
    d = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="target_argmax"):
        greedy_accept(d, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="draft_ids"):
        greedy_accept(d.int(), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(d, None, torch.rand(2, 3, 5))
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(d, torch.rand(2, 3, 6), torch.rand(2, 4, 5))

# ---------------------------------------------------------------- rejection sampling


def random_dist(shape, zeros: bool) -> torch.Tensor:
    """Random distributions over the last dim, min entry >= ~0.05 (chi-square needs counts); with
    ``zeros``, token 3 is filtered out of every row (as top-k / top-p would)."""
    p = torch.rand(shape, dtype=torch.float64) + 0.3
    if zeros:
        p[..., 3] = 0
    return p / p.sum(-1, keepdim=True)


def spec_step(ctx: torch.Tensor, P: torch.Tensor, Q: torch.Tensor | None, D: torch.Tensor, k: int,
              g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One verify step over N independent rows of a bigram target ``P[prev] -> next``: drafts are drawn
    from the bigram ``Q`` (or, with Q None, deterministically ``D[prev]``), target probs gathered along
    the draft path, as a real verify step computes them."""
    drafts, prev = [], ctx
    for _ in range(k):
        prev = D[prev] if Q is None else torch.multinomial(Q[prev], 1, generator=g).squeeze(1)
        drafts.append(prev)
    draft_ids = torch.stack(drafts, 1) if k else ctx.new_zeros(len(ctx), 0)
    path = torch.cat([ctx[:, None], draft_ids], 1)            # the K + 1 tokens fed to the target
    draft_probs = None if Q is None else Q[path[:, :k]]
    return rejection_sample(draft_ids, draft_probs, P[path], g)


def assert_counts(outcomes: torch.Tensor, probs: torch.Tensor) -> None:
    counts = torch.bincount(outcomes, minlength=probs.numel()).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "emitted a token the target gives probability 0"
    expected = probs[support] * outcomes.numel()
    assert expected.min() >= 20, "test set-up: expected counts too small"
    stat = ((counts[support] - expected) ** 2 / expected).sum().item()
    dof = int(support.sum()) - 1
    assert stat < chi2_limit(dof), f"chi2 {stat:.1f} over {dof} dof (limit {chi2_limit(dof):.1f})"


@pytest.mark.parametrize("drafts", ["one_hot", "random_q"])
@pytest.mark.parametrize("k", [1, 2])
def test_rejection_sampling_preserves_target_distribution(drafts, k, seed):
    V, N = 4, 20_000
    g = torch.Generator().manual_seed(seed)
    P = random_dist((V, V), zeros=True)   # target bigram; token 3 never allowed (filtered)
    Q = random_dist((V, V), zeros=False) if drafts == "random_q" else None
    D = torch.tensor([3, 2, 0, 1])        # deterministic drafts, 3 (always rejected) included
    ctx = torch.randint(0, V - 1, (N,), generator=g)
    # first step; rows that emitted one token take a second step from it
    na, em = spec_step(ctx, P, Q, D, k, g)
    assert ((na >= 0) & (na <= k)).all() and (em.gather(1, na[:, None]) >= 0).all()
    na2, em2 = spec_step(em[:, 0], P, Q, D, k, g)
    t0, t1 = em[:, 0], torch.where(na >= 1, em[:, 1], em2[:, 0])
    for c in range(V - 1):
        rows = ctx == c
        assert_counts(t0[rows], P[c])                                       # first token ~ p(. | c)
        assert_counts((t0 * V + t1)[rows], (P[c][:, None] * P).flatten())  # (t0, t1) ~ p(. | c) p(. | t0)
    if k == 2:  # the bonus: after two accepted drafts, from p(. | x_1)
        full = na == 2
        for x1 in range(V - 1):
            rows = full & (em[:, 1] == x1)
            if rows.sum() >= 500:
                assert_counts(em[rows, 2], P[x1])
    # acceptance rate of the first draft: sum_x min(p(x), q(x)), averaged over contexts
    q0 = torch.nn.functional.one_hot(D[ctx], V).double() if Q is None else Q[ctx]
    rate = torch.minimum(P[ctx], q0).sum(-1).mean().item()
    assert abs((na >= 1).double().mean().item() - rate) < 5 * (rate * (1 - rate) / N) ** 0.5 + 1e-9


@pytest.mark.parametrize("k", [0, 1, 3])
def test_rejection_sample_bonus_and_one_hot_target_is_greedy(k, seed):
    V, B = 11, 64
    g = torch.Generator().manual_seed(seed)
    argmax = torch.randint(0, V, (B, k + 1), generator=g)
    target = torch.nn.functional.one_hot(argmax, V).float()  # temperature -> 0
    drafts = argmax[:, :k].clone()
    wrong = torch.rand(B, k, generator=g) < 0.3
    drafts[wrong] = (drafts[wrong] + 1) % V
    for draft_probs in (None, torch.softmax(torch.randn(B, k, V, generator=g), -1)):
        na, em = rejection_sample(drafts, draft_probs, target, g)
        ga, gem = greedy_accept(drafts, argmax)
        assert torch.equal(na, ga) and torch.equal(em, gem)
    assert (ga == k).any() and (k == 0 or (ga < k).any())


def test_rejection_sample_none_equals_explicit_one_hot(seed):
    V, B, k = 7, 257, 3
    target = torch.softmax(torch.randn(B, k + 1, V) * 2, -1)
    drafts = torch.randint(0, V, (B, k))
    runs = []
    for q in (None, torch.nn.functional.one_hot(drafts, V).float()):
        g = torch.Generator().manual_seed(seed)
        runs.append(rejection_sample(drafts, q, target, g))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    na, em = runs[0]
    assert emitted_tokens(na, em) == [em[b, :int(na[b]) + 1].tolist() for b in range(B)]
    assert (em[:, :k] == torch.where(torch.arange(k) < na[:, None], drafts, em[:, :k])).all()
