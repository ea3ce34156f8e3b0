"""Chunked prefill, the output and state paths' ChunkConfig variants (chunk_configs.py; the H200 takes its own row,
CI the default) against the float64 reference, and the two parent phases equal to one ticketed launch bit for bit.
Triton only (the PyTorch path has no launch config). The prep's variants: test_gdn_chunk_prep.py.

Each variant compiles its own kernels on the GPU (seconds each): a variant runs in the dtype(s) whose code it
changes, at test_gdn_chunk.SHAPE, not in a variant x dtype cross product."""
from __future__ import annotations

import pytest
import torch

from gdnserve.ops.gdn.chunk_configs import override
from tests.ops.gdn_inputs import gdn_inputs, random_pool
from tests.ops.test_gdn_chunk import SHAPE, check_variant_against_reference, run

OLD = dict(prep_out=False, store_kn=False, short_prep=0)   # snapshots h, U and the separate output kernel


# OLD in both dtypes (the output kernel; the state pass without the prep's Q' and without stored keys); the stored
# keys off with the prep's Q' on, and tf32 products on the fp32 state, in bf16 (with fp32 activations the state is
# never rounded for its products: state_f32 changes no arithmetic there)
@pytest.mark.parametrize("dtype,cfg", [(torch.float32, OLD), (torch.bfloat16, OLD),
                                       (torch.bfloat16, dict(store_kn=False)), (torch.bfloat16, dict(state_f32=True))],
                         ids=["old-fp32", "old-bf16", "no-kn-bf16", "state-f32-bf16"])
def test_path_variants_against_reference(dtype, cfg, device):
    check_variant_against_reference(dtype, cfg, device)


def test_parent_phases_equal_ticketed_launch(device):
    """Producers then consumers as two launches == one launch with tickets and flags, bit for bit."""
    H, HV, K, V = SHAPE[torch.bfloat16]
    lens, parents = [70, 20, 33, 0, 65, 1], [-1, 0, 0, 0, -1, 4]
    src, dst = [1, -1, 2, -1, 3, -1], [4, 5, 6, 7, 8, -1]
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(sum(lens), H, HV, K, V, torch.bfloat16, device)
    pool = random_pool(9, HV, V, K, torch.float32, device)
    res = []
    for phases in (True, False):
        p = pool.clone()
        with override(parent_phases=phases):
            res.append((run("triton", q, k, v, a, b, A_log, dt_bias, p, lens, src, dst, parents), p))
    assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])
    assert torch.equal(res[0][1][[0, 1, 2, 3]], pool[[0, 1, 2, 3]])
