"""``gdnserve serve``: the OpenAI-compatible HTTP server on the embedded default model or an HF checkpoint.

Before the model loads: the model folder, the device, the port and the memory plan (the model and the pools
against --gpu-memory-utilization / --memory-budget-gb) are checked (one line naming the flag, exit 2). After: a
banner (model, device, dtype, memory, pools, capacity, limits, URL, access) on stderr, then uvicorn on the
socket bound before the load."""
from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import time

from gdnserve.engine.config import FIXED_PAGES, EngineConfig
from gdnserve.engine.engine_api import EngineDeadError
from gdnserve.entrypoints.config import ServerConfig, is_loopback_name
from gdnserve.entrypoints.limits import Limits

_D = EngineConfig()     # the engine's defaults live there, once
_L = Limits()
_C = ServerConfig()


def _csv(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model and engine")
    m.add_argument("--model", default=None, help="HF checkpoint folder (config.json, *.safetensors, tokenizer.json); "
                                                  "default: the embedded tiny model (random weights)")
    m.add_argument("--device", default="auto", help="auto (default: cuda if available, else cpu), cpu or cuda[:N]")
    m.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on CUDA, float32 on CPU")
    m.add_argument("--prefill-mode", default=_D.prefill_mode,
                   choices=["serial", "two_phase", "two_phase_indexed", "fused"],
                   help=f"grouped producer/consumer prefill executor (default {_D.prefill_mode})")
    m.add_argument("--max-num-seqs", type=int, default=_D.max_num_seqs,
                   help=f"concurrently running sequences (default {_D.max_num_seqs})")
    m.add_argument("--max-model-len", type=int, default=_D.max_model_len,
                   help=f"prompt + generated tokens per sequence (default {_D.max_model_len})")
    m.add_argument("--max-step-tokens", "--max-num-batched-tokens", type=int, default=_D.max_step_tokens,
                   dest="max_step_tokens",
                   help=f"prompt tokens one step prefills, beside its decodes (default {_D.max_step_tokens}; vLLM's "
                        "--max-num-batched-tokens): larger steps cut a long prompt's steps and TTFT, the memory plan "
                        "measures the activation peak of a step this large")
    m.add_argument("--gpu-memory-utilization", type=float, default=_D.gpu_memory_utilization, metavar="F",
                   help=f"share of the GPU's memory the engine may use: weights, activations, CUDA graphs, and KV "
                        f"pages + state slots sized to fill the rest (default {_D.gpu_memory_utilization}; on CPU the "
                        "share of the available RAM the fixed pools are checked against)")
    m.add_argument("--memory-budget-gb", type=float, default=None, metavar="GB",
                   help="bytes the engine may use, in GiB, instead of --gpu-memory-utilization (any device; on CPU it "
                        "sizes the pools, which are otherwise fixed)")
    m.add_argument("--num-pages", type=int, default=_D.num_pages,
                   help=f"KV pages of {_D.page_size} tokens per attention layer (default: sized from the memory "
                        f"budget on CUDA, {FIXED_PAGES} on CPU); checked against the budget")
    m.add_argument("--num-slots", type=int, default=_D.num_slots,
                   help="recurrent-state slots: running requests, fork producers and checkpoints (default: sized "
                        "from the memory budget on CUDA, 2 x --max-num-seqs + 2 on CPU); checked against the budget")
    m.add_argument("--spec-k", type=int, default=_D.spec_k,
                   help=f"speculative decoding: drafts verified per step (default {_D.spec_k}; 0 = off)")
    m.add_argument("--spec-draft", default=_D.spec_draft, choices=["ngram", "mtp"],
                   help=f"drafter: ngram (prompt lookup, no weights) or mtp (the checkpoint's mtp.* head); default "
                        f"{_D.spec_draft}")
    m.add_argument("--spec-mode", default=_D.spec_mode, choices=["replay", "intermediate"],
                   help=f"GDN verify mode: replay (pending inputs, one state read+write) or intermediate; default "
                        f"{_D.spec_mode}")
    m.add_argument("--tensor-parallel-size", type=int, default=_D.tensor_parallel_size, metavar="N",
                   help="shard the model over N processes, one GPU each (cuda:0..N-1; gloo processes on CPU); N "
                        "must divide the model's attention, KV and GDN heads (default 1)")
    m.add_argument("--no-auto-checkpoints", dest="auto_checkpoints", action="store_false",
                   help="publish no automatic checkpoints (a finished request's state, which the next turn of a chat "
                        "or an extended prompt starts from; vLLM's --no-enable-prefix-caching); checkpoints at a "
                        "marker or checkpoint_at stay on (default: on)")
    m.add_argument("--checkpoint-host-memory", dest="checkpoint_host_memory_gb", type=float,
                   default=_D.checkpoint_host_memory_gb, metavar="GB",
                   help="GiB of pinned host memory for checkpoints evicted from the GPU: copied down instead of "
                        "dropped, restored on a hit (default 0 = off; on CPU ordinary memory, for tests)")
    m.add_argument("--checkpoint-spill-ahead", dest="checkpoint_spill_ahead", type=int,
                   default=_D.checkpoint_spill_ahead, metavar="N",
                   help="with --checkpoint-host-memory: when fewer than N state slots are free, copy the least "
                        "recently used checkpoints to host memory in the background (still usable on the GPU "
                        "until their slot is needed, then freed without a copy; 0 = off; default "
                        f"{_D.checkpoint_spill_ahead})")
    m.add_argument("--checkpoint-dir", default=_D.checkpoint_dir, metavar="PATH",
                   help="directory for checkpoints evicted below the host tier (or the device when it is off) and for "
                        "every checkpoint at a graceful shutdown; found again at the next start with the same model "
                        "(default: none)")
    m.add_argument("--checkpoint-dir-max-gb", type=float, default=_D.checkpoint_dir_max_gb, metavar="GB",
                   help=f"size bound of --checkpoint-dir, least recently used files removed first (default "
                        f"{_D.checkpoint_dir_max_gb:g})")
    m.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_const", const=False, default=None,
                   help="run decode and verify steps eagerly (default: bucketed CUDA graphs on a CUDA device)")
    ov = m.add_mutually_exclusive_group()
    ov.add_argument("--overlap", dest="overlap", action="store_const", const=True, default=None,
                    help="the overlapped engine loop: the next step is scheduled and launched while the device runs "
                         "this one (not with --spec-k or tensor parallelism; default: off until verified on the GPU, "
                         "docs/serving.md § Overlapped loop)")
    ov.add_argument("--no-overlap", dest="overlap", action="store_const", const=False, default=None,
                    help="the serial engine loop (the default for now)")
    n = p.add_argument_group("network and access")
    n.add_argument("--host", default="127.0.0.1",
                   help="bind address (default 127.0.0.1: loopback only; 0.0.0.0 exposes the server: add --api-key)")
    n.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default 8000)")
    n.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* and /metrics (default: no key)")
    n.add_argument("--public-metrics", action="store_true", help="serve /metrics without the API key")
    n.add_argument("--allowed-hosts", type=_csv, default=(), metavar="NAME[,NAME...]",
                   help="Host header names accepted besides the loopback ones ('*': any). Bound to loopback, other "
                        "Hosts get 403 (DNS rebinding); bound elsewhere, the check applies only with this flag")
    n.add_argument("--allowed-origins", type=_csv, default=(), metavar="ORIGIN[,ORIGIN...]",
                   help="browser origins (scheme://host[:port], '*': any) allowed to call the server, with CORS "
                        "headers; requests from other origins get 403 (default: none)")
    n.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds open requests get to finish on shutdown before they are cut (default 10)")
    r = p.add_argument_group("requests and limits")
    r.add_argument("--parse-special-tokens", action="store_true",
                   help="special-token strings in prompts and chat contents become control tokens (default: plain "
                        "text; per request: \"parse_special_tokens\": true)")
    r.add_argument("--default-max-tokens", type=int, default=_C.default_max_tokens,
                   help=f"/v1/completions without max_tokens (default {_C.default_max_tokens})")
    r.add_argument("--chat-default-max-tokens", type=int, default=_C.chat_default_max_tokens,
                   help=f"/v1/chat/completions without max_tokens (default {_C.chat_default_max_tokens}; "
                        "always at most what the context leaves)")
    r.add_argument("--max-body-bytes", type=int, default=_L.max_body_bytes,
                   help=f"request body size; larger bodies get 413 (default {_L.max_body_bytes} = 8 MiB)")
    r.add_argument("--max-prompts", type=int, default=_L.max_prompts,
                   help=f"prompts in one /v1/completions request (default {_L.max_prompts})")
    r.add_argument("--max-stop", type=int, default=_L.max_stop, help=f"stop strings per request (default {_L.max_stop})")
    r.add_argument("--max-stop-chars", type=int, default=_L.max_stop_chars,
                   help=f"characters per stop string (default {_L.max_stop_chars})")
    r.add_argument("--max-json-depth", type=int, default=_L.max_json_depth,
                   help=f"nesting of arrays/objects in a request body (default {_L.max_json_depth})")
    r.add_argument("--max-json-containers", type=int, default=_L.max_json_containers,
                   help=f"arrays + objects in a request body (default {_L.max_json_containers})")
    r.add_argument("--max-candidates", type=int, default=_L.max_candidates,
                   help=f"candidates in one /v1/score request (default {_L.max_candidates})")
    r.add_argument("--max-n", type=int, default=_L.max_n, help=f"samples per prompt, n (default {_L.max_n})")
    r.add_argument("--max-logprobs", type=int, default=_L.max_logprobs,
                   help=f"logprobs / top_logprobs per token (default {_L.max_logprobs})")


