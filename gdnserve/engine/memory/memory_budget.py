"""The numbers the memory plan decides from (engine/memory/memory_plan.py), and EngineConfig's pools resolved from them.

- **Budget**: on CUDA ``gpu_memory_utilization x`` the device's memory minus what is in use besides our weights
  (other processes, the CUDA context); on CPU that fraction of the RAM available (``MemAvailable`` in
  /proc/meminfo, plus the weights already loaded from it); ``memory_budget_gb`` replaces either.
- **Weights**: the model's parameters and buffers, counted on the loaded model, or before loading on the meta
  device (nothing allocated; an FP8 checkpoint's layers become FP8 first, as the loader makes them).
- **Activations**: the peak of the largest step, a prefill of ``max_step_tokens`` tokens with every row's logits
  (prompt logprobs and scoring ask for them; a single-sample prompt_logprobs prompt is chunked, intake refuses the
  others and score candidates above max_step_tokens), their log-softmax ``sampler.ROW_BLOCK`` rows at a time, plus
  sampling. On CUDA, when the pools are sized, it is measured as nano-vllm does (a warm-up step on small temporary
  pools, ``max_memory_allocated``); otherwise :func:`estimate_activations` bounds it from the config, conservatively
  (tests/engine compare the two on the GPU).
- **CUDA graphs**: their private pool holds the largest captured step's intermediates (graphs are captured on first
  use, after the pools exist), estimated the same way without the logits.
- **Runtime** (CUDA): workspaces and allocator slack (``RUNTIME_RESERVE`` / ``MEASURED_RESERVE``), plus with a
  checkpoint tier the copies' two staging buffers (:func:`tier_staging`, 2 x 128 MiB).

:func:`resolve_pools` returns the EngineConfig with ``num_pages`` / ``num_slots`` filled in and the plan (for the
banner); a model or a size that does not fit raises ``MemoryPlanError`` naming the field.
"""
from __future__ import annotations

import gc
from dataclasses import replace

import torch

from gdnserve.engine.cache.checkpoint_copy import STAGE_BYTES
from gdnserve.engine.cache.host_memory import meminfo_available
from gdnserve.engine.config import EngineConfig
from gdnserve.engine.execution.graph_inputs import BUCKETS
from gdnserve.engine.execution.model_runner import pool_configs, spec_bytes_per_slot
from gdnserve.engine.execution.sampler import ROW_BLOCK
from gdnserve.engine.memory.memory_plan import (
    Budget,
    Demand,
    MemoryPlan,
    MemoryPlanError,
    fmt_bytes,
    plan,
)
from gdnserve.layers.rank_shapes import GDNShape, attn_heads

RUNTIME_RESERVE = 1 << 30           # CUDA, analytic plans: cuBLAS / Triton workspaces, allocator slack
MEASURED_RESERVE = 512 << 20        # CUDA, measured plans: the workspaces are in the measurement; slack only
SAFETY = 1.25                       # on the analytic estimates: allocator rounding, temporaries not modelled
CHUNK = 64                          # the chunked GDN prefill's chunk (a state per chunk in fp32)


def tier_staging(cfg: EngineConfig) -> int:
    """Device bytes of the checkpoint tiers' copies (CUDA): one staging buffer per direction
    (engine/cache/checkpoint_copy.py: spills and restores on their own streams), allocated at the first copy of
    each; 0 without a tier."""
    return 2 * STAGE_BYTES if cfg.checkpoint_host_memory_gb or cfg.checkpoint_dir is not None else 0


def device_budget(device: torch.device, cfg: EngineConfig, resident: int = 0) -> Budget:
    """What the engine may use on ``device``. ``resident``: bytes of ours already on it (the loaded weights),
    which are counted in the plan's demand rather than as in use."""
    detail = ""
    if device.type == "cuda":
        torch.cuda.empty_cache()        # cached blocks of freed tensors are not in use
        free, total = torch.cuda.mem_get_info(device)
        in_use, name = max(0, total - free - resident), f"{device} ({torch.cuda.get_device_name(device)})"
        capacity, what = total, f"of {name}"
        if in_use:
            detail = in_use_detail(total - free, torch.cuda.memory_allocated(device),
                                   torch.cuda.memory_reserved(device), resident)
    else:
        capacity, in_use, what = meminfo_available() + resident, 0, "RAM available (/proc/meminfo MemAvailable)"
    gb = cfg.memory_budget_gb
    if gb is not None:
        usable = int(gb * (1 << 30))
        if usable > capacity - in_use:
            raise MemoryPlanError("memory_budget_gb", f"= {gb} asks for {fmt_bytes(usable)} ({usable} bytes), "
                                  f"more than the {fmt_bytes(capacity - in_use)} free {what}")
        return Budget(capacity, in_use, usable, f"--memory-budget-gb {gb:g}", "memory_budget_gb", detail)
    u = cfg.gpu_memory_utilization
    usable = int(u * capacity) - in_use
    source = f"{u:.2f} x {fmt_bytes(capacity)} {what}" + (f" - {fmt_bytes(in_use)} in use" if in_use else "")
    return Budget(capacity, in_use, usable, source, "gpu_memory_utilization", detail)


