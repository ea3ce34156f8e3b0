"""Causal conv1d ops (prefill / decode / verify / fold) against the float64 reference and against each
other. Conv state is a copy of inputs, so every pool comparison is bit-exact; outputs use vLLM's bars
(gdn_kernels.md §6.4). Inputs are fresh random every run (the seed is printed on failure)."""
from __future__ import annotations


import pytest
import torch

from gdnserve.ops.conv import causal_conv1d_fold, causal_conv1d_prefill, causal_conv1d_update
from gdnserve.ops.conv.naive import naive_conv_prefill, naive_conv_update
from gdnserve.ops.varlen import VarlenMeta

BACKENDS = ["torch", "triton"]
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(rtol=3e-4, atol=1e-3), torch.bfloat16: dict(rtol=1e-2, atol=5e-2)}
I32 = torch.int32


pytestmark = pytest.mark.usefixtures("seed")   # fresh, printed seed per test (tests/conftest.py)


def idx(v, device) -> torch.Tensor:
    return torch.tensor(v, dtype=I32, device=device)


def rand_x(T: int, D: int, dtype, device) -> torch.Tensor:
    """[T, D] with row stride D + 24 (a column slice of a wider projection output)."""
    return torch.randn(T, D + 24, dtype=dtype, device=device)[:, 7:7 + D]


def rand_setup(D: int, W: int, S: int, dtype, device):
    w = (torch.randn(D, W, device=device) * 0.5).to(dtype)
    pool = torch.randn(S, W - 1, D, dtype=dtype, device=device)
    return w, pool


