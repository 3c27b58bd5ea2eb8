"""``mpengine serve``: the engine's three stages plus the HTTP front end in this process.

1. bind the HTTP port (a port in use fails before a model is loaded)
2. launch the engine (stages, model, KV cache); IPC clients may connect at --address
3. serve HTTP (uvicorn) through an ``AsyncClient``; tell systemd ``READY=1``
4. every second (or half the watchdog interval): poll the engine's stats, ping the
   watchdog only while healthy (``health.py``), update ``STATUS=``
5. on SIGTERM or SIGINT: ``STOPPING=1`` and drain -- refuse new requests (503, and the
   scheduler refuses IPC clients too), let admitted ones finish for --drain-timeout
   seconds, abort the rest (finish reason ``abort``), then stop everything; exit 0
6. if a stage dies: exit 1 (systemd restarts the service, Restart=on-failure)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import gc
import logging
import os
import resource
import signal
import socket
import ssl
import sys
from collections.abc import Coroutine, Iterator
from typing import Any

import uvicorn

from mpengine.config import EngineConfig
from mpengine.data_parallel import RemoteReplicas
from mpengine.launch import Engine, raise_open_files_limit
from mpengine.metrics import ServerMetrics
from mpengine.runtime.engine_file import ipc_dir, read_engine_file, write_engine_file
from mpengine.runtime.notify import Notifier
from mpengine.runtime.stage import STACKS_SIGNAL, configure_logging
from mpengine.server.app import Cors, build_app
from mpengine.server.health import EngineMonitor, StatsLog, has_work
from mpengine.server.http_protocol import protocol_with_head_timeout
from mpengine.server.request_logs import RateLimit
from mpengine.server.state import ServerState
from mpengine.server.text import NO_TEMPLATE, TextTools, load_chat_template

logger = logging.getLogger(__name__)

ABORT_GRACE_S = 5.0  # after the drain deadline, for the aborted requests' last outputs
HTTP_GRACE_S = 5.0  # for open connections to finish once the drain is over
POLL_S = 0.05
FILES_RESERVED = 256  # open files kept for the engine's own, beside HTTP connections
DEFAULT_MAX_CONNECTIONS = 8192


def serve(args: argparse.Namespace, engine_config: EngineConfig) -> int:
    """The body of ``mpengine serve``; the exit status."""
    api_key, source = _api_key(args)
    if api_key is not None and not api_key:
        # A check against "" would let in whoever sends an empty bearer token.
        raise SystemExit(f"mpengine: {source} an empty key: give a key, or none for no auth")
    _check_names(args)
    _check_tls(args)
    if args.chat_template is not None:
        try:
            args.chat_template = load_chat_template(args.chat_template)
        except ValueError as exc:
            raise SystemExit(f"mpengine: --chat-template: {exc}") from None
    configure_logging(engine_config.log_level, "serve")
    args.max_connections = _connection_limit(args.max_connections)
    listener = _listen(args.host, args.port)
    notifier = Notifier.from_environment()
    # Until the event loop handles them, SIGTERM and SIGINT interrupt the start-up, which
    # undoes what it made (the engine's constructor cleans up after itself).
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.default_int_handler)
    try:
        if args.engine_address:  # engines started elsewhere: this is their front only
            engine: Any = RemoteReplicas(engine_config, args.engine_address)
        else:
            engine = Engine(engine_config)
    except KeyboardInterrupt:
        listener.close()
        print("mpengine: stopped while starting", file=sys.stderr)
        return 0
    except BaseException:
        listener.close()
        raise
    try:
        with _stack_dumps(engine.runtime_dir):
            return _run(_serve(engine, listener, args, api_key, notifier))
    except KeyboardInterrupt:  # between start-up and the loop's own handlers
        return 0
    finally:
        # The loop is closed and its handlers gone: a signal now (a third Ctrl-C) would
        # cut the stages' stop short; it is bounded, so let it finish.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)
        engine.shutdown()
        notifier.close()


def _api_key(args: argparse.Namespace) -> tuple[str | None, str]:
    """The API key (None: no auth) and where it came from: ``--api-key``, ``--api-key-file``,
    else ``$MPENGINE_API_KEY`` or vLLM's ``$VLLM_API_KEY`` (a vLLM deployment that keeps
    its key there must not come up open)."""
    if args.api_key is not None and args.api_key_file:
        raise SystemExit("mpengine: give --api-key or --api-key-file, not both")
    if args.api_key_file:
        try:
            with open(args.api_key_file) as key_file:
                return key_file.read().strip(), "--api-key-file holds"
        except (OSError, UnicodeDecodeError) as exc:
            raise SystemExit(f"mpengine: cannot read --api-key-file: {exc}") from None
    # Stripped like the file's (a secret mounted from a file often ends in a newline).
    if args.api_key is not None:
        return args.api_key.strip(), "--api-key is"
    for name in ("MPENGINE_API_KEY", "VLLM_API_KEY"):
        if (key := os.environ.get(name)) is not None:
            return key.strip(), f"${name} is"
    return None, ""


def _check_names(args: argparse.Namespace) -> None:
    """Served model names: none empty or repeated; and ``--served-model-name`` takes every
    word after it, so ``serve --served-model-name NAME MODEL`` would serve the default model
    as NAME and MODEL."""
    names = args.served_model_name or []
    if any(not name for name in names) or len(set(names)) < len(names):
        raise SystemExit(f"mpengine: --served-model-name {names}: empty or repeated names")
    if names and getattr(args, "model_given", True) is False:
        raise SystemExit(
            "mpengine: no model given (serve MODEL or --model): --served-model-name takes "
            f"every word after it ({' '.join(names)}); put MODEL first"
        )


def _check_tls(args: argparse.Namespace) -> None:
    """HTTPS needs both files, and they must load: found out before the model loads."""
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise SystemExit("mpengine: HTTPS needs both --ssl-keyfile and --ssl-certfile")
    if args.ssl_certfile is not None:
        try:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
        except (OSError, ssl.SSLError) as exc:
            raise SystemExit(f"mpengine: cannot load the TLS key and certificate: {exc}") from None


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket; ``::`` (every IPv6 address) takes IPv4 too, as vLLM's does."""
    host = host.removeprefix("[").removesuffix("]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    dual = host == "::" and socket.has_dualstack_ipv6()
    try:
        listener = socket.create_server(
            (host, port), family=family, backlog=1024, dualstack_ipv6=dual
        )
    except OSError as exc:
        raise SystemExit(f"mpengine: cannot listen on {host}:{port}: {exc}") from None
    # Accepted connections inherit it (asyncio sets it only on sockets made with proto
    # IPPROTO_TCP, which create_server's are not): without it a stream on a kept-alive
    # connection (the openai client's pool) waited ~45 ms for the client's delayed ACK of
    # the response head before its first events (Nagle), which then came at once.
    listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return listener


@contextlib.contextmanager
def _stack_dumps(runtime_dir: str) -> Iterator[None]:
    """``mpengine stacks`` shows this process's threads too (the HTTP front end)."""
    with open(os.path.join(runtime_dir, "stacks-launcher.txt"), "a") as dump:
        faulthandler.register(STACKS_SIGNAL, file=dump, all_threads=True)
        try:
            yield
        finally:
            faulthandler.unregister(STACKS_SIGNAL)


def _run(main: Coroutine[None, None, int]) -> int:
    """Run ``main`` on uvloop's event loop when it is installed (less CPU per streamed
    token, which the engine's stages feel on a small machine), on asyncio's otherwise."""
    try:
        import uvloop
    except ImportError:
        uvloop = None
    if uvloop is None:  # (outside the except block: a traceback would show the ImportError)
        return asyncio.run(main)
    if sys.version_info < (3, 11):
        uvloop.install()
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def _tune_gc() -> None:
    """What start-up made (the tokenizer, the app, the engine's client) is frozen out of
    every collection, and the youngest generation is collected every 50,000 allocations
    instead of 700. Request bodies parse on the event loop into a Python object per JSON
    value, and with the defaults the collections that kept traversing them took longer
    than the parse itself: parsing and checking a 16 MB body of 1.5 M token-id lists took
    3.0 s, now 1.5 s.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, *gc.get_threshold()[1:])


class _Server(uvicorn.Server):
    """uvicorn without signal handlers of its own: SIGTERM and SIGINT start our drain."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn
        pass


async def _serve(
    engine: Any,
    listener: socket.socket,
    args: argparse.Namespace,
    api_key: str | None,
    notifier: Notifier,
) -> int:
    # 1. the front end's state; a stage's death marks it dead and ends the wait below
    loop = asyncio.get_running_loop()
    state = _state(engine, args, api_key)
    died = asyncio.Event()

    def on_death(reason: str) -> None:  # the launcher's supervisor thread
        state.monitor.dead = reason
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            loop.call_soon_threadsafe(died.set)

    engine.on_death(on_death)
    _tune_gc()
    # 2. HTTP; once it listens, ready
    server = _http_server(state, args)
    logging.getLogger("uvicorn.error").addFilter(RateLimit())  # (what clients cause at will)
    http = asyncio.create_task(server.serve(sockets=[listener]))
    while not server.started and not http.done():
        await asyncio.sleep(0.01)
    if http.done():
        await http  # raises what stopped it
        return 1
    _announce(engine, listener, state.model_name, "https" if args.ssl_certfile else "http")
    await state.monitor.poll()
    notifier.ready(state.monitor.status(state.model_name))
    # 3. serve until SIGTERM/SIGINT, a stage's death, or the HTTP server's end
    stop, now = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:  # the first drains, a second stops at once (as uvicorn does)
        if stop.is_set() and not now.is_set():
            logger.warning("a second signal: stopping without waiting for the drain")
            now.set()
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal)
    interval = min(1.0, notifier.watchdog_interval or 1.0)
    watch = asyncio.create_task(_watch(state.monitor, notifier, state.model_name, interval))
    waits = [asyncio.create_task(stop.wait()), asyncio.create_task(died.wait()), http]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    # 4. drain (or give up), then stop HTTP
    code = 0
    if stop.is_set() and not died.is_set():
        logger.info("draining (at most %g s)", args.drain_timeout)
        notifier.stopping(f"{state.model_name}: draining")
        drain = asyncio.create_task(_drain(state, engine, args.drain_timeout))
        hurry = asyncio.create_task(now.wait())
        await asyncio.wait([drain, hurry], return_when=asyncio.FIRST_COMPLETED)
        if not drain.done():
            drain.cancel()
            engine.abort_unfinished()
        hurry.cancel()
    else:
        print(f"mpengine: {state.monitor.dead or 'the HTTP server stopped'}", file=sys.stderr)
        code = 1
    for task in (watch, *waits[:2]):
        task.cancel()
    server.should_exit = True
    await http
    state.client.close()
    return code