def server_config(args: argparse.Namespace) -> ServerConfig:
    limits = Limits(max_body_bytes=args.max_body_bytes, max_prompts=args.max_prompts, max_stop=args.max_stop,
                    max_stop_chars=args.max_stop_chars, max_json_depth=args.max_json_depth,
                    max_json_containers=args.max_json_containers,
                    max_candidates=args.max_candidates, max_n=args.max_n, max_logprobs=args.max_logprobs)
    return ServerConfig(api_key=args.api_key, host=args.host, allowed_hosts=tuple(args.allowed_hosts),
                        allowed_origins=tuple(args.allowed_origins), public_metrics=args.public_metrics,
                        parse_special_tokens=args.parse_special_tokens, default_max_tokens=args.default_max_tokens,
                        chat_default_max_tokens=args.chat_default_max_tokens, limits=limits)


# EngineConfig fields set by a flag of the same name (--max-num-seqs -> max_num_seqs; --no-cuda-graphs and
# --no-auto-checkpoints store into cuda_graphs / auto_checkpoints). A command has the flags it offers.
ENGINE_FLAGS = ("prefill_mode", "max_num_seqs", "max_model_len", "max_step_tokens", "num_pages", "num_slots",
                "spec_k", "spec_mode", "spec_draft", "cuda_graphs", "auto_checkpoints", "tensor_parallel_size",
                "gpu_memory_utilization", "memory_budget_gb", "overlap", "checkpoint_host_memory_gb",
                "checkpoint_spill_ahead", "checkpoint_dir", "checkpoint_dir_max_gb")


