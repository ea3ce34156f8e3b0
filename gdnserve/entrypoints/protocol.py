"""The server's wire format: request models for /v1/completions, /v1/chat/completions and /v1/score,
their validation, OpenAI-style errors, and the response pieces (logprobs, usage, provenance) in OpenAI's
shapes. Requests are parsed strictly (no "5" for 5) and checked here once; checks that need the engine
(model name, vocabulary, context length) are in ``server.py``.

Every error is ``{"error": {"message", "type", "param", "code"}}`` with ``param`` naming the field. The
limits (``limits.Limits``) are passed to ``parse_request`` and each ``check``.
"""
from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gdnserve.engine.engine_api import CheckpointInfo, TokenizerLike
from gdnserve.entrypoints.limits import Limits, invalid_unicode, json_shape, may_hold_surrogates

DEFAULT_LIMITS = Limits()


class APIError(Exception):
    """An error answered to the client as OpenAI answers it."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _loc_to_param(loc: Sequence[int | str]) -> str:
    """pydantic's ``("messages", 0, "role")`` as ``messages[0].role``; union branch names dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in ("str", "int", "float", "bool"):
            continue  # the name of a union member (``list[int]``), not a field
        else:
            out += f".{part}" if out else part
    return out


def _long_number_field(body: bytes) -> str | None:
    """The key whose value is an integer literal too long for ``int`` (the first such), None if it is not one
    ``"key": digits`` (e.g. inside an array)."""
    limit = sys.get_int_max_str_digits()
    m = re.search(rb'"([^"\\]{1,64})"\s*:\s*-?\d{%d}' % (limit + 1), body) if limit else None
    return m.group(1).decode("utf-8", "replace") if m else None


def parse_request(body: bytes, model: type[BaseModel], limits: Limits = DEFAULT_LIMITS) -> Any:
    """``model`` from a JSON body; malformed JSON, nesting deeper than ``limits.max_json_depth``, more arrays
    and objects than ``limits.max_json_containers``, a string that is not valid Unicode (a lone surrogate), a
    non-object and every pydantic error become a 400 that names the (first) offending field."""
    # UTF-8 only (RFC 8259 §8.1): json.loads would decode UTF-16 / 32 itself, and the byte scans below (depth,
    # containers, the surrogate pre-check) read UTF-8; a UTF-16 body slipped a lone surrogate past them (a 500)
    if json.detect_encoding(body[:4]) not in ("utf-8", "utf-8-sig"):
        raise APIError("the request body must be UTF-8 encoded JSON (it looks like UTF-16 or UTF-32)",
                       code="invalid_encoding")
    depth, containers = json_shape(body)
    if depth > limits.max_json_depth:
        raise APIError(f"the request body nests arrays/objects {depth} deep; at most {limits.max_json_depth} "
                       "(--max-json-depth)", code="json_too_deep")
    if containers > limits.max_json_containers:  # before pydantic builds (and holds the GIL for) each of them
        raise APIError(f"the request body holds {containers} arrays/objects; at most {limits.max_json_containers} "
                       "(--max-json-containers)", code="json_too_many_containers")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}") from None
    except ValueError:      # an integer literal past Python's int conversion limit (a 500 before)
        field = _long_number_field(body)
        raise APIError(f"{field or 'the request body'} holds a number of more than {sys.get_int_max_str_digits()} "
                       "digits", field, code="number_too_long") from None
    except RecursionError:  # nesting the bracket count did not see (inside a malformed string): still the client's
        raise APIError("the request body is not valid JSON: nested too deep", code="json_too_deep") from None
    if not isinstance(data, dict):
        raise APIError(f"the request body must be a JSON object, got {type(data).__name__}")
    bad = invalid_unicode(data) if may_hold_surrogates(body) else None
    if bad is not None:
        raise APIError(f"{bad} is not valid Unicode (it holds a lone surrogate escape such as \\ud800)", bad,
                       code="invalid_unicode")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = _loc_to_param(err["loc"]) or None
        if err["type"] == "missing":
            raise APIError(f"{param} is required", param=param) from None
        got = repr(err.get("input"))
        got = got if len(got) <= 80 else got[:77] + "..."
        raise APIError(f"invalid {param}: {err['msg']} (got {got})", param=param) from None


class _Strict(BaseModel):
    # strict: "5" is not 5 and true is not 1; unknown fields are ignored, as OpenAI-compatible servers do
    model_config = ConfigDict(strict=True, extra="ignore")


