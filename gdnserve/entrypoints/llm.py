"""``LLM``: the offline Python API. ``LLM()`` runs the embedded default model; ``LLM(path)`` an HF
checkpoint folder. ``generate`` drives the engine loop until every request has finished."""
from __future__ import annotations

import logging
from typing import Sequence

import torch

from gdnserve.engine.config import EngineConfig
from gdnserve.engine.engine_api import EngineDeadError, RequestOutput, ScoreResult
from gdnserve.engine.llm_engine import LLMEngine
from gdnserve.engine.memory.memory_budget import check_before_load
from gdnserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def load_engine(model: str | None = None, *, dtype: str | None = None, device: str = "auto",
                config: EngineConfig | None = None, **fields) -> LLMEngine:
    """The engine over the embedded model (None) or an HF checkpoint folder. ``config`` or EngineConfig fields
    as keywords (max_num_seqs, num_pages, num_slots, page_size, max_model_len, max_step_tokens, prefill_mode, seed,
    auto_checkpoints, spec_k, spec_mode, spec_draft, cuda_graphs=False to step eagerly, tensor_parallel_size,
    gpu_memory_utilization, memory_budget_gb). The memory plan runs first, from the model's config.json alone:
    a model or a pool size that cannot fit raises MemoryPlanError (a ValueError naming the field) before anything
    is loaded or allocated (docs/serving.md § Memory planning).
    ``tensor_parallel_size`` N > 1 starts N - 1 worker processes (one GPU each on CUDA, gloo on CPU); call the
    engine's ``close()`` (``LLM.close``) to stop them (atexit does it otherwise)."""
    from gdnserve.models.builtin import build_builtin_model
    from gdnserve.models.loader import load_model
    from gdnserve.models.tokenizer import load_tokenizer
    cfg = (config or EngineConfig(model_name=model or "gdnserve-embedded")).with_(**fields)
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    dt = getattr(torch, dtype) if dtype else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    planned, _ = check_before_load(cfg, model, dt, dev)
    if cfg.tensor_parallel_size > 1:     # every rank's pools the same size: planned here, once, from rank 0's GPU
        from gdnserve.engine.tp.tp_launch import start_tp_engine
        return start_tp_engine(model, dt, dev, planned)
    net = build_builtin_model(dtype=dt, device=dev) if model is None else load_model(model, dtype=dt, device=dev)[0]
    return LLMEngine(net, load_tokenizer(model), cfg)


class LLM:
    def __init__(self, model: str | None = None, **engine_kw):
        self.engine = load_engine(model, **engine_kw)

    def close(self) -> None:
        """Stop the tensor-parallel worker processes, if any (idempotent; also at interpreter exit)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]], params: SamplingParams | None = None,
                 checkpoint_at: int | None = None) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``. A prompt's ``<|state_checkpoint|>`` marker (or
        ``checkpoint_at``) makes its prefix a checkpoint shared by the prompts with the same prefix. A request
        the engine had to fail comes back finished with ``error`` set (finish_reason "abort"); the others are
        unaffected. Invalid input raises before anything is queued."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        params = params or SamplingParams()
        e = self.engine
        reqs = [e.make_request(None, p, params, checkpoint_at) for p in batch]    # all validated first
        ids = [e.submit(r) for r in reqs]
        final: dict[str, RequestOutput] = {}
        failures = 0
        try:
            while len(final) < len(ids) and e.has_unfinished():
                try:
                    outs = e.step()
                    failures = 0
                except Exception as err:     # noqa: BLE001  rolled back; the engine isolates the culprit next
                    failures += 1
                    if failures > 3:         # not a request's fault: every step fails
                        raise
                    logger.warning("engine step failed (isolating the request that causes it): %r", err)
                    continue
                final.update({o.request_id: o for o in outs if o.finished})
        finally:
            for rid in ids:
                if rid not in final:
                    e.abort(rid)
        if e.dead is not None:          # not these requests' fault: the engine cannot run any more
            raise EngineDeadError(e.dead)
        return [final[i] for i in ids]

    def score(self, prefix: str | list[int], candidates: list[str | list[int]],
              label_token_ids: list[int] | None = None) -> ScoreResult:
        return self.engine.score(prefix, candidates, label_token_ids)
