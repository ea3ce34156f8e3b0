"""Issue 6, "no index construction per layer", measured with torch.profiler on the CPU: one verify step of
a model with 1 GDN layer and of one with 4 (same attention) builds exactly the same index tensors — the
same count of integer-tensor creations, conversions and copies, and exactly one host-to-device upload —
while the per-layer compute (the GEMMs) grows. Counted outside the op implementations: the PyTorch
reference ops derive per-call index tensors internally (clamp, long, arange: on the GPU the Triton kernels
do that in registers), which is the ops' compute; everything the runner, the step plan, the forward
context, the model and the layers build is counted."""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

import gdnserve.layers.attention as attention
import gdnserve.layers.gdn_mixer as gdn_mixer
from gdnserve.engine.cache.sequence import PrefillItem
from gdnserve.engine.execution.model_runner import (
    ModelRunner,
    RunnerConfig,
)
from gdnserve.models.builtin import builtin_config
from gdnserve.models.qwen3_5 import HybridLM

OPS = {gdn_mixer: ("causal_conv1d_update", "gdn_verify", "gdn_decode"), attention: ("store_kv", "paged_attention")}
ALWAYS_INDEX = {"aten::arange", "aten::lift_fresh", "aten::repeat_interleave", "aten::cumsum", "aten::nonzero"}
CONVERSIONS = {"aten::to", "aten::_to_copy", "aten::copy_"}
FACTORY_DTYPE_ARG = {"aten::empty": 1, "aten::zeros": 1, "aten::ones": 1, "aten::full": 2, "aten::empty_strided": 2}
INT_DTYPES = {"int", "long int", "short int", "signed char", "unsigned char"}
INT_SCALAR_TYPES = {0, 1, 2, 3, 4}          # c10::ScalarType uint8, int8, int16, int32, int64


def build_model(n_gdn: int) -> HybridLM:
    """The embedded model's shapes with ``n_gdn`` GDN layers and one attention layer, fixed random weights."""
    cfg = dataclasses.replace(builtin_config(), num_layers=n_gdn + 1,
                              layer_types=("linear_attention",) * n_gdn + ("full_attention",))
    gen = torch.Generator().manual_seed(n_gdn)
    model = HybridLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if "conv" in name else 0.02))
    for layer in model.gdn_layers():
        layer.A_log.data = layer.A_log.data.float()
    return model.eval()


@pytest.fixture
def op_scopes(monkeypatch):
    """Each op the layers call runs inside a ``record_function("op::...")`` scope."""
    for mod, names in OPS.items():
        for name in names:
            def scoped(*a, _real=getattr(mod, name), _name=name, **kw):
                with record_function("op::" + _name):
                    return _real(*a, **kw)
            monkeypatch.setattr(mod, name, scoped)


def counted(e) -> bool:
    """An outermost aten op (not one dispatched inside another) outside every op scope."""
    if e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"):
        return False
    while e is not None:
        if e.name.startswith("op::"):
            return False
        e = e.cpu_parent
    return True


def input_dtypes(prof) -> dict[int, list[str]]:
    """Event id -> its inputs' dtypes. ``FunctionEvent.input_dtypes`` exists from torch 2.12 on; on older
    releases (the H200's 2.11) the dtypes live only on the kineto event of the same correlation id."""
    return {k.correlation_id(): list(k.dtypes()) for k in prof.profiler.kineto_results.events()}


def index_label(e, dtypes: dict[int, list[str]]) -> str | None:
    """A label for an op that creates, converts or copies an integer tensor, else None (0-dim wrapped Python
    scalars are arithmetic, not indices). Copies are labelled with their dtypes and non_blocking flag."""
    dts, args = dtypes.get(e.id) or [], e.concrete_inputs or []
    if e.name in ALWAYS_INDEX:
        return e.name
    if e.name in CONVERSIONS and e.input_shapes and e.input_shapes[0] and any(d in INT_DTYPES for d in dts[:2]):
        nb = ", non_blocking" if e.name == "aten::copy_" and args[2:3] == [True] else ""
        return f"{e.name}({', '.join(dts[:2])}{nb})"
    i = FACTORY_DTYPE_ARG.get(e.name)
    if i is not None and i < len(args) and args[i] in INT_SCALAR_TYPES:
        return f"{e.name}(int)"
    return None


def profile_verify(n_gdn: int, mode: str, graphs: bool) -> tuple[Counter, Counter]:
    """(index-building ops outside the ops, all op names) of the second verify step of 3 requests."""
    r = ModelRunner(build_model(n_gdn), RunnerConfig(backend="torch", num_slots=8, num_pages=64, page_size=8,
                                                     spec_mode=mode, spec_tokens=3, cuda_graphs=graphs))
    seqs = [r.new_seq() for _ in range(3)]
    r.step([PrefillItem(s, list(range(5, 16 + 2 * i))) for i, s in enumerate(seqs)], [])
    r.step([], [], verifies=[(s, [1, 2, 3]) for s in seqs])
    r.accept([(s, a) for s, a in zip(seqs, (1, 2, 3))])           # replay: the next verify applies pending tokens
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        r.step([], [], verifies=[(s, [4, 5, 6]) for s in seqs])
    if graphs:
        assert r.graphs.stats["eager"] == 2                        # both verifies took the graph-shaped path
    events, dtypes = prof.events(), input_dtypes(prof)
    index = Counter(index_label(e, dtypes) for e in events if counted(e))
    del index[None]
    return index, Counter(e.name for e in events)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph_shaped"])
@pytest.mark.parametrize("mode", ["intermediate", "replay"])
def test_index_building_does_not_grow_with_gdn_layers(op_scopes, mode, graphs):
    few, few_all = profile_verify(1, mode, graphs)
    many, many_all = profile_verify(4, mode, graphs)
    assert few == many, f"index ops per step changed with the GDN layer count:\n1 layer: {few}\n4 layers: {many}"
    assert few, "the profile saw no index building at all: the counter is broken"
    assert many_all["aten::mm"] >= few_all["aten::mm"] + 3 * 2      # in_proj + out_proj per added GDN layer
    assert many_all["op::gdn_verify"] == 4 and few_all["op::gdn_verify"] == 1
    # one upload per step (IndexStager.push: the plan's buffer, or the graphs' static inputs), from a host
    # list built once (eager: torch.tensor of the packed ints; graph-shaped: numpy writes into the staging)
    assert few["aten::copy_(int, int, non_blocking)"] == 1
    assert few["aten::lift_fresh"] == (0 if graphs else 1)
    assert few["aten::arange"] == 0


def test_the_counter_sees_per_layer_index_building(op_scopes, monkeypatch):
    """The counter is not blind: a layer that builds its verify row index itself (vLLM's per-layer arange)
    makes the count grow with the GDN layers."""
    real = gdn_mixer.GatedDeltaNet._verify

    def per_layer_rows(self, x, a, b, vf, p, o):
        torch.arange(vf.slots.shape[0] * vf.tokens_per_req, dtype=torch.int32)
        return real(self, x, a, b, vf, p, o)
    monkeypatch.setattr(gdn_mixer.GatedDeltaNet, "_verify", per_layer_rows)
    few, _ = profile_verify(1, "replay", False)
    many, _ = profile_verify(4, "replay", False)
    assert many["aten::arange"] - few["aten::arange"] == 3
