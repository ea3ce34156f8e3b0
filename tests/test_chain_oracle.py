"""The greedy-chain oracle drafters of the HTTP benchmark's speculative rows (benchmarks/oracle_drafter.py, issue 27
item 3): drafts are the chain pi(t), pi(pi(t)), ... of the last token, the first floor(rate x k + u) right and the
rest wrong, so the mean accepted drafts per step is rate x k; the MTP wrapper runs the real head first."""
from __future__ import annotations

import argparse
import types

import torch

from benchmarks.bench_serve_http import spec_label
from benchmarks.oracle_drafter import ChainOracleDrafter, ChainOracleMTP

V, K = 50, 3
PERM = torch.randperm(V, generator=torch.Generator().manual_seed(0))


def chain(t: int) -> list[int]:
    out = []
    for _ in range(K):
        t = int(PERM[t])
        out.append(t)
    return out


def right_prefix(drafts: list[int], t: int) -> int:
    want = chain(t)
    n = 0
    while n < K and drafts[n] == want[n]:
        n += 1
    assert all(d != w for d, w in zip(drafts[n:], want[n:]))        # after the first wrong one, all wrong
    return n


def test_host_oracle_accepts_rate_times_k_on_average():
    for rate in (1.0, 0.6, 0.0):
        d = ChainOracleDrafter(PERM.tolist(), K, rate)
        got = [right_prefix(d.propose([1, 2] + [0] * n + [t]), t) for n in range(200) for t in (3, 7)]
        assert abs(sum(got) / len(got) - rate * K) < 0.1, (rate, sum(got) / len(got))


def test_mtp_oracle_runs_the_head_then_replaces_its_drafts():
    calls = []

    class FakeMTP:
        def draft(self, first, meta):
            calls.append(first.clone())
            return torch.zeros(len(first), K, dtype=torch.long)
    mtp = FakeMTP()
    ChainOracleMTP(mtp, PERM, K, 0.6)
    first = torch.arange(V)
    got = []
    for step in range(20):
        drafts = mtp.draft(first, types.SimpleNamespace(positions=torch.full((K, V), 100 + step)))
        got += [right_prefix(drafts[i].tolist(), i) for i in range(V)]
    assert len(calls) == 20 and torch.equal(calls[0], first)           # the real head ran every time
    assert abs(sum(got) / len(got) - 0.6 * K) < 0.1


def test_rows_name_their_speculative_setting():
    ns = lambda **kw: argparse.Namespace(**{"spec_k": None, "spec_draft": None, "spec_oracle": None, **kw})
    assert spec_label(ns()) == "none"
    assert spec_label(ns(spec_k=3, spec_draft="mtp", spec_oracle=0.6)) == "mtp k=3 oracle 0.6"
    assert spec_label(ns(spec_k=2)) == "ngram k=2"
