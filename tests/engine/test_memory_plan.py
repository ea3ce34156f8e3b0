"""The memory plan (issue 27): the bytes of a page and a slot at the full-size Qwen3.5-35B-A3B shapes, the sizing
rule on an H200-sized budget (no allocation), refusals that name the field with the bytes, and on CPU the engine's
pools equal to what the plan priced (the real tensors counted)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.random_model import full_hf_config, param_bytes, tiny_hf_config
from gdnserve.engine.config import EngineConfig
from gdnserve.engine.execution.model_runner import pool_configs, spec_bytes_per_slot
from gdnserve.engine.llm_engine import LLMEngine
from gdnserve.engine.memory.memory_budget import (
    config_weights_bytes,
    device_budget,
    estimate_activations,
    resolve_pools,
    weights_bytes,
)
from gdnserve.engine.memory.memory_plan import Budget, Demand, MemoryPlanError, min_slots, plan, working_slots
from gdnserve.models.builtin import build_builtin_model, builtin_config
from gdnserve.models.config import ModelConfig
from gdnserve.models.tokenizer import ByteTokenizer

GiB = 1 << 30
FULL = ModelConfig.from_hf(full_hf_config())
H200 = Budget(capacity=150_000_000_000, in_use=600 << 20, usable=int(0.9 * 150_000_000_000) - (600 << 20),
              source="0.90 x H200", field="gpu_memory_utilization")


def full_costs(cfg: EngineConfig = EngineConfig(), dtype: torch.dtype = torch.bfloat16) -> dict:
    sc, pc = pool_configs(FULL, cfg.runner_config(), dtype)
    return dict(page_bytes=pc.bytes_per_page, slot_bytes=sc.bytes_per_slot, page_size=cfg.page_size,
                max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs)


def test_full_size_page_and_slot_bytes():
    """30 GDN layers x (conv 3 x 8192 bf16 + SSM 32 x 128 x 128 fp32); 10 attention layers x K+V x 16 tokens x
    2 KV heads x 256 bf16. One slot costs as much as ~3000 tokens of KV."""
    c = full_costs()
    assert c["slot_bytes"] == 30 * (3 * 8192 * 2 + 32 * 128 * 128 * 4) == 64_389_120
    assert c["page_bytes"] == 10 * 2 * 16 * 2 * 256 * 2 == 327_680
    _, pc = pool_configs(FULL, EngineConfig(spec_k=2, spec_draft="mtp").runner_config(), torch.bfloat16)
    assert pc.bytes_per_page == 11 * 2 * 16 * 2 * 256 * 2          # the MTP head's KV: one more layer
    assert config_weights_bytes(FULL, torch.bfloat16) - param_bytes(full_hf_config())[1] == 10 * 32 * 4  # inv_freq


def test_h200_bf16_and_fp8_plans_follow_the_rule():
    c = full_costs()
    weights = param_bytes(full_hf_config())[1]
    act = estimate_activations(FULL, EngineConfig(), torch.bfloat16)
    assert 4 * GiB < act < 16 * GiB       # the [4096, 248320] fp32 logits of a prompt-logprobs step dominate
    demand = Demand(weights=weights, activations=act, graphs=GiB, runtime=GiB)
    p = plan(H200, demand, **c)
    seat = c["slot_bytes"] + 256 * c["page_bytes"]
    assert p.num_slots == min(p.room // seat, 16 * 64) and p.num_slots > working_slots(64)
    assert p.num_pages == min((p.room - p.num_slots * c["slot_bytes"]) // c["page_bytes"], p.num_slots * 256)
    assert p.pool_bytes <= p.room < p.pool_bytes + seat and p.sized
    assert p.max_concurrency() == 64 and p.checkpoint_capacity(2048, 64) > 100
    fp8 = plan(H200, Demand(weights=weights // 2, activations=act, graphs=GiB, runtime=GiB), **c)
    assert fp8.num_slots > p.num_slots and fp8.room - fp8.pool_bytes < seat       # FP8: every byte goes to seats
    huge = plan(Budget(1 << 50, 0, 1 << 50, "a huge device"), demand, **c)
    assert huge.num_slots == 16 * 64 and huge.num_pages == huge.num_slots * 256   # both caps reached
    text = "\n".join(p.describe())
    assert f"{p.num_slots} state slots" in text and f"{p.num_pages} KV pages" in text
    assert "64 concurrent requests at max_model_len 4096" in text and "checkpoints of a 2048-token prefix" in text


MiB = 1 << 20
FIRST_H200_RUN = {   # the banner of the first H200 run of bench_serve_http (issue 27), bf16
    "budget": Budget(int(139.80 * GiB), int(20.64 * GiB), int(105.18 * GiB), "0.90 x 139.80 GiB of cuda:0"),
    "demand": Demand(weights=int(64.56 * GiB), activations=int(7.61 * GiB), graphs=int(1.33 * GiB),
                     runtime=512 * MiB, measured=True)}


def test_big_slots_are_seats_not_a_floor_of_working_slots():
    """The first H200 run: slots of 61.41 MiB, max_num_seqs 256, max_model_len 9216. The old floor of W = 514
    working slots took the room's 31 GiB and left KV for 2 requests; seats (a slot + 8192 tokens of KV) give 144
    slots and KV for 128 requests of 9216 tokens, and the capacity line says the memory holds fewer than 256."""
    c = {**full_costs(), "max_model_len": 9216, "max_num_seqs": 256}
    assert (c["slot_bytes"], c["page_bytes"], c["page_size"]) == (64_389_120, 327_680, 16)    # 61.41 MiB, 320 KiB
    p = plan(**FIRST_H200_RUN, **c)
    seat = c["slot_bytes"] + 512 * c["page_bytes"]          # 8192 tokens, not max_model_len's 9216
    assert p.room // seat == p.num_slots == 144 < working_slots(256)
    assert p.num_pages == (p.room - 144 * c["slot_bytes"]) // c["page_bytes"] == 73_874    # the rest is KV
    assert p.max_concurrency() == 128 == p.num_pages // 576 and p.max_concurrency(8192) == 144
    capacity = p.describe()[2]
    assert capacity.startswith("  capacity: 128 concurrent requests at max_model_len 9216 (state slots 144, KV for "
                               "128, max_num_seqs 256: the memory holds fewer); 144 at 8192 tokens each;"), capacity
    assert "(144 working + 0 for checkpoints)" in p.describe()[1]


def test_a_long_max_model_len_sizes_seats_at_a_typical_request():
    """The real model's default context (262144 tokens): a seat at max_model_len would be 5 GB of KV and give ~6 slots
    for 31 GiB; at 8192 tokens the slots are the same as at 9216 and the KV holds 4 full-length requests (or 144 of
    8192 tokens). A given --num-slots still pins the slots (SGLang's --max-mamba-cache-size)."""
    c = {**full_costs(), "max_model_len": 262_144, "max_num_seqs": 256}
    p = plan(**FIRST_H200_RUN, **c)
    assert p.num_slots == 144 and p.num_pages == 73_874
    assert (p.max_concurrency(), p.max_concurrency(8192)) == (4, 144)
    assert "4 concurrent requests at max_model_len 262144" in p.describe()[2]
    pinned = plan(**FIRST_H200_RUN, num_slots=32, **c)
    assert pinned.num_slots == 32 and pinned.num_pages == (p.room - 32 * c["slot_bytes"]) // c["page_bytes"]
    with pytest.raises(MemoryPlanError, match=r"^num_slots \(--num-slots\) = 600 asks for 600 state slots"):
        plan(**FIRST_H200_RUN, num_slots=600, **c)       # 600 x 61.41 MiB + one 262144-token sequence > 31 GiB


def test_refusals_name_the_field_and_the_bytes():
    c = full_costs()
    demand = Demand(weights=70 * GiB, activations=10 * GiB)
    with pytest.raises(MemoryPlanError) as e:
        plan(H200, demand, num_pages=100_000_000, **c)
    need = 100_000_000 * c["page_bytes"] + min_slots(64) * c["slot_bytes"]
    assert e.value.field == "num_pages" and isinstance(e.value, ValueError)
    assert str(e.value).startswith("num_pages (--num-pages) = 100000000") and str(need) in str(e.value)
    assert str(H200.usable - demand.total) in str(e.value)                  # the bytes the pools have
    with pytest.raises(MemoryPlanError, match=r"^num_slots \(--num-slots\) = 100000") as e:
        plan(H200, demand, num_slots=100_000, **c)
    with pytest.raises(MemoryPlanError, match=r"^gpu_memory_utilization .* leaves no memory for the pools"):
        plan(H200, Demand(weights=140 * GiB, activations=0), **c)
    small = Budget(80 * GiB, 0, 72 * GiB, "--memory-budget-gb 72", "memory_budget_gb")
    with pytest.raises(MemoryPlanError, match=r"^memory_budget_gb .* less than their minimum 325.62 MiB \(4 state"):
        plan(small, Demand(weights=71 * GiB, activations=GiB - 300 * MiB), **c)    # 300 MiB: 4 slots + 4096 tokens
    given = plan(H200, demand, num_pages=4096, num_slots=300, **c)
    assert (given.num_pages, given.num_slots, given.sized) == (4096, 300, False)
    rest = plan(H200, demand, num_pages=4096, **c)                           # the slots take the rest, capped
    assert rest.num_pages == 4096 and rest.num_slots == (rest.room - 4096 * c["page_bytes"]) // c["slot_bytes"]


@settings(max_examples=60, deadline=None)
@given(usable=st.integers(1 << 20, 1 << 42), weights=st.integers(0, 1 << 41), seqs=st.integers(1, 300),
       length=st.integers(1, 1 << 17), page=st.sampled_from([1, 16, 64]), slot=st.integers(1, 1 << 28),
       page_bytes=st.integers(1, 1 << 21))
def test_plan_invariants(usable, weights, seqs, length, page, slot, page_bytes):
    """Whatever fits is within the room, keeps the least slots and one max_model_len sequence, uses the room by
    seats (no seat more would fit unless a cap binds), holds no page that no slot could hold, and its capacity line
    is the min of the three limits; whatever does not fit is a MemoryPlanError."""
    budget = Budget(usable, 0, usable, "test")
    try:
        p = plan(budget, Demand(weights=weights, activations=0), page_bytes=page_bytes, slot_bytes=slot,
                 page_size=page, max_model_len=length, max_num_seqs=seqs)
    except MemoryPlanError as e:
        assert e.field == "gpu_memory_utilization"
        return
    pps = -(-length // page)
    assert p.pool_bytes <= p.room
    assert min_slots(seqs) <= p.num_slots <= max(min_slots(seqs), 16 * seqs)
    assert pps <= p.num_pages <= p.num_slots * pps
    seat = slot + -(-min(length, 8192) // page) * page_bytes
    if min_slots(seqs) < p.num_slots < 16 * seqs:     # by seats, one max_model_len sequence's pages kept
        assert p.num_slots == min(p.room // seat, (p.room - pps * page_bytes) // slot)
    run = min(seqs, p.num_slots, p.num_pages // pps)
    assert p.describe()[2].startswith(f"  capacity: {run} concurrent requests at max_model_len {length} ")
    assert (": the memory holds fewer" in p.describe()[2]) == (run < seqs and p.sized)


def pool_tensors_bytes(e: LLMEngine) -> int:
    s, pg = e.kv.state, e.kv.pages
    return sum(t.numel() * t.element_size() for t in (s.conv_pools, s.ssm_pools, pg.k_pools, pg.v_pools))


def test_engine_pools_are_what_the_plan_priced_on_cpu():
    """memory_budget_gb sizes the pools on CPU; the allocated tensors are the plan's bytes exactly."""
    e = LLMEngine(build_builtin_model(), ByteTokenizer(), EngineConfig(memory_budget_gb=0.25, max_num_seqs=8,
                                                                      max_model_len=512))
    p = e.memory_plan
    assert p.sized and p.budget.field == "memory_budget_gb" and p.budget.usable == GiB // 4
    assert (e.kv.pages.num_pages, e.kv.state.num_slots) == (p.num_pages, p.num_slots) == \
        (e.config.num_pages, e.config.num_slots)
    assert p.num_slots == 16 * 8 and p.num_pages == p.num_slots * 32      # a tiny model: the caps bind
    assert pool_tensors_bytes(e) == p.pool_bytes <= p.room
    fixed = LLMEngine(build_builtin_model(), ByteTokenizer(), EngineConfig())   # CPU default: fixed, checked
    assert (fixed.kv.pages.num_pages, fixed.kv.state.num_slots) == (2048, 130) and not fixed.memory_plan.sized
    assert fixed.memory_plan.budget.field == "gpu_memory_utilization"


@pytest.mark.parametrize("mode,draft", [("intermediate", "ngram"), ("replay", "ngram"), ("replay", "mtp")])
def test_speculative_buffers_per_slot_are_priced(mode, draft):
    e = LLMEngine(build_builtin_model(), ByteTokenizer(), EngineConfig(num_slots=6, num_pages=64, max_num_seqs=2,
                                                                      spec_k=2, spec_mode=mode, spec_draft=draft))
    bound = 0
    for layer in e.runner.model.gdn_layers():
        pending = [] if layer.pending is None else [getattr(layer.pending, f) for f in "kvab"]
        ts = [layer.conv_scratch, layer.ssm_scratch, *pending]
        bound += sum(t.numel() * t.element_size() for t in ts if t is not None)
    if e.runner.mtp is not None:
        real = e.runner.mtp.hidden[:-1]          # per slot; the last row is the graphs' scratch (one row in all)
        bound += real.numel() * real.element_size()
    per = spec_bytes_per_slot(builtin_config(), e.runner.rc, torch.float32)
    assert per > 0 and bound == 6 * per
    assert e.memory_plan.slot_bytes == e.kv.state.bytes_per_slot + per


def test_weights_counted_before_loading_match_the_loaded_model():
    assert config_weights_bytes(builtin_config(), torch.float32) == weights_bytes(build_builtin_model())
    tiny = ModelConfig.from_hf(tiny_hf_config())
    from benchmarks.random_model import build_random_model
    built = build_random_model(tiny_hf_config(), torch.device("cpu"), torch.bfloat16)
    assert config_weights_bytes(tiny, torch.bfloat16) == weights_bytes(built)


def test_llm_refuses_before_loading(monkeypatch):
    """The Python API: a ValueError naming the field, raised before the model is built or a pool allocated."""
    import gdnserve.models.builtin as builtin
    from gdnserve.entrypoints.llm import LLM

    def no_load(*a, **k):
        raise AssertionError("the model was built before the memory check")
    monkeypatch.setattr(builtin, "build_builtin_model", no_load)
    with pytest.raises(ValueError, match=r"^num_pages \(--num-pages\) = 100000000 asks for"):
        LLM(num_pages=100_000_000, device="cpu")
    with pytest.raises(ValueError, match=r"^memory_budget_gb .* more than the"):
        LLM(memory_budget_gb=1e9, device="cpu")
    for field, bad in (("gpu_memory_utilization", 0), ("gpu_memory_utilization", 1.5), ("memory_budget_gb", -1)):
        with pytest.raises(ValueError, match=field):
            EngineConfig(**{field: bad})


def test_cpu_budget_counts_loaded_weights_as_available():
    """After loading, MemAvailable no longer includes the weights: they are added back (else counted twice)."""
    a = device_budget(torch.device("cpu"), EngineConfig(), resident=0)
    b = device_budget(torch.device("cpu"), EngineConfig(), resident=10 * GiB)
    assert b.capacity - a.capacity == pytest.approx(10 * GiB, abs=256 << 20) and b.in_use == 0


def test_the_cuda_budget_says_where_in_use_is(monkeypatch):
    """Issue 27: "20.64 GiB in use" beside 64.56 GiB of weights, unexplained. The budget's detail (on the banner's
    memory line) splits it: torch tensors of this process beyond the counted weights, torch's cached fragments
    that empty_cache could not return, and what is outside torch's allocator (the CUDA counters faked)."""
    weights = int(64.56 * GiB)
    fake = {"mem_get_info": lambda d: (140 * GiB - weights - 20 * GiB, 140 * GiB),
            "memory_allocated": lambda d: weights + GiB, "memory_reserved": lambda d: weights + 19 * GiB + GiB // 2,
            "get_device_name": lambda d: "H200", "empty_cache": lambda: None}
    for name, f in fake.items():
        monkeypatch.setattr(torch.cuda, name, f)
    b = device_budget(torch.device("cuda:0"), EngineConfig(), resident=weights)
    assert b.in_use == 20 * GiB and b.usable == int(0.9 * 140 * GiB) - 20 * GiB
    assert b.detail == ("1.00 GiB torch tensors beyond the weights + 18.50 GiB cached by torch's allocator "
                        "(fragments) + 512.00 MiB outside it (CUDA context, libraries, other processes)")
    p = plan(b, Demand(weights=weights, activations=GiB), **full_costs())
    assert f"(0.90 x 140.00 GiB of cuda:0 (H200) - 20.00 GiB in use: {b.detail}): weights 64.56 GiB" in p.describe()[0]


def test_resolve_pools_leaves_given_sizes_and_sizes_the_rest():
    cfg = EngineConfig(memory_budget_gb=0.5, num_pages=300, max_num_seqs=4)
    out, p = resolve_pools(cfg, builtin_config(), torch.float32, torch.device("cpu"), weights=1 << 20)
    assert out.num_pages == 300 and out.num_slots == p.num_slots == 16 * 4 and cfg.num_slots is None


def test_the_warm_up_measurement_runs_the_largest_step(monkeypatch):
    """measure_activations' step on CPU (the CUDA counters faked): max_step_tokens split into sequences of at most
    max_model_len, every row's logits; the result is the counted peak above the start plus the sampler's sort."""
    from gdnserve.engine.execution.model_runner import ModelRunner
    from gdnserve.engine.memory import memory_budget as mb
    steps = []
    real_step = ModelRunner.step

    def step(self, prefills, decodes, *a, **k):
        steps.append([(len(it.tokens), it.all_logits) for it in prefills])
        return real_step(self, prefills, decodes, *a, **k)
    monkeypatch.setattr(ModelRunner, "step", step)
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 1000)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 1000 + 12345)
    cfg = EngineConfig(max_step_tokens=300, max_model_len=128, max_num_seqs=2)
    got = mb.measure_activations(build_builtin_model(), cfg)
    assert steps == [[(128, True), (128, True), (44, True)]]
    assert got == 12345 + max(0, 2 * 260 * 28 - 300 * 260 * 4)


def test_a_tensor_parallel_rank_0_keeps_the_workers_sizes():
    """Rank 0's engine is built after the workers started with cfg.runner_config(): it must not re-plan (on CUDA it
    would have sized unset pools differently from the workers')."""
    cfg = EngineConfig(memory_budget_gb=0.5, tensor_parallel_size=2, max_num_seqs=4)
    model = build_builtin_model()
    out, p = resolve_pools(cfg, builtin_config(), torch.float32, torch.device("cpu"), weights=1 << 20, model=model)
    assert (out.num_pages, out.num_slots) == (cfg.runner_config().num_pages, cfg.runner_config().num_slots)
    assert not p.sized
    before, _ = resolve_pools(cfg, builtin_config(), torch.float32, torch.device("cpu"), weights=1 << 20)
    assert before.num_slots == 16 * 4           # before the workers start (load_engine): planned


def test_steps_with_every_rows_logits_stay_within_max_step_tokens():
    """Score candidates, and prompt_logprobs prompts of n > 1 samples or with a checkpoint marker, are not chunked
    and keep every row's logits: above max_step_tokens (the step the plan prices) intake refuses them, naming the
    field and the flag; at it they run. A single-sample prompt_logprobs prompt is chunked (below)."""
    from gdnserve.engine.sampling_params import SamplingParams
    from gdnserve.engine.scheduling.request import RequestError
    e = LLMEngine(build_builtin_model(), ByteTokenizer(), EngineConfig(max_step_tokens=64, max_model_len=512,
                                                                      num_pages=128, max_num_seqs=4))
    plp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    for params, mark in ((SamplingParams(max_tokens=1, prompt_logprobs=0, n=2), None), (plp, 30)):
        with pytest.raises(RequestError, match=r"^prompt_logprobs: a prompt of 65 tokens with n > 1 or a checkpoint "
                                               r"marker .* max_step_tokens = 64 \(--max-step-tokens\)") as err:
            e.add_request(None, [5] * 65, params, checkpoint_at=mark)
        assert err.value.param == "prompt_logprobs"
    e.add_request(None, [5] * 65, plp)                 # one sample, no marker: chunked
    with pytest.raises(RequestError, match=r"^candidates\[1\]: .* \(65 tokens\) .* max_step_tokens = 64") as err:
        e.add_score([1, 2, 3], [[4] * 8, [4] * 64])
    assert err.value.param == "candidates[1]"
    e.add_request(None, [5] * 64, plp)                 # at the bound: runs, in one step of 64 rows of logits
    e.add_score([1, 2, 3], [[4] * 63])
    while e.has_unfinished():
        e.step()


def test_cpu_fixed_pools_are_not_refused_for_steps_with_every_rows_logits(monkeypatch):
    """Issue 27 review: on CPU without --memory-budget-gb the plan only checks the fixed pools; pricing the
    prompt-logprobs step there (8 bytes x vocab x max_step_tokens of float32 logits and their copy, 9.5 GiB for a
    vocab of 248320 at 4096 tokens, estimated; 14 GiB before the log-softmax went ROW_BLOCK rows at a time)
    refused a small real model on an 8 GiB machine. The check leaves that step out; a CPU budget that
    sizes the pools still prices it."""
    from dataclasses import replace

    from gdnserve.engine.memory import memory_budget as mb
    monkeypatch.setattr(mb, "meminfo_available", lambda: 8 * GiB)
    small_real = replace(builtin_config(), vocab_size=248_320)
    full = estimate_activations(small_real, EngineConfig(), torch.float32)
    assert full > 8 * GiB
    _, p = resolve_pools(EngineConfig(), small_real, torch.float32, torch.device("cpu"), weights=GiB)
    assert not p.sized and p.demand.activations < GiB
    with pytest.raises(MemoryPlanError, match=r"^memory_budget_gb"):       # sized from a budget: priced
        resolve_pools(EngineConfig(memory_budget_gb=6), small_real, torch.float32, torch.device("cpu"), weights=GiB)

