"""benchmarks/bench_decode_b1.py's host logic (its measurements need CUDA): merging a partial re-sweep into a table."""
from benchmarks.bench_decode_b1 import merge_table
from gdnserve.ops.gemv import SkinnyConfig


def test_merge_table_replaces_only_the_swept_ranges():
    a, b, c = SkinnyConfig(8, 1024, 8, 1, False), SkinnyConfig(32, 256, 4, 4), SkinnyConfig(2, 4096, 4, 1, False)
    old = {(1, 2): ((1, a), (4, b)), (3, 4): ((1, a),)}
    new = {(1, 2): ((1, c),)}
    assert merge_table(old, new, (1,)) == {(1, 2): ((1, c), (4, b)), (3, 4): ((1, a),)}
    assert merge_table(old, {}, (1,)) == old
