"""The random-weight benchmark model at any tensor-parallel size, and rank 0's handle on it (bench_tp, bench_serve).

``build_random_shard(hf_cfg, device, dtype, rank, size)``: rank ``rank``'s shard of one fixed random model. Each
parameter's FULL tensor is drawn (in the parameter order of the full model, one device generator, the rules of
``random_model.init_random_``) and cut by the layer's own ``weight_loader`` (layers/linear.py ``load_shard``), so
the shards of every size are cuts of the same weights and ``size = 1`` is the whole model: TP = 2's outputs can be
held to TP = 1's. The full tensors exist one at a time (the largest, a layer's expert gate/up block of the
full-size model, is 1 GiB), so a rank needs its shard's memory and nothing more. ``chain``: then
``random_model.make_greedy_chain_`` (replicated embedding and lm head, the same on every rank), so greedy tokens are
robust to bf16 rounding; its permutation is ``model.chain_perm``.

``RandomSpec`` is the ``tp_workers.ModelSpec`` that every rank loads it through (picklable: the spawned workers
build their own shards on their own GPUs). ``TPSession`` starts the group once (rank 0 = this process) for one
``RunnerConfig`` and hands out runners and engines over it, all on that config (the workers' pools are built for
it); at size 1 there is no group and they are plain ModelRunner / LLMEngine objects.

``CollectiveTimer``: wraps ``torch.distributed.all_reduce`` (which layers/parallel.py calls) to time every
collective of rank 0: CUDA events around each call on the current stream (the NCCL kernel, including its wait for
the slower rank; no host sync added) or perf_counter on CPU (gloo is synchronous)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.random_model import NullTokenizer, make_greedy_chain_
from gdnserve.engine.config import EngineConfig
from gdnserve.engine.execution.model_runner import (
    ModelRunner,
    RunnerConfig,
    build_pools,
)
from gdnserve.engine.llm_engine import LLMEngine
from gdnserve.engine.tp.tp_workers import ModelSpec, TPGroup
from gdnserve.layers.moe import fold_shared_experts
from gdnserve.models.config import ModelConfig


def _draw(name: str, shape: list[int], dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """A full parameter by ``init_random_``'s rules (drawn in ``dtype`` on the device, as on CUDA there)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if name.endswith("A_log"):
        return t.uniform_(1, 16, generator=gen).log_()
    if name.endswith("dt_bias"):
        return t.fill_(1.0)
    if "conv" in name:
        return t.normal_(0, 0.3, generator=gen)
    if "norm" in name:
        return t.fill_(1.0 if name.endswith(("mixer.norm.weight", "linear_attn.norm.weight")) else 0.0)
    return t.normal_(0, 0.02 if len(shape) > 1 else 1 / math.sqrt(math.prod(shape)), generator=gen)


@torch.no_grad()
def build_random_shard(hf_cfg: dict[str, Any], device: torch.device, dtype: torch.dtype, rank: int = 0,
                       size: int = 1, seed: int = 0, chain: bool = True):
    """Rank ``rank`` of ``size``'s shard of the random model (module docstring)."""
    from gdnserve.layers.linear import full_shape, load_shard
    from gdnserve.models.qwen3_5 import HybridLM
    cfg = ModelConfig.from_hf(hf_cfg)
    with torch.device("meta"):
        model = HybridLM(cfg, rank, size).to(dtype)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        owner, _, attr = name.rpartition(".")
        full = _draw(name, full_shape(model.get_submodule(owner), attr), p.dtype, device, gen)
        p.copy_(load_shard(model, name, full))
        del full
    fold_shared_experts(model)                 # as the loader does (per rank: its shard of the shared expert)
    for layer in model.gdn_layers():
        layer.A_log.data = layer.A_log.data.float()
    for attn in model.attention_layers():
        attn.rotary.reset_buffers()
    model.chain_perm = make_greedy_chain_(model) if chain else None
    return model.eval()


