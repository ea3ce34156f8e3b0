"""EngineConfig: every engine default, once. The offline ``LLM``, the CLI (``entrypoints/serve.py``
``engine_config``: the flags -> config mapping every command shares) and the server build one; the engine derives
the runner's config from it (``runner_config``: a new object, nothing the caller passed is mutated). RunnerConfig
takes its defaults from EngineConfig's fields; only what a runner on its own needs beyond them (its small pools,
the graph buckets' bounds) is its own."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

PREFILL_MODES = ("serial", "two_phase", "two_phase_indexed", "fused")
FIXED_PAGES = 2048      # num_pages when nothing sizes the pools (CPU without memory_budget_gb)


# The overlapped loop is the default on CUDA (issue 26): exact on the CPU (tests/engine/test_overlap.py, the
# property test in both modes) and on the H200 (tests/engine/test_overlap_gpu.py with graphs, and every engine and
# server GPU test running on it by default). ``overlap=False`` / ``gdnserve serve --no-overlap`` is the serial loop.
OVERLAP_BY_DEFAULT = True

@dataclass(frozen=True)
class EngineConfig:
    """``num_pages`` / ``num_slots`` None = sized by the memory plan (engine/memory/memory_plan.py) from
    ``gpu_memory_utilization`` of the device (CUDA) or from ``memory_budget_gb`` (any device); on CPU without
    ``memory_budget_gb`` they are fixed: ``FIXED_PAGES`` pages and ``2 * max_num_seqs + 2`` slots (running samples,
    their fork producers and checkpoints), checked against the RAM available. Given sizes are checked, not changed.
    ``cuda_graphs`` None = on for CUDA devices (decode-only and verify-only steps replay bucketed graphs).
    ``tensor_parallel_size`` N > 1: N processes, one GPU each (engine/tp/tp_workers.py); steps run eagerly.
    ``max_partial_prefills``: prompts (or checkpoint / score prefixes) prefilled chunk by chunk at once; a prompt
    that needs chunking waits while this many are in progress, without holding up shorter jobs behind it (vLLM's
    ``max_long_partial_prefills``; docs/serving.md "Chunked prefill").
    ``checkpoint_host_memory_gb`` > 0: evicted checkpoints are copied to that much pinned host memory (one arena
    pinned at start-up; ordinary memory on CPU) and restored on a hit; ``checkpoint_dir``: below it (or below the device when the host tier is off) a
    directory of checkpoint files of at most ``checkpoint_dir_max_gb``, kept across restarts
    (engine/cache/checkpoint_tiers.py; docs/serving.md "Checkpoint tiers"). ``checkpoint_spill_ahead`` W (host tier
    on): when fewer than W state slots are free (or too few KV pages for the running requests and the next waiting
    one), the least recently used READY checkpoints are copied to the host tier in the background, staying usable on
    the device until their slot is needed, then dropped without a copy (0: off; only evictions copy down).

    ``overlap``: the overlapped loop (llm_engine.py: step n + 1 is scheduled and launched with step n's sampled ids
    still on the device, and step n's outputs processed while it runs); None = ``OVERLAP_BY_DEFAULT`` on a CUDA device. It needs
    ``spec_k = 0`` and ``tensor_parallel_size = 1`` (None then means off)."""
    max_num_seqs: int = 64
    max_step_tokens: int = 4096
    max_model_len: int = 4096
    num_pages: int | None = None
    page_size: int = 16
    num_slots: int | None = None
    gpu_memory_utilization: float = 0.9
    memory_budget_gb: float | None = None
    prefill_mode: str = "fused"
    backend: str = "auto"
    auto_checkpoints: bool = True
    spec_k: int = 0
    spec_mode: str = "replay"
    spec_draft: str = "ngram"
    cuda_graphs: bool | None = None
    graph_capture: bool | None = None
    seed: int | None = None
    model_name: str = "gdnserve"
    tensor_parallel_size: int = 1
    max_partial_prefills: int = 1
    checkpoint_host_memory_gb: float = 0.0
    checkpoint_dir: str | None = None
    checkpoint_dir_max_gb: float = 64.0
    checkpoint_spill_ahead: int = 2
    overlap: bool | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_step_tokens", "max_model_len", "page_size", "max_partial_prefills"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.num_pages is not None and (not isinstance(self.num_pages, int) or isinstance(self.num_pages, bool)
                                           or self.num_pages < 1):
            raise ValueError(f"num_pages must be null or an int >= 1, got {self.num_pages!r}")
        u = self.gpu_memory_utilization
        if not isinstance(u, (int, float)) or isinstance(u, bool) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {u!r}")
        b = self.memory_budget_gb
        if b is not None and (not isinstance(b, (int, float)) or isinstance(b, bool) or not b > 0):
            raise ValueError(f"memory_budget_gb must be null or a number > 0, got {b!r}")
        if self.num_slots is not None and (not isinstance(self.num_slots, int) or self.num_slots < 2):
            raise ValueError(f"num_slots must be null or an int >= 2, got {self.num_slots!r}")
        if self.prefill_mode not in PREFILL_MODES:
            raise ValueError(f"prefill_mode must be one of {PREFILL_MODES}, got {self.prefill_mode!r}")
        if self.spec_draft not in ("ngram", "mtp"):
            raise ValueError(f"spec_draft must be 'ngram' or 'mtp', got {self.spec_draft!r}")
        if self.spec_mode not in ("replay", "intermediate"):
            raise ValueError(f"spec_mode must be 'replay' or 'intermediate', got {self.spec_mode!r}")
        if not isinstance(self.spec_k, int) or self.spec_k < 0:
            raise ValueError(f"spec_k must be an int >= 0, got {self.spec_k!r}")
        for name in ("checkpoint_host_memory_gb", "checkpoint_dir_max_gb"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")
        w = self.checkpoint_spill_ahead
        if not isinstance(w, int) or isinstance(w, bool) or w < 0:
            raise ValueError(f"checkpoint_spill_ahead must be an int >= 0, got {w!r}")
        if self.checkpoint_dir is not None and (not isinstance(self.checkpoint_dir, str) or not self.checkpoint_dir):
            raise ValueError(f"checkpoint_dir must be null or a directory path, got {self.checkpoint_dir!r}")
        tp = self.tensor_parallel_size
        if tp > 1 and (self.checkpoint_host_memory_gb or self.checkpoint_dir is not None):
            raise ValueError(f"checkpoint_host_memory_gb / checkpoint_dir: not with tensor_parallel_size = {tp} (the "
                             "state of the other ranks' shards lives in their processes)")
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
        if self.overlap and (self.spec_k or tp > 1):
            raise ValueError(f"overlap: not with spec_k = {self.spec_k} / tensor_parallel_size = {tp} (the overlapped "
                             "loop feeds sampled ids on one device and has no draft acceptance)")
        if tp > 1 and (self.cuda_graphs or self.graph_capture):
            raise ValueError(f"cuda_graphs / graph_capture: not with tensor_parallel_size = {tp} (tensor-parallel "
                             "steps run eagerly)")

    @property
    def graphs(self) -> bool | None:
        """Whether steps replay CUDA graphs, decided here only: never under tensor parallelism (its steps run
        eagerly: a collective inside a captured graph is not supported); else ``cuda_graphs`` (None: on for a
        CUDA device with a capturable forward, the runner's ``build_step_graphs`` resolves it)."""
        return False if self.tensor_parallel_size > 1 else self.cuda_graphs

    def overlapped(self, device_type: str) -> bool:
        """Whether the engine on a ``device_type`` device runs the overlapped loop (``overlap`` resolved)."""
        if self.overlap is not None:
            return self.overlap
        return OVERLAP_BY_DEFAULT and device_type == "cuda" and self.spec_k == 0 and self.tensor_parallel_size == 1

    @property
    def slots(self) -> int:
        return self.num_slots if self.num_slots is not None else 2 * self.max_num_seqs + 2

    @property
    def pages(self) -> int:
        """``num_pages``, or the fixed size when nothing sized the pools."""
        return self.num_pages if self.num_pages is not None else FIXED_PAGES

    def runner_config(self) -> RunnerConfig:
        k = self.spec_k
        return RunnerConfig(num_slots=self.slots, num_pages=self.pages, page_size=self.page_size,
                            prefill_mode=self.prefill_mode, backend=self.backend,
                            spec_mode=self.spec_mode if k else None, spec_tokens=k + 1 if k else 0,
                            spec_draft=self.spec_draft,
                            cuda_graphs=self.graphs,
                            graph_capture=self.graph_capture, graph_max_batch=self.max_num_seqs,
                            max_model_len=self.max_model_len, graph_max_tokens=self.max_step_tokens)

    @classmethod
    def from_runner(cls, rc: RunnerConfig, **kw) -> EngineConfig:
        """The config of an engine built from an explicit RunnerConfig (benchmarks and tests size the pools)."""
        base = dict(num_slots=rc.num_slots, num_pages=rc.num_pages, page_size=rc.page_size,
                    prefill_mode=rc.prefill_mode, backend=rc.backend, graph_capture=rc.graph_capture)
        if rc.cuda_graphs is not None:
            base["cuda_graphs"] = rc.cuda_graphs
        base.update({k: v for k, v in kw.items() if v is not None or k in ("seed", "cuda_graphs")})
        if base.get("cuda_graphs") is None and rc.cuda_graphs is not None:
            base["cuda_graphs"] = rc.cuda_graphs
        return cls(**base)

    def with_(self, **kw) -> EngineConfig:
        known = {f.name for f in fields(self)}
        bad = sorted(set(kw) - known)
        if bad:
            raise TypeError(f"EngineConfig has no field(s) {bad}")
        return replace(self, **kw)


_E = EngineConfig      # a frozen dataclass's class attributes are its fields' defaults


@dataclass
class RunnerConfig:
    """The ModelRunner's config: ``EngineConfig.runner_config()`` for an engine; a runner on its own (kernel-level
    tests, ``gdnserve generate``) gets small pools by default and EngineConfig's defaults for the rest."""
    num_slots: int = 32
    num_pages: int = 512
    page_size: int = _E.page_size
    prefill_mode: str = _E.prefill_mode
    backend: str = _E.backend
    staging_ints: int = 1 << 20
    spec_mode: str | None = None     # "intermediate" | "replay": speculative verify buffers
    spec_tokens: int = 0             # L = k + 1 tokens per verify
    spec_draft: str = _E.spec_draft  # "ngram": verify tokens come with the step; "mtp": the runner drafts them
    cuda_graphs: bool | None = _E.cuda_graphs   # decode/verify steps via bucketed graphs (cuda_graphs.py); None = on for CUDA
    graph_capture: bool | None = _E.graph_capture   # False: the same padded static-buffer path, run eagerly (None = on CUDA)
    graph_max_batch: int | None = None  # largest bucket (max_num_seqs); None = min(256, num_slots)
    max_model_len: int = _E.max_model_len   # sets the graphs' page-table width; longer sequences step eagerly
    mixed_graphs: bool = True        # prefill and mixed steps via graphs too (prefill_mode "fused")
    graph_max_tokens: int | None = None  # largest prefill-token bucket; None = min(max_model_len, 8192)
