"""The chunked (WY-form) recurrent kernel that the Triton path takes for replay verify, decodes with pending
tokens and flushes: against the float64 token-by-token reference (gdn_kernels.md §6.4: bf16 output 2.5e-3,
fp32 state 1e-5) and against the token-by-token Triton kernel. Fresh random inputs, random non-zero states
and pending rows, every acceptance count 0..Lmax, grouped value heads r = 1..4, ragged head sizes, padded
slots (-1) and nothing-applied slots left bit-identical."""
from __future__ import annotations

import pytest
import torch

from gdnserve.ops.gdn.naive import naive_recurrent
from gdnserve.ops.gdn.recurrent import GDNPending, gdn_decode, gdn_flush_pending, gdn_verify
from gdnserve.ops.gdn.recurrent_triton import recurrent_plan
from gdnserve.ops.launch import launch
from gdnserve.ops.numerics import rel_rms
from tests.ops.test_gdn_recurrent import (BF16, DEV, F32, TOL_O_BF16, TOL_S, idx, make_inputs, poisoned, qkvab,
                                          rand_pool, same_bits)


def rand_pending(P, Lp, H, HV, K, V, gate_a=0.0):
    p = GDNPending.empty(P, Lp, H, HV, K, V, BF16, DEV)
    for t in (p.k, p.v, p.b):
        t.copy_(torch.randn(t.shape, device=DEV).to(BF16))
    p.a.copy_((gate_a + torch.randn(p.a.shape, device=DEV)).to(BF16))
    return p


def ref_replay(x, n, L, pend, row, npend, state):
    """fp64 (pending outputs are discarded: k stands in for their q): the state after request n's npend pending tokens, then its L outputs and the final state."""
    S = state.double()
    if row >= 0:
        for t in range(npend):
            _, S = naive_recurrent(pend.k[row, t:t + 1], pend.k[row, t:t + 1], pend.v[row, t:t + 1],
                                   pend.a[row, t:t + 1], pend.b[row, t:t + 1], x["A_log"], x["dt_bias"], S)
    after = S
    outs = []
    for t in range(n * L, (n + 1) * L):
        o, S = naive_recurrent(*qkvab(x, slice(t, t + 1)), x["A_log"], x["dt_bias"], S)
        outs.append(o[0])
    return after, (torch.stack(outs) if outs else None), S


# every head shape with two gate regimes, every regime at two head shapes (the regimes change no kernel
# specialisation, the 4 x 4 cross product ran each shape's kernels four times)
@pytest.mark.parametrize("H,r,K,V,gate", [(2, 1, 32, 32, "strong"), (2, 1, 32, 32, "huge"), (1, 2, 16, 24, "slow"),
                                          (1, 2, 16, 24, "mixed"), (1, 3, 24, 40, "huge"), (1, 3, 24, 40, "strong"),
                                          (1, 4, 16, 16, "mixed"), (1, 4, 16, 16, "slow")])
def test_replay_verify_matches_reference(H, r, K, V, gate):
    L, Lp = 4, 4
    HV = H * r
    npend = [0, 1, 2, 3, 4, 2]
    B = len(npend)
    x = make_inputs(B * L, H, HV, K, V, gate="huge" if gate == "mixed" else gate)
    pend = rand_pending(2 * B + 1, Lp, H, HV, K, V, 20.0 if gate == "huge" else 0.0)
    if gate == "mixed":   # g ~ -330 on the first pending token, ~ -5e-3 after it: |gamma| large, steps small
        pend.a[:, 0] = 20.0
        pend.a[:, 1:] = -8.0 + 0.1 * torch.randn(pend.a[:, 1:].shape, device=DEV)
        x["a"].copy_((-8.0 + 0.1 * torch.randn(x["a"].shape, device=DEV)).to(BF16))
    pool = rand_pool(B + 3, HV, V, K)
    slots = idx(5, 0, 2, 7, 3, -1)
    rows_in = idx(0, 1, -1, 3, 4, 5)          # request 2: row -1 means nothing pending whatever its count
    rows_out = idx(6, 7, 8, -1, 10, 11)       # request 3 stores no pending inputs
    pend0 = [t.clone() for t in (pend.k, pend.v, pend.a, pend.b)]
    new = pool.clone()
    out = poisoned(B * L, HV, V, dtype=BF16)
    o = gdn_verify(*qkvab(x), x["A_log"], x["dt_bias"], new, slots, tokens_per_req=L, mode="replay", pending=pend,
                   pending_in_rows=rows_in, num_pending=idx(*npend), pending_out_rows=rows_out, out=out,
                   backend="triton")
    assert o is out and torch.isfinite(o).all()
    for n, s in enumerate(slots.tolist()):
        sl = slice(n * L, (n + 1) * L)
        if s < 0:
            assert (o[sl] == 0).all()
            continue
        row = rows_in[n].item()
        applied = npend[n] if row >= 0 else 0
        after, ro, _ = ref_replay(x, n, L, pend, row, applied, pool[s])
        assert rel_rms(o[sl], ro.to(BF16)) <= TOL_O_BF16, n
        if applied == 0:
            assert same_bits(new[s], pool[s])          # nothing applied: the slot is not written
        else:
            assert rel_rms(new[s], after) <= TOL_S, n
        pr = rows_out[n].item()
        if pr >= 0:
            for t, src in ((pend.k, x["k"]), (pend.v, x["v"]), (pend.a, x["a"]), (pend.b, x["b"])):
                assert same_bits(t[pr, :L], src[sl])
    for s in (1, 4, 6, 8):
        assert same_bits(new[s], pool[s])
    for t, t0 in zip((pend.k, pend.v, pend.a, pend.b), pend0):   # rows read, rows of skipped requests
        assert same_bits(t[[0, 1, 2, 3, 4, 5, 9]], t0[[0, 1, 2, 3, 4, 5, 9]])


