"""``LLM``: the offline Python API. ``LLM()`` runs the embedded default model; ``LLM(path)`` an HF
checkpoint folder. ``generate`` drives the engine loop until every request has finished."""
from __future__ import annotations

from typing import Sequence

import torch

from gdnserve.engine.engine_api import RequestOutput
from gdnserve.engine.llm_engine import LLMEngine
from gdnserve.engine.model_runner import RunnerConfig
from gdnserve.engine.sampling_params import SamplingParams


def load_engine(model: str | None = None, *, dtype: str | None = None, device: str = "auto",
                prefill_mode: str = "fused", max_num_seqs: int = 64, num_pages: int = 2048, page_size: int = 16,
                max_model_len: int = 4096, seed: int | None = None, auto_checkpoints: bool = True,
                spec_k: int = 0, spec_mode: str = "replay", spec_draft: str = "ngram",
                max_step_tokens: int = 4096, cuda_graphs: bool | None = None) -> LLMEngine:
    """``cuda_graphs=False`` runs every step eagerly (default: CUDA graphs for decode / verify steps on CUDA)."""
    from gdnserve.models.builtin import build_builtin_model
    from gdnserve.models.loader import load_model
    from gdnserve.models.tokenizer import load_tokenizer
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    dt = getattr(torch, dtype) if dtype else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    net = build_builtin_model(dtype=dt, device=dev) if model is None else load_model(model, dtype=dt, device=dev)[0]
    rc = RunnerConfig(num_slots=2 * max_num_seqs + 2, num_pages=num_pages, page_size=page_size,
                      prefill_mode=prefill_mode)
    return LLMEngine(net, load_tokenizer(model), runner=rc, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                     model_name=model or "gdnserve-embedded", seed=seed, auto_checkpoints=auto_checkpoints,
                     spec_k=spec_k, spec_mode=spec_mode, spec_draft=spec_draft, max_step_tokens=max_step_tokens,
                     cuda_graphs=cuda_graphs)


class LLM:
    def __init__(self, model: str | None = None, **engine_kw):
        self.engine = load_engine(model, **engine_kw)

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]], params: SamplingParams | None = None,
                 checkpoint_at: int | None = None) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``. A prompt's ``<|state_checkpoint|>`` marker (or
        ``checkpoint_at``) makes its prefix a checkpoint shared by the prompts with the same prefix."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        params = params or SamplingParams()
        ids = [self.engine.add_request(None, p, params, checkpoint_at) for p in batch]
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]
