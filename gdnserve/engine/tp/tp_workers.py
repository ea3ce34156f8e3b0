"""Tensor-parallel worker processes: rank 0 is the engine process (scheduler, pools' allocators, sampling); ranks
1..N-1 are processes started here (``torch.multiprocessing`` spawn), each holding its shard of the model and its
shard of the same state slots and KV pages. ``torch.distributed`` joins all N: NCCL on CUDA (rank r on cuda:r),
gloo on CPU; the model's all-reduces run in that group (layers/parallel.py).

Control plane: one pipe per worker, not a collective. Each step rank 0 pickles its ``StepWork`` (and the device
ops it ran since the last step: replay-mode flushes, acceptance commits) once and writes the bytes to every pipe;
a worker's :class:`ShardRunner` replays the ops and executes the work on its shard: the same slot and page
numbers, decided by rank 0's allocators only (its own pools are never allocated from; tp_runner.py is rank 0's
side). An idle worker waits on its pipe, so an idle server needs no heartbeat, and a worker whose rank 0 is gone
reads EOF and exits.

Liveness: a monitor thread on rank 0 waits on every worker's pipe and process sentinel. A worker that raises
reports the error on its pipe and exits 1; a worker that is killed just exits. Either way the group is marked
broken with "tensor-parallel worker rank R exited with ...", every later step raises that error at once
(``TensorParallelError``, an ``EngineDeadError``: the engine fails every request with it), and a collective that
was waiting on the dead rank fails (gloo: the peer's socket closes; both backends: the process group's
``timeout``). ``close`` (LLM.close, server exit, atexit) stops the workers and joins them.
"""
from __future__ import annotations

import atexit
import logging
import os
import pickle
import signal
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gdnserve.engine.cache.page_pool import PagePool, PageTable
from gdnserve.engine.cache.sequence import SeqState
from gdnserve.engine.cache.state_pool import StatePool
from gdnserve.engine.engine_api import EngineDeadError
from gdnserve.engine.execution.model_runner import ModelRunner, pool_shapes
from gdnserve.engine.execution.step_work import StepWork

logger = logging.getLogger(__name__)

TIMEOUT_S = float(os.environ.get("GDNSERVE_TP_TIMEOUT_S", "300"))   # any one collective wait (the group's timeout)


class TensorParallelError(EngineDeadError):
    """A tensor-parallel rank is gone (or the ranks are out of step): the engine cannot run any more steps."""


@dataclass(frozen=True)
class ModelSpec:
    """What every rank loads: the embedded model (path None) or an HF folder, in ``dtype`` on ``device_type``."""
    path: str | None
    dtype: str          # "float32", "bfloat16", ...
    device_type: str    # "cpu" | "cuda"

    def device(self, rank: int) -> torch.device:
        return torch.device("cuda", rank) if self.device_type == "cuda" else torch.device("cpu")

    def load(self, rank: int, size: int):
        """This rank's shard of the model (rank / size also come from the process group)."""
        from gdnserve.models.builtin import build_builtin_model
        from gdnserve.models.loader import load_model
        dt, dev = getattr(torch, self.dtype), self.device(rank)
        if self.path is None:
            return build_builtin_model(dtype=dt, device=dev, tp_rank=rank, tp_size=size)
        return load_model(self.path, dtype=dt, device=dev, tp_rank=rank, tp_size=size)[0]


def init_group(rank: int, size: int, store: dist.Store, device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    else:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")    # loopback: containers may not resolve their hostname
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", store=store, rank=rank, world_size=size,
                            timeout=timedelta(seconds=TIMEOUT_S))