def _http_server(state: ServerState, args: argparse.Namespace) -> _Server:
    """uvicorn serving the app, with the process's logging and our own signal handling."""
    cors = Cors(
        args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials
    )
    return _Server(
        uvicorn.Config(
            build_app(state, cors),
            ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile,
            log_config=None,  # the process's logging, as configured
            log_level=args.uvicorn_log_level,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=HTTP_GRACE_S,
            # Past it, a clean 503 at once (and never the open-file limit: see above).
            limit_concurrency=args.max_connections,
            http=protocol_with_head_timeout(args.http_head_timeout),
        )
    )


def _connection_limit(asked: int | None) -> int:
    """Raise the soft limit on open files as an engine does (``raise_open_files_limit``:
    the usual 1,024 is soon reached by keep-alive clients, and at the limit asyncio's
    accept failed in a loop of tracebacks), and return the connections to serve at once:
    ``asked``, else what the files allow after a reserve for the engine's own (sockets,
    shared memory, the model's files)."""
    raise_open_files_limit()
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    files = soft if soft != resource.RLIM_INFINITY else 1 << 20
    room = max(16, files - FILES_RESERVED)
    if asked is not None and asked > room:
        logger.warning("--max-connections %d: the open-file limit allows %d", asked, room)
    return min(asked, room) if asked is not None else min(room, DEFAULT_MAX_CONNECTIONS)


