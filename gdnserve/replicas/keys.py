"""The checkpoint a request needs, as the replica router sees it. Computed from the token ids the ingress
sends (the server tokenized the prompt and stripped its marker, exactly as for one engine) with the engine's
own functions (``checkpoint_index``: ``checkpoint_key``, ``boundary_prefix``, ``score_prefix``,
``conversation_prefix``), so a key here is the key of the engine's ``CheckpointIndex``. No Ray import."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from gdnserve.engine.cache.checkpoint_index import boundary_prefix, checkpoint_key, conversation_prefix, score_prefix


@dataclass(frozen=True, slots=True)
class Route:
    """``exact``: the key of the checkpoint the request names (its marker / ``checkpoint_at``, or a score
    prefix): the replica holding or producing it gets the request, else it becomes the producer there.
    ``prompt``: a request without a boundary, which starts from the READY checkpoint of its longest proper
    prefix (the automatic checkpoint of the conversation it continues): the router looks its prefixes up
    at the lengths the replicas hold."""
    exact: bytes | None = None
    prompt: tuple[int, ...] | None = None


def generate_route(prompt_ids: Sequence[int], checkpoint_at: int | None) -> Route:
    prefix = boundary_prefix(prompt_ids, checkpoint_at)
    if prefix:
        return Route(exact=checkpoint_key(prefix))
    return Route(prompt=tuple(prompt_ids))


def score_route(prefix_ids: Sequence[int]) -> Route:
    prefix = score_prefix(prefix_ids)
    return Route(exact=checkpoint_key(prefix)) if prefix else Route()


def prefix_key(prompt: Sequence[int], length: int) -> bytes:
    """The key of the first ``length`` tokens of ``prompt`` (an automatic-checkpoint lookup)."""
    return checkpoint_key(prompt[:length])


def published_key(prompt_ids: Sequence[int], output_ids: Sequence[int]) -> tuple[bytes, int]:
    """The key and length of the automatic checkpoint a finished single-sample request published."""
    tokens = conversation_prefix(prompt_ids, output_ids)
    return checkpoint_key(tokens), len(tokens)
