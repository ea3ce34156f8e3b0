"""EngineStats: the engine's monotonic counters, typed, with one writer: the scheduler (its admission object, its
``update_from_output``, its queues). Everything else reads them (``LLMEngine.stats()`` flattens them into the
keys /metrics knows). StepReport: what one ``LLMEngine.step()`` did, for an observer (the server's step-time
and queue-time histograms) registered through ``LLMEngine.set_step_observer``."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class EngineStats:
    prompt_tokens: int = 0
    tokens_generated: int = 0
    requests_finished: int = 0
    checkpoint_hits: int = 0
    checkpoints_published: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0
    preemptions: int = 0
    requests_failed: int = 0
    idle_steps: int = 0         # steps that scheduled nothing (waiting on room): the engine thread backs off
    checkpoint_misses: dict[str, int] = field(default_factory=dict)    # lookup miss reason -> count

    def published(self, miss: str | None) -> None:
        """A checkpoint reserved for publication, after a lookup that missed for ``miss``."""
        self.checkpoints_published += 1
        self.checkpoint_misses[miss] = self.checkpoint_misses.get(miss, 0) + 1

    def unpublished(self, miss: str | None) -> None:
        """A PENDING checkpoint dropped before it was READY: its publication's counts taken back (its next
        producer counts them)."""
        self.checkpoints_published -= 1
        if self.checkpoint_misses.get(miss):
            self.checkpoint_misses[miss] -= 1

    def as_dict(self) -> dict:
        """The counters under their ``stats()`` keys (a copy: the misses dict too)."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class StepReport:
    """One ``LLMEngine.step()``: when it started (``time.monotonic()``), how long it took, and the jobs it
    admitted (request ids that left the waiting queue during the step)."""
    start: float
    seconds: float
    admitted: tuple[str, ...]