@dataclass(frozen=True)
class RandomSpec(ModelSpec):
    """What every rank builds: ``build_random_shard`` of ``hf_cfg`` (path stays None: nothing on disk)."""
    hf_cfg: dict = field(default_factory=dict)
    seed: int = 0
    chain: bool = True

    def load(self, rank: int, size: int):
        return build_random_shard(self.hf_cfg, self.device(rank), getattr(torch, self.dtype), rank, size,
                                  self.seed, self.chain)


class TPSession:
    """Rank 0's shard and (size > 1) the worker group, for one RunnerConfig (module docstring)."""

    def __init__(self, hf_cfg: dict[str, Any], device: torch.device, dtype: torch.dtype, size: int,
                 rc: RunnerConfig, chain: bool = True, seed: int = 0) -> None:
        from gdnserve.engine.tp.tp_check import check_tensor_parallel
        self.size, self.rc = size, rc
        self.spec = RandomSpec(None, str(dtype).removeprefix("torch."), device.type, hf_cfg=hf_cfg, seed=seed,
                               chain=chain)
        self.group: TPGroup | None = None
        if size == 1:
            self.model = build_random_shard(hf_cfg, device, dtype, 0, 1, seed, chain)
            return
        check_tensor_parallel(ModelConfig.from_hf(hf_cfg), size, device)
        self.group = TPGroup(self.spec, size, rc)
        try:
            self.group.start()
            self.model = self.spec.load(0, size)      # rank 0's shard while the workers build theirs
            self.group.wait_ready()
        except BaseException:
            self.group.close()
            raise

    def runner(self) -> ModelRunner:
        """A runner on the session's config (its own rank-0 pools; the workers' are shared by all)."""
        if self.group is None:
            return ModelRunner(self.model, self.rc)
        from gdnserve.engine.tp.tp_runner import TPRunner
        return TPRunner(self.model, self.rc, build_pools(self.model, self.rc), self.group)

    def engine(self, cfg: EngineConfig) -> LLMEngine:
        """An LLMEngine (token-id prompts: NullTokenizer); ``cfg.runner_config()`` must be the session's."""
        cfg = cfg.with_(tensor_parallel_size=self.size, **({"cuda_graphs": False} if self.size > 1 else {}))
        if cfg.runner_config() != self.rc:
            raise ValueError(f"engine config gives {cfg.runner_config()}, the session was started for {self.rc}")
        if self.group is None:
            return LLMEngine(self.model, NullTokenizer(), cfg)
        from gdnserve.engine.tp.tp_runner import TPRunner
        return LLMEngine(self.model, NullTokenizer(), cfg, runner_factory=partial(TPRunner, group=self.group))

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
        self.model = None


class CollectiveTimer:
    """Times rank 0's ``dist.all_reduce`` calls while active (module docstring). ``result(steps)``: calls and ms
    per step."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.events: list[tuple[Any, Any]] = []
        self.host_s = 0.0
        self._orig = None

    def __enter__(self) -> CollectiveTimer:
        self._orig = orig = dist.all_reduce

        def timed_all_reduce(*a, **kw):
            if self.cuda:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                out = orig(*a, **kw)
                e.record()
                self.events.append((s, e))
                return out
            t0 = time.perf_counter()
            out = orig(*a, **kw)
            self.host_s += time.perf_counter() - t0
            self.events.append((None, None))
            return out
        dist.all_reduce = timed_all_reduce
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self._orig

    def result(self, steps: int) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
            total_ms = sum(s.elapsed_time(e) for s, e in self.events)
        else:
            total_ms = self.host_s * 1e3
        return {"calls_per_step": len(self.events) / max(steps, 1), "ms_per_step": total_ms / max(steps, 1),
                "steps": steps, "method": "cuda events around dist.all_reduce" if self.cuda else
                "perf_counter around dist.all_reduce (gloo)"}
