"""Checks the commands run before loading a model, so that a mistyped flag ends in one line that names it,
not a traceback after a long load: the model folder, the device, the listening port."""
from __future__ import annotations

import errno
import socket
from pathlib import Path


class PreflightError(Exception):
    """A problem with the command line; the message names the flag."""


def check_model_folder(model: str | None) -> None:
    """An HF checkpoint folder: config.json, safetensors weights, tokenizer.json (None: the embedded model)."""
    if model is None:
        return
    path = Path(model)
    if not path.exists():
        raise PreflightError(f"--model {model}: no such folder")
    if not path.is_dir():
        raise PreflightError(f"--model {model}: not a folder (give the HF checkpoint folder that holds "
                             "config.json, the *.safetensors weights and tokenizer.json)")
    for name in ("config.json", "tokenizer.json"):
        if not (path / name).is_file():
            raise PreflightError(f"--model {model}: {path / name} is missing (an HF checkpoint folder holds "
                                 "config.json, the *.safetensors weights and tokenizer.json)")
    if not any(path.glob("*.safetensors")):
        raise PreflightError(f"--model {model}: no *.safetensors weights in the folder")


def check_device(device: str) -> None:
    """auto, cpu, cuda or cuda:N, and a CUDA one must exist."""
    import torch
    if device == "auto":
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise PreflightError(f"--device {device}: not a device (auto, cpu, cuda or cuda:N)") from None
    if dev.type not in ("cpu", "cuda"):
        raise PreflightError(f"--device {device}: gdnserve runs on cpu or cuda")
    if dev.type == "cuda":
        if torch.version.cuda is None or not torch.cuda.is_available():
            why = ("this PyTorch build has no CUDA support" if torch.version.cuda is None
                   else "no CUDA device is visible")
            raise PreflightError(f"--device {device}: {why} (torch {torch.__version__}); use --device cpu")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise PreflightError(f"--device {device}: there are {count} CUDA devices (cuda:0 .. cuda:{count - 1})")


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (not yet listening: connections are refused until the server starts).
    Raises PreflightError when the address is in use or cannot be had."""
    if not 0 <= port <= 65535:
        raise PreflightError(f"--port {port}: not a port number (0 to 65535)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise PreflightError(f"--host {host}: {e.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        hint = " (another server is listening there: stop it or pick another --port)" if e.errno == errno.EADDRINUSE else ""
        raise PreflightError(f"cannot listen on {host}:{port}: {e.strerror}{hint}") from None
    sock.set_inheritable(True)
    return sock
