"""benchmarks/profile_layers.py: events are given to the layer window holding their start; the CPU proxy run
(interpreted Triton launches + aten ops instead of CUDA kernels) writes the before/after table, with fewer
kernels per layer when fused."""
import re

import pytest

from benchmarks import profile_layers as pl
from gdnserve.ops.backend import interpreting


def test_attribute_by_window():
    ev = [pl.Event(n, t, 1.0) for n, t in [("up", 0.5), ("a", 1.0), ("b", 1.9), ("c", 3.0), ("d", 3.5), ("lm", 9.0)]]
    got = pl.attribute([(1.0, 2.0), (3.0, 4.0)], ev)
    assert [[e.name for e in l] for l in got.layers] == [["a", "b"], ["c", "d"]]
    assert [e.name for e in got.outside] == ["up", "lm"]


@pytest.mark.skipif(not interpreting(), reason="the CPU proxy needs TRITON_INTERPRET=1")
def test_cpu_proxy_run_writes_the_table(tmp_path):
    out = tmp_path / "k.md"
    assert pl.main(["--device", "cpu", "--layers", "4", "--context", "4", "--cases", "decode", "--out", str(out),
                    "--commit", "abc"]) == 0
    text = out.read_text()
    for row in ("| decode B=1 | GDN |", "| decode B=1 | attention |", "commit abc"):
        assert row in text
    rows = re.findall(r"\| decode B=1 \| (?:GDN|attention) \| (\d+) \| (\d+) \|", text)
    assert len(rows) == 2 and all(int(on) < int(off) for off, on in rows)
    assert "triton::_add_rms_norm_kernel" in text and "triton::_router_small_kernel" in text