def _state(engine: Any, args: argparse.Namespace, api_key: str | None) -> ServerState:
    client = engine.async_client(timeout=engine.config.startup_timeout)
    info = client.info
    # A front for engines elsewhere names the model they serve unless told a name.
    unnamed = isinstance(engine, RemoteReplicas) and not getattr(args, "model_given", True)
    names = args.served_model_name or [info.model if unnamed else engine.config.model]
    config = engine.config
    cache_config = {
        "block_size": info.block_size,
        "num_gpu_blocks": info.num_blocks,
        "enable_prefix_caching": config.prefix_caching,
        "preemption_mode": config.preemption_mode,
        "swap_space_bytes": config.swap_space if config.preemption_mode == "swap" else 0,
        "gpu_memory_utilization": config.gpu_memory_utilization,
    }
    metrics = ServerMetrics(
        names[0], info.max_model_len, cache_config, num_engines=client.data_parallel_size
    )
    monitor = EngineMonitor(client, metrics, args.stall_timeout, engine)
    text = TextTools(
        info.tokenizer, args.chat_template, args.chat_template_content_format, info.max_model_len
    )
    if text.template is None and info.can_generate:
        logger.warning("%s; /v1/chat/completions refuses messages", NO_TEMPLATE)
    return ServerState(
        client,
        info,
        text,
        metrics,
        monitor,
        names,
        api_key,
        access_log=not args.disable_uvicorn_access_log,
        log_requests=args.enable_log_requests,
        tool_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        stream_stall_s=args.stream_stall_timeout,
        body_timeout_s=args.http_body_timeout,
    )


