"""Chunked prefill, the prep's ChunkConfig variants (chunk_configs.py; the H200 takes its own row, CI the default):
the split over value heads bit for bit, the (I + 𝒜)⁻¹ variants and the full tile for short sequences against the
float64 reference, the short tile close to the full one. Triton only (the PyTorch path has no launch config).

Each variant compiles its own prep kernel on the GPU (seconds): a variant runs in the dtype(s) whose code it
changes, at test_gdn_chunk.SHAPE (whose default-config kernels are shared), not in a variant x dtype cross product."""
from __future__ import annotations

import pytest
import torch

from gdnserve.ops.gdn.chunk_configs import override
from gdnserve.ops.numerics import rel_rms
from tests.ops.gdn_inputs import gdn_inputs, random_pool
from tests.ops.test_gdn_chunk import SHAPE, check_variant_against_reference, run


def test_prep_split_over_value_heads_is_bit_identical(device):
    """The prep runs one program per key head (large grids) or per value head (small grids): the same
    arithmetic per value head, so outputs and states agree bit for bit. Three value heads per key head (with one
    the split changes nothing: a former HV = 2 case ran the same launch twice)."""
    H, HV, K, V = SHAPE[torch.bfloat16]
    lens = [1, 63, 64, 65, 130]
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(sum(lens), H, HV, K, V, torch.bfloat16, device)
    pool0 = random_pool(12, HV, V, K, torch.float32, device)
    res = []
    for below in (0, 1 << 30):     # never split / always split
        pool = pool0.clone()
        with override(prep_split_below=below):
            o = run("triton", q, k, v, a, b, A_log, dt_bias, pool, lens, [3, -1, 5, 6, 7], [8, 9, 5, 10, 11])
        res.append((o, pool))
    assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])


# Every (I + 𝒜)⁻¹ variant (substitution / batched product form on the diagonal 16x16 blocks + merge; the full
# product form with fp32 or bf16 operands: one of these two is each device row's default in bf16) and the full
# 64-row tile for short sequences (short_prep=0, in bf16: an fp32 prep compile takes 50-60 s on the H200 and the
# fp32 prep is already compiled by inv0 and the short-tile test below)
@pytest.mark.parametrize("dtype,cfg", [
    (torch.float32, dict(inv_mode=0)), (torch.bfloat16, dict(inv_mode=2, inv_bf16=False)),
    (torch.bfloat16, dict(inv_mode=1, inv_bf16=False)), (torch.bfloat16, dict(inv_mode=1, inv_bf16=True)),
    (torch.bfloat16, dict(short_prep=0))], ids=["inv0-fp32", "inv2-bf16", "inv1-bf16", "inv1-bf16ops-bf16",
                                                 "no-short-bf16"])
def test_prep_variants_against_reference(dtype, cfg, device):
    check_variant_against_reference(dtype, cfg, device)


# fp32 on the CPU only: on the H200 its two fp32 prep compiles took 134 s of the file's 188 s (12 files in parallel);
# the GPU still compiles and checks an fp32 prep (inv0-fp32 above) and the short tile in bf16 here
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.skipif(
    torch.cuda.is_available(), reason="fp32 short tile: CPU only (two ~60 s fp32 compiles on the GPU)")),
    torch.bfloat16])
def test_short_tile_close_to_full_tile(dtype, device):
    """Sequences of <= 32 tokens take a 32-row prep tile: the same math as the 64-row tile (rounding only)."""
    H, HV, K, V = SHAPE[dtype]
    lens = [1, 16, 31, 32, 33]
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(sum(lens), H, HV, K, V, dtype, device, "mild")
    pool = random_pool(10, HV, V, K, torch.float32, device)
    res = []
    for short in (32, 0):
        p = pool.clone()
        with override(short_prep=short):
            res.append((run("triton", q, k, v, a, b, A_log, dt_bias, p, lens, range(5), range(5, 10)), p))
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    assert rel_rms(res[0][0], res[1][0]) < tol and rel_rms(res[0][1], res[1][1]) < tol
    assert torch.equal(res[0][0][-33:], res[1][0][-33:])      # the 33-token sequence: the 64-row tile in both
