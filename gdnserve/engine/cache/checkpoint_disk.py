"""The disk tier of checkpoints: one file per checkpoint under ``<checkpoint_dir>/<fingerprint>/``, an index loaded
at start-up (checkpoints survive a restart), a size bound with LRU eviction, and all file I/O on one worker thread.

File format (version ``VERSION``), little-endian::

    magic b"GDNCKPT\\0" | u32 version | u32 header bytes | header (UTF-8 JSON) | payload | 32-byte blake2b

The header holds the model fingerprint, the key (hex), the token ids and, per tensor, its name, dtype, shape,
offset in the payload and byte count; the checksum covers everything before it. The tensors are the host
checkpoint's (checkpoint_copy.py: conv, ssm, the state pool's registered rows such as ``mtp_hidden``, k, v); a file
must hold exactly the names the tier was built with (``names``, the copier's). Version 2 added the registered rows
(version 1 files, which had none, are ignored: an MTP checkpoint without its hidden would draft from a stale one).
A host checkpoint held in several arena extents (host_arena.py ``alloc_extents``) is written in the same format
(its tensors put together from the extents): the file never depended on how the host memory was cut.
A file is only ever seen whole: it is written to ``*.tmp`` and renamed. At start-up each file's header is read and its size checked against the
header (a truncated file is ignored, with one log line); the checksum is checked when a checkpoint is loaded (a
corrupt file is ignored with one log line and removed, and the lookup misses). A file whose fingerprint or
version differs is never loaded (another model's files live under another fingerprint directory anyway).

LRU: a file's modification time is its last use (touched on every load), so the order survives a restart.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from gdnserve.engine.cache.checkpoint_copy import TENSORS, HostCheckpoint

logger = logging.getLogger(__name__)

MAGIC = b"GDNCKPT\0"
VERSION = 2
_PRE = struct.Struct("<8sII")
_SUM = 32
MAX_QUEUED = 64         # writes waiting for the I/O thread, at most (their host copies are held meanwhile)


class CheckpointFileError(ValueError):
    """A checkpoint file that cannot be used: truncated, corrupt, another version or another model's."""


@dataclass(slots=True)
class DiskEntry:
    path: Path
    token_ids: tuple[int, ...]
    nbytes: int


def _checksum(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=_SUM).digest()


def encode(hc: HostCheckpoint, fingerprint: str) -> bytes:
    """The file's bytes for ``hc`` (its device -> host copy must be complete)."""
    tensors, payload, off = [], [], 0
    for name, t in hc.host_tensors().items():       # (put together from its arena extents where it has several)
        t = t.contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        tensors.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                        "offset": off, "nbytes": len(raw)})
        pad = -len(raw) % 64          # every tensor 64-byte aligned: a typed view of the buffer needs its alignment
        payload.append(raw + bytes(pad))
        off += len(raw) + pad
    header = json.dumps({"fingerprint": fingerprint, "key": hc.key.hex(), "token_ids": list(hc.token_ids),
                         "tensors": tensors, "payload_bytes": off}).encode()
    body = b"".join([_PRE.pack(MAGIC, VERSION, len(header)), header, *payload])
    return body + _checksum(body)


