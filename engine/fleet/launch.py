"""`stepscope serve --replicas N`: N replica servers on this machine behind one router process.

    stepscope serve --replicas 3 --routing prefix_aware --model tiny --port 8000
      router (this process, no torch): HTTP on --port, the `route` span, the policy (routing.py)
      replica i: `stepscope serve` on 127.0.0.1:<free port>, its own core process, KV cache and prefix
                 cache, service.instance.id `<host>:<i>` (or the i-th of --instance-id A,B,C),
                 num_threads // N torch threads; with --disagg each replica is itself a router over
                 its prefill and decode workers

A replica dies with the router (parent-death signal); the router stops them all however it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import socket
import subprocess
import sys
import time

import httpx

from engine.config import PRESETS, EngineConfig
from engine.disagg.launch import stop_workers, worker_threads

REPLICA_STARTUP_S = 300.0
_SERVER_OPTIONS = ("served_model_name", "otlp_endpoint", "trace_steps_every")  # passed on as given
_DISAGG_OPTIONS = ("num_prefill", "num_decode", "kv_host", "kv_transfer_timeout")


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """The fleet options of `stepscope serve`."""
    from engine.fleet.routing import POLICIES, RoutingConfig

    group.add_argument(
        "--replicas", metavar="INT", help="serve N replicas behind a router (default: one server, no router)"
    )
    group.add_argument(
        "--routing",
        default=RoutingConfig.__dataclass_fields__["policy"].default,
        metavar="|".join(POLICIES),
        help="how the router picks a replica (default: %(default)s)",
    )


def instance_ids(given: str | None, num_replicas: int) -> list[str]:
    """Stable replica ids: the given comma-separated list, or `<host>:<i>`; ValueError on a bad list."""
    if not given:
        return [f"{socket.gethostname()}:{i}" for i in range(num_replicas)]
    ids = [s.strip() for s in given.split(",")]
    if len(ids) != num_replicas or not all(ids) or len(set(ids)) != len(ids):
        raise ValueError(
            f"--instance-id: expected {num_replicas} distinct comma-separated ids, got {given!r}"
        )
    return ids


def replica_argv(
    args: argparse.Namespace, config: EngineConfig, port: int, instance: str, threads: int
) -> list[str]:
    """`stepscope serve` options of one replica: the engine config as given, the server's options."""
    argv = ["--host", "127.0.0.1", "--port", str(port), "--instance-id", instance]
    default = EngineConfig()
    for f in dataclasses.fields(EngineConfig):
        value = threads if f.name == "num_threads" else getattr(config, f.name)
        if value == getattr(default, f.name) and f.name != "num_threads":
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    for name in _SERVER_OPTIONS:
        if getattr(args, name, None) is not None:
            argv += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    if args.disagg:
        argv.append("--disagg")
        for name in _DISAGG_OPTIONS:
            argv += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return argv


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parent_death() -> None:  # in the child, before exec
    from engine.core_proc import _die_with_parent

    _die_with_parent()


def spawn_replicas(
    args: argparse.Namespace, config: EngineConfig, ids: list[str], admin_token: str | None
) -> list[tuple[str, str, subprocess.Popen]]:
    """Start the replica servers: (instance, url, process) each."""
    threads = worker_threads(config, len(ids))
    env = dict(os.environ)
    # Each replica is its own instance: a service.instance.id in OTEL_RESOURCE_ATTRIBUTES (which wins over
    # the server's own) would make them one; the router's own resource keeps it.
    attrs = [a for a in env.get("OTEL_RESOURCE_ATTRIBUTES", "").split(",") if a.strip()]
    kept = [a for a in attrs if a.split("=", 1)[0].strip() != "service.instance.id"]
    if len(kept) != len(attrs):
        env["OTEL_RESOURCE_ATTRIBUTES"] = ",".join(kept)
    if admin_token:
        env["STEPSCOPE_ADMIN_TOKEN"] = admin_token  # not on the command line, where `ps` shows it
    out = []
    for instance in ids:
        port = _free_port()
        cmd = [
            sys.executable,
            "-m",
            "stepscope",
            "serve",
            *replica_argv(args, config, port, instance, threads),
        ]
        proc = subprocess.Popen(cmd, env=env, preexec_fn=_parent_death)
        out.append((instance, f"http://127.0.0.1:{port}", proc))
    return out


async def wait_ready(replicas: list[tuple[str, str, subprocess.Popen]], timeout_s: float) -> None:
    """Until every replica's /health answers 200; RuntimeError when one exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    pending = list(replicas)
    async with httpx.AsyncClient(timeout=2.0) as http:
        while pending:
            for item in list(pending):
                instance, url, proc = item
                if proc.poll() is not None:
                    raise RuntimeError(f"replica {instance} exited during startup ({proc.returncode})")
                try:
                    if (await http.get(url + "/health")).status_code == 200:
                        pending.remove(item)
                except httpx.TransportError:
                    pass
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"{len(pending)} replicas not ready after {timeout_s:g} s")
            await asyncio.sleep(0.3)


def tokenizer_for(model: str) -> object:
    """The replicas' tokenizer, without loading the model (the router imports no torch)."""
    import json
    from pathlib import Path

    from engine.tokenizer import get_tokenizer

    if model in PRESETS:
        return get_tokenizer(model, PRESETS[model].vocab_size)
    cfg = json.loads((Path(model) / "config.json").read_text())
    return get_tokenizer(model, int(cfg.get("vocab_size", 0)))


async def serve_fleet(
    args: argparse.Namespace,
    config: EngineConfig,
    settings: object,
    listener: socket.socket,
    ids: list[str],
    tracer: object | None,
) -> int:
    """Start the replicas, wait until all are ready, serve the router until stopped; stops them all."""
    import uvicorn

    from engine.fleet.router import FleetRouter, FleetSettings, build_router_app
    from engine.fleet.routing import Replica, Router, RoutingConfig

    started = spawn_replicas(args, config, ids, settings.admin_token)
    procs = [p for _, _, p in started]
    try:
        await wait_ready(started, REPLICA_STARTUP_S)
        replicas = [Replica(i, url, pid=p.pid) for i, url, p in started]
        router = Router(replicas, RoutingConfig(policy=args.routing, seed=config.seed))
        fleet_settings = FleetSettings(
            settings.served_model_name, config.block_size, settings.admin_token, {i: p for i, _, p in started}
        )
        fleet = FleetRouter(router, tokenizer_for(config.model), fleet_settings, tracer)
        print(
            f"stepscope serve: router over {len(ids)} replicas of {settings.served_model_name} "
            f"({args.routing}): {', '.join(ids)}; listening on http://{args.host}:{listener.getsockname()[1]}",
            file=sys.stderr,
            flush=True,
        )
        app = build_router_app(fleet)
        uv = uvicorn.Config(
            app, log_level="info", access_log=False, timeout_graceful_shutdown=5, lifespan="on"
        )
        await uvicorn.Server(uv).serve(sockets=[listener])
        return 0
    except RuntimeError as e:
        print(f"stepscope serve: {e}", file=sys.stderr)
        return 1
    finally:
        stop_workers(procs)