def exit_text(rank: int, code: int | None, report: str | None) -> str:
    how = "a running state" if code is None else (
        f"signal {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() else f"exit code {code}")
    return f"tensor-parallel worker rank {rank} exited with {how}" + (f" after raising {report}" if report else "")


class TPGroup:
    """Rank 0's handle on the N-1 worker processes: start, ship a step, liveness, close."""

    def __init__(self, spec: ModelSpec, size: int, rc) -> None:
        self.spec, self.size, self.rc = spec, size, rc
        self.procs: list[mp.Process] = []
        self.conns: list[Connection] = []
        self.reports: dict[int, str] = {}     # rank -> the error a worker reported before exiting
        self.error: str | None = None         # set once: the group is broken
        self.closing = False
        self._lock = threading.Lock()
        self._monitor: threading.Thread | None = None

    # ------------------------------------------------------------------ start
    def start(self) -> None:
        """Spawn the workers and join the process group as rank 0 (returns before the workers have loaded their
        shards: ``wait_ready`` waits for them while rank 0 loads its own)."""
        if dist.is_available() and dist.is_initialized():
            raise ValueError("tensor_parallel_size > 1: torch.distributed is already initialised in this process "
                             "(close the other tensor-parallel LLM first)")
        store = dist.TCPStore("127.0.0.1", 0, self.size, True, timedelta(seconds=TIMEOUT_S), wait_for_workers=False)
        ctx = mp.get_context("spawn")
        atexit.register(self.close)
        for rank in range(1, self.size):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(rank, self.size, store.port, self.spec, self.rc, theirs),
                            name=f"gdnserve-tp{rank}", daemon=True)
            p.start()
            theirs.close()
            self.procs.append(p)
            self.conns.append(mine)
        self._await("hello")                  # every worker imported and is about to join the group
        init_group(0, self.size, store, self.spec.device_type)
        self.store = store

    def wait_ready(self) -> None:
        """Until every worker has built its shard, runner and pools (a worker that dies meanwhile raises)."""
        self._await("ready")
        self._monitor = threading.Thread(target=self._watch, name="gdnserve-tp-monitor", daemon=True)
        self._monitor.start()

    def _await(self, what: str) -> None:
        todo = dict(zip(self.conns, range(1, self.size)))
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs, 1)}
        while todo:
            for obj in wait(list(todo) + list(sentinels)):
                if obj in sentinels:
                    r = sentinels[obj]
                    self._drain_report(r)
                    self.close()
                    raise TensorParallelError(exit_text(r, self.procs[r - 1].exitcode, self.reports.get(r)) +
                                              f" while starting (waiting for {what!r})")
                if obj in todo:
                    r = todo[obj]
                    try:
                        msg = obj.recv()
                    except EOFError:                  # it is exiting: wait for its exit code
                        self.procs[r - 1].join(5)
                        self.close()
                        raise TensorParallelError(exit_text(r, self.procs[r - 1].exitcode, self.reports.get(r)) +
                                                  f" while starting (waiting for {what!r})") from None
                    if msg[0] == "error":
                        self.reports[r] = msg[1]
                    elif msg[0] == what:
                        del todo[obj]

    # ------------------------------------------------------------------ steps
    def check(self) -> None:
        if self.error is not None:
            raise TensorParallelError(self.error)

    def send(self, msg: tuple) -> None:
        """One pickle, written to every worker's pipe."""
        self.check()
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for c in self.conns:
                c.send_bytes(data)
        except OSError as e:                  # a pipe closed under us: the monitor names the worker
            raise self.broken(e) from e

    def broken(self, err: BaseException) -> TensorParallelError:
        """The error of a step that failed after its inputs went out: a dead worker if there is one (waiting a
        moment for its exit to be seen), else rank 0's own error; either way the ranks are out of step now."""
        deadline = time.monotonic() + 10
        while self.error is None and time.monotonic() < deadline:
            dead = [r for r, p in enumerate(self.procs, 1) if not p.is_alive()]
            if dead:
                self._mark(dead[0])
                break
            time.sleep(0.05)
        if self.error is None:
            with self._lock:
                self.error = (f"tensor-parallel step failed on rank 0 after its inputs were sent to the workers "
                              f"({type(err).__name__}: {err}); the ranks are out of step")
            self.close()
        return TensorParallelError(self.error)

    # ------------------------------------------------------------------ liveness
    def _drain_report(self, rank: int) -> None:
        c = self.conns[rank - 1]
        try:
            while c.poll():
                msg = c.recv()
                if msg[0] == "error":
                    self.reports[rank] = msg[1]
        except (EOFError, OSError):
            pass

    def _mark(self, rank: int) -> None:
        self._drain_report(rank)
        with self._lock:
            if self.error is not None or self.closing:
                return
            self.error = exit_text(rank, self.procs[rank - 1].exitcode, self.reports.get(rank))
            logger.error("%s", self.error)
        if self.spec.device_type == "cuda":
            # An NCCL collective waiting on the dead rank does not notice it (gloo's does: the socket closes);
            # aborting the communicators makes rank 0's wait raise now instead of at the group's timeout.
            try:
                dist.distributed_c10d._abort_process_group()
            except Exception as e:                # noqa: BLE001  best effort: the timeout still bounds the wait
                logger.warning("tensor parallel: aborting the NCCL group after rank %d died: %r", rank, e)

    def _watch(self) -> None:
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs, 1)}
        conns = {c: r for r, c in enumerate(self.conns, 1)}
        while not self.closing and self.error is None:
            for obj in wait(list(sentinels) + list(conns), timeout=0.5):
                if obj in sentinels:
                    self.procs[sentinels[obj] - 1].join(1)
                    self._mark(sentinels[obj])
                    return
                r = conns[obj]
                try:
                    msg = obj.recv()
                except (EOFError, OSError):
                    del conns[obj]                    # it is exiting: its sentinel follows
                    continue
                if msg[0] == "error":
                    self.reports[r] = msg[1]

    # ------------------------------------------------------------------ shutdown
    def close(self, timeout: float = 10.0) -> None:
        """Stop the workers (a "stop" message, then terminate / kill what is left) and leave the process group.
        Idempotent; registered with atexit."""
        with self._lock:
            if self.closing:
                return
            self.closing = True
        for c in self.conns:
            try:
                c.send(("stop",))
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        for c in self.conns:
            c.close()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(2)
        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as e:                # noqa: BLE001  a broken group may refuse a clean teardown
                logger.warning("tensor parallel: process group teardown: %r", e)
        atexit.unregister(self.close)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]