def engine_config(args: argparse.Namespace, **fixed) -> EngineConfig:
    """The engine's config from a command's flags: the one flags -> config mapping (``serve``, ``serve --replicas``,
    ``generate``, ``score``; the flags a command does not offer keep EngineConfig's defaults), plus ``fixed``
    fields the command decides itself. A value the config refuses raises ValueError naming the flag that set it
    ("--max-num-seqs: max_num_seqs must be an int >= 1, got 0"): the commands print it and exit 2."""
    flagged = {f: getattr(args, f) for f in ENGINE_FLAGS if hasattr(args, f)}
    try:
        return EngineConfig(**{"model_name": getattr(args, "model", None) or "gdnserve-embedded", **flagged,
                               **fixed})
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        if field in flagged and field not in fixed:
            raise ValueError(f"--{field.replace('_', '-')}: {e}") from None
        raise


def _fail(message: str, code: int = 2) -> int:
    print(f"gdnserve serve: {message}", file=sys.stderr, flush=True)
    return code


def run_serve(args: argparse.Namespace) -> int:
    from gdnserve.entrypoints.preflight import PreflightError, bind_socket, check_device, check_model_folder
    term: list[bool] = []      # set when a SIGTERM ended the server (_terminated_unwinds)
    try:
        config = server_config(args)
    except ValueError as e:
        return _fail(str(e))
    if args.shutdown_timeout < 0:
        return _fail(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    try:
        check_model_folder(args.model)
        check_device(args.device)
        sock = bind_socket(args.host, args.port)  # before the load: a busy port fails in a second, not minutes
    except PreflightError as e:
        return _fail(str(e))
    try:
        from gdnserve.engine.async_engine import AsyncEngine
        from gdnserve.engine.memory.memory_plan import MemoryPlanError
        from gdnserve.entrypoints.llm import load_engine
        from gdnserve.entrypoints.server import run_server
        t0 = time.perf_counter()
        try:
            cfg = engine_config(args)
        except ValueError as e:            # a flag out of range: the message names the flag
            return _fail(str(e))
        try:
            # args.load_engine: a launcher's own loader (benchmarks/serve_random.py: a random-weight model)
            engine = (getattr(args, "load_engine", None) or load_engine)(args.model, dtype=args.dtype,
                                                                         device=args.device, config=cfg)
        except MemoryPlanError as e:       # refused before loading: the numbers and the flag to change
            return _fail(str(e))
        except (OSError, ValueError, EngineDeadError) as e:  # CheckpointError, a config the model cannot take,
            # a missing file, a tensor-parallel worker that could not start
            return _fail(f"cannot load {'the embedded model' if args.model is None else args.model}: {e}", 1)
        try:
            # graphs captured and kernels compiled before the first request, not in it (vLLM captures at start-up too)
            try:
                args.warm_up_line = engine.warm_up() if hasattr(engine, "warm_up") else ""
            except RuntimeError as e:      # a capture out of memory: say so, not a traceback
                return _fail(f"warm-up (CUDA graph capture) failed: {e}; --no-cuda-graphs serves without graphs", 1)
            print(banner(engine, args, config, sock.getsockname()[1], time.perf_counter() - t0), file=sys.stderr,
                  flush=True)
            # a dead engine (a tensor-parallel worker gone) fails its requests and stops the server: exit 1 below
            with _terminated_unwinds(term):
                run_server(AsyncEngine(engine), config=config, port=args.port, sock=sock,
                           shutdown_timeout=args.shutdown_timeout)
        finally:
            if hasattr(engine, "close"):      # tensor-parallel workers stop and are joined; a --checkpoint-dir
                engine.close()                # gets the checkpoints still in GPU and host memory
        if getattr(engine, "dead", None) is not None:
            return _fail(f"the engine stopped: {engine.dead}", 1)
    finally:
        sock.close()
    if term:                                 # the engine is closed: end as the SIGTERM would have
        signal.raise_signal(signal.SIGTERM)
    return 0



class _Terminated(Exception):
    """SIGTERM, after uvicorn's graceful shutdown."""


@contextlib.contextmanager
def _terminated_unwinds(term: list[bool]):
    """uvicorn re-raises the SIGTERM it caught once its graceful shutdown is done; with the default handler that
    ends the process there, before the engine is closed. Here it unwinds (the engine closes on the way) and is
    raised again at the end, so the exit status stays -SIGTERM."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def unwind(signum, frame):
        raise _Terminated

    old = signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    except _Terminated:
        term.append(True)
    finally:
        signal.signal(signal.SIGTERM, old)


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def max_n(engine, limit: int) -> int:
    """The most samples per prompt a request can get: ``--max-n``, the engine's SamplingParams cap, its
    ``max_num_seqs`` and its state slots (the n samples and their fork)."""
    from gdnserve.engine.sampling_params import MAX_N
    cfg = getattr(engine, "config", None)
    return min(limit, MAX_N, *((cfg.max_num_seqs, cfg.slots - 1) if isinstance(cfg, EngineConfig) else ()))


def tier_lines(engine) -> list[str]:
    """The checkpoint tiers' capacity: the GPU's state slots (each checkpoint holds one) and the lower tiers'."""
    kv = getattr(engine, "kv", None)
    tiers = getattr(getattr(kv, "checkpoint_cache", None), "tiers", None)
    if tiers is None:
        return []
    return [f"  checkpoint tiers: gpu <= {kv.state.num_slots} checkpoints (state slots); "
            + "; ".join(tiers.capacity()) + " (checkpoints of 2,048 tokens)"]


def banner(engine, args: argparse.Namespace, config: ServerConfig, port: int, load_s: float) -> str:
    """What is being served, how, and where: printed once the model is loaded."""
    st = engine.stats() if hasattr(engine, "stats") else {}
    runner = getattr(engine, "runner", None)
    device, dtype = getattr(runner, "device", "?"), str(getattr(runner, "dtype", "?")).removeprefix("torch.")
    page = getattr(getattr(runner, "rc", None), "page_size", 16)
    plan = getattr(engine, "memory_plan", None)
    lim = config.limits
    n_cap = max_n(engine, lim.max_n)
    what = getattr(args, "model_desc", None) or (  # model_desc: a launcher's own (benchmarks/serve_random.py)
        "embedded tiny model, random weights: its text is noise" if args.model is None else args.model)
    lines = [
        f"gdnserve: serving {getattr(engine, 'model_name', '?')} ({what}); loaded in {load_s:.1f} s",
        f"  device {device}, dtype {dtype}, prefill {args.prefill_mode}, max_model_len {args.max_model_len}, "
        f"max_num_seqs {args.max_num_seqs}, spec_k {args.spec_k}, automatic checkpoints "
        f"{'on' if getattr(getattr(engine, 'config', None), 'auto_checkpoints', args.auto_checkpoints) else 'off'}"
        f"{f', tensor parallel {args.tensor_parallel_size} ranks' if getattr(args, 'tensor_parallel_size', 1) > 1 else ''}",
        *(plan.describe() if plan is not None else
          [f"  pools: {st.get('state_pool_total')} state slots, {st.get('page_pool_total')} KV pages x {page} tokens"]),
        *tier_lines(engine),
        *([f"  warm-up: {args.warm_up_line}"] if getattr(args, "warm_up_line", "") else []),
        f"  limits: body {lim.max_body_bytes} B, {lim.max_prompts} prompts/request, n <= {n_cap}"
        f"{f' (--max-n {lim.max_n}, capped by the engine)' if n_cap < lim.max_n else ''}, "
        f"{lim.max_stop} stop strings x {lim.max_stop_chars} chars, JSON depth {lim.max_json_depth} and "
        f"{lim.max_json_containers} arrays/objects, "
        f"{lim.max_candidates} score candidates",
        f"  access: API key {'required' if config.api_key else 'none'}"
        f"{' (/metrics open)' if config.api_key and config.public_metrics else ''}; Host "
        f"{'loopback names' if config.loopback else 'any'}"
        f"{' + ' + ','.join(config.allowed_hosts) if config.allowed_hosts else ''}; CORS origins "
        f"{','.join(config.allowed_origins) or 'none'}; special tokens in user text "
        f"{'parsed' if config.parse_special_tokens else 'plain text'}",
        f"  listening on {_url(args.host, port)}  (OpenAI base_url {_url(args.host, port)}/v1; Ctrl-C stops)",
    ]
    if not is_loopback_name(args.host) and not config.api_key:
        lines.append(f"  WARNING: bound to {args.host} without --api-key: anyone who can reach this port can use it")
    return "\n".join(lines)