def read_header(f, size: int, fingerprint: str, names: tuple[str, ...] = TENSORS) -> dict:
    """The header of an open file of ``size`` bytes whose tensors are ``names``; CheckpointFileError naming what is
    wrong."""
    pre = f.read(_PRE.size)
    if len(pre) < _PRE.size:
        raise CheckpointFileError(f"truncated: {size} bytes, shorter than the {_PRE.size}-byte preamble")
    magic, version, hlen = _PRE.unpack(pre)
    if magic != MAGIC:
        raise CheckpointFileError(f"not a gdnserve checkpoint file (magic {magic!r})")
    if version != VERSION:
        raise CheckpointFileError(f"format version {version}, this build reads {VERSION}")
    raw = f.read(hlen)
    if len(raw) < hlen:
        raise CheckpointFileError(f"truncated inside its {hlen}-byte header")
    try:
        header = json.loads(raw)
        want = _PRE.size + hlen + int(header["payload_bytes"]) + _SUM
        held = [t["name"] for t in header["tensors"]]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointFileError(f"unreadable header ({e})") from None
    if header.get("fingerprint") != fingerprint:
        raise CheckpointFileError(f"written for another model (fingerprint {str(header.get('fingerprint'))[:16]}, "
                                  f"this model's {fingerprint[:16]})")
    if size != want:
        raise CheckpointFileError(f"truncated or extended: {size} bytes, its header says {want}")
    if sorted(held) != sorted(names):
        raise CheckpointFileError(f"tensors {held}, this layout is {list(names)}")
    return header


def decode(data: bytes, fingerprint: str, pin: bool, names: tuple[str, ...] = TENSORS) -> HostCheckpoint:
    """A HostCheckpoint from a whole file's bytes; CheckpointFileError if it is not intact, not this model's or does
    not hold exactly the tensors ``names``."""
    import io
    header = read_header(io.BytesIO(data), len(data), fingerprint, names)
    if _checksum(memoryview(data)[:-_SUM]) != data[-_SUM:]:
        raise CheckpointFileError("checksum mismatch (corrupt)")
    base = len(data) - _SUM - header["payload_bytes"]
    buf = bytearray(memoryview(data)[base:len(data) - _SUM])
    tensors = {}
    for t in header["tensors"]:
        dtype = getattr(torch, t["dtype"])
        flat = torch.frombuffer(buf, dtype=torch.uint8, offset=t["offset"], count=t["nbytes"]) if t["nbytes"] else \
            torch.empty(0, dtype=torch.uint8)
        x = flat.view(dtype).reshape(t["shape"])
        tensors[t["name"]] = x.pin_memory() if pin else x
    return HostCheckpoint(bytes.fromhex(header["key"]), tuple(header["token_ids"]), tensors)


