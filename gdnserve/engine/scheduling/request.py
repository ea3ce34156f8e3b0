"""What the scheduler schedules: a generation ``Request`` (``n`` ``Sample``s of one prompt) and a ``ScoreJob``
(a prefix and its candidates). Both carry one progress counter, ``num_computed``: the prompt (or score prefix)
tokens whose state is computed or scheduled in the running step, in the spirit of vLLM's
``num_computed_tokens`` (each sample's own output progress is its token list)."""
from __future__ import annotations

from dataclasses import dataclass, field

from gdnserve.engine.cache.checkpoint_index import Checkpoint, key_of_i32
from gdnserve.engine.cache.sequence import SeqState
from gdnserve.engine.detokenizer import IncrementalDetokenizer
from gdnserve.engine.engine_api import CandidateScore, CheckpointInfo
from gdnserve.engine.sampling_params import SamplingParams


class RequestError(ValueError):
    """A request the engine refuses; the message names the problem (the server answers 400), ``param`` the request
    field to blame when there is one (the server's error ``param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(eq=False)
class Sample:
    index: int
    detok: IncrementalDetokenizer
    seq: SeqState | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float] | None] | None = None
    cumulative_logprob: float | None = 0.0   # None once a verified token came without its logprob (speculation)
    text: str = ""
    finish_reason: str | None = None

    @property
    def live(self) -> bool:
        return self.finish_reason is None


@dataclass(eq=False)
class Producer:
    """A chunked checkpoint producer in flight: the index entry (PENDING while chunks run; READY, with a
    reference held by the request, between its last chunk and the step its samples continue from it) and the
    sequence over the entry's slot that carries the prefix's KV pages."""
    entry: Checkpoint
    seq: SeqState

    @property
    def end(self) -> int:
        """Prompt tokens the prefix covers: the request's marker, or the fork point of n samples of a prompt
        too long for one step (admission.Admission._plan)."""
        return len(self.entry.token_ids)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    checkpoint_at: int | None
    samples: list[Sample]
    checkpoint: CheckpointInfo = field(default_factory=CheckpointInfo)
    prompt_logprobs: list | None = None
    num_computed: int = 0             # prompt tokens scheduled so far (< len(prompt_ids) while chunked)
    prod: Producer | None = None      # while its checkpoint prefix is prefilled chunk by chunk
    error: str | None = None          # why the engine failed it (finish_reason "abort")
    prompt_i32: bytes | None = None   # prompt_ids as native int32 bytes (intake): checkpoint keys of its prefixes

    def prefix_key(self, n: int) -> bytes | None:
        """``checkpoint_key(prompt_ids[:n])`` from the intake bytes (None without them: the index hashes)."""
        return None if self.prompt_i32 is None else key_of_i32(n, self.prompt_i32[:4 * n])

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    @property
    def live_samples(self) -> list[Sample]:
        return [s for s in self.samples if s.finish_reason is None]

    @property
    def preempted(self) -> bool:
        """Waiting with output already generated: it is recomputed on readmission."""
        return any(s.token_ids for s in self.samples)

    def progress(self) -> tuple[int, int]:
        """(tokens generated, prompt tokens computed): grows with every step the request takes part in."""
        return sum(len(s.token_ids) for s in self.samples), self.num_computed

    def fail(self, reason: str) -> None:
        self.error = reason
        for s in self.samples:
            if s.finish_reason is None:
                s.finish_reason = "abort"


@dataclass(eq=False)
class ScoreJob:
    """``/v1/score`` / ``LLM.score`` as a request: the prefix is produced once (into a checkpoint, so later
    waves and later calls read it), candidates run as its consumers in waves that fit the step's budget and
    free slots. ``results[i]`` fills in as candidate i's wave completes."""
    request_id: str
    prefix_ids: list[int]
    candidates: list[list[int]]
    label_token_ids: list[int] | None
    todo: list[int]                               # candidate indices not yet scored
    results: list[CandidateScore | None]
    num_computed: int = 0                         # prefix tokens computed (chunks of a long prefix)
    entry: Checkpoint | None = None               # the prefix checkpoint while the job holds a reference
    prod: SeqState | None = None                  # the PENDING prefix's sequence while it is being produced
    error: str | None = None
    checkpoint: CheckpointInfo | None = None      # where its prefix state came from (set when first known)
    publisher: int | None = None                  # the candidate that reports the prefix's publication

    @property
    def finished(self) -> bool:
        return self.error is not None or not self.todo

    def provenance(self, i: int) -> CheckpointInfo:
        """Candidate i's record, as a completion request's: when the job published its prefix checkpoint, the
        first candidate scored from it says so (hit_length 0, why the lookup missed, published) as a producer
        does, and the others started from it (hit_length = the prefix, as same-step consumers); when the prefix
        was READY (or another job's producer in the same step), every candidate hit it; a one-token prefix has
        no checkpoint."""
        ck = self.checkpoint or CheckpointInfo()
        if ck.published and self.publisher in (None, i):
            self.publisher = i
            return ck
        return CheckpointInfo(hit_length=len(self.prefix_ids)) if ck.published or ck.hit_length else ck

    def progress(self) -> tuple[int, int]:
        return len(self.candidates) - len(self.todo), self.num_computed

    def fail(self, reason: str) -> None:
        self.error = reason


Job = Request | ScoreJob
