"""Starting a disaggregated deployment: `stepscope serve --disagg` (router + workers on this machine) and
`stepscope serve --role prefill|decode --router HOST:PORT` (one worker, here or on another host).

    stepscope serve --disagg --num-prefill 1 --num-decode 1 --model small --num-threads 2
      router process: HTTP front end on --port, worker registration on --worker-port (0: any free port)
      spawns `python -m engine.disagg.launch --options JSON` per worker; each worker gets
      num_threads // (P + D) torch threads (at least 1), the router imports no torch

Workers connect to the router; one spawned by the router dies with it (parent-death signal), one started
with `--role` reconnects after losing the router and registers again (a restarted worker rejoins).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from engine.config import EngineConfig

WORKER_STARTUP_S = 300.0  # a large checkpoint takes a while to load


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """The disaggregation options of `stepscope serve`."""
    group.add_argument("--disagg", action="store_true", help="router + prefill and decode worker processes")
    group.add_argument("--num-prefill", default="1", metavar="INT", help="prefill workers (default: 1)")
    group.add_argument("--num-decode", default="1", metavar="INT", help="decode workers (default: 1)")
    group.add_argument("--role", choices=("prefill", "decode"), help="run one worker that joins --router")
    group.add_argument("--router", metavar="HOST:PORT", help="the router's worker-registration address")
    group.add_argument(
        "--worker-port", default="0", metavar="INT", help="router: port workers register on (0: any free)"
    )
    group.add_argument("--kv-host", default="127.0.0.1", help="decode worker: address its KV port binds to")
    group.add_argument(
        "--kv-transfer-timeout", default="30", metavar="SECONDS", help="a KV transfer fails after this"
    )


def check_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """Validated disaggregation options; raises ValueError with a one-line reason."""
    out: dict[str, Any] = {}
    for name in ("num_prefill", "num_decode", "worker_port"):
        raw = str(getattr(args, name))
        if not raw.isdigit():
            raise ValueError(f"--{name.replace('_', '-')}: expected an integer, got {raw!r}")
        out[name] = int(raw)
    if args.disagg and (out["num_prefill"] < 1 or out["num_decode"] < 1):
        raise ValueError("--disagg needs at least one prefill and one decode worker")
    try:
        out["kv_timeout_s"] = float(args.kv_transfer_timeout)
    except ValueError:
        given = args.kv_transfer_timeout
        raise ValueError(f"--kv-transfer-timeout: expected seconds, got {given!r}") from None
    if args.role and not args.router:
        raise ValueError("--role needs --router HOST:PORT (the router's worker port)")
    if args.role and args.disagg:
        raise ValueError("--role and --disagg exclude each other")
    return out


def worker_threads(config: EngineConfig, num_workers: int) -> int:
    """Torch threads per worker: the cores split evenly (several processes on few cores contend)."""
    cores = config.num_threads or os.cpu_count() or 1
    return max(1, cores // num_workers)


# -- a worker ----------------------------------------------------------------------------------------
def run_worker(options: dict[str, Any]) -> int:
    """Load the model, connect to the router, serve until shut down (rejoining if `rejoin`)."""
    from engine.channel import Channel
    from engine.core import EngineCore
    from engine.core_proc import _die_with_parent, _load_sink
    from engine.disagg.kv_link import KVReceiver
    from engine.disagg.worker import WorkerLoop, abort_all, worker_info
    from engine.protocol import Codec, Ready

    if options.get("spawned"):
        _die_with_parent()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; the router decides
    signal.signal(signal.SIGTERM, _exit)
    role, router = options["role"], options["router"]
    config = EngineConfig(**options["engine"])
    sink = _load_sink(options.get("event_sink"), options)
    core = EngineCore(config, record_events=sink is not None)
    receiver = KVReceiver(options.get("kv_host", "127.0.0.1")) if role == "decode" else None
    instance = f"{socket.gethostname()}:{os.getpid()}"
    loop = None
    while True:
        sock = _connect(router, None if options.get("rejoin") else 60.0)
        channel = Channel(sock, Codec())
        if loop is None:
            timeout = options["kv_timeout_s"]
            loop = WorkerLoop(core, channel, role, sink, receiver=receiver, kv_timeout_s=timeout)
        loop.channel = channel
        channel.send(Ready(worker_info(loop, instance)))
        print(f"stepscope worker: {role} {instance} registered with {router}", file=sys.stderr, flush=True)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the router went away
            loop.run()
        sock.close()
        if loop.stopping or not options.get("rejoin"):
            return 0
        print("stepscope worker: lost the router; rejoining", file=sys.stderr, flush=True)
        abort_all(loop)


def _connect(router: str, timeout_s: float | None) -> socket.socket:
    host, _, port = router.removeprefix("tcp://").rpartition(":")
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        try:
            return socket.create_connection((host, int(port)), timeout=5)
        except OSError as e:
            if deadline is not None and time.monotonic() > deadline:
                raise SystemExit(f"stepscope worker: cannot reach the router at {router}: {e}") from None
            time.sleep(0.5)


def _exit(signum: int, frame: object) -> None:
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    """`python -m engine.disagg.launch --options JSON`: a worker spawned by the router."""
    p = argparse.ArgumentParser(prog="engine.disagg.launch")
    p.add_argument("--options", required=True, help="JSON: role, router, engine config, telemetry")
    return run_worker(json.loads(p.parse_args(argv).options))


# -- the router --------------------------------------------------------------------------------------
def spawn_workers(
    config: EngineConfig, router: str, dis: dict[str, Any], tele: dict[str, Any] | None, kv_host: str
) -> list[subprocess.Popen]:
    """Start the prefill and decode worker processes of `--disagg`."""
    from instrumentation.config import CORE_SINK

    num = dis["num_prefill"] + dis["num_decode"]
    engine = dataclasses.asdict(dataclasses.replace(config, num_threads=worker_threads(config, num)))
    procs = []
    for role in ["prefill"] * dis["num_prefill"] + ["decode"] * dis["num_decode"]:
        options = {
            "role": role,
            "router": router,
            "engine": engine,
            "kv_host": kv_host,
            "kv_timeout_s": dis["kv_timeout_s"],
            "spawned": True,
            "event_sink": CORE_SINK if tele else None,
            "telemetry": {**tele, "role": role, "instance_id": ""} if tele else None,
        }
        cmd = [sys.executable, "-m", "engine.disagg.launch", "--options", json.dumps(options)]
        procs.append(subprocess.Popen(cmd))
    return procs


async def serve_router(
    config: EngineConfig,
    settings: object,
    listener: socket.socket,
    dis: dict[str, Any],
    tele: dict[str, Any] | None,
    kv_host: str,
) -> int:
    """Listen for workers, spawn them, wait until all registered, then serve HTTP with the router client
    behind the OpenAI front end. Stops the workers however it ends."""
    import uvicorn

    from engine.disagg.router import DisaggClient
    from engine.server import build_app

    host = listener.getsockname()[0]
    client = DisaggClient(host, dis["worker_port"], kv_timeout_s=dis["kv_timeout_s"])
    await client.start()
    procs = spawn_workers(config, f"{host}:{client.port}", dis, tele, kv_host)
    try:
        waiter = asyncio.ensure_future(
            client.wait_for_workers(dis["num_prefill"], dis["num_decode"], WORKER_STARTUP_S)
        )
        while not waiter.done():
            await asyncio.sleep(0.2)
            dead = [p for p in procs if p.poll() is not None]
            if dead:
                waiter.cancel()
                code = dead[0].returncode
                print(f"stepscope serve: a worker exited during startup ({code})", file=sys.stderr)
                return 1
        waiter.result()
        info = client.info
        print(
            f"stepscope serve: router for {settings.served_model_name} ({info['device']} {info['dtype']}, "
            f"{info['num_kv_blocks']} KV blocks per worker, {dis['num_prefill']} prefill + "
            f"{dis['num_decode']} decode workers); workers register on {host}:{client.port}; "
            f"listening on http://{host}:{listener.getsockname()[1]}",
            file=sys.stderr,
            flush=True,
        )
        app = build_app(None, settings, lambda reason: None, client=client)
        uv_config = uvicorn.Config(
            app, log_level="info", access_log=False, timeout_graceful_shutdown=5, lifespan="on"
        )
        server = uvicorn.Server(uv_config)
        await server.serve(sockets=[listener])
        return 0
    finally:
        await client.close()
        stop_workers(procs)


def stop_workers(procs: list[subprocess.Popen], timeout_s: float = 10.0) -> None:
    """SIGTERM every worker, wait, SIGKILL the ones that will not go."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


if __name__ == "__main__":
    sys.exit(main())
