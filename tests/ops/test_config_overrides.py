"""Every op family's launch config comes from its table / shape rule or from an explicit ``config=`` of its entry
point (issue 28: no module global that a benchmark flips). The override must reach the launch unchanged."""
from __future__ import annotations

import importlib

import pytest
import torch

from gdnserve.ops.quant.fp8_ref import quantize_weight

MODULES = ["gdnserve.ops.quant.fp8_linear", "gdnserve.ops.quant.fp8_gemv_triton", "gdnserve.ops.quant.fp8_gemm_triton",
           "gdnserve.ops.moe.grouped_triton",
           "gdnserve.ops.moe.grouped_fp8_triton", "gdnserve.ops.moe.decode_fp8_triton", "gdnserve.ops.quant.fp8_scaled_mm"]


@pytest.mark.parametrize("name", MODULES)
def test_no_mutable_config_global(name):
    m = importlib.import_module(name)
    assert not any(hasattr(m, g) for g in ("CONFIG_OVERRIDE", "GEMV_MAX_M", "SKINNY_MAX_M", "DECODE_QUANT_ACT",
                                          "GEMV_QUANT_IN_KERNEL", "ENABLED"))


def _capture(monkeypatch, mod):
    seen = []
    real = mod.launch
    monkeypatch.setattr(mod, "launch", lambda fn, grid, args, *a, **kw: seen.append((fn, grid, a, kw))
                        or real(fn, grid, args, *a, **kw))
    return seen


def test_fp8_gemv_and_linear_overrides_reach_the_launch(monkeypatch, device):
    from gdnserve.ops.quant import fp8_gemv_triton as gv
    from gdnserve.ops.quant.fp8_linear import DEFAULT, Fp8LinearConfig, fp8_linear, linear_config
    assert linear_config(torch.device("cpu")) == DEFAULT
    q, s = quantize_weight(torch.randn(256, 256, device=device))
    x = torch.randn(1, 256, device=device)
    seen = _capture(monkeypatch, gv)
    cfg = gv.GemvConfig(16, 128, 2, 1)
    assert cfg != gv.config(1, 256, 256)
    fp8_linear(x, q, s, backend="triton", config=Fp8LinearConfig(gemv=cfg))
    (_, grid, a, kw), = seen
    assert grid == (256 // 16,) and kw == {"num_warps": 2, "num_stages": 1}
    fp8_linear(x, q, s, backend="triton")                      # no override: the rule's pick again
    assert seen[-1][1] == (256 // gv.config(1, 256, 256).BN,)
    # gemv_max_m = 0: M = 1 takes the GEMM (no GEMV launch)
    n = len(seen)
    fp8_linear(x, q, s, backend="triton", config=Fp8LinearConfig(gemv_max_m=0))
    assert len(seen) == n


def test_fp8_gemm_override_reaches_the_launch(monkeypatch, device):
    from gdnserve.ops.quant import fp8_gemm_triton as g
    q, s = quantize_weight(torch.randn(128, 256, device=device))
    seen = _capture(monkeypatch, g)
    g.fp8_gemm_triton(torch.randn(70, 256, device=device), q, s, config=(64, 64, 2, 1, 1, 0, False))
    assert seen[-1][1][0] == 2 * 2 and seen[-1][3] == {"num_warps": 2, "num_stages": 1}


def test_moe_decode_override_reaches_the_launch(monkeypatch, device):
    from gdnserve.ops.moe import decode_fp8_triton as d
    E, H, I, T, k = 3, 128, 128, 1, 2
    qg, sg = zip(*(quantize_weight(torch.randn(2 * I, H, device=device)) for _ in range(E)))
    qd, sd = zip(*(quantize_weight(torch.randn(H, I, device=device)) for _ in range(E)))
    seen = _capture(monkeypatch, d)
    cfg = d.DecodeConfig(BR=16, BR2=128)
    d.moe_experts_fp8_decode(torch.randn(T, H, device=device), torch.full((T, k), 0.5, device=device),
                             torch.tensor([[0, 2]], device=device), torch.stack(qg),
                             torch.stack(qd), torch.stack(sg), torch.stack(sd), config=cfg)
    assert seen[0][1] == (T * k, I // 16) and seen[-1][1] == (T, H // 128)


def test_fp8_linear_override_sets_fields_for_the_block_only():
    """``fp8_linear.override``: fields on top of the device's row for every call without config=, restored after
    the block (also after an error); an unknown field is refused by name."""
    from gdnserve.ops.quant.fp8_linear import DEFAULT, linear_config, override
    cpu = torch.device("cpu")
    with override(gemv_max_m=0, scaled_mm=False):
        assert (linear_config(cpu).gemv_max_m, linear_config(cpu).scaled_mm) == (0, False)
        with override(gemv_max_m=2):
            assert (linear_config(cpu).gemv_max_m, linear_config(cpu).scaled_mm) == (2, False)
        assert linear_config(cpu).gemv_max_m == 0
    assert linear_config(cpu) == DEFAULT
    with pytest.raises(RuntimeError):
        with override(gemv_quant_inside=True):
            raise RuntimeError("boom")
    assert linear_config(cpu) == DEFAULT
    with pytest.raises(ValueError, match="bogus"):
        with override(bogus=1):
            pass