class DiskTier:
    """Checkpoint files of one model under ``root / fingerprint[:32]``, at most ``max_bytes`` of them. ``names``: the
    tensors a checkpoint holds (the copier's ``names``; a file with others is corrupt)."""

    def __init__(self, root: str | os.PathLike, max_bytes: int, fingerprint: str, *, pin: bool = False,
                 on_bytes: Callable[[str, int], None] | None = None, names: tuple[str, ...] = TENSORS) -> None:
        self.dir = Path(root) / fingerprint[:32]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.fingerprint, self.pin, self.names = max_bytes, fingerprint, pin, tuple(names)
        self.on_bytes = on_bytes or (lambda what, n: None)
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, DiskEntry] = OrderedDict()     # least recently used first
        self._writing: set[bytes] = set()
        self._lengths: Counter[int] = Counter()
        self.used = 0
        self.ignored = 0        # files found unusable (logged)
        self.dropped = 0        # checkpoints not written: the write queue was full
        self._io = ThreadPoolExecutor(1, thread_name_prefix="gdnserve-ckpt-disk")
        self._scan()

    def _scan(self) -> None:
        found = []
        for path in self.dir.glob("*.tmp"):       # a write cut by a crash
            path.unlink(missing_ok=True)
        for path in self.dir.glob("*.gck"):
            try:
                size = path.stat().st_size
                with open(path, "rb") as f:
                    header = read_header(f, size, self.fingerprint, self.names)
                found.append((path.stat().st_mtime_ns, bytes.fromhex(header["key"]),
                              DiskEntry(path, tuple(header["token_ids"]), size)))
            except (OSError, CheckpointFileError, ValueError) as e:
                self.ignored += 1
                logger.warning("checkpoint file %s ignored: %s", path, e)
        for _, key, entry in sorted(found, key=lambda x: x[0]):
            self._add(key, entry)
        self._bound()
        logger.info("checkpoint dir %s: %d checkpoints, %.1f MiB", self.dir, len(self._entries), self.used / 2**20)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries or key in self._writing

    def token_ids(self, key: bytes) -> tuple[int, ...] | None:
        e = self._entries.get(key)
        return None if e is None else e.token_ids

    def lengths(self) -> set[int]:
        with self._lock:
            return set(self._lengths)

    def keys(self) -> tuple[list[bytes], set[int]]:
        """The keys of the files indexed (not those still being written: a lookup cannot find them yet) and their
        token lengths, in one pass under the lock (the I/O thread adds and removes files)."""
        with self._lock:
            return list(self._entries), set(self._lengths)

    def _add(self, key: bytes, entry: DiskEntry) -> None:
        self._entries[key] = entry
        self.used += entry.nbytes
        self._lengths[len(entry.token_ids)] += 1

    def _remove(self, key: bytes) -> DiskEntry | None:
        e = self._entries.pop(key, None)
        if e is not None:
            self.used -= e.nbytes
            n = len(e.token_ids)
            self._lengths[n] -= 1
            if not self._lengths[n]:
                del self._lengths[n]
        return e

    def put(self, hc: HostCheckpoint) -> None:
        """Write ``hc`` on the I/O thread (nothing if its key is on disk or being written). Beyond ``MAX_QUEUED``
        writes waiting (a disk slower than the evictions) it is dropped: each holds its host copy until written.
        Takes ``hc`` over: its arena block is released once the I/O thread has read it (at once when not written)."""
        if hc.key in self:
            hc.release()
            return
        if len(self._writing) >= MAX_QUEUED:
            self.dropped += 1
            hc.release()
            return
        self._writing.add(hc.key)
        self._io.submit(self._write, hc)

    def _write(self, hc: HostCheckpoint) -> None:
        try:
            try:
                hc.wait()
                data = encode(hc, self.fingerprint)
            finally:
                hc.release()        # read (or failed): the block may take the next checkpoint copied down
            path = self.dir / f"{hc.key.hex()}.gck"
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
            with self._lock:
                self._add(hc.key, DiskEntry(path, hc.token_ids, len(data)))
                self._bound()
            self.on_bytes("disk_write", len(data))
        except Exception as e:  # noqa: BLE001  a full disk loses a checkpoint, never a request
            logger.warning("checkpoint %s not written to %s: %s", hc.key.hex()[:12], self.dir, e)
        finally:
            self._writing.discard(hc.key)

    def _bound(self) -> None:
        while self.used > self.max_bytes and self._entries:
            self._remove(next(iter(self._entries))).path.unlink(missing_ok=True)

    def load(self, key: bytes) -> Future:
        """The checkpoint of ``key`` read on the I/O thread: a Future of a HostCheckpoint, or of None when the
        file is gone, corrupt or not this model's (logged once, removed from the index)."""
        return self._io.submit(self._read, key)

    def _read(self, key: bytes) -> HostCheckpoint | None:
        with self._lock:
            e = self._entries.get(key)
            if e is not None:
                self._entries.move_to_end(key)
        if e is None:
            return None
        try:
            data = e.path.read_bytes()
            hc = decode(data, self.fingerprint, self.pin, self.names)
            if hc.key != key:
                raise CheckpointFileError(f"holds key {hc.key.hex()[:12]}, indexed as {key.hex()[:12]}")
            os.utime(e.path)
            self.on_bytes("disk_read", len(data))
            return hc
        except (OSError, CheckpointFileError, ValueError, RuntimeError) as err:
            self.ignored += 1
            logger.warning("checkpoint file %s ignored: %s", e.path, err)
            with self._lock:
                self._remove(key)
            e.path.unlink(missing_ok=True)
            return None

    def flush(self) -> None:
        """Wait for every write queued so far."""
        self._io.submit(lambda: None).result()

    def close(self) -> None:
        self._io.shutdown(wait=True)
