"""What the HTTP server is told at start: access (API key, allowed hosts and origins), tokenization of
user text, defaults, and the request limits. ``gdnserve serve``'s flags fill one :class:`ServerConfig`;
``build_app(engine)`` without one gets the defaults below (the safe loopback ones)."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from gdnserve.entrypoints.limits import Limits


@dataclass(frozen=True, slots=True)
class ServerConfig:
    api_key: str | None = None              # Authorization: Bearer KEY on /v1/* (and /metrics)
    host: str = "127.0.0.1"                  # the bind address: loopback turns the Host check on
    allowed_hosts: tuple[str, ...] = ()      # Host names accepted besides the loopback ones ("*": any)
    allowed_origins: tuple[str, ...] = ()    # CORS: origins that may call from a browser ("*": any)
    public_metrics: bool = False             # /metrics without the API key
    parse_special_tokens: bool = False       # special-token strings in user text become control tokens
    default_max_tokens: int = 16             # /v1/completions without max_tokens (OpenAI's default)
    chat_default_max_tokens: int = 1024      # /v1/chat/completions without max_tokens / max_completion_tokens
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        for name in ("default_max_tokens", "chat_default_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} (--{name.replace('_', '-')}) must be >= 1, got {getattr(self, name)}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be a non-empty string or None")

    @property
    def loopback(self) -> bool:
        return is_loopback_name(self.host)


def split_host(host: str) -> str:
    """The name of a ``Host`` header value, port and IPv6 brackets removed, lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host[1:]
    name, sep, port = host.rpartition(":")
    return name if sep and port.isdigit() and ":" not in name else host


def is_loopback_name(name: str) -> bool:
    """``localhost``, ``*.localhost`` (RFC 6761) or a loopback address (127.0.0.0/8, ::1)."""
    name = split_host(name) if name.startswith("[") else name.strip().lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
