"""Tokenizers: an HF ``tokenizer.json`` through the ``tokenizers`` library, or the built-in byte-level
tokenizer of the embedded model; chat templates rendered with jinja2 the way HF renders them; and the
checkpoint marker.

The marker (default ``<|state_checkpoint|>``) is found in the prompt TEXT and never reaches the model:
``encode_with_marker`` splits the text at it and returns ``encode(prefix) + encode(suffix)`` with the
offset ``len(encode(prefix))``. By construction the tokens of the prefix are exactly the first ``offset``
tokens, so the checkpoint state is the state after the producer's prefix and nothing else. (Those ids may
differ from ``encode(prefix + suffix)`` where a BPE merge would have spanned the boundary; the marker
is what defines the boundary, so that merge is deliberately not made.)

Special tokens in user text: ``encode(text, special=False)`` encodes special-token strings (``<|im_end|>``)
as the plain text they spell, never as the control token. ``encode_chat`` renders a chat template so that
only the template's own special tokens are special: special-token strings inside message contents are
swapped for unique placeholders before rendering and encoded as plain text where the placeholders land
(the template still sees, trims or splits the rest of each content as usual). The server uses both by
default; the engine's own ``encode`` / ``encode_with_marker`` keep ``special=True``.
"""
from __future__ import annotations

import json
import os
import re
import secrets
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

DEFAULT_MARKER = "<|state_checkpoint|>"


class MarkerError(ValueError):
    """A checkpoint marker in a place where it cannot define a checkpoint."""