def _announce(engine: Any, listener: socket.socket, model: str, scheme: str) -> None:
    host, port = listener.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    url = f"{scheme}://{host}:{port}"
    model_path = engine.model.model_path if engine.model else model
    # The first line is what `mpengine serve` always printed (IPC clients parse it).
    print(f"mpengine: serving {model_path} at {engine.address}", flush=True)
    print(f"mpengine: HTTP API at {url}/v1 (model {model!r})", flush=True)
    for address in [] if isinstance(engine, RemoteReplicas) else engine.address.split(","):
        if address.startswith("ipc://"):  # (each replica's record: for stacks and top)
            directory = ipc_dir(address)
            record = read_engine_file(directory) or {}
            write_engine_file(directory, {**record, "http": url})


async def _watch(monitor: EngineMonitor, notifier: Notifier, model: str, interval: float) -> None:
    """Ping the watchdog only while the pipeline is healthy; keep STATUS= current; log the
    engine's throughput now and then while it works."""
    stats_log = StatsLog()
    loop = asyncio.get_running_loop()
    while True:
        stats = await monitor.poll()
        if monitor.problem() is None or monitor.recovering:  # (a restart takes seconds)
            notifier.watchdog()
        notifier.status(monitor.status(model))
        if stats is not None and (line := stats_log.line(stats, loop.time())):
            logger.info("%s", line)
        await asyncio.sleep(interval)


async def _drain(state: ServerState, engine: Any, timeout: float) -> None:
    """Refuse new requests, let the admitted ones finish until ``timeout``, abort the rest."""
    state.draining = state.monitor.draining = True
    engine.stop_admitting()
    if not await _until_idle(state, timeout):
        logger.warning("drain timeout: aborting what is still running")
        engine.abort_unfinished()
        await _until_idle(state, ABORT_GRACE_S)


async def _until_idle(state: ServerState, timeout: float) -> bool:
    """Wait until no HTTP request is open and the engine (IPC clients too) has nothing left;
    whether that happened within ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if state.num_inflight == 0:
            stats = await state.monitor.poll()
            if stats is not None and not has_work(stats):
                return True
        await asyncio.sleep(POLL_S)
    return False