def in_use_detail(used: int, allocated: int, reserved: int, resident: int) -> str:
    """Where the device's ``used`` bytes (total - free) beyond our ``resident`` weights are: tensors torch allocated
    for this process besides the counted weights (a leftover tensor, weights that are not parameters or buffers),
    torch's cached blocks that ``empty_cache`` could not return (free parts of segments partly in use: the
    fragments of weights re-allocated after they were placed, e.g. folded or quantized in place), and memory outside
    torch's allocator (the CUDA context, cuBLAS / NCCL workspaces, other processes)."""
    return (f"{fmt_bytes(allocated - resident)} torch tensors beyond the weights + {fmt_bytes(reserved - allocated)} "
            f"cached by torch's allocator (fragments) + {fmt_bytes(used - reserved)} outside it (CUDA context, "
            "libraries, other processes)")


def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (a tensor shared by two modules counted once)."""
    seen, n = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type != "meta" and t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        n += t.numel() * t.element_size()
    return n


def config_weights_bytes(model_cfg, dtype: torch.dtype, tp: int = 1, folder: str | None = None) -> int:
    """:func:`weights_bytes` of the model ``model_cfg`` describes, in ``dtype``, built on the meta device (this rank's
    shard at ``tp``); ``folder``: an FP8 checkpoint's layers are made FP8 as the loader makes them."""
    from gdnserve.models.qwen3_5 import HybridLM
    with torch.device("meta"):
        model = HybridLM(model_cfg, 0, tp)
    if folder is not None and model_cfg.quant is not None:
        from gdnserve.models.loader import (
            checkpoint_source,
            checkpoint_tensors,
            prepare_fp8,
        )
        prepare_fp8(model, model_cfg, checkpoint_source(model_cfg, checkpoint_tensors(folder), model.mtp is not None))
    n = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        size = 1 if t.element_size() == 1 else 4 if name.endswith(("A_log", "scale_inv", "inv_freq")) else dtype.itemsize
        n += t.numel() * size
    return n