class _GenerationTag(jinja2.ext.Extension):
    """HF templates may wrap assistant turns in ``{% generation %}…{% endgeneration %}`` (used by HF to
    build assistant masks); rendering-wise it is a no-op."""
    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # HF's override: jinja's own tojson HTML-escapes, which would change the prompt
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_chat_template(source: str) -> jinja2.Template:
    """The environment HF's apply_chat_template uses (sandboxed, trim/lstrip blocks, loop controls,
    ``raise_exception``, ``strftime_now``, a non-escaping ``tojson``)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class BaseTokenizer(ABC):
    """What the engine needs from a tokenizer. Subclasses set ``eos_token_ids``, ``chat_template`` and
    ``special_tokens`` (bos_token / eos_token / … strings, passed to the template as HF does)."""
    eos_token_ids: tuple[int, ...]
    chat_template: str | None
    special_tokens: dict[str, str]
    _compiled: jinja2.Template | None = None

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @abstractmethod
    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids of ``text``. With ``special`` (the default), special-token strings in the text map to
        their ids; with ``special=False`` they are encoded as the plain text they spell. No BOS/EOS is
        added (chat templates write those themselves, as HF's tokenize=True path assumes)."""

    @property
    @abstractmethod
    def special_strings(self) -> tuple[str, ...]:
        """The strings ``encode`` turns into special tokens (the checkpoint marker excluded: it is found
        in the text and stripped before encoding)."""

    @abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """The prompt text for ``messages`` (a marker inside a message survives rendering; pass the text to
        :meth:`encode_with_marker`)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat_template (tokenizer_config.json / chat_template.jinja)")
        if self._compiled is None:
            self._compiled = compile_chat_template(self.chat_template)
        # as HF: tools / documents default to None, special-token strings are template variables
        return self._compiled.render(messages=[dict(m) for m in messages],
                                     add_generation_prompt=add_generation_prompt,
                                     **{"tools": None, "documents": None, **self.special_tokens, **kwargs})

    def encode_with_marker(self, text: str, marker: str = DEFAULT_MARKER,
                           special: bool = True) -> tuple[list[int], int | None]:
        """``(ids, checkpoint_offset)``: the marker is stripped; the offset is the number of tokens before it
        (None without a marker). Raises :class:`MarkerError` for more than one marker, a marker with no
        tokens before it (offset 0) or with no tokens after it (at the very end). ``special``: as in
        :meth:`encode`."""
        return self._encode_segments([(text, special)], marker)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], special: bool = False,
                    marker: str = DEFAULT_MARKER, add_generation_prompt: bool = True,
                    **kwargs: Any) -> tuple[list[int], int | None, str]:
        """``(ids, checkpoint_offset, text)`` of the chat prompt for ``messages``. The template's own special
        tokens are special; special-token strings inside message contents are plain text unless
        ``special`` (then the rendered text is encoded as a whole, as HF's ``apply_chat_template`` does).
        A marker in a content defines the checkpoint as in :meth:`encode_with_marker`. ``text`` is the
        rendered prompt as HF would render it."""
        specials = [t for t in self.special_strings if t and t != marker]
        pattern = re.compile("|".join(map(re.escape, sorted(specials, key=len, reverse=True)))) if specials else None
        found = pattern is not None and not special and any(
            isinstance(m.get("content"), str) and pattern.search(m["content"]) for m in messages)
        if not found:
            text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
            return (*self._encode_segments([(text, True)], marker), text)
        nonce, originals = secrets.token_hex(8), []

        def hide(m: re.Match) -> str:
            originals.append(m.group(0))
            return f"\ue000{nonce}:{len(originals) - 1}\ue001"

        hidden = [{**m, "content": pattern.sub(hide, m["content"])} if isinstance(m.get("content"), str) else m
                  for m in messages]
        rendered = self.apply_chat_template(hidden, add_generation_prompt, **kwargs)
        parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", rendered)
        segments = [(piece, True) if j % 2 == 0 else (originals[int(piece)], False) for j, piece in enumerate(parts)]
        segments = [seg for seg in segments if seg[0]]
        ids, offset = self._encode_segments(segments, marker)
        return ids, offset, "".join(t for t, _ in segments)

    def _encode_segments(self, segments: Sequence[tuple[str, bool]], marker: str) -> tuple[list[int], int | None]:
        """``encode_with_marker`` over ``(text, special)`` pieces: each piece encoded on its own; the marker
        (in special pieces; a plain piece is a special-token string, never the marker) split out."""
        if not marker:
            raise ValueError("marker must be a non-empty string")
        count = sum(t.count(marker) for t, _ in segments)
        if count == 0:
            return [i for t, sp in segments for i in self.encode(t, special=sp)], None
        if count > 1:
            raise MarkerError(f"the prompt contains the checkpoint marker {marker!r} {count} times; "
                              "at most one is allowed")
        head: list[int] = []
        tail: list[int] = []
        seen = False
        for t, sp in segments:
            if not seen and marker in t:
                before, after = t.split(marker)
                head += self.encode(before, special=sp)
                tail += self.encode(after, special=sp)
                seen = True
            else:
                (tail if seen else head).extend(self.encode(t, special=sp))
        if not head:
            raise MarkerError(f"the checkpoint marker {marker!r} is at offset 0: there are no tokens before it, "
                              "so there is no prefix to checkpoint")
        if not tail:
            raise MarkerError(f"the checkpoint marker {marker!r} is at the end of the prompt "
                              f"(offset {len(head)} of {len(head)} tokens): there are no tokens after it")
        return head + tail, len(head)


class Tokenizer(BaseTokenizer):
    """An HF tokenizer folder: ``tokenizer.json`` (+ ``tokenizer_config.json`` for bos/eos/pad and the chat
    template, ``chat_template.jinja`` if the template lives there, ``generation_config.json`` for extra
    EOS ids)."""

    def __init__(self, tok: Any, *, special_tokens: Mapping[str, str] | None = None,
                 chat_template: str | None = None, extra_eos_ids: Sequence[int] = ()) -> None:
        self._tok = tok
        self._plain_tok: Any = None  # a copy with encode_special_tokens=True, made on first use
        self.special_tokens = dict(special_tokens or {})
        self.chat_template = chat_template
        eos: list[int] = []
        if "eos_token" in self.special_tokens:
            i = tok.token_to_id(self.special_tokens["eos_token"])
            if i is None:
                raise ValueError(f"eos_token {self.special_tokens['eos_token']!r} is not in the vocabulary")
            eos.append(i)
        eos += [int(i) for i in extra_eos_ids if int(i) not in eos]
        self.eos_token_ids = tuple(eos)

    @classmethod
    def from_folder(cls, path: str | os.PathLike[str]) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer
        path = Path(path)
        folder = path if path.is_dir() else path.parent
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"{file}: no such file (a model folder needs the HF tokenizer.json beside "
                                    "config.json)")
        tok = HFTokenizer.from_file(str(file))
        cfg = _read_json(folder / "tokenizer_config.json")
        special = {k: _token_str(cfg[k]) for k in ("bos_token", "eos_token", "pad_token", "unk_token")
                   if cfg.get(k) is not None}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        if template is None and (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        gen_eos = _read_json(folder / "generation_config.json").get("eos_token_id")
        extra = [] if gen_eos is None else [gen_eos] if isinstance(gen_eos, int) else list(gen_eos)
        return cls(tok, special_tokens=special, chat_template=template, extra_eos_ids=extra)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def special_strings(self) -> tuple[str, ...]:
        return tuple(t.content for t in self._tok.get_added_tokens_decoder().values()
                     if t.special and t.content != DEFAULT_MARKER)

    def encode(self, text: str, special: bool = True) -> list[int]:
        if special:
            return _hf_encode(self._tok, text)
        if self._plain_tok is None:  # a second object: the flag is per tokenizer, and encode may run on two threads
            from tokenizers import Tokenizer as HFTokenizer
            plain = HFTokenizer.from_str(self._tok.to_str())
            plain.encode_special_tokens = True
            self._plain_tok = plain
        return _hf_encode(self._plain_tok, text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _hf_encode(tok: Any, text: str) -> list[int]:
    """``tok.encode(text).ids``. A long text goes through ``encode_batch``, which releases the GIL: ``encode``
    holds it throughout (seconds for megabytes), so the server's worker thread would hold its event loop."""
    if len(text) > 8192:
        return tok.encode_batch([text], add_special_tokens=False)[0].ids
    return tok.encode(text, add_special_tokens=False).ids


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_str(value: str | Mapping[str, Any]) -> str:
    return value if isinstance(value, str) else str(value["content"])  # AddedToken dicts carry "content"


SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", DEFAULT_MARKER)
BYTE_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
CHATML_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                   "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class ByteTokenizer(BaseTokenizer):
    """The embedded model's tokenizer: ids 0–255 are the UTF-8 bytes, then the special tokens in the order
    of ``SPECIAL_TOKENS`` (256 = ``<|endoftext|>``, 257 = ``<|im_start|>``, 258 = ``<|im_end|>``,
    259 = ``<|state_checkpoint|>``). Needs nothing on disk."""

    def __init__(self) -> None:
        self._special_ids = {s: 256 + i for i, s in enumerate(SPECIAL_TOKENS)}
        self._split = re.compile("(" + "|".join(map(re.escape, SPECIAL_TOKENS)) + ")")
        self.special_tokens = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
        self.chat_template = CHATML_TEMPLATE
        self.eos_token_ids = (self._special_ids["<|im_end|>"], self._special_ids["<|endoftext|>"])

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB_SIZE

    @property
    def special_strings(self) -> tuple[str, ...]:
        return tuple(t for t in SPECIAL_TOKENS if t != DEFAULT_MARKER)

    def encode(self, text: str, special: bool = True) -> list[int]:
        if not special:
            return list(text.encode("utf-8"))
        ids: list[int] = []
        for piece in self._split.split(text):
            special = self._special_ids.get(piece)
            ids.extend([special] if special is not None else piece.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out: list[str] = []
        buf = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                buf.append(i)
                continue
            if not 256 <= i < BYTE_VOCAB_SIZE:
                raise ValueError(f"token id {i} is outside the byte tokenizer's vocabulary [0, {BYTE_VOCAB_SIZE})")
            out.append(buf.decode("utf-8", errors="replace"))  # a special token ends any partial character
            buf.clear()
            if not skip_special_tokens:
                out.append(SPECIAL_TOKENS[i - 256])
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)


def load_tokenizer(path: str | os.PathLike[str] | None = None) -> BaseTokenizer:
    """The tokenizer of a model folder (or a tokenizer.json path); the byte tokenizer for None."""
    return ByteTokenizer() if path is None else Tokenizer.from_folder(path)
