"""The boundary between the front doors (HTTP server, CLI) and the engine: what the server sends, what the
engine streams back, and the :class:`AsyncEngineClient` protocol the engine implements. Nothing here runs
a model; the server is written against this module only, so either side can change behind it.

Contract, in short:

- ``generate(req)`` is an async generator. Each item is a :class:`RequestOutput` with, per sample, the
  FULL text / token ids / logprobs so far (not deltas); the last item has ``finished=True`` and every
  sample a ``finish_reason``. ``n`` samples of one prompt travel in one ``RequestOutput`` (``index`` 0..n-1).
- Bad input the server could not see (a misplaced or repeated marker, a checkpoint offset outside the
  prompt, a label id the model lacks) is raised as ``ValueError`` (or a subclass) with a message that names
  the problem, from the call or from the first ``__anext__``; the server answers 400 with that message.
  Any other exception fails that request alone (500).
- ``abort(request_id)`` cancels a request and frees its slots and pages; aborting an unknown or finished
  request is a no-op. The generator of an aborted request may end with ``finish_reason="abort"`` or stop.
- Logprobs: ``SamplingParams.logprobs = k`` asks, per generated token, for a dict ``token id -> logprob``
  holding the sampled token and the ``k`` most likely tokens (``k = 0``: the sampled token only);
  ``prompt_logprobs = k`` the same per prompt token (``None`` for the first, which has no context).
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "abort"]
TokenLogprobs = dict[int, float]


class EngineDeadError(RuntimeError):
    """The engine cannot run any more steps (e.g. a tensor-parallel worker process is gone): every open and every
    later request fails with this message; the server exits non-zero."""


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """Where a request's state came from. ``hit_length``: prompt tokens covered by the checkpoint it
    started from (0 on a miss); ``miss_reason``: why the lookup missed (``MissReason`` values: absent,
    pending, evicted, collision; "prompt_logprobs": not looked up, the request wants every prompt position's
    logits), None on a hit; ``published``: whether this
    request published a checkpoint (at its marker / ``checkpoint_at``, or the automatic one at its end); ``tier``:
    on a hit on a published checkpoint, where it was found: "gpu", or "host" / "disk" when it was restored from
    that tier for this request (None on a miss or a checkpoint produced in the same step)."""
    hit_length: int = 0
    miss_reason: str | None = None
    published: bool = False
    tier: str | None = None


@dataclass(slots=True)
class GenerateRequest:
    """One prompt to generate from. ``prompt`` is text (the engine tokenizes it and strips a marker) or
    token ids (the server sends ids, marker already stripped, with ``checkpoint_at`` = the offset).
    ``checkpoint_at``: publish the state after exactly that many prompt tokens (0 < c < len(prompt))."""
    request_id: str
    prompt: str | list[int]
    params: Any  # gdnserve.engine.sampling_params.SamplingParams (see make_sampling_params)
    checkpoint_at: int | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One sample so far. ``logprobs[i]`` belongs to ``token_ids[i]`` (None when not asked for).
    ``cumulative_logprob``: the sum of the tokens' logprobs; None for a speculating request that did not ask for
    logprobs (its verified tokens' logprobs are not computed)."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None
    cumulative_logprob: float | None = None
    finish_reason: FinishReason | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    checkpoint: CheckpointInfo = field(default_factory=CheckpointInfo)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # only with SamplingParams.prompt_logprobs
    error: str | None = None    # set when the engine failed this request alone (finish_reason "abort")


@dataclass(frozen=True, slots=True)
class CandidateScore:
    """One candidate scored after the prefix: the summed and mean log-probability of its tokens, and
    with ``label_token_ids`` the probability of each label token as the NEXT token after prefix +
    candidate (full-vocabulary softmax; the server renormalises over the labels when asked)."""
    index: int
    sum_logprob: float
    mean_logprob: float
    num_tokens: int
    label_probs: dict[int, float] | None = None
    checkpoint: CheckpointInfo = field(default_factory=CheckpointInfo)


@dataclass(frozen=True, slots=True)
class ScoreResult:
    prefix_token_ids: list[int]
    candidates: list[CandidateScore]  # in the order of the request's candidates


@runtime_checkable
class TokenizerLike(Protocol):
    """What the server needs of ``gdnserve.models.tokenizer.BaseTokenizer``."""
    @property
    def vocab_size(self) -> int: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...
    def encode_with_marker(self, text: str) -> tuple[list[int], int | None]: ...
    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str: ...


@runtime_checkable
class AsyncEngineClient(Protocol):
    """The engine as the server sees it. All coroutines run on the server's event loop; an engine that
    steps on another thread hands results over to that loop itself."""
    model_name: str
    max_model_len: int      # prompt + generated tokens, per sequence
    tokenizer: TokenizerLike

    def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]: ...

    async def score(self, prefix: str | list[int], candidates: list[str | list[int]],
                    label_token_ids: list[int] | None = None) -> ScoreResult: ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> dict[str, Any]:
        """A snapshot for /metrics. Keys the server knows (others are exported as gauges): queue_depth,
        running, state_pool_used, state_pool_total, page_pool_used, page_pool_total, checkpoint_hits,
        checkpoint_misses (dict reason -> count), checkpoints_published, tokens_generated,
        prompt_tokens, requests_finished (the last four monotonic counters)."""
        ...


@dataclass(frozen=True, slots=True)
class _FallbackSamplingParams:
    """Stand-in until ``gdnserve.engine.sampling_params.SamplingParams`` exists; same field names."""
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0            # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    ignore_eos: bool = False


def make_sampling_params(**fields: Any) -> Any:
    """The engine's SamplingParams from the fields a client set (unset ones keep the engine's defaults).
    Field names: n, max_tokens, temperature, top_p, top_k, seed, stop, logprobs, prompt_logprobs, ignore_eos."""
    try:
        from gdnserve.engine.sampling_params import SamplingParams
    except ModuleNotFoundError as e:
        if e.name != "gdnserve.engine.sampling_params":
            raise
        SamplingParams = _FallbackSamplingParams
    return SamplingParams(**fields)