def estimate_activations(model_cfg, cfg: EngineConfig, dtype: torch.dtype, tp: int = 1, *, logits: bool = True,
                         tokens: int | None = None, all_logits: bool = True) -> int:
    """A conservative bound on the peak bytes of the largest step (every term its layer's largest temporaries,
    times ``SAFETY``): ``tokens`` (default max_step_tokens) prefill rows; with ``logits`` every row's fp32 logits
    and their log-sum-exp, and the sampler's sort over max_num_seqs x (spec_k + 1) rows. Attention's scores are
    bounded by its kernels' blocks (flash attention on CUDA, query blocks in the PyTorch path): no T^2 term.
    ``all_logits`` False: only the sampled rows' logits (no prompt-logprobs or score step)."""
    c, a, g, m = model_cfg, model_cfg.attn, model_cfg.gdn, model_cfg.mlp
    T, act, h = tokens if tokens is not None else cfg.max_step_tokens, dtype.itemsize, c.hidden_size
    gs, (NH, KVH) = GDNShape.of(g, tp), attn_heads(a.num_heads, a.num_kv_heads, tp)
    HV, K, V, D = gs.HV, gs.K, gs.V, a.head_dim
    proj = gs.conv_dim + HV * V + 2 * HV              # in_proj: q k v z | b a
    conv = gs.conv_dim
    seqs = -(-T // cfg.max_model_len)
    gdn = T * (proj * act * 2 + conv * act + HV * (K + V) * 4 * 2 + HV * V * act * 2) \
        + (-(-T // CHUNK) + seqs) * HV * K * V * 4 * 2      # fp32 chunk states, and their prefix pass
    attn = T * ((NH + 2 * KVH) * D * act * 2 + NH * D * act * 3)
    if m.num_experts:
        k, inter = m.num_experts_per_tok, m.moe_intermediate_size // tp
        mlp = T * k * (h * act * 2 + 3 * inter * act) + T * m.num_experts * 4 * 2 \
            + T * 3 * (m.shared_expert_intermediate_size // tp) * act
    else:
        mlp = T * 3 * (m.intermediate_size // tp) * act
    peak = max(gdn, attn, mlp)
    if logits:
        vocab, sampled = c.vocab_size, cfg.max_num_seqs * (cfg.spec_k + 1)
        R = T if all_logits else min(T, sampled)
        # the logits in the activation dtype and fp32; then (prompt logprobs) a block of the fp32 rows gathered
        # beside them and its log-sum-exp's temporary (sampler.ROW_BLOCK rows at a time), or the sampler's sort
        B = min(R, ROW_BLOCK)
        peak = max(peak, R * vocab * (act + 4), R * vocab * 4 + max(2 * B * vocab * 4, sampled * vocab * 28))
    return int((3 * T * h * act + peak) * SAFETY)


def estimate_graphs(model_cfg, cfg: EngineConfig, dtype: torch.dtype, device: torch.device) -> int:
    """The CUDA graphs' pool: the largest captured step's intermediates without the logits, plus the hidden outputs
    the captured graphs keep (an allowance of 16 of the largest, plus the steady-state mixed graphs the start-up
    warm-up captures: two per batch bucket and none, ``StepGraphs.steady_keys``). Decode / verify graphs have
    max_num_seqs x (spec_k + 1) rows; a prefill / mixed graph's token bucket reaches max_step_tokens and its row
    region holds up to the largest batch bucket's decodes or verifies (spec_k + 1 rows each) besides, however few
    prefill tokens the scheduler left them. 0 where no graphs are captured."""
    if device.type != "cuda" or cfg.graphs is False:
        return 0
    mixed = cfg.prefill_mode == "fused"
    rows = min(cfg.max_num_seqs, BUCKETS[-1]) * (cfg.spec_k + 1)
    T = cfg.max_step_tokens + rows if mixed else rows
    kept = 16 + (2 * (len(BUCKETS) + 1) if mixed else 0)
    keep = kept * T * model_cfg.hidden_size * dtype.itemsize
    return estimate_activations(model_cfg, cfg, dtype, logits=False, tokens=T) + keep


def resolve_pools(cfg: EngineConfig, model_cfg, dtype: torch.dtype, device: torch.device, *, weights: int,
                  resident: int = 0, model=None) -> tuple[EngineConfig, MemoryPlan]:
    """``cfg`` with ``num_pages`` and ``num_slots`` set by the plan, and the plan. ``weights``: the model's bytes
    (``resident`` of them already on the device); ``model``: the loaded model, whose warm-up step measures the
    activation peak when the pools are sized on CUDA (None: the estimate, e.g. before loading). CPU without
    ``memory_budget_gb``, and a tensor-parallel engine's rank 0 (``model`` given): the sizes of
    ``cfg.runner_config()``, checked. Raises MemoryPlanError naming the field."""
    tp, cuda = cfg.tensor_parallel_size, device.type == "cuda"
    rc = replace(cfg.runner_config(), num_slots=1, num_pages=1)       # the bytes of one slot and one page
    sc, pc = pool_configs(model_cfg, rc, dtype, "meta", tp)
    slot_bytes = sc.bytes_per_slot + spec_bytes_per_slot(model_cfg, rc, dtype, tp)
    pages, slots = cfg.num_pages, cfg.num_slots
    if not cuda and cfg.memory_budget_gb is None:
        pages, slots = cfg.pages, cfg.slots       # CPU: fixed (zero-filling a share of the RAM helps no test)
    if tp > 1 and model is not None:
        # the workers were started with cfg.runner_config()'s sizes (planned in load_engine before they started):
        # rank 0 must take the same, only checked
        pages, slots = cfg.pages, cfg.slots
    measured = (pages is None or slots is None) and cuda and model is not None and tp == 1
    if measured:
        try:
            activations = measure_activations(model, cfg)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            raise MemoryPlanError("max_step_tokens", f"= {cfg.max_step_tokens}: the warm-up step of that many "
                                  f"tokens ran out of memory beside the weights ({fmt_bytes(weights)}); lower "
                                  "--max-step-tokens or load FP8 weights") from None
    else:
        # CPU with fixed pools: only a check (nothing is sized from it), without the steps that keep every row's
        # logits (prompt logprobs, scoring): 12 bytes x vocab x max_step_tokens (12 GiB for a vocab of 248320 at
        # 4096 tokens) would refuse a small real model on a laptop for requests it may never get
        activations = estimate_activations(model_cfg, cfg, dtype, tp, all_logits=cuda or pages is None
                                           or slots is None)
    budget = device_budget(device, cfg, resident)    # after the warm-up: its workspaces are in use
    reserve = (MEASURED_RESERVE if measured else RUNTIME_RESERVE) + tier_staging(cfg) if cuda else 0
    demand = Demand(weights=weights, activations=activations, graphs=estimate_graphs(model_cfg, cfg, dtype, device),
                    runtime=reserve, measured=measured)
    p = plan(budget, demand, page_bytes=pc.bytes_per_page, slot_bytes=slot_bytes, page_size=cfg.page_size,
             max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs, num_pages=pages, num_slots=slots)
    return replace(cfg, num_pages=p.num_pages, num_slots=p.num_slots), p


@torch.inference_mode()
def measure_activations(model, cfg: EngineConfig) -> int:
    """Peak bytes of the largest step above what is allocated before it (nano-vllm's warm-up): one eager prefill
    of max_step_tokens random tokens (sequences of at most max_model_len) with every row's logits, then what prompt
    logprobs compute from them (a block of rows gathered, its log-sum-exp, the top logprobs, ROW_BLOCK rows at a
    time), on temporary pools just large enough; plus the sampler's sort over max_num_seqs x (spec_k + 1) rows
    beyond that block's log-sum-exp (its temporaries are not in the forward). No step holds more rows of logits:
    a prompt_logprobs prompt or a score candidate longer than max_step_tokens is chunked (single-sample prompt
    logprobs) or refused at intake."""
    from gdnserve.engine.cache.sequence import PrefillItem
    from gdnserve.engine.execution.model_runner import (
        ModelRunner,
        build_pools,
    )
    from gdnserve.engine.execution.sampler import token_logprobs_rows
    from gdnserve.engine.sampling_params import MAX_LOGPROBS
    dev = model.embed_tokens.weight.device
    T, L, ps = cfg.max_step_tokens, cfg.max_model_len, cfg.page_size
    lens = [min(L, T - i) for i in range(0, T, L)]
    rc = replace(cfg.runner_config(), num_slots=len(lens) + 1, num_pages=sum(-(-n // ps) for n in lens) + 1,
                 cuda_graphs=False, graph_capture=False, spec_mode=None, spec_tokens=0)
    gc.collect()
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    # the runner binds its temporary pools into the layers: rebound to what they held before once measured, so
    # that they are freed now, not counted as in use by device_budget (a slot of the full-size model is 61 MiB)
    gdn, attn = model.gdn_layers(), model.attention_layers()
    held = [(m.conv_pool, m.ssm_pool) for m in gdn], [(m.k_cache, m.v_cache) for m in attn]
    runner = ModelRunner(model, rc, build_pools(model, rc))
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    gen = torch.Generator().manual_seed(0)
    vocab = model.cfg.vocab_size
    items = [PrefillItem(runner.new_seq(), torch.randint(0, vocab, (n,), generator=gen).tolist(), all_logits=True)
             for n in lens]
    logits = runner.step(items, [])
    rows = torch.arange(logits.shape[0] - 1, device=dev)
    # what prompt logprobs compute (output_processor.prompt_logprobs): the rows' log-softmax at their targets and
    # top MAX_LOGPROBS, ROW_BLOCK rows at a time (sampler.token_logprobs_rows)
    token_logprobs_rows(logits, rows, rows % vocab, MAX_LOGPROBS)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    del logits, rows, items, runner
    for m, (conv, ssm) in zip(gdn, held[0]):
        m.bind_state(conv, ssm)
    for m, (k, v) in zip(attn, held[1]):
        m.bind_cache(k, v)
    gc.collect()
    torch.cuda.empty_cache()
    sampled = cfg.max_num_seqs * (cfg.spec_k + 1) * vocab * 28
    return peak + max(0, sampled - min(T, ROW_BLOCK) * vocab * 4)


def check_before_load(cfg: EngineConfig, model: str | None, dtype: torch.dtype,
                      device: torch.device) -> tuple[EngineConfig, MemoryPlan]:
    """The plan from the model's config alone, before anything is loaded (``model``: an HF folder or None for the
    embedded model): raises MemoryPlanError for a model or a pool size that cannot fit."""
    from pathlib import Path

    from gdnserve.models.builtin import builtin_config
    from gdnserve.models.config import ModelConfig
    model_cfg = builtin_config() if model is None else ModelConfig.from_hf(Path(model))
    if cfg.tensor_parallel_size > 1:      # the shard this rank's plan prices must exist: its own message first
        from gdnserve.engine.tp.tp_check import check_tensor_parallel
        check_tensor_parallel(model_cfg, cfg.tensor_parallel_size, device)
    weights = config_weights_bytes(model_cfg, dtype, cfg.tensor_parallel_size, model)
    return resolve_pools(cfg, model_cfg, dtype, device, weights=weights)