def nan_out(T: int, D: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN-poisoned output view with row stride > D, and the buffer it lives in."""
    buf = torch.full((T, D + 5), float("nan"), dtype=dtype, device=device)
    return buf[:, 2:2 + D], buf


def assert_y(y: torch.Tensor, ref: torch.Tensor, dtype) -> None:
    assert torch.isfinite(y).all(), "output has unwritten (NaN) or non-finite rows"
    torch.testing.assert_close(y.double().cpu(), ref.double().cpu(), **TOL[dtype])


def assert_same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert torch.equal(a.cpu(), b.cpu()), f"{what} differs (must be bit-exact)"


def prefill(backend, x, w, pool, lens, src, dst, parents=None, pad=0, activation="silu", out=None):
    dev = x.device
    meta = VarlenMeta.build(lens, dev)
    if pad:
        meta = VarlenMeta.build(lens, dev, pad_chunks_to=meta.num_chunks + pad)
    par = None if parents is None else idx(parents, dev)
    return causal_conv1d_prefill(x, w, pool, meta, idx(src, dev), idx(dst, dev), par,
                                 activation=activation, out=out, backend=backend)


def decode(backend, x, w, pool, slots, Lq, **kw):
    return causal_conv1d_update(x, w, pool, idx(slots, x.device), tokens_per_req=Lq, backend=backend, **kw)


# ---------------------------------------------------------------------------------------------- prefill

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("W,D", [(2, 200), (3, 96), (4, 96), (4, 200)])
def test_prefill_matches_naive(backend, dtype, W, D, device):
    lens = [1, 2, 3, 63, 64, 65, 0, 203, 5, 4, 2]
    # seq 2 continues seq 0 (length 1: short for W >= 3, so it reaches seq 0's src slot), seq 8 continues
    # the long seq 7, seq 9 continues the empty seq 6 (pure src history), seq 10 continues seq 1.
    parents = [-1, -1, 0, -1, -1, -1, -1, -1, 7, 6, 1]
    N = len(lens)
    perm = torch.randperm(3 * N).tolist()
    src = [perm[n] for n in range(N)]
    dst = [perm[N + n] for n in range(N)]
    src[4] = -1             # zeros history
    dst[5] = -1             # no write
    dst[3] = src[3]         # in place
    src[2] = perm[2 * N]    # ignored: seq 2 has a parent
    x = rand_x(sum(lens), D, dtype, device)
    w, pool = rand_setup(D, W, 3 * N + 2, dtype, device)
    ref_y, ref_pool = naive_conv_prefill(x, w, pool, lens, src, dst, parents)
    out, buf = nan_out(sum(lens), D, dtype, device)
    y = prefill(backend, x, w, pool, lens, src, dst, parents, pad=3, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert_y(y, ref_y, dtype)
    assert torch.isnan(buf[:, :2]).all() and torch.isnan(buf[:, 2 + D:]).all(), "wrote outside out"
    assert_same(pool, ref_pool, "conv_pool")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_equals_per_sequence(backend, dtype, device):
    D, W = 200, 4
    lens = [65, 1, 0, 64, 2, 130, 3]
    N = len(lens)
    src = [3, -1, 5, 0, 1, 2, 4]
    dst = [7, 8, -1, 10, 1, 12, 13]          # seq 4 in place
    x = rand_x(sum(lens), D, dtype, device)
    w, pool = rand_setup(D, W, 14, dtype, device)
    pool_packed = pool.clone()
    y = prefill(backend, x, w, pool_packed, lens, src, dst)
    cu = [0]
    for L in lens:
        cu.append(cu[-1] + L)
    for n in range(N):
        y_n = prefill(backend, x[cu[n]:cu[n + 1]], w, pool, [lens[n]], [src[n]], [dst[n]])
        assert_same(y[cu[n]:cu[n + 1]], y_n, f"y of sequence {n}")
    assert_same(pool_packed, pool, "conv_pool")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("W", [2, 4])
def test_parent_equals_serial(backend, dtype, W, device):
    """Parents in one call == parents first (writing their dst), then children from those slots."""
    D = 96
    p_lens, c_lens = [0, 1, 2, 70], [3, 65, 1, 2]
    P = len(p_lens)
    p_src, p_dst = [0, 1, 2, -1], [4, 5, 6, 7]
    c_dst = [8, 9, -1, 11]
    x_p = rand_x(sum(p_lens), D, dtype, device)
    x_c = rand_x(sum(c_lens), D, dtype, device)
    w, pool = rand_setup(D, W, 12, dtype, device)

    pool_one = pool.clone()
    x = torch.cat([x_p, x_c])
    y = prefill(backend, x, w, pool_one, p_lens + c_lens, p_src + [10] * P, p_dst + c_dst,
                [-1] * P + list(range(P)))

    y_p = prefill(backend, x_p, w, pool, p_lens, p_src, p_dst)
    y_c = prefill(backend, x_c, w, pool, c_lens, p_dst, c_dst)
    assert_same(y, torch.cat([y_p, y_c]), "y")
    assert_same(pool_one, pool, "conv_pool")


@pytest.mark.parametrize("backend", BACKENDS)
def test_in_place_and_no_write(backend, device):
    D, W, dtype = 96, 4, torch.bfloat16
    lens = [1, 2, 70, 0, 5, 3]
    src = [0, 1, 2, 3, 4, 5]
    dst = [0, -1, 2, 3, -1, -1]               # in place or no write
    x = rand_x(sum(lens), D, dtype, device)
    w, pool = rand_setup(D, W, 8, dtype, device)
    before = pool.clone()
    ref_y, ref_pool = naive_conv_prefill(x, w, pool, lens, src, dst)
    y = prefill(backend, x, w, pool, lens, src, dst)
    assert_y(y, ref_y, dtype)
    assert_same(pool, ref_pool, "conv_pool")
    assert_same(pool[[1, 4, 5, 6, 7]], before[[1, 4, 5, 6, 7]], "slots that nobody writes")
    assert not torch.equal(pool[2], before[2]), "in-place slot was not updated"


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_token_call_copies_history(backend, device):
    D, W, dtype = 96, 3, torch.float32
    w, pool = rand_setup(D, W, 6, dtype, device)
    ref_y, ref_pool = naive_conv_prefill(rand_x(0, D, dtype, device), w, pool, [0, 0, 0], [0, -1, 2], [3, 4, 2])
    y = prefill(backend, rand_x(0, D, dtype, device), w, pool, [0, 0, 0], [0, -1, 2], [3, 4, 2])
    assert y.shape == (0, D)
    assert_same(pool, ref_pool, "conv_pool")
    assert (pool[4] == 0).all() and torch.equal(pool[3], pool[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_activation(backend, device):
    D, W, dtype = 96, 4, torch.float32
    lens = [3, 66]
    x = rand_x(sum(lens), D, dtype, device)
    w, pool = rand_setup(D, W, 4, dtype, device)
    ref_y, _ = naive_conv_prefill(x, w, pool, lens, [0, 1], [2, 3], activation=None)
    assert_y(prefill(backend, x, w, pool, lens, [0, 1], [2, 3], activation=None), ref_y, dtype)
    xu = rand_x(4, D, dtype, device)
    ref_y, _, _ = naive_conv_update(xu, w, pool, [2, 3], 2, activation=None)
    assert_y(decode(backend, xu, w, pool, [2, 3], 2, activation=None), ref_y, dtype)


# ---------------------------------------------------------------------------------------------- decode

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("W", [2, 3, 4])
def test_prefill_then_decode_equals_long_prefill(backend, dtype, W, device):
    D, steps = 200, 4
    pre = [1, 2, 65]
    B = len(pre)
    x_pre = [rand_x(L, D, dtype, device) for L in pre]
    x_dec = [rand_x(B, D, dtype, device) for _ in range(steps)]
    w, pool = rand_setup(D, W, 8, dtype, device)
    pool_long = pool.clone()

    prefill(backend, torch.cat(x_pre), w, pool, pre, [0, 1, -1], [4, 5, 6])
    slots = [4, -1, 5, 6]                            # a padding request in the batch
    ys = []
    for x_t in x_dec:
        x_in = torch.cat([x_t[:1], rand_x(1, D, dtype, device), x_t[1:]])
        ys.append(decode(backend, x_in, w, pool, slots, 1)[[0, 2, 3]])

    full = [torch.cat([x_pre[n]] + [x_t[n:n + 1] for x_t in x_dec]) for n in range(B)]
    y_long = prefill(backend, torch.cat(full), w, pool_long, [L + steps for L in pre], [0, 1, -1], [4, 5, 6])
    assert_same(pool, pool_long, "conv_pool after decode vs one prefill")
    cu = [0]
    for L in pre:
        cu.append(cu[-1] + L + steps)
    for n in range(B):
        y_dec = torch.stack([y_t[n] for y_t in ys])
        assert_y(y_dec, y_long[cu[n + 1] - steps:cu[n + 1]], dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Lq", [1, 3])
def test_update_padding_and_naive(backend, dtype, Lq, device):
    D, W = 96, 4
    slots = [2, -1, 0, -1, 5]
    pin, npend, pout = [0, 1, -1, 2, 3], [2, 1, 0, 3, 4], [4, 5, 6, 7, -1]
    B = len(slots)
    x = rand_x(B * Lq, D, dtype, device)
    w, pool = rand_setup(D, W, 7, dtype, device)
    pending = torch.randn(8, 4, D, dtype=dtype, device=device)
    pool0, pend0 = pool.clone(), pending.clone()
    ref_y, ref_pool, ref_pend = naive_conv_update(x, w, pool, slots, Lq, "final", pending, pin, npend, pout)
    out, _ = nan_out(B * Lq, D, dtype, device)
    y = decode(backend, x, w, pool, slots, Lq, pending_x=pending, pending_in_rows=idx(pin, device),
               num_pending=idx(npend, device), pending_out_rows=idx(pout, device), out=out)
    assert_y(y, ref_y, dtype)
    for n in (1, 3):
        assert (y[n * Lq:(n + 1) * Lq] == 0).all(), "padding request rows must be zeros"
    assert_same(pool, ref_pool, "conv_pool")
    assert_same(pending, ref_pend, "pending_x")
    assert_same(pool[[1, 3, 4, 6]], pool0[[1, 3, 4, 6]], "unused slots")
    assert_same(pending[[5, 7]], pend0[[5, 7]], "pending rows of padding requests")


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_padding_leaves_pool(backend, device):
    D, W, dtype = 200, 4, torch.bfloat16
    w, pool = rand_setup(D, W, 3, dtype, device)
    before = pool.clone()
    out, _ = nan_out(3, D, dtype, device)
    y = decode(backend, rand_x(3, D, dtype, device), w, pool, [-1, -1, -1], 1, out=out)
    assert (y == 0).all()
    assert_same(pool, before, "conv_pool")


# ---------------------------------------------------------------------------------------------- verify

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("W", [2, 3, 4])
def test_verify_then_fold_equals_decode(backend, dtype, W, device):
    """'intermediate' mode: verify stores the drafted inputs, then folding a accepted ones equals
    decoding those a tokens one at a time, for every a in 0..K (one request per a)."""
    D, K = 96, 3
    Lq, B = K + 1, K + 1
    slots = [3, 0, 5, 2]
    x = rand_x(B * Lq, D, dtype, device)
    w, pool = rand_setup(D, W, 6, dtype, device)
    pending = torch.randn(2 * B, Lq + 1, D, dtype=dtype, device=device)
    pout = [4, 6, 1, 7]
    pool_dec = pool.clone()
    ref_y, _, _ = naive_conv_update(x, w, pool, slots, Lq, "none")
    y = decode(backend, x, w, pool, slots, Lq, write_state="none", pending_x=pending,
               pending_out_rows=idx(pout, device))
    assert_y(y, ref_y, dtype)
    assert_same(pool, pool_dec, "conv_pool after write_state='none'")
    assert_same(pending[pout, :Lq], x.reshape(B, Lq, D), "pending_x drafted rows")

    accepted = list(range(K + 1))                  # request n accepts n tokens
    causal_conv1d_fold(pool, idx(slots, device), pending, idx(pout, device), idx(accepted, device),
                       backend=backend)
    xv = x.reshape(B, Lq, D)
    for t in range(K):
        live = [s if accepted[n] > t else -1 for n, s in enumerate(slots)]
        y_t = decode(backend, xv[:, t].contiguous(), w, pool_dec, live, 1)
        for n in range(B):
            if accepted[n] > t:
                assert_y(y_t[n:n + 1], y[n * Lq + t:n * Lq + t + 1].double(), dtype)
    assert_same(pool, pool_dec, "conv_pool: fold vs token-by-token decode")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_replay_equals_fold_then_verify(backend, dtype, device):
    """'replay' mode: folding the previous step's accepted drafts at the start of the next verify
    (write_state='after_pending') == an explicit fold followed by a plain verify."""
    D, W, K = 200, 4, 3
    Lq = K + 1
    slots = [1, 4, -1, 0, 2]
    B = len(slots)
    pin = [0, 1, 2, -1, 3]                      # previous step's drafts (ping)
    npend = [K + 1, 0, 2, 3, 2]
    pout = [5, 6, 7, 8, 9]                      # this step's drafts (pong)
    x = rand_x(B * Lq, D, dtype, device)
    w, pool = rand_setup(D, W, 6, dtype, device)
    pending = torch.randn(10, Lq, D, dtype=dtype, device=device)
    pool_b, pend_b = pool.clone(), pending.clone()
    ref_y, ref_pool, ref_pend = naive_conv_update(x, w, pool, slots, Lq, "after_pending", pending, pin, npend, pout)

    y_a = decode(backend, x, w, pool, slots, Lq, write_state="after_pending", pending_x=pending,
                 pending_in_rows=idx(pin, device), num_pending=idx(npend, device), pending_out_rows=idx(pout, device))
    causal_conv1d_fold(pool_b, idx(slots, device), pend_b, idx(pin, device), idx(npend, device), backend=backend)
    y_b = decode(backend, x, w, pool_b, slots, Lq, write_state="none", pending_x=pend_b,
                 pending_out_rows=idx(pout, device))
    assert_y(y_a, ref_y, dtype)
    assert_same(pool, ref_pool, "conv_pool vs naive")
    assert_same(pending, ref_pend, "pending_x vs naive")
    assert_same(y_a, y_b, "y: replay vs fold-then-verify")
    assert_same(pool, pool_b, "conv_pool: replay vs fold-then-verify")
    assert_same(pending, pend_b, "pending_x: replay vs fold-then-verify")


# ---------------------------------------------------------------------------------------------- validation

def _bad_cases(device):
    D, W, dt = 96, 4, torch.bfloat16
    x = rand_x(5, D, dt, device)
    w, pool = rand_setup(D, W, 4, dt, device)
    meta = VarlenMeta.build([2, 3], device)
    s2 = idx([0, 1], device)
    pend = torch.zeros(4, 3, D, dtype=dt, device=device)

    def pf(**kw):
        args = dict(x=x, weight=w, conv_pool=pool, meta=meta, src_slots=s2, dst_slots=s2)
        args.update(kw)
        return lambda be: causal_conv1d_prefill(**args, backend=be)

    def up(**kw):
        args = dict(x=x[:4], weight=w, conv_pool=pool, slots=s2, tokens_per_req=2)
        args.update(kw)
        return lambda be: causal_conv1d_update(**args, backend=be)

    return {
        "conv_pool  ": pf(x=x.float()),                         # pool dtype differs from x
        "x ": pf(x=torch.randn(D, 5, dtype=dt, device=device).t()),   # channel stride != 1
        "x  ": pf(x=x[:4]),                                     # rows != meta.num_tokens
        "x   ": pf(x=x.to(torch.int32)),
        "weight": pf(weight=w[:, :1]),                          # W < 2
        "conv_pool   ": pf(weight=w[:, :3]),                    # pool holds W-1 = 3 rows, weight says 2
        "weight ": pf(weight=w[:50]),
        "conv_pool": pf(conv_pool=torch.zeros(8, W - 1, D, dtype=dt, device=device)[::2]),  # not contiguous
        "conv_pool ": pf(conv_pool=pool[:, :2]),
        "src_slots": pf(src_slots=s2.long()),
        "dst_slots": pf(dst_slots=idx([0, 1, 2], device)),
        "parents": pf(parents=idx([-1], device)),
        "out": pf(out=torch.empty(5, D + 1, dtype=dt, device=device)),
        "activation": pf(activation="relu"),
        "slots": up(slots=s2.long()),
        "x    ": up(tokens_per_req=3),
        "pending_x": up(pending_x=pend.float(), pending_out_rows=s2),
        "pending_x ": up(pending_x=pend[:, :1].contiguous(), pending_out_rows=s2),
        "num_pending": up(pending_x=pend, pending_in_rows=s2),
        "write_state": up(write_state="all"),
        "tokens_per_req": up(x=x[:0], tokens_per_req=-1),
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_inputs_raise(backend, device):
    for name, call in _bad_cases(device).items():
        with pytest.raises(ValueError, match=name.strip()):
            call(backend)
    pool = torch.zeros(4, 3, 96, device=device)
    with pytest.raises(ValueError, match="num_pending"):
        causal_conv1d_fold(pool, idx([0], device), torch.zeros(2, 3, 96, device=device), idx([0], device),
                           idx([0, 1], device), backend=backend)