# Lists stop at their first invalid item (only the first error is reported): a body of a million bad items
# would build a million errors, for every member of a union, in seconds that hold the GIL.
_Texts = Annotated[list[str], Field(fail_fast=True)]
_Ids = Annotated[list[int], Field(fail_fast=True)]


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    """The fields /v1/completions and /v1/chat/completions share."""
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stop: str | _Texts | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    checkpoint_at: int | None = None  # gdnserve: publish the state after this many prompt tokens
    parse_special_tokens: bool | None = None  # gdnserve: special-token strings in the text are control tokens
    ignore_eos: bool = False  # vLLM's extension: generate past the model's EOS tokens (stop strings still apply)
    # OpenAI fields gdnserve does not implement: refused unless neutral, never silently ignored
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def check(self, limits: Limits = DEFAULT_LIMITS) -> None:
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise APIError(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if self.temperature is not None and not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise APIError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise APIError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k is not None and self.top_k < -1:
            raise APIError(f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}", "top_k")
        if not 1 <= self.n <= limits.max_n:
            raise APIError(f"n must be between 1 and {limits.max_n}, got {self.n}", "n")
        stops = self.stop_list()
        if len(stops) > limits.max_stop:
            raise APIError(f"stop holds {len(stops)} strings; at most {limits.max_stop} (--max-stop)", "stop")
        for i, s in enumerate(stops):
            if not s:
                raise APIError("stop strings must not be empty", "stop")
            if len(s) > limits.max_stop_chars:
                raise APIError(f"stop string {i} is {len(s)} characters; at most {limits.max_stop_chars} "
                               "(--max-stop-chars)", "stop")
        if self.checkpoint_at is not None and self.checkpoint_at <= 0:
            raise APIError(f"checkpoint_at must be >= 1 (a token offset inside the prompt), got "
                           f"{self.checkpoint_at}", "checkpoint_at")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                raise APIError(f"{name} is not supported by gdnserve (only 0)", name)
        if self.logit_bias:
            raise APIError("logit_bias is not supported by gdnserve", "logit_bias")

    def stop_list(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_fields(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None) -> dict[str, Any]:
        """Keyword arguments of the engine's SamplingParams: only what the client set, so the engine's
        defaults (the model's generation config) apply to the rest."""
        f: dict[str, Any] = {"n": self.n, "max_tokens": max_tokens}
        if self.temperature is not None:
            f["temperature"] = self.temperature
        if self.top_p is not None:
            f["top_p"] = self.top_p
        if self.top_k is not None and self.top_k >= 1:
            f["top_k"] = self.top_k
        if self.seed is not None:
            f["seed"] = self.seed
        if self.stop is not None:
            f["stop"] = self.stop_list()
        if self.ignore_eos:
            f["ignore_eos"] = True
        if logprobs is not None:
            f["logprobs"] = logprobs
        if prompt_logprobs is not None:
            f["prompt_logprobs"] = prompt_logprobs
        return f


class CompletionRequest(_SamplingRequest):
    prompt: str | _Texts | _Ids | Annotated[list[_Ids], Field(fail_fast=True)]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check(self, limits: Limits = DEFAULT_LIMITS) -> None:
        super().check(limits)
        if self.logprobs is not None and not 0 <= self.logprobs <= limits.max_logprobs:
            raise APIError(f"logprobs must be between 0 and {limits.max_logprobs}, got {self.logprobs}", "logprobs")
        if self.best_of not in (None, self.n):
            raise APIError("best_of is not supported by gdnserve (only best_of = n)", "best_of")
        if self.suffix:
            raise APIError("suffix is not supported by gdnserve", "suffix")
        prompts = self.prompts()
        if not prompts:
            raise APIError("prompt must not be empty", "prompt")
        if len(prompts) > limits.max_prompts:
            raise APIError(f"prompt holds {len(prompts)} prompts; at most {limits.max_prompts} per request "
                           "(--max-prompts)", "prompt")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise APIError("prompt must not be empty" + (f" (prompt {i})" if len(prompts) > 1 else ""), "prompt")

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a text or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[ContentPart], Field(fail_fast=True)] | None = None
    name: str | None = None

    def text(self, i: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        for j, part in enumerate(self.content):
            where = f"messages[{i}].content[{j}]"
            if part.type != "text":
                raise APIError(f"{where} is a part of type {part.type!r}: only text parts ({{\"type\": \"text\", \"text\": "
                               f"...}}) are supported", f"{where}.type")
            if part.text is None:
                raise APIError(f"{where} is a text part without its text", f"{where}.text")
        return "".join(part.text for part in self.content)  # type: ignore[misc]


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(fail_fast=True)]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None

    def check(self, limits: Limits = DEFAULT_LIMITS) -> None:
        # both fields are checked whatever the other says; given both, max_completion_tokens (OpenAI's
        # current name, max_tokens being deprecated for chat) is the one used
        if self.max_completion_tokens is not None and self.max_completion_tokens <= 0:
            raise APIError(f"max_completion_tokens must be at least 1, got {self.max_completion_tokens}",
                           "max_completion_tokens")
        super().check(limits)
        if not self.messages:
            raise APIError("messages must not be empty", "messages")
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= limits.max_logprobs:
                raise APIError(f"top_logprobs must be between 0 and {limits.max_logprobs}, got {self.top_logprobs}",
                               "top_logprobs")
            if not self.logprobs:
                raise APIError("top_logprobs needs logprobs = true", "top_logprobs")
        if self.tools:
            raise APIError("tools are not supported by gdnserve", "tools")

    def token_limit(self) -> tuple[int | None, str]:
        """The requested completion length and the field it came from."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def plain_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]


class ScoreRequest(_Strict):
    """``{prefix | query, candidates | items, label_token_ids?, apply_softmax?}`` (SGLang's names or ours)."""
    model: str | None = None
    prefix: str | _Ids | None = None
    query: str | _Ids | None = None
    candidates: Annotated[list[str | _Ids], Field(fail_fast=True)] | None = None
    items: Annotated[list[str | _Ids], Field(fail_fast=True)] | None = None
    label_token_ids: _Ids | None = None
    apply_softmax: bool = False
    parse_special_tokens: bool | None = None

    def check(self, limits: Limits = DEFAULT_LIMITS) -> tuple[str | list[int], list[str | list[int]]]:
        """``(prefix, candidates)`` whichever names the client used."""
        if self.prefix is not None and self.query is not None:
            raise APIError("give one of prefix and query, not both", "prefix")
        if self.candidates is not None and self.items is not None:
            raise APIError("give one of candidates and items, not both", "candidates")
        prefix = self.prefix if self.prefix is not None else self.query
        cands_name = "candidates" if self.items is None else "items"
        cands = self.candidates if self.candidates is not None else self.items
        if not prefix:
            raise APIError("prefix (or query) must be a non-empty string or token id list",
                           "prefix" if self.query is None else "query")
        if not cands:
            raise APIError(f"{cands_name} must be a non-empty list", cands_name)
        if len(cands) > limits.max_candidates:
            raise APIError(f"{cands_name} holds {len(cands)} entries; at most {limits.max_candidates} "
                           "(--max-candidates)", cands_name)
        for i, c in enumerate(cands):
            if len(c) == 0:
                raise APIError(f"{cands_name}[{i}] is empty", f"{cands_name}[{i}]")
        if self.label_token_ids is not None and not self.label_token_ids:
            raise APIError("label_token_ids must be a non-empty list or absent", "label_token_ids")
        seen: set[int] = set()
        for j, t in enumerate(self.label_token_ids or ()):   # one probability per label: a repeat is a mistake
            if t in seen:
                raise APIError(f"label_token_ids holds token id {t} twice (again at label_token_ids[{j}]); give "
                               "each label once", "label_token_ids")
            seen.add(t)
        if self.apply_softmax and self.label_token_ids is None:
            raise APIError("apply_softmax needs label_token_ids", "apply_softmax")
        return prefix, cands


# ---- response pieces ----------------------------------------------------------------------------------

def provenance(ckpt: CheckpointInfo, prompt_tokens: int, checkpoint_at: int | None) -> dict[str, Any]:
    """The ``gdnserve`` record of one prompt: where its state came from and what it published."""
    return {"prompt_tokens": prompt_tokens, "checkpoint_at": checkpoint_at, "hit_length": ckpt.hit_length,
            "miss_reason": ckpt.miss_reason, "published": ckpt.published,
            "tier": ckpt.tier}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _token_str(tok: TokenizerLike, tid: int) -> str:
    return tok.decode([tid], skip_special_tokens=False)


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def _sampled_logprob(entry: dict[int, float] | None, tid: int) -> float | None:
    if entry is None:
        return None
    return entry.get(tid, -9999.0)  # the engine includes the sampled token; -9999 marks one it dropped


def completion_logprobs(tok: TokenizerLike, token_ids: Sequence[int],
                        logprobs: Sequence[dict[int, float] | None], k: int, offset: int = 0) -> dict[str, Any]:
    """OpenAI's legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, logprobs):
        s = _token_str(tok, tid)
        tokens.append(s)
        lps.append(_sampled_logprob(entry, tid))
        tops.append(None if entry is None else {_token_str(tok, t): lp for t, lp in _top(entry, k)})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tok: TokenizerLike, token_ids: Sequence[int],
                  logprobs: Sequence[dict[int, float] | None], k: int) -> dict[str, Any]:
    """OpenAI's chat shape: ``{"content": [{token, logprob, bytes, top_logprobs: [...]}]}``."""
    content = []
    for tid, entry in zip(token_ids, logprobs):
        s = _token_str(tok, tid)
        top = [] if entry is None else [{"token": (t := _token_str(tok, i)), "logprob": lp,
                                         "bytes": list(t.encode())} for i, lp in _top(entry, k)]
        content.append({"token": s, "logprob": _sampled_logprob(entry, tid), "bytes": list(s.encode()),
                        "top_logprobs": top})
    return {"content": content}