# ---------------------------------------------------------------------- the worker process

class _ShardPagePool(PagePool):
    """A worker's KV pages: tensors only. Rank 0 allocates; page numbers arrive with the work (no refcount check)."""

    def _check_used(self, page: int, what: str) -> None:
        self._check_page(page)


class ShardRunner(ModelRunner):
    def __init__(self, model, rc):
        sc, pc = pool_shapes(model, rc)
        pages = _ShardPagePool(pc)
        super().__init__(model, rc, pools=(StatePool(sc), pages))
        self._table = PageTable(pages)       # a stand-in for the sequences' tables in replayed ops

    def replay(self, ops: list[tuple], work: StepWork) -> None:
        for kind, rows in ops:
            if kind == "flush":
                self.flush([SeqState(slot, self._table, 0, pending, parity) for slot, pending, parity in rows])
            elif kind == "accept":
                self.accept([(SeqState(slot, self._table, self.rc.spec_tokens), a) for slot, a in rows])
            else:
                raise ValueError(f"unknown op {kind!r} from rank 0")
        self.execute(work)



def worker_main(rank: int, size: int, port: int, spec: ModelSpec, rc, conn: Connection) -> None:
    """Rank ``rank``: join the group, build the shard, then replay and execute each step rank 0 sends."""
    code = 0
    try:
        if spec.device_type == "cpu":
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        conn.send(("hello",))
        store = dist.TCPStore("127.0.0.1", port, size, False, timedelta(seconds=TIMEOUT_S))
        init_group(rank, size, store, spec.device_type)
        runner = ShardRunner(spec.load(rank, size), rc)
        conn.send(("ready",))
        while True:
            try:
                msg = conn.recv()
            except EOFError:                       # rank 0 is gone
                break
            if msg[0] == "stop":
                break
            if msg[0] != "step":
                raise ValueError(f"unknown message {msg[0]!r} from rank 0")
            runner.replay(msg[1], msg[2])
    except BaseException as e:                     # noqa: BLE001  reported, then this rank exits non-zero
        code = 1
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
    finally:
        conn.close()
        # no process-group teardown: rank 0 leaves it, and gloo may abort a process tearing down mid-collective
        os._exit(code)