@pytest.mark.parametrize("pool_dtype", [F32, BF16])
def test_decode_with_pending_and_flush(pool_dtype):
    """write_state final (a decode consuming pending tokens) and the flush (no new tokens) take the chunk."""
    H, HV, K, V, Lp = 2, 4, 32, 16, 3
    B = 3
    x = make_inputs(B, H, HV, K, V, gate="slow")
    pend = rand_pending(B, Lp, H, HV, K, V)
    pool = rand_pool(4, HV, V, K, pool_dtype)
    slots, rows, npend = idx(3, 1, -1), idx(2, 0, 1), [3, 0, 2]
    tol = TOL_S if pool_dtype == F32 else 2 ** -8
    new = pool.clone()
    o = gdn_decode(*qkvab(x), x["A_log"], x["dt_bias"], new, slots, pending=pend, pending_in_rows=rows,
                   num_pending=idx(*npend), backend="triton")
    flushed = pool.clone()
    gdn_flush_pending(flushed, slots, pend, rows, idx(*npend), A_log=x["A_log"], dt_bias=x["dt_bias"],
                      backend="triton")
    for n, s in enumerate(slots.tolist()[:2]):
        after, ro, final = ref_replay(x, n, 1, pend, rows[n].item(), npend[n], pool[s].double())
        assert rel_rms(o[n], ro[0].to(BF16)) <= TOL_O_BF16
        assert rel_rms(new[s], final) <= tol
        if npend[n]:
            assert rel_rms(flushed[s], after) <= tol
        else:
            assert same_bits(flushed[s], pool[s])
    assert (o[2] == 0).all()
    for s in (0, 2):
        assert same_bits(new[s], pool[s]) and same_bits(flushed[s], pool[s])


@pytest.mark.parametrize("L,Lp", [(8, 8), (2, 1), (5, 0)])
def test_chunked_equals_token_by_token_kernel(L, Lp):
    """The two Triton kernels on the same call (up to 16 positions): states 1e-5, outputs 2.5e-3 apart."""
    H, HV, K, V = 1, 2, 16, 32
    B = 3
    x = make_inputs(B * L, H, HV, K, V, gate="mild")
    pool = rand_pool(4, HV, V, K)
    slots = idx(2, 0, 3)
    pend0 = rand_pending(2 * B, max(Lp, L), H, HV, K, V)
    pin, npend = (idx(0, 1, 2), idx(Lp, Lp - 1, Lp)) if Lp else (None, None)
    res = []
    for chunked in (False, True):
        new = pool.clone()
        pend = GDNPending(*(t.clone() for t in (pend0.k, pend0.v, pend0.a, pend0.b)))
        out = torch.empty(B * L, HV, V, dtype=BF16, device=DEV)
        fn, grid, args, nw, key = recurrent_plan(*qkvab(x), x["A_log"], x["dt_bias"], new, slots, L, "final", None,
                                                 None, pend, pin, npend, idx(3, 4, 5), K ** -0.5, out,
                                                 chunked=chunked)
        launch(fn, grid, args, nw, key=key)
        res.append((out, new, pend))
    (o0, s0, p0), (o1, s1, p1) = res
    assert rel_rms(o1, o0) <= TOL_O_BF16 and rel_rms(s1, s0) <= TOL_S
    assert same_bits(s1[1], pool[1])
    for t0, t1 in zip((p0.k, p0.v, p0.a, p0.b), (p1.k, p1.v, p1.a, p1.b)):
        assert same_bits(t0, t1)
