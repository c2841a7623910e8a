"""`stepscope serve`: the engine core process plus the OpenAI-compatible HTTP front end.

Engine options are generated from the `EngineConfig` dataclass (name -> `--kebab-case`, type from
the default, help from the field metadata), so a default lives only there. Values are converted
here rather than by argparse so a bad one is a one-line `UsageError` (exit 2).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import socket
import sys
import typing
from pathlib import Path

from engine.config import PRESETS, EngineConfig
from engine.disagg import launch
from engine.fleet import launch as fleet_launch
from instrumentation.config import CORE_SINK, STEPS_EVERY_ENV, TelemetryConfig, telemetry_config
from stepscope.cli import UsageError

if typing.TYPE_CHECKING:  # heavy imports wait until `run`, so `--help` stays fast
    from engine.core_client import CoreProcess
    from engine.server import ServerSettings

ADMIN_TOKEN_ENV = "STEPSCOPE_ADMIN_TOKEN"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine options from `EngineConfig`, then the server's own."""
    engine = parser.add_argument_group("engine (EngineConfig)")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{f.metadata.get('help', '')} (default: {f.default})"
        if f.metadata.get("runtime"):
            help_text += "; changeable at run time via /admin/limits"
        if isinstance(f.default, bool):
            engine.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
            continue
        choices = typing.get_args(hints[f.name]) if typing.get_origin(hints[f.name]) is typing.Literal else ()
        metavar = "|".join(choices) if choices else type(f.default).__name__.upper()
        if f.name == "model":
            metavar = f"{'|'.join(PRESETS)}|PATH"
        engine.add_argument(flag, default=None, metavar=metavar, help=help_text)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    server.add_argument(
        "--port", default="8000", metavar="INT", help="port to listen on (default: %(default)s)"
    )
    server.add_argument("--served-model-name", help="model id in the API (default: the --model value)")
    server.add_argument(
        "--instance-id",
        help="service.instance.id of this server (default: host:port); with --replicas N, N comma-separated "
        "ids (default: host:0 .. host:N-1)",
    )
    server.add_argument(
        "--admin-token",
        help=f"bearer token of /admin/limits (default: ${ADMIN_TOKEN_ENV}; unset: admin disabled)",
    )
    server.add_argument(
        "--otlp-endpoint",
        help="OTLP endpoint (base URL) for traces and metrics; turns tracing on "
        "(default: $OTEL_EXPORTER_OTLP_ENDPOINT; docs/spans.md)",
    )
    server.add_argument(
        "--trace-steps-every",
        metavar="INT",
        help=f"export one engine.step span in N, 0 for none (default: ${STEPS_EVERY_ENV} or "
        f"{TelemetryConfig.__dataclass_fields__['steps_every'].default})",
    )
    launch.add_arguments(parser.add_argument_group("disaggregated serving (docs/disagg.md)"))
    fleet_launch.add_arguments(parser.add_argument_group("fleet: replicas behind a router (docs/fleet.md)"))


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The `EngineConfig` of the given options; raises UsageError on a bad value."""
    hints = typing.get_type_hints(EngineConfig)
    values: dict[str, object] = {}
    for f in dataclasses.fields(EngineConfig):
        raw = getattr(args, f.name, None)
        if raw is not None:
            values[f.name] = _convert(f.name, raw, type(f.default), hints[f.name])
    try:
        config = EngineConfig(**values)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if config.model not in PRESETS and not Path(config.model).is_dir():
        raise UsageError(
            f"--model: {config.model!r} is neither a preset ({', '.join(PRESETS)}) nor a directory"
        )
    return config


def _convert(name: str, raw: object, kind: type, hint: object) -> object:
    flag = "--" + name.replace("_", "-")
    if kind is bool:
        return raw
    choices = typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else ()
    if choices and raw not in choices:
        raise UsageError(f"{flag}: expected one of {', '.join(choices)}, got {raw!r}")
    try:
        return kind(raw)
    except ValueError:
        raise UsageError(
            f"{flag}: expected {'an integer' if kind is int else kind.__name__}, got {raw!r}"
        ) from None


def run(args: argparse.Namespace) -> int:
    """Start the core process, wait until the model is loaded, serve HTTP until SIGTERM/SIGINT."""
    from engine.core_client import CoreStartupError, start_core_process
    from engine.server import ServerSettings

    config = engine_config(args)
    try:
        dis = launch.check_arguments(args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.role and args.replicas is not None:
        raise UsageError("--role and --replicas exclude each other")
    if args.role:
        return _run_worker(args, config, dis)
    if args.replicas is not None:
        return _run_fleet(args, config)
    settings = ServerSettings(
        served_model_name=args.served_model_name or config.model,
        max_waiting=config.max_waiting,
        admin_token=args.admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None,
        otlp_endpoint=args.otlp_endpoint,
    )
    listener = _listen(args.host, args.port)  # before the model loads: a busy port fails fast
    role = "router" if args.disagg else "colocated"
    tele = _telemetry(args, config, settings.served_model_name, listener, role)
    settings.telemetry = tele[1] if tele else None
    signal.signal(signal.SIGTERM, _terminate)
    if args.disagg:
        return _run_router(args, config, settings, listener, dis, tele)
    try:
        core = start_core_process(
            config,
            event_sink=CORE_SINK if tele else None,  # no sink: the core records no events at all
            extra={"otlp_endpoint": args.otlp_endpoint, "telemetry": tele[0].to_dict() if tele else None},
        )
    except CoreStartupError as e:
        print(f"stepscope serve: the engine core failed to start: {e}", file=sys.stderr)
        listener.close()
        _close_telemetry(settings)
        return 1
    except _Terminated:
        _close_telemetry(settings)
        return 0
    info = core.ready.info
    print(
        f"stepscope serve: {settings.served_model_name} ready on {info['device']} {info['dtype']}, "
        f"max_model_len {info['max_model_len']}, {info['num_kv_blocks']} KV blocks of {info['block_size']}; "
        f"listening on http://{args.host}:{listener.getsockname()[1]}",
        file=sys.stderr,
        flush=True,
    )
    try:
        return asyncio.run(_serve(core, settings, listener))
    except _Terminated:
        return 0
    finally:
        core.stop()
        listener.close()
        _close_telemetry(settings)


def _telemetry(
    args: argparse.Namespace,
    config: EngineConfig,
    model: str,
    listener: socket.socket,
    role: str = "colocated",
) -> tuple[TelemetryConfig, object] | None:
    """(settings, the front end's RequestTracer) when tracing is on; None when off (OpenTelemetry is
    then never imported). A bad setting is a UsageError."""
    steps_every = getattr(args, "trace_steps_every", None)
    port = listener.getsockname()[1]
    try:
        if steps_every is not None and not str(steps_every).isdigit():
            raise ValueError(f"--trace-steps-every: expected an integer, got {steps_every!r}")
        tele = telemetry_config(
            args.otlp_endpoint,
            model=model,
            instance_id=getattr(args, "instance_id", None) or f"{socket.gethostname()}:{port}",
            steps_every=int(steps_every) if steps_every is not None else None,
        )
        if tele is None:
            return None
        tele.role = role
        from instrumentation.request_spans import open_frontend

        return tele, open_frontend(tele)
    except ValueError as e:  # TelemetryError is one
        listener.close()
        raise UsageError(str(e)) from None


def _run_router(
    args: argparse.Namespace,
    config: EngineConfig,
    settings: ServerSettings,
    listener: socket.socket,
    dis: dict[str, object],
    tele: tuple[TelemetryConfig, object] | None,
) -> int:
    """`--disagg`: the router (this process) and its workers (engine/disagg/launch.py)."""
    worker_tele = dict(tele[0].to_dict(), endpoint=args.otlp_endpoint) if tele else None
    try:
        return asyncio.run(launch.serve_router(config, settings, listener, dis, worker_tele, args.kv_host))
    except _Terminated:
        return 0
    finally:
        listener.close()
        _close_telemetry(settings)


def _run_fleet(args: argparse.Namespace, config: EngineConfig) -> int:
    """`--replicas N`: the router (this process) over N replica servers (engine/fleet/launch.py)."""
    from engine.fleet.routing import RoutingConfig
    from engine.server import ServerSettings

    raw = str(args.replicas)
    if not raw.isdigit() or int(raw) < 1:
        raise UsageError(f"--replicas: expected a positive integer, got {raw!r}")
    try:
        RoutingConfig(policy=args.routing)
        ids = fleet_launch.instance_ids(args.instance_id, int(raw))
    except ValueError as e:
        raise UsageError(str(e)) from None
    settings = ServerSettings(
        served_model_name=args.served_model_name or config.model,
        max_waiting=config.max_waiting,
        admin_token=args.admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None,
        otlp_endpoint=args.otlp_endpoint,
    )
    listener = _listen(args.host, args.port)
    tracer = None
    try:
        tele = telemetry_config(
            args.otlp_endpoint,
            model=settings.served_model_name,
            instance_id=f"{socket.gethostname()}:{listener.getsockname()[1]}",
        )
        if tele is not None:
            tele.role = "router"
            from instrumentation.route_spans import open_router

            tracer = open_router(tele)
    except ValueError as e:
        listener.close()
        raise UsageError(str(e)) from None
    signal.signal(signal.SIGTERM, _terminate)
    try:
        return asyncio.run(fleet_launch.serve_fleet(args, config, settings, listener, ids, tracer))
    except _Terminated:
        return 0
    finally:
        listener.close()
        if tracer is not None:
            tracer.shutdown()


def _run_worker(args: argparse.Namespace, config: EngineConfig, dis: dict[str, object]) -> int:
    """`--role prefill|decode --router HOST:PORT`: one worker that registers (and re-registers)."""
    try:
        tele = telemetry_config(args.otlp_endpoint, model=args.served_model_name or config.model)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if tele is not None:
        tele.role = args.role
    options = {
        "role": args.role,
        "router": args.router,
        "engine": dataclasses.asdict(config),
        "kv_host": args.kv_host,
        "kv_timeout_s": dis["kv_timeout_s"],
        "rejoin": True,
        "event_sink": CORE_SINK if tele else None,
        "telemetry": tele.to_dict() if tele else None,
    }
    return launch.run_worker(options)


def _close_telemetry(settings: ServerSettings) -> None:
    if settings.telemetry is not None:
        settings.telemetry.telemetry.shutdown()


class _Terminated(BaseException):
    """SIGTERM: unwind so the core process is stopped by the `finally` that owns it."""


def _terminate(signum: int, frame: object) -> None:
    # The first SIGTERM unwinds; another one while the core is being stopped (a process group's stop
    # reaches every member) would cut that cleanup short with a traceback, so later ones are ignored.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise _Terminated()


def _listen(host: str, port_text: str) -> socket.socket:
    if not str(port_text).isdigit() or not 0 <= int(port_text) <= 65535:
        raise UsageError(f"--port: expected a port number, got {port_text!r}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # A streamed response's headers and first token are separate writes: with Nagle on, the token waits
    # for the client's delayed ACK of the headers. Accepted sockets inherit the option on Linux.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, int(port_text)))
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port_text}: {e.strerror or e}") from None
    sock.listen(2048)
    return sock


async def _serve(core: CoreProcess, settings: ServerSettings, listener: socket.socket) -> int:
    import uvicorn

    from engine.server import build_app

    core_gone: list[str] = []

    def on_core_exit(reason: str) -> None:
        core_gone.append(reason)
        server.should_exit = True

    app = build_app(core, settings, on_core_exit)
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="info", access_log=False, timeout_graceful_shutdown=5, lifespan="on")
    )
    await server.serve(sockets=[listener])
    if core_gone:
        print(f"stepscope serve: {core_gone[0]}", file=sys.stderr)
        return 1
    return 0
