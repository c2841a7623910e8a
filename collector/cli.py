"""`stepscope collector`: receive OTLP/HTTP into ClickHouse and serve the read-only query API."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import sys

from collector.config import CollectorConfig

_SKIP = {"store", "host", "port", "token", "spool", "config"}  # spelled out below with their short forms


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags for every CollectorConfig field; defaults come from the dataclass."""
    defaults = CollectorConfig()
    helps = CollectorConfig.field_help()
    parser.add_argument("--store", default=defaults.store, metavar="DSN", help=helps["store"])
    parser.add_argument("--host", default=defaults.host, help=helps["host"])
    parser.add_argument("--port", type=int, default=defaults.port, help=helps["port"])
    parser.add_argument(
        "--token",
        default=os.environ.get("STEPSCOPE_TOKEN"),
        metavar="T",
        help=helps["token"] + " (or $STEPSCOPE_TOKEN)",
    )
    parser.add_argument("--spool", default=None, metavar="DIR", help=helps["spool"])
    parser.add_argument("--config", default=None, metavar="PATH", help=helps["config"])
    for f in dataclasses.fields(CollectorConfig):
        if f.name in _SKIP:
            continue
        flag = "--" + f.name.replace("_", "-")
        parser.add_argument(
            flag,
            type=type(getattr(defaults, f.name)),
            default=getattr(defaults, f.name),
            dest=f.name,
            help=helps[f.name],
        )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument(
        "--alert-rules",
        default=None,
        metavar="PATH",
        help="evaluate these alert rules (TOML, docs/alerts.md) on the stored requests",
    )


def run(args: argparse.Namespace) -> int:
    """Start the collector and serve until interrupted."""
    from stepscope.cli import UsageError

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(CollectorConfig)}
    try:
        config = CollectorConfig(**values)
    except ValueError as e:
        raise UsageError(str(e)) from None
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    import uvicorn

    from collector.server import create_app
    from collector.store import StoreError, redact

    background = []
    if getattr(args, "alert_rules", None):
        from alerting.embedded import start_in_collector
        from alerting.rules import RuleError, load_rules

        try:
            ruleset = load_rules(args.alert_rules)
        except RuleError as e:
            raise UsageError(str(e)) from None
        background.append(functools.partial(start_in_collector, ruleset))
    app = create_app(config, background=background)
    logging.getLogger(__name__).info(
        "collector on http://%s:%d, store %s, spool %s",
        config.host,
        config.port,
        redact(config.store),
        config.spool,
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=args.log_level,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=10,
        )
    )
    try:
        server.run()
    except StoreError as e:
        print(f"stepscope collector: {e}", file=sys.stderr)
        return 1
    return 0 if server.started else 1
